"""The unfused baseline launches the benchmarks compare each fusion with, written to the same
quality as the fused kernels so that a ratio measures the fusion, not the code: vLLM's KV-cache
write (``concat_and_cache_mla``: scale, saturate, store one latent row per token; its static fp8
query quant is ``kernels/static_quant.py``), the concat and quant as vLLM's default serving compiles
them into one kernel (``compiled_concat_quant``), plus the empty and one-load launches that floor any
kernel's time. Kernel names contain the census names of what they stand for."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from k3_amd_overlay.kernels.qk_cache import _fp8_bits


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _one_load_kernel(x_ptr, y_ptr):  # each program one element: a grid of N loads N at once
    tl.store(y_ptr + tl.program_id(0), tl.load(x_ptr + tl.program_id(0)) + 1.0)


@triton.jit
def concat_and_cache_mla_like_kernel(kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_blk,
                     s_row, block_size, fmax, L: tl.constexpr, R: tl.constexpr, FP8_MODE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        scale = tl.load(k_scale_ptr)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        row = cache_ptr + (slot // block_size) * s_blk + (slot % block_size) * s_row
        kv_c = tl.load(kv_c_ptr + t * s_kv_t + offs_l).to(tl.float32)
        k_pe = tl.load(k_pe_ptr + t * s_kpe_t + offs_r).to(tl.float32)
        tl.store(row + offs_l, _fp8_bits(kv_c, inv, fmax, FP8_MODE))
        tl.store(row + L + offs_r, _fp8_bits(k_pe, inv, fmax, FP8_MODE))


@functools.cache
def compiled_concat_quant(device_type: str, fmax: float, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The ``[ql_nope | q_pe]`` concat and static fp8 query quant as vLLM 0.33's default serving runs
    them on a GPU: ``_DecodeConcatQuantFP8``'s native forward (vllm/model_executor/layers/attention/
    mla_attention.py, its QuantFP8 base's native path: cat, flatten the heads, times the fp32
    reciprocal of the scale, clamp, convert) compiled by torch.compile into one Inductor kernel, which
    returns a new fp8 tensor [T, H, L + R]; under vLLM's torch.compile mode QuantFP8 is no enabled
    custom op, so it is built with ``compile_native=True`` (CustomOp.dispatch_forward, maybe_compile);
    with --enforce-eager the custom op runs, torch.cat then the quant, two launches. Off a GPU (the
    CPU interpreter's tests) the same operations uncompiled."""
    def concat_quant(ql_nope: torch.Tensor, q_pe: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        q = torch.cat((ql_nope, q_pe), dim=-1)
        flat = q.reshape(q.shape[0], -1)
        codes = (flat.to(torch.float32) * scale.to(torch.float32).reciprocal()).clamp(-fmax, fmax).to(dtype)
        return codes.view(q.shape)

    if device_type != "cuda":
        return concat_quant
    # One compile per shape, as vLLM's capture sizes each have theirs; a benchmark's dozens of shapes pass
    # torch.compile's default of 8 recompiles, after which the function would run uncompiled, op by op
    # (the layer step on an H100, 2026-12-07: slower than the eager stock).
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, 1024)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4096)
    return torch.compile(concat_quant, dynamic=False)
