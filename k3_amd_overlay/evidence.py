"""What this process proves about itself: one record per process (versions, mode, vLLM shape,
per-fusion state, provider, reason, and whether a fused path has actually run), published as
one log line through the ``vllm`` logger hierarchy and as a JSON marker file. The record's run
counts are kept by ``run_counts``, its writes timed by ``marker_writes``, and its life in forked
and exiting processes followed through ``process_hooks``."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3_amd_overlay import log_lines, markers, process_hooks
from k3_amd_overlay.fusions.states import FUSED_STATES, FusionState, LayerDecision
from k3_amd_overlay.marker_writes import MarkerWriter
from k3_amd_overlay.package import FUSIONS, __version__
from k3_amd_overlay.process_identity import process_role
from k3_amd_overlay.record import FusionEntry, LayerTally, MarkerRecord
from k3_amd_overlay.run_counts import RunCounter
from k3_amd_overlay.settings import Mode, OverlaySettings
from k3_amd_overlay.versions import installed_vllm_version


def process_record(settings: OverlaySettings, fusions: dict[str, FusionEntry], **fields: Any) -> MarkerRecord:
    """A record of this process as it is now (pid, start time, role, process name, versions, switch)
    in ``settings``' mode, with ``fusions`` and any further ``fields``."""
    pid = os.getpid()
    return MarkerRecord(
        pid=pid,
        mode=settings.mode,
        fusions=fusions,
        start_ticks=markers.process_start_ticks(pid),
        boot_id=markers.boot_id(),
        role=process_role(),
        process_name=multiprocessing.current_process().name,
        overlay_version=__version__,
        vllm_version=installed_vllm_version(),
        switch=settings.raw,
        strict=settings.strict,
        **fields,
    )


class Evidence:
    """The record of one process. Thread-safe; every change is written out atomically."""

    def __init__(self, settings: OverlaySettings, shape: str | None = None) -> None:
        self.lock = threading.Lock()
        self.record = process_record(
            settings, {f: FusionEntry(self._initial_state(settings, f), reason=self._initial_reason(settings, f))
                       for f in FUSIONS}, vllm_shape=shape)
        self._forked = False
        self._world_reader: Callable[[], tuple[int, int, int | None] | None] | None = None
        self._writer = MarkerWriter(settings.marker_dir)
        self._counts = RunCounter(self)
        process_hooks.after_fork_in_child(self, Evidence._after_fork)

    @property
    def marker_path(self) -> Path | None:
        return self._writer.path

    @property
    def marker_error(self) -> str | None:
        return self._writer.error

    def _after_fork(self) -> None:
        """In a forked child: its own pid, start time and role; the parent's run counts dropped (the
        states and layer tallies stay: the child holds the same patches and any layer already built)."""
        self.lock = threading.Lock()  # another thread may have held the parent's at fork
        self._forked = True
        record = self.record
        record.pid = os.getpid()
        record.start_ticks = markers.process_start_ticks(record.pid)
        # The parent's place in the world is not the child's, and vLLM's world state the child inherits
        # names the parent's rank: the child follows a world only once it builds a model itself.
        record.rank = record.world_size = record.nodes = None
        self._world_reader = None
        self._writer.forget_path()
        self._counts.start_in_child(list(record.fusions.values()))
        self._write()

    def _refresh_identity(self) -> None:
        """A forked child's role and process name, read at each write: multiprocessing names the
        child only after the fork hooks have run."""
        self.record.role = process_role()
        self.record.process_name = multiprocessing.current_process().name

    @staticmethod
    def _initial_state(settings: OverlaySettings, fusion: str) -> FusionState:
        if not settings.requested(fusion):
            return FusionState.DISABLED
        return FusionState.FORCED_STOCK if settings.mode is Mode.STOCK else FusionState.PENDING

    @staticmethod
    def _initial_reason(settings: OverlaySettings, fusion: str) -> str:
        if not settings.requested(fusion):
            return f"not requested by K3_AMD_OVERLAY={settings.raw!r}"
        if settings.mode is Mode.STOCK:
            return "stock mode"
        return "patched; decided per layer when K3 MLA layers are built"

    def fusion(self, name: str) -> FusionEntry:
        return self.record.fusions[name]

    def set_shape(self, shape: str | None, patches: list[str]) -> None:
        with self.lock:
            self.record.vllm_shape = shape
            self.record.patches = patches
            self._write()

    def set_coverage(self, coverage: dict[str, Any]) -> None:
        """What the process serves and what the overlay does not cover there (targets/vllm_env.py)."""
        with self.lock:
            self.record.coverage = coverage
            self._write()
        for gap in coverage.get("not_covered", []):
            log_lines.emit(logging.WARNING, f"k3-amd-overlay: not covered in this process: {gap}")

    def set_launch_configs(self, launch_configs: dict[str, Any]) -> None:
        """The GPU arch and where each kernel's launch configs come from (kernels/launch_configs.py)."""
        with self.lock:
            self.record.launch_configs = launch_configs
            self._write()

    def set_measurement(self, entry: dict[str, Any]) -> None:
        """This GPU's self-measurement and where it lets each fusion run (measured.marker_entry)."""
        with self.lock:
            self.record.measurement = entry
            self._write()

    def update_launch_configs(self, entries: dict[str, Any]) -> None:
        """Add to what ``set_launch_configs`` recorded: the configs degraded in this process and the
        seconds the ahead-of-time compile took (targets/installer.py)."""
        with self.lock:
            self.record.launch_configs = {**self.record.launch_configs, **entries}
            self._write()

    def set_upstream_defects(self, defects: list[dict[str, Any]]) -> None:
        """Known defects of this vLLM's own K3 code (targets/defects.py), and whether this
        process's environment triggers them."""
        with self.lock:
            self.record.upstream_defects = defects
            self._write()
        for defect in defects:
            if defect["triggered"] is not False:
                how = "triggers" if defect["triggered"] else f"may trigger ({defect['when']})"
                log_lines.emit(logging.WARNING, "k3-amd-overlay: this vLLM has a known defect that this environment "
                                                f"{how}, with or without the overlay: {defect['name']}: "
                                                f"{defect['what']}")

    def defect_outcome(self, name: str, fired: bool) -> None:
        """What building a layer showed of a defect whose trigger is decided per layer."""
        with self.lock:
            for defect in self.record.upstream_defects:
                if defect["name"] == name and defect["triggered"] is not True:
                    defect["triggered"] = fired
            self._write()

    def set_fusion(self, name: str, state: FusionState, reason: str, provider: str | None = None) -> None:
        with self.lock:
            entry = self.fusion(name)
            entry.state, entry.reason, entry.provider = state, reason, provider
            self._write()

    def follow_world(self, reader: Callable[[], tuple[int, int, int | None] | None]) -> None:
        """Record this process's rank, world size and node count as ``reader`` gives them
        (vllm_env.world_position) now and at every later write: a world that changes (vLLM's elastic
        expert parallelism rescales it) is the one recorded."""
        with self.lock:
            if self._world_reader is not reader:
                self._world_reader = reader
                self._write()

    def _read_world(self) -> None:
        position = self._world_reader() if self._world_reader is not None else None
        if position is not None:
            self.record.rank, self.record.world_size, self.record.nodes = position

    def note_layer(self, name: str, decision: LayerDecision) -> None:
        """A K3 MLA layer was built and decided: tally it by state (with that state's reason); the
        first decision sets the fusion's state, a later layer that decides differently makes it
        mixed (the tally says how many layers went which way)."""
        with self.lock:
            entry = self.fusion(name)
            summary = (decision.state, decision.provider, decision.reason)
            if entry.layers == 0:
                entry.state, entry.provider, entry.reason = summary
            elif summary != (entry.state, entry.provider, entry.reason):
                entry.reason = f"mixed across layers; latest: {decision.state.value} ({decision.reason})"
            entry.layers += 1
            tally = entry.layer_states.setdefault(decision.state, LayerTally())
            tally.layers += 1
            tally.reason = decision.reason
            self._write()

    def effective_hook(self, fusion: str, layer: str) -> Callable[[int], None]:
        """The hook of one layer's fused site (``run_counts.RunCounter.effective_hook``)."""
        return self._counts.effective_hook(fusion, layer)

    def write_counts(self, now: bool) -> None:
        """With the lock held: the marker rewritten if ``now``, or if a write is due anyway."""
        if now or self._writer.due():
            self._write()

    def stop_writing(self) -> None:
        """Write no more markers (the directory is about to be removed)."""
        self._writer.stop()

    def flush(self) -> None:
        with self.lock:
            self._write()

    def layer_summary(self) -> list[tuple[int, str]]:
        """Per requested fusion, how its layers were decided: (log level, line). A fusion requested
        but fused on no layer is a warning."""
        lines = []
        for name, entry in self.record.fusions.items():
            tallies = entry.layer_states
            if not tallies:
                continue
            total = entry.layers
            parts = [f"{state.value} on {t.layers}/{total} layers ({t.reason})" for state, t in tallies.items()]
            fused = sum(t.layers for state, t in tallies.items() if state in FUSED_STATES)
            level = logging.INFO
            text = f"{name}=" + "; ".join(parts)
            if self.record.mode is Mode.AUTO and FusionState.DISABLED not in tallies and fused == 0:
                level = logging.WARNING
                text += " -- requested but fused on no layer: this process runs it stock"
            elif entry.state is FusionState.REFUSED and FusionState.APPLIED in tallies:  # then a kernel failed
                level = logging.WARNING
                text += f" -- then refused: {entry.reason}: the overlay's launch runs on none of them"
            lines.append((level, text))
        return lines

    def publish_layers(self) -> None:
        """Log the layer summary once a model's layers are built (called per model built)."""
        prefix = f"k3-amd-overlay: pid={self.record.pid} role={self.record.role} layers built: "
        for level, line in self.layer_summary():
            log_lines.emit(level, prefix + line)

    def _write(self) -> None:
        if self._forked:
            self._refresh_identity()
        self._read_world()
        self._writer.write(self.record)

    def publish(self) -> None:
        with self.lock:
            self._write()
        log_lines.emit(logging.WARNING if self.marker_error else logging.INFO, self.summary_line())
        if self.marker_error:
            log_lines.emit(logging.WARNING, "k3-amd-overlay: WARNING: this process writes no marker, so "
                                            f"`k3-amd-overlay check` cannot see it: {self.marker_error}")

    def summary_line(self) -> str:
        r = self.record
        parts = [
            f"k3-amd-overlay {r.overlay_version}: pid={r.pid} role={r.role}",
            f"vllm={r.vllm_version} mode={r.mode.value} shape={r.vllm_shape}",
        ]
        for name, entry in r.fusions.items():
            provider = f" provider={entry.provider}" if entry.provider else ""
            parts.append(f"{name}={entry.state.value}{provider} ({entry.reason})")
        parts.append(f"marker={self.marker_path}" if self.marker_path else f"marker-error={self.marker_error}")
        return " | ".join(parts)
