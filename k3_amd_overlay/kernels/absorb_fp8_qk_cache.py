"""Triton kernel for the decode query path with vLLM's fp8 W_UK absorption (ROCm's
``VLLM_ROCM_USE_AITER_FP8BMM``), in one launch: q_nope quantised to fp8 per token and head (one
group of P = 128, dynamic: scale = max|q| / fp8 max, as the AITER batched GEMM vLLM calls does),
the fp8 x fp8 product with vLLM's per-tensor-quantised ``W_K`` [H, L, P], both scales applied, the
result rounded to the query dtype (the GEMM's bf16 output), then the ``[ql_nope | q_pe]`` concat,
the static fp8 query quant and the fp8 KV-cache write. Programs as in ``absorb_qk_cache.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_amd_overlay.fp8 import Fp8Format, format_of
from k3_amd_overlay.kernels import target
from k3_amd_overlay.kernels.absorb_qk_cache import (
    FEW_TOKEN_MOST,
    absorb_launch,
    load_rope,
    query_operands,
    store_query,
    summed_products,
    write_kv_program,
)
from k3_amd_overlay.kernels.launch import check_cache_alignment, launch
from k3_amd_overlay.kernels.names import ABSORB_FP8_QK_CACHE_KERNEL
from k3_amd_overlay.kernels.qk_cache import CACHE_POINTER, _fp8_bits, fp8_mode
from k3_amd_overlay.kernels.rounding import emulate_bf16, to_dtype_rne

GROUP = 128  # vLLM quantises q_nope in groups of 128 (``triton_fp8_bmm(..., group_size=128)``)


@triton.jit(do_not_specialize=CACHE_POINTER)
def absorb_fp8_qk_cache_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_n, s_w_k, s_qn_t, s_qn_h,
    w_scale_ptr, q_scale_ptr, q_pe_ptr, s_qp_t, s_qp_h, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, W_FMAX: tl.constexpr, FP8_MODE: tl.constexpr, W_FP8_MODE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        column, head, t64, live, offs_n, q_nope, w = query_operands(
            pid, q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, num_tokens, token_blocks, P, L, BLOCK_T,
            BLOCK_N)
        pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
        # both scalar scales with the operands: after the max's and the dot's barriers each load was a
        # second memory round trip
        w_scale = tl.load(w_scale_ptr)
        scale = tl.load(q_scale_ptr)
        # the dynamic per-(token, head) quant of the AITER GEMM: scale = max(max|q|, 1e-10) times the
        # fp32 constant 1 / fp8 max (folded at compile time, as there: a run-time fp32 reciprocal can be
        # an ulp off and move codes), q * (1 / scale) clamped and cast to the weight's fp8 type
        amax = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), axis=1), 1e-10)[:, None]
        a_scale = amax * (1.0 / W_FMAX)
        a_recip = 1.0 / a_scale
        if DOT_IN_FP32:  # the CPU interpreter's fp8 cast loses mantissa carries: round on the bits
            q8 = _fp8_bits(q_nope.to(tl.float32), a_recip, W_FMAX, W_FP8_MODE).to(w_ptr.dtype.element_ty, bitcast=True)
        else:
            q8 = tl.clamp(q_nope.to(tl.float32) * a_recip, -W_FMAX, W_FMAX).to(w_ptr.dtype.element_ty)
        if BLOCK_T <= FEW_TOKEN_MOST:  # few tokens: the exact fp8 products summed in fp32 beat a padded dot
            ql = summed_products(q8, w)
        elif DOT_IN_FP32:  # the CPU interpreter mishandles fp8 dots: the same exact products in fp32
            ql = tl.dot(q8.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:  # full fp32 accumulation (sm90's default for fp8 keeps fewer bits and moves codes; AMD's is this)
            ql = tl.dot(q8, w, max_num_imprecise_acc=0)
        ql = ql * a_scale * w_scale
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


def absorb_fp8_qk_cache(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor, q_pe: torch.Tensor,
                        kv_c: torch.Tensor, k_pe: torch.Tensor, cache_bytes: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor,
                        q_out_bytes: torch.Tensor, fmt: Fp8Format, block_n: int | None = None,
                        num_warps: int | None = None, block_tokens: int | None = None) -> None:
    """Launch on validated inputs: q_nope [T, H, P = 128]; W_K [H, L, P] fp8 (any strides);
    W_K_scale one fp32 element; k_pe 2-D; uint8 views of cache and q_out. ``block_n``,
    ``num_warps``, ``block_tokens``: the launch shape, by default the arch's config (sweeps compare
    others)."""
    num_tokens, num_heads, nope = q_nope.shape
    lora, rope = w_k.shape[1], q_pe.shape[-1]
    grid, config = absorb_launch(ABSORB_FP8_QK_CACHE_KERNEL, q_nope, lora, block_n, num_warps, block_tokens)
    check_cache_alignment(ABSORB_FP8_QK_CACHE_KERNEL, cache_bytes)
    launch(
        absorb_fp8_qk_cache_kernel, grid,
        w_k, q_nope, num_heads, num_tokens, w_k.stride(0), w_k.stride(1), w_k.stride(2),
        q_nope.stride(0), q_nope.stride(1),
        w_k_scale, q_scale, q_pe, q_pe.stride(0), q_pe.stride(1), q_out_bytes, q_out_bytes.stride(0),
        q_out_bytes.stride(1), fmt.fmax,
        kv_c, k_pe, cache_bytes, slot_mapping, k_scale, kv_c.stride(0), k_pe.stride(0), cache_bytes.stride(0),
        cache_bytes.stride(1), cache_bytes.shape[1],
        W_FMAX=format_of(w_k.dtype).fmax, P=nope, L=lora, R=rope,
        FP8_MODE=fp8_mode(fmt, q_nope.device), W_FP8_MODE=fp8_mode(format_of(w_k.dtype), q_nope.device),
        DOT_IN_FP32=not target.of(q_nope.device).gpu, EMULATE_BF16=emulate_bf16(q_nope.device), **config,
    )
