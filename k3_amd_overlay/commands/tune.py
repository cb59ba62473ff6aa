"""``k3-amd-overlay tune``: find the fastest launch config of each overlay kernel on this GPU, per
batch size and per-rank head count, and write them as a launch-config file for this device.

    k3-amd-overlay tune [--out FILE|DIR] [--heads H ...] [--tokens T ...] [--kernels K ...]
    k3-amd-overlay tune --compare FILE    (FILE's configs against the shipped ones, side by side)
    k3-amd-overlay tune --plan [--arch ARCH] [--heads H ...] [--tokens T ...] [--kernels K ...]
                                          (how many candidates a run would time; no GPU needed with --arch)

For each kernel, batch and head count, every candidate config is launched once on fresh random
inputs and its bytes checked against the stock path's (the reference providers: the KV-cache rows
byte for byte; the fp8 query codes within one step of the reference's, and no more of them off than
the shipped config has plus 0.1%); the candidates that pass are timed under CUDA/HIP-graph replay
(median) beside the shipped config, and the fastest is kept. The file (``<arch>-<device>.json`` in
a directory) is used when ``K3_AMD_OVERLAY_KERNEL_CONFIGS`` names it or its directory; the marker,
``doctor`` and ``check`` then say that these kernels were tuned on this device.

How long: every candidate is compiled and timed. By default that is 7480 candidates on gfx942, 10700
on gfx950 (7840 on sm90), most of them at 128 and 256 tokens; on an H100 a candidate took about 0.3 s
at 8 tokens and over 1.9 s at 256 tokens, so the default run takes hours. Name this deployment's
per-rank heads (``--heads``; the heads are the query heads over the tensor-parallel size): one head
count is about a quarter of the default run. ``--plan`` prints the count per kernel for the options
given, and a run prints it before its first shape. The file is written after each kernel, so an
interrupted run keeps the kernels it finished."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files, k3
from k3_amd_overlay.commands import tune_compile
from k3_amd_overlay.commands.usage import (
    EXIT_FAILED,
    Parser,
    UsageError,
    check_input_file,
    describe,
    json_result,
    tool_main,
)
from k3_amd_overlay.kernels import launch_configs, names

TUNED_KERNELS = (names.RMSNORM_PAIR_KERNEL, names.QK_CACHE_KERNEL, names.ABSORB_QK_CACHE_KERNEL,
                 names.ABSORB_FP8_QK_CACHE_KERNEL, names.ABSORB_MXFP4_QK_CACHE_KERNEL)
MIN_GAIN = 0.02  # a candidate replaces the shipped config only if faster by more than this
MOST_TOKENS = 16384  # the largest batch --tokens takes (a larger one takes the largest tuned batch's config)
# From this many tokens the absorb kernels are also tried with KV programs of KV_ROWS_TRIED rows (on the
# H200, 16 rows a program beat one at 256 and 512 tokens and tied at 64-128: docs/benchmarks.md).
KV_ROWS_FROM_TOKENS, KV_ROWS_TRIED = 128, 16
# From this many tokens the absorb kernels are also tried with wider tiles (BLOCK_N 256, BLOCK_T 128) of
# at most WIDE_TILE_ELEMENTS products a program (on the H200, BLOCK_N 256 beat 128 by 7-15% at 256 tokens,
# 12 and 16 heads: docs/benchmarks.md).
WIDE_FROM_TOKENS, WIDE_TILE_ELEMENTS = 128, 32768
# There the bf16 absorb kernel's tiles of 64 tokens and 128 columns and more are also tried with the
# dot over P in K_STEPS_TRIED pipelined slices (on the H200, 11% faster at 12 heads and 256 tokens:
# docs/benchmarks.md).
K_STEPS_TRIED = 4
# One-token programs (BLOCK_T 1, no dot) are also tried this narrow: on the H200 the MXFP4 launch's
# fastest at one token, 12 heads (docs/benchmarks.md).
ONE_TOKEN_NARROWEST = 8
# Programs of 2 to launch_configs.FEW_TOKEN_MOST tokens (no dot, as programs of one) are tried up to
# that many tokens, and the absorb kernels are tuned at these batches besides the benchmarks': on the
# H200, programs of 2 tokens beat the 16-row tile by 4-8% at 2 tokens (docs/benchmarks.md). Their
# BLOCK_T x BLOCK_N is kept to FEW_TOKEN_WIDEST, the widest one-token program's, so that the
# [BLOCK_T, P, BLOCK_N] product summed without a dot grows no larger than it.
FEW_TOKEN_BATCHES = [1 << i for i in range(1, launch_configs.FEW_TOKEN_MOST.bit_length())]
FEW_TOKEN_WIDEST = 128
# Off AMD, programs of launch_configs.PADDED_DOT_ROWS tokens (a dot Triton pads) are tried too from this
# many tokens, the least the sm90 file's 8-token rules serve, up to tl.dot's 16 rows (docs/benchmarks.md,
# 2026-12-06: they won at 4 and 8 tokens and lost at 32 and 64).
PADDED_FROM_TOKENS = 3
MISMATCH_ALLOWANCE = 1e-3  # extra share of query codes a candidate may have one step off the reference


def candidates(kernel: str, tokens: int, amd: bool, arch: str | None = None) -> list[dict[str, int]]:
    """The configs tried for ``kernel`` at ``tokens`` tokens (AMD adds the 16-wide MFMA option; many
    tokens add wider tiles and multi-row KV programs), less those the loader refuses on ``arch``
    (default gfx942 or sm90): more warps than matrix tiles."""
    warps = (1, 2, 4, 8)  # one warp won the fp8 absorb's one-token programs on the H200 (2026-12-04)
    if kernel == names.RMSNORM_PAIR_KERNEL:
        return [{"ROWS_Q": q, "ROWS_KV": kv, "num_warps": w} for q in (1, 2) for kv in (1, 2, 4, 8)
                for w in warps if w >= 2]
    if kernel == names.QK_CACHE_KERNEL:
        return [{"HEADS": h, "num_warps": w} for h in (1, 2, 4, 8) for w in warps]
    arch = arch or ("gfx942" if amd else "sm90")
    wide = tokens >= WIDE_FROM_TOKENS
    least = launch_configs.DOT_LEAST
    tiles = [t for t in (least, 32, 64, 128) if t == least or (t <= tokens and (t < 128 or wide))]
    if PADDED_FROM_TOKENS <= tokens < least and launch_configs.least_dot_rows(arch) < least:
        tiles = [launch_configs.least_dot_rows(arch), *tiles]
    if tokens <= launch_configs.FEW_TOKEN_MOST:
        tiles = [t for t in (1, *FEW_TOKEN_BATCHES) if t <= tokens] + tiles
    widths = (16, 32, 64, 128, 256) if wide else (16, 32, 64, 128)
    found = [{"BLOCK_N": n, "BLOCK_T": t, "num_warps": w} for t in tiles for n in widths for w in warps
             if n * t <= (WIDE_TILE_ELEMENTS if t > launch_configs.FEW_TOKEN_MOST else FEW_TOKEN_WIDEST)]
    if 1 in tiles:
        found += [{"BLOCK_N": ONE_TOKEN_NARROWEST, "BLOCK_T": 1, "num_warps": w} for w in warps]
    if amd:
        found += [{**c, "matrix_instr_nonkdim": 16} for c in found if c["BLOCK_T"] >= launch_configs.DOT_LEAST]
    if wide and kernel == names.ABSORB_QK_CACHE_KERNEL:
        found += [{**c, "K_STEPS": K_STEPS_TRIED} for c in found if c["BLOCK_T"] >= 64 and c["BLOCK_N"] >= 128]
    if tokens >= KV_ROWS_FROM_TOKENS:
        found += [{**c, "KV_ROWS": KV_ROWS_TRIED} for c in found]
    return [c for c in found if launch_configs.dot_warps_fit(arch, kernel, c)]


def _codes_apart(got: Any, want: Any) -> tuple[int, int]:
    """(elements that differ, elements more than one code apart) of two same-shaped code tensors
    (fp8 bytes or bf16/fp16 bits: sign and magnitude)."""
    import torch

    code = {1: torch.uint8, 2: torch.int16}[got.element_size()]  # the bits, not the values (bf16 -> int16)
    got_i, want_i = got.reshape(-1).view(code).to(torch.int32), want.reshape(-1).view(code).to(torch.int32)
    bits = got.element_size() * 8
    sign = 1 << (bits - 1)
    magnitude = sign - 1
    apart = ((got_i & magnitude) - (want_i & magnitude)).abs()
    differ = got_i != want_i
    far = differ & (((got_i & sign) != (want_i & sign)) | (apart > 1))
    return int(differ.sum()), int(far.sum())


class Case:
    """One kernel at one batch and head count: inputs, the reference's bytes, a launch.
    ``exact_outputs``: per output, whether every byte must equal the reference's (the KV cache: a copy
    and a quant, no sum whose order may round otherwise); the others may have codes one step off."""

    exact_outputs: tuple[bool, ...] = ()  # () : none

    def __init__(self, kernel: str, tokens: int, heads: int, fmt: Any) -> None:
        import torch

        from k3_amd_overlay import k3
        from k3_amd_overlay.commands.bench.kernels import decode_step_inputs, fp8_weights, mxfp4_weights
        from k3_amd_overlay.ops import reference

        self.kernel = kernel
        lora, nope = k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM
        if kernel == names.RMSNORM_PAIR_KERNEL:
            from k3_amd_overlay.kernels.rmsnorm_pair import rmsnorm_pair

            latent = torch.randn(tokens, k3.Q_LORA_RANK + k3.LATENT_ROW, dtype=torch.bfloat16, device="cuda")
            q_c, kv = latent[:, : k3.Q_LORA_RANK], latent[:, k3.Q_LORA_RANK: k3.Q_LORA_RANK + lora]
            q_w = torch.randn(k3.Q_LORA_RANK, dtype=torch.bfloat16, device="cuda")
            kv_w = torch.randn(lora, dtype=torch.bfloat16, device="cuda")
            self.outputs = (torch.empty(tokens, k3.Q_LORA_RANK, dtype=torch.bfloat16, device="cuda"),
                            torch.empty(tokens, lora, dtype=torch.bfloat16, device="cuda"))
            eps = k3.RMS_NORM_EPS
            self.wanted = reference.rmsnorm_pair_reference(q_c, kv, q_w, kv_w, eps, eps)
            self.run = lambda: rmsnorm_pair(q_c, kv, q_w, kv_w, eps, eps, *self.outputs)
            return
        q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)
        self.outputs = (q_out, cache)
        self.exact_outputs = (False, True)
        self.poison()  # the cache rows the step does not write stay poisoned in both
        want_out, want_cache = torch.empty_like(q_out), cache.clone()

        def stock(ql_nope: Any) -> None:
            reference.qk_cache_reference(ql_nope, q_pe, kv_c, k_pe, want_cache.view(fmt.dtype), slots, k_scale,
                                         q_scale, want_out.view(fmt.dtype), fmt)

        if kernel == names.QK_CACHE_KERNEL:
            from k3_amd_overlay.kernels.qk_cache import qk_cache

            ql_nope = torch.randn(heads, tokens, lora, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
            stock(ql_nope)
            self.run = lambda: qk_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)
        elif kernel == names.ABSORB_QK_CACHE_KERNEL:
            from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache

            w_uk_t = (torch.randn(lora, heads, nope, device="cuda") * 0.05).to(torch.bfloat16).permute(1, 2, 0)
            stock(reference.absorb_w_uk_reference(q_nope, w_uk_t))
            self.run = lambda: absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale,
                                               q_out, fmt)
        elif kernel == names.ABSORB_FP8_QK_CACHE_KERNEL:
            from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache

            w_k, w_k_scale = fp8_weights(heads, fmt)
            stock(reference.absorb_w_k_fp8_reference(q_nope, w_k, w_k_scale, fmt))
            self.run = lambda: absorb_fp8_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache, slots, k_scale,
                                                   q_scale, q_out, fmt)
        else:
            from k3_amd_overlay.kernels.absorb_mxfp4_qk_cache import absorb_mxfp4_qk_cache

            w_k, w_k_scale = mxfp4_weights(heads)
            stock(reference.absorb_w_k_mxfp4_reference(q_nope, w_k, w_k_scale, q_scale))
            self.run = lambda: absorb_mxfp4_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache, slots,
                                                     k_scale, q_scale, q_out, fmt)
        self.wanted = (want_out, want_cache)

    def poison(self) -> None:
        """Fill every output with a byte pattern no correct write leaves behind."""
        import torch

        for out in self.outputs:
            out.view(torch.uint8).fill_(0xA5)

    def mismatches(self, config: dict[str, int] | None) -> tuple[int, int]:
        """Run once under ``config`` (None: the shipped one) into poisoned outputs: (codes one step
        off, codes further off or never written) against the reference; in an exact output every
        byte that differs counts as further off."""
        from k3_amd_overlay.kernels.launch import forced

        self.poison()
        with forced(config) if config is not None else contextlib.nullcontext():
            self.run()
        near = far = 0
        exact = self.exact_outputs or (False,) * len(self.outputs)
        for out, want, whole in zip(self.outputs, self.wanted, exact, strict=True):
            differ, apart = _codes_apart(out, want)
            near, far = (near, far + differ) if whole else (near + differ - apart, far + apart)
        return near, far

    def allowance(self) -> int:
        """How many more codes one step off than the shipped config a candidate may have:
        MISMATCH_ALLOWANCE of the codes of the outputs that may have any (never the exact ones)."""
        exact = self.exact_outputs or (False,) * len(self.wanted)
        return int(MISMATCH_ALLOWANCE * sum(w.numel() for w, whole in zip(self.wanted, exact, strict=True)
                                            if not whole))


def time_us(run: Callable[[], None], config: dict[str, int] | None) -> float:
    """Median µs of one launch under ``config`` (None: the shipped one), CUDA/HIP-graph replay."""
    from k3_amd_overlay.commands.bench.timing import graph_us
    from k3_amd_overlay.kernels.launch import forced

    with forced(config) if config is not None else contextlib.nullcontext():
        return graph_us(run, per_graph=20, reps=50)


def interleaved_us(run: Callable[[], None], configs: list[dict[str, int] | None], rounds: int = 3) -> list[float]:
    """Each config's median µs over ``rounds`` rounds taken in turn (drift hits all alike)."""
    import statistics

    from k3_amd_overlay.commands.bench.timing import in_turn

    readings = in_turn({i: (lambda config=config: time_us(run, config)) for i, config in enumerate(configs)}, rounds)
    return [statistics.median(readings[i]) for i in range(len(configs))]


def tune_case(case: Case, shipped: dict[str, int], tried: Iterable[dict[str, int]],
              log: Callable[[str], None]) -> tuple[dict[str, int], float, float]:
    """The fastest config passing the bytes check: (config, its µs, the shipped config's µs). A
    candidate replaces the shipped config only where it is faster by more than ``MIN_GAIN`` in an
    interleaved re-timing of the two."""
    base_near, base_far = case.mismatches(shipped)
    if base_far:
        raise RuntimeError(f"{case.kernel}: the shipped config is {base_far} codes off the reference")
    allowed = base_near + case.allowance()
    best: tuple[float, dict[str, int]] | None = None
    for config in tried:
        if config == shipped:
            continue
        try:
            near, far = case.mismatches(config)
        except Exception as exc:  # a config this GPU cannot build or launch is not a candidate
            log(f"    {config}: {type(exc).__name__}")
            continue
        if far or near > allowed:
            log(f"    {config}: rejected ({far} codes off, {near} one step off; allowed {allowed})")
            continue
        us = time_us(case.run, config)
        if best is None or us < best[0]:
            best = (us, config)
    if best is None:
        shipped_us = time_us(case.run, shipped)
        return shipped, shipped_us, shipped_us
    best_us, shipped_us = interleaved_us(case.run, [best[1], shipped])
    return (best[1], best_us, shipped_us) if best_us < shipped_us * (1 - MIN_GAIN) else (shipped, shipped_us,
                                                                                         shipped_us)


def shipped_rules(arch: str, kernel: str) -> tuple[launch_configs.Rule, ...]:
    return launch_configs.shipped(launch_configs.shipped_arch(arch)).kernels[kernel]


def shapes_of(kernel: str, heads: list[int], tokens: list[int] | None) -> list[tuple[int, int]]:
    """(tokens, heads) to tune or compare ``kernel`` at: the benchmarks' shapes by default, and for the
    absorb kernels ``FEW_TOKEN_BATCHES`` too."""
    from k3_amd_overlay.commands.bench import shapes

    if kernel == names.RMSNORM_PAIR_KERNEL:
        return [(t, 1) for t in tokens or shapes.NORM_TOKENS]
    batches = tokens or (shapes.QK_CACHE_BATCHES if kernel == names.QK_CACHE_KERNEL
                         else sorted({*shapes.ABSORB_BATCHES, *FEW_TOKEN_BATCHES}))
    return [(t, h) for h in heads for t in batches]


def reachable_here(kernel: str, arch: str, amd: bool) -> bool:
    return not (kernel == names.ABSORB_MXFP4_QK_CACHE_KERNEL and amd and arch != "gfx950")  # CDNA4 only in vLLM


def plan(kernels: Iterable[str], heads: list[int], tokens: list[int] | None, arch: str) -> list[tuple[str, int, int]]:
    """(kernel, shapes, candidates) of a run on ``arch`` with these options, the kernels it tunes there in
    their order (each shape's candidates include the shipped config, which is timed once, not as one)."""
    amd = arch.startswith("gfx")
    rows = []
    for kernel in kernels:
        if reachable_here(kernel, arch, amd):
            shapes = shapes_of(kernel, heads, tokens)
            rows.append((kernel, len(shapes), sum(len(candidates(kernel, t, amd, arch)) for t, _ in shapes)))
    return rows


def plan_line(arch: str, rows: list[tuple[str, int, int]]) -> str:
    counts = ", ".join(f"{kernel} {found} at {shapes}" for kernel, shapes, found in rows)
    return (f"{sum(r[2] for r in rows)} candidates at {sum(r[1] for r in rows)} shapes on {arch}, each compiled "
            f"and timed ({counts})")


def print_plan(arch: str, rows: list[tuple[str, int, int]]) -> None:
    print(plan_line(arch, rows))
    print("| kernel | shapes | candidates |")
    print("|---|---|---|")
    for kernel, shapes, found in rows:
        print(f"| {kernel} | {shapes} | {found} |")


def compare(path: str, kernels: list[str], heads: list[int], tokens: list[int] | None, fmt: Any, arch: str,
            amd: bool) -> int:
    """Time ``path``'s config against the shipped one at every shape a run with these ``heads`` and
    ``tokens`` would tune, interleaved; 1 where any of ``path``'s is slower by more than ``MIN_GAIN``."""
    table = launch_configs.load(path)
    slower = 0
    print(f"| kernel | T | H | shipped µs | {Path(path).name} µs | shipped / it |")
    print("|---|---|---|---|---|---|")
    for kernel in kernels:
        if kernel not in table.kernels or not reachable_here(kernel, arch, amd):
            continue
        for batch, heads_here in shapes_of(kernel, heads, tokens):
            mine = dict(launch_configs.rule_for(table.kernels[kernel], batch, heads_here).config)
            shipped = dict(launch_configs.rule_for(shipped_rules(arch, kernel), batch, heads_here).config)
            if mine == shipped:  # timing one config against itself would only measure noise
                print(f"| {kernel} | {batch} | {heads_here} | same config | same config | 1.00 |", flush=True)
                continue
            case = Case(kernel, batch, heads_here, fmt)
            mine_us, shipped_us = interleaved_us(case.run, [mine, shipped])
            slower += mine_us > shipped_us * (1 + MIN_GAIN)
            print(f"| {kernel} | {batch} | {heads_here} | {shipped_us:.2f} | {mine_us:.2f} | "
                  f"{shipped_us / mine_us:.2f} |", flush=True)
    print(f"{slower} shapes slower than the shipped configs by more than {MIN_GAIN:.0%}")
    return 1 if slower else 0


def with_catch_alls(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tuned rules in lookup order (heads, then tokens, ascending), each head count closed by its
    largest batch's config for any larger batch, the last config for anything beyond."""
    ordered: list[dict[str, Any]] = []
    for rule in sorted(rules, key=lambda r: (r.get("heads", 0), r["tokens"])):
        if ordered and "heads" in rule and ordered[-1].get("heads") != rule["heads"]:
            ordered.append({"heads": ordered[-1]["heads"], "config": ordered[-1]["config"],
                            "note": "larger batches: the largest tuned batch's"})
        ordered.append(rule)
    ordered.append({"config": ordered[-1]["config"], "note": "beyond the tuned batches and heads: the largest's"})
    return ordered


device_slug = launch_configs.device_slug


def out_path(out: Path, arch: str, device: str) -> Path:
    path = Path(out)
    return path / launch_configs.tuned_name(arch, device) if path.is_dir() or not path.suffix else path


def out_given(args: argparse.Namespace) -> Path:
    """Where a run writes: --out, else the current directory."""
    return Path(".") if args.out is None else args.out


def check_compare(given: Path) -> None:
    """--compare names a readable launch-config file (checked before any GPU work)."""
    check_input_file("--compare", given)
    try:
        launch_configs.load(given)
    except launch_configs.LaunchConfigError as exc:
        raise UsageError(f"--compare {given}: not a usable launch-config file ({exc})") from None


def check_out(given: Path) -> None:
    """--out as tune will write it, checked before any GPU work: an existing directory (the file in it,
    named for the GPU, is checked by ``check_out_file`` once the GPU is known), or a file whose directory
    exists and can be written, which, where it exists, ``check_out_file`` accepts. (An empty value the
    parser refuses: usage.Parser.)"""
    path = Path(given)
    if not path.is_dir() and not path.suffix:
        what = "not a directory" if path.exists() else "no such directory"
        raise UsageError(f"--out {given}: {what}; give an existing directory (for <arch>-<device>.json) or a file "
                         "name with a suffix (.json)")
    directory = path if path.is_dir() else path.parent
    if not directory.is_dir():
        raise UsageError(f"--out {given}: the directory {directory} does not exist (tune creates no directories)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"--out {given}: the directory {directory} is not writable here")
    if not path.is_dir():
        check_out_file(path, given)


def check_out_file(path: Path, given: Path) -> None:
    """An existing file at ``path`` (what --out ``given`` writes) must be one tune can keep the kernels of or
    replace: a launch-config file whose ``tuned_on``, if any, is an object; a UsageError otherwise (nothing
    tuned yet, nothing lost)."""
    where = f"--out {given}: {path}" if path != given else f"--out {given}"
    if path.resolve().parent == launch_configs.CONFIG_DIR.resolve():
        raise UsageError(f"{where} is in the package's own launch-config directory, whose files the overlay needs "
                         "as shipped: name a file or directory outside it")
    if not path.exists():
        return
    if not path.is_file():
        raise UsageError(f"{where} exists and is not a regular file")
    if not os.access(path, os.W_OK):
        raise UsageError(f"{where} exists and is not writable here")
    try:
        data: Any = json_files.load(path)
        launch_configs.parse(data, str(path))
    except (OSError, ValueError) as exc:  # LaunchConfigError and JSONDecodeError are ValueErrors
        raise UsageError(f"{where} exists and is not a launch-config file tune can update ({exc}); move it or "
                         "name another file") from None
    tuned = data.get("tuned_on")
    if tuned is not None and not isinstance(tuned, dict):
        raise UsageError(f"{where} exists and its tuned_on {tuned!r} is not an object (device, date, torch, "
                         "triton); move it or name another file")


def parser() -> Parser:
    p = Parser(prog="k3-amd-overlay tune", description=describe(__doc__))
    p.add_argument("--out", type=Path,
                   help="a file, or a directory for <arch>-<device>.json (default .); an existing file for this arch "
                        "and GPU keeps the kernels not tuned now")
    p.add_argument("--heads", type=int, nargs="+", help="per-rank query heads (default: the benchmarks')")
    p.add_argument("--tokens", type=int, nargs="+", help="batch sizes (default: the benchmarks', and 2 and 4 "
                   "tokens for the absorb kernels)")
    p.add_argument("--kernels", nargs="+", choices=TUNED_KERNELS, default=list(TUNED_KERNELS), metavar="KERNEL",
                   help=f"the kernels to tune, of {', '.join(TUNED_KERNELS)} (default: all)")
    p.add_argument("--compare", type=Path, metavar="FILE", help="instead of tuning: time FILE's configs against the "
                   "shipped ones at the shapes a run with the same --heads and --tokens tunes; exit 1 where FILE's "
                   "are slower")
    p.add_argument("--plan", action="store_true", help="instead of tuning: print how many candidates a run with "
                   "these options would compile and time, per kernel and in all; nothing is written")
    p.add_argument("--arch", choices=launch_configs.SHIPPED_ARCHS, help="with --plan: the arch to count for "
                   "(default: this GPU's; with it no GPU is needed)")
    p.add_argument("--jobs", type=int, default=tune_compile.default_jobs(), metavar="N",
                   help="compile each shape's candidates in N worker processes on this GPU before timing them "
                        f"(default: this machine's cores, at most {tune_compile.DEFAULT_JOBS_MAX}, here "
                        "%(default)s; 1: no workers, each is compiled at its first launch)")
    p.add_argument("--verbose", action="store_true", help="say why each rejected candidate was")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout on every path (the file written; the table goes to stderr)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The checks of tune's arguments that need no torch (the CLI runs them before it looks for it):
    UsageError naming the value and what is allowed."""
    for name, values, most in (("--heads", args.heads, k3.NUM_HEADS), ("--tokens", args.tokens, MOST_TOKENS)):
        if values is not None and any(not 1 <= v <= most for v in values):
            raise UsageError(f"{name} {values}: every value must be an integer from 1 to {most}"
                             + (f" (K3 has {k3.NUM_HEADS} query heads)" if name == "--heads" else ""))
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: give a positive number of worker processes (1: none)")
    if args.arch is not None and not args.plan:
        raise UsageError(f"--arch {args.arch}: only with --plan (a run tunes the GPU it runs on)")
    if args.plan and args.compare is not None:
        raise UsageError("--plan and --compare: give one of them")
    if args.compare is not None and args.out is not None:
        raise UsageError(f"--out {args.out} and --compare: --compare writes no file (it times FILE's configs against "
                         "the shipped ones); give one of them")
    if args.plan and args.out is not None:
        raise UsageError(f"--out {args.out} and --plan: --plan writes no file (it counts the candidates a run would "
                         "time); give one of them")
    if args.compare is not None:
        check_compare(args.compare)
    elif not args.plan:
        check_out(out_given(args))


def main(argv: list[str] | None = None) -> int:
    return tool_main(sys.modules[__name__], argv)


def checked_main(args: argparse.Namespace) -> int:
    """The run of arguments ``usage.checked_args`` accepted (the CLI calls it once it has found torch
    and triton)."""
    if not needs_image(args):
        return planned(args, args.arch)
    import torch

    if not torch.cuda.is_available():  # a machine that cannot run it: a failure, not a usage error
        message = "no GPU here: tune runs on the GPU it tunes for"
        if args.plan:
            arches = ", ".join(launch_configs.SHIPPED_ARCHS)
            message = f"no GPU here: --plan counts for this GPU's arch unless --arch names one ({arches})"
        if args.json:
            print(json_result("tune", False, error=message))
        print(f"k3-amd-overlay tune: {message}", file=sys.stderr)
        return EXIT_FAILED
    if args.plan:
        from k3_amd_overlay.kernels import target

        return planned(args, target.of(torch.device("cuda", torch.cuda.current_device())).arch)
    try:
        return run(args) if not args.json else run_json(args)
    except UsageError as exc:  # found once the GPU is known (the file named for it), before any tuning
        return parser().usage_error(exc, json_wanted=args.json)


def needs_image(args: argparse.Namespace) -> bool:
    """Whether this run needs the image's torch and triton (and a GPU): all but ``--plan --arch``, which
    only counts."""
    return not (args.plan and args.arch is not None)


def asked(args: argparse.Namespace) -> tuple[list[int], list[int] | None]:
    """The head counts (the benchmarks' by default) and batch sizes (None: each kernel's default) asked
    for, each once and in order."""
    from k3_amd_overlay.commands.bench import shapes

    return sorted(set(args.heads or shapes.HEADS)), sorted(set(args.tokens)) if args.tokens else None


def planned(args: argparse.Namespace, arch: str) -> int:
    """--plan: the candidates a run with ``args`` would time on ``arch``, as a table (or one JSON object)."""
    heads, tokens = asked(args)
    rows = plan(args.kernels, heads, tokens, arch)
    if args.json:
        print(json_result("tune", True, plan={
            "arch": arch, "heads": heads, "candidates": sum(r[2] for r in rows), "shapes": sum(r[1] for r in rows),
            "kernels": [{"kernel": k, "shapes": n, "candidates": c} for k, n, c in rows]}))
    else:
        print_plan(arch, rows)
    return 0


def run_json(args: argparse.Namespace) -> int:
    """``run`` with --json: the table to stderr, one object on stdout (also where ``run`` raises: a
    UsageError is the caller's to print; anything else is said in the object, its traceback kept)."""
    args.written = args.error = None
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the table to stderr; stdout: the one object
            code = run(args)
    except UsageError:
        raise
    except Exception as exc:
        print(json_result("tune", False, file=args.written, compare=args.compare and str(args.compare),
                          error=f"{type(exc).__name__}: {' '.join(str(exc).split())} (the traceback is on stderr)"))
        raise
    print(json_result("tune", code == 0, file=args.written, compare=args.compare and str(args.compare),
                      **({"error": args.error} if getattr(args, "error", None) else {})))
    return code


def run(args: argparse.Namespace) -> int:
    """Tune (or --compare) on this machine's GPU, with checked arguments."""
    import torch
    import triton

    from k3_amd_overlay.fp8 import device_format
    from k3_amd_overlay.kernels import target
    from k3_amd_overlay.kernels.launch import device_name

    device = torch.device("cuda", torch.cuda.current_device())
    where, name, fmt = target.of(device), device_name(device), device_format(device)
    amd = where.backend == target.HIP
    heads, tokens = asked(args)
    torch.manual_seed(0)
    print(f"{name} ({where.arch}), torch {torch.__version__}, triton {triton.__version__}")
    if args.compare is not None:
        return compare(str(args.compare), args.kernels, heads, tokens, fmt, where.arch, amd)

    def log(line: str) -> None:
        if args.verbose:
            print(line, file=sys.stderr)

    if not launch_configs.device_slug(name or ""):  # some ROCm containers report an empty name
        args.error = (f"this GPU reports no name (torch.cuda.get_device_name() gives {name!r}): the server reads a "
                      "tuned file by the GPU's name, and would read none written for this one; nothing tuned")
        print(f"k3-amd-overlay tune: {args.error}", file=sys.stderr)
        return EXIT_FAILED
    path = out_path(out_given(args), where.arch, name)
    check_out_file(path, out_given(args))
    if (other := tuned_elsewhere(path, where.arch, name)) is not None:
        args.error = (f"--out {out_given(args)}: {path} holds launch configs tuned on {other}; tune keeps no other "
                      "GPU's tuning by replacing it: name another file or directory; nothing tuned")
        print(f"k3-amd-overlay tune: {args.error}", file=sys.stderr)
        return EXIT_FAILED
    skipped = [k for k in args.kernels if not reachable_here(k, where.arch, amd)]
    if len(skipped) == len(args.kernels):
        args.error = (f"--kernels {' '.join(args.kernels)}: none runs on {where.arch} (vLLM takes the MXFP4 W_K "
                      "absorption on gfx950 only); nothing tuned")
        print(f"k3-amd-overlay tune: {args.error}", file=sys.stderr)
        return EXIT_FAILED
    for kernel in skipped:
        print(f"{kernel}: not tuned, it does not run on {where.arch}")
    print(plan_line(where.arch, plan(args.kernels, heads, tokens, where.arch)), flush=True)
    print("| kernel | T | H | shipped µs | tuned µs | shipped / tuned | tuned config |")
    print("|---|---|---|---|---|---|---|")
    with tune_compile.Compiler(args.jobs, device.index) as compiler:
        for kernel in args.kernels:
            if not reachable_here(kernel, where.arch, amd):
                continue
            rules = []
            for batch, heads_here in shapes_of(kernel, heads, tokens):
                shipped = dict(launch_configs.rule_for(shipped_rules(where.arch, kernel), batch, heads_here).config)
                tried = candidates(kernel, batch, amd, where.arch)
                compiler.compile(kernel, batch, heads_here, [shipped, *(c for c in tried if c != shipped)])
                case = Case(kernel, batch, heads_here, fmt)
                config, us, shipped_us = tune_case(case, shipped, tried, log)
                print(f"| {kernel} | {batch} | {heads_here} | {shipped_us:.2f} | {us:.2f} | {shipped_us / us:.2f} | "
                      f"{config} |", flush=True)
                rule: dict[str, Any] = {"tokens": batch, "config": config, "note": f"{us:.2f} us"}
                if kernel != names.RMSNORM_PAIR_KERNEL:
                    rule["heads"] = heads_here
                rules.append(rule)
            write(path, where.arch, name, {kernel: rules}, torch.__version__, triton.__version__)
            args.written = str(path)
    named = path.name == launch_configs.tuned_name(where.arch, name)
    print(f"wrote {path}; the overlay uses it with {launch_configs.KERNEL_CONFIGS}={path}"
          + (f" or {launch_configs.KERNEL_CONFIGS}={path.parent}" if named else
             f" (a directory is read for {launch_configs.tuned_name(where.arch, name)} only)"))
    return 0


def tuned_elsewhere(path: Path, arch: str, device: str | None) -> str | None:
    """The GPU (arch and name) the launch-config file at ``path`` was tuned on where that is not this
    one, else None (no file, an untuned one, or one of this GPU: check_out_file accepted it)."""
    if not path.is_file():
        return None
    table = launch_configs.parse(json_files.load(path), str(path))
    if table.tuned_on is None or (table.arch, table.tuned_on) == (arch, device):
        return None
    return f"{table.tuned_on} ({table.arch})"


def write(path: Path, arch: str, device: str, kernels: dict[str, list[dict[str, Any]]], torch_version: str,
          triton_version: str) -> None:
    """Write (after each kernel, so an interrupted run keeps what it finished) ``kernels``' tuned rules
    (each a batch and, but for the norm, a head count; the catch-alls are added here) into ``path``,
    atomically, keeping what a file tuned before for this arch and GPU holds of the other kernels and,
    of these kernels, of the other head counts."""
    merged = {kernel: with_catch_alls(rules) for kernel, rules in kernels.items()}
    if path.is_file():
        before: Any = json_files.load(path)
        table = launch_configs.parse(before, str(path))  # check_out_file accepted it before tuning began
        if table.arch == arch and table.tuned_on == device:
            merged = {**before["kernels"]}
            for kernel, rules in kernels.items():
                tuned_heads = {rule.get("heads") for rule in rules}
                kept = [rule for rule in before["kernels"].get(kernel, ())
                        if "tokens" in rule and rule.get("heads") not in tuned_heads]
                merged[kernel] = with_catch_alls(kept + rules)
    kernels = merged
    data = {"schema": launch_configs.SCHEMA, "arch": arch,
            "origin": "k3-amd-overlay tune: per shape the fastest candidate passing the bytes check, graph replay, "
                      f"median; the shipped config kept unless beaten by more than {MIN_GAIN:.0%}",
            "tuned_on": {"device": device, "date": datetime.date.today().isoformat(), "torch": torch_version,
                         "triton": triton_version},
            "kernels": kernels}
    launch_configs.parse(data, str(path))  # what the overlay will read back
    json_files.replace_atomically(path, launch_configs.dumps(data), f".{path.name}.", durable=True)


if __name__ == "__main__":
    sys.exit(main())
