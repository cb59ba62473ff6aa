"""qkv_norm: the q_a and kv_a RMSNorms of a K3 MLA layer in one launch.

The per-layer decision (``decide_qkv_norm``), the ``q_kv_norm`` callback the overlay installs
on K3 MLA wrappers, and ``QkvNormSite.normalize``: the one site acting on the decision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3_amd_overlay.fusions.states import TRACED_WHOLE, FusionState, LayerDecision, choose_provider
from k3_amd_overlay.ops import rmsnorm_pair

TwoNorms = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class QkvNormInputs:
    """Everything the decision reads, each taken from the layer as it stands."""

    stock_mode: bool
    has_q_norm: bool
    upstream_fuses: bool  # this vLLM's own dual-norm fusion is on for this layer
    provider_setting: str  # auto or a provider name
    provider_missing: dict[str, str | None]  # from ops.rmsnorm_pair.provider_missing
    traced_whole: bool = False  # vLLM compiles the whole model (STOCK_TORCH_COMPILE, fullgraph)


def decide_qkv_norm(inputs: QkvNormInputs) -> LayerDecision:
    if inputs.stock_mode:
        return LayerDecision(FusionState.FORCED_STOCK, None, "stock mode: two separate RMSNorms")
    if not inputs.has_q_norm:
        return LayerDecision(FusionState.REFUSED, None, "no q norm (q_lora_rank is None)")
    if inputs.traced_whole and not inputs.upstream_fuses:
        return LayerDecision(FusionState.REFUSED, None, TRACED_WHOLE)
    if inputs.upstream_fuses and inputs.provider_setting == "auto":
        return LayerDecision(FusionState.UPSTREAM, "aiter", "vLLM's AITER dual RMSNorm is on")
    return choose_provider(rmsnorm_pair.FUSED_PROVIDERS, inputs.provider_setting, inputs.provider_missing)


class QKvNorm:
    """The ``q_kv_norm`` callback: both norms of one layer through one provider launch.
    Weights and eps are read from the layer's own RMSNorm modules at call time (after loading)."""

    def __init__(self, q_norm: Any, kv_norm: Any, provider: str | None) -> None:
        assert provider is not None
        self.q_norm = q_norm
        self.kv_norm = kv_norm
        self.provider = provider

    def __call__(self, q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rmsnorm_pair.run_provider(
            self.provider, q_c, kv_c, self.q_norm.weight, self.kv_norm.weight,
            self.q_norm.variance_epsilon, self.kv_norm.variance_epsilon,
        )


@dataclass
class QkvNormSite:
    """One layer's decision, its callback and its evidence hook."""

    decision: LayerDecision
    q_kv_norm: QKvNorm | None
    on_effective: Callable[[int], None]  # given the batch's token count

    def normalize(self, q_norm: Any, kv_norm: Any, upstream: TwoNorms | None,
                  q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The one site acting on the decision. Under torch.compile tracing the overlay's kernel
        (not a registered op) stands down to the two separate norms."""
        state = self.decision.state
        if state is FusionState.APPLIED and self.q_kv_norm is not None:
            if torch.compiler.is_compiling():
                return q_norm(q_c), kv_norm(kv_c)
            self.on_effective(q_c.shape[0])
            return self.q_kv_norm(q_c, kv_c)
        if state is FusionState.UPSTREAM and upstream is not None:
            if not torch.compiler.is_compiling():
                self.on_effective(q_c.shape[0])
            return upstream(q_c, kv_c)
        return q_norm(q_c), kv_norm(kv_c)
