"""``fused_absorb_qk_cache``: the decode query path from q_nope to the fp8 query in one launch (the
W_UK absorption folded into ``fused_qk_cache``), with the KV-cache write; its reference and input
contract."""

from __future__ import annotations

import torch

from k3_amd_overlay.ops import qk_cache as qk_cache_op
from k3_amd_overlay.ops import reference
from k3_amd_overlay.ops.availability import first_available, triton_missing

OP = "fused_absorb_qk_cache"
PROVIDERS = ("triton", "reference")


def provider_missing(device: torch.device) -> dict[str, str | None]:
    return {"triton": triton_missing(device), "reference": None}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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
    """``fused_qk_cache`` with ``ql_nope = q_nope @ W_UK_T`` computed inside, in fp32.

    q_nope [T, H, P] (rows and heads may be strided, unit last stride), W_UK_T [H, P, L] in the
    query dtype (any strides: vLLM's is a permuted view). The other arguments and the stored
    values are those of ``fused_qk_cache``, with ``ql_nope`` the fp32 product (not rounded to the
    query dtype first). ``provider``: auto, triton or reference.
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
    if q_nope.shape[-1] > 1 and q_nope.stride(-1) != 1:
        raise ValueError(f"{OP}: q_nope needs unit stride in its last dim, got strides {q_nope.stride()}")
    lora = w_uk_t.shape[2]
    call = qk_cache_op.check_inputs(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale,
                                    kv_format, lora=lora)
    shape = (tokens, heads, lora + call.rope)
    if q_out is None:
        q_out = torch.empty(shape, dtype=call.fmt.dtype, device=q_nope.device)
    elif tuple(q_out.shape) != shape or q_out.dtype != call.fmt.dtype or q_out.stride(-1) != 1:
        raise ValueError(f"{OP}: q_out must be {call.fmt.dtype} {list(shape)} with unit last stride, "
                         f"got {q_out.dtype} {list(q_out.shape)}")
    missing = provider_missing(q_nope.device)
    if not all(_pow2(n) for n in (nope, lora, call.rope)):
        missing["triton"] = f"the Triton kernel needs power-of-two P, L, R (got {nope}, {lora}, {call.rope})"
    name = first_available(missing, provider, OP)
    if tokens == 0:
        return q_out
    if name == "reference":
        ql_nope = torch.bmm(q_nope.transpose(0, 1).float(), w_uk_t.float()).transpose(0, 1)
        reference.qk_cache_reference(ql_nope, q_pe.float(), kv_c, call.k_pe, call.kv_cache, slot_mapping,
                                     k_scale, q_scale, q_out, call.fmt)
    else:
        from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache

        absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, call.k_pe, call.kv_cache.view(torch.uint8), slot_mapping,
                        k_scale, q_scale, q_out.view(torch.uint8), call.fmt)
    return q_out
