"""Whether a fused path really ran in this process, and in how many batches of each phase: the
hook each layer's fused site calls, the counting of a captured graph's replays, and which counts
must reach the marker at once (a new captured size, a count reaching a power of two)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from k3_amd_overlay import process_hooks
from k3_amd_overlay.package import FUSIONS
from k3_amd_overlay.phases import Phase, capturing_graph, current_phase, replay_phase
from k3_amd_overlay.record import FusionEntry

REPLAY_COUNTED = "_k3_overlay_counted_fusions"  # on a CUDA graph instance: the fusions its replays count for


class CountedRecord(Protocol):
    """What the counts are kept in: a record's fusion entries, under its lock, written through it."""

    lock: threading.Lock

    def fusion(self, name: str) -> FusionEntry: ...

    def write_counts(self, now: bool) -> None:
        """With ``lock`` held: write the marker if ``now``, or if a write is due anyway."""

    def flush(self) -> None: ...


class RunCounter:
    """The runs of each fusion in one process, kept in ``record``'s entries."""

    def __init__(self, record: CountedRecord) -> None:
        self._record = record
        self._effective_layers: dict[str, set[str]] = {f: set() for f in FUSIONS}
        self._counting_layer: dict[str, str] = {}
        self._flush_registered = False
        self._generation = 0  # bumped in a forked child: the parent's first-run flags are not the child's

    def start_in_child(self, entries: list[FusionEntry]) -> None:
        """In a forked child: the parent's run counts are not the child's; nothing has run here yet."""
        self._generation += 1
        self._effective_layers = {f: set() for f in FUSIONS}
        self._counting_layer = {}
        self._flush_registered = False
        for entry in entries:
            entry.effective, entry.effective_layers = False, 0
            entry.runs = {phase: 0 for phase in entry.runs}
            entry.captured_sizes = []

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
            with self._record.lock:
                if not done:
                    done_in = self._generation
                    layers = self._effective_layers[fusion]
                    layers.add(layer)
                    entry = self._record.fusion(fusion)
                    entry.effective, entry.effective_layers = True, len(layers)
                    self._counting_layer.setdefault(fusion, layer)
                    now = True
                else:
                    now = False
                if self._counting_layer[fusion] == layer:
                    now = self._count(fusion, phase, num_tokens) or now
                    if phase is Phase.CAPTURE:
                        self._count_replays(capturing_graph(), fusion)
                self._record.write_counts(now)

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
        with self._record.lock:
            now = False
            for fusion in fusions:
                now = self._count(fusion, phase, 0) or now
            self._record.write_counts(now)

    def _count(self, fusion: str, phase: Phase, num_tokens: int) -> bool:
        """Count one batch; True where the marker must be rewritten now (a new captured size, or a
        count reaching a power of two)."""
        entry = self._record.fusion(fusion)
        entry.runs[phase] += 1
        if not self._flush_registered:
            self._flush_registered = True
            process_hooks.register_exit_flush(self._record.flush)  # the counts since the last write, at exit
        if phase is Phase.CAPTURE and num_tokens not in entry.captured_sizes:
            entry.captured_sizes = sorted([*entry.captured_sizes, num_tokens])
            return True
        count = entry.runs[phase]
        return count & (count - 1) == 0
