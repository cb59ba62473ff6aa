"""The AITER provider of ``fused_qk_cache``: AITER's ``fused_qk_rope_concat_and_cache_mla`` fed
an identity rotation. AITER is imported lazily, on first use, never at module import.

Contract kept (AITER's ``aiter.ops.cache.fused_qk_rope_concat_and_cache_mla``, read in its source
from v0.1.8 to v0.1.20 and a later commit, e4048607a5; the v0.1.21+ releases vLLM 0.33 pins were not
read): the cos/sin tables are one row of ones/zeros in the query dtype; positions is an int64 buffer
of zeros, so no AITER kernel or version reads past that row (the general decode kernel and every
kernel before v0.1.19.post1 do not clamp positions); slot_mapping is int64, dense, and exactly the
tokens handed in (the launch grid is its length; the kernels read it by pointer); the KV cache is
passed in the fp8 dtype, never as uint8; q_out is fp8 like the cache, its heads L+R apart (the
kernels bound each token's stores to heads x (L+R) elements)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

AITER_OP_MODULE = "aiter.ops.cache"
AITER_OP_NAME = "fused_qk_rope_concat_and_cache_mla"
# Arguments before compute_all_q_rope, which AITER added with its position clamp (v0.1.19.post1, #4342).
AITER_BASE_ARITY = 14

_op: Callable[..., Any] | None = None
_identity_tables: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
_zero_positions: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # zero-position buffers a larger batch replaced, never freed


def load_op() -> Callable[..., Any]:
    """AITER's op; raises ImportError saying what is missing."""
    global _op
    if _op is None:
        module = __import__(AITER_OP_MODULE, fromlist=[AITER_OP_NAME])
        op = getattr(module, AITER_OP_NAME, None)
        if op is None:
            raise ImportError(f"{AITER_OP_MODULE} has no {AITER_OP_NAME} (AITER too old: needs >= v0.1.8)")
        _op = op
    return _op


def device_missing(device: torch.device) -> str | None:
    """AITER's HIP kernels take ROCm GPU tensors only (torch calls a ROCm device ``cuda``)."""
    return None if device.type == "cuda" else f"AITER needs ROCm GPU tensors (got {device.type})"


def missing(device: torch.device) -> str | None:
    """Why the AITER provider cannot run for tensors on ``device`` (None: it can)."""
    try:
        load_op()
    except Exception as exc:  # an AITER that fails to import for any reason is unavailable
        return f"AITER {AITER_OP_NAME} unavailable: {type(exc).__name__}: {exc}"
    return device_missing(device)


def op_arity(op: Callable[..., Any]) -> int:
    """14 or 15: read from the registered torch schema (AITER's compile_ops wrapper hides the
    Python signature), else from the Python signature, else the 14 every version accepts."""
    try:
        schema = getattr(torch.ops.aiter, AITER_OP_NAME).default._schema
        return len(schema.arguments)
    except (AttributeError, RuntimeError):
        pass
    try:
        parameters = inspect.signature(op).parameters.values()
    except (TypeError, ValueError):
        return AITER_BASE_ARITY
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return AITER_BASE_ARITY  # a wrapper's (*args, **kwargs) says nothing of the op's arguments
    return len(parameters)


class BuiltInsideCapture(RuntimeError):
    """A table or buffer the fused path needs was not built before a CUDA/HIP-graph capture: built
    inside one, its contents exist only in the graph (on an H200: cos = 0), so it is never built there."""


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _not_inside_capture(device: torch.device, what: str) -> None:
    if _capturing(device):
        raise BuiltInsideCapture(f"{what} on {device} was not built before graph capture; build it when the "
                                 "layer is built (reserve_identity_table / reserve_zero_positions)")


def reserve_identity_table(device: torch.device, dtype: torch.dtype, rope_dim: int) -> None:
    """Build the one-row cos = 1, sin = 0 table for (device, dtype, rope_dim), eagerly, once."""
    key = (device, dtype, rope_dim)
    if key not in _identity_tables:
        _not_inside_capture(device, f"the identity rope table ({dtype}, {rope_dim})")
        half = rope_dim // 2
        _identity_tables[key] = (
            torch.ones(1, half, dtype=dtype, device=device),
            torch.zeros(1, half, dtype=dtype, device=device),
        )


def identity_rope_table(device: torch.device, dtype: torch.dtype, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared one-row identity table (built here if need be, but never inside a capture)."""
    reserve_identity_table(device, dtype, rope_dim)
    return _identity_tables[(device, dtype, rope_dim)]


def reserve_zero_positions(device: torch.device, num_tokens: int) -> None:
    """Size the shared zero-positions buffer of a device, eagerly (ahead of any graph capture)."""
    held = _zero_positions.get(device)
    if held is None or held.numel() < num_tokens:
        _not_inside_capture(device, f"the zero-positions buffer for {num_tokens} tokens")
        if held is not None:  # a graph captured earlier may read it: it stays allocated (and zero)
            _outgrown.append(held)
        _zero_positions[device] = torch.zeros(max(num_tokens, 1), dtype=torch.int64, device=device)


def zero_positions(device: torch.device, num_tokens: int) -> torch.Tensor:
    reserve_zero_positions(device, num_tokens)
    return _zero_positions[device][:num_tokens]


def run(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
        kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
        q_scale: torch.Tensor, q_out: torch.Tensor) -> None:
    """Call AITER on validated inputs: k_pe 2-D, kv_cache and q_out in the fp8 dtype."""
    width = kv_cache.shape[-1]
    if q_out.shape[1] > 1 and q_out.stride(1) != width:
        raise ValueError(f"AITER {AITER_OP_NAME}: q_out's heads must be {width} elements apart (its kernels bound "
                         f"each token's stores to heads x {width}), got strides {q_out.stride()}")
    op = load_op()
    num_tokens = slot_mapping.shape[0]
    cos, sin = identity_rope_table(ql_nope.device, ql_nope.dtype, q_pe.shape[-1])
    if not ql_nope.is_contiguous():  # AITER before v0.1.17 reads q_nope as dense rows
        ql_nope = ql_nope.contiguous()
    args = (ql_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale,
            zero_positions(ql_nope.device, num_tokens), cos, sin, True, True)
    if op_arity(op) > AITER_BASE_ARITY:
        op(*args, False)
    else:
        op(*args)
