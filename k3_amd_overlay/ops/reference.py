"""Torch references for the fused ops: the definition every provider is tested against.
Plain torch, runs on any device, allocates freely; never used on a hot path by default."""

from __future__ import annotations

import torch

from k3_amd_overlay.fp8 import Fp8Format


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps)`` in fp32, rounded to the weight's dtype, times the
    weight in that dtype, returned in x's dtype: the rounding of vLLM's RMSNorm (its native op,
    ``vllm/ir/ops/layernorm.py`` in 0.32, and its CUDA/HIP kernel both round the normalised
    value before the weight multiply), so a fused norm can match the two norms it replaces."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((xf * inv_rms).to(weight.dtype) * weight).to(x.dtype)


def rmsnorm_pair_reference(
    q_c: torch.Tensor,
    kv_c: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    q_eps: float,
    kv_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rmsnorm_reference(q_c, q_weight, q_eps), rmsnorm_reference(kv_c, kv_weight, kv_eps)


def absorb_w_uk_reference(q_nope: torch.Tensor, w_uk_t: torch.Tensor) -> torch.Tensor:
    """ql_nope [T, H, L] = q_nope [T, H, P] @ W_UK_T [H, P, L] per head, in the query dtype: the
    same ``torch.bmm`` call, into the same token-major layout, as vLLM's stock decode path."""
    tokens, heads, _ = q_nope.shape
    ql_nope = q_nope.new_empty((tokens, heads, w_uk_t.shape[-1]))
    torch.bmm(q_nope.transpose(0, 1), w_uk_t, out=ql_nope.transpose(0, 1))
    return ql_nope


def absorb_w_k_fp8_reference(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor,
                             fmt: Fp8Format) -> torch.Tensor:
    """ql_nope [T, H, L] in the query dtype from q_nope [T, H, P] and vLLM's fp8 ``W_K`` [H, L, P]
    with its per-tensor fp32 scale, by the arithmetic of the AITER batched GEMM that vLLM's
    ``rocm_aiter_ops.triton_fp8_bmm(..., group_size=128)`` calls: per token and group of 128 lanes
    ``a = max(max|q|, 1e-10) / fmax``, ``q8 = fp8(clamp(q * (1 / a), -fmax, fmax))``, then
    ``(q8 @ W_K^T) * a * W_K_scale`` accumulated in fp32 and rounded to the query dtype. ``fmt`` is
    W_K's fp8 format."""
    tokens, heads, nope = q_nope.shape
    groups = q_nope.float().reshape(tokens, heads, nope // 128, 128)
    a_scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) * torch.tensor(1.0 / fmt.fmax)
    q8 = (groups * (1.0 / a_scale)).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype).float()
    w = w_k.float().reshape(heads, w_k.shape[1], nope // 128, 128)  # [H, L, G, 128]
    partial = torch.einsum("thgk,hlgk->thgl", q8, w) * a_scale  # each group's product, scaled
    return (partial.sum(dim=2) * w_k_scale.float().reshape(())).to(q_nope.dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Static per-tensor fp8 quant: ``fp8(clamp(float(x) * (1 / scale), -fmax, fmax))``, RNE.

    The reciprocal is taken once in fp32 and multiplied, as AITER and vLLM's QuantFP8 do; NaN
    stays NaN (clamp propagates it), +-inf saturates to +-fmax.
    """
    inv = 1.0 / scale.float().reshape(())
    return (x.float() * inv).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)


def qk_cache_reference(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    q_scale: torch.Tensor,
    q_out: torch.Tensor,
    fmt: Fp8Format,
) -> None:
    """Write ``q_out = fp8([ql_nope | q_pe] / q_scale)`` and, for every token with a slot >= 0,
    ``kv_cache[slot] = fp8([kv_c | k_pe] / k_scale)``. kv_cache and q_out are in fmt's dtype."""
    num_tokens = ql_nope.shape[0]
    q_out.copy_(quantize_fp8(torch.cat([ql_nope, q_pe], dim=-1), q_scale, fmt))
    rows = torch.cat([kv_c, k_pe.reshape(num_tokens, -1)], dim=-1)
    valid = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[valid]
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = quantize_fp8(rows[valid], k_scale, fmt)
