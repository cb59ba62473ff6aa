"""What a fusion can be in one process, and who owns the fused path: the vocabulary of the
evidence, the log line and the check command."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FusionState(str, enum.Enum):
    APPLIED = "applied"  # the overlay's fused path is installed
    UPSTREAM = "upstream"  # this vLLM's own fused code is in effect; the overlay only watches
    FORCED_STOCK = "forced-stock"  # stock mode: the overlay made sure the unfused path runs
    REFUSED = "refused"  # requested, but cannot run here; left stock, reason recorded
    DISABLED = "disabled"  # not requested


FUSED_STATES = frozenset({FusionState.APPLIED, FusionState.UPSTREAM})


@dataclass(frozen=True)
class LayerDecision:
    """One layer's static decision for one fusion: whether it fuses, whose code, which
    provider, and why (each predicate input that decided it)."""

    state: FusionState
    provider: str | None
    reason: str

    @property
    def fused(self) -> bool:
        return self.state in FUSED_STATES
