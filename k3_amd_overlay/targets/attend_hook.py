"""The decode hook for vLLMs whose K3 wrapper has no fused-decode helper of its own (0.27-0.31), and
in stock mode on every release (where it only opens the census's decode range):
the layer's MLAAttention instance is given a K3-only subclass whose ``forward`` asks the layer's
qk_cache site first. The shared MLAAttention class itself is never touched."""

from __future__ import annotations

from typing import Any

import torch

from k3_amd_overlay.targets.class_swap import subclass_once
from k3_amd_overlay.targets.decode import DECODE_SITE, DecodeSite

REGISTER_KEY = "mla_attention.class_swap"  # its entry in docs/patches.md (it is not a PatchSpec)
_HOOKED: dict[type, type] = {}


def hooked_class(base: type) -> type:
    """A subclass of ``base`` (made once per base) routing ``forward`` through the site."""
    return subclass_once(_HOOKED, base, _routed_forward,
                         f"{base.__name__} of a Kimi-K3 layer with the overlay's qk_cache decode site.")


def _routed_forward(base: type) -> Any:
    def forward(self: Any, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                output_shape: Any = None, q_dcp_replicated: torch.Tensor | None = None) -> torch.Tensor:
        site: DecodeSite = self.__dict__[DECODE_SITE]
        return site.attend(self, base.forward.__get__(self), q, kv_c_normed, k_pe,
                           output_shape=output_shape, q_dcp_replicated=q_dcp_replicated)

    return forward


def install(attn: Any, site: DecodeSite) -> None:
    """Give this one MLAAttention instance the hooked class (its class swapped, nothing else)."""
    attn.__dict__[DECODE_SITE] = site
    attn.__class__ = hooked_class(type(attn))
