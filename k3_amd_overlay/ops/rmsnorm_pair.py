"""``fused_q_kv_rmsnorm``: the q_a and kv_a RMSNorms of an MLA layer in one launch, with its
providers and their availability. Providers that need vLLM or AITER are reached lazily."""

from __future__ import annotations

import math

import torch

from k3_amd_overlay import package
from k3_amd_overlay.ops import reference
from k3_amd_overlay.ops.availability import first_available, gpu_missing, torch_op_missing, triton_missing

OP = "fused_q_kv_rmsnorm"
NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Providers that really fuse the pair into one launch, best first; "reference" is the definition.
FUSED_PROVIDERS = package.FUSED_PROVIDERS[package.QKV_NORM]


def provider_missing(device: torch.device, q_eps: float, kv_eps: float) -> dict[str, str | None]:
    """For each provider, why it cannot run for tensors on ``device`` (None: it can)."""
    on_gpu = gpu_missing(device)
    vllm_missing = on_gpu
    if vllm_missing is None and q_eps != kv_eps:
        vllm_missing = f"vLLM's fused_q_kv_rmsnorm takes one eps (got q_eps={q_eps}, kv_eps={kv_eps})"
    if vllm_missing is None:
        try:
            from vllm.models.common.ops.fused_qk_rmsnorm import fused_q_kv_rmsnorm  # noqa: F401
        except ImportError as exc:
            vllm_missing = f"vLLM's in-tree fused_q_kv_rmsnorm is not importable: {exc}"
    return {
        "aiter": on_gpu or torch_op_missing("vllm", "fused_mla_dual_rms_norm"),
        "triton": triton_missing(device),
        "vllm": vllm_missing,
        "reference": None,
    }


def _check_inputs(q_c: torch.Tensor, kv_c: torch.Tensor, q_weight: torch.Tensor,
                  kv_weight: torch.Tensor, q_eps: float, kv_eps: float) -> None:
    for name, x in (("q_c", q_c), ("kv_c", kv_c)):
        if x.dim() != 2:
            raise ValueError(f"{OP}: {name} must be 2-D [T, width], got shape {tuple(x.shape)}")
        if x.dtype not in NORM_DTYPES:
            raise ValueError(f"{OP}: {name} dtype {x.dtype} not supported; allowed: {NORM_DTYPES}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"{OP}: {name} needs unit stride in its last dim, got stride {x.stride()}")
    if q_c.shape[0] != kv_c.shape[0]:
        raise ValueError(f"{OP}: q_c has {q_c.shape[0]} rows but kv_c has {kv_c.shape[0]}")
    if kv_c.dtype != q_c.dtype or kv_c.device != q_c.device:
        raise ValueError(f"{OP}: kv_c ({kv_c.dtype}, {kv_c.device}) must match q_c ({q_c.dtype}, {q_c.device})")
    for name, w, x in (("q_weight", q_weight, q_c), ("kv_weight", kv_weight, kv_c)):
        if w.dim() != 1 or w.shape[0] != x.shape[1] or not w.is_contiguous():
            raise ValueError(f"{OP}: {name} must be contiguous 1-D of {x.shape[1]}, got {tuple(w.shape)}")
        if w.device != x.device:
            raise ValueError(f"{OP}: {name} is on {w.device}, inputs on {x.device}")
    for name, eps in (("q_eps", q_eps), ("kv_eps", kv_eps)):
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"{OP}: {name}={eps!r} must be a finite float > 0")


def fused_q_kv_rmsnorm(
    q_c: torch.Tensor,
    kv_c: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    q_eps: float,
    kv_eps: float,
    *,
    provider: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent RMSNorms in one launch: ``x / sqrt(mean(x.float()**2, -1) + eps) * weight``,
    accumulated in fp32, returned in the input dtype as fresh contiguous tensors.

    q_c [T, Q] and kv_c [T, KV] are 2-D with unit stride in the last dim; rows may be strided
    (both are column slices of one projection output); T may be 0. ``provider``: ``auto`` (the
    first available of aiter, triton, vllm, reference), ``reference``, ``triton``, ``vllm``
    (single eps only) or ``aiter``; a provider named but unavailable raises ProviderUnavailable.
    """
    _check_inputs(q_c, kv_c, q_weight, kv_weight, q_eps, kv_eps)
    name = first_available(provider_missing(q_c.device, q_eps, kv_eps), provider, OP)
    return run_provider(name, q_c, kv_c, q_weight, kv_weight, q_eps, kv_eps)


def run_provider(name: str, q_c: torch.Tensor, kv_c: torch.Tensor, q_weight: torch.Tensor,
                 kv_weight: torch.Tensor, q_eps: float, kv_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one already-chosen provider on checked inputs (the per-layer hot path calls this)."""
    if name == "reference":
        return reference.rmsnorm_pair_reference(q_c, kv_c, q_weight, kv_weight, q_eps, kv_eps)
    if name == "aiter":
        return torch.ops.vllm.fused_mla_dual_rms_norm(q_c, q_weight, kv_c, kv_weight, q_eps, kv_eps)
    if name == "vllm":
        from vllm.models.common.ops.fused_qk_rmsnorm import fused_q_kv_rmsnorm as vllm_pair

        return vllm_pair(q_c, kv_c, q_weight, kv_weight, q_eps)
    q_out = torch.empty(q_c.shape, dtype=q_c.dtype, device=q_c.device)
    kv_out = torch.empty(kv_c.shape, dtype=kv_c.dtype, device=kv_c.device)
    if q_c.shape[0] > 0:
        from k3_amd_overlay.kernels.rmsnorm_pair import rmsnorm_pair

        rmsnorm_pair(q_c, kv_c, q_weight, kv_weight, q_eps, kv_eps, q_out, kv_out)
    return q_out, kv_out
