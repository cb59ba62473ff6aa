"""Public fused ops of the overlay, usable without vLLM (the GPU benchmark machine has none).

    from k3_amd_overlay.ops import fused_absorb_qk_cache, fused_q_kv_rmsnorm, fused_qk_cache

Importing this package never imports vLLM, AITER or triton; a provider that needs one imports
it when it runs."""

from k3_amd_overlay.ops.absorb_qk_cache import (
    fused_absorb_fp8_qk_cache,
    fused_absorb_mxfp4_qk_cache,
    fused_absorb_qk_cache,
)
from k3_amd_overlay.ops.availability import ProviderUnavailable
from k3_amd_overlay.ops.qk_cache import fused_qk_cache
from k3_amd_overlay.ops.rmsnorm_pair import fused_q_kv_rmsnorm

__all__ = ["ProviderUnavailable", "fused_absorb_fp8_qk_cache", "fused_absorb_mxfp4_qk_cache", "fused_absorb_qk_cache",
           "fused_q_kv_rmsnorm", "fused_qk_cache"]
