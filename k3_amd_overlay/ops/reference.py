"""Torch references for the fused ops: the definition every provider is tested against.
Plain torch, runs on any device, allocates freely; never used on a hot path by default."""

from __future__ import annotations

import torch

from k3_amd_overlay import mxfp4
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


def mxfp4_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) as MXFP4 by the dynamic quant of AITER's MXFP4 GEMMs, which
    vLLM's ``rocm_aiter_ops.batched_gemm_a16wfp4(..., prequant=True)`` applies to q_nope: per group
    of 32 lanes, the fp32 max|x| rounded up to a power of two when its mantissa is >= 1.75, the
    scale exponent ``e = clamp(log2(that) - 2, -127, 127)``, and each lane's ``x * 2**-e`` rounded to
    the nearest e2m1 value (ties to the even code), saturating at 6. Returns the codes [..., K]
    (uint8, 0-15, unpacked) and the e8m0 scale bytes ``e + 127`` [..., K / 32]."""
    *lead, k = x.shape
    groups = x.float().reshape(*lead, k // mxfp4.GROUP, mxfp4.GROUP)
    amax_bits = groups.abs().amax(dim=-1).view(torch.int32)
    biased = ((amax_bits + mxfp4.AMAX_ROUND_BITS) >> 23) & 0xFF  # the rounded max's biased exponent
    exponent = (biased - mxfp4.E8M0_BIAS - mxfp4.SCALE_EXPONENT_OFFSET).clamp(-mxfp4.E8M0_BIAS, mxfp4.E8M0_BIAS)
    scaled = groups * torch.exp2(-exponent.float())[..., None]
    magnitude = scaled.abs()
    # e2m1 steps: 0.5 below 2, 1 below 4, 2 up to 6; torch.round rounds half to even, which is
    # the even code at every tie of these ranges
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = (torch.round(magnitude / step) * step).clamp(max=mxfp4.E2M1_MAX)
    table = torch.tensor(mxfp4.E2M1_MAGNITUDES, device=x.device)
    codes = (rounded[..., None] == table).to(torch.uint8).argmax(dim=-1).to(torch.uint8)
    codes = codes | ((scaled < 0).to(torch.uint8) << 3)
    return codes.reshape(*lead, k), (exponent + mxfp4.E8M0_BIAS).to(torch.uint8)


def mxfp4_dequantize(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 values of unpacked e2m1 ``codes`` [..., K] under their e8m0 ``scale_bytes`` [..., K / 32]."""
    table = torch.tensor(mxfp4.E2M1_MAGNITUDES, device=codes.device)
    magnitude = table[(codes & 7).long()]
    value = torch.where((codes & 8) != 0, -magnitude, magnitude)
    scale = torch.exp2(scale_bytes.float() - mxfp4.E8M0_BIAS).repeat_interleave(mxfp4.GROUP, dim=-1)
    return value * scale


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K / 2] bytes, lane 2i in the low nibble (the layout ``unpack_e2m1`` reads)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] bytes -> [..., K] codes: lane 2i is byte i's low nibble, lane 2i + 1 its high."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def absorb_w_k_mxfp4_reference(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor,
                               y_scale: torch.Tensor | None) -> torch.Tensor:
    """ql_nope [T, H, L] in the query dtype from q_nope [T, H, P] and vLLM's MXFP4 ``W_K``
    [H, L, P / 2] (uint8, packed e2m1) with ``W_K_scale`` [H, L, P / 32] (uint8 e8m0), by the
    arithmetic of the AITER GEMM vLLM's ``rocm_aiter_ops.batched_gemm_a16wfp4(q_nope, W_K,
    W_K_scale, transpose_bm=True, prequant=True, y_scale=...)`` runs: q_nope quantised by
    ``mxfp4_quantize_reference``, the exact products of the dequantised values summed in fp32, times
    the fp32 ``1 / y_scale`` where given (vLLM passes its q_scale when attention is fp8), rounded to
    the query dtype."""
    codes, scales = mxfp4_quantize_reference(q_nope)
    q_values = mxfp4_dequantize(codes, scales)  # [T, H, P]
    w_values = mxfp4_dequantize(unpack_e2m1(w_k), w_k_scale)  # [H, L, P]
    ql = torch.einsum("thp,hlp->thl", q_values.double(), w_values.double()).float()
    if y_scale is not None:
        ql = ql * (1.0 / y_scale.float().reshape(()))
    return ql.to(q_nope.dtype)


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
