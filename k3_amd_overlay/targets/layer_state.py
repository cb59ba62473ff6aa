"""Read a built K3 MLA wrapper (and its MLAAttention) into the fusions' predicate inputs, and
install the per-layer sites. Runs in vLLM processes only, when each K3 MLA layer is built."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fp8 import Fp8Format, format_of
from k3_amd_overlay.fusions.qk_cache import QkCacheInputs, QkCacheSite, decide_absorb, decide_qk_cache
from k3_amd_overlay.fusions.qkv_norm import QKvNorm, QkvNormInputs, QkvNormSite, decide_qkv_norm
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.ops import absorb_qk_cache, aiter_qk_cache, qk_cache, rmsnorm_pair
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import Mode, OverlaySettings

QKV_NORM_SITE = "_k3_overlay_qkv_norm"
QK_CACHE_SITE = "_k3_overlay_qk_cache"
DECODE_FUSIONS = frozenset({QK_CACHE, ABSORB_QK_CACHE})  # both act at the one decode site
NOT_REQUESTED = LayerDecision(FusionState.DISABLED, None, "not requested")


def rotation_kind(rotary_emb: Any) -> str:
    if rotary_emb is None:
        return "none"
    return "identity" if getattr(rotary_emb, "is_identity", False) is True else "real"


def absorb_variant(attn: Any) -> str:
    # The stock decode path's own precedence: fp4 before fp8 (both flags can be set), then AMX.
    if getattr(attn, "is_aiter_triton_fp4_bmm_enabled", False):
        return "fp4"
    if getattr(attn, "is_aiter_triton_fp8_bmm_enabled", False):
        return "fp8"
    if getattr(attn, "is_amx_bmm_enabled", False):
        return "amx"
    return "bf16"


def layer_device(wrapper: Any) -> torch.device:
    return wrapper.kv_a_layernorm.weight.device


def vllm_fp8_format() -> Fp8Format:
    from vllm.platforms import current_platform

    return format_of(current_platform.fp8_dtype())


def max_batched_tokens() -> int:
    try:
        from vllm.config import get_current_vllm_config

        return int(get_current_vllm_config().scheduler_config.max_num_batched_tokens)
    except Exception:  # no config in context (tests, doctor): the buffer grows on demand
        return 0


AITER_SWITCHED_OFF = ("vLLM has AITER switched off (rocm_aiter_ops.is_enabled() is False: VLLM_ROCM_USE_AITER "
                      "is unset or 0, or this is not a supported ROCm GPU)")


def vllm_aiter_missing() -> str | None:
    """AITER providers follow vLLM's own master switch: vLLM registers its AITER ops whenever AITER
    is installed, whatever VLLM_ROCM_USE_AITER says, so an op being present proves nothing."""
    try:
        from vllm._aiter_ops import rocm_aiter_ops
    except ImportError:  # the ops used without vLLM: no switch to follow
        return None
    return None if rocm_aiter_ops.is_enabled() else AITER_SWITCHED_OFF


def with_vllm_aiter_switch(missing: dict[str, str | None]) -> dict[str, str | None]:
    """``missing`` with the aiter provider also refused while vLLM has AITER off."""
    if missing.get("aiter", "absent") is None:
        return {**missing, "aiter": vllm_aiter_missing()}
    return missing


def whole_model_compiled() -> bool:
    """vLLM's STOCK_TORCH_COMPILE mode: the whole model goes through ``torch.compile(fullgraph=True)``
    (vLLM 0.29-0.33's model runner), so every site of the overlay is traced once, and stands down."""
    try:
        from vllm.config import get_current_vllm_config
        from vllm.config.compilation import CompilationMode

        return get_current_vllm_config().compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE
    except Exception:  # no config in context (tests, doctor): nothing is compiled
        return False


AITER_MLA_MODULE = "vllm.v1.attention.backends.mla.rocm_aiter_mla"


def padded_query_heads(attn: Any, num_heads: int) -> int:
    """How many query heads to allocate the fp8 query with: the attention backend's own padded
    count where the backend pads (AITER MLA: ``AiterMLAHelper.get_actual_mla_num_heads``) and takes
    a view of a buffer that wide without copying (vLLM 0.33's ``get_mla_padded_q``, asked with a
    one-token probe); else the layer's own head count (the backend copies whatever it is given)."""
    if type(attn.impl).__module__ != AITER_MLA_MODULE:
        return num_heads
    return _aiter_zero_copy_heads(num_heads)


@functools.cache
def _aiter_zero_copy_heads(num_heads: int) -> int:
    """The AITER MLA backend's padded head count for ``num_heads`` where it takes a padded view
    without copying, else ``num_heads`` (asked once per head count, not per layer)."""
    try:
        from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLAHelper
    except ImportError:
        return num_heads
    padded = int(AiterMLAHelper.get_actual_mla_num_heads(num_heads))
    if padded == num_heads:
        return num_heads
    probe = torch.empty(1, padded, 1)[:, :num_heads]
    zero_copy = AiterMLAHelper.get_mla_padded_q(num_heads, probe).data_ptr() == probe.data_ptr()
    return padded if zero_copy else num_heads


@functools.cache
def kv_transfer_hooks() -> Any:
    """vLLM's own KV-connector decorator (``maybe_transfer_kv_layer``, which wraps the stock MLA
    attention op) around a one-argument step: the fused decode runs between the same
    ``wait_for_layer_load`` and ``save_kv_layer`` calls, and is a plain call without a connector.
    Made once per process and shared by every layer."""
    try:
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
    except ImportError:  # no vLLM (the ops' own tests): no connector either
        return None

    def _k3_overlay_fused_attention(layer_name: str, step: Any) -> Any:
        return step()

    return maybe_transfer_kv_layer(_k3_overlay_fused_attention)


DSPARK_NOT_COVERED = ("the DSpark drafter (speculative method 'dspark', K3DSparkModel) builds vLLM's NVIDIA MLA, "
                      "not the K3 AMD layers the overlay patches: its decode runs stock")


def model_coverage() -> dict[str, Any]:
    """What this process serves, for the marker: the served architecture (Kimi-K3, or Kimi-Linear,
    whose MLA layers are the same ``amd/linear.py`` class and take the same fusions), the text model
    that builds the layers, the speculative method (MTP draft layers are K3 AMD layers and are
    covered) and what is not covered."""
    try:
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        model_config = config.model_config
        # the text model's config while its layers are built (a copy made for the language model);
        # ``architecture`` is what vLLM serves, the top-level class (ModelConfig keeps it in the copy)
        text = list(getattr(model_config.hf_config, "architectures", None) or [])
        served = getattr(model_config, "architecture", None) or (text[0] if text else None)
        method = getattr(config.speculative_config, "method", None) if config.speculative_config else None
    except Exception:  # no model config in context (tests, doctor)
        return {}
    return {"architecture": served, "text_model": text, "speculative_method": method,
            "not_covered": [DSPARK_NOT_COVERED] if method == "dspark" else []}


def get_attention_context(layer_name: str) -> tuple[Any, Any, torch.Tensor, torch.Tensor | None]:
    from vllm.model_executor.layers.attention.attention import get_attention_context as vllm_ctx

    return vllm_ctx(layer_name)


@dataclass
class LayerInstaller:
    """Builds and attaches one layer's sites; records each decision in the evidence."""

    settings: OverlaySettings
    evidence: Evidence
    coverage_recorded: bool = False

    def record_coverage(self) -> None:
        if not self.coverage_recorded:
            self.coverage_recorded = True
            self.evidence.set_coverage(model_coverage())

    @property
    def stock(self) -> bool:
        return self.settings.mode is Mode.STOCK

    def install_qkv_norm(self, wrapper: Any, upstream_fuses: bool) -> QkvNormSite:
        self.record_coverage()
        q_norm = wrapper.q_a_layernorm
        kv_norm = wrapper.kv_a_layernorm
        has_q = q_norm is not None
        inputs = QkvNormInputs(
            stock_mode=self.stock,
            has_q_norm=has_q,
            upstream_fuses=upstream_fuses,
            provider_setting=self.settings.provider(QKV_NORM),
            provider_missing=with_vllm_aiter_switch(rmsnorm_pair.provider_missing(
                layer_device(wrapper),
                q_norm.variance_epsilon if has_q else 0.0,
                kv_norm.variance_epsilon,
            )) if has_q and not self.stock else {},
            traced_whole=whole_model_compiled(),
        )
        decision = decide_qkv_norm(inputs)
        callback = QKvNorm(q_norm, kv_norm, decision.provider) if decision.state is FusionState.APPLIED else None
        site = QkvNormSite(decision, callback,
                           self.evidence.effective_hook(QKV_NORM, wrapper.mla_attn.layer_name))
        setattr(wrapper, QKV_NORM_SITE, site)
        self.evidence.note_layer(QKV_NORM, decision)
        return site

    def install_qk_cache(self, wrapper: Any, upstream_fuses: bool) -> QkCacheSite:
        self.record_coverage()
        attn = wrapper.mla_attn
        impl = attn.impl
        inputs = QkCacheInputs(
            stock_mode=self.stock,
            provider_setting=self.settings.provider(QK_CACHE),
            provider_missing={} if self.stock else with_vllm_aiter_switch(qk_cache.provider_missing(
                layer_device(wrapper))),
            kv_cache_dtype=str(attn.kv_cache_dtype),
            rotation=rotation_kind(wrapper.rotary_emb),
            dcp_world_size=int(getattr(impl, "dcp_world_size", 1) or 1),
            pcp=bool(getattr(attn, "use_pcp", False)),
            hisparse=getattr(attn, "hisparse_cache", None) is not None,
            q_pad_num_heads=getattr(attn, "q_pad_num_heads", None),
            num_heads=int(wrapper.num_heads),
            absorb=absorb_variant(attn),
            quant_query_input=bool(getattr(impl, "supports_quant_query_input", False)),
            upstream_fuses=upstream_fuses,
            traced_whole=whole_model_compiled(),
        )
        requested = self.settings.requested
        decision = decide_qk_cache(inputs) if requested(QK_CACHE) else NOT_REQUESTED
        absorb = NOT_REQUESTED
        if requested(ABSORB_QK_CACHE):
            absorb = decide_absorb(inputs, decision, self.settings.provider(ABSORB_QK_CACHE),
                                   {} if self.stock else absorb_qk_cache.provider_missing(
                                       layer_device(wrapper), attn.qk_nope_head_dim, attn.kv_lora_rank,
                                       attn.qk_rope_head_dim))
        if decision.state is FusionState.APPLIED and decision.provider == "aiter":
            # every table and buffer the fused path reads, built now, never inside a graph capture
            aiter_qk_cache.reserve_zero_positions(layer_device(wrapper), max_batched_tokens())
            aiter_qk_cache.reserve_identity_table(layer_device(wrapper), wrapper.kv_a_layernorm.weight.dtype,
                                                  attn.qk_rope_head_dim)
        site = QkCacheSite(
            decision=decision,
            absorb_decision=absorb,
            absorb=inputs.absorb,
            fmt=None,
            context=None,
            on_effective=self.evidence.effective_hook(QK_CACHE, attn.layer_name),
            on_absorb_effective=self.evidence.effective_hook(ABSORB_QK_CACHE, attn.layer_name),
            upstream_fuses=upstream_fuses,
        )
        site.kv_transfer = kv_transfer_hooks()
        site.query_heads = padded_query_heads(attn, inputs.num_heads)
        if site.overlay_fuses:
            site.fmt, site.context = vllm_fp8_format(), get_attention_context
        setattr(wrapper, QK_CACHE_SITE, site)
        for fusion, layer_decision in ((QK_CACHE, decision), (ABSORB_QK_CACHE, absorb)):
            if requested(fusion):
                self.evidence.note_layer(fusion, layer_decision)
        return site
