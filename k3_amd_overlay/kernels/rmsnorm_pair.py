"""Triton kernels for RMSNorm: the q_a/kv_a pair in one launch, and the single-tensor kernel of
the same design that the benchmark's two-launch baseline uses.

Design: one flat grid of q-row programs then kv-row programs, rows per program and warps from the
arch's launch configs (on an H200 one q row and four kv rows a program, about 2048 lanes each at 4
warps, was fastest at every T measured; a token's two rows in one program was slower:
docs/benchmarks.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_amd_overlay.kernels.launch import config_for, launch
from k3_amd_overlay.kernels.names import RMSNORM_PAIR_KERNEL
from k3_amd_overlay.kernels.rounding import emulate_bf16, to_dtype_rne


@triton.jit
def _norm_rows(x_ptr, out_ptr, w_ptr, x_stride, out_stride, row0, n_rows, eps,
               N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, EMULATE_BF16: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]  # int64 offsets: strides of ~24K overflow int32 past ~87K rows
    x = tl.load(x_ptr + r64 * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # The weight is loaded with the row, not after the sum: the sum's cross-warp reduction is a
    # barrier the compiler does not move a load over, so a load after it is a second round trip.
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    # Round the normalised value to the weight's dtype before the multiply, as vLLM's RMSNorm does;
    # the product of two bf16/fp16 values is exact in fp32, so one rounding to the output follows.
    normed = to_dtype_rne(x * inv_rms[:, None], w_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
    y = normed * w.to(tl.float32)[None, :]
    tl.store(out_ptr + r64 * out_stride + cols[None, :], to_dtype_rne(y, out_ptr.dtype.element_ty, EMULATE_BF16),
             mask=mask)


@triton.jit
def rmsnorm_pair_kernel(
    q_ptr, q_out_ptr, q_w_ptr, q_stride, q_out_stride, q_eps,
    kv_ptr, kv_out_ptr, kv_w_ptr, kv_stride, kv_out_stride, kv_eps, num_tokens,
    Q: tl.constexpr, KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    ROWS_Q: tl.constexpr, ROWS_KV: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    # Programs [0, q_programs) normalise q rows, the rest kv rows; one flat grid axis (no 65535 cap).
    pid = tl.program_id(0)
    q_programs = tl.cdiv(num_tokens, ROWS_Q)
    if pid < q_programs:
        _norm_rows(q_ptr, q_out_ptr, q_w_ptr, q_stride, q_out_stride, pid * ROWS_Q, num_tokens,
                   q_eps, Q, BLOCK_Q, ROWS_Q, EMULATE_BF16)
    else:
        _norm_rows(kv_ptr, kv_out_ptr, kv_w_ptr, kv_stride, kv_out_stride,
                   (pid - q_programs) * ROWS_KV, num_tokens, kv_eps, KV, BLOCK_KV, ROWS_KV, EMULATE_BF16)


@triton.jit
def rmsnorm_kernel(x_ptr, out_ptr, w_ptr, x_stride, out_stride, eps, num_tokens,
                   N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, EMULATE_BF16: tl.constexpr):
    _norm_rows(x_ptr, out_ptr, w_ptr, x_stride, out_stride, tl.program_id(0) * ROWS, num_tokens,
               eps, N, BLOCK, ROWS, EMULATE_BF16)


def rmsnorm_pair(q_c: torch.Tensor, kv_c: torch.Tensor, q_weight: torch.Tensor,
                 kv_weight: torch.Tensor, q_eps: float, kv_eps: float,
                 q_out: torch.Tensor, kv_out: torch.Tensor) -> None:
    num_tokens, q_size = q_c.shape
    kv_size = kv_c.shape[1]
    config = config_for(RMSNORM_PAIR_KERNEL, q_c.device, num_tokens)
    grid = (triton.cdiv(num_tokens, config["ROWS_Q"]) + triton.cdiv(num_tokens, config["ROWS_KV"]),)
    launch(
        rmsnorm_pair_kernel, grid,
        q_c, q_out, q_weight, q_c.stride(0), q_out.stride(0), q_eps,
        kv_c, kv_out, kv_weight, kv_c.stride(0), kv_out.stride(0), kv_eps, num_tokens,
        Q=q_size, KV=kv_size, BLOCK_Q=triton.next_power_of_2(q_size),
        BLOCK_KV=triton.next_power_of_2(kv_size), EMULATE_BF16=emulate_bf16(q_c.device), **config,
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
            rows: int = 1, num_warps: int = 4) -> None:
    """One RMSNorm launch (the benchmark baseline picks its best ``rows``/``num_warps``)."""
    num_tokens, size = x.shape
    rmsnorm_kernel[(triton.cdiv(num_tokens, rows),)](
        x, out, weight, x.stride(0), out.stride(0), eps, num_tokens,
        N=size, BLOCK=triton.next_power_of_2(size), ROWS=rows, EMULATE_BF16=emulate_bf16(x.device),
        num_warps=num_warps)
