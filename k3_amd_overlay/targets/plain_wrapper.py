"""The overlay's K3 MLA wrapper for vLLMs whose K3 AMD code builds the plain shared
``MultiHeadLatentAttentionWrapper`` (0.27-0.29). A K3-only subclass, bound by name in
``amd/linear.py`` only: the shared class and every other model keep the stock wrapper.

It gives these vLLMs the seam later releases have (``_normalize_q_kv`` at the kv split) and
installs the per-layer sites, in stock mode too (they count the layer and open the census's ranges).
Its ``forward`` covers the K3 front end only (q-LoRA, no rotary embedding, no indexer, no DCP query
replication) and hands anything else, and any layer whose qkv_norm is not applied (every layer in
stock mode), to the stock forward unchanged; such a layer's two norms then open the qkv_norm range
themselves (norm_hook.py), as the front end does around its pair."""

from __future__ import annotations

from typing import Any

import torch

from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.targets import norm_hook
from k3_amd_overlay.targets.installer import LayerInstaller, install_sites
from k3_amd_overlay.targets.norm import QKV_NORM_SITE, QkvNormSite


def k3_wrapper_class(base: type, installer: LayerInstaller, fusions: frozenset[str]) -> type:
    """A subclass of the shared wrapper class ``base`` carrying the overlay's K3 seams."""

    class K3OverlayMLAWrapper(base):  # type: ignore[misc, valid-type]
        """The K3 MLA wrapper with the overlay's seams (see the module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            install_sites(installer, self, fusions, decode_via_attend_hook=True)
            if QKV_NORM_SITE in self.__dict__ and not self._k3_front_end():
                norm_hook.install(self.q_a_layernorm, self.kv_a_layernorm)

        def _normalize_q_kv(self, q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            site: QkvNormSite = self.__dict__[QKV_NORM_SITE]
            return site.normalize(self.q_a_layernorm, self.kv_a_layernorm, None, q_c, kv_c)

        def _k3_front_end(self) -> bool:
            site: QkvNormSite | None = self.__dict__.get(QKV_NORM_SITE)
            return (
                site is not None
                and site.decision.state is FusionState.APPLIED
                and self.q_lora_rank is not None
                and self.rotary_emb is None
                and not (self.indexer and self.is_sparse)
                and not self.dcp_q_replicate
            )

        def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                    llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
            if not self._k3_front_end():
                return super().forward(positions, hidden_states, llama_4_scaling)
            latent = self.fused_qkv_a_proj(hidden_states)[0]
            q_c, kv_c, k_pe = latent.split(
                [self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            q_c, kv_c_normed = self._normalize_q_kv(q_c, kv_c)
            q = self.q_b_proj(q_c)[0].view(-1, self.num_heads, self.qk_head_dim)
            if llama_4_scaling is not None:
                q *= llama_4_scaling
            attn_out = self.mla_attn(
                q, kv_c_normed, k_pe.unsqueeze(1),
                output_shape=(hidden_states.shape[0], self.num_heads * self.v_head_dim),
                q_dcp_replicated=None,
            )
            if self.g_proj is not None:
                attn_out = attn_out * self.g_proj(hidden_states)[0].sigmoid()
            return self.o_proj(attn_out)[0]

    K3OverlayMLAWrapper.__qualname__ = K3OverlayMLAWrapper.__name__
    return K3OverlayMLAWrapper
