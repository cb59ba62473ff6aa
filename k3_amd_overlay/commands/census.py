"""Kernel census over PyTorch profiler traces (the Kineto JSON that vLLM's ``--profiler-config``
torch profiler writes, one per rank, ``.json`` or ``.json.gz``): GPU kernel launches per rank,
counted and timed, before and after a fusion, with the cheap invariant "fused kernel count =
MLA layers x decode steps" checkable by ``--expect``.

The traces are read directly: a Kineto trace is a JSON object whose ``traceEvents`` hold one
complete event (``ph: X``) per GPU kernel with ``cat`` "kernel" (CUDA and ROCm alike, graph
replays included). Maintained analysers (HolisticTraceAnalysis, AMD TraceLens) do much more but
pull in pandas and friends that a stock serving image lacks, for what is a group-by over names.
Each number read from an event (a kernel's ``dur``, an overlay range's ``ts`` and ``dur``, a
launch's ``ts``, a ``correlation`` id) must be a finite number, a duration 0 or more: anything else,
or none, is a ``TraceError`` naming the file, the event and the value, never a guessed 0; events
whose numbers the census never reads may carry anything.

Names alone cannot tell a fusion's kernels apart from the model's others (hipBLASLt names every GEMM
``Cijk_...``; every RMSNorm matches ``rms_norm_kernel``). Where the overlay installs a site (stock
mode too, on the releases regions.py names) it opens profiler ranges around the regions its fusions
replace, and each
kernel is attributed to the range its launch was made in (the kernel's ``correlation`` id leads to
its launch on a CPU thread): the comparison then counts only kernels inside those ranges, and inside
a decode range a GEMM only where the region's own work follows it (the W_UK absorption precedes the
KV write, concat and quant or the fused launch; the W_UV GEMM after the attention kernel does not).
Traces without the ranges (overlay off, CUDA-graph replays) fall back to names, and say so; then the
kernels no fusion touches (the table claims none of them: attention, the model's other GEMMs, MoE,
all-reduce) must have run in both arms, as often on every rank, or nothing shows that the arms profiled
the same steps and no section counted by name stands.

Each kernel counts in one section, that of the launch that replaced it, and a fusion has a section
only where its own launch, an overlay kernel (``OVERLAY_KERNELS``), ran in the candidate: vLLM's and
AITER's fused kernels of the table alone are vLLM's own fusion, or the overlay's aiter or vllm
provider launching the same kernel, which neither names nor ranges tell apart, so never the
overlay's fusion by this evidence. The absorbed launch also does qk_cache's work
(``verdict.DOES_THE_WORK_OF``), so where only it ran the kernels it removed are its own, and where
both launches ran they share one section (the baseline cannot say which stock kernel each replaced).
No ratio comes from evidence that cannot carry one: an empty trace, two traces of one rank (profiler
sessions summed as one), a copy of a trace given as another rank's (byte for byte the same: no two
ranks' traces are), fewer ranks than the traces' ``distributedInfo`` world size, different rank
sets, arms on different GPUs (``deviceProperties``), nested overlay ranges, one arm (or some ranks)
with a region's ranges and the other without, a baseline that ran the fused launch or none of the
kernels it replaces; the comparison names the reason and does not hold. Each ``--expect`` is judged
on its own, and an empty trace, two traces of one rank, a copy or missing ranks satisfy none. One file
named twice (a path twice, a file beside the folder holding it) is refused: a usage error."""

from __future__ import annotations

import bisect
import gzip
import hashlib
import itertools
import json
import math
import os
import re
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_values
from k3_amd_overlay.commands.usage import UsageError
from k3_amd_overlay.commands.verdict import DOES_THE_WORK_OF
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
# The overlay's own kernels (kernels/names.py). The table's other added kernels are vLLM's or AITER's:
# vLLM launches them itself where it fuses the layer (the overlay's decision ``upstream``), and the
# overlay's aiter and vllm providers launch the same ones, which neither a name nor the overlay's
# ranges (open around vLLM's own fused calls too) tell apart; only these prove the overlay's fusion.
OVERLAY_KERNELS = frozenset({QK_CACHE_KERNEL, ABSORB_QK_CACHE_KERNEL, ABSORB_FP8_QK_CACHE_KERNEL,
                             ABSORB_MXFP4_QK_CACHE_KERNEL, STATIC_QUANT_KERNEL, RMSNORM_PAIR_KERNEL})
KERNEL_CATEGORIES = frozenset({"kernel", "gpu_op"})
# The patterns of GEMM kernels: inside a decode range, the W_UK absorption's (before the region's
# own work) and the W_UV up-projection's (after the attention kernel) look alike.
GEMM_PATTERNS = frozenset({"batched_gemm_a8w8", "batched_gemm_a16wfp4", "bmm", "gemm", "Cijk_", "nvjet"})
FUSION_REGIONS = {QKV_NORM: QKV_NORM_REGION, QK_CACHE: DECODE_REGION, ABSORB_QK_CACHE: DECODE_REGION}
RANGE_CATEGORIES = frozenset({"user_annotation"})
# The one kernel no fusion's table claims that the overlay's decode may leave out, so that it runs in the
# baseline alone: vLLM's rotation of q_pe and k_pe, which the fused launches skip where it is the identity
# (the fusions' predicate).
BASELINE_ALONE = "rotary_embedding"
MOST_STEPS = 10**9  # the largest --steps or --layers (a count of decode steps or layers, not of anything larger)
# What vLLM 0.33 writes beside the ranks' traces in a profiler folder, read only where named: the API
# frontend's CPU-only trace (``<host>_<pid>.async_llm.<time>.pt.trace.json.gz``, vllm/v1/engine/async_llm.py,
# unless the profiler config's ``ignore_frontend``) and, with ``capture_torch_profiler``, rank 0's trace
# of its CUDA-graph capture in a ``capture_traces`` folder (vllm/v1/worker/gpu_model_runner.py).
NOT_A_RANK = re.compile(r".*\.async_llm\..*")
CAPTURE_FOLDER = "capture_traces"


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
    """Kernel statistics per rank (rank -> kernel name -> stats), the kernels launched inside each
    of the overlay's profiler ranges (rank -> [(range name, [(launch time, kernel, µs)])]), the
    overlay ranges opened inside another one (rank -> [(outer, inner)]), the files read for each
    rank, the world size each file's ``distributedInfo`` gives, the GPU names its
    ``deviceProperties`` give, and each file whose bytes an earlier one's repeat."""

    ranks: dict[str, dict[str, KernelStats]] = field(default_factory=dict)
    regions: dict[str, list[tuple[str, list[tuple[float, str, float]]]]] = field(default_factory=dict)
    nested: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # rank -> [(outer, inner) range]
    files: dict[str, list[Path]] = field(default_factory=dict)
    world_sizes: dict[Path, int] = field(default_factory=dict)
    gpus: set[str] = field(default_factory=set)
    copies: list[tuple[Path, Path]] = field(default_factory=list)  # (a file, a later one of the same bytes)
    digests: dict[bytes, Path] = field(default_factory=dict)  # each trace's sha256 -> the first file holding it
    unranked: list[Path] = field(default_factory=list)  # files naming no rank (given one by their place)

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

    def counted_as(self, name: str, rank: str) -> dict[str, int]:
        """The kernels of one rank that ``--expect NAME`` counts, by kernel name: those containing
        NAME, less those the census's table gives to a longer pattern than NAME's own (with NAME
        "qk_cache_kernel", "absorb_qk_cache_kernel" is the absorbed launch, not a qk_cache launch)."""
        own = claiming_pattern(name)
        return {kernel: stats.count for kernel, stats in self.ranks[rank].items()
                if name in kernel and (own is None or claiming_pattern(kernel) == own)}

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
        if _looked_at(item, item.is_dir):
            files += _traces_under(item)
        elif _looked_at(item, item.is_file):
            files.append(item)
        elif _looked_at(item, item.exists):
            raise TraceError(f"{item}: not a regular file (a FIFO, a socket or a device): name a trace file")
        else:
            raise TraceError(f"{item}: no such file or directory")
    if not files:
        raise TraceError(f"no .json or .json.gz trace found in {', '.join(map(str, paths))}")
    _refuse_named_twice(files)
    return files


def _refuse_named_twice(files: list[Path]) -> None:
    """A TraceError where two of ``files`` are one file (one path given twice, a file given beside the
    folder holding it, a link to it): read twice, one trace would count as two ranks."""
    seen: dict[Path, Path] = {}
    for path in files:
        first = seen.setdefault(path.resolve(), path)
        if first is not path:
            named = f"{path}" if str(first) == str(path) else f"{first} and {path}: one file ({path.resolve()})"
            raise TraceError(f"{named} named twice (a path given twice, or a file given beside the folder holding "
                             f"it): read twice, one trace would count as two ranks; name each rank's trace once")


def _looked_at(path: Path, test: Callable[[], bool]) -> bool:
    """``test()`` (``path.is_dir`` and the like), or a TraceError naming ``path`` where it cannot be
    looked at: a folder above it that can be listed but not searched (mode r--)."""
    try:
        return test()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _traces_under(directory: Path) -> list[Path]:
    """The trace files (regular files named ``*.json`` or ``*.json.gz``) under ``directory``: never a
    FIFO (reading one would block), a folder or a device; a folder it cannot list is an error, not an
    empty census."""
    found: list[Path] = []

    def refuse(exc: OSError) -> None:
        raise TraceError(f"{exc.filename or directory}: cannot list ({exc.strerror or exc})")

    for root, folders, names in os.walk(directory, onerror=refuse, followlinks=False):
        folders[:] = [f for f in folders if f != CAPTURE_FOLDER]  # graph-capture traces: no served step
        found += [Path(root, n) for n in names if n.endswith((".json", ".json.gz")) and not NOT_A_RANK.fullmatch(n)
                  and _looked_at(Path(root, n), Path(root, n).is_file)]
    return sorted(found)


def trace_bytes(path: Path) -> bytes:
    """The JSON text of the trace at ``path`` (gunzipped where it is ``.gz``), as bytes."""
    try:
        return gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{path}: cannot read ({type(exc).__name__}: {exc}); truncated or not gzip?") from None
    except MemoryError:
        raise TraceError(f"{path}: too large to read in this process's memory; profile a shorter window") from None


def load_trace(path: Path, raw: bytes | None = None) -> dict[str, Any]:
    """The trace at ``path`` (``raw``: its ``trace_bytes``, where already read)."""
    raw = trace_bytes(path) if raw is None else raw
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not JSON ({exc}); a truncated trace?") from None
    except (RecursionError, ValueError) as exc:  # nested too deeply; an integer of too many digits
        raise TraceError(f"{path}: not a trace JSON can hold ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path}: JSON without a traceEvents list: not a PyTorch profiler trace")
    return data


def rank_of(path: Path, data: dict[str, Any], index: int) -> str:
    """The rank the trace names (its ``distributedInfo``, else its file name), else ``index`` (see
    ``Census.unranked``)."""
    return named_rank(path, data) or str(index)


def named_rank(path: Path, data: dict[str, Any]) -> str | None:
    info = data.get("distributedInfo")
    if isinstance(info, dict) and "rank" in info:
        return str(info["rank"])
    match = re.search(r"rank[_-]?(\d+)", path.name) or re.search(r"_(\d+)\.(?:pt\.)?trace", path.name)
    return match.group(1) if match else None


def world_size_of(path: Path, data: dict[str, Any]) -> int | None:
    """The world size the trace's ``distributedInfo`` gives (None: it gives none)."""
    info = data.get("distributedInfo")
    if not isinstance(info, dict) or "world_size" not in info:
        return None
    size = info["world_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TraceError(f"{path}: distributedInfo world_size {size!r} is not a number of ranks (a whole number, "
                         "1 or more)")
    return size


def gpu_names(data: dict[str, Any]) -> set[str]:
    """The GPU names the trace's ``deviceProperties`` give (none where it gives none)."""
    devices = data.get("deviceProperties")
    if not isinstance(devices, list):
        return set()
    return {str(d["name"]) for d in devices if isinstance(d, dict) and d.get("name")}


def read_census(paths: Iterable[str | Path]) -> Census:
    paths = list(paths)
    census = Census()
    for index, path in enumerate(trace_files(paths)):
        raw = trace_bytes(path)
        first = census.digests.setdefault(hashlib.sha256(raw).digest(), path)
        if first is not path:
            census.copies.append((first, path))
        data = load_trace(path, raw)
        named = named_rank(path, data)
        rank = named or str(index)  # rank_of's rule, the name read once
        if named is None:
            census.unranked.append(path)
        census.files.setdefault(rank, []).append(path)
        size = world_size_of(path, data)
        if size is not None:
            census.world_sizes[path] = size
        census.gpus |= gpu_names(data)
        kernels = census.ranks.setdefault(rank, {})
        events = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
        gpu = [e for e in events if str(e.get("cat", "")).lower() in KERNEL_CATEGORIES]
        for event in gpu:
            stats = kernels.setdefault(str(event.get("name")), KernelStats())
            stats.count += 1
            stats.total_us += _number(path, event, "dur", least=0.0)
        found, nested = _region_kernels(path, events, gpu)
        census.regions.setdefault(rank, []).extend(found)
        census.nested.setdefault(rank, []).extend(nested)
    # durations are never negative: where the sum of all is finite, so is every sum the census shows
    if not math.isfinite(sum(s.total_us for kernels in census.ranks.values() for s in kernels.values())):
        raise TraceError(f"the kernel durations of {', '.join(map(str, paths))} sum beyond what a float holds: not a "
                         "profiler trace's times")
    return census


def _bad(path: Path, event: dict[str, Any], key: str, fields: dict[str, Any], expected: str) -> TraceError:
    cat = str(event.get("cat", ""))
    has = f"has {key}={fields[key]!r}" if key in fields else f"has no {key}"
    return TraceError(f"{path}: {cat + ' ' if cat else ''}event {event.get('name')!r} {has}, expected {expected}")


def _number(path: Path, event: dict[str, Any], key: str, least: float | None = None,
            fields: dict[str, Any] | None = None) -> float:
    """A number the census reads from an event (from ``fields``, the event's own by default): missing,
    not a finite number or below ``least``, the file cannot be counted or attributed."""
    fields = event if fields is None else fields
    value = json_values.finite(fields.get(key))
    if value is not None and (least is None or value >= least):
        return value
    raise _bad(path, event, key, fields, "a number" + ("" if least is None else f", {least:g} or more"))


def _thread(path: Path, event: dict[str, Any]) -> tuple[Any, Any]:
    """The (pid, tid) of a range or launch: kept as given (Kineto writes numbers and names), never a list."""
    for key in ("pid", "tid"):
        if isinstance(event.get(key), list | dict):
            raise _bad(path, event, key, event, "a process or thread id (a number or a name)")
    return event.get("pid"), event.get("tid")


def _correlation(path: Path, event: dict[str, Any]) -> float | None:
    """The id linking a kernel to its launch (None: the event has none, as a graph replay's kernel)."""
    args = event.get("args")
    if not isinstance(args, dict) or "correlation" not in args:
        return None
    return _number(path, event, "correlation", fields=args)


def _region_kernels(path: Path, events: list[dict[str, Any]], gpu: list[dict[str, Any]]
                    ) -> tuple[list[tuple[str, list[Any]]], list[tuple[str, str]]]:
    """Each overlay range of one trace with the kernels launched inside it (innermost range wins),
    and each (outer, inner) pair of overlay ranges where one opened inside another on one thread:
    the overlay never nests them, so such a trace cannot be attributed (see ``compare``)."""
    ranges: dict[tuple[Any, Any], list[tuple[float, float, int]]] = defaultdict(list)
    found: list[tuple[str, list[Any]]] = []
    for event in events:
        name = str(event.get("name", ""))
        if str(event.get("cat", "")).lower() in RANGE_CATEGORIES and name.startswith(REGION_PREFIX):
            start = _number(path, event, "ts")
            ranges[_thread(path, event)].append((start, start + _number(path, event, "dur", least=0.0), len(found)))
            found.append((name, []))
    if not found:
        return [], []
    for spans in ranges.values():
        spans.sort()
    nested = [(found[i][0], found[j][0]) for spans in ranges.values() for i, j in _opened_inside(spans)]
    launches = {}
    starts_of: dict[tuple[Any, Any], tuple[list[float], list[float]]] = {}
    for event in events:
        if str(event.get("cat", "")).lower() not in KERNEL_CATEGORIES:
            corr = _correlation(path, event)
            if corr is not None:
                launches[corr] = (_thread(path, event), _number(path, event, "ts"))
    for kernel in gpu:
        launch = launches.get(_correlation(path, kernel))
        if launch is None:
            continue
        thread, at = launch
        spans = ranges.get(thread, [])
        if thread not in starts_of:
            starts_of[thread] = ([start for start, _, _ in spans],
                                 list(itertools.accumulate((end for _, end, _ in spans), max)))
        starts, reach = starts_of[thread]
        # the innermost range holding the launch: of those opened at or before it, the latest still
        # open; none once no earlier range reaches the launch (a kernel between ranges: most of them)
        for index in range(bisect.bisect_right(starts, at) - 1, -1, -1):
            if reach[index] < at:
                break
            _, end, i = spans[index]
            if at <= end:
                found[i][1].append((at, str(kernel.get("name")), _number(path, kernel, "dur", least=0.0)))
                break
    for _, kernels in found:
        kernels.sort()
    return found, nested


def _opened_inside(spans: list[tuple[float, float, int]]) -> list[tuple[int, int]]:
    """(outer, inner) for each range of one thread opened inside an earlier-opened one still open
    (``spans`` sorted by start: (start, end, index)), in one pass: an inner range's outer is the
    open range reaching furthest."""
    pairs, reach = [], None  # reach: (end, index) of the range open furthest so far
    for start, end, index in spans:
        if reach is not None and start < reach[0]:
            pairs.append((reach[1], index))
        if reach is None or end > reach[0]:
            reach = (end, index)
    return pairs


TABLE_PATTERNS = frozenset(p for kinds in FUSION_KERNELS.values() for kind in kinds.values() for p in kind)


def claiming_pattern(name: str) -> str | None:
    """The longest pattern of the table that ``name`` contains (None: no fusion's kernel)."""
    return max((p for p in TABLE_PATTERNS if p in name), key=len, default=None)


COUNT = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit takes "²", which int() refuses)


def check_steps(steps: int | None, baseline: list[str] | None, layers: int | None = None) -> None:
    """A UsageError where ``--steps`` is given without ``--baseline``, or ``--layers`` without
    ``--steps``: the steps divide only the comparison's figures (launches per step, µs per layer and
    step), the layers only the per-layer ones, so alone each would be dropped without a word
    (``--expect`` counts per rank over the whole window)."""
    if steps is not None and not baseline:
        raise UsageError(f"--steps {steps} without --baseline: the steps divide the before/after comparison's "
                         "figures (per step, per layer and step), which only --baseline gives; give --baseline "
                         "TRACE ..., or leave --steps out (--expect counts per rank over the whole window)")
    if layers is not None and steps is None:
        raise UsageError(f"--layers {layers} without --steps: the layers divide only the comparison's figures per "
                         "layer and step, which --steps (with --baseline) gives; give --steps N, or leave --layers out")


def parse_expectations(items: Iterable[str]) -> list[tuple[str, int]]:
    parsed = []
    for item in items:
        name, sep, count = item.rpartition("=")
        if not sep or not name or not COUNT.fullmatch(count):
            raise ValueError(f"--expect {item!r}: write NAME=COUNT (a kernel-name substring and a count per rank: "
                             "0 or more, in at most 18 ASCII digits)")
        parsed.append((name, int(count)))
    return parsed


def empty_ranks(census: Census) -> list[str]:
    """The ranks whose trace holds no GPU kernel at all: no evidence, for or against anything."""
    return [rank for rank in sorted(census.ranks) if not census.launches(rank)]


EMPTY = ("rank {rank}: the trace has no GPU kernel at all, so it proves nothing (profiled without the CUDA/ROCm "
         "activity, or a window where nothing ran)")
ONE_SESSION = "keep one profiler session per directory, one trace per rank"


def rank_problems(census: Census) -> list[str]:
    """Why the traces are not one trace per rank of a whole deployment: a file that is a copy of
    another (no evidence of a second rank), a rank with several traces (their kernels would be summed
    as one session's), traces that disagree on the world size, or ranks of the world size their
    ``distributedInfo`` gives without a trace."""
    problems = [f"{first} and {copy}: the same trace byte for byte, a copy (no two ranks' traces are: each "
                f"has its own process ids and times), so one rank's kernels would count twice; {ONE_SESSION}"
                for first, copy in census.copies]
    problems += [f"rank {rank}: {len(files)} traces ({', '.join(map(str, files))}) would be summed as one; "
                 f"{ONE_SESSION}" for rank, files in sorted(census.files.items()) if len(files) > 1]
    first: dict[int, Path] = {}  # world size -> the first file read that gives it
    for path, size in census.world_sizes.items():
        first.setdefault(size, path)
    if first and census.unranked:
        problems.append(f"{', '.join(map(str, census.unranked))}: no rank in the trace (distributedInfo) or its name, "
                        "beside traces of a world of ranks: it cannot stand for one of them (a stray file, or a copy "
                        f"re-written without its rank?); {ONE_SESSION}")
    if len(first) > 1:
        problems.append("traces disagree on the world size (distributedInfo): " + ", ".join(
            f"{size} in {path}" for size, path in sorted(first.items())) + f"; {ONE_SESSION}")
    elif first:
        (size,) = first
        named, more = missing_ranks(census, size)
        if named:
            listed = ", ".join(named) + (f" and {more} more" if more else "")
            problems.append(f"rank{'s' if len(named) > 1 else ''} {listed}: no trace, though distributedInfo gives "
                            f"world size {size}: a verdict would rest on {len(census.ranks)} of its {size} ranks; "
                            "profile every rank, one trace per rank")
    return problems


def rank_number(rank: str) -> int | None:
    """The rank a trace's rank name is (as ``str(rank)`` writes it), None where it is no such number."""
    if not COUNT.fullmatch(rank) or str(int(rank)) != rank:
        return None
    return int(rank)


MISSING_NAMED = 16  # the missing ranks a problem names; the rest are counted (a world size may be any number)


def missing_ranks(census: Census, size: int) -> tuple[list[str], int]:
    """The first ``MISSING_NAMED`` ranks below ``size`` without a trace, and how many more there are,
    found in time bounded by the traces read, not by ``size`` (a trace's world_size may be huge)."""
    present = {number for rank in census.ranks if (number := rank_number(rank)) is not None and number < size}
    named: list[str] = []
    rank = 0
    while rank < size and len(named) < MISSING_NAMED:
        if rank not in present:
            named.append(str(rank))
        rank += 1
    return named, size - len(present) - len(named)


@dataclass
class Expectation:
    """One ``--expect NAME=COUNT``, judged on its own: what each rank ran and why it fails."""

    name: str
    count: int
    ranks: dict[str, int]
    kernels: list[str]  # the kernel names it counted
    problems: list[str]

    @property
    def holds(self) -> bool:
        return not self.problems

    def line(self) -> str:
        got = ", ".join(f"rank {rank}: {n}" for rank, n in self.ranks.items()) or "no rank"
        return f"expect {self.name}={self.count} per rank: {'ok' if self.holds else 'FAILED'} ({got})"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "count": self.count, "holds": self.holds, "ranks": self.ranks,
                "kernels": self.kernels, "problems": self.problems}


def judge_expectations(census: Census, expectations: list[tuple[str, int]]) -> list[Expectation]:
    """Each NAME must have run exactly COUNT times on every rank, each rank's trace holding GPU
    kernels (an empty trace never satisfies a count, not even 0)."""
    judged = []
    empty, ranks = empty_ranks(census), rank_problems(census)
    for name, count in expectations:
        per_rank = {rank: census.counted_as(name, rank) for rank in sorted(census.ranks)}
        problems = ranks + [EMPTY.format(rank=rank) for rank in empty]
        problems += [f"rank {rank}: kernels matching {name!r} ran {sum(found.values())} times, expected {count}"
                     for rank, found in per_rank.items() if rank not in empty and sum(found.values()) != count]
        if not census.ranks:
            problems.append("no trace was read")
        judged.append(Expectation(name, count, {rank: sum(found.values()) for rank, found in per_rank.items()},
                                  sorted({kernel for found in per_rank.values() for kernel in found}), problems))
    return judged


def check_expectations(census: Census, expectations: list[tuple[str, int]]) -> list[str]:
    """Problems of all expectations together (each judged by ``judge_expectations``)."""
    return [problem for judged in judge_expectations(census, expectations) for problem in judged.problems]


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


def _add(stats: KernelStats, count: int, total_us: float) -> None:
    stats.count += count
    stats.total_us += total_us


def name_claims(census: Census, patterns: tuple[str, ...]) -> dict[str, KernelStats]:
    """Per pattern, the stats (summed over ranks) of the kernels it claims, by name alone."""
    claimed: dict[str, KernelStats] = {pattern: KernelStats() for pattern in patterns}
    for name, stats in census.total().items():
        pattern = claiming_pattern(name)
        if pattern in claimed:
            _add(claimed[pattern], stats.count, stats.total_us)
    return claimed


def _region_claims(census: Census, region: str, patterns: tuple[str, ...], own_work: set[str]
                   ) -> dict[str, KernelStats]:
    claimed = {pattern: KernelStats() for pattern in patterns}
    for kernels in (kernels for regions in census.regions.values() for name, kernels in regions if name == region):
        marks = [claiming_pattern(name) for _, name, _ in kernels]
        for i, ((_, _, dur), pattern) in enumerate(zip(kernels, marks, strict=True)):
            if pattern not in claimed:
                continue
            if pattern in GEMM_PATTERNS and not own_work.intersection(marks[i + 1:]):
                continue
            _add(claimed[pattern], 1, dur)
    return claimed


def _own_work(fusions: tuple[str, ...]) -> set[str]:
    return {p for fusion in fusions for kind in FUSION_KERNELS[fusion].values() for p in kind} - GEMM_PATTERNS


def region_claims(census: Census, fusion: str, patterns: tuple[str, ...]) -> dict[str, KernelStats] | None:
    """Per pattern of one fusion, the kernels launched inside its range (None where the traces have
    none of its ranges). Inside a decode range a GEMM counts only where a kernel of the fusion's own
    region work follows it in that range: the W_UK absorption, not the W_UV up-projection."""
    region = FUSION_REGIONS[fusion]
    if not any(name == region for regions in census.regions.values() for name, _ in regions):
        return None
    return _region_claims(census, region, patterns, _own_work((fusion,)))


NO_RANGES = ("counted by kernel name alone: the {side} traces have no {region} ranges (the overlay off, or "
             "kernels replayed from CUDA graphs), so every matching kernel counts, in or out of the region (every "
             "GEMM, every RMSNorm); profile eager (--enforce-eager) with the overlay on, K3_AMD_OVERLAY=stock for "
             "the baseline, for the region's own kernels")
PROFILE_ALIKE = ("profile both arms alike: eager (--enforce-eager) with the overlay on, K3_AMD_OVERLAY=stock for "
                 "the baseline")


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


@dataclass
class Section:
    """One region's before/after: the fusions whose launches ran in the candidate (one, or several
    whose launches share the stock kernels they replace), each kernel counted once."""

    fusions: tuple[str, ...]
    region: str
    by_ranges: bool
    rows: list[tuple[str, str, KernelStats, KernelStats]]  # (pattern, "removes"/"adds", baseline, candidate)
    launched: dict[str, int]  # fusion -> its own launches in the candidate
    ranks: tuple[int, int]
    steps: int | None
    layers: int

    @property
    def title(self) -> str:
        return " + ".join(self.fusions)

    def total(self, side: int) -> KernelStats:
        found = KernelStats()
        for row in self.rows:
            _add(found, row[2 + side].count, row[2 + side].total_us)
        return found

    @property
    def ratio(self) -> float | None:
        before, after = self.total(0).total_us, self.total(1).total_us
        return before / after if after else None

    def per_layer_step(self) -> tuple[float, float] | None:
        if not self.steps:
            return None
        return tuple(self.total(side).total_us / (self.ranks[side] * self.steps * self.layers)  # type: ignore
                     for side in (0, 1))

    def render(self) -> list[str]:
        how = f"counted inside the overlay's {self.region} ranges" if self.by_ranges else NO_RANGES.format(
            side="baseline and candidate", region=self.region)
        if len(self.fusions) > 1:
            how = ("the launches of each ran in the candidate and the baseline's kernels cannot be told apart by the "
                   "launch that replaced them: one section, each kernel once; " + how)
        lines = [f"\n{self.title} (summed over ranks; count × mean µs = total µs; {how})"]
        lines += _table([[pattern, f"{b.count} × {b.mean_us:.2f} = {b.total_us:.1f}",
                          f"{c.count} × {c.mean_us:.2f} = {c.total_us:.1f}"] for pattern, _, b, c in self.rows],
                        ["kernel", "baseline", "candidate"])
        before, after = self.total(0), self.total(1)
        lines.append(f"{self.title} region: {before.total_us:.1f} µs -> {after.total_us:.1f} µs ("
                     + (f"{self.ratio:.2f}x)" if self.ratio is not None else
                        "no ratio: the candidate's kernels carry no duration)"))
        lines.append(f"{self.title} region launches: {before.count} -> {after.count} ({after.count - before.count:+d})")
        per = self.per_layer_step()
        if per is not None:
            lines.append(f"per MLA layer per decode step and rank ({self.layers} layers x {self.steps} steps): "
                         f"{per[0]:.2f} µs -> {per[1]:.2f} µs")
        return lines

    def to_json(self) -> dict[str, Any]:
        def stats(s: KernelStats) -> dict[str, Any]:
            return {"count": s.count, "total_us": round(s.total_us, 3), "mean_us": round(s.mean_us, 3)}

        per = self.per_layer_step()
        before, after = self.total(0), self.total(1)
        return {"fusions": list(self.fusions), "region": self.region,
                "counted": "inside ranges" if self.by_ranges else "by name",
                "kernels": [{"kernel": p, "kind": kind, "baseline": stats(b), "candidate": stats(c)}
                            for p, kind, b, c in self.rows],
                "baseline": stats(before), "candidate": stats(after),
                "ratio": None if self.ratio is None else round(self.ratio, 3),
                "launch_change": after.count - before.count, "launched": self.launched,
                "per_layer_step_us": None if per is None else {
                    "layers": self.layers, "steps": self.steps,
                    "baseline": round(per[0], 3), "candidate": round(per[1], 3)}}


@dataclass
class Comparison:
    """The before/after of every region: its sections, each fusion without one and why, what refuses
    the comparison (it holds only with no problem and at least one section) and the launch change."""

    sections: list[Section] = field(default_factory=list)
    not_run: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    launches: tuple[float, float] | None = None
    steps: int | None = None

    @property
    def holds(self) -> bool:
        return bool(self.sections) and not self.problems

    def _launch_unit(self) -> str:
        return "per rank per step" if self.steps else "per rank"

    def render(self) -> str:
        lines = [f"\nNO COMPARISON: {problem}" for problem in self.problems]
        for section in self.sections:
            lines += section.render()
        lines += [f"\n{note}" for note in self.not_run.values()]
        if self.launches is not None:
            before, after = self.launches
            delta = after - before
            lines.append(f"\nkernel launches {self._launch_unit()}: {before:.0f} -> {after:.0f} ({delta:+.0f}, "
                         f"{100 * delta / before:+.1f}%)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        launches = None
        if self.launches is not None:
            before, after = self.launches
            launches = {"unit": self._launch_unit(), "baseline": round(before, 3), "candidate": round(after, 3),
                        "change": round(after - before, 3), "percent": round(100 * (after - before) / before, 3)}
        return {"holds": self.holds, "problems": self.problems, "sections": [s.to_json() for s in self.sections],
                "not_run": self.not_run, "launches": launches}


def _evidence_problems(baseline: Census, candidate: Census) -> list[str]:
    """What makes the two arms no evidence for a comparison at all."""
    problems = []
    for side, census in (("baseline", baseline), ("candidate", candidate)):
        if not census.ranks:
            problems.append(f"the {side} has no trace")
        problems += [f"the {side}'s " + problem for problem in rank_problems(census)]
        problems += [f"the {side}'s " + EMPTY.format(rank=rank) for rank in empty_ranks(census)]
    both = [(baseline.digests[d], candidate.digests[d]) for d in baseline.digests.keys() & candidate.digests.keys()]
    problems += [f"{base} (baseline) and {cand} (candidate): the same trace byte for byte, so one run's kernels "
                 "would stand for both arms; profile each arm in its own run" for base, cand in sorted(both)]
    if baseline.ranks and candidate.ranks and sorted(baseline.ranks) != sorted(candidate.ranks):
        base, cand = ", ".join(sorted(baseline.ranks)), ", ".join(sorted(candidate.ranks))
        problems.append(f"the baseline has {len(baseline.ranks)} rank trace(s) (ranks {base}), the candidate "
                        f"{len(candidate.ranks)} (ranks {cand}): different deployments; profile both arms with the "
                        "same parallelism, one trace per rank")
    if baseline.gpus and candidate.gpus and baseline.gpus != candidate.gpus:
        problems.append(f"the baseline ran on {', '.join(sorted(baseline.gpus))}, the candidate on "
                        f"{', '.join(sorted(candidate.gpus))} (deviceProperties): kernel times of different GPUs "
                        "say nothing of a fusion; profile both arms on the same GPU")
    return problems


def _range_problems(baseline: Census, candidate: Census, region: str) -> tuple[list[str], bool]:
    """Why the region cannot be compared (nested ranges; one arm, or some ranks, with ranges and others
    without), and whether both arms have its ranges on every rank."""
    problems, has = [], {}
    for side, census in (("baseline", baseline), ("candidate", candidate)):
        nested = [(rank, outer, inner) for rank, pairs in sorted(census.nested.items()) for outer, inner in pairs
                  if region in (outer, inner)]
        if nested:
            rank, outer, inner = nested[0]
            problems.append(f"{region}: the {side} has {len(nested)} overlay range(s) opened inside another (rank "
                            f"{rank}: {inner} inside {outer}); the overlay never nests them (a site patched twice, or "
                            "another tool's ranges under its name?), so its kernels cannot be attributed")
        has[side] = [rank for rank in sorted(census.ranks)
                     if any(name == region for name, _ in census.regions.get(rank, []))]
    full = {side: len(has[side]) == len(census.ranks) for side, census in (("baseline", baseline),
                                                                             ("candidate", candidate))}
    if any(has.values()) and not all(full.values()):
        where = "; ".join(f"the {side}: " + ("every rank" if full[side] else "ranks " + ", ".join(has[side])
                                              if has[side] else "none") for side in ("baseline", "candidate"))
        problems.append(f"{region}: only some traces have its ranges ({where}): one arm counted by range and the other "
                        f"by name would credit kernels outside the region; {PROFILE_ALIKE}")
    return problems, all(full.values())


def _untouched(census: Census, rank: str) -> dict[str, int]:
    """The launches per kernel name on one rank of the kernels no fusion touches (the table claims none
    of them): the attention kernel, the model's other GEMMs, MoE, all-reduce, the sampler."""
    return {name: stats.count for name, stats in census.ranks[rank].items() if claiming_pattern(name) is None}


def _name_window_problems(baseline: Census, candidate: Census) -> list[str]:
    """Counted by name (no ranges to count the steps by), where nothing shows that the arms profiled the
    same window: on some rank a kernel no fusion touches ran a different number of times in the two arms
    (for the same steps it runs the same), or the arms ran no such kernel in common."""
    how = "counted by kernel name (no overlay ranges to count the steps by), and on rank"
    for rank in sorted(baseline.ranks):
        base, cand = _untouched(baseline, rank), _untouched(candidate, rank)
        shared = sorted(set(base) & set(cand))
        if not shared:
            return [f"{how} {rank} the arms ran no kernel in common that no fusion touches (the attention kernel, "
                    "the model's other GEMMs, MoE, all-reduce): nothing shows they profiled the same steps, so their "
                    "totals cannot be compared; profile the same steps in both arms with the whole model in the window "
                    "(the same requests, the same profiler window), or eager (--enforce-eager) with the overlay on, "
                    "K3_AMD_OVERLAY=stock for the baseline, whose ranges count the steps"]
        alone = sorted((set(base) ^ set(cand)) - {n for n in base if BASELINE_ALONE in n},
                       key=lambda n: -max(base.get(n, 0), cand.get(n, 0)))
        if alone:
            name = alone[0]
            side, other = ("baseline", "candidate") if name in base else ("candidate", "baseline")
            more = f" ({len(alone)} such kernels ran in one arm only)" if len(alone) > 1 else ""
            return [f"{how} {rank} {name}, which no fusion touches, ran {max(base.get(name, 0), cand.get(name, 0))} "
                    f"times in the {side} and never in the {other}{more}: the arms profiled different work (a "
                    "prefill in one window, another step), so their totals cannot be compared; profile the same steps "
                    "in both arms (the same requests, the same profiler window), or eager (--enforce-eager) with the "
                    "overlay on, K3_AMD_OVERLAY=stock for the baseline, whose ranges count the steps"]
        differ = [name for name in shared if base[name] != cand[name]]
        if differ:
            name = max(differ, key=lambda n: max(base[n], cand[n]))
            more = f" ({len(differ)} such kernels differ)" if len(differ) > 1 else ""
            return [f"{how} {rank} {name}, which no fusion touches, ran {base[name]} times in the baseline and "
                    f"{cand[name]} in the candidate{more}: the arms profiled windows of different lengths, so their "
                    "totals cannot be compared; profile the same number of steps in both arms (the same requests, the "
                    "same profiler window)"]
    return []


def _window_problems(baseline: Census, candidate: Census, region: str) -> list[str]:
    """Where a rank's traces hold a different number of layer steps in the two arms, so that the arms
    profiled windows of different lengths and their totals (and the ratio of them) say nothing of the
    fusion. A step is one decode range where both arms have them on every rank (one per layer step on
    every release and mode, none nested), else one of ``region``'s own ranges (vLLM 0.29's stock norms
    open two per step: there the decode ranges count)."""
    def counts(census: Census, name: str) -> dict[str, int]:
        return {rank: sum(n == name for n, _ in census.regions.get(rank, [])) for rank in census.ranks}

    def steps_in_decode(c: Census) -> bool:  # one decode range per step on every rank, none nested
        return all(counts(c, DECODE_REGION).values()) and not any(
            DECODE_REGION in pair for pairs in c.nested.values() for pair in pairs)

    by = DECODE_REGION if steps_in_decode(baseline) and steps_in_decode(candidate) else region
    base, cand = counts(baseline, by), counts(candidate, by)
    differ = [rank for rank in sorted(base) if base[rank] != cand.get(rank)]
    if not differ:
        return []
    rank = differ[0]
    return [f"{region}: the baseline has {base[rank]} {by} ranges on rank {rank}, the candidate {cand.get(rank)}"
            + (f" ({len(differ)} ranks differ)" if len(differ) > 1 else "") + ": one range is one layer's decode "
            "step, so the arms profiled windows of different lengths and their totals cannot be compared; profile "
            "the same steps in both arms (the same requests, the same profiler window)"]


def _work_shared(fusion: str) -> set[str]:
    """The fusions whose work shares one launch with ``fusion``'s (it does theirs, or they do its)."""
    return {f for f, other in DOES_THE_WORK_OF.items() if other == fusion} | (
        {DOES_THE_WORK_OF[fusion]} if fusion in DOES_THE_WORK_OF else set())


def _launch_names(fusion: str) -> str:
    """The overlay's own kernels among the fusion's added ones: those that prove it ran."""
    return ", ".join(p for p in FUSION_KERNELS[fusion]["adds"] if p in OVERLAY_KERNELS)


def _why_no_section(fusion: str, where: str, doer: str | None, foreign: dict[str, int]) -> str:
    """Why ``fusion`` has no section: no overlay kernel of it ran in the candidate, and ``foreign``
    (pattern -> count) are the vLLM or AITER fused kernels of its table that ran instead."""
    if foreign:
        ran = ", ".join(f"{p} {n}" for p, n in foreign.items())
        head = (f"{fusion}: only vLLM's or AITER's own fused kernel ran in the candidate ({ran}, counted {where}), "
                f"no overlay kernel ({_launch_names(fusion)}): this is not the overlay's fusion but vLLM's own (the "
                "overlay's decision upstream), or the overlay's aiter or vllm provider launching the same kernel, "
                "which neither kernel names nor the overlay's ranges tell apart (k3-amd-overlay check says which ran; "
                "the triton provider runs the overlay's own kernel)")
    else:
        head = f"{fusion}: its own launch ({_launch_names(fusion)}) did not run in the candidate (counted {where})"
    return head + (f"; the {doer} launch did its work, and the kernels that launch removed are counted once, in "
                   f"{doer}'s section" if doer else ": no section, no ratio")


def _region_sections(baseline: Census, candidate: Census, region: str, by_ranges: bool, steps: int | None,
                     layers: int, comparison: Comparison) -> None:
    fusions = tuple(f for f in FUSION_KERNELS if FUSION_REGIONS[f] == region)

    def claims(census: Census, patterns: tuple[str, ...], group: tuple[str, ...]) -> dict[str, KernelStats]:
        if by_ranges:
            return _region_claims(census, region, patterns, _own_work(group))
        return name_claims(census, patterns)

    where = f"inside its {region} ranges" if by_ranges else "by kernel name"
    added = {f: claims(candidate, FUSION_KERNELS[f]["adds"], (f,)) for f in fusions}
    ran = {f: sum(s.count for s in added[f].values()) for f in fusions}
    own = {f: sum(s.count for p, s in added[f].items() if p in OVERLAY_KERNELS) for f in fusions}
    groups: list[tuple[str, ...]] = []
    for fusion in fusions:
        if not own[fusion]:  # a section is the overlay's fusion only where an overlay kernel of it ran
            doer = next((f for f in fusions if DOES_THE_WORK_OF.get(f) == fusion and own[f]), None)
            comparison.not_run[fusion] = _why_no_section(fusion, where, doer, {
                p: s.count for p, s in added[fusion].items() if s.count})
        elif not any(fusion in group for group in groups):  # one section with the fusions sharing its launch's work
            groups.append(tuple(f for f in fusions if f == fusion or (own[f] and fusion in _work_shared(f))))
    region_adds = _unique(p for f in fusions for p in FUSION_KERNELS[f]["adds"])  # every fused launch here
    for group in groups:
        adds = _unique(p for f in group for p in FUSION_KERNELS[f]["adds"])
        removes = tuple(p for p in _unique(p for f in group for p in FUSION_KERNELS[f]["removes"]) if p not in adds)
        base, cand = claims(baseline, (*removes, *adds), group), claims(candidate, (*removes, *adds), group)
        fused_in_base = claims(baseline, region_adds, group)
        own = {p: fused_in_base[p].count for p in region_adds if fused_in_base[p].count}
        title = " + ".join(group)
        if own:
            comparison.problems.append(
                f"{title}: the baseline ran the fused launch too ({', '.join(f'{p} {n}' for p, n in own.items())} "
                f"{where}): not an unfused baseline; profile it with K3_AMD_OVERLAY=stock")
            continue
        if not any(base[p].count for p in removes):
            comparison.problems.append(f"{title}: the baseline has none of the kernels its launch replaces "
                                       f"({', '.join(removes)}) {where}: nothing to compare against")
            continue
        rows = [(p, "removes" if p in removes else "adds", base[p], cand[p]) for p in (*removes, *adds)
                if base[p].count or cand[p].count]
        timeless = [side for side, i in (("baseline", 2), ("candidate", 3)) if not sum(r[i].total_us for r in rows)]
        if timeless:
            comparison.problems.append(f"{title}: the {timeless[0]}'s kernels {where} carry no duration (every dur 0): "
                                       "no ratio to give")
            continue
        comparison.sections.append(Section(group, region, by_ranges, rows, {f: ran[f] for f in group},
                                           (len(baseline.ranks), len(candidate.ranks)), steps, layers))


def compare(baseline: Census, candidate: Census, steps: int | None, layers: int) -> Comparison:
    """The before/after of each region a fusion replaces. A fusion gets a section only where an overlay
    kernel of it ran in the candidate (vLLM's or AITER's fused kernels alone are not the overlay's
    fusion); each kernel counts in one section (the absorbed launch does qk_cache's work: where it
    ran, the kernels it removed are its own). Nothing is compared from empty traces, two traces of one
    rank, missing ranks, different rank sets or GPUs, nested ranges, one arm with a region's ranges and
    one without, windows of different lengths (told by the ranges, or by name by the kernels no fusion
    touches), or a baseline that ran the fused launch."""
    comparison = Comparison(steps=steps, problems=_evidence_problems(baseline, candidate))
    if comparison.problems:
        return comparison
    windows_differ = False
    for region in _unique(FUSION_REGIONS[f] for f in FUSION_KERNELS):
        problems, by_ranges = _range_problems(baseline, candidate, region)
        if not problems and by_ranges:
            problems = _window_problems(baseline, candidate, region)
            windows_differ |= bool(problems)
        if problems:
            comparison.problems += problems
            continue
        _region_sections(baseline, candidate, region, by_ranges, steps, layers, comparison)
    window = _name_window_problems(baseline, candidate) if any(not s.by_ranges for s in comparison.sections) else []
    if window:  # no section counted by name stands where nothing shows that the windows match
        comparison.sections = [s for s in comparison.sections if s.by_ranges]
        comparison.problems += window
        windows_differ = True
    if not comparison.sections and not comparison.problems:
        comparison.problems.append("no fusion's own launch ran in the candidate: nothing to compare")
    if not windows_differ:  # launches of windows not shown to match say nothing either
        before, after = (census.launches() / len(census.ranks) / (steps or 1) for census in (baseline, candidate))
        comparison.launches = (before, after)
    return comparison


def render_comparison(baseline: Census, candidate: Census, steps: int | None, layers: int) -> str:
    return compare(baseline, candidate, steps, layers).render()
