"""Judging evidence records against an expectation (``fused``, ``stock`` or ``off``): the logic of
``k3-amd-overlay check``, of ``--merge`` (each node's ``check --json``) and of ``--static`` (with
``doctor``'s own verdict), kept apart from reading files so it is tested on records directly.
Every line names the process as ``host H pid N``: pids repeat across nodes."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from k3_amd_overlay import measured
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.package import ABSORB_QK_CACHE, FUSIONS, QK_CACHE, __version__
from k3_amd_overlay.phases import Phase
from k3_amd_overlay.process_identity import CLI_CLIENT, MODEL_ROLES
from k3_amd_overlay.record import FusionEntry, MarkerRecord
from k3_amd_overlay.settings import SWITCH, Mode, SettingsError, parse_switch


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


def launch_config_notes(launch_configs: dict[str, Any]) -> list[str]:
    """What else a process's launch configs say (kernels/launch.py, targets/installer.py): a tuned file
    it could not use, each config degraded to the arch's safe one (and whether that failed too), and
    its kernels' compile seconds at model load."""
    notes = []
    if launch_configs.get("error"):
        notes.append(f"unusable launch-config file: {launch_configs['error']}")
    for kernel, entries in launch_configs.get("degraded", {}).items():
        for entry in entries:
            note = (f"{kernel} config {entry.get('config')} (rules {', '.join(entry.get('rules', []))}) degraded to "
                    f"the safe config {entry.get('safe')}: {entry.get('why')}")
            if entry.get("safe_failed"):
                note += f"; the safe config failed too: {entry['safe_failed']}"
            notes.append(note)
    seconds = launch_configs.get("compile_seconds") or {}
    if seconds:
        each = ", ".join(f"{kernel} {s:.1f} s" for kernel, s in seconds.items())
        notes.append(f"compiled at model load in {sum(seconds.values()):.1f} s ({each})")
    return notes


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

    def add(self, record: MarkerRecord, entry: FusionEntry, via: str | None = None) -> None:
        where = f"host {record.host} pid {record.pid}" + (f" in the {via} launch" if via else "")
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


def who(record: MarkerRecord) -> str:
    """A process as every line names it: its host and pid (pids repeat across nodes), role, vLLM."""
    return f"host {record.host} pid {record.pid} ({record.role}, vLLM {record.vllm_version})"


NO_OFF_RECORD = ("no live vLLM process left an off record (is the server up, k3-amd-overlay installed in its Python "
                 f"(with {SWITCH} unset or 0 its plugin leaves one), the same K3_AMD_OVERLAY_MARKER_DIR?)")


NO_MODEL_PROCESS = ("only API server processes left an off record: no engine core, worker or offline engine did, so "
                    "what ran the model is not known (its processes may use another K3_AMD_OVERLAY_MARKER_DIR, run "
                    f"on another node or another Python, or run with another {SWITCH})")


def _judge_off(records: list[MarkerRecord], verdict: Verdict) -> Verdict:
    """``off`` (the A/B baseline of vLLM as it is): at least one live process that runs the model
    (``MODEL_ROLES``) left an off record (the plugin loaded and patched nothing) and none runs the
    overlay, all of this check's overlay version and one arm (``_one_arm``: one vLLM version and one
    switch; off records of two deployments are not one baseline). Nothing at all proves nothing: the
    server may be down, or the plugin absent from its Python; nor does an API server's record alone
    (it runs no model). Adds to ``verdict`` and returns it."""
    if not records:
        verdict.fail(NO_OFF_RECORD)
    for record in records:
        if record.mode is Mode.OFF:
            verdict.ok(f"{who(record)}: overlay off")
            _same_overlay(record, verdict)
        else:
            verdict.fail(f"{who(record)}: overlay in {record.mode.value} mode ({SWITCH}={record.switch!r})")
    on = sum(r.mode is not Mode.OFF for r in records)
    if on and on < len(records):
        verdict.fail(f"mixed: {len(records) - on} process{'es' if len(records) - on != 1 else ''} with the overlay "
                     f"off, {on} with it on: not one arm")
    _one_arm([r for r in records if r.mode is Mode.OFF], verdict)
    if records and not any(r.role in MODEL_ROLES for r in records):
        verdict.fail(NO_MODEL_PROCESS)
    return verdict


def _same_overlay(record: MarkerRecord, verdict: Verdict) -> None:
    """Fail ``verdict`` where ``record`` was written by another overlay version than this check's: its
    rules are the ones that judge the record."""
    if record.overlay_version != __version__:
        written_by = record.overlay_version or "(unknown)"
        verdict.fail(f"{who(record)}: its record was written by k3-amd-overlay {written_by}, this check is "
                     f"{__version__}: judge it with the k3-amd-overlay of the install that wrote it (check in the "
                     "Python vLLM runs in; --merge with that version)")


def distinct_processes(records: Iterable[MarkerRecord]) -> list[MarkerRecord]:
    """``records`` with one record per process (host, pid), the first: a process counts once."""
    kept: dict[tuple[str, int], MarkerRecord] = {}
    for record in records:
        kept.setdefault((record.host, record.pid), record)
    return list(kept.values())


def _one_per_process(records: list[MarkerRecord], verdict: Verdict) -> list[MarkerRecord]:
    """``distinct_processes(records)``; a process with more than one record is said, and fails
    ``verdict`` where its records differ (which one is that process's own is unknown)."""
    copies: dict[tuple[str, int], list[MarkerRecord]] = {}
    for record in records:
        copies.setdefault((record.host, record.pid), []).append(record)
    for (host, pid), same in copies.items():
        if len(same) < 2:
            continue
        if all(r.to_json() == same[0].to_json() for r in same):
            verdict.info(f"host {host} pid {pid}: {len(same)} copies of its record, counted once")
        else:
            verdict.fail(f"host {host} pid {pid}: {len(same)} records of one process that differ: which one is "
                         "its own is unknown")
    return [same[0] for same in copies.values()]


def _readable(what: str, entry: dict[str, Any], lines: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    """The lines an informational part of a record gives, or one line saying it is unreadable: a
    marker written by hand or by another tool must not stop the verdict on every process."""
    try:
        return lines(entry)
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
        return [f"unreadable {what} in its record ({type(exc).__name__}: {exc}): {json.dumps(entry)[:200]}"]


NOT_RECORDED = FusionEntry(FusionState.DISABLED, reason="not in this process's record")


def report_lines(notes: Iterable[object], lines: Iterable[object], holds: bool, expect: object,
                 processes: int) -> list[str]:
    """``check``'s report as it prints it without ``--json``: its notes and lines, then whether it
    holds over how many processes."""
    count = f"{processes} process{'es' if processes != 1 else ''}"
    return [*map(str, notes), *map(str, lines), f"{'HOLDS' if holds else 'DOES NOT HOLD'}: expect {expect} ({count})"]


def judge(records: Iterable[MarkerRecord], expect: str, fusions: Iterable[str] | None,
          require_effective: bool, static: bool = False, allow_mixed: bool = False,
          whole_world: bool = False) -> Verdict:
    """``fused`` holds where every process runs the overlay on (auto), each process that built K3
    MLA layers has each fusion applied (the overlay's) or upstream (this vLLM's own), some process
    built layers, and, with ``require_effective``, each fusion's fused path served traffic: a graph
    whose capture recorded it was replayed, or it ran on an eager batch, after startup. A capture
    alone, and runs or replays in vLLM's own warm-up batches (profile run, warm-up, dummy batches),
    prove nothing about served traffic.
    ``stock`` holds only where every process runs the overlay in stock mode, each fusion forced
    stock and its fused path never run, and some process built K3 MLA layers: an API server alone
    proves nothing about the workers. A process with the overlay off proves neither.
    ``off`` holds only where some live process left an off record, one of them a process that runs
    the model (``MODEL_ROLES``: not an API server alone), and none runs the overlay.
    A process whose layers split (some fused, some not) is not a fused arm unless ``allow_mixed``.
    Every expectation also needs one arm: the processes judged share one overlay version (this
    check's: its rules are the ones that judge the record), one vLLM version and one switch, and
    (but ``off``) each has a fusion to judge; a process of another install must not prove this one.
    A process counts once (by host and pid): records of one process that differ fail.
    Every rank of vLLM's world that the records name must have left a live record (``_all_ranks``):
    on one node here, across nodes with ``whole_world`` (``--merge``).
    ``fusions`` None: each process's requested ones (those not ``disabled``). ``static``: the
    record of a fresh process that loaded the plugin and imported the K3 code but built no layer:
    ``fused`` then holds where each fusion is patched (``pending``) or already decided fused."""
    verdict = Verdict()
    records = _one_per_process([r for r in records if r.role != CLI_CLIENT], verdict)
    if expect == "off":
        return _judge_off(records, verdict)
    named = list(fusions) if fusions is not None else None
    if not records:
        verdict.fail("no live vLLM process has left overlay evidence (is the server up, the plugin "
                     "installed, K3_AMD_OVERLAY set, the marker directory the same?)")
        return verdict
    proofs: dict[str, _Proof] = {}
    any_layers = False
    for record in records:
        name = who(record)
        mode = record.mode
        entries = record.fusions
        if mode is Mode.OFF:
            verdict.fail(f"{name}: overlay off: proves neither fused nor stock")
            continue
        _same_overlay(record, verdict)
        wanted = named if named is not None else [
            f for f, e in entries.items() if e.state is not FusionState.DISABLED]
        has_layers = record.builds_layers()
        any_layers = any_layers or has_layers
        if not wanted:
            verdict.fail(f"{name}: no fusion to judge: every fusion is disabled in its record ("
                         + "; ".join(f"{f}: {e.reason}" for f, e in entries.items()) + ")")
            continue
        if expect == "fused" and not has_layers and not static:
            # Refused before any layer (the vLLM code not recognised, an anchor missing, an out-of-tree
            # replacement registered): facts of the install and its plugins, not of this process's role.
            refused = [f for f in wanted if entries.get(f, NOT_RECORDED).state is FusionState.REFUSED]
            if mode is not Mode.AUTO:
                verdict.fail(f"{name}: overlay in {mode.value} mode")
            elif refused:
                for fusion in refused:
                    verdict.fail(f"{name}: {fusion}=refused at startup ({entries[fusion].reason})")
            else:
                verdict.ok(f"{name}: overlay on ({', '.join(wanted)}); builds no K3 MLA layer, nothing to fuse here")
            continue
        if record.launch_configs and expect == "fused":
            for line in _readable("launch configs", record.launch_configs, lambda c: [
                    f"launch configs {launch_configs_summary(c)}", *launch_config_notes(c)]):
                verdict.info(f"{name}: {line}")
        if record.measurement and expect == "fused":
            for line in _readable("measurement", record.measurement, lambda m: [measured.summary(m)]):
                verdict.info(f"{name}: {line}")
        for fusion in wanted:
            entry = entries.get(fusion, NOT_RECORDED)
            proof = proofs.setdefault(fusion, _Proof())
            proof.add(record, entry)
            for doer, covered in DOES_THE_WORK_OF.items():
                if covered == fusion and doer in entries and entries[doer].fused:
                    proof.add(record, entries[doer], via=doer)
            state, provider, reason, layers = entry.state, entry.provider, entry.reason, entry.layers
            described = (f"{name}: {fusion}={state.value}" + (f" provider={provider}" if provider else "")
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
    arm = [r for r in records if r.mode is (Mode.AUTO if expect == "fused" else Mode.STOCK)]
    _one_arm(arm, verdict)
    _all_ranks(records, verdict, whole_world)
    if expect in ("fused", "stock") and not any_layers and not static:
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


# What one arm's processes share: a process of another install or another switch is not this arm,
# and its evidence (a served batch, a fused layer) must not prove this one.
ONE_ARM_FIELDS = (("overlay_version", "overlay versions"), ("vllm_version", "vllm versions"),
                  ("switch", f"{SWITCH} values"))


def _switch_meaning(raw: str) -> str:
    """A switch as the arm it names: ``1`` and the list of every fusion (in any order, with spaces)
    are one arm; a value no overlay reads stands for itself."""
    try:
        mode, fusions = parse_switch(raw)
    except SettingsError:
        return repr(raw)
    return f"{mode.value} ({', '.join(f for f in FUSIONS if f in fusions) or 'no fusion'})"


def _one_arm(records: list[MarkerRecord], verdict: Verdict) -> None:
    """Fail ``verdict`` where ``records`` (the processes in the expected mode: one in another has failed
    already) differ in overlay version, vLLM version or the arm their switch names."""
    for attribute, what in ONE_ARM_FIELDS:
        seen: dict[str, list[str]] = {}
        for record in records:
            value, where = getattr(record, attribute), f"host {record.host} pid {record.pid}"
            if attribute == "switch":
                seen.setdefault(_switch_meaning(value), []).append(f"{where}: {value!r}")
            else:
                seen.setdefault(str(value or "unknown"), []).append(where)
        if len(seen) > 1:
            verdict.fail(f"not one deployment: {what} differ: " + "; ".join(
                f"{value} ({', '.join(where)})" for value, where in seen.items()))


def _spans(numbers: Iterable[int]) -> str:
    """Whole numbers as runs: ``0-3, 5, 7-8``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _ranks(numbers: list[int]) -> str:
    return f"rank{'s' if len(numbers) != 1 else ''} {_spans(numbers)}"


def _all_ranks(records: list[MarkerRecord], verdict: Verdict, whole_world: bool) -> None:
    """Fail ``verdict`` unless every rank of each world the records name (a process that built layers
    names its rank, its world's size and node count) left as many live records as the world's other
    ranks: a rank with fewer ran what is unknown (its marker unwritten). Several deployments of one
    world size (two replicas, a prefill and a decode instance on one host; vLLM's independent data-parallel
    ranks of a dense model) each hold every rank once, so each rank is held as many times. A world over
    several nodes has ranks on other hosts: a check of one node says which it did not see, and
    ``whole_world`` (the merge of every node's check) needs them all."""
    worlds: dict[tuple[int, int | None], Counter[int]] = {}
    for record in records:
        if record.world_size is not None and record.rank is not None:
            worlds.setdefault((record.world_size, record.nodes), Counter())[record.rank] += 1
    for (size, nodes), held in sorted(worlds.items(), key=lambda item: item[0][0]):  # smallest world first
        copies = max(held.values())
        short = [rank for rank in range(size) if held[rank] < copies]
        world = f"a world of {size} rank{'s' if size != 1 else ''}" + (
            f" over {nodes} node{'s' if nodes != 1 else ''}" if nodes else "")
        several = f" ({copies} deployments of this world)" if copies > 1 else ""
        if not short:
            verdict.info(f"{_ranks(list(range(size)))} of {world}: each left a live record{several}")
        elif whole_world or not nodes or nodes == 1:
            what = ("left no live record" if copies == 1 else
                    f"left fewer live records than the others, {copies} each{several}: one is incomplete")
            verdict.fail(f"{_ranks(short)} of {world} {what}: what ran there is unknown (a rank whose marker could "
                         "not be written says why in its log; "
                         + ("every node's check must be merged)" if whole_world else
                            "on several nodes, judge each node's check --json together with --merge)"))
        else:
            verdict.info(f"{_ranks(short)} of {world} {'is' if len(short) == 1 else 'are'} not on this host: this "
                         "check proves this host's processes; --merge of every node's check --json proves the "
                         "deployment")


@dataclass
class NodeEvidence:
    """One node's ``check --json`` output as ``--merge`` reads it."""

    source: str  # the file it came from
    host: str | None
    expect: str | None
    holds: bool | None
    live: bool  # read from that node's live markers (not a --static or --merge output)
    records: list[MarkerRecord]
    lines: list[str] = field(default_factory=list)  # its own verdict's lines
    checked_at: float | None = None  # when that node's check ran (seconds since the epoch; older overlays: none)


# How long after a node's ``check --json`` its file still proves that node's deployment in a merge:
# a file from an earlier run (or another deployment's) must not prove this one.
MERGE_MAX_AGE_S = 900


def judge_merge(nodes: list[NodeEvidence], expect: str, fusions: Iterable[str] | None, require_effective: bool,
                allow_mixed: bool = False, max_age_s: float = MERGE_MAX_AGE_S, now: float | None = None) -> Verdict:
    """A deployment across nodes holds only where every node file contributes live evidence that
    holds on its own under this expectation (a node that served stock, or nothing, fails it), each
    host comes once, each file was written by ``check`` within ``max_age_s`` of ``now``, all
    processes run one overlay version and one vLLM version, and the processes of all nodes together
    hold as one deployment."""
    verdict = Verdict()
    now = time.time() if now is None else now
    fusions = list(fusions) if fusions is not None else None
    hosts: dict[str, str] = {}
    judged: list[MarkerRecord] = []
    for node in nodes:
        name = f"node host {node.host} ({node.source})"
        how = (f"run `k3-amd-overlay check --expect {expect} --json > FILE` on host {node.host or '?'} while its vLLM "
               "serves, and merge that FILE")
        if not node.host:
            verdict.fail(f"node ({node.source}): names no host, so its pids cannot be told from another node's: {how}")
            continue
        if node.host in hosts:
            verdict.fail(f"{name}: host {node.host} again (also {hosts[node.host]}): one file per node, each once")
            continue
        hosts[node.host] = node.source
        if not node.live:
            verdict.fail(f"{name}: not read from that node's live markers (a --static or --merge output): {how}")
            continue
        if node.expect != expect:
            verdict.fail(f"{name}: judged there against --expect {node.expect}, not {expect}: {how}")
            continue
        if node.checked_at is None:
            verdict.fail(f"{name}: says not when it was checked (an older k3-amd-overlay wrote it), so it may be "
                         f"another run's: {how}")
            continue
        if not abs(now - node.checked_at) <= max_age_s:  # not ">": a NaN age must fail too
            verdict.fail(f"{name}: checked {_age(now - node.checked_at)}, more than --max-age {max_age_s:g} s: it "
                         f"proves that node as it was then, not this deployment: {how} (or pass a larger --max-age "
                         "to judge an archived run)")
            continue
        for record in node.records:
            if record.host != node.host:
                verdict.fail(f"{name}: holds {who(record)}, another host's process: that node's file proves "
                             "only its own processes")
        own = [r for r in node.records if r.host == node.host and r.role != CLI_CLIENT]
        judged += own
        if not own:
            missing = NO_OFF_RECORD if expect == "off" else (
                "no live vLLM process left overlay evidence (is the server up there, k3-amd-overlay installed in "
                "its Python, K3_AMD_OVERLAY set, the marker directory the same?)")
            verdict.fail(f"{name}: 0 processes: {missing}; {how}")
            continue
        alone = judge(own, expect, fusions, require_effective, allow_mixed=allow_mixed)
        failed = [line.removeprefix("FAIL ") for line in [*node.lines, *alone.lines] if line.startswith("FAIL ")]
        count = len(distinct_processes(own))
        if node.holds is not True or not alone.holds:
            verdict.fail(f"{name}: its own processes do not prove {expect}: " + "; ".join(dict.fromkeys(failed)))
        else:
            verdict.ok(f"{name}: {count} live process{'es' if count != 1 else ''} prove {expect} there")
    merged = judge(judged, expect, fusions, require_effective, allow_mixed=allow_mixed, whole_world=True)
    verdict.lines += merged.lines
    verdict.holds = verdict.holds and merged.holds and bool(nodes)
    return verdict


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds >= 0 else f"{-seconds:.0f} s in the future (clocks apart?)"


# What ``doctor``'s verdict line starts with where a fresh process here would be each arm.
DOCTOR_VERDICT_FOR = {"fused": "ready: ", "stock": "ready (stock)", "off": "off: "}


def judge_doctor(report: dict[str, Any], expect: str, fusions: Iterable[str] | None, verdict: Verdict) -> None:
    """``--static``: add ``doctor``'s own verdict (``doctor.verdict_line``) on this machine, for the
    fusions asked (default: those the switch requests), to ``verdict``; it holds only where the
    doctor says what this expectation needs ("ready" for fused, each fusion asked fusing here)."""
    from k3_amd_overlay.commands.doctor import verdict_line

    outlook = report.get("fusions", {})
    asked = list(fusions) if fusions is not None else [f for f, o in outlook.items() if o["state"] != "off"]
    line, healthy = verdict_line({**report, "fusions": {f: o for f, o in outlook.items() if f in asked}})
    if not healthy or not line.startswith(DOCTOR_VERDICT_FOR[expect]):
        verdict.fail(f"doctor on this machine{' for ' + ', '.join(asked) if asked else ''}: {line}")
        return
    missing = [f for f in asked if outlook.get(f, {}).get("state") != "fused"] if expect == "fused" else []
    for fusion in missing:
        why = outlook.get(fusion, {}).get("why", "not in its report")
        verdict.fail(f"doctor on this machine: {fusion} would not fuse here ({why})")
    if not missing:
        verdict.ok(f"doctor on this machine: {line}")
