"""Triton kernels for RMSNorm: the q_a/kv_a pair in one launch, and the single-tensor kernel of
the same quality that the benchmark's two-launch baseline uses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_row(x_ptr, out_ptr, w_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rmsnorm_pair_kernel(
    q_ptr, q_out_ptr, q_w_ptr, q_stride, q_out_stride, q_eps,
    kv_ptr, kv_out_ptr, kv_w_ptr, kv_stride, kv_out_stride, kv_eps,
    Q: tl.constexpr, KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
):
    # Token on grid-x (no 65535 cap), which norm on grid-y; int64 row offsets for huge T.
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _norm_row(q_ptr + t * q_stride, q_out_ptr + t * q_out_stride, q_w_ptr, q_eps, Q, BLOCK_Q)
    else:
        _norm_row(kv_ptr + t * kv_stride, kv_out_ptr + t * kv_out_stride, kv_w_ptr, kv_eps, KV,
                  BLOCK_KV)


@triton.jit
def rmsnorm_kernel(x_ptr, out_ptr, w_ptr, x_stride, out_stride, eps,
                   N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _norm_row(x_ptr + t * x_stride, out_ptr + t * out_stride, w_ptr, eps, N, BLOCK)


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4 if block >= 512 else 2


def rmsnorm_pair(q_c: torch.Tensor, kv_c: torch.Tensor, q_weight: torch.Tensor,
                 kv_weight: torch.Tensor, q_eps: float, kv_eps: float,
                 q_out: torch.Tensor, kv_out: torch.Tensor) -> None:
    num_tokens, q_size = q_c.shape
    kv_size = kv_c.shape[1]
    block_q, block_kv = triton.next_power_of_2(q_size), triton.next_power_of_2(kv_size)
    rmsnorm_pair_kernel[(num_tokens, 2)](
        q_c, q_out, q_weight, q_c.stride(0), q_out.stride(0), q_eps,
        kv_c, kv_out, kv_weight, kv_c.stride(0), kv_out.stride(0), kv_eps,
        Q=q_size, KV=kv_size, BLOCK_Q=block_q, BLOCK_KV=block_kv,
        num_warps=_warps(max(block_q, block_kv)),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    num_tokens, size = x.shape
    block = triton.next_power_of_2(size)
    rmsnorm_kernel[(num_tokens,)](x, out, weight, x.stride(0), out.stride(0), eps,
                                  N=size, BLOCK=block, num_warps=_warps(block))
