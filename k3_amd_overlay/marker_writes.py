"""When and where a process's marker is written: into the marker directory (an unusable one is
recorded, never raised), each write atomic, a state change at once, run counts when due (at the
counts ``run_counts`` names, or once ``MARKER_INTERVAL_S`` has passed since the last write)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from k3_amd_overlay import log_lines, markers
from k3_amd_overlay.record import MarkerRecord

MARKER_INTERVAL_S = 2.0  # run counts reach the marker at most this long after the last write


class MarkerWriter:
    """The marker of one process in ``marker_dir``; ``error`` says why none is written."""

    def __init__(self, marker_dir: str | None) -> None:
        self.path: Path | None = None
        self.error: str | None = None
        self._directory: Path | None = None
        self._last_write = 0.0
        try:
            self._directory = markers.ensure_marker_dir(marker_dir)
        except markers.MarkerDirError as exc:
            self.error = str(exc)

    def due(self) -> bool:
        """Whether ``MARKER_INTERVAL_S`` has passed since the last write."""
        return time.monotonic() - self._last_write >= MARKER_INTERVAL_S

    def write(self, record: MarkerRecord) -> None:
        """``record``, stamped now, as this process's marker; a failure is recorded and warned about
        once: serving must never fail over evidence. A failed write voids the last marker (its record
        is what the process was, not what it is: a state change since, a refusal, would not reach it),
        so ``check`` fails on this process rather than trust it; the next write that succeeds restores it."""
        record.updated = time.time()
        self._last_write = time.monotonic()
        if self._directory is None:
            return
        try:
            self.path = markers.write_marker(self._directory, record.pid, record.to_json())
        except OSError as exc:
            voided = markers.void_marker(self._directory, record.pid)
            if self.error is None:
                self.error = f"marker write failed in {self._directory}: {exc}; {voided}"
                log_lines.emit(logging.WARNING, f"k3-amd-overlay: {self.error}")

    def forget_path(self) -> None:
        """In a forked child: the parent's marker is not this process's."""
        self.path = None

    def stop(self) -> None:
        """Write nothing more (the directory is about to be removed)."""
        self._directory = None
