"""k3-amd-overlay: the Kimi-K3 MLA fusions for a stock vLLM ROCm image, behind one switch.

    pip install k3_amd_overlay-*.whl    # the built wheel, next to vLLM; touches no vllm, torch or triton
    export K3_AMD_OVERLAY=1             # 0/unset: off; stock: force unfused; qkv_norm,qk_cache
    vllm serve <Kimi-K3 checkpoint> ... # every vLLM process loads the plugin

What it does: in every vLLM process, patches only the K3 AMD vendor code
(``vllm/models/kimi_k3/amd/``) so that the q_a/kv_a RMSNorms run as one launch (qkv_norm) and,
on decode-only batches, the fp8 KV-cache write, the query concat and its fp8 quant run as one
launch (qk_cache), with the W_UK absorption folded in for batches of up to 256 tokens
(absorb_qk_cache). It records what is in effect per process and where each fused path ran
(``k3-amd-overlay check``).

What it does not do: touch shared vLLM layers or other models; fall back silently when
switched on against a vLLM it does not recognise (it raises unless K3_AMD_OVERLAY_STRICT=0).

``activate()`` / ``deactivate()`` turn it on and off in-process (the plugin calls ``activate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3_amd_overlay.package import SUPPORTED_VLLM, __version__

if TYPE_CHECKING:
    from k3_amd_overlay.activation import Activation
    from k3_amd_overlay.settings import OverlaySettings

__all__ = ["SUPPORTED_VLLM", "__version__", "activate", "deactivate"]


def activate(settings: OverlaySettings | None = None) -> Activation | None:
    """Turn the overlay on as ``K3_AMD_OVERLAY`` (or the given settings) says."""
    from k3_amd_overlay.activation import activate as _activate

    return _activate(settings)


def deactivate() -> list[str]:
    """Revert every patch, restoring the identical original objects on vLLM's classes and modules
    (the keys reverted come back); a patch another tool has wrapped since stays under that wrapper,
    inert. Layers built while the overlay was active keep the overlay's sites and their routes (a
    method bound on the layer); layers built after run vLLM's own code. Every requested fusion then
    reads ``refused``: the process proves neither arm."""
    from k3_amd_overlay.activation import deactivate as _deactivate

    return _deactivate()
