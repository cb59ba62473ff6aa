"""``fused_absorb_qk_cache``, ``fused_absorb_fp8_qk_cache`` and ``fused_absorb_mxfp4_qk_cache``: the
decode query path from q_nope to the fp8 query in one launch (vLLM's W_UK absorption, bf16, fp8- or
MXFP4-quantised, folded into ``fused_qk_cache``), with the KV-cache write; their providers and input
contracts."""

from __future__ import annotations

from typing import Any

import torch

from k3_amd_overlay import mxfp4, package
from k3_amd_overlay.fp8 import E4M3FNUZ, Fp8Format, format_of
from k3_amd_overlay.ops import aiter_absorb, reference
from k3_amd_overlay.ops import qk_cache as qk_cache_op
from k3_amd_overlay.ops.availability import first_available, triton_missing

OP = "fused_absorb_qk_cache"
OP_FP8 = "fused_absorb_fp8_qk_cache"
OP_MXFP4 = "fused_absorb_mxfp4_qk_cache"
FUSED_PROVIDERS = package.FUSED_PROVIDERS[package.ABSORB_QK_CACHE]
FP8_GROUP = 128  # vLLM's fp8 BMM quantises q_nope in groups of this many lanes


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def provider_missing(device: torch.device, nope: int, lora: int, rope: int, fp8_weights: bool = False,
                     weight_format: Fp8Format | None = None, mxfp4_weights: bool = False) -> dict[str, str | None]:
    """For each provider, why it cannot run for tensors on ``device`` at these widths, with a bf16
    W_UK_T, (``fp8_weights``) vLLM's fp8 W_K in ``weight_format`` or (``mxfp4_weights``) its MXFP4
    W_K (None: it can)."""
    triton = triton_missing(device)
    if triton is None and not all(_pow2(n) for n in (nope, lora, rope)):
        triton = f"the Triton kernel needs power-of-two P, L, R (got {nope}, {lora}, {rope})"
    if mxfp4_weights:
        if triton is None and nope < 2 * mxfp4.GROUP:
            triton = f"the MXFP4 kernel takes P >= {2 * mxfp4.GROUP}, got {nope}"
        return {"triton": triton, "aiter": aiter_absorb.missing(device, aiter_absorb.AITER_FP4_NAME),
                "reference": None}
    if fp8_weights:
        if nope != FP8_GROUP:
            triton = triton or f"the fp8 kernel takes P = {FP8_GROUP} (one quant group), got {nope}"
        if weight_format is E4M3FNUZ and device.type == "cuda" and torch.version.hip is None:
            triton = triton or "e4m3fnuz weights (MI300's fp8) need an AMD GPU for the fp8 dot"
        return {"triton": triton, "aiter": aiter_absorb.missing(device), "reference": None}
    return {"triton": triton, "aiter": "AITER has no fused kernel for a bf16 W_UK_T", "reference": None}


def fused_absorb_qk_cache(
    q_nope: torch.Tensor,
    w_uk_t: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    q_scale: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    provider: str = "auto",
    kv_format: str | None = None,
) -> torch.Tensor:
    """``fused_qk_cache`` with ``ql_nope = q_nope @ W_UK_T`` computed inside.

    q_nope [T, H, P] (rows and heads may be strided, unit last stride), W_UK_T [H, P, L] in the
    query dtype (any strides: vLLM's is a permuted view). The other arguments and the stored
    values are those of ``fused_qk_cache``, with ``ql_nope`` the product accumulated in fp32 and
    rounded to the query dtype, as the stock path's ``torch.bmm`` output is (so the codes match
    stock's but where the two fp32 sums straddle a rounding boundary). ``provider``: auto, triton
    or reference (which is the stock path's own bmm, bit for bit).
    """
    if q_nope.dim() != 3 or w_uk_t.dim() != 3:
        raise ValueError(f"{OP}: q_nope must be [T, H, P] and W_UK_T [H, P, L], got {tuple(q_nope.shape)} "
                         f"and {tuple(w_uk_t.shape)}")
    tokens, heads, nope = q_nope.shape
    if tuple(w_uk_t.shape[:2]) != (heads, nope):
        raise ValueError(f"{OP}: W_UK_T must be [H={heads}, P={nope}, L], got {tuple(w_uk_t.shape)}")
    if w_uk_t.dtype != q_nope.dtype or w_uk_t.device != q_nope.device:
        raise ValueError(f"{OP}: W_UK_T ({w_uk_t.dtype}, {w_uk_t.device}) must match q_nope "
                         f"({q_nope.dtype}, {q_nope.device}); fused_absorb_fp8_qk_cache takes vLLM's fp8 W_K")
    call, q_out, name = _checked_call(OP, q_nope, w_uk_t.shape[2], q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                                      k_scale, q_scale, q_out, provider, kv_format)
    if tokens:
        run_provider(name, q_nope, w_uk_t, q_pe, kv_c, call.k_pe, call.kv_cache, slot_mapping, k_scale, q_scale,
                     q_out, call.fmt)
    return q_out


def run_provider(name: str, q_nope: torch.Tensor, w_uk_t: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                 k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                 q_scale: torch.Tensor, q_out: torch.Tensor, fmt: Fp8Format) -> None:
    """Run one already-chosen provider on checked inputs (k_pe 2-D, cache in its fp8 dtype): the
    per-layer hot path calls this."""
    if name == "reference":
        ql_nope = reference.absorb_w_uk_reference(q_nope, w_uk_t)
        reference.qk_cache_reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                                     q_out, fmt)
    else:
        from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache

        absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, kv_cache.view(torch.uint8), slot_mapping, k_scale,
                        q_scale, q_out.view(torch.uint8), fmt)


def _quantised_weight_call(op: str, q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor,
                           q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor,
                           q_out: torch.Tensor | None, provider: str, kv_format: str | None,
                           **weights: Any) -> tuple[qk_cache_op.QkCacheCall, torch.Tensor, str]:
    """The fp8 and MXFP4 entry points once their weights' own shapes and dtypes are checked: the
    weights on q_nope's device, then what every entry point shares."""
    if w_k.device != q_nope.device or w_k_scale.device != q_nope.device:
        raise ValueError(f"{op}: W_K on {w_k.device} and W_K_scale on {w_k_scale.device}, q_nope on "
                         f"{q_nope.device}")
    return _checked_call(op, q_nope, w_k.shape[1], q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                         q_out, provider, kv_format, **weights)


def _checked_call(op: str, q_nope: torch.Tensor, lora: int, q_pe: torch.Tensor, kv_c: torch.Tensor,
                  k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                  q_scale: torch.Tensor, q_out: torch.Tensor | None, provider: str, kv_format: str | None,
                  **weights: Any) -> tuple[qk_cache_op.QkCacheCall, torch.Tensor, str]:
    """What every entry point shares once its weights are checked: ``fused_qk_cache``'s contract at
    the weights' latent width ``lora``, q_out, and the provider (``weights``: ``provider_missing``'s
    flags for the variant)."""
    call = qk_cache_op.check_inputs(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                                    kv_format, lora=lora)
    q_out = qk_cache_op.q_out_for(call, q_out, q_nope.device, op)
    missing = provider_missing(q_nope.device, q_nope.shape[2], call.lora, call.rope, **weights)
    return call, q_out, first_available(missing, provider, op)


def fused_absorb_fp8_qk_cache(
    q_nope: torch.Tensor,
    w_k: torch.Tensor,
    w_k_scale: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    q_scale: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    provider: str = "auto",
    kv_format: str | None = None,
) -> torch.Tensor:
    """``fused_qk_cache`` with ``ql_nope`` from vLLM's fp8 W_UK absorption computed inside.

    q_nope [T, H, P = 128] (unit last stride); W_K [H, L, P] in an fp8 dtype (vLLM's ``W_K``, any
    strides) and W_K_scale its one-element fp32 per-tensor scale (vLLM's ``W_K_scale``). ``ql_nope``
    is what vLLM's ``rocm_aiter_ops.triton_fp8_bmm(q_nope, W_K, W_K_scale, group_size=128)`` returns
    (see ``reference.absorb_w_k_fp8_reference``); the rest is ``fused_qk_cache``'s contract.
    ``provider``: auto, triton, aiter (ROCm) or reference.
    """
    if q_nope.dim() != 3 or w_k.dim() != 3:
        raise ValueError(f"{OP_FP8}: q_nope must be [T, H, P] and W_K [H, L, P], got {tuple(q_nope.shape)} "
                         f"and {tuple(w_k.shape)}")
    tokens, heads, nope = q_nope.shape
    if w_k.shape[0] != heads or w_k.shape[2] != nope or nope % FP8_GROUP:
        raise ValueError(f"{OP_FP8}: W_K must be [H={heads}, L, P={nope}] with P a multiple of {FP8_GROUP}, "
                         f"got {tuple(w_k.shape)}")
    try:
        weight_format = format_of(w_k.dtype)
    except ValueError as exc:
        raise ValueError(f"{OP_FP8}: W_K dtype {w_k.dtype} is not fp8 ({exc})") from None
    if w_k_scale.numel() != 1 or w_k_scale.dtype != torch.float32:
        raise ValueError(f"{OP_FP8}: W_K_scale must be one float32 element, got {w_k_scale.dtype} "
                         f"with {w_k_scale.numel()} elements")
    call, q_out, name = _quantised_weight_call(OP_FP8, q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache,
                                               slot_mapping, k_scale, q_scale, q_out, provider, kv_format,
                                               fp8_weights=True, weight_format=weight_format)
    if tokens:
        run_fp8_provider(name, q_nope, w_k, w_k_scale, q_pe, kv_c, call.k_pe, call.kv_cache, slot_mapping,
                         k_scale, q_scale, q_out, call.fmt, weight_format)
    return q_out


def run_fp8_provider(name: str, q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor,
                     q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor, q_out: torch.Tensor,
                     fmt: Fp8Format, weight_format: Fp8Format) -> None:
    """Run one already-chosen provider on checked inputs: the per-layer hot path calls this."""
    if name == "reference":
        ql_nope = reference.absorb_w_k_fp8_reference(q_nope, w_k, w_k_scale, weight_format)
        reference.qk_cache_reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                                     q_out, fmt)
    elif name == "aiter":
        aiter_absorb.run(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                         q_out, fmt)
    else:
        from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache

        absorb_fp8_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache.view(torch.uint8), slot_mapping,
                            k_scale, q_scale, q_out.view(torch.uint8), fmt)


def fused_absorb_mxfp4_qk_cache(
    q_nope: torch.Tensor,
    w_k: torch.Tensor,
    w_k_scale: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    q_scale: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    provider: str = "auto",
    kv_format: str | None = None,
) -> torch.Tensor:
    """``fused_qk_cache`` with ``ql_nope`` from vLLM's MXFP4 W_UK absorption computed inside.

    q_nope [T, H, P] (P a multiple of 32, unit last stride); W_K [H, L, P / 2] uint8 (packed e2m1,
    vLLM's ``W_K``, any strides) and W_K_scale [H, L, P / 32] uint8 (e8m0, vLLM's ``W_K_scale``).
    ``ql_nope`` is what vLLM's ``rocm_aiter_ops.batched_gemm_a16wfp4(q_nope, W_K, W_K_scale,
    transpose_bm=True, prequant=True, y_scale=q_scale)`` returns when attention is fp8 (see
    ``reference.absorb_w_k_mxfp4_reference``): q_scale divides ql_nope there and again in the query
    quant, as on vLLM's stock path; the rest is ``fused_qk_cache``'s contract. ``provider``: auto,
    triton, aiter (ROCm with AITER's MXFP4 support) or reference.
    """
    if q_nope.dim() != 3 or w_k.dim() != 3 or w_k_scale.dim() != 3:
        raise ValueError(f"{OP_MXFP4}: q_nope must be [T, H, P], W_K [H, L, P/2] and W_K_scale [H, L, P/32], got "
                         f"{tuple(q_nope.shape)}, {tuple(w_k.shape)} and {tuple(w_k_scale.shape)}")
    tokens, heads, nope = q_nope.shape
    if nope % mxfp4.GROUP or w_k.shape[0] != heads or w_k.shape[2] * 2 != nope:
        raise ValueError(f"{OP_MXFP4}: W_K must be [H={heads}, L, P/2={nope // 2}] with P a multiple of "
                         f"{mxfp4.GROUP}, got {tuple(w_k.shape)}")
    expected_scale = (heads, w_k.shape[1], nope // mxfp4.GROUP)
    if tuple(w_k_scale.shape) != expected_scale:
        raise ValueError(f"{OP_MXFP4}: W_K_scale must be [H, L, P/32] = {expected_scale}, got "
                         f"{tuple(w_k_scale.shape)}")
    if w_k.dtype != torch.uint8 or w_k_scale.dtype != torch.uint8:
        raise ValueError(f"{OP_MXFP4}: W_K and W_K_scale must be uint8 (packed e2m1, e8m0), got {w_k.dtype} "
                         f"and {w_k_scale.dtype}")
    call, q_out, name = _quantised_weight_call(OP_MXFP4, q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache,
                                               slot_mapping, k_scale, q_scale, q_out, provider, kv_format,
                                               mxfp4_weights=True)
    if tokens:
        run_mxfp4_provider(name, q_nope, w_k, w_k_scale, q_pe, kv_c, call.k_pe, call.kv_cache, slot_mapping,
                           k_scale, q_scale, q_out, call.fmt)
    return q_out


def run_mxfp4_provider(name: str, q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor,
                       q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor,
                       q_out: torch.Tensor, fmt: Fp8Format) -> None:
    """Run one already-chosen provider on checked inputs: the per-layer hot path calls this."""
    if name == "reference":
        ql_nope = reference.absorb_w_k_mxfp4_reference(q_nope, w_k, w_k_scale, q_scale)
        reference.qk_cache_reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                                     q_out, fmt)
    elif name == "aiter":
        aiter_absorb.run_mxfp4(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                               q_out, fmt)
    else:
        from k3_amd_overlay.kernels.absorb_mxfp4_qk_cache import absorb_mxfp4_qk_cache

        absorb_mxfp4_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache.view(torch.uint8), slot_mapping,
                              k_scale, q_scale, q_out.view(torch.uint8), fmt)
