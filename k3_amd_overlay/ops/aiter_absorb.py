"""The AITER providers of ``fused_absorb_fp8_qk_cache`` and ``fused_absorb_mxfp4_qk_cache``: AITER's
Triton kernels ``fused_fp8_bmm_rope_cat_and_cache_mla`` and ``fused_fp4_bmm_rope_cat_and_cache_mla``
(``aiter.ops.triton.fusions.fused_bmm_rope_kv_cache``: the quantised BMM with the dynamic quant of
q_nope, the concat and the KV-cache write, one launch) fed an identity rotation, then the static fp8
query quant, which those kernels do not take (their query comes out in bf16), by the overlay's
Triton quant: two launches where stock has three or four. AITER is imported on first use, never at
module import. Its kernels pass AMD-only launch options, so they run on ROCm; the fp4 one also
asserts AITER's MXFP4 support (gfx950)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.ops import aiter_qk_cache

AITER_MODULE = "aiter.ops.triton.fusions.fused_bmm_rope_kv_cache"
AITER_FP8_NAME = "fused_fp8_bmm_rope_cat_and_cache_mla"
AITER_FP4_NAME = "fused_fp4_bmm_rope_cat_and_cache_mla"

_ops: dict[str, Callable[..., Any]] = {}


def load_op(name: str = AITER_FP8_NAME) -> Callable[..., Any]:
    """One of AITER's fused kernels by name; raises ImportError saying what is missing."""
    if name not in _ops:
        module = __import__(AITER_MODULE, fromlist=[name])
        _ops[name] = getattr(module, name)
    return _ops[name]


def device_missing(device: torch.device) -> str | None:
    """AITER's Triton launches pass AMD-only options (``waves_per_eu``, ``matrix_instr_nonkdim``)."""
    if device.type != "cuda" or torch.version.hip is None:
        return f"AITER's Triton kernels need ROCm GPU tensors (got {device.type}, hip={torch.version.hip})"
    return None


def missing(device: torch.device, name: str = AITER_FP8_NAME) -> str | None:
    try:
        load_op(name)
    except Exception as exc:  # an AITER that fails to import for any reason is unavailable
        return f"AITER {name} unavailable: {type(exc).__name__}: {exc}"
    return device_missing(device)


def fused_query(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor, q_pe: torch.Tensor,
                kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                k_scale: torch.Tensor, q_out_dtype: torch.dtype) -> torch.Tensor:
    """AITER's one launch on validated inputs (k_pe 2-D, kv_cache in the fp8 dtype): the cache written
    in place, ``[ql_nope | q_pe]`` returned unscaled in ``q_out_dtype``."""
    tokens = q_nope.shape[0]
    lora, rope = kv_c.shape[-1], q_pe.shape[-1]
    cos, sin = aiter_qk_cache.identity_rope_table(q_nope.device, q_nope.dtype, rope)
    query, _, _, _ = load_op(AITER_FP8_NAME)(
        q_nope.transpose(0, 1), w_k, w_k_scale.reshape(1), q_pe, kv_c.view(tokens, 1, lora),
        k_pe.view(tokens, 1, rope), kv_cache.view(-1, 1, lora + rope), slot_mapping,
        aiter_qk_cache.zero_positions(q_nope.device, tokens), cos, sin, group_size=128, transpose_bm=True,
        k_scale=k_scale, is_neox=False, q_out_dtype=q_out_dtype,
    )
    return query


def run(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
        k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
        q_scale: torch.Tensor, q_out: torch.Tensor, fmt: Fp8Format) -> None:
    """The provider: AITER's launch (query in the query dtype), then the static fp8 query quant (the
    overlay's one-launch Triton quant)."""
    from k3_amd_overlay.kernels.static_quant import scaled_quant

    query = fused_query(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_nope.dtype)
    scaled_quant(query, q_scale, q_out.view(torch.uint8), fmt)


def fused_query_mxfp4(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor, q_pe: torch.Tensor,
                      kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor, y_scale: torch.Tensor | None) -> torch.Tensor:
    """AITER's fused fp4 launch on validated inputs: the cache written in place, ``[ql_nope | q_pe]``
    returned in the query dtype, ql_nope times ``1 / y_scale`` as vLLM's stock GEMM call asks."""
    tokens = q_nope.shape[0]
    lora, rope = kv_c.shape[-1], q_pe.shape[-1]
    cos, sin = aiter_qk_cache.identity_rope_table(q_nope.device, q_nope.dtype, rope)
    query, _, _, _ = load_op(AITER_FP4_NAME)(
        q_nope.transpose(0, 1), w_k, w_k_scale, q_pe, kv_c.view(tokens, 1, lora), k_pe.view(tokens, 1, rope),
        kv_cache.view(-1, 1, lora + rope), slot_mapping, aiter_qk_cache.zero_positions(q_nope.device, tokens),
        cos, sin, transpose_bm=True, prequant=True, y_scale=y_scale, k_scale=k_scale, is_neox=False,
        q_out_dtype=q_nope.dtype,
    )
    return query


def run_mxfp4(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor, q_pe: torch.Tensor,
              kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              k_scale: torch.Tensor, q_scale: torch.Tensor, q_out: torch.Tensor, fmt: Fp8Format) -> None:
    """The fp4 provider: AITER's launch (y_scale = q_scale, as vLLM's fp8-attention call passes), then
    the static fp8 query quant."""
    from k3_amd_overlay.kernels.static_quant import scaled_quant

    query = fused_query_mxfp4(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale, q_scale)
    scaled_quant(query, q_scale, q_out.view(torch.uint8), fmt)
