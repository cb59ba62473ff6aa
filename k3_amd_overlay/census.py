"""Kernel census over PyTorch profiler traces (the Kineto JSON that vLLM's ``--profiler-config``
torch profiler writes, one per rank, ``.json`` or ``.json.gz``): GPU kernel launches per rank,
counted and timed, before and after a fusion, with the cheap invariant "fused kernel count =
MLA layers x decode steps" checkable by ``--expect``.

The traces are read directly: a Kineto trace is a JSON object whose ``traceEvents`` hold one
complete event (``ph: X``) per GPU kernel with ``cat`` "kernel" (CUDA and ROCm alike, graph
replays included). Maintained analysers (HolisticTraceAnalysis, AMD TraceLens) do much more but
pull in pandas and friends that a stock serving image lacks, for what is a group-by over names.

Names alone cannot tell a fusion's kernels apart from the model's others (hipBLASLt names every GEMM
``Cijk_...``; every RMSNorm matches ``rms_norm_kernel``). Where the overlay is on (stock mode
included) it opens profiler ranges around the regions its fusions replace (regions.py), and each
kernel is attributed to the range its launch was made in (the kernel's ``correlation`` id leads to
its launch on a CPU thread): the comparison then counts only kernels inside those ranges, and inside
a decode range a GEMM only where the region's own work follows it (the W_UK absorption precedes the
KV write, concat and quant or the fused launch; the W_UV GEMM after the attention kernel does not).
Traces without the ranges (overlay off, CUDA-graph replays) fall back to names, and say so."""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3_amd_overlay.kernels.names import (
    ABSORB_FP8_QK_CACHE_KERNEL,
    ABSORB_MXFP4_QK_CACHE_KERNEL,
    ABSORB_QK_CACHE_KERNEL,
    QK_CACHE_KERNEL,
    RMSNORM_PAIR_KERNEL,
    STATIC_QUANT_KERNEL,
)
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.regions import DECODE_REGION, QKV_NORM_REGION, REGION_PREFIX

# One table of the kernels each fusion removes and adds, matched as substrings of the full
# kernel name: AITER's, vLLM's and the overlay's own. A kernel counts under the longest pattern of
# the whole table it contains, once, in each fusion that lists that pattern (AITER's fused BMM
# kernels contain "bmm"; the overlay's absorbed kernels contain "qk_cache_kernel").
FUSION_KERNELS: dict[str, dict[str, tuple[str, ...]]] = {
    QK_CACHE: {
        "removes": ("concat_and_cache_mla", "CatArrayBatchedCopy", "scaled_quant",
                    "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal"),
        "adds": ("fuse_qk_rope_concat_and_cache_mla", QK_CACHE_KERNEL),
    },
    ABSORB_QK_CACHE: {  # the bf16 W_UK_T's bmm (torch: hipBLASLt's Cijk_, cuBLASLt's nvjet) or vLLM's fp8 / MXFP4 one
        "removes": ("concat_and_cache_mla", "CatArrayBatchedCopy", "scaled_quant",
                    "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal", QK_CACHE_KERNEL,
                    "fuse_qk_rope_concat_and_cache_mla", "batched_gemm_a8w8",
                    "batched_gemm_a16wfp4", "bmm", "gemm", "Cijk_", "nvjet"),
        "adds": (ABSORB_QK_CACHE_KERNEL, ABSORB_FP8_QK_CACHE_KERNEL, ABSORB_MXFP4_QK_CACHE_KERNEL,
                 "fused_fp8_bmm_rope_cat_and_cache_mla", "fused_fp4_bmm_rope_cat_and_cache_mla", STATIC_QUANT_KERNEL),
    },
    QKV_NORM: {
        "removes": ("rms_norm_kernel", "rmsnorm_kernel"),
        "adds": ("fused_qk_rmsnorm", "FusedQKVRMSNormKernel", RMSNORM_PAIR_KERNEL),
    },
}
KERNEL_CATEGORIES = frozenset({"kernel", "gpu_op"})
# The patterns of GEMM kernels: inside a decode range, the W_UK absorption's (before the region's
# own work) and the W_UV up-projection's (after the attention kernel) look alike.
GEMM_PATTERNS = frozenset({"batched_gemm_a8w8", "batched_gemm_a16wfp4", "bmm", "gemm", "Cijk_", "nvjet"})
FUSION_REGIONS = {QKV_NORM: QKV_NORM_REGION, QK_CACHE: DECODE_REGION, ABSORB_QK_CACHE: DECODE_REGION}
RANGE_CATEGORIES = frozenset({"user_annotation"})


class TraceError(ValueError):
    """A file that is not a readable profiler trace; the message names the file and why."""


@dataclass
class KernelStats:
    count: int = 0
    total_us: float = 0.0

    @property
    def mean_us(self) -> float:
        return self.total_us / self.count if self.count else 0.0


@dataclass
class Census:
    """Kernel statistics per rank (rank -> kernel name -> stats), and the kernels launched inside
    each of the overlay's profiler ranges (rank -> [(range name, [(launch time, kernel, µs)])])."""

    ranks: dict[str, dict[str, KernelStats]] = field(default_factory=dict)
    regions: dict[str, list[tuple[str, list[tuple[float, str, float]]]]] = field(default_factory=dict)

    def total(self) -> dict[str, KernelStats]:
        summed: dict[str, KernelStats] = defaultdict(KernelStats)
        for kernels in self.ranks.values():
            for name, stats in kernels.items():
                summed[name].count += stats.count
                summed[name].total_us += stats.total_us
        return dict(summed)

    def matching(self, pattern: str, rank: str | None = None) -> KernelStats:
        kernels = self.ranks[rank] if rank is not None else self.total()
        found = KernelStats()
        for name, stats in kernels.items():
            if pattern in name:
                found.count += stats.count
                found.total_us += stats.total_us
        return found

    def launches(self, rank: str | None = None) -> int:
        kernels = self.ranks[rank] if rank is not None else self.total()
        return sum(s.count for s in kernels.values())

    def to_json(self) -> dict[str, Any]:
        def rows(kernels: dict[str, KernelStats]) -> list[dict[str, Any]]:
            return [{"name": n, "count": s.count, "total_us": round(s.total_us, 3), "mean_us": round(s.mean_us, 3)}
                    for n, s in sorted(kernels.items(), key=lambda kv: -kv[1].total_us)]

        return {"ranks": {r: rows(k) for r, k in sorted(self.ranks.items())}, "total": rows(self.total())}


def trace_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for text in paths:
        if not str(text).strip():
            raise TraceError("an empty path was given (it would scan the current directory): name the traces")
        item = Path(text)
        if item.is_dir():
            files += sorted(p for p in item.rglob("*") if p.name.endswith((".json", ".json.gz")))
        elif item.is_file():
            files.append(item)
        else:
            raise TraceError(f"{item}: no such file or directory")
    if not files:
        raise TraceError(f"no .json or .json.gz trace found in {', '.join(map(str, paths))}")
    return files


def load_trace(path: Path) -> dict[str, Any]:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        data = json.loads(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(f"{path}: cannot read ({type(exc).__name__}: {exc}); truncated or not gzip?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not JSON ({exc}); a truncated trace?") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path}: JSON without a traceEvents list: not a PyTorch profiler trace")
    return data


def rank_of(path: Path, data: dict[str, Any], index: int) -> str:
    info = data.get("distributedInfo")
    if isinstance(info, dict) and "rank" in info:
        return str(info["rank"])
    match = re.search(r"rank[_-]?(\d+)", path.name) or re.search(r"_(\d+)\.(?:pt\.)?trace", path.name)
    return match.group(1) if match else str(index)


def read_census(paths: Iterable[str | Path]) -> Census:
    census = Census()
    for index, path in enumerate(trace_files(paths)):
        data = load_trace(path)
        rank = rank_of(path, data, index)
        kernels = census.ranks.setdefault(rank, {})
        events = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
        gpu = [e for e in events if str(e.get("cat", "")).lower() in KERNEL_CATEGORIES]
        for event in gpu:
            stats = kernels.setdefault(str(event.get("name")), KernelStats())
            stats.count += 1
            stats.total_us += float(event.get("dur", 0.0))
        census.regions.setdefault(rank, []).extend(_region_kernels(events, gpu))
    return census


def _correlation(event: dict[str, Any]) -> Any:
    args = event.get("args")
    return args.get("correlation") if isinstance(args, dict) else None


def _region_kernels(events: list[dict[str, Any]], gpu: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """Each overlay range of one trace with the kernels launched inside it (innermost range wins)."""
    ranges: dict[tuple[Any, Any], list[tuple[float, float, int]]] = defaultdict(list)
    found: list[tuple[str, list[Any]]] = []
    for event in events:
        name = str(event.get("name", ""))
        if str(event.get("cat", "")).lower() in RANGE_CATEGORIES and name.startswith(REGION_PREFIX):
            start = float(event.get("ts", 0.0))
            ranges[(event.get("pid"), event.get("tid"))].append((start, start + float(event.get("dur", 0.0)),
                                                                 len(found)))
            found.append((name, []))
    if not found:
        return []
    launches = {}
    for event in events:
        corr = _correlation(event)
        if corr is not None and str(event.get("cat", "")).lower() not in KERNEL_CATEGORIES:
            launches[corr] = (event.get("pid"), event.get("tid"), float(event.get("ts", 0.0)))
    for kernel in gpu:
        launch = launches.get(_correlation(kernel))
        if launch is None:
            continue
        pid, tid, at = launch
        inside = [(start, i) for start, end, i in ranges.get((pid, tid), []) if start <= at <= end]
        if inside:
            found[max(inside)[1]][1].append((at, str(kernel.get("name")), float(kernel.get("dur", 0.0))))
    for _, kernels in found:
        kernels.sort()
    return found


def parse_expectations(items: Iterable[str]) -> list[tuple[str, int]]:
    parsed = []
    for item in items:
        name, sep, count = item.rpartition("=")
        if not sep or not name or not count.isdigit():
            raise ValueError(f"--expect {item!r}: write NAME=COUNT (a kernel-name substring and a count per rank)")
        parsed.append((name, int(count)))
    return parsed


def check_expectations(census: Census, expectations: list[tuple[str, int]]) -> list[str]:
    """Problems: each NAME must have run exactly COUNT times on every rank."""
    problems = []
    for name, count in expectations:
        for rank in sorted(census.ranks):
            got = census.matching(name, rank).count
            if got != count:
                problems.append(f"rank {rank}: kernels matching {name!r} ran {got} times, expected {count}")
    return problems


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def render(census: Census, top: int = 25) -> str:
    lines = []
    for rank in sorted(census.ranks):
        kernels = census.ranks[rank]
        total = sum(s.total_us for s in kernels.values())
        lines.append(f"\nrank {rank}: {census.launches(rank)} kernel launches, {total:.1f} µs")
        rows = [[n, str(s.count), f"{s.mean_us:.2f}", f"{s.total_us:.1f}"]
                for n, s in sorted(kernels.items(), key=lambda kv: -kv[1].total_us)[:top]]
        lines += _table(rows, ["kernel", "count", "mean µs", "total µs"])
    if len(census.ranks) > 1:
        summed = census.total()
        lines.append(f"\nall {len(census.ranks)} ranks: {census.launches()} kernel launches")
        rows = [[n, str(s.count), f"{s.mean_us:.2f}", f"{s.total_us:.1f}"]
                for n, s in sorted(summed.items(), key=lambda kv: -kv[1].total_us)[:top]]
        lines += _table(rows, ["kernel", "count", "mean µs", "total µs"])
    return "\n".join(lines)


TABLE_PATTERNS = frozenset(p for kinds in FUSION_KERNELS.values() for kind in kinds.values() for p in kind)


def claiming_pattern(name: str) -> str | None:
    """The longest pattern of the table that ``name`` contains (None: no fusion's kernel)."""
    return max((p for p in TABLE_PATTERNS if p in name), key=len, default=None)


def _claims(census: Census, patterns: tuple[str, ...]) -> dict[str, KernelStats]:
    """Per pattern of one fusion, the stats (summed over ranks) of the kernels it claims."""
    claimed: dict[str, KernelStats] = {pattern: KernelStats() for pattern in patterns}
    for name, stats in census.total().items():
        pattern = claiming_pattern(name)
        if pattern in claimed:
            claimed[pattern].count += stats.count
            claimed[pattern].total_us += stats.total_us
    return claimed


def region_claims(census: Census, fusion: str, patterns: tuple[str, ...]) -> dict[str, KernelStats] | None:
    """Per pattern of one fusion, the kernels launched inside its range (None where the traces have
    none of its ranges). Inside a decode range a GEMM counts only where a kernel of the fusion's own
    region work follows it in that range: the W_UK absorption, not the W_UV up-projection."""
    instances = [kernels for regions in census.regions.values() for name, kernels in regions
                 if name == FUSION_REGIONS[fusion]]
    if not instances:
        return None
    claimed = {pattern: KernelStats() for pattern in patterns}
    own_work = {*FUSION_KERNELS[fusion]["removes"], *FUSION_KERNELS[fusion]["adds"]} - GEMM_PATTERNS
    for kernels in instances:
        marks = [claiming_pattern(name) for _, name, _ in kernels]
        for i, ((_, _, dur), pattern) in enumerate(zip(kernels, marks, strict=True)):
            if pattern not in claimed:
                continue
            if pattern in GEMM_PATTERNS and not own_work.intersection(marks[i + 1:]):
                continue
            claimed[pattern].count += 1
            claimed[pattern].total_us += dur
    return claimed


NO_RANGES = ("counted by kernel name alone: the {side} traces have no {region} ranges (the overlay off, or "
             "kernels replayed from CUDA graphs), so every matching kernel counts, in or out of the region (every "
             "GEMM, every RMSNorm); profile eager (--enforce-eager) with the overlay on, K3_AMD_OVERLAY=stock for "
             "the baseline, for the region's own kernels")


def render_comparison(baseline: Census, candidate: Census, steps: int | None, layers: int) -> str:
    lines = []
    ranks = max(len(baseline.ranks), 1), max(len(candidate.ranks), 1)
    if len(baseline.ranks) != len(candidate.ranks):
        lines.append(f"WARNING: the baseline has {len(baseline.ranks)} rank trace(s), the candidate "
                     f"{len(candidate.ranks)}: the summed tables compare different deployments; per-rank figures "
                     "divide by each arm's own count. Profile both arms with the same parallelism.")
    for fusion, kinds in FUSION_KERNELS.items():
        rows = []
        region = [0.0, 0.0]
        patterns = (*kinds["adds"], *kinds["removes"])
        by_region = {side: region_claims(census, fusion, patterns) for side, census in (("b", baseline),
                                                                                       ("c", candidate))}
        missing = [name for side, name in (("b", "baseline"), ("c", "candidate")) if by_region[side] is None]
        claimed = {side: by_region[side] if not missing else _claims(census, patterns)
                   for side, census in (("b", baseline), ("c", candidate))}
        for pattern in (*kinds["removes"], *kinds["adds"]):
            b, c = claimed["b"][pattern], claimed["c"][pattern]
            if b.count or c.count:
                rows.append([pattern, f"{b.count} × {b.mean_us:.2f} = {b.total_us:.1f}",
                             f"{c.count} × {c.mean_us:.2f} = {c.total_us:.1f}"])
                region[0] += b.total_us
                region[1] += c.total_us
        if not rows:
            continue
        how = (NO_RANGES.format(side=" and ".join(missing), region=FUSION_REGIONS[fusion]) if missing
               else f"counted inside the overlay's {FUSION_REGIONS[fusion]} ranges")
        lines.append(f"\n{fusion} (summed over ranks; count × mean µs = total µs; {how})")
        lines += _table(rows, ["kernel", "baseline", "candidate"])
        if region[1]:
            lines.append(f"{fusion} region: {region[0]:.1f} µs -> {region[1]:.1f} µs ({region[0] / region[1]:.2f}x)")
        if steps:
            per = [r / (n * steps * layers) for r, n in zip(region, ranks, strict=True)]
            lines.append(f"per MLA layer per decode step and rank ({layers} layers x {steps} steps): "
                         f"{per[0]:.2f} µs -> {per[1]:.2f} µs")
    b_launch, c_launch = baseline.launches() / ranks[0], candidate.launches() / ranks[1]
    if steps:
        b_launch, c_launch = b_launch / steps, c_launch / steps
    delta = c_launch - b_launch
    unit = "per rank per step" if steps else "per rank"
    lines.append(f"\nkernel launches {unit}: {b_launch:.0f} -> {c_launch:.0f} "
                 f"({delta:+.0f}, {100 * delta / b_launch if b_launch else 0:+.1f}%)")
    return "\n".join(lines)
