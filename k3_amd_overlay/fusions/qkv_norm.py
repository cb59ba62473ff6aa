"""qkv_norm: the q_a and kv_a RMSNorms of a K3 MLA layer in one launch, as a pure decision.

``decide_qkv_norm`` decides per layer from what the layer holds (read by targets/installer.py);
the site acting on it is ``QkvNormSite.normalize`` (targets/norm.py). Wherever the overlay's own
fused norm does not run on a layer (refused, or its kernel failed) vLLM's own ``_normalize_q_kv``
runs, its fused dual RMSNorm included where vLLM fuses; only stock mode forces the two norms."""

from __future__ import annotations

from dataclasses import dataclass

from k3_amd_overlay.fusions.states import TRACED_WHOLE, FusionState, LayerDecision, choose_provider
from k3_amd_overlay.package import AUTO, FUSED_PROVIDERS, QKV_NORM


@dataclass(frozen=True)
class QkvNormInputs:
    """Everything the decision reads, each taken from the layer as it stands."""

    stock_mode: bool
    has_q_norm: bool
    upstream_fuses: bool  # this vLLM's own dual-norm fusion is on for this layer
    provider_setting: str  # auto or a provider name
    provider_missing: dict[str, str | None]  # why each provider cannot run here (None: it can)
    traced_whole: bool = False  # vLLM compiles the whole model (STOCK_TORCH_COMPILE, fullgraph)


UPSTREAM_KEEPS = "; vLLM's own fused q/kv norm keeps the layer"


def decide_qkv_norm(inputs: QkvNormInputs) -> LayerDecision:
    """Stock mode forces the two separate norms; in auto mode a layer vLLM fuses itself stays
    vLLM's; else a provider. Where the overlay refuses a layer vLLM fuses, vLLM's fused norm keeps it."""
    if inputs.stock_mode:
        return LayerDecision(FusionState.FORCED_STOCK, None, "stock mode: two separate RMSNorms")
    if not inputs.has_q_norm:
        return LayerDecision(FusionState.REFUSED, None, "no q norm (q_lora_rank is None)")
    if inputs.traced_whole and not inputs.upstream_fuses:
        return LayerDecision(FusionState.REFUSED, None, TRACED_WHOLE)
    if inputs.upstream_fuses and inputs.provider_setting == AUTO:
        return LayerDecision(FusionState.UPSTREAM, "aiter", "vLLM's AITER dual RMSNorm is on")
    decision = choose_provider(FUSED_PROVIDERS[QKV_NORM], inputs.provider_setting, inputs.provider_missing)
    if decision.state is FusionState.REFUSED and inputs.upstream_fuses:
        return LayerDecision(decision.state, None, decision.reason + UPSTREAM_KEEPS)
    return decision
