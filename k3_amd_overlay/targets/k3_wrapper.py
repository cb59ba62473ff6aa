"""wrapt wrappers for the K3 MLA wrapper class of vLLM 0.30+ (``vllm.models.kimi_k3.amd.mla``):
each adds one thing and calls through, so everything else upstream does stays in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from k3_amd_overlay.fusions.qk_cache import upstream_takes
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.regions import DECODE_REGION, region
from k3_amd_overlay.targets import attend_hook, vllm_env
from k3_amd_overlay.targets.decode import DECODE_SITE, DecodeSite, batch_facts
from k3_amd_overlay.targets.defects import W_UK_T_BEFORE_LOAD
from k3_amd_overlay.targets.installer import LayerInstaller, install_sites
from k3_amd_overlay.targets.norm import QKV_NORM_SITE, QkvNormSite

Wrapped = Callable[..., Any]


def install_layer_sites(installer: LayerInstaller, fusions: frozenset[str],
                        qk_cache_via_attend_hook: bool) -> Callable[..., None]:
    """Wrap ``__init__``: after upstream builds the layer, attach the overlay's per-layer sites."""

    def _k3_overlay_install_layer_sites(wrapped: Wrapped, instance: Any, args: tuple[Any, ...],
                                        kwargs: dict[str, Any]) -> None:
        wrapped(*args, **kwargs)
        install_sites(installer, instance, fusions, qk_cache_via_attend_hook)

    return _k3_overlay_install_layer_sites


def report_layers(installer: LayerInstaller) -> Callable[..., None]:
    """Wrap the K3 text model's ``__init__``: once upstream has built every decoder layer of this
    model, log how each fusion was decided across them (a warning where a requested fusion fused
    on no layer). Per-layer decisions otherwise reach only the marker."""

    def _k3_overlay_report_layers(wrapped: Wrapped, instance: Any, args: tuple[Any, ...],
                                  kwargs: dict[str, Any]) -> None:
        wrapped(*args, **kwargs)
        if not installer.retired:  # left inert under another tool's wrapper: nothing of the overlay to report
            installer.follow_world()  # a pipeline stage without MLA layers is a rank of the world too
            installer.evidence.publish_layers()

    return _k3_overlay_report_layers


def _q_c_kv_c(q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q_c, kv_c


def _k3_overlay_normalize_q_kv(wrapped: Wrapped, instance: Any, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``_normalize_q_kv`` through the layer's qkv_norm site (upstream, overlay or stock)."""
    site: QkvNormSite | None = instance.__dict__.get(QKV_NORM_SITE)
    if site is None:  # a layer built before the overlay was activated
        return wrapped(*args, **kwargs)
    q_c, kv_c = _q_c_kv_c(*args, **kwargs)
    return site.normalize(instance.q_a_layernorm, instance.kv_a_layernorm, wrapped, q_c, kv_c)


def decide_fused_qk_prep(installer: LayerInstaller) -> Callable[..., bool]:
    """Wrap ``_fused_qk_prep_supported``: upstream's answer becomes one input of the overlay's
    predicate, whose answer is returned (False in stock mode; True where the overlay extends)."""

    def _k3_overlay_decide_qk_cache(wrapped: Wrapped, instance: Any, args: tuple[Any, ...],
                                    kwargs: dict[str, Any]) -> bool:
        try:
            upstream = bool(wrapped(*args, **kwargs))
        except AttributeError as exc:  # vLLM's own defect, as it fails without the overlay: name it
            if "W_UK_T" in str(exc):
                installer.evidence.defect_outcome(W_UK_T_BEFORE_LOAD.name, fired=True)
                exc.add_note(f"k3-amd-overlay: a known vLLM defect, not the overlay's: "
                             f"{W_UK_T_BEFORE_LOAD.describe()}")
            raise
        installer.evidence.defect_outcome(W_UK_T_BEFORE_LOAD.name, fired=False)
        if installer.retired:  # a patch left inert under another wrapper: vLLM's own answer
            return upstream
        site = installer.install_qk_cache(instance, upstream_fuses=upstream)
        if installer.stock:  # vLLM's stock attention call, inside the census's profiler range
            attend_hook.install(instance.mla_attn, site)
        return site.plan.fused_decode_on

    return _k3_overlay_decide_qk_cache


def _fused_decode_args(q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                       positions: torch.Tensor, output_shape: Any, attn_metadata: Any, layer: Any,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[Any, ...]:
    """The arguments the site reads itself; the batch's context is read again where it is routed."""
    return q, kv_c_normed, k_pe, positions, output_shape


def _k3_overlay_fused_decode(wrapped: Wrapped, instance: Any, args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> torch.Tensor:
    """Route ``_fused_decode`` by the layer's decisions: the overlay's fused decode where it takes
    the batch (it extends vLLM, or a provider was named), vLLM's own code where vLLM owns it."""
    site: DecodeSite | None = instance.__dict__.get(DECODE_SITE)
    if site is None:
        return wrapped(*args, **kwargs)
    q, kv_c_normed, k_pe, positions, output_shape = _fused_decode_args(*args, **kwargs)
    if torch.compiler.is_compiling():  # stand down under tracing: vLLM's own path, or stock
        if site.plan.upstream_keeps:
            return wrapped(*args, **kwargs)
        return instance.mla_attn(q, kv_c_normed, k_pe, output_shape=output_shape)
    with region(DECODE_REGION):
        return site.through_break(_route_fused_decode, q, output_shape, site, wrapped, instance, q, kv_c_normed,
                                  k_pe, positions, output_shape)


def _route_fused_decode(site: DecodeSite, wrapped: Wrapped, instance: Any, q: torch.Tensor,
                        kv_c_normed: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, output_shape: Any,
                        output: torch.Tensor | None = None) -> torch.Tensor:
    """One batch vLLM's K3 forward sent to ``_fused_decode``, decided from this batch's attention
    context (read here, not taken from the call: under a breakable capture this runs again for each
    replayed batch, which need not be decode-only)."""
    attn = instance.mla_attn
    attn_metadata, layer, kv_cache, slot_mapping = vllm_env.get_attention_context(attn.layer_name)
    path = site.path_for(attn_metadata, slot_mapping, kv_cache, None)
    if path is not None:  # the overlay's own decision for this batch comes first
        fused = site.try_fused_decode(path, attn, q, kv_c_normed, k_pe, output_shape, attn_metadata, kv_cache,
                                      slot_mapping, output)
        if fused is not None:
            return fused
    if site.plan.upstream_keeps and upstream_takes(batch_facts(attn_metadata, slot_mapping, kv_cache, None)):
        # a decode batch the overlay does not take, on a layer vLLM fuses: vLLM's own, between the KV
        # connector's hooks that vLLM's own fused decode skips (the stock attention op runs them)
        def upstream() -> torch.Tensor:
            return wrapped(q, kv_c_normed, k_pe, positions, output_shape, attn_metadata, layer, kv_cache, slot_mapping)

        if site.plan.decision.state is FusionState.UPSTREAM:
            site.on_effective(q.shape[0])
        return upstream() if site.kv_transfer is None else site.kv_transfer(attn.layer_name, upstream)
    # Any other batch (e.g. over the absorbed path's token limit with qk_cache not requested, or a
    # replayed batch with prefill rows): the stock attention call writes the KV cache and quantises
    # the query itself.
    return attn(q, kv_c_normed, k_pe, output_shape=output_shape)


normalize_q_kv_wrapper = _k3_overlay_normalize_q_kv
fused_decode_wrapper = _k3_overlay_fused_decode
