"""Judging evidence records against an expectation (``fused`` or ``stock``): the logic of
``k3-amd-overlay check``, kept apart from reading files so it is tested on records directly."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE
from k3_amd_overlay.phases import Phase
from k3_amd_overlay.record import FusionEntry, MarkerRecord
from k3_amd_overlay.settings import SWITCH, Mode


@dataclass
class Verdict:
    holds: bool = True
    lines: list[str] = field(default_factory=list)

    def fail(self, line: str) -> None:
        self.holds = False
        self.lines.append(f"FAIL {line}")

    def ok(self, line: str) -> None:
        self.lines.append(f"ok   {line}")

    def info(self, line: str) -> None:
        """A fact for the reader that neither holds nor fails the verdict."""
        self.lines.append(f"info {line}")


def launch_configs_summary(launch_configs: dict[str, Any]) -> str:
    """Which config file each kernel used in a process and whether it was tuned on that GPU."""
    by_source: dict[str, list[str]] = {}
    for kernel, source in launch_configs.get("kernels", {}).items():
        tuned = ("tuned on this GPU" if source.get("tuned_here") else
                 f"tuned on {source['tuned_on']}, not this GPU" if source.get("tuned_on") else "untuned")
        by_source.setdefault(f"{os.path.basename(source.get('file', '?'))} ({tuned})", []).append(kernel)
    files = "; ".join(f"{where}: {', '.join(kernels)}" for where, kernels in by_source.items())
    return f"{launch_configs.get('arch')} ({launch_configs.get('device') or 'no GPU'}): {files}"


# A fusion whose one launch also does another's work: absorb_qk_cache's launch writes the KV cache
# and quantises the concatenated query too, so its runs prove qk_cache's fusion ran as well.
DOES_THE_WORK_OF = {ABSORB_QK_CACHE: QK_CACHE}


@dataclass
class _Proof:
    """Where one fusion's fused path ran, summed over the processes judged."""

    captured: list[tuple[str, list[int]]] = field(default_factory=list)  # (where, graph sizes)
    served: list[tuple[str, int]] = field(default_factory=list)  # (where, eager served batches)
    replayed: list[tuple[str, int]] = field(default_factory=list)  # (where, served graph replays)
    warmup: int = 0

    def add(self, pid: int, entry: FusionEntry, via: str | None = None) -> None:
        where = f"pid {pid}" + (f" in the {via} launch" if via else "")
        if entry.captured_sizes:
            self.captured.append((where, list(entry.captured_sizes)))
        if entry.runs[Phase.SERVED]:
            self.served.append((where, entry.runs[Phase.SERVED]))
        if entry.runs[Phase.REPLAY]:
            self.replayed.append((where, entry.runs[Phase.REPLAY]))
        self.warmup += entry.runs[Phase.WARMUP]

    def graphs(self) -> str:
        count = sum(len(sizes) for _, sizes in self.captured)
        where = "; ".join(f"{w}: sizes {', '.join(map(str, sizes))}" for w, sizes in self.captured)
        return f"{count} graph{'s' if count != 1 else ''} ({where})"

    def describe(self) -> str:
        """What proves served traffic took the fused path; empty where nothing does. A capture alone
        happens at startup, before any request: only its replays outside vLLM's warm-up count."""
        parts = []
        if self.replayed:
            replays = sum(n for _, n in self.replayed)
            where = ", ".join(f"{w}: {n}" for w, n in self.replayed)
            parts.append(f"{replays} replay{'s' if replays != 1 else ''} of the {self.graphs()} that recorded it, "
                         f"for served batches ({where})")
        if self.served:
            batches = sum(n for _, n in self.served)
            where = ", ".join(f"{w}: {n}" for w, n in self.served)
            parts.append(f"{batches} eager batch{'es' if batches != 1 else ''} after startup ({where})")
        return "; ".join(parts)


def _judge_off(records: list[MarkerRecord]) -> Verdict:
    """``off`` (the A/B baseline of vLLM as it is): no live process runs the overlay. With the
    overlay off the plugin writes no marker, so no record at all holds too."""
    verdict = Verdict()
    if not records:
        verdict.ok("no live vLLM process has overlay evidence here: the overlay is off (or not installed)")
    for record in records:
        who = f"pid {record.pid} ({record.role}, vLLM {record.vllm_version})"
        if record.mode is Mode.OFF:
            verdict.ok(f"{who}: overlay off")
        else:
            verdict.fail(f"{who}: overlay in {record.mode.value} mode ({SWITCH}={record.switch!r})")
    return verdict


NOT_RECORDED = FusionEntry(FusionState.DISABLED, reason="not in this process's record")


def judge(records: Iterable[MarkerRecord], expect: str, fusions: Iterable[str] | None,
          require_effective: bool, static: bool = False, allow_mixed: bool = False) -> Verdict:
    """``fused`` holds where every process runs the overlay on (auto), each process that built K3
    MLA layers has each fusion applied (the overlay's) or upstream (this vLLM's own), some process
    built layers, and, with ``require_effective``, each fusion's fused path served traffic: a graph
    whose capture recorded it was replayed, or it ran on an eager batch, after startup. A capture
    alone, and runs or replays in vLLM's own warm-up batches (profile run, warm-up, dummy batches),
    prove nothing about served traffic.
    ``stock`` holds only where every process runs the overlay in stock mode, each fusion forced
    stock and its fused path never run. A process with the overlay off proves neither.
    A process whose layers split (some fused, some not) is not a fused arm unless ``allow_mixed``.
    ``fusions`` None: each process's requested ones (those not ``disabled``). ``static``: the
    record of a fresh process that loaded the plugin and imported the K3 code but built no layer:
    ``fused`` then holds where each fusion is patched (``pending``) or already decided fused."""
    verdict = Verdict()
    records = [r for r in records if r.role != "cli-client"]
    if expect == "off":
        return _judge_off(records)
    named = list(fusions) if fusions is not None else None
    if not records:
        verdict.fail("no live vLLM process has left overlay evidence (is the server up, the plugin "
                     "installed, K3_AMD_OVERLAY set, the marker directory the same?)")
        return verdict
    proofs: dict[str, _Proof] = {}
    any_layers = False
    for record in records:
        who = f"pid {record.pid} ({record.role}, vLLM {record.vllm_version})"
        mode = record.mode
        entries = record.fusions
        if mode is Mode.OFF:
            verdict.fail(f"{who}: overlay off: proves neither fused nor stock")
            continue
        wanted = named if named is not None else [
            f for f, e in entries.items() if e.state is not FusionState.DISABLED]
        has_layers = record.builds_layers()
        any_layers = any_layers or has_layers
        if expect == "fused" and not has_layers and not static:
            if mode is Mode.AUTO:
                verdict.ok(f"{who}: overlay on ({', '.join(wanted)}); builds no K3 MLA layer, nothing to fuse here")
            else:
                verdict.fail(f"{who}: overlay in {mode.value} mode")
            continue
        if record.launch_configs and expect == "fused":
            verdict.info(f"{who}: launch configs {launch_configs_summary(record.launch_configs)}")
        for fusion in wanted:
            entry = entries.get(fusion, NOT_RECORDED)
            proof = proofs.setdefault(fusion, _Proof())
            proof.add(record.pid, entry)
            for doer, covered in DOES_THE_WORK_OF.items():
                if covered == fusion and doer in entries and entries[doer].fused:
                    proof.add(record.pid, entries[doer], via=doer)
            state, provider, reason, layers = entry.state, entry.provider, entry.reason, entry.layers
            described = (f"{who}: {fusion}={state.value}" + (f" provider={provider}" if provider else "")
                         + (f" on {layers} layer{'s' if layers != 1 else ''}" if layers else "") + f" ({reason})")
            if expect == "fused":
                good = mode is Mode.AUTO and (entry.fused or (static and state is FusionState.PENDING))
                split = entry.mixed()
                if split and good:
                    described += f"; mixed across layers: {split}"
                    good = allow_mixed
                    if not allow_mixed:
                        described += " (pass --allow-mixed to accept a partly fused process)"
            else:
                good = mode is Mode.STOCK and state is FusionState.FORCED_STOCK and not entry.ran
                if entry.ran:
                    described += "; its fused path ran"
            (verdict.ok if good else verdict.fail)(described)
    if expect == "fused" and not any_layers and not static:
        verdict.fail("no live process has built a K3 MLA layer (is the model loaded in a process that "
                     "shares this marker directory?)")
    if expect == "fused" and require_effective:
        for fusion, proof in proofs.items():
            proved = proof.describe()
            if proved:
                verdict.ok(f"{fusion}: served traffic took the fused path: {proved}")
            elif proof.captured:
                verdict.fail(f"{fusion}: captured into {proof.graphs()} at startup, but no served batch has run "
                             "it yet (no replay of those graphs, no eager batch): send a request (a decode step) "
                             "first")
            elif proof.warmup:
                verdict.fail(f"{fusion}: its fused path ran only in vLLM's own warm-up batches ({proof.warmup}), "
                             "which proves nothing about served traffic; send a request (a decode step) first")
            else:
                verdict.fail(f"{fusion}: no process has run its fused path yet (send a request first, "
                             "or pass --no-effective)")
    return verdict
