"""Triton kernel for the decode query path with vLLM's MXFP4 W_UK absorption (ROCm's
``VLLM_ROCM_USE_AITER_FP4BMM``), in one launch: q_nope quantised to MXFP4 per token, head and group
of 32 lanes (dynamic, as the AITER GEMM vLLM calls does; ``ops/reference.py`` states the rounding),
the product with vLLM's MXFP4 ``W_K`` [H, L, P / 2] under its e8m0 ``W_K_scale`` [H, L, P / 32],
times ``1 / y_scale`` (vLLM passes its q_scale), rounded to the query dtype, then the
``[ql_nope | q_pe]`` concat, the static fp8 query quant and the fp8 KV-cache write.

Both operands are dequantised in registers to bf16 (an e2m1 value times a power of two is exact
there) and multiplied on the bf16 tensor cores with fp32 accumulation: every product is exact, so
the result equals the GEMM's wherever the fp32 sum is exact (a row's group scales within about
nine binades of each other). The packed weight is split by nibble, not interleaved: the even lanes
of q_nope meet the low nibbles, the odd lanes the high ones. Programs as in ``absorb_qk_cache.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_amd_overlay import mxfp4
from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.kernels import target
from k3_amd_overlay.kernels.absorb_qk_cache import (
    FEW_TOKEN_MOST,
    absorb_launch,
    load_rope,
    query_rows,
    store_query,
    summed_products,
    write_kv_program,
)
from k3_amd_overlay.kernels.launch import check_cache_alignment, launch
from k3_amd_overlay.kernels.names import ABSORB_MXFP4_QK_CACHE_KERNEL
from k3_amd_overlay.kernels.qk_cache import CACHE_POINTER, fp8_mode
from k3_amd_overlay.kernels.rounding import emulate_bf16, to_dtype_rne


@triton.jit
def _rne_integer(x):
    """x (fp32, 0 <= x < 2**22) rounded to the nearest integer, ties to even, by fp32 addition."""
    return (x + 8388608.0) - 8388608.0


@triton.jit
def _pow2(exponent):
    """2 ** exponent (int32, -127..127) as fp32, from the bits; -127 gives 0 (fp32's bias is 127)."""
    return (tl.maximum(exponent + 127, 0) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_values(q, BLOCK_T: tl.constexpr, P: tl.constexpr, GROUP: tl.constexpr, AMAX_ROUND_BITS: tl.constexpr,
                 EXPONENT_OFFSET: tl.constexpr, E2M1_MAX: tl.constexpr):
    """q [BLOCK_T, P] (fp32) quantised to MXFP4 and back: each lane's e2m1 value times its group's
    power-of-two scale, in fp32."""
    groups = tl.reshape(q, (BLOCK_T, P // GROUP, GROUP))
    amax = tl.max(tl.abs(groups), axis=2)
    biased = ((amax.to(tl.int32, bitcast=True) + AMAX_ROUND_BITS) >> 23) & 0xFF
    exponent = tl.maximum(biased - 127 - EXPONENT_OFFSET, -127)[:, :, None]
    x = groups * _pow2(-exponent)
    magnitude = tl.abs(x)
    # e2m1 steps: 0.5 below 2, 1 below 4, 2 up to the saturating 6
    step = tl.where(magnitude < 2.0, 0.5, tl.where(magnitude < 4.0, 1.0, 2.0))
    rounded = tl.minimum(_rne_integer(magnitude * (1.0 / step)) * step, E2M1_MAX)
    return tl.reshape(tl.where(x < 0, -rounded, rounded) * _pow2(exponent), (BLOCK_T, P))


@triton.jit
def e2m1_value(code):
    """fp32 value of e2m1 codes (uint8 0-15): 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign."""
    exponent = ((code >> 1) & 3).to(tl.int32)
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (2.0 + mantissa) * (1 << exponent).to(tl.float32) * 0.25)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit(do_not_specialize=CACHE_POINTER)
def absorb_mxfp4_qk_cache_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_n, s_w_k, s_qn_t, s_qn_h,
    w_scale_ptr, s_ws_h, s_ws_n, s_ws_k, q_scale_ptr, q_pe_ptr, s_qp_t, s_qp_h, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, GROUP: tl.constexpr, AMAX_ROUND_BITS: tl.constexpr, EXPONENT_OFFSET: tl.constexpr,
    E2M1_MAX: tl.constexpr, FP8_MODE: tl.constexpr, DOT_IN_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        column, head, t64, live, offs_n, q_nope = query_rows(pid, q_nope_ptr, s_qn_t, s_qn_h, num_tokens,
                                                             token_blocks, P, L, BLOCK_T, BLOCK_N)
        pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
        q_scale = tl.load(q_scale_ptr)  # with the operands, not after the dot's barriers
        values = mxfp4_values(q_nope.to(tl.float32), BLOCK_T, P, GROUP, AMAX_ROUND_BITS, EXPONENT_OFFSET, E2M1_MAX)
        even, odd = tl.split(tl.reshape(values, (BLOCK_T, P // 2, 2)))
        # packed row j holds lanes 2j (low nibble) and 2j + 1 (high); its scale is group 2j // GROUP
        offs_j = tl.arange(0, P // 2)
        head64 = head.to(tl.int64)
        packed = tl.load(w_ptr + head64 * s_w_h + offs_j[:, None] * s_w_k + offs_n[None, :] * s_w_n)
        scale_bytes = tl.load(w_scale_ptr + head64 * s_ws_h + (offs_j[:, None] // (GROUP // 2)) * s_ws_k
                              + offs_n[None, :] * s_ws_n)
        scale = (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # e8m0 and fp32 share the bias 127
        w_low = e2m1_value(packed & 0xF) * scale
        w_high = e2m1_value(packed >> 4) * scale
        if BLOCK_T <= FEW_TOKEN_MOST:  # few tokens: the exact products summed in fp32 beat a padded dot
            ql = summed_products(even, w_low) + summed_products(odd, w_high)
        elif DOT_IN_FP32:  # the CPU interpreter: the same exact products in fp32
            ql = tl.dot(odd, w_high, acc=tl.dot(even, w_low, input_precision="ieee"), input_precision="ieee")
        else:
            ql = tl.dot(odd.to(tl.bfloat16), w_high.to(tl.bfloat16),
                        acc=tl.dot(even.to(tl.bfloat16), w_low.to(tl.bfloat16)))
        inv = tl.fdiv(q_scale * 0.0 + 1.0, q_scale, ieee_rounding=True)
        # vLLM hands its q_scale to the GEMM as y_scale and quantises the query with it again
        ql = to_dtype_rne(ql * inv, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


def absorb_mxfp4_qk_cache(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor, q_pe: torch.Tensor,
                          kv_c: torch.Tensor, k_pe: torch.Tensor, cache_bytes: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor,
                          q_out_bytes: torch.Tensor, fmt: Fp8Format, block_n: int | None = None,
                          num_warps: int | None = None, block_tokens: int | None = None) -> None:
    """Launch on validated inputs: q_nope [T, H, P]; W_K [H, L, P / 2] uint8 and W_K_scale
    [H, L, P / 32] uint8 (any strides: vLLM's are transposed views); k_pe 2-D; uint8 views of cache
    and q_out. ``block_n``, ``num_warps``, ``block_tokens``: the launch shape (default the arch's
    config)."""
    num_tokens, num_heads, nope = q_nope.shape
    lora, rope = w_k.shape[1], q_pe.shape[-1]
    grid, config = absorb_launch(ABSORB_MXFP4_QK_CACHE_KERNEL, q_nope, lora, block_n, num_warps, block_tokens)
    check_cache_alignment(ABSORB_MXFP4_QK_CACHE_KERNEL, cache_bytes)
    launch(
        absorb_mxfp4_qk_cache_kernel, grid,
        w_k, q_nope, num_heads, num_tokens, w_k.stride(0), w_k.stride(1), w_k.stride(2),
        q_nope.stride(0), q_nope.stride(1),
        w_k_scale, w_k_scale.stride(0), w_k_scale.stride(1), w_k_scale.stride(2), q_scale, q_pe, q_pe.stride(0),
        q_pe.stride(1), q_out_bytes, q_out_bytes.stride(0), q_out_bytes.stride(1), fmt.fmax,
        kv_c, k_pe, cache_bytes, slot_mapping, k_scale, kv_c.stride(0), k_pe.stride(0), cache_bytes.stride(0),
        cache_bytes.stride(1), cache_bytes.shape[1],
        P=nope, L=lora, R=rope, GROUP=mxfp4.GROUP,
        AMAX_ROUND_BITS=mxfp4.AMAX_ROUND_BITS, EXPONENT_OFFSET=mxfp4.SCALE_EXPONENT_OFFSET,
        E2M1_MAX=mxfp4.E2M1_MAX, FP8_MODE=fp8_mode(fmt, q_nope.device),
        DOT_IN_FP32=not target.of(q_nope.device).gpu, EMULATE_BF16=emulate_bf16(q_nope.device), **config,
    )
