"""What this process proves about itself: one record per process (versions, mode, vLLM shape,
per-fusion state, provider, reason, and whether a fused path has actually run), published as
one log line through the ``vllm`` logger hierarchy and as a JSON marker file."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3_amd_overlay import markers
from k3_amd_overlay.fusions.states import FUSED_STATES, FusionState, LayerDecision
from k3_amd_overlay.package import FUSIONS, __version__
from k3_amd_overlay.phases import Phase, capturing_graph, current_phase, replay_phase
from k3_amd_overlay.process_identity import process_role
from k3_amd_overlay.record import FusionEntry, LayerTally, MarkerRecord
from k3_amd_overlay.settings import Mode, OverlaySettings
from k3_amd_overlay.versions import installed_vllm_version

logger = logging.getLogger("vllm.k3_amd_overlay")
# Marker rewrites for run counts: at these counts, then at most every MARKER_INTERVAL_S seconds.
MARKER_INTERVAL_S = 2.0
REPLAY_COUNTED = "_k3_overlay_counted_fusions"  # on a CUDA graph instance: the fusions its replays count for


def process_record(settings: OverlaySettings, fusions: dict[str, FusionEntry], **fields: Any) -> MarkerRecord:
    """A record of this process as it is now (pid, start time, role, process name, versions, switch)
    in ``settings``' mode, with ``fusions`` and any further ``fields``."""
    pid = os.getpid()
    return MarkerRecord(
        pid=pid,
        mode=settings.mode,
        fusions=fusions,
        start_ticks=markers.process_start_ticks(pid),
        role=process_role(),
        process_name=multiprocessing.current_process().name,
        overlay_version=__version__,
        vllm_version=installed_vllm_version(),
        switch=settings.raw,
        strict=settings.strict,
        **fields,
    )



def register_exit_flush(flush: Callable[[], None]) -> None:
    """``flush`` when this process ends. multiprocessing's finalizers run at the interpreter's exit and
    also where multiprocessing ends a child it started with ``os._exit`` (vLLM's fork start method),
    where no ``atexit`` function runs; a finalizer inherited by a forked child is not run there (the
    child registers its own)."""
    multiprocessing.util.Finalize(None, flush, exitpriority=0)

class Evidence:
    """The record of one process. Thread-safe; every change is written out atomically."""

    def __init__(self, settings: OverlaySettings, shape: str | None = None) -> None:
        self._lock = threading.Lock()
        self.marker_path: Path | None = None
        self.marker_error: str | None = None
        self._directory: Path | None = None
        self._effective_layers: dict[str, set[str]] = {f: set() for f in FUSIONS}
        self._counting_layer: dict[str, str] = {}
        self._last_write = 0.0
        self._flush_registered = False
        self._generation = 0  # bumped in a forked child: the parent's first-run flags are not the child's
        self.record = process_record(
            settings, {f: FusionEntry(self._initial_state(settings, f), reason=self._initial_reason(settings, f))
                       for f in FUSIONS}, vllm_shape=shape)
        self._forked = False
        try:
            self._directory = markers.ensure_marker_dir(settings.marker_dir)
        except markers.MarkerDirError as exc:
            self.marker_error = str(exc)
        # A forked child (vLLM's fork start method: an offline LLM's engine core and workers) loads no
        # plugin again and would keep this record, pid and all: it becomes its own process's record.
        this = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (evidence := this()) is not None and evidence._after_fork())

    def _after_fork(self) -> None:
        """In a forked child: its own pid, start time and role; the parent's run counts dropped (the
        states and layer tallies stay: the child holds the same patches and any layer already built)."""
        self._lock = threading.Lock()  # another thread may have held the parent's at fork
        self._forked = True
        self._generation += 1
        self._effective_layers = {f: set() for f in FUSIONS}
        self._counting_layer = {}
        self._flush_registered = False
        record = self.record
        record.pid = os.getpid()
        record.start_ticks = markers.process_start_ticks(record.pid)
        self.marker_path = None
        for entry in record.fusions.values():
            entry.effective, entry.effective_layers = False, 0
            entry.runs = {phase: 0 for phase in entry.runs}
            entry.captured_sizes = []
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
        with self._lock:
            self.record.vllm_shape = shape
            self.record.patches = patches
            self._write()

    def set_coverage(self, coverage: dict[str, Any]) -> None:
        """What the process serves and what the overlay does not cover there (targets/vllm_env.py)."""
        with self._lock:
            self.record.coverage = coverage
            self._write()
        for gap in coverage.get("not_covered", []):
            _emit(logging.WARNING, f"k3-amd-overlay: not covered in this process: {gap}")

    def set_launch_configs(self, launch_configs: dict[str, Any]) -> None:
        """The GPU arch and where each kernel's launch configs come from (kernels/launch_configs.py)."""
        with self._lock:
            self.record.launch_configs = launch_configs
            self._write()

    def set_measurement(self, entry: dict[str, Any]) -> None:
        """This GPU's self-measurement and where it lets each fusion run (measured.marker_entry)."""
        with self._lock:
            self.record.measurement = entry
            self._write()

    def update_launch_configs(self, entries: dict[str, Any]) -> None:
        """Add to what ``set_launch_configs`` recorded: the configs degraded in this process and the
        seconds the ahead-of-time compile took (targets/installer.py)."""
        with self._lock:
            self.record.launch_configs = {**self.record.launch_configs, **entries}
            self._write()

    def set_upstream_defects(self, defects: list[dict[str, Any]]) -> None:
        """Known defects of this vLLM's own K3 code (targets/defects.py), and whether this
        process's environment triggers them."""
        with self._lock:
            self.record.upstream_defects = defects
            self._write()
        for defect in defects:
            if defect["triggered"] is not False:
                how = "triggers" if defect["triggered"] else f"may trigger ({defect['when']})"
                _emit(logging.WARNING, f"k3-amd-overlay: this vLLM has a known defect that this environment "
                                       f"{how}, with or without the overlay: {defect['name']}: {defect['what']}")

    def defect_outcome(self, name: str, fired: bool) -> None:
        """What building a layer showed of a defect whose trigger is decided per layer."""
        with self._lock:
            for defect in self.record.upstream_defects:
                if defect["name"] == name and defect["triggered"] is not True:
                    defect["triggered"] = fired
            self._write()

    def set_fusion(self, name: str, state: FusionState, reason: str, provider: str | None = None) -> None:
        with self._lock:
            entry = self.fusion(name)
            entry.state, entry.reason, entry.provider = state, reason, provider
            self._write()

    def note_layer(self, name: str, decision: LayerDecision) -> None:
        """A K3 MLA layer was built and decided: tally it by state (with that state's reason); the
        first decision sets the fusion's state, a later layer that decides differently makes it
        mixed (the tally says how many layers went which way)."""
        with self._lock:
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
        """A callable for one layer's fused site, given the batch's token count. Its first call
        records that the fused path ran on this layer. The first layer to run a fusion also counts
        every batch by phase (warm-up, graph capture with the captured size, served), so the
        counts are batches, not layer calls. No device work: safe under graph capture."""
        done_in = -1  # the generation (process) in which this layer's first run was recorded

        def mark(num_tokens: int) -> None:
            nonlocal done_in
            done = done_in == self._generation
            if done and self._counting_layer.get(fusion) != layer:
                return
            phase = current_phase()
            with self._lock:
                if not done:
                    done_in = self._generation
                    layers = self._effective_layers[fusion]
                    layers.add(layer)
                    entry = self.fusion(fusion)
                    entry.effective, entry.effective_layers = True, len(layers)
                    self._counting_layer.setdefault(fusion, layer)
                    force = True
                else:
                    force = False
                if self._counting_layer[fusion] == layer:
                    force = self._count(fusion, phase, num_tokens) or force
                    if phase is Phase.CAPTURE:
                        self._count_replays(capturing_graph(), fusion)
                if force or time.monotonic() - self._last_write >= MARKER_INTERVAL_S:
                    self._write()

        return mark

    def _count_replays(self, graph: Any, fusion: str) -> None:
        """Count each replay of ``graph`` (being captured with ``fusion``'s fused path in it) as a
        batch of that fusion: vLLM replays a graph by calling its ``replay`` from Python (both model
        runners, and a breakable capture's segments), so this one graph instance gets a ``replay``
        of its own that counts, then replays. Nothing else of torch or vLLM changes."""
        if graph is None:
            return
        fusions = graph.__dict__.get(REPLAY_COUNTED)
        if fusions is None:
            fusions = graph.__dict__[REPLAY_COUNTED] = []
            replay, this = type(graph).replay, weakref.ref(graph)  # no cycle: the graph frees as before

            def _k3_overlay_counted_replay() -> None:
                replay(this())
                self._replayed(fusions)

            graph.replay = _k3_overlay_counted_replay
        if fusion not in fusions:
            fusions.append(fusion)

    def _replayed(self, fusions: list[str]) -> None:
        phase = replay_phase()  # REPLAY only where a served step replays it
        with self._lock:
            force = False
            for fusion in fusions:
                force = self._count(fusion, phase, 0) or force
            if force or time.monotonic() - self._last_write >= MARKER_INTERVAL_S:
                self._write()

    def _count(self, fusion: str, phase: Phase, num_tokens: int) -> bool:
        """Count one batch; True where the marker must be rewritten now (a new captured size, or a
        count reaching a power of two)."""
        entry = self.fusion(fusion)
        entry.runs[phase] += 1
        if not self._flush_registered:
            self._flush_registered = True
            register_exit_flush(self.flush)  # the counts since the last rewrite reach the marker at exit
        if phase is Phase.CAPTURE and num_tokens not in entry.captured_sizes:
            entry.captured_sizes = sorted([*entry.captured_sizes, num_tokens])
            return True
        count = entry.runs[phase]
        return count & (count - 1) == 0

    def flush(self) -> None:
        with self._lock:
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
            lines.append((level, text))
        return lines

    def publish_layers(self) -> None:
        """Log the layer summary once a model's layers are built (called per model built)."""
        prefix = f"k3-amd-overlay: pid={self.record.pid} role={self.record.role} layers built: "
        for level, line in self.layer_summary():
            _emit(level, prefix + line)

    def _write(self) -> None:
        if self._forked:
            self._refresh_identity()
        self.record.updated = time.time()
        self._last_write = time.monotonic()
        if self._directory is None:
            return
        try:
            self.marker_path = markers.write_marker(self._directory, self.record.pid, self.record.to_json())
        except OSError as exc:  # serving must never fail over evidence
            if self.marker_error is None:
                self.marker_error = f"marker write failed in {self._directory}: {exc}"
                _emit(logging.WARNING, f"k3-amd-overlay: {self.marker_error}")

    def publish(self) -> None:
        with self._lock:
            self._write()
        _emit(logging.WARNING if self.marker_error else logging.INFO, self.summary_line())
        if self.marker_error:
            _emit(logging.WARNING, f"k3-amd-overlay: WARNING: this process writes no marker, so `k3-amd-overlay "
                                   f"check` cannot see it: {self.marker_error}")

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


def _emit(level: int, line: str) -> None:
    """Through the vllm logger once vLLM has configured it; stderr before, so no line is lost."""
    if logging.getLogger("vllm").handlers:
        logger.log(level, line)
    else:
        print(line, file=sys.stderr, flush=True)
