"""``fused_absorb_qk_cache``: the decode query path from q_nope to the fp8 query in one launch (the
W_UK absorption folded into ``fused_qk_cache``), with the KV-cache write; its reference and input
contract."""

from __future__ import annotations

import torch

from k3_amd_overlay import package
from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.ops import qk_cache as qk_cache_op
from k3_amd_overlay.ops import reference
from k3_amd_overlay.ops.availability import first_available, triton_missing

OP = "fused_absorb_qk_cache"
FUSED_PROVIDERS = package.FUSED_PROVIDERS[package.ABSORB_QK_CACHE]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def provider_missing(device: torch.device, nope: int, lora: int, rope: int) -> dict[str, str | None]:
    """For each provider, why it cannot run for tensors on ``device`` at these widths (None: it can)."""
    triton = triton_missing(device)
    if triton is None and not all(_pow2(n) for n in (nope, lora, rope)):
        triton = f"the Triton kernel needs power-of-two P, L, R (got {nope}, {lora}, {rope})"
    return {"triton": triton, "reference": None}


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
                         f"({q_nope.dtype}, {q_nope.device}); the fp8 BMM variant is not supported")
    call = qk_cache_op.check_inputs(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                                    kv_format, lora=w_uk_t.shape[2])
    q_out = qk_cache_op.q_out_for(call, q_out, q_nope.device, OP)
    name = first_available(provider_missing(q_nope.device, nope, call.lora, call.rope), provider, OP)
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
