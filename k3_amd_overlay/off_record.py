"""The evidence a process leaves with the overlay off: one small marker (mode ``off``, pid, start
time, role, versions), so that ``check --expect off`` holds on a live process that loaded the
plugin and patched nothing, never on the absence of everything.

Cheap and side-effect free beyond that one file: no wrapt, no vLLM import, nothing patched. A
process forked from one that left an off record (vLLM's fork start method) leaves its own. An
unusable marker directory is warned about once per process and never stops vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import time

from k3_amd_overlay import log_lines, markers
from k3_amd_overlay.evidence import process_record
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.package import FUSIONS
from k3_amd_overlay.record import FusionEntry, MarkerRecord
from k3_amd_overlay.settings import SWITCH, OverlaySettings


class _OffState:
    """This process's off record and where it goes (a module-level instance: multiprocessing's
    after-fork registry holds it weakly)."""

    settings: OverlaySettings | None = None
    record: MarkerRecord | None = None
    warned = False
    hooked = False


_state = _OffState()


def build(settings: OverlaySettings) -> MarkerRecord:
    """This process's off record, read now (its pid, start time, role, process name)."""
    reason = f"overlay off ({SWITCH}={settings.raw!r})"
    return process_record(settings, {f: FusionEntry(FusionState.DISABLED, reason=reason) for f in FUSIONS},
                          updated=time.time())


def leave(settings: OverlaySettings) -> MarkerRecord:
    """Write this process's off record; a forked child will write its own."""
    _state.settings = settings
    if not _state.hooked:
        _state.hooked = True
        os.register_at_fork(after_in_child=_after_fork)
        # multiprocessing names its child only after the fork hooks: the role is rewritten then.
        multiprocessing.util.register_after_fork(_state, lambda _: _write())
    return _write()


def current() -> MarkerRecord | None:
    """The off record this process left (None where the overlay is on, or the plugin never ran)."""
    return _state.record


def _after_fork() -> None:
    _state.warned = False  # the child's own warning, once
    _write()


def _write() -> MarkerRecord:
    assert _state.settings is not None
    record = _state.record = build(_state.settings)
    try:
        directory = markers.ensure_marker_dir(_state.settings.marker_dir)
        markers.write_marker(directory, record.pid, record.to_json())
    except (OSError, markers.MarkerDirError) as exc:  # serving must never fail over evidence
        if not _state.warned:
            _state.warned = True
            log_lines.emit(logging.WARNING, "k3-amd-overlay: WARNING: the overlay is off, but this process writes no "
                                            f"off record, so `k3-amd-overlay check --expect off` cannot see it: {exc}")
    return record
