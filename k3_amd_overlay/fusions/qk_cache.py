"""qk_cache: on decode-only batches, the fp8 KV-cache write, the ``[ql_nope | q_pe]`` concat and
the static fp8 query quant in one launch.

``decide_qk_cache`` is the static half of the one predicate (per layer, from state the layer
holds); ``batch_fusable`` is its per-batch half. ``QkCacheSite.attend`` is the one site acting on
both: when they say fused, it runs the fused decode *instead of* the stock attention call, so
the stock KV write and the fused write can never both run, or neither; otherwise it runs stock.
The fused path never rotates: K3's MLA is NoPE, and any layer with a real rotary embedding is
refused, so RoPE is applied exactly once (by the stock wrapper) wherever it exists."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3_amd_overlay.fp8 import FUSABLE_KV_CACHE_DTYPES, Fp8Format
from k3_amd_overlay.fusions.states import TRACED_WHOLE, FusionState, LayerDecision, choose_provider
from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
from k3_amd_overlay.ops import qk_cache as qk_cache_op
from k3_amd_overlay.ops.reference import absorb_w_uk_reference
from k3_amd_overlay.package import ABSORB_MAX_TOKENS

ABSORB_VARIANTS = ("bf16", "fp8", "fp4", "amx")

ContextGetter = Callable[[str], tuple[Any, Any, torch.Tensor, torch.Tensor | None]]
# Runs one layer's attention step between the KV connector's hooks (wait_for_layer_load before,
# save_kv_layer after), as vLLM runs its stock attention call: (layer name, the step) -> its output.
KvTransfer = Callable[[str, Callable[[], torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class QkCacheInputs:
    """Everything the static decision reads, each taken from the layer as it stands."""

    stock_mode: bool
    provider_setting: str
    provider_missing: dict[str, str | None]
    kv_cache_dtype: str
    rotation: str  # "none" (no rotary embedding), "identity" (declared no-op) or "real"
    dcp_world_size: int
    pcp: bool
    hisparse: bool
    q_pad_num_heads: int | None
    num_heads: int
    absorb: str  # which W_UK absorption this layer runs: one of ABSORB_VARIANTS
    quant_query_input: bool  # the attention backend takes an fp8 query (stock quantises it too)
    upstream_fuses: bool  # this vLLM's own fused decode takes this layer
    traced_whole: bool = False  # vLLM compiles the whole model (STOCK_TORCH_COMPILE, fullgraph)


def _refusal(x: QkCacheInputs) -> str | None:
    """Why this layer's decode can never be fused (shared by qk_cache and absorb_qk_cache)."""
    refusals = [
        (x.kv_cache_dtype not in FUSABLE_KV_CACHE_DTYPES,
         f"kv cache dtype {x.kv_cache_dtype!r} is not a plain fp8 cache ({sorted(FUSABLE_KV_CACHE_DTYPES)})"),
        (x.rotation == "real", "a real rotary embedding: the fused path does not rotate"),
        (x.dcp_world_size > 1, f"DCP is on (world size {x.dcp_world_size})"),
        (x.pcp, "PCP is on (the latent all-gather must run)"),
        (x.hisparse, "HiSparse is on (its cursor and remapped slots must run)"),
        (x.q_pad_num_heads is not None, f"query heads are padded to {x.q_pad_num_heads}"),
        (x.num_heads < 1, f"{x.num_heads} heads per rank"),
        (x.absorb == "amx", "the AMX (CPU) W_UK absorption is not reproduced"),
        (not x.quant_query_input, "the attention backend does not take an fp8 query"),
        (x.traced_whole, TRACED_WHOLE),
    ]
    return next((reason for refused, reason in refusals if refused), None)


UPSTREAM_KEEPS = "; vLLM's own fused decode keeps the layer"


def decide_qk_cache(x: QkCacheInputs) -> LayerDecision:
    """Stock mode forces the three launches; in auto mode a layer vLLM's own fused decode takes
    stays vLLM's (its own predicate has accepted it); else the overlay's refusals, then a
    provider. Where the overlay refuses a layer vLLM fuses, vLLM's fused decode keeps it."""
    if x.stock_mode:
        return LayerDecision(FusionState.FORCED_STOCK, None, "stock mode: three launches")
    if x.upstream_fuses and x.provider_setting == "auto":
        return LayerDecision(FusionState.UPSTREAM, "aiter", "vLLM's own fused decode takes this layer")
    refusal = _refusal(x)
    detail = f"{x.num_heads} heads, {x.absorb} absorption"
    decision = LayerDecision(FusionState.REFUSED, None, refusal) if refusal else choose_provider(
        qk_cache_op.FUSED_PROVIDERS, x.provider_setting, x.provider_missing, detail)
    if decision.state is FusionState.REFUSED and x.upstream_fuses:
        return LayerDecision(decision.state, None, decision.reason + UPSTREAM_KEEPS)
    return decision


def decide_absorb(x: QkCacheInputs, qk: LayerDecision, provider_setting: str,
                  provider_missing: dict[str, str | None]) -> LayerDecision:
    """absorb_qk_cache: the qk_cache conditions, a bf16 W_UK_T, and no vLLM-owned fused decode to
    defer to (auto mode keeps vLLM's own path where it applies)."""
    if x.stock_mode:
        return LayerDecision(FusionState.FORCED_STOCK, None, "stock mode: the absorption is its own launch")
    refusal = _refusal(x)
    if refusal:
        return LayerDecision(FusionState.REFUSED, None, refusal)
    if x.absorb != "bf16":
        return LayerDecision(FusionState.REFUSED, None,
                             f"the {x.absorb} W_UK absorption (quantised weights) is not folded; only a bf16 W_UK_T")
    if qk.state is FusionState.UPSTREAM and provider_setting == "auto":
        return LayerDecision(FusionState.DISABLED, None,
                             "deferred: vLLM's own fused decode owns this layer (it keeps its own absorption)")
    return choose_provider(absorb_op.FUSED_PROVIDERS, provider_setting, provider_missing,
                           f"decode batches of <= {ABSORB_MAX_TOKENS} tokens, {x.num_heads} heads")


def batch_fusable(attn_metadata: Any, slot_mapping: torch.Tensor | None, kv_cache: torch.Tensor,
                  q_dcp_replicated: torch.Tensor | None) -> bool:
    """The per-batch half of the predicate: a real decode-only batch (not a profile or dummy
    run without metadata, not empty, no prefill rows) with a KV cache and its slots."""
    return (
        attn_metadata is not None
        and slot_mapping is not None
        and kv_cache.numel() > 0
        and q_dcp_replicated is None
        and attn_metadata.num_decode_tokens > 0
        and attn_metadata.num_actual_tokens == attn_metadata.num_decode_tokens
    )


def absorb_w_uk(attn: Any, variant: str, q_nope_t: torch.Tensor) -> torch.Tensor:
    """ql_nope [B, N, L] from q_nope (N, B, P): the same calls, in the same precedence, as the
    stock decode path, so the fused path starts from bit-identical ql_nope."""
    if variant == "fp4":
        from vllm._aiter_ops import rocm_aiter_ops

        fp8_attention = attn.kv_cache_dtype.startswith("fp8")
        return rocm_aiter_ops.batched_gemm_a16wfp4(
            q_nope_t, attn.W_K, attn.W_K_scale, transpose_bm=True, prequant=True,
            y_scale=attn._q_scale if fp8_attention else None,
        )
    if variant == "fp8":
        from vllm._aiter_ops import rocm_aiter_ops

        return rocm_aiter_ops.triton_fp8_bmm(
            q_nope_t, attn.W_K, attn.W_K_scale, group_size=128, transpose_bm=True
        )
    return absorb_w_uk_reference(q_nope_t.transpose(0, 1), attn.W_UK_T)


@dataclass
class QkCacheSite:
    """One layer's decode decisions (qk_cache, absorb_qk_cache) and what their fused paths need."""

    decision: LayerDecision
    absorb_decision: LayerDecision
    absorb: str
    fmt: Fp8Format | None
    context: ContextGetter | None
    on_effective: Callable[[int], None]  # given the batch's (padded) token count
    on_absorb_effective: Callable[[int], None]
    upstream_fuses: bool = False  # vLLM's own fused decode accepted this layer (0.32+)
    kv_transfer: KvTransfer | None = None  # vLLM's KV-connector hooks (disaggregation, offloading)
    query_heads: int = 0  # heads the fp8 query buffer is allocated with (> the layer's: backend padding)

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

    def path_for(self, attn_metadata: Any, slot_mapping: torch.Tensor | None, kv_cache: torch.Tensor,
                 q_dcp_replicated: torch.Tensor | None) -> str | None:
        """The one decision per batch: "absorb", "qk_cache", or None for the stock path."""
        if not self.overlay_fuses or not batch_fusable(attn_metadata, slot_mapping, kv_cache, q_dcp_replicated):
            return None
        if self.absorb_decision.state is FusionState.APPLIED and attn_metadata.num_actual_tokens <= ABSORB_MAX_TOKENS:
            return "absorb"
        return "qk_cache" if self.decision.state is FusionState.APPLIED else None

    def fused_decode(self, path: str, attn: Any, q: torch.Tensor, kv_c_normed: torch.Tensor,
                     k_pe: torch.Tensor, output_shape: Any, attn_metadata: Any,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The decode-only MLA step with one fused launch in place of the KV write, the concat and
        the query quant ("qk_cache", after the stock W_UK absorption) or of all four ("absorb");
        the MQA kernel and the V up-projection are stock's. A configured KV connector's per-layer
        hooks run around it, as around vLLM's stock attention call."""

        def step() -> torch.Tensor:
            return self._fused_step(path, attn, q, kv_c_normed, k_pe, output_shape, attn_metadata, kv_cache,
                                    slot_mapping)

        return self.kv_transfer(attn.layer_name, step) if self.kv_transfer is not None else step()

    def _fused_step(self, path: str, attn: Any, q: torch.Tensor, kv_c_normed: torch.Tensor,
                    k_pe: torch.Tensor, output_shape: Any, attn_metadata: Any,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        assert self.fmt is not None
        batch_rows = q.shape[0]  # with CUDA-graph padding: the captured graph's size
        num_tokens = attn_metadata.num_actual_tokens  # CUDA-graph padding rows are not attended
        q = q[:num_tokens]
        q_nope, q_pe = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        cache = kv_cache if kv_cache.dtype == self.fmt.dtype else kv_cache.view(self.fmt.dtype)
        # Where the backend pads the query heads (AITER MLA), the query is a view of a buffer that wide,
        # which the backend takes without copying.
        heads = q.shape[1]
        q_out = torch.empty((num_tokens, max(self.query_heads, heads), attn.kv_lora_rank + attn.qk_rope_head_dim),
                            dtype=self.fmt.dtype, device=q.device)[:, :heads]
        kv_c, k_pe, slots = kv_c_normed[:num_tokens], k_pe[:num_tokens].reshape(num_tokens, -1), \
            slot_mapping.flatten()[:num_tokens]
        if path == "absorb":
            self.on_absorb_effective(batch_rows)
            absorb_op.run_provider(self.absorb_decision.provider, q_nope, attn.W_UK_T, q_pe, kv_c, k_pe, cache, slots,
                                   attn._k_scale, attn._q_scale, q_out, self.fmt)
        else:
            self.on_effective(batch_rows)
            ql_nope = absorb_w_uk(attn, self.absorb, q_nope.transpose(0, 1))
            qk_cache_op.run_provider(self.decision.provider, ql_nope, q_pe, kv_c, k_pe, cache, slots,
                                     attn._k_scale, attn._q_scale, q_out, self.fmt)
        attn_out, _ = attn.impl.forward_mqa(q_out, cache, attn_metadata, attn)
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        attn._v_up_proj(attn_out, out=output[:num_tokens])
        return output

    def attend(self, attn: Any, stock: Callable[..., torch.Tensor], q: torch.Tensor,
               kv_c_normed: torch.Tensor, k_pe: torch.Tensor, output_shape: Any = None,
               q_dcp_replicated: torch.Tensor | None = None) -> torch.Tensor:
        """The one site: a fused decode when the predicate says so for this batch, else stock.
        Under torch.compile tracing it stands down to the stock call (no evidence hook either)."""
        if self.context is not None and not torch.compiler.is_compiling():
            attn_metadata, _, kv_cache, slot_mapping = self.context(attn.layer_name)
            path = self.path_for(attn_metadata, slot_mapping, kv_cache, q_dcp_replicated)
            if path is not None:
                return self.fused_decode(path, attn, q, kv_c_normed, k_pe, output_shape, attn_metadata,
                                         kv_cache, slot_mapping)
        return stock(q, kv_c_normed, k_pe, output_shape=output_shape, q_dcp_replicated=q_dcp_replicated)
