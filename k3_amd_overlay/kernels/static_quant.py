"""Triton kernel for a static per-tensor fp8 quant of a [T, H, D] query (one program per token and
head): the second launch of the AITER provider of the fp8 absorbed decode (AITER's fused kernel
takes no query scale), and the benchmarks' stand-in for vLLM's own static quant launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.kernels.launch import config_for, launch
from k3_amd_overlay.kernels.names import STATIC_QUANT_KERNEL
from k3_amd_overlay.kernels.qk_cache import _fp8_bits, fp8_mode


@triton.jit
def query_fp8_quant_kernel(x_ptr, out_ptr, scale_ptr, fmax, heads, s_x_t, s_x_h, s_out_t, s_out_h, D: tl.constexpr,
                        BLOCK: tl.constexpr, FP8_MODE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, h = row // heads, row % heads
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    scale = tl.load(scale_ptr)
    inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
    x = tl.load(x_ptr + t * s_x_t + h * s_x_h + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + t * s_out_t + h * s_out_h + offs, _fp8_bits(x, inv, fmax, FP8_MODE), mask=mask)


def scaled_quant(x: torch.Tensor, scale: torch.Tensor, out_bytes: torch.Tensor, fmt: Fp8Format) -> None:
    """``out = fp8(clamp(x / scale))`` for x [T, H, D] (unit last stride) into a uint8 view [T, H, D]."""
    tokens, heads, width = x.shape
    launch(
        query_fp8_quant_kernel, (tokens * heads,),
        x, out_bytes, scale, fmt.fmax, heads, x.stride(0), x.stride(1), out_bytes.stride(0), out_bytes.stride(1),
        D=width, BLOCK=triton.next_power_of_2(width), FP8_MODE=fp8_mode(fmt, x.device),
        **config_for(STATIC_QUANT_KERNEL, x.device, tokens, heads))
