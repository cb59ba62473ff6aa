"""qk_cache and absorb_qk_cache: the one predicate of the fused decode, as pure decisions.

``decide_qk_cache`` and ``decide_absorb`` are its static half (per layer, from what the layer
holds, read by targets/installer.py); ``DecodePlan.path_for`` is its per-batch half. The site that
acts on the plan (targets/decode.py) runs the fused decode *instead of* the stock attention call,
so the stock KV write and the fused write can never both run, or neither. The fused path never
rotates: K3's MLA is NoPE, and a layer with a real rotary embedding is refused, so RoPE is applied
exactly once (by the stock wrapper) wherever it exists."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from k3_amd_overlay.fp8 import FUSABLE_KV_CACHE_DTYPES
from k3_amd_overlay.fusions.states import TRACED_WHOLE, BucketGate, FusionState, LayerDecision, choose_provider
from k3_amd_overlay.package import ABSORB_MAX_TOKENS, ABSORB_QK_CACHE, AUTO, FUSED_PROVIDERS, QK_CACHE


class Rotation(str, enum.Enum):
    """The layer's rotary embedding as the fused path sees it."""

    NONE = "none"  # no rotary embedding (K3's NoPE MLA)
    IDENTITY = "identity"  # one that declares itself a no-op
    REAL = "real"


class AbsorbVariant(str, enum.Enum):
    """Which W_UK absorption the layer's stock decode runs (vLLM's precedence: fp4, fp8, AMX, bf16)."""

    BF16 = "bf16"  # torch.bmm with the bf16 W_UK_T
    FP8 = "fp8"  # AITER's Triton fp8 BMM (VLLM_ROCM_USE_AITER_FP8BMM)
    FP4 = "fp4"  # AITER's Triton MXFP4 BMM (VLLM_ROCM_USE_AITER_FP4BMM)
    AMX = "amx"  # the CPU AMX BMM


# The W_UK absorptions the fused decode reproduces (absorb_qk_cache folds each into its launch).
FOLDED_ABSORPTIONS = frozenset({AbsorbVariant.BF16, AbsorbVariant.FP8, AbsorbVariant.FP4})


class DecodePath(str, enum.Enum):
    """The fused launch a decode batch takes."""

    ABSORB = "absorb"  # W_UK absorption, concat, query quant and KV write in one launch
    QK_CACHE = "qk_cache"  # stock absorption, then concat, query quant and KV write in one launch


@dataclass(frozen=True)
class QkCacheInputs:
    """Everything the static decision reads, each taken from the layer as it stands."""

    stock_mode: bool
    provider_setting: str
    provider_missing: dict[str, str | None]
    kv_cache_dtype: str
    rotation: Rotation
    dcp_world_size: int
    pcp: bool
    hisparse: bool
    q_pad_num_heads: int | None
    num_heads: int
    absorb: AbsorbVariant
    quant_query_input: bool  # the attention backend takes an fp8 query (stock quantises it too)
    upstream_fuses: bool  # this vLLM's own fused decode takes this layer
    traced_whole: bool = False  # vLLM compiles the whole model (STOCK_TORCH_COMPILE, fullgraph)
    activation_dtype: str = "bfloat16"  # the layer's activations (torch dtype name)


def _refusal(x: QkCacheInputs) -> str | None:
    """Why this layer's decode can never be fused (shared by qk_cache and absorb_qk_cache)."""
    refusals = [
        (x.kv_cache_dtype not in FUSABLE_KV_CACHE_DTYPES,
         f"kv cache dtype {x.kv_cache_dtype!r} is not a plain fp8 cache ({sorted(FUSABLE_KV_CACHE_DTYPES)})"),
        (x.rotation is Rotation.REAL, "a real rotary embedding: the fused path does not rotate"),
        (x.dcp_world_size > 1, f"DCP is on (world size {x.dcp_world_size})"),
        (x.pcp, "PCP is on (the latent all-gather must run)"),
        (x.hisparse, "HiSparse is on (its cursor and remapped slots must run)"),
        (x.q_pad_num_heads is not None, f"query heads are padded to {x.q_pad_num_heads}"),
        (x.num_heads < 1, f"{x.num_heads} heads per rank"),
        (x.absorb not in FOLDED_ABSORPTIONS, f"the {x.absorb.value} W_UK absorption is not reproduced"),
        (not x.quant_query_input, "the attention backend does not take an fp8 query"),
        (x.traced_whole, TRACED_WHOLE),
        (x.activation_dtype == "float16" and x.absorb in (AbsorbVariant.FP8, AbsorbVariant.FP4),
         f"fp16 activations with the {x.absorb.value} W_UK BMM: its GEMM returns bf16 ql_nope, which the fused "
         "path would round to fp16"),
    ]
    return next((reason for refused, reason in refusals if refused), None)


UPSTREAM_KEEPS = "; vLLM's own fused decode keeps the layer"


def decide_qk_cache(x: QkCacheInputs) -> LayerDecision:
    """Stock mode forces the three launches; in auto mode a layer vLLM's own fused decode takes
    stays vLLM's (its own predicate has accepted it); else the overlay's refusals, then a
    provider. Where the overlay refuses a layer vLLM fuses, vLLM's fused decode keeps it."""
    if x.stock_mode:
        return LayerDecision(FusionState.FORCED_STOCK, None, "stock mode: three launches")
    if x.upstream_fuses and x.provider_setting == AUTO:
        return LayerDecision(FusionState.UPSTREAM, "aiter", "vLLM's own fused decode takes this layer")
    refusal = _refusal(x)
    detail = f"{x.num_heads} heads, {x.absorb.value} absorption"
    decision = LayerDecision(FusionState.REFUSED, None, refusal) if refusal else choose_provider(
        FUSED_PROVIDERS[QK_CACHE], x.provider_setting, x.provider_missing, detail)
    if decision.state is FusionState.REFUSED and x.upstream_fuses:
        return LayerDecision(decision.state, None, decision.reason + UPSTREAM_KEEPS)
    return decision


def decide_absorb(x: QkCacheInputs, qk: LayerDecision, provider_setting: str,
                  provider_missing: dict[str, str | None]) -> LayerDecision:
    """absorb_qk_cache: the qk_cache conditions (a folded W_UK absorption among them). In auto mode a
    layer whose qk_cache decision defers to vLLM's own fused decode stays vLLM's; where qk_cache is
    not asked for (absorb_qk_cache alone) there is no such decision, so the absorbed launch takes
    its batches and vLLM's fused decode keeps the rest (DecodePlan.upstream_keeps)."""
    if x.stock_mode:
        return LayerDecision(FusionState.FORCED_STOCK, None, "stock mode: the absorption is its own launch")
    refusal = _refusal(x)
    if refusal:
        return LayerDecision(FusionState.REFUSED, None, refusal)
    if qk.state is FusionState.UPSTREAM and provider_setting == AUTO:
        return LayerDecision(FusionState.DISABLED, None,
                             "deferred: vLLM's own fused decode owns this layer (it keeps its own absorption)")
    return choose_provider(FUSED_PROVIDERS[ABSORB_QK_CACHE], provider_setting, provider_missing,
                           f"decode batches of <= {ABSORB_MAX_TOKENS} tokens, {x.num_heads} heads, "
                           f"{x.absorb.value} W_UK")


@dataclass(frozen=True)
class BatchFacts:
    """What the per-batch half reads of one forward step."""

    num_actual_tokens: int  # tokens attended (CUDA-graph padding rows excluded)
    num_decode_tokens: int
    has_cache: bool  # a KV cache and its slot mapping: not a profile or dummy run
    dcp_replicated: bool  # the query arrives replicated for DCP


def batch_fusable(batch: BatchFacts | None) -> bool:
    """The per-batch half of the predicate: a real decode-only batch (metadata, a KV cache and its
    slots; not empty; no prefill rows; no DCP-replicated query). ``None``: no attention metadata."""
    return (
        batch is not None
        and batch.has_cache
        and not batch.dcp_replicated
        and batch.num_decode_tokens > 0
        and batch.num_actual_tokens == batch.num_decode_tokens
    )


def upstream_takes(batch: BatchFacts | None) -> bool:
    """vLLM 0.32+'s own per-batch test for its fused decode (the K3 MLA wrapper's forward):
    metadata, a KV cache and its slots, and no prefill rows."""
    return batch is not None and batch.has_cache and batch.num_actual_tokens == batch.num_decode_tokens


@dataclass(frozen=True)
class DecodePlan:
    """One layer's decode decisions (qk_cache, absorb_qk_cache) and whose fused decode it has."""

    decision: LayerDecision
    absorb_decision: LayerDecision
    absorb: AbsorbVariant = AbsorbVariant.BF16
    upstream_fuses: bool = False  # vLLM's own fused decode accepted this layer (0.32+)
    # This GPU's self-measurement at this layer's shape (measured.py): per fusion, the token counts where
    # its fused launch may run. None: no measurement here, every batch as the decisions say.
    measured: Mapping[str, BucketGate] | None = None

    @property
    def overlay_fuses(self) -> bool:
        return FusionState.APPLIED in (self.decision.state, self.absorb_decision.state)

    @property
    def upstream_keeps(self) -> bool:
        """vLLM's own fused decode runs every batch the overlay does not take: whatever the overlay
        was not asked for, or refused, keeps doing exactly what vLLM does; only stock mode stops it."""
        return self.upstream_fuses and FusionState.FORCED_STOCK not in (self.decision.state,
                                                                        self.absorb_decision.state)

    @property
    def fused_decode_on(self) -> bool:
        """The answer for vLLM's ``_fused_qk_prep_supported``: its fused-decode branch is taken where
        vLLM's own fused decode keeps the layer or the overlay fuses it."""
        return self.upstream_keeps or self.overlay_fuses

    def measured_refusal(self, fusion: str, num_tokens: int) -> str | None:
        """Why the self-measurement sends ``fusion`` to stock at ``num_tokens`` tokens (None: it may
        run; also where there is no measurement). A fusion the measurement does not name runs stock."""
        if self.measured is None:
            return None
        gate = self.measured.get(fusion)
        return BucketGate().refusal(num_tokens) if gate is None else gate.refusal(num_tokens)

    def choose(self, batch: BatchFacts | None,
               failed: frozenset[str] = frozenset()) -> tuple[DecodePath | None, str | None]:
        """The one decision per batch: the fused launch to take, or None for the stock path, with the
        self-measurement's reason where it alone sent the batch to stock (``failed``: fusions whose
        kernel failed in this process, refused from then on). The absorbed launch takes batches up to
        ``ABSORB_MAX_TOKENS`` tokens, qk_cache's any other and those the measurement refuses the
        absorbed launch where it allows qk_cache's."""
        absorb_on = self.absorb_decision.state is FusionState.APPLIED and ABSORB_QK_CACHE not in failed
        qk_on = self.decision.state is FusionState.APPLIED and QK_CACHE not in failed
        if not (absorb_on or qk_on) or not batch_fusable(batch):
            return None, None
        assert batch is not None
        tokens = batch.num_actual_tokens
        refused = []
        if absorb_on and tokens <= ABSORB_MAX_TOKENS:
            why = self.measured_refusal(ABSORB_QK_CACHE, tokens)
            if why is None:
                return DecodePath.ABSORB, None
            refused.append(f"{ABSORB_QK_CACHE}: {why}")
        if qk_on:
            why = self.measured_refusal(QK_CACHE, tokens)
            if why is None:
                return DecodePath.QK_CACHE, None
            refused.append(f"{QK_CACHE}: {why}")
        return None, "; ".join(refused) or None

    def path_for(self, batch: BatchFacts | None, failed: frozenset[str] = frozenset()) -> DecodePath | None:
        """The fused launch ``choose`` takes for this batch, or None for the stock path."""
        return self.choose(batch, failed)[0]
