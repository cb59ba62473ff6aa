"""The qkv_norm site of one K3 MLA layer: the ``q_kv_norm`` callback (both RMSNorms of the layer
through one provider launch) and ``QkvNormSite.normalize``, the one site acting on the layer's
qkv_norm decision (fusions/qkv_norm.py). A fused launch that fails on its config is tried again on
the arch's safe config; one that still fails refuses qkv_norm for the process (kernel_failures.py).
Wherever the overlay's fused norm does not run (refused, failed, a batch its self-measurement sends
to stock, torch.compile tracing) vLLM's own ``_normalize_q_kv`` runs, exactly as with the overlay
off: its fused dual RMSNorm where vLLM fuses (0.30+ with AITER on), else the two norms (as on 0.29,
which has no such method). Only stock mode forces the two separate norms (the A/B baseline)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.fusions.states import BucketGate, FusionState, LayerDecision
from k3_amd_overlay.kernels.names import RMSNORM_PAIR_KERNEL
from k3_amd_overlay.kernels.probe import precompile_once
from k3_amd_overlay.ops import rmsnorm_pair
from k3_amd_overlay.package import QKV_NORM
from k3_amd_overlay.regions import QKV_NORM_REGION, region

QKV_NORM_SITE = "_k3_overlay_qkv_norm"  # the attribute a K3 MLA wrapper holds its site under
TwoNorms = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class QkvNormCallback:
    """The ``q_kv_norm`` callback: both norms of one layer through one provider launch.
    Weights and eps are read from the layer's own RMSNorm modules at call time (after loading)."""

    def __init__(self, q_norm: Any, kv_norm: Any, provider: str | None) -> None:
        assert provider is not None
        self.q_norm = q_norm
        self.kv_norm = kv_norm
        self.provider = provider

    def compile_ahead(self, device: torch.device, dtype: torch.dtype) -> float | None:
        """The norm kernel's compile for this provider, device and dtype, once a process (one head,
        no fp8, no cache: ``probe.precompile_once``): the seconds, or None where nothing compiled.
        The installer calls it at load; a call finds it done."""
        return precompile_once(self.provider, RMSNORM_PAIR_KERNEL, device, dtype, 1, E4M3FN)

    def __call__(self, q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.compile_ahead(q_c.device, q_c.dtype)
        return rmsnorm_pair.run_provider(
            self.provider, q_c, kv_c, self.q_norm.weight, self.kv_norm.weight,
            self.q_norm.variance_epsilon, self.kv_norm.variance_epsilon,
        )


@dataclass
class QkvNormSite:
    """One layer's decision, its callback and its evidence hook."""

    decision: LayerDecision
    q_kv_norm: QkvNormCallback | None
    on_effective: Callable[[int], None]  # given the batch's token count
    on_failure: Callable[[str, str], None] | None = None  # records qkv_norm refused for a failed kernel
    on_degraded: Callable[[], None] | None = None  # records a config degraded to the safe one
    gate: BucketGate | None = None  # this GPU's self-measurement (measured.py): the token counts it may fuse

    def normalize(self, q_norm: Any, kv_norm: Any, upstream: TwoNorms | None,
                  q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The one site acting on the decision, inside the census's profiler range. ``upstream``:
        vLLM's own ``_normalize_q_kv`` of this layer (None where vLLM has none: 0.29)."""
        with region(QKV_NORM_REGION):
            return self._normalize(q_norm, kv_norm, upstream, q_c, kv_c)

    def _normalize(self, q_norm: Any, kv_norm: Any, upstream: TwoNorms | None,
                   q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.decision.state
        if state is FusionState.FORCED_STOCK:  # the A/B baseline: vLLM's own fusion switched off too
            return q_norm(q_c), kv_norm(kv_c)
        if state is FusionState.APPLIED and self.q_kv_norm is not None and QKV_NORM not in kernel_failures.failed() \
                and (self.gate is None or self.gate.allows(q_c.shape[0])) and not torch.compiler.is_compiling():
            callback = self.q_kv_norm  # under tracing the overlay's kernel (not a registered op) stands down
            try:
                normed = kernel_failures.guarded(QKV_NORM, lambda: callback(q_c, kv_c), self.on_degraded)
            except kernel_failures.KernelFailed as failure:
                kernel_failures.refuse(failure, self.on_failure or (lambda fusion, why: None))
            else:
                self.on_effective(q_c.shape[0])
                return normed
        if state is FusionState.UPSTREAM and upstream is not None and not torch.compiler.is_compiling():
            self.on_effective(q_c.shape[0])
        return vllms_own(q_norm, kv_norm, upstream, q_c, kv_c)


def vllms_own(q_norm: Any, kv_norm: Any, upstream: TwoNorms | None,
              q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM runs with the overlay off: its own ``_normalize_q_kv`` (its fused dual RMSNorm where
    it fuses), or where it has none (0.29's shared forward) the two norms."""
    if upstream is not None:
        return upstream(q_c, kv_c)
    return q_norm(q_c), kv_norm(kv_c)
