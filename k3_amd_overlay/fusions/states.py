"""What a fusion can be in one process, and who owns the fused path: the vocabulary of the
evidence, the log line and the check command."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from k3_amd_overlay.package import AUTO


class FusionState(str, enum.Enum):
    PENDING = "pending"  # patched; decided per layer when K3 MLA layers are built (none yet here)
    APPLIED = "applied"  # the overlay's fused path is installed
    UPSTREAM = "upstream"  # this vLLM's own fused code is in effect; the overlay only watches
    FORCED_STOCK = "forced-stock"  # stock mode: the overlay made sure the unfused path runs
    REFUSED = "refused"  # requested, but cannot run here; left stock, reason recorded
    DISABLED = "disabled"  # not requested


FUSED_STATES = frozenset({FusionState.APPLIED, FusionState.UPSTREAM})
FUSED_STATE_VALUES = frozenset(s.value for s in FUSED_STATES)
# Why a layer is refused when vLLM compiles the whole model: one reason for every fusion.
TRACED_WHOLE = ("vLLM compiles the whole model (STOCK_TORCH_COMPILE, fullgraph=True): the overlay's sites stand "
                "down under tracing, so the compiled graph holds the stock path")


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


def choose_provider(fused_providers: tuple[str, ...], setting: str, missing: dict[str, str | None],
                    detail: str = "") -> LayerDecision:
    """The overlay's own path with the provider ``setting`` names, or for ``auto`` the first of
    ``fused_providers`` that can run (``missing[name]`` is None); refused, with every reason, if none."""
    candidates = fused_providers if setting == AUTO else (setting,)
    suffix = f"; {detail}" if detail else ""
    for name in candidates:
        if missing.get(name, "unknown") is None:
            why = "forced by setting" if setting != AUTO else "first available fused provider"
            return LayerDecision(FusionState.APPLIED, name, f"{name}: {why}{suffix}")
    reasons = "; ".join(f"{n}: {missing.get(n)}" for n in candidates)
    return LayerDecision(FusionState.REFUSED, None, f"no provider can run here ({reasons})")


@dataclass(frozen=True)
class BucketGate:
    """Where this GPU's self-measurement lets one fusion run (``k3-amd-overlay measure``, read by
    ``measured.py``): the measured buckets ascending, each ``(tokens, why)``, a bucket covering the
    token counts above the one before it up to ``tokens``; ``why`` None where the fusion measured
    exact and at least as fast as stock there, else why stock runs there. Above the largest bucket
    (or where nothing was measured at this shape) stock runs, for ``unmeasured``: fail closed.
    ``unlike_measured``, asked where a bucket allows the fusion: why its launch at that size would not
    be the one measured (its launch config failed in this process and the safe config runs in its
    place, launch_configs.failed_here), which sends the batch to stock too."""

    buckets: tuple[tuple[int, str | None], ...] = field(default=())
    unmeasured: str = "not measured on this GPU"
    unlike_measured: Callable[[int], str | None] | None = field(default=None, compare=False)

    def refusal(self, num_tokens: int) -> str | None:
        """Why a batch of ``num_tokens`` tokens runs stock, or None where the fusion may run it."""
        why = next((why for tokens, why in self.buckets if num_tokens <= tokens), self.unmeasured)
        if why is None and self.unlike_measured is not None:
            unlike = self.unlike_measured(num_tokens)
            if unlike is not None:
                return f"stock at {num_tokens} tokens: {unlike}, and only the table's config was measured on this GPU"
        return why

    def allows(self, num_tokens: int) -> bool:
        return self.refusal(num_tokens) is None

    def reasons(self) -> list[str]:
        """Every reason this gate sends batches to stock, in bucket order (the marker's list)."""
        return list(dict.fromkeys([*(why for _, why in self.buckets if why is not None), self.unmeasured]))
