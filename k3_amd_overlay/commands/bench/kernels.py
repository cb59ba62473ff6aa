"""Kernel benchmarks of the fused ops at Kimi-K3 shapes, side by side in one run: the unfused
baseline (launches of the same quality, one per step), the fused launch, the floors (an empty
launch; bytes over the bandwidth measured here) and, with ``--peers aiter``, AMD's own AITER Triton
kernels, eager and CUDA-graph replay, medians.

    k3-amd-overlay bench [--json-out OUT.json] [--quick] [--peers aiter]
    k3-amd-overlay bench plot OUT.json        # draw it

Needs a GPU with Triton; does not need vLLM. torch, triton and the kernels are imported by the
functions that run them, so that --help and usage errors need none of them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from k3_amd_overlay import k3
from k3_amd_overlay.commands.bench import AITER_TREE
from k3_amd_overlay.commands.bench.shapes import ABSORB_BATCHES, HEADS, NORM_TOKENS, QK_CACHE_BATCHES
from k3_amd_overlay.commands.usage import EPILOG, EXIT_FAILED, Parser, UsageError, describe, json_result, tool_main
from k3_amd_overlay.fp8 import E4M3FN, Fp8Format

if TYPE_CHECKING:
    import torch

SINGLE_NORM_CONFIGS = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8)]  # (rows, warps) tried for the baseline


def row(*cells: object) -> str:
    return " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells)


def _result(op: str, shape: dict, mode: str, baseline: float, fused: float, empty: dict[str, float],
            floor_bw: float) -> dict:
    return dict(op=op, **shape, mode=mode, baseline_us=baseline, fused_us=fused, ratio=baseline / fused,
                empty_us=empty[mode], one_load_us=empty["one_load_" + mode], bytes_bw_us=floor_bw,
                fused_over_floor=fused / max(empty[mode], floor_bw),
                fused_over_load_floor=fused / max(empty["one_load_" + mode], floor_bw))


def norm_pair_inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    """The norm pair's inputs at K3 widths as the model hands them over (q_c and kv_c column slices of
    one latent row), random bf16 weights and contiguous outputs: (q, kv, q_w, kv_w, q_out, kv_out)."""
    import torch

    latent = torch.randn(tokens, k3.Q_LORA_RANK + k3.LATENT_ROW, dtype=torch.bfloat16, device="cuda")
    q, kv = latent[:, : k3.Q_LORA_RANK], latent[:, k3.Q_LORA_RANK: k3.Q_LORA_RANK + k3.KV_LORA_RANK]
    q_w = torch.randn(k3.Q_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    kv_w = torch.randn(k3.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    q_out = torch.empty(tokens, k3.Q_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    kv_out = torch.empty(tokens, k3.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    return q, kv, q_w, kv_w, q_out, kv_out


def bench_qkv_norm(tokens_list: list[int], bw: float, empty: dict[str, float]) -> list[dict]:
    from k3_amd_overlay.commands.bench.timing import eager_us, graph_us
    from k3_amd_overlay.kernels.rmsnorm_pair import rmsnorm, rmsnorm_pair

    results = []
    print(f"\n### qkv_norm: two single-norm launches vs one fused launch (bf16, q {k3.Q_LORA_RANK} + kv {k3.KV_LORA_RANK})")
    print("| T | mode | two launches µs | fused µs | ratio | empty µs | one-load µs | bytes/bw µs "
          "| fused / max(empty, bytes) | fused / max(one-load, bytes) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in tokens_list:
        q, kv, q_w, kv_w, q_out, kv_out = norm_pair_inputs(tokens)
        def two(rows: int, warps: int) -> Callable[[], None]:
            return lambda: (rmsnorm(q, q_w, 1e-5, q_out, rows, warps), rmsnorm(kv, kv_w, 1e-5, kv_out, rows, warps))

        one = lambda: rmsnorm_pair(q, kv, q_w, kv_w, 1e-5, 1e-5, q_out, kv_out)  # noqa: E731
        moved = 2 * tokens * (k3.Q_LORA_RANK + k3.KV_LORA_RANK) * 2 + (k3.Q_LORA_RANK + k3.KV_LORA_RANK) * 2
        floor_bw = moved / bw
        for mode, timer in (("graph", graph_us), ("eager", eager_us)):
            t2 = min(timer(two(r, w)) for r, w in SINGLE_NORM_CONFIGS)  # the best single-norm config
            t1 = timer(one)
            result = _result("qkv_norm", dict(tokens=tokens), mode, t2, t1, empty, floor_bw)
            print("| " + row(tokens, mode, t2, t1, t2 / t1, empty[mode], empty["one_load_" + mode], floor_bw,
                             result["fused_over_floor"], result["fused_over_load_floor"]) + " |")
            results.append(result)
    return results


def bench_qk_cache(heads_list: list[int], tokens_list: list[int], bw: float, empty: dict[str, float],
                   fmt: Fp8Format = E4M3FN, peers: bool = False) -> list[dict]:
    import torch

    from k3_amd_overlay.commands.bench import aiter_peers
    from k3_amd_overlay.commands.bench.baselines import concat_and_cache_mla_like_kernel
    from k3_amd_overlay.commands.bench.timing import eager_us, graph_us
    from k3_amd_overlay.kernels.qk_cache import fp8_mode, qk_cache
    from k3_amd_overlay.kernels.static_quant import scaled_quant

    results = []
    lora, rope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM
    mode_bits = fp8_mode(fmt, torch.device("cuda"))
    print(f"\n### qk_cache: three launches (KV write, concat, quant) vs one fused launch ({fmt.name}, block 1536)")
    print("| H | B | mode | three launches µs | fused µs | ratio | empty µs | one-load µs | bytes/bw µs "
          "| fused / max(empty, bytes) | fused / max(one-load, bytes) |" + (" AITER Triton µs | AITER / fused |" if peers else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if peers else ""))
    for heads in heads_list:
        for tokens in tokens_list:
            ql_nope = torch.randn(tokens, heads, lora, dtype=torch.bfloat16, device="cuda")
            q_full = torch.randn(tokens, heads, k3.QK_NOPE_HEAD_DIM + rope, dtype=torch.bfloat16, device="cuda")
            q_pe = q_full[..., k3.QK_NOPE_HEAD_DIM:]
            latent = torch.randn(tokens, k3.Q_LORA_RANK + lora + rope, dtype=torch.bfloat16, device="cuda")
            kv_c = torch.randn(tokens, lora, dtype=torch.bfloat16, device="cuda")
            k_pe = latent[:, k3.Q_LORA_RANK + lora:]
            blocks = max(2, -(-tokens // 1536) * 2)
            cache = torch.zeros(blocks, 1536, lora + rope, dtype=torch.uint8, device="cuda")
            slots = torch.randperm(blocks * 1536, device="cuda")[:tokens].to(torch.int64)
            k_scale = torch.tensor([1.1], device="cuda")
            q_scale = torch.tensor([0.9], device="cuda")
            q_out = torch.empty(tokens, heads, lora + rope, dtype=torch.uint8, device="cuda")
            cat_out = torch.empty(tokens, heads, lora + rope, dtype=torch.bfloat16, device="cuda")

            def three() -> None:
                concat_and_cache_mla_like_kernel[(tokens,)](kv_c, k_pe, cache, slots, k_scale, kv_c.stride(0), k_pe.stride(0),
                                            cache.stride(0), cache.stride(1), 1536, fmt.fmax, L=lora, R=rope,
                                            FP8_MODE=mode_bits, num_warps=4)
                torch.cat([ql_nope, q_pe], dim=-1, out=cat_out)
                scaled_quant(cat_out, q_scale, q_out, fmt)

            def one() -> None:
                qk_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)

            moved = tokens * (heads * (lora + rope) * 2 + (lora + rope) * 2 + 8) + tokens * (heads + 1) * (lora + rope)
            floor_bw = moved / bw
            def aiter() -> None:
                aiter_peers.qk_cache(ql_nope, q_pe, kv_c, k_pe, cache.view(fmt.dtype), slots, k_scale)

            for mode, timer in (("graph", graph_us), ("eager", eager_us)):
                t3, t1 = timer(three), timer(one)
                result = _result("qk_cache", dict(heads=heads, tokens=tokens), mode, t3, t1, empty, floor_bw)
                cells = [heads, tokens, mode, t3, t1, t3 / t1, empty[mode], empty["one_load_" + mode],
                         floor_bw, result["fused_over_floor"], result["fused_over_load_floor"]]
                if peers:
                    result["aiter_us"] = timer(aiter)
                    cells += [result["aiter_us"], result["aiter_us"] / t1]
                print("| " + row(*cells) + " |")
                results.append(result)
    return results


def decode_step_inputs(tokens: int, heads: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """One decode step's absorbed-path inputs at K3 widths, laid out as vLLM hands them over (q_nope and
    q_pe column slices of q, k_pe a slice of the latent row), a block-1536 uint8 cache with random
    slots, and the scales: (q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out)."""
    import torch

    lora, rope, nope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM
    q = torch.randn(tokens, heads, nope + rope, dtype=torch.bfloat16, device=device)
    kv_c = torch.randn(tokens, lora, dtype=torch.bfloat16, device=device)
    k_pe = torch.randn(tokens, k3.Q_LORA_RANK + lora + rope, dtype=torch.bfloat16, device=device)[:, -rope:]
    blocks = max(2, -(-tokens // 1536) * 2)
    cache = torch.zeros(blocks, 1536, lora + rope, dtype=torch.uint8, device=device)
    slots = torch.randperm(blocks * 1536, device=device)[:tokens].to(torch.int64)
    k_scale, q_scale = torch.tensor([1.1], device=device), torch.tensor([0.9], device=device)
    q_out = torch.empty(tokens, heads, lora + rope, dtype=torch.uint8, device=device)
    return q[..., :nope], q[..., nope:], kv_c, k_pe, cache, slots, k_scale, q_scale, q_out


def bench_absorb(heads_list: list[int], tokens_list: list[int], bw: float, empty: dict[str, float],
                 fmt: Fp8Format = E4M3FN, block_n: int | None = None) -> list[dict]:
    """The W_UK absorption folded in: bmm + three launches (stock), bmm + one qk_cache launch, and
    one absorb_qk_cache launch; the floor counts W_UK_T read once."""
    import torch

    from k3_amd_overlay.commands.bench.baselines import concat_and_cache_mla_like_kernel
    from k3_amd_overlay.commands.bench.timing import eager_us, graph_us
    from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache
    from k3_amd_overlay.kernels.qk_cache import fp8_mode, qk_cache
    from k3_amd_overlay.kernels.static_quant import scaled_quant

    results = []
    lora, rope, nope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM
    mode_bits = fp8_mode(fmt, torch.device("cuda"))
    print(f"\n### absorb_qk_cache: bmm + three launches, bmm + qk_cache, one launch ({fmt.name}, block 1536)")
    print("| H | B | mode | bmm + three µs | bmm + qk_cache µs | one launch µs | vs bmm+qk_cache | vs stock "
          "| bytes/bw µs (W read once) | one launch / max(one-load, bytes) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for heads in heads_list:
        w_uk_t = bf16_weights(heads)
        for tokens in tokens_list:
            q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)
            ql_nope = torch.empty(tokens, heads, lora, dtype=torch.bfloat16, device="cuda")
            cat_out = torch.empty(tokens, heads, lora + rope, dtype=torch.bfloat16, device="cuda")

            def bmm() -> None:
                torch.bmm(q_nope.transpose(0, 1), w_uk_t, out=ql_nope.transpose(0, 1))

            def stock() -> None:
                bmm()
                concat_and_cache_mla_like_kernel[(tokens,)](kv_c, k_pe, cache, slots, k_scale, kv_c.stride(0),
                                                            k_pe.stride(0), cache.stride(0), cache.stride(1), 1536,
                                                            fmt.fmax, L=lora, R=rope, FP8_MODE=mode_bits, num_warps=4)
                torch.cat([ql_nope, q_pe], dim=-1, out=cat_out)
                scaled_quant(cat_out, q_scale, q_out, fmt)

            def two() -> None:
                bmm()
                qk_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)

            def one() -> None:
                absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt,
                                block_n)

            moved = (heads * nope * lora * 2 + tokens * heads * (nope + rope) * 2 + tokens * (lora + rope) * 2
                     + tokens * 8 + tokens * (heads + 1) * (lora + rope))
            floor_bw = moved / bw
            for mode, timer in (("graph", graph_us), ("eager", eager_us)):
                t_stock, t_two, t_one = timer(stock), timer(two), timer(one)
                floor = max(empty["one_load_" + mode], floor_bw)
                print("| " + row(heads, tokens, mode, t_stock, t_two, t_one, t_two / t_one, t_stock / t_one,
                                 floor_bw, t_one / floor) + " |")
                results.append(dict(op="absorb_qk_cache", heads=heads, tokens=tokens, mode=mode, stock_us=t_stock,
                                    baseline_us=t_two, fused_us=t_one, ratio=t_two / t_one,
                                    ratio_vs_stock=t_stock / t_one, bytes_bw_us=floor_bw,
                                    fused_over_load_floor=t_one / floor))
    return results


def _time_against_peers(op: str, heads: int, tokens: int, floor_bw: float, empty: dict[str, float],
                        one: Callable[[], None],
                        peers: tuple[Callable[[], None], Callable[[], None], Callable[[], None]] | None) -> list[dict]:
    """One absorbed launch at one shape, graph and eager, printed and returned: against its load floor and,
    with ``peers`` (the unfused path, AITER's fused launch, the aiter provider), against each of them."""
    from k3_amd_overlay.commands.bench.timing import eager_us, graph_us

    results = []
    for mode, timer in (("graph", graph_us), ("eager", eager_us)):
        t_one = timer(one)
        floor = max(empty["one_load_" + mode], floor_bw)
        result = dict(op=op, heads=heads, tokens=tokens, mode=mode, fused_us=t_one, bytes_bw_us=floor_bw,
                      fused_over_load_floor=t_one / floor)
        cells = [heads, tokens, mode, t_one, floor_bw, t_one / floor]
        if peers:
            unfused, aiter_fused, aiter_provider = peers
            result.update(baseline_us=timer(unfused), aiter_fused_us=timer(aiter_fused),
                          aiter_provider_us=timer(aiter_provider))
            result.update(ratio=result["baseline_us"] / t_one, ratio_vs_aiter=result["aiter_fused_us"] / t_one)
            cells += [result["baseline_us"], result["ratio"], result["aiter_fused_us"], result["ratio_vs_aiter"],
                      result["aiter_provider_us"]]
        print("| " + row(*cells) + " |")
        results.append(result)
    return results


def bench_absorb_fp8(heads_list: list[int], tokens_list: list[int], bw: float, empty: dict[str, float],
                     peers: bool, fmt: Fp8Format = E4M3FN) -> list[dict]:
    """vLLM's fp8 W_UK absorption folded in: the unfused fp8 path (AITER's fp8 BMM, then the overlay's
    qk_cache launch) and AITER's own fused fp8 kernel (its launch alone, query unscaled; and the aiter
    provider: that launch plus the static query quant), against the overlay's one launch."""
    from k3_amd_overlay.commands.bench import aiter_peers
    from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache
    from k3_amd_overlay.kernels.qk_cache import qk_cache
    from k3_amd_overlay.ops import aiter_absorb

    results = []
    lora, rope, nope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM
    print(f"\n### absorb_qk_cache, fp8 W_UK (VLLM_ROCM_USE_AITER_FP8BMM): one launch vs peers ({fmt.name}, block 1536)")
    print("| H | B | mode | one launch µs | bytes/bw µs | one launch / max(one-load, bytes) |"
          + (" fp8 bmm + qk_cache µs | vs it | AITER fused µs | vs it | aiter provider µs |" if peers else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|---|---|" if peers else ""))
    for heads in heads_list:
        w_k, w_k_scale = fp8_weights(heads, fmt)
        for tokens in tokens_list:
            q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)

            def one() -> None:
                absorb_fp8_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out,
                                    fmt)

            def unfused() -> None:
                ql_nope = aiter_peers.fp8_bmm(q_nope, w_k, w_k_scale)
                qk_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)

            def aiter_fused() -> None:
                aiter_absorb.fused_query(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache.view(fmt.dtype), slots,
                                         k_scale, fmt.dtype)

            def aiter_provider() -> None:
                aiter_absorb.run(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache.view(fmt.dtype), slots, k_scale,
                                 q_scale, q_out.view(fmt.dtype), fmt)

            moved = (heads * nope * lora + tokens * heads * (nope + rope) * 2 + tokens * (lora + rope) * 2
                     + tokens * 8 + tokens * (heads + 1) * (lora + rope))
            results += _time_against_peers("absorb_qk_cache_fp8", heads, tokens, moved / bw, empty, one,
                                           (unfused, aiter_fused, aiter_provider) if peers else None)
    return results


def sweep_absorb_fp8(heads_list: list[int], tokens_list: list[int], fmt: Fp8Format = E4M3FN) -> list[dict]:
    """The fp8 absorb kernel's launch shapes side by side (graph replay): column block x warps."""
    import torch

    from k3_amd_overlay.commands.bench.timing import graph_us
    from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache

    results = []
    shapes = [(n, w, 0) for n in (16, 32, 64, 128) for w in (2, 4, 8)] + [(n, w, 1) for n in (16, 32, 64)
                                                                          for w in (1, 2, 4)]
    lora, rope, nope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM
    print("\n### fp8 absorb kernel launch shapes (graph µs; columns: BLOCK_N x num_warps, t1: one token a "
          "program, no tensor cores)")
    print("| H | B | " + " | ".join(f"{n}x{w}" + ("t1" if t else "") for n, w, t in shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for heads in heads_list:
        w_k, w_k_scale = fp8_weights(heads, fmt)
        for tokens in tokens_list:
            q = torch.randn(tokens, heads, nope + rope, dtype=torch.bfloat16, device="cuda")
            kv_c = torch.randn(tokens, lora, dtype=torch.bfloat16, device="cuda")
            k_pe = torch.randn(tokens, rope, dtype=torch.bfloat16, device="cuda")
            cache = torch.zeros(4, 1536, lora + rope, dtype=torch.uint8, device="cuda")
            slots = torch.randperm(4 * 1536, device="cuda")[:tokens].to(torch.int64)
            scale = torch.tensor([1.1], device="cuda")
            q_out = torch.empty(tokens, heads, lora + rope, dtype=torch.uint8, device="cuda")
            times = [graph_us(lambda n=n, w=w, t=t: absorb_fp8_qk_cache(
                q[..., :nope], w_k, w_k_scale, q[..., nope:], kv_c, k_pe, cache, slots, scale, scale, q_out, fmt,
                n, w, t or None)) for n, w, t in shapes]
            print("| " + row(heads, tokens, *times) + " |")
            results.append(dict(op="absorb_fp8_sweep", heads=heads, tokens=tokens,
                                times={f"{n}x{w}" + ("t1" if t else ""): us
                                       for (n, w, t), us in zip(shapes, times, strict=True)}))
    return results


def bf16_weights(heads: int, device: str = "cuda") -> torch.Tensor:
    """Random bf16 W_UK_T [H, P, L] (magnitude ~1/8) in vLLM's layout: a permuted view of [L, H, P]."""
    import torch

    lora, nope = k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM
    return (torch.randn(lora, heads, nope, dtype=torch.bfloat16, device=device) / 8).permute(1, 2, 0)


def fp8_weights(heads: int, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 W_K [H, L, P] in ``fmt`` (clamped to its range) and its one fp32 per-tensor scale, as
    vLLM's fp8 absorption holds them."""
    import torch

    lora, nope = k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM
    w_k = (torch.randn(heads, lora, nope, device="cuda") * 40).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)
    return w_k, torch.tensor(0.003, device="cuda")


def mxfp4_weights(heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 W_K [H, L, P/2] and e8m0 W_K_scale [H, L, P/32] in vLLM's layout (transposed views of
    the [L, H, ...] quant), scales around 2**-5 as a bf16 W_UK of magnitude ~0.1 gives."""
    import torch

    lora, nope = k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM
    w_k = torch.randint(0, 256, (lora, heads, nope // 2), dtype=torch.uint8, device="cuda").transpose(0, 1)
    w_k_scale = torch.randint(120, 125, (lora, heads, nope // 32), dtype=torch.uint8, device="cuda").transpose(0, 1)
    return w_k, w_k_scale


def bench_absorb_mxfp4(heads_list: list[int], tokens_list: list[int], bw: float, empty: dict[str, float],
                       peers: bool, fmt: Fp8Format = E4M3FN, sweep: bool = False) -> list[dict]:
    """vLLM's MXFP4 W_UK absorption folded in: the unfused fp4 path (AITER's MXFP4 GEMM, then the
    overlay's qk_cache launch) and AITER's own fused fp4 kernel (its launch alone; on sm90 it mis-scales
    groups below ~3.5, which changes no time), against the overlay's one launch. ``sweep``: the
    overlay kernel's launch shapes instead."""

    from k3_amd_overlay.commands.bench import aiter_peers
    from k3_amd_overlay.commands.bench.timing import graph_us
    from k3_amd_overlay.kernels.absorb_mxfp4_qk_cache import absorb_mxfp4_qk_cache
    from k3_amd_overlay.kernels.qk_cache import qk_cache
    from k3_amd_overlay.ops import aiter_absorb

    results = []
    lora, rope, nope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM
    shapes = [(n, w, t) for n in (16, 32, 64, 128) for w in (4, 8) for t in (0, 1)]
    if sweep:
        print("\n### MXFP4 absorb kernel launch shapes (graph µs; BLOCK_N x num_warps, t1: one token a program)")
        print("| H | B | " + " | ".join(f"{n}x{w}" + ("t1" if t else "") for n, w, t in shapes) + " |")
        print("|---|---|" + "---|" * len(shapes))
    else:
        print(f"\n### absorb_qk_cache, MXFP4 W_UK (VLLM_ROCM_USE_AITER_FP4BMM): one launch vs peers ({fmt.name})")
        print("| H | B | mode | one launch µs | bytes/bw µs | one launch / max(one-load, bytes) |"
              + (" fp4 bmm + qk_cache µs | vs it | AITER fused µs | vs it | aiter provider µs |" if peers else ""))
        print("|---|---|---|---|---|---|" + ("---|---|---|---|---|" if peers else ""))
    for heads in heads_list:
        w_k, w_k_scale = mxfp4_weights(heads)
        for tokens in tokens_list:
            q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)
            if sweep:
                times = [graph_us(lambda n=n, w=w, t=t: absorb_mxfp4_qk_cache(
                    q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt, n, w,
                    1 if t else None)) for n, w, t in shapes]
                print("| " + row(heads, tokens, *times) + " |")
                results.append(dict(op="absorb_mxfp4_sweep", heads=heads, tokens=tokens,
                                    times={f"{n}x{w}" + ("t1" if t else ""): us
                                           for (n, w, t), us in zip(shapes, times, strict=True)}))
                continue

            def one() -> None:
                absorb_mxfp4_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale,
                                      q_out, fmt)

            def unfused() -> None:
                ql_nope = aiter_peers.fp4_bmm(q_nope, w_k, w_k_scale, q_scale)
                qk_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)

            def aiter_fused() -> None:
                aiter_absorb.fused_query_mxfp4(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache.view(fmt.dtype),
                                               slots, k_scale, q_scale)

            def aiter_provider() -> None:
                aiter_absorb.run_mxfp4(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache.view(fmt.dtype), slots,
                                       k_scale, q_scale, q_out.view(fmt.dtype), fmt)

            moved = (heads * lora * (nope // 2 + nope // 32) + tokens * heads * (nope + rope) * 2
                     + tokens * (lora + rope) * 2 + tokens * 8 + tokens * (heads + 1) * (lora + rope))
            results += _time_against_peers("absorb_qk_cache_mxfp4", heads, tokens, moved / bw, empty, one,
                                           (unfused, aiter_fused, aiter_provider) if peers else None)
    return results


SECTIONS = ("qkv_norm", "qk_cache", "absorb_qk_cache", "absorb_fp8", "absorb_mxfp4", "layer_step")
# The options that replace a section's benchmark with their own table: (option, argument name, section).
REPLACING = (("--absorb-block-n", "absorb_block_n", "absorb_qk_cache"), ("--sweep-fp8", "sweep_fp8", "absorb_fp8"),
             ("--sweep-mxfp4", "sweep_mxfp4", "absorb_mxfp4"))


def parser() -> Parser:
    p = Parser(prog="k3-amd-overlay bench", description=describe(__doc__),
               epilog="k3-amd-overlay bench plot OUT.json draws what --json-out wrote (its own --help). "
                      + EPILOG)
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout on every path (every measurement; the tables go to stderr)")
    p.add_argument("--json-out", type=Path, metavar="FILE",
                   help="also write every measurement to FILE (what bench plot reads)")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--absorb-block-n", type=int, nargs="+", metavar="N",
                   help="absorb kernel column blocks to compare (in place of the absorb_qk_cache section)")
    p.add_argument("--sweep-fp8", action="store_true",
                   help="the fp8 absorb kernel's launch shapes (in place of the absorb_fp8 section)")
    p.add_argument("--sweep-mxfp4", action="store_true",
                   help="the MXFP4 absorb kernel's launch shapes (in place of the absorb_mxfp4 section)")
    p.add_argument("--only", choices=SECTIONS,
                   help="one section (default: all); with --absorb-block-n, --sweep-fp8 or --sweep-mxfp4 only the "
                        "section that option replaces")
    p.add_argument("--peers", choices=("aiter",), help="add AMD's AITER Triton kernels as columns "
                   f"(on ROCm from the installed AITER; elsewhere from ${AITER_TREE})")
    return p


def legacy_argv(argv: list[str]) -> list[str]:
    """``--json FILE`` (before --json became the flag it is for every command) as ``--json-out FILE``,
    said on stderr where it converts."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--":
            break
        if arg == "--json" and not out[i + 1].startswith("-"):
            out[i] = "--json-out"
    if out != argv:
        print("k3-amd-overlay bench: --json FILE is --json-out FILE now (--json: one JSON object on stdout)",
              file=sys.stderr)
    return out


def check_json_out(given: str | Path) -> None:
    """--json-out names a file that can be written once the benchmark is done: checked before it starts,
    so that no measurement is lost to a path that cannot take it."""
    path = Path(given)
    if path.is_dir():
        raise UsageError(f"--json-out {given}: a directory; name a file (e.g. {path / 'bench.json'})")
    directory = path.parent
    if not directory.is_dir():
        raise UsageError(f"--json-out {given}: the directory {directory} does not exist (bench creates none)")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(directory, os.W_OK | os.X_OK)
    if not writable:
        raise UsageError(f"--json-out {given}: cannot be written here (permissions)")


def check_absorb_block_n(values: list[int] | None) -> None:
    """Each --absorb-block-n value is a column block the absorb kernel takes: a power of two (a Triton
    tile) of at most L (``k3.KV_LORA_RANK``, the latent columns it splits; more would be cut to L, so
    the table would name a block that never ran)."""
    for value in values or []:
        if not (0 < value <= k3.KV_LORA_RANK and value & (value - 1) == 0):
            raise UsageError(f"--absorb-block-n {value}: a power of two from 1 to {k3.KV_LORA_RANK} (the kernel's "
                             f"latent columns per program, a Triton tile of the {k3.KV_LORA_RANK} it splits)")


def write_json_out(given: str | Path, measured: dict) -> str | None:
    """Write the measurements to --json-out's file; why it could not be (checked before the benchmark,
    so only a change meanwhile), else None."""
    try:
        with open(given, "w") as handle:
            json.dump({k: v for k, v in measured.items() if k != "error"}, handle, indent=1)
    except OSError as exc:
        return f"--json-out {given}: cannot write it ({exc}); the tables (and with --json, stdout) have the measurements"
    return None


def check_sections(args: argparse.Namespace) -> None:
    """An option that replaces a section's benchmark (``REPLACING``) runs in that section: with
    ``--only`` another section it would run besides the one asked for (or, skipped, be dropped)."""
    for option, name, section in REPLACING:
        if args.only is not None and getattr(args, name) and section != args.only:
            raise UsageError(f"--only {args.only} with {option}: {option} replaces the {section} section, which "
                             f"--only {args.only} leaves out; give --only {section}, or leave --only out (every "
                             "section)")


def check_args(args: argparse.Namespace) -> None:
    """The checks of bench's arguments that need no torch (the CLI runs them before it looks for it):
    UsageError naming the value and what is allowed."""
    check_absorb_block_n(args.absorb_block_n)
    check_sections(args)
    if args.json_out is not None:
        check_json_out(args.json_out)


def main(argv: list[str] | None = None) -> int:
    return tool_main(sys.modules[__name__], argv)


def checked_main(args: argparse.Namespace) -> int:
    """The run of arguments ``usage.checked_args`` accepted (the CLI calls it once it has found torch
    and triton)."""
    if not args.json:
        return run(args)
    measured: dict = {}
    with contextlib.redirect_stdout(sys.stderr):  # the tables to stderr; stdout: the one object
        code = run(args, measured)
    print(json_result("bench", code == 0, **measured))
    return code


def run(args: argparse.Namespace, measured: dict | None = None) -> int:
    """The benchmark of parsed arguments; 1 where it cannot run here (no GPU, --peers aiter without
    AITER) or a layer step's parity failed. ``measured``: filled with what --json-out writes, or an
    error."""
    import torch
    import triton

    from k3_amd_overlay.commands.bench import aiter_peers
    from k3_amd_overlay.commands.bench.baselines import _empty_kernel, _one_load_kernel
    from k3_amd_overlay.commands.bench.timing import bandwidth_bytes_per_us, eager_us, graph_us

    measured = {} if measured is None else measured
    why = "no GPU: nothing to benchmark" if not torch.cuda.is_available() else None
    peers = args.peers == "aiter"
    if why is None and peers and (missing := aiter_peers.enable()):
        why = f"--peers aiter: {missing}"
    if why:
        measured["error"] = why
        print(why, file=sys.stderr)
        return EXIT_FAILED
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = bandwidth_bytes_per_us()
    dummy = torch.empty(1, device="cuda")
    sink = torch.empty(1, device="cuda")
    empty = {"graph": graph_us(lambda: _empty_kernel[(1,)](dummy)), "eager": eager_us(lambda: _empty_kernel[(1,)](dummy)),
             "one_load_graph": graph_us(lambda: _one_load_kernel[(1,)](dummy, sink)),
             "one_load_eager": eager_us(lambda: _one_load_kernel[(1,)](dummy, sink))}
    print(f"device: {props.name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"copy bandwidth {bw / 1e6:.2f} TB/s; empty launch graph {empty['graph']:.2f} µs, eager {empty['eager']:.2f} µs; "
          f"one-load launch graph {empty['one_load_graph']:.2f} µs, eager {empty['one_load_eager']:.2f} µs")
    tokens = [1, 8, 64, 512] if args.quick else NORM_TOKENS
    heads = [3, 12] if args.quick else HEADS
    batch = [1, 32, 256] if args.quick else QK_CACHE_BATCHES
    absorb_batches = [1, 32, 256] if args.quick else ABSORB_BATCHES
    results = []
    if args.only in (None, "qkv_norm"):
        results += bench_qkv_norm(tokens, bw, empty)
    if args.only in (None, "qk_cache"):
        results += bench_qk_cache(heads, batch, bw, empty, peers=peers)
    if args.absorb_block_n:
        for block_n in args.absorb_block_n:
            print(f"\nabsorb kernel BLOCK_N = {block_n}")
            results += bench_absorb([3, 12, 16], [1, 32, 256], bw, empty, block_n=block_n)
    elif args.only in (None, "absorb_qk_cache"):
        results += bench_absorb([3, 12] if args.quick else [3, 12, 16],
                                absorb_batches, bw, empty)
    if args.sweep_fp8:
        results += sweep_absorb_fp8([3, 12, 16], [1, 4, 8, 32, 64])
    elif args.only in (None, "absorb_fp8"):
        results += bench_absorb_fp8(heads, absorb_batches, bw, empty, peers)
    if args.sweep_mxfp4:
        results += bench_absorb_mxfp4([3, 12, 16], [1, 4, 8, 32, 64], bw, empty, False, sweep=True)
    elif args.only in (None, "absorb_mxfp4"):
        fp4_why = aiter_peers.fp4_missing() if peers else None
        if fp4_why:
            print(f"--peers aiter: no MXFP4 peer columns: {fp4_why}", file=sys.stderr)
        mxfp4_peers = peers and not fp4_why
        results += bench_absorb_mxfp4(heads, absorb_batches, bw, empty,
                                      mxfp4_peers)
    from k3_amd_overlay.commands.bench import layer_step  # it imports this module: not at the top

    if args.only in (None, "layer_step"):  # a shape whose parity failed is not timed and fails the run
        results += layer_step.bench(heads, absorb_batches, peers)
    measured.update(device=props.name, torch=torch.__version__, triton=triton.__version__, bandwidth_tb_s=bw / 1e6,
                    empty_us=empty, results=results)
    if args.json_out and (why := write_json_out(args.json_out, measured)):
        measured["error"] = why
        print(why, file=sys.stderr)
        return EXIT_FAILED
    if layer_step.failed(results):
        measured["error"] = "a layer step's parity failed: it was not timed"
        return EXIT_FAILED
    return 0

