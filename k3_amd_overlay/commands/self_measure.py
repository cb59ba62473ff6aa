"""``k3-amd-overlay measure``: each fused path timed against the stock sequence on this GPU, at this
deployment's shapes, per batch bucket; the result file the server gates its fusions by ("never
slower", measured.py).

    k3-amd-overlay measure (--heads H ... | --model DIR) [--tensor-parallel-size N]
                           [--variant bf16 fp8] [--buckets T ...] [--out DIR] [--rounds N] [--seed N] [--json]

Buckets: vLLM's default CUDA-graph capture sizes (vLLM 0.33, ``vllm/config/vllm.py``: [1, 2, 4], then
8 to 248 in steps of 8, then 256 up to ``max_cudagraph_capture_size`` in steps of 16, which
``vllm/config/compilation.py`` caps at 512 by default), or ``--buckets``. Heads per rank: ``--heads``
(given with ``--tensor-parallel-size``, it must be K3's heads over that size: a usage error otherwise),
or ``num_attention_heads`` of the model's ``config.json`` over the tensor-parallel size. KV cache: fp8
(the one the fused decode writes), in this GPU's fp8 format. W_UK absorption (``--variant``): bf16
(vLLM's ``torch.bmm``) or fp8 (AITER's Triton fp8 BMM, which must be importable: it is stock's).

Per bucket, on fresh random inputs (a padding slot among them) with every output poisoned, each fused
path's bytes are checked against the stock sequence's (bench/layer_step.py's parity check); a bucket
that is not exact is not timed and never fused. Then stock and fused are timed side by side under
CUDA/HIP-graph replay, ``--rounds`` rounds in turn, medians:

- qkv_norm: the two single-norm launches (the fastest of the benchmarks' configs) against the norm pair;
- qk_cache: the W_UK absorption, KV-cache write, ``[ql_nope | q_pe]`` concat and static fp8 query quant
  (the concat and quant the faster of vLLM's eager two launches and its default serving's one
  torch.compile'd kernel) against the absorption and the qk_cache launch;
- absorb_qk_cache (batches up to ``package.ABSORB_MAX_TOKENS`` tokens): the same stock sequence against
  the one absorbed launch.

The fused side is the overlay's own Triton launches (``measured.PROVIDER``, recorded in the file): the
server's gates speak for that provider alone, and with the file ``auto`` chooses it.

It prints the table, writes ``<arch>-<device>.measured.json`` into ``--out`` (default: see measured.py:
beside the tuned launch configs, else a per-user directory), keeping the rows of other shapes a file
for this GPU and overlay version holds where they were measured under the same conditions (launch
configs, torch, Triton, AITER, KV-cache dtype, fp8 format: ``measured.CONDITIONS``; otherwise it drops them
and says so), and exits 1 where a bucket was not exact (the file is still written: that bucket runs
stock); with ``--json`` a failed run's object says why in ``error``. It imports no vLLM, touches no
server state (no marker, no variable) and replaces the result file atomically; one bucket's tensors are
alive at a time, up to about 0.2 GiB of GPU memory at 12 heads per rank and 512 tokens, about 1 GiB at
96 heads (K3 at tensor-parallel 1; from the tensors' sizes: the run prints its peak), beside its
process's own CUDA/HIP context, so it can run in a live container beside a server that leaves that
much free, whose load then shows in the times (measure an idle GPU for numbers to keep); a bucket whose
inputs cannot be made (out of memory) is not exact, so stock runs there. On an H200,
51 buckets at 12 heads took 43 s (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files, json_values, k3, measured
from k3_amd_overlay.commands.usage import (
    EXIT_FAILED,
    Parser,
    UsageError,
    describe,
    json_result,
    kernel_configs_setting,
    tool_main,
)
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant
from k3_amd_overlay.package import ABSORB_MAX_TOKENS, ABSORB_QK_CACHE, FUSIONS, QK_CACHE, QKV_NORM, __version__
from k3_amd_overlay.settings import KERNEL_CONFIGS

DESCRIPTION = ("time each fused path against the stock sequence on this GPU per batch bucket; write the file the "
               "server keeps a fusion only where it measured exact and at least as fast")
# vLLM 0.33's default capture sizes (vllm/config/vllm.py; the 512 cap: vllm/config/compilation.py).
VLLM_CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 512 + 1, 16))
ROUNDS = 3
REPS = 100  # graph replays per timing (each of 20 calls), a median of them per round
STOCK_WORDS = ("qkv_norm: two single-norm Triton launches (the fastest of the benchmarks' configs); decode: the "
               "W_UK absorption (bf16: torch.bmm; fp8: AITER's Triton fp8 BMM), the fp8 KV-cache write, and the "
               "[ql_nope | q_pe] concat and static fp8 query quant, the faster of two launches (torch.cat, the "
               "quant: vLLM eager) and one torch.compile'd kernel (vLLM's default serving)")

Timer = Callable[[Callable[[], None]], float]


@dataclass
class Pair:
    """One fusion at one bucket: the stock sequence (candidates; the fastest counts), the fused
    path, and the parity check of the fused bytes against stock (problems; empty: exact)."""

    fusion: str
    tokens: int
    heads: int | None
    variant: str | None
    stocks: Sequence[Callable[[], None]]
    fused: Callable[[], None]
    parity: Callable[[], list[str]]


def measure_pair(pair: Pair, timer: Timer, rounds: int = ROUNDS) -> measured.Row:
    """Parity first (an exception counts as a problem: fail closed); then, only where exact, stock
    and fused timed side by side, ``rounds`` rounds in turn, medians (a timing that fails, e.g. a
    launch graph capture refuses, leaves the bucket not exact: stock)."""
    shape = (pair.fusion, pair.tokens, pair.heads, pair.variant)
    try:
        problems = pair.parity()
    except Exception as exc:  # a kernel this GPU cannot build or run: never fused
        problems = [f"{type(exc).__name__}: {exc}"]
    if problems:
        return measured.Row(*shape, exact=False, problems=tuple(problems))
    try:
        candidates = [timer(stock) for stock in pair.stocks]
        best = pair.stocks[min(range(len(candidates)), key=candidates.__getitem__)]
        stock_times, fused_times = [min(candidates)], [timer(pair.fused)]
        for _ in range(rounds - 1):
            fused_times.append(timer(pair.fused))
            stock_times.append(timer(best))
    except Exception as exc:  # not measured is not fused
        return measured.Row(*shape, exact=False, problems=(f"timing failed: {type(exc).__name__}: {exc}",))
    return measured.Row(*shape, exact=True, stock_us=statistics.median(stock_times),
                        fused_us=statistics.median(fused_times))


HEADER = ("| fusion | heads | W_UK | bucket (tokens) | stock µs | fused µs | stock / fused | parity | runs |",
          "|---|---|---|---|---|---|---|---|---|")


def table_row(row: measured.Row, low: int) -> str:
    """One bucket's line: ``low``-``row.tokens`` are the token counts it covers."""
    span = str(row.tokens) if low == row.tokens else f"{low}-{row.tokens}"
    times = ([f"{row.stock_us:.2f}", f"{row.fused_us:.2f}", measured.ratio_words(row.ratio)]
             if row.exact else ["-", "-", "-"])
    parity = "exact" if row.exact else "FAILED: " + "; ".join(row.problems)
    cells = [row.fusion, row.heads or "-", row.variant or "-", span, *times, parity, row.verdict()]
    return "| " + " | ".join(map(str, cells)) + " |"


def lows(rows: Iterable[measured.Row]) -> dict[tuple[str, int | None, str | None, int], int]:
    """Each row's lowest token count: one above the bucket before it at the same fusion and shape."""
    out, last = {}, {}
    for row in sorted(rows, key=lambda r: r.tokens):
        shape = row.key[:3]
        out[row.key] = last.get(shape, 0) + 1
        last[shape] = row.tokens
    return out


def table(rows: Sequence[measured.Row]) -> list[str]:
    """The whole table, rows in measuring order."""
    low = lows(rows)
    return [*HEADER, *(table_row(r, low[r.key]) for r in rows)]


def gate_lines(measurement: measured.Measurement) -> list[str]:
    """What the server will do with this file, per fusion and shape."""
    shapes = sorted({r.key[:3] for r in measurement.rows}, key=lambda s: (FUSIONS.index(s[0]), s[1] or 0, s[2] or ""))
    lines = []
    for fusion, heads, variant in shapes:
        gate = measured.gate_for(measurement, fusion, heads, variant)
        fused = [tokens for tokens, why in gate.buckets if why is None]
        lines.append(f"{fusion} ({measured.shape_words(heads, variant)}): fused in {len(fused)} of "
                     f"{len(gate.buckets)} buckets; " + "; ".join(gate.reasons()))
    return lines


def merged(new: measured.Measurement, path: Path, out: Callable[[str], None] = print) -> measured.Measurement:
    """``new`` with the rows of the file already at ``path`` that it did not measure again, where that
    file is for the same GPU and overlay version and was measured under the same conditions
    (``measured.CONDITIONS``); otherwise ``new`` alone, saying which rows were dropped and why."""
    try:
        before = measured.load(path) if path.is_file() else None
    except measured.MeasuredError:
        before = None
    if before is None or (before.arch, before.device) != (new.arch, new.device):
        return new
    keys = {r.key for r in new.rows}
    kept = tuple(r for r in before.rows if r.key not in keys)
    stale = measured.differences(before, new.conditions())
    if before.provider != new.provider:
        stale.insert(0, ("provider", before.provider, f"this run timed {new.provider}'s launches"))
    if before.overlay_version != new.overlay_version:
        stale.insert(0, ("overlay_version", before.overlay_version, f"this is k3-amd-overlay {new.overlay_version}"))
    if stale:
        if kept:
            why = "; ".join(f"{name} {repr(value) if value else 'absent'}, {here}" for name, value, here in stale)
            out(f"dropped {len(kept)} row{'s' if len(kept) != 1 else ''} of {path} (other shapes or buckets) measured "
                f"under other conditions ({why}): measure those again")
        return new
    return measured.Measurement(**{**new.__dict__, "rows": kept + new.rows})


def write(measurement: measured.Measurement, directory: Path, out: Callable[[str], None] = print) -> Path:
    """Write the result file atomically (a server starting meanwhile reads the old file or the new,
    never half of one; flushed to disk before it replaces the old), after checking that the server
    will read back what is written. Two runs writing one file at once take turns (a lock file beside
    it), each merging into what the other wrote; a temporary file is removed on any failure."""
    path = directory / measured.result_name(measurement.arch, measurement.device)
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(f".{path.name}.lock")):
        measurement = merged(measurement, path, out)
        data = measurement.to_json()
        measured.parse(json.loads(json.dumps(data)), str(path))
        json_files.replace_atomically(path, json.dumps(data, indent=1) + "\n", f".{path.name}.", durable=True)
    return path


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock`` (created if absent) while in the block."""
    with open(lock, "a") as file:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)


# --- the pairs at K3 shapes (torch and Triton, imported when measuring) ---

# Per fusion: (the timed stock segment, the timed fused segment, the whole chain with the fusion, for parity)
def _segments(fusion: str, config: tuple[int, int]) -> tuple[Callable[[Any], None], Callable[[Any], None],
                                                             Callable[[Any], None]]:
    from k3_amd_overlay.commands.bench import layer_step

    def stock_norms(s: Any) -> None:
        layer_step.stock_norms(s, config)

    if fusion == QKV_NORM:
        return stock_norms, layer_step.norm_pair, lambda s: (layer_step.norm_pair(s), layer_step.stock_tail(s))
    fused = layer_step.qk_cache_tail if fusion == QK_CACHE else layer_step.absorbed_tail
    return layer_step.stock_tail, fused, lambda s: (stock_norms(s), fused(s))


def pairs(heads_list: Sequence[int], variants: Sequence[str], buckets: Sequence[int], device: Any, fmt: Any,
          seed: int) -> Iterator[Pair]:
    """Every fusion at every bucket, at each heads count and W_UK variant (qkv_norm once a bucket: its
    launch has no heads), each on its own fresh inputs: a padded batch for parity, another to time."""
    from functools import partial

    from k3_amd_overlay.commands.bench import layer_step
    from k3_amd_overlay.commands.bench.kernels import SINGLE_NORM_CONFIGS

    def pair(fusion: str, tokens: int, heads: int, variant: str, n: int) -> Pair:
        step_seed = seed + 7919 * n

        def check() -> list[str]:
            s = layer_step.make_step(tokens, heads, variant, device, seed=step_seed, padding=True, fmt=fmt)
            problems = layer_step.parity_problems(s, chain=_segments(fusion, SINGLE_NORM_CONFIGS[0])[2],
                                                  exact_codes=fusion == QK_CACHE)  # stock's own bmm: same bytes
            if fusion != QKV_NORM:  # the compiled stock timed beside the eager one writes the same bytes
                problems += [f"compiled stock: {p}" for p in layer_step.parity_problems(
                    s, chain=layer_step.stock_compiled, want_chain=layer_step.stock, exact_codes=True)]
            return problems

        shape = (None, None) if fusion == QKV_NORM else (heads, variant)
        try:
            timed = layer_step.make_step(tokens, heads, variant, device, seed=step_seed + 1, fmt=fmt)
            layer_step.stock_norms(timed, SINGLE_NORM_CONFIGS[0])  # the tails read written norms
        except Exception as exc:  # out of memory beside a live server, a norm this GPU cannot build: this bucket
            failure = f"its inputs could not be prepared: {type(exc).__name__}: {exc}"
            return Pair(fusion, tokens, *shape, stocks=(), fused=lambda: None, parity=lambda: [failure])
        configs = SINGLE_NORM_CONFIGS if fusion == QKV_NORM else SINGLE_NORM_CONFIGS[:1]
        stocks = [partial(_segments(fusion, c)[0], timed) for c in configs]
        if fusion != QKV_NORM:  # the concat and quant as vLLM's default serving compiles them: one kernel
            stocks.append(partial(layer_step.stock_tail_compiled, timed))
        fused = partial(_segments(fusion, configs[0])[1], timed)
        return Pair(fusion, tokens, *shape, stocks=stocks, fused=fused, parity=check)

    n = 0
    for tokens in buckets:
        n += 1
        yield pair(QKV_NORM, tokens, heads_list[0], variants[0], n)
        for heads in heads_list:
            for variant in variants:
                for fusion in (ABSORB_QK_CACHE, QK_CACHE):
                    if fusion == ABSORB_QK_CACHE and tokens > ABSORB_MAX_TOKENS:
                        continue
                    n += 1
                    yield pair(fusion, tokens, heads, variant, n)


def config_failed(row: measured.Row) -> measured.Row:
    """``row`` if every launch config ran as the table picks it; else (a config failed in this process,
    launch_configs.degrade, and the safe config runs from then on in its place) the row not usable: it
    may have timed the safe config, which a server where the table's config builds never runs."""
    from k3_amd_overlay.kernels import launch_configs

    failed = [f"{kernel} {entry['config']} ({entry['why']})"
              for kernel, entries in launch_configs.degraded().items() for entry in entries]
    if not failed:
        return row
    return measured.Row(row.fusion, row.tokens, row.heads, row.variant, exact=False, problems=(
        *row.problems, f"measured after a launch config failed in this run ({'; '.join(failed)}): the safe config "
        f"ran in its place, which a server where that config builds does not run; run {measured.COMMAND} again",))


def measure(all_pairs: Iterable[Pair], timer: Timer, rounds: int = ROUNDS,
            out: Callable[[str], None] = print) -> list[measured.Row]:
    """Measure each pair in turn, printing the table as it goes; the rows from a launch config's
    failure on are not usable (``config_failed``)."""
    rows: list[measured.Row] = []
    last: dict[tuple[str, int | None, str | None], int] = {}
    for line in HEADER:
        out(line)
    for pair in all_pairs:
        row = config_failed(measure_pair(pair, timer, rounds))
        del pair  # its tensors go before the next bucket's are made
        shape = row.key[:3]
        out(table_row(row, last.get(shape, 0) + 1))
        last[shape] = row.tokens
        rows.append(row)
    return rows


# --- the command ---

def per_rank(heads: int, tp: int, whose: str) -> int:
    """``heads`` attention heads over tensor-parallel size ``tp``, which must divide them."""
    if heads % tp:
        raise UsageError(f"--tensor-parallel-size {tp}: does not divide {whose} {heads} attention heads")
    return heads // tp


def heads_from_model(model: str, tp: int) -> int:
    """Heads per rank: ``num_attention_heads`` of the model's config.json (top level or its text
    config) over the tensor-parallel size, which must divide it."""
    path = Path(model)
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = json_files.load(config_file)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {model}: cannot read {config_file} ({exc}); give a local model directory or "
                         "its config.json, or --heads") from None
    if not isinstance(config, dict):
        raise UsageError(f"--model {model}: {config_file} holds {json_values.kind(config)}, not a model config "
                         "object (with num_attention_heads); give the model's config.json, or --heads")
    field, heads = heads_field(config)
    if field is None:
        raise UsageError(f"--model {model}: {config_file} has no num_attention_heads (top level or text_config); "
                         "give the model's config.json, or --heads")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise UsageError(f"--model {model}: {config_file} {field} {heads!r} is not a positive whole number of heads; "
                         "give the model's config.json, or --heads")
    return per_rank(heads, tp, "the model's")


def heads_field(config: dict[str, Any]) -> tuple[str | None, Any]:
    """(where, value) of a model config's num_attention_heads: top level, else its text config's; (None,
    None) where neither has one."""
    if "num_attention_heads" in config:
        return "num_attention_heads", config["num_attention_heads"]
    text = config.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" in text:
        return "text_config.num_attention_heads", text["num_attention_heads"]
    return None, None


def check_out_directory(given: Path, said: str | None = None,
                        remedy: str = "--out names a directory for the result file") -> None:
    """--out (or the default directory, ``said`` naming where it comes from) is a directory, or one the
    result file's writing can create: no part of it an existing file (checked before measuring, so that
    no measurement is lost to it). (An empty --out the parser refuses: usage.Parser.)"""
    said = said or f"--out {given}"
    path = Path(given)
    for part in (path, *path.parents):
        if not part.exists():
            continue
        if not part.is_dir():
            what = "is a file" if part == path else f"lies under {part}, which is a file"
            raise UsageError(f"{said}: {what}; {remedy}")
        if not os.access(part, os.W_OK | os.X_OK):
            raise UsageError(f"{said}: {part} is not writable here; {remedy}")
        return


def check_default_directory() -> None:
    """The directory the result file goes to without --out (``measured.result_dir``), checked as --out is."""
    setting = kernel_configs_setting() or ""
    try:
        directory = measured.result_dir(os.environ)
    except (RuntimeError, KeyError):  # Path.home(): no HOME and no passwd entry for this user
        raise UsageError(f"no home directory here for the per-user result directory: give --out DIR, or set "
                         f"{KERNEL_CONFIGS} as the server has it") from None
    except OSError as exc:  # a path that cannot be looked at (too long, no access)
        raise UsageError(f"{KERNEL_CONFIGS}={setting}: its result directory cannot be looked at ({exc}); give "
                         "--out DIR, or fix the variable as the server has it") from None
    said = (f"{KERNEL_CONFIGS}={setting}: its result directory {directory}" if setting
            else f"the per-user result directory {directory}")
    check_out_directory(directory, said, "give --out DIR")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--heads", type=int, nargs="+", help="query heads per rank (K3: 96 / tensor-parallel size)")
    which.add_argument("--model", help="the served model's directory or its config.json: heads per rank from "
                                       "num_attention_heads and --tensor-parallel-size")
    parser.add_argument("--tensor-parallel-size", type=int,
                        help=f"with --model: its heads over this (default 1); with --heads: checked against K3's "
                             f"{k3.NUM_HEADS} heads over this")
    parser.add_argument("--variant", nargs="+", default=[measured.VARIANTS[0]],
                        help=f"W_UK absorptions: {', '.join(measured.VARIANTS)} (default {measured.VARIANTS[0]}; fp8: "
                             "vLLM's fp8 W_K, VLLM_ROCM_USE_AITER_FP8BMM, needs AITER's Triton fp8 BMM)")
    parser.add_argument("--buckets", type=int, nargs="+",
                        help="batch buckets in tokens (default vLLM's capture sizes: 1, 2, 4, then 8-256 by 8 and "
                             "272-512 by 16)")
    parser.add_argument("--out", type=Path,
                        help="directory for the result file (default: $K3_AMD_OVERLAY_KERNEL_CONFIGS's, else "
                             "$XDG_CACHE_HOME/k3-amd-overlay or ~/.cache/k3-amd-overlay)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timing rounds, in turn (default {ROUNDS})")
    parser.add_argument("--seed", type=int, help="inputs' seed (default: a fresh one, recorded in the file)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object on stdout on every path (the file written; the table goes to stderr)")


def check_args(args: argparse.Namespace) -> None:
    """The checks of measure's arguments, none of which needs torch (the CLI runs them before it looks for
    it): UsageError naming the value and what is allowed."""
    _checked(args)


def _checked(args: argparse.Namespace) -> tuple[list[int], list[str], list[int]]:
    """The heads per rank, W_UK variants and buckets ``args`` ask for, checked (UsageError otherwise)."""
    tp = args.tensor_parallel_size
    if tp is not None and tp < 1:
        raise UsageError(f"--tensor-parallel-size {tp}: a positive integer")
    for name, values in (("--heads", args.heads or []), ("--buckets", args.buckets or [])):
        if any(v < 1 for v in values):
            raise UsageError(f"{name} {' '.join(map(str, values))}: every value must be a positive integer")
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: a positive integer")
    if args.seed is not None and args.seed not in measured.SEEDS:
        raise UsageError(f"--seed {args.seed}: a whole number {measured.SEEDS[0]}-{measured.SEEDS[-1]}")
    if args.heads and tp is not None:
        expected = per_rank(k3.NUM_HEADS, tp, "K3's")
        if set(args.heads) != {expected}:
            raise UsageError(f"--heads {' '.join(map(str, args.heads))} with --tensor-parallel-size {tp}: --heads "
                             f"is heads per rank, and K3's {k3.NUM_HEADS} heads at that size are {expected} per "
                             f"rank; give --heads {expected}, or --heads alone (another model's heads per rank)")
    if args.model is not None and not args.model.strip():
        raise UsageError(f"--model {args.model!r} names no model (an empty value: an unset variable?); give the "
                         "model's directory or its config.json, or --heads")
    heads = sorted(set(args.heads)) if args.heads else [heads_from_model(args.model, tp or 1)]
    if args.out is not None:
        check_out_directory(args.out)
    else:
        check_default_directory()
    bad = [v for v in args.variant if v not in measured.VARIANTS]
    if bad:
        fp4 = (" (fp4: its stock absorption is AITER's MXFP4 GEMM, which this version does not measure: an fp4 layer "
               "runs stock where a measurement exists)" if "fp4" in bad else "")
        raise UsageError(f"--variant {' '.join(bad)}: allowed {', '.join(measured.VARIANTS)}{fp4}")
    return heads, list(dict.fromkeys(args.variant)), sorted(set(args.buckets or VLLM_CAPTURE_SIZES))


def graph_timer() -> Timer:
    """The real timer: CUDA/HIP-graph replay medians (bench/timing.py), ``REPS`` replays of 20 calls."""
    from functools import partial

    from k3_amd_overlay.commands.bench.timing import graph_us

    return partial(graph_us, per_graph=20, reps=REPS)


def result(rows: Sequence[measured.Row], arch: str, device_name: str, fp8_format: str,
           seed: int) -> measured.Measurement:
    """The measurement of ``rows`` on this machine, now (with this overlay and the conditions it
    measured under: this process's launch configs, torch, Triton and AITER, the fp8 KV cache in
    ``fp8_format``)."""
    here = {**measured.conditions(arch, device_name), "fp8_format": fp8_format}
    return measured.Measurement(
        path="", arch=arch, device=device_name,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        overlay_version=__version__, stock=STOCK_WORDS, seed=seed, rows=tuple(rows),
        **{name: here[name] or "" for name in measured.CONDITIONS})


def _failed(args: argparse.Namespace, message: str) -> int:
    """A failed run: ``message`` on stderr and in ``args.error`` (the --json object's ``error``); 1."""
    args.error = message
    print(f"{COMMAND_NAME}: {message}", file=sys.stderr)
    return EXIT_FAILED


def run(args: argparse.Namespace, timer: Timer | None = None) -> int:
    """0: measured, every bucket exact; 1: some bucket not exact (written: stock runs there), no
    GPU, or another failure (``args.error`` says why); 2: a usage error."""
    try:
        heads, variants, buckets = _checked(args)
    except UsageError as exc:
        print(f"{COMMAND_NAME}: {exc}", file=sys.stderr)
        return 2
    import torch
    import triton

    from k3_amd_overlay.commands.bench import aiter_peers
    from k3_amd_overlay.fp8 import device_format
    from k3_amd_overlay.kernels import target
    from k3_amd_overlay.kernels.launch import device_name

    if not torch.cuda.is_available():
        return _failed(args, "no GPU here: it measures the GPU the server runs on")
    if AbsorbVariant.FP8.value in variants and (why := aiter_peers.enable()):
        return _failed(args, f"--variant fp8: stock's fp8 absorption is AITER's Triton fp8 BMM: {why}")
    device = torch.device("cuda", torch.cuda.current_device())
    arch, name, fmt = target.of(device).arch, device_name(device), device_format(device)
    assert name is not None
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    directory = Path(args.out) if args.out else measured.result_dir(os.environ)
    print(f"{name} ({arch}), torch {torch.__version__}, triton {triton.__version__}, k3-amd-overlay {__version__}; "
          f"heads per rank {', '.join(map(str, heads))}; W_UK {', '.join(variants)}; fp8 KV cache ({fmt.name}); "
          f"{len(buckets)} buckets {buckets[0]}-{buckets[-1]}; seed {seed}; CUDA/HIP-graph replay, {args.rounds} "
          "rounds, medians")
    torch.cuda.reset_peak_memory_stats(device)
    rows = measure(pairs(heads, variants, buckets, device, fmt, seed), timer or graph_timer(), args.rounds)
    print(f"this run's tensors took at most {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB of GPU memory")
    try:
        path = write(result(rows, arch, name, fmt.name, seed), directory)
    except OSError as exc:
        return _failed(args, f"cannot write the result file into {directory}: {exc}; --out names another directory")
    args.written = str(path)
    for line in gate_lines(measured.load(path)):
        print(line)
    print(f"wrote {path}; the server reads it at startup from {measured.result_dir(os.environ)} (the directory of "
          f"{KERNEL_CONFIGS}, else the per-user one): run the server with the environment this ran with")
    not_exact = [r for r in rows if not r.exact]
    if not_exact:
        fusions = ", ".join(dict.fromkeys(r.fusion for r in not_exact))
        return _failed(args, f"{len(not_exact)} of {len(rows)} buckets not exact ({fusions}; the table says why): "
                             f"they run stock ({path} is written)")
    return 0


COMMAND_NAME = measured.COMMAND


def parser() -> Parser:
    """The command's parser (``k3-amd-overlay measure --help``)."""
    built = Parser(prog=COMMAND_NAME, description=describe(__doc__))
    add_arguments(built)
    return built


def main(argv: list[str] | None = None) -> int:
    return tool_main(sys.modules[__name__], argv)


def checked_main(args: argparse.Namespace) -> int:
    """The run of arguments ``usage.checked_args`` accepted (the CLI calls it once it has found torch
    and triton)."""
    if not args.json:
        return run(args)
    args.written = args.error = None
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the table to stderr; stdout: the one object
            code = run(args)
    except Exception as exc:
        from k3_amd_overlay.commands.usage import missing_image_module

        if not (isinstance(exc, ModuleNotFoundError) and missing_image_module(exc)):  # torch or triton: the CLI says so
            print(json_result("measure", False, file=args.written,
                              error=f"{type(exc).__name__}: {' '.join(str(exc).split())} (the traceback is on "
                                    "stderr)"))
        raise
    print(json_result("measure", code == 0, file=args.written, **({} if code == 0 else {"error": args.error})))
    return code


if __name__ == "__main__":  # as `k3-amd-overlay measure`: a missing torch or triton said, never a traceback
    from k3_amd_overlay.commands import cli

    sys.exit(cli.main(["measure", *sys.argv[1:]]))
