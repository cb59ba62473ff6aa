"""The vLLM shapes the overlay recognises: for each, the anchors (probed in source, before any
model import) that identify it and that each fusion needs, what this vLLM fuses by itself, and
the patches the overlay installs there. Recognised by probing, never by version string."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from k3_amd_overlay.engine import PatchSpec
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.targets import k3_wrapper
from k3_amd_overlay.targets import sources as src
from k3_amd_overlay.targets.decode import DECODE_SITE
from k3_amd_overlay.targets.installer import DECODE_FUSIONS, LayerInstaller
from k3_amd_overlay.targets.norm import QKV_NORM_SITE
from k3_amd_overlay.targets.plain_wrapper import k3_wrapper_class

LINEAR_MODULE = "vllm.models.kimi_k3.amd.linear"
MTP_MODULE = "vllm.models.kimi_k3.amd.mtp"
K3_MLA_MODULE = "vllm.models.kimi_k3.amd.mla"
SHARED_MLA_MODULE = "vllm.model_executor.layers.mla"
K3_WRAPPER = src.K3_WRAPPER
TEXT_MODEL = "KimiLinearModel"  # the K3 (and Kimi-Linear) text model: builds every decoder layer
MTP_MODEL = "KimiK3MultiTokenPredictor"  # the MTP draft model: builds the draft's decoder layers
SHARED_WRAPPER = "MultiHeadLatentAttentionWrapper"
FUSED_DECODE_PARAMS = ("q", "kv_c_normed", "k_pe", "positions", "output_shape", "attn_metadata",
                       "layer", "kv_cache", "slot_mapping")
ATTN_FORWARD_PARAMS = ("q", "kv_c_normed", "k_pe", "output_shape", "q_dcp_replicated")
# vLLM 0.32+'s own fused decode takes a layer only where kv_lora_rank * heads per rank >= this
# (``_fused_qk_prep_supported`` in vllm/models/kimi_k3/amd/mla.py).
UPSTREAM_DECODE_MIN_LATENT_HEADS = 2048


@dataclass(frozen=True)
class Anchor:
    what: str
    holds: Callable[[src.VllmSources], bool]


@dataclass(frozen=True)
class VllmShape:
    name: str
    releases: str
    identity: tuple[Anchor, ...]
    fusion_anchors: dict[str, tuple[Anchor, ...]]
    upstream: dict[str, str]
    build: Callable[[LayerInstaller, frozenset[str]], list[PatchSpec]]


def _k3_class(s: src.VllmSources):
    return src.find_class(s.tree(src.K3_MLA), K3_WRAPPER)


def _k3_method(s: src.VllmSources, name: str):
    return src.find_method(_k3_class(s), name)


def _linear_uses(name: str) -> Anchor:
    return Anchor(
        f"{src.LINEAR}: KimiMLAAttention.__init__ constructs {name}",
        lambda s: src.calls(src.find_method(src.find_class(s.tree(src.LINEAR), "KimiMLAAttention"),
                                            "__init__"), name),
    )


TEXT_MODEL_EXISTS = Anchor(f"{src.LINEAR}: class {TEXT_MODEL}",
                           lambda s: src.find_class(s.tree(src.LINEAR), TEXT_MODEL) is not None)
K3_WRAPPER_EXISTS = Anchor(f"{src.K3_MLA}: class {K3_WRAPPER}", lambda s: _k3_class(s) is not None)
NORMALIZE_SEAM = (
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}._normalize_q_kv(q_c, kv_c)",
           lambda s: src.params(_k3_method(s, "_normalize_q_kv")) == ("q_c", "kv_c")),
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}.forward calls self._normalize_q_kv",
           lambda s: src.calls(_k3_method(s, "forward"), "self._normalize_q_kv")),
)
FUSED_DECODE_SEAM = (
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}._fused_qk_prep_supported()",
           lambda s: _k3_method(s, "_fused_qk_prep_supported") is not None
           and src.params(_k3_method(s, "_fused_qk_prep_supported")) == ()),
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}.__init__ sets self._fused_qk_prep from _fused_qk_prep_supported()",
           lambda s: src.assigns_self_attr(_k3_method(s, "__init__"), "_fused_qk_prep")
           and src.calls(_k3_method(s, "__init__"), "self._fused_qk_prep_supported")),
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}._fused_decode{FUSED_DECODE_PARAMS}",
           lambda s: src.params(_k3_method(s, "_fused_decode")) == FUSED_DECODE_PARAMS),
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}.forward calls self._fused_decode",
           lambda s: src.calls(_k3_method(s, "forward"), "self._fused_decode")),
    # fusions.qk_cache.upstream_takes mirrors this per-batch test: where vLLM's changes, the mirror is stale
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}.forward fuses decode-only batches (num_actual_tokens == num_decode_tokens)",
           lambda s: src.compares_equal(_k3_method(s, "forward"), "num_actual_tokens", "num_decode_tokens")),
)
NO_UPSTREAM_DECODE = Anchor(
    f"{src.K3_MLA}: no fused decode of its own (no _fused_decode, no fused_qk_rope_concat_and_cache_mla)",
    lambda s: not src.mentions(s.tree(src.K3_MLA), "_fused_decode")
    and not src.mentions(s.tree(src.K3_MLA), "fused_qk_rope_concat_and_cache_mla"),
)
ATTEND_SEAM = (
    Anchor(f"{src.MLA_ATTENTION}: MLAAttention.forward{ATTN_FORWARD_PARAMS}",
           lambda s: src.params(src.find_method(src.find_class(s.tree(src.MLA_ATTENTION), "MLAAttention"),
                                                "forward"))[:5] == ATTN_FORWARD_PARAMS),
    Anchor(f"{src.MLA_ATTENTION}: MLAAttention._v_up_proj(x, out)",
           lambda s: src.params(src.find_method(src.find_class(s.tree(src.MLA_ATTENTION), "MLAAttention"),
                                                "_v_up_proj")) == ("x", "out")),
    Anchor(f"{src.ATTENTION}: get_attention_context(layer_name)",
           lambda s: src.params(src.find_function(s.tree(src.ATTENTION), "get_attention_context"))
           == ("layer_name",)),
)
K3_ATTEND_SEAM = (
    Anchor(f"{src.K3_MLA}: {K3_WRAPPER}.forward calls self.mla_attn",
           lambda s: src.calls(_k3_method(s, "forward"), "self.mla_attn")),
    *ATTEND_SEAM,
)
SHARED_FRONT_END = (
    Anchor(f"{src.SHARED_MLA}: {SHARED_WRAPPER}.forward(positions, hidden_states, llama_4_scaling)",
           lambda s: src.params(src.find_method(src.find_class(s.tree(src.SHARED_MLA), SHARED_WRAPPER),
                                                "forward")) == ("positions", "hidden_states", "llama_4_scaling")),
    Anchor(f"{src.SHARED_MLA}: {SHARED_WRAPPER}.forward normalises with self.q_a_layernorm and self.kv_a_layernorm",
           lambda s: src.calls(src.find_method(src.find_class(s.tree(src.SHARED_MLA), SHARED_WRAPPER), "forward"),
                               "self.q_a_layernorm")
           and src.calls(src.find_method(src.find_class(s.tree(src.SHARED_MLA), SHARED_WRAPPER), "forward"),
                         "self.kv_a_layernorm")),
)


def _init_spec(installer: LayerInstaller, fusions: frozenset[str], attend_hook: bool) -> PatchSpec:
    return PatchSpec(
        key="k3_wrapper.init", module=K3_MLA_MODULE, attribute=f"{K3_WRAPPER}.__init__",
        fusions=tuple(sorted(fusions)),
        wrapper=k3_wrapper.install_layer_sites(installer, fusions, attend_hook),
    )


def _report_spec(installer: LayerInstaller, specs: list[PatchSpec]) -> list[PatchSpec]:
    """Where anything decides per layer, log the decisions once the text model is built, and again
    once the MTP draft model is (its layers are K3 MLA layers too, built after the text model)."""
    if not specs:
        return []
    fusions = tuple(sorted({f for spec in specs for f in spec.fusions}))
    return [PatchSpec(key="linear.report_layers", module=LINEAR_MODULE, attribute=f"{TEXT_MODEL}.__init__",
                      fusions=fusions, wrapper=k3_wrapper.report_layers(installer), optional=True),
            PatchSpec(key="mtp.report_layers", module=MTP_MODULE, attribute=f"{MTP_MODEL}.__init__",
                      fusions=fusions, wrapper=k3_wrapper.report_layers(installer), optional=True)]


def _normalize_spec() -> PatchSpec:
    return PatchSpec(key="k3_wrapper.normalize_q_kv", module=K3_MLA_MODULE,
                     attribute=f"{K3_WRAPPER}._normalize_q_kv", fusions=(QKV_NORM,),
                     wrapper=k3_wrapper.normalize_q_kv_wrapper, params=("q_c", "kv_c"), kept_by=QKV_NORM_SITE)


def _build_decode_shape(installer: LayerInstaller, fusions: frozenset[str]) -> list[PatchSpec]:
    specs = []
    if QKV_NORM in fusions:
        specs += [_init_spec(installer, frozenset({QKV_NORM}), attend_hook=False), _normalize_spec()]
    decode = tuple(sorted(fusions & DECODE_FUSIONS))
    if decode:
        specs += [
            PatchSpec(key="k3_wrapper.fused_qk_prep_supported", module=K3_MLA_MODULE,
                      attribute=f"{K3_WRAPPER}._fused_qk_prep_supported", fusions=decode,
                      wrapper=k3_wrapper.decide_fused_qk_prep(installer), params=()),
            PatchSpec(key="k3_wrapper.fused_decode", module=K3_MLA_MODULE,
                      attribute=f"{K3_WRAPPER}._fused_decode", fusions=decode,
                      wrapper=k3_wrapper.fused_decode_wrapper, params=FUSED_DECODE_PARAMS, kept_by=DECODE_SITE),
        ]
    return specs + _report_spec(installer, specs)


def _build_norm_shape(installer: LayerInstaller, fusions: frozenset[str]) -> list[PatchSpec]:
    # No upstream fused decode to disable, but in stock mode the decode site still goes on each layer:
    # it counts the layer (stock) and opens the census's decode range around vLLM's own call.
    if not fusions:
        return []
    specs = [_init_spec(installer, fusions, attend_hook=bool(fusions & DECODE_FUSIONS))]
    if QKV_NORM in fusions:
        specs.append(_normalize_spec())
    return specs + _report_spec(installer, specs)


def _build_plain_shape(installer: LayerInstaller, fusions: frozenset[str]) -> list[PatchSpec]:
    # Nothing upstream is fused here, but in stock mode the subclass still goes on each layer: it
    # counts the layer and opens the census's ranges around vLLM's own forward, which it runs.
    if not fusions:
        return []
    specs = [PatchSpec(
        key="linear.mla_wrapper", module=LINEAR_MODULE, attribute=SHARED_WRAPPER,
        fusions=tuple(sorted(fusions)),
        replace=lambda original: k3_wrapper_class(original, installer, fusions),
        guard=_no_oot_replacement,
    )]
    return specs + _report_spec(installer, specs)


def _no_oot_replacement(module: object) -> str | None:
    """An out-of-tree replacement registered for the shared wrapper is found by class name at
    instantiation; the overlay's subclass has another name and would silently bypass it."""
    from vllm.model_executor.custom_op import op_registry_oot

    oot = op_registry_oot.get(SHARED_WRAPPER)
    return f"an out-of-tree replacement {oot!r} is registered for {SHARED_WRAPPER}" if oot else None


K3_DECODE_WRAPPER = VllmShape(
    name="k3_decode_wrapper",
    releases="0.32-0.33",
    identity=(K3_WRAPPER_EXISTS, _linear_uses(K3_WRAPPER), FUSED_DECODE_SEAM[2], TEXT_MODEL_EXISTS),
    fusion_anchors={QKV_NORM: NORMALIZE_SEAM, QK_CACHE: FUSED_DECODE_SEAM + ATTEND_SEAM[1:2],
                    ABSORB_QK_CACHE: FUSED_DECODE_SEAM + ATTEND_SEAM[1:2]},
    upstream={QKV_NORM: "AITER dual RMSNorm when AITER is on",
              QK_CACHE: "AITER fused decode when AITER MLA is on, fp8 KV cache, "
                        f"kv_lora_rank*heads >= {UPSTREAM_DECODE_MIN_LATENT_HEADS}, no DCP/PCP/HiSparse/padded "
                        "heads, and the fp4 BMM (taken on gfx950 only; on by default in 0.32, off in 0.33) or "
                        "no fp8 BMM",
              ABSORB_QK_CACHE: ""},
    build=_build_decode_shape,
)
K3_NORM_WRAPPER = VllmShape(
    name="k3_norm_wrapper",
    releases="0.30-0.31",
    identity=(K3_WRAPPER_EXISTS, _linear_uses(K3_WRAPPER), NO_UPSTREAM_DECODE, TEXT_MODEL_EXISTS),
    fusion_anchors={QKV_NORM: NORMALIZE_SEAM, QK_CACHE: K3_ATTEND_SEAM, ABSORB_QK_CACHE: K3_ATTEND_SEAM},
    upstream={QKV_NORM: "AITER dual RMSNorm when AITER is on", QK_CACHE: "", ABSORB_QK_CACHE: ""},
    build=_build_norm_shape,
)
PLAIN_WRAPPER = VllmShape(
    name="plain_wrapper",
    releases="0.27-0.29",
    identity=(
        Anchor(f"{src.LINEAR}: imports {SHARED_WRAPPER} from {SHARED_MLA_MODULE}",
               lambda s: src.imports_name(s.tree(src.LINEAR), SHARED_MLA_MODULE, SHARED_WRAPPER)),
        _linear_uses(SHARED_WRAPPER),
        Anchor(f"{src.LINEAR}: no {K3_WRAPPER}", lambda s: not src.mentions(s.tree(src.LINEAR), K3_WRAPPER)),
        TEXT_MODEL_EXISTS,
    ),
    fusion_anchors={QKV_NORM: SHARED_FRONT_END, QK_CACHE: ATTEND_SEAM, ABSORB_QK_CACHE: ATTEND_SEAM},
    upstream={QKV_NORM: "", QK_CACHE: "", ABSORB_QK_CACHE: ""},
    build=_build_plain_shape,
)
VLLM_SHAPES: tuple[VllmShape, ...] = (K3_DECODE_WRAPPER, K3_NORM_WRAPPER, PLAIN_WRAPPER)


@dataclass(frozen=True)
class Recognition:
    """What the static probe found: the shape (or None), and per fusion the anchors missing."""

    shape: VllmShape | None
    missing_identity: dict[str, list[str]]
    missing_for_fusion: dict[str, list[str]]


def recognise(sources: src.VllmSources) -> Recognition:
    missing_identity: dict[str, list[str]] = {}
    for shape in VLLM_SHAPES:
        absent = [a.what for a in shape.identity if not a.holds(sources)]
        if absent:
            missing_identity[shape.name] = absent
            continue
        per_fusion = {f: [a.what for a in anchors if not a.holds(sources)]
                      for f, anchors in shape.fusion_anchors.items()}
        return Recognition(shape, missing_identity, per_fusion)
    return Recognition(None, missing_identity, {})
