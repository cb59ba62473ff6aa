"""``fused_qk_cache``: on a decode step, the fp8 KV-cache write, the ``[ql_nope | q_pe]`` concat
and the static fp8 query quant in one launch; its providers and input contract."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3_amd_overlay import package
from k3_amd_overlay.fp8 import Fp8Format, format_of
from k3_amd_overlay.ops import aiter_qk_cache, reference
from k3_amd_overlay.ops.availability import first_available, triton_missing

OP = "fused_qk_cache"
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FUSED_PROVIDERS = package.FUSED_PROVIDERS[package.QK_CACHE]


def provider_missing(device: torch.device) -> dict[str, str | None]:
    """For each provider, why it cannot run for tensors on ``device`` (None: it can)."""
    return {
        "aiter": aiter_qk_cache.missing(device),
        "triton": triton_missing(device),
        "reference": None,
    }


@dataclass(frozen=True)
class QkCacheCall:
    """Checked inputs, normalised: k_pe 2-D, the cache viewed in its fp8 dtype."""

    num_tokens: int
    num_heads: int
    lora: int
    rope: int
    fmt: Fp8Format
    k_pe: torch.Tensor
    kv_cache: torch.Tensor


def _fail(what: str) -> ValueError:
    return ValueError(f"{OP}: {what}")


def check_inputs(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                 q_scale: torch.Tensor, kv_format: str | None, *, lora: int | None = None) -> QkCacheCall:
    """Check the contract; ``lora`` is given when ``ql_nope`` is not materialised (the absorbed op
    passes its q_nope [T, H, P] for the token, head, dtype, stride and device checks)."""
    query = "ql_nope" if lora is None else "q_nope"
    if ql_nope.dim() != 3:
        raise _fail(f"{query} must be [T, H, {'L' if lora is None else 'P'}], got shape {tuple(ql_nope.shape)}")
    num_tokens, num_heads, width = ql_nope.shape
    lora = width if lora is None else lora
    if ql_nope.dtype not in QUERY_DTYPES:
        raise _fail(f"{query} dtype {ql_nope.dtype} not supported; allowed: {QUERY_DTYPES}")
    if q_pe.dim() != 3 or tuple(q_pe.shape[:2]) != (num_tokens, num_heads):
        raise _fail(f"q_pe must be [T={num_tokens}, H={num_heads}, R], got {tuple(q_pe.shape)}")
    rope = q_pe.shape[2]
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe.squeeze(1)
    if tuple(kv_c.shape) != (num_tokens, lora):
        raise _fail(f"kv_c must be [T={num_tokens}, L={lora}], got {tuple(kv_c.shape)}")
    if tuple(k_pe.shape) != (num_tokens, rope):
        raise _fail(f"k_pe must be [T={num_tokens}, R={rope}] or [T, 1, R], got {tuple(k_pe.shape)}")
    for name, x in (("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe)):
        if x.dtype != ql_nope.dtype:
            raise _fail(f"{name} dtype {x.dtype} must match {query}'s {ql_nope.dtype}")
    for name, x in ((query, ql_nope), ("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe)):
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise _fail(f"{name} needs unit stride in its last dim, got strides {x.stride()}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != lora + rope:
        raise _fail(f"kv_cache must be [num_blocks, block_size, L+R={lora + rope}], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(2) != 1:
        raise _fail(f"kv_cache needs unit stride in its last dim, got strides {kv_cache.stride()}")
    if kv_cache.dtype == torch.uint8:
        if kv_format is None:
            raise _fail("kv_cache is uint8: name its fp8 format with kv_format='e4m3fn' or 'e4m3fnuz'")
        fmt = format_of(kv_format)
        kv_cache = kv_cache.view(fmt.dtype)
    else:
        try:
            fmt = format_of(kv_cache.dtype)
        except ValueError as exc:
            raise _fail(f"kv_cache dtype {kv_cache.dtype} is not fp8 ({exc})") from None
        if kv_format is not None and format_of(kv_format) is not fmt:
            raise _fail(f"kv_format={kv_format!r} contradicts kv_cache dtype {kv_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens or slot_mapping.dtype != torch.int64:
        raise _fail(f"slot_mapping must be int64 [T={num_tokens}], "
                    f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if num_tokens > 1 and slot_mapping.stride(0) != 1:  # every provider's kernel reads it by pointer
        raise _fail(f"slot_mapping must be dense (stride 1), got stride {slot_mapping.stride(0)}")
    for name, s in (("k_scale", k_scale), ("q_scale", q_scale)):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise _fail(f"{name} must be a one-element float32 tensor, got {s.dtype} with {s.numel()} elements")
    for name, x in (("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache),
                    ("slot_mapping", slot_mapping), ("k_scale", k_scale), ("q_scale", q_scale)):
        if x.device != ql_nope.device:
            raise _fail(f"{name} is on {x.device}, {query} on {ql_nope.device}")
    return QkCacheCall(num_tokens, num_heads, lora, rope, fmt, k_pe, kv_cache)


def q_out_for(call: QkCacheCall, q_out: torch.Tensor | None, device: torch.device, op: str) -> torch.Tensor:
    """The given q_out, checked ([T, H, L + R] in the cache's fp8 dtype, unit last stride), or a new one."""
    shape = (call.num_tokens, call.num_heads, call.lora + call.rope)
    if q_out is None:
        return torch.empty(shape, dtype=call.fmt.dtype, device=device)
    if tuple(q_out.shape) != shape or q_out.dtype != call.fmt.dtype or q_out.stride(-1) != 1:
        raise ValueError(f"{op}: q_out must be {call.fmt.dtype} {list(shape)} with unit last stride, "
                         f"got {q_out.dtype} {list(q_out.shape)} strides {q_out.stride()}")
    return q_out


def fused_qk_cache(
    ql_nope: torch.Tensor,
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
    """Quantise the decode query and write the KV cache in one launch; returns q_out.

    ql_nope [T, H, L], q_pe [T, H, R], kv_c [T, L], k_pe [T, R] or [T, 1, R], all one float dtype
    with unit stride in the last dim (rows and heads may be strided). kv_cache [blocks,
    block_size, L + R] in torch.float8_e4m3fn or torch.float8_e4m3fnuz, or uint8 with
    ``kv_format`` naming the format. slot_mapping int64 [T], negative = padding. k_scale,
    q_scale: one-element float32 tensors. Stored value = fp8(clamp(float(x) * (1 / scale),
    -fmax, fmax)), round to nearest even. Tokens with a negative slot write no KV and leave
    their q_out row unspecified; no other cache byte changes. q_out [T, H, L + R] in the cache's
    fp8 dtype is allocated unless given. ``provider``: auto, reference, triton or aiter.
    """
    call = check_inputs(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale, kv_format)
    q_out = q_out_for(call, q_out, ql_nope.device, OP)
    name = first_available(provider_missing(ql_nope.device), provider, OP)
    if call.num_tokens:
        run_provider(name, ql_nope, q_pe, kv_c, call.k_pe, call.kv_cache, slot_mapping, k_scale,
                     q_scale, q_out, call.fmt)
    return q_out


def run_provider(name: str, ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                 k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor, q_scale: torch.Tensor, q_out: torch.Tensor,
                 fmt: Fp8Format) -> None:
    """Run one already-chosen provider on checked inputs (k_pe 2-D, cache in its fp8 dtype)."""
    if name == "reference":
        reference.qk_cache_reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale,
                                     q_scale, q_out, fmt)
    elif name == "aiter":
        aiter_qk_cache.run(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale, q_out)
    else:
        from k3_amd_overlay.kernels.qk_cache import qk_cache

        qk_cache(ql_nope, q_pe, kv_c, k_pe, kv_cache.view(torch.uint8), slot_mapping, k_scale,
                 q_scale, q_out.view(torch.uint8), fmt)
