"""The qkv_norm range for vLLMs whose K3 layer runs the shared wrapper's own forward (0.27-0.29, stock
mode, and any layer the overlay's front end does not take): the layer's q_a and kv_a RMSNorm
instances are given a K3-only subclass whose ``forward`` calls the stock ``forward`` inside the
census's qkv_norm range, one range per norm call. Nothing else changes: the shared RMSNorm class
itself is never touched, and the norms compute exactly what they did."""

from __future__ import annotations

from typing import Any

import torch

from k3_amd_overlay.regions import QKV_NORM_REGION, region
from k3_amd_overlay.targets.class_swap import subclass_once

REGISTER_KEY = "rms_norm.class_swap"  # its entry in docs/patches.md (it is not a PatchSpec)
_RANGED: dict[type, type] = {}


def ranged_class(base: type) -> type:
    """A subclass of ``base`` (made once per base) whose ``forward`` runs inside the qkv_norm range."""
    return subclass_once(_RANGED, base, _ranged_forward,
                         f"{base.__name__} of a Kimi-K3 layer's q/kv front end, inside the census's qkv_norm range.")


def _ranged_forward(base: type) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # the range is a profiler call: nothing to trace
            return base.forward(self, *args, **kwargs)
        with region(QKV_NORM_REGION):
            return base.forward(self, *args, **kwargs)

    return forward


def install(*norms: Any) -> None:
    """Give each of these RMSNorm instances (None: the layer has no such norm) the ranged class."""
    for norm in norms:
        if norm is not None and type(norm) not in _RANGED.values():
            norm.__class__ = ranged_class(type(norm))
