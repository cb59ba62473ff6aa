"""Per-layer installation: read a freshly built K3 MLA wrapper (and its MLAAttention) into the
fusions' predicate inputs, decide, attach the sites that act on the decisions (every vLLM shape
comes through ``install_sites``), and compile every config their Triton kernels can pick, so no
served batch compiles (in every runner and graph mode: this is model load, before vLLM's profile
run). Runs in vLLM processes only, as each K3 MLA layer is built."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from k3_amd_overlay import kernel_failures, measured
from k3_amd_overlay.engine import Applied, Wrapper
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fusions.qk_cache import (
    AbsorbVariant,
    DecodePlan,
    QkCacheInputs,
    Rotation,
    decide_absorb,
    decide_qk_cache,
)
from k3_amd_overlay.fusions.qkv_norm import QkvNormInputs, decide_qkv_norm
from k3_amd_overlay.fusions.states import BucketGate, FusionState, LayerDecision
from k3_amd_overlay.kernels import launch, launch_configs, target
from k3_amd_overlay.kernels.names import QK_CACHE_KERNEL, RMSNORM_PAIR_KERNEL
from k3_amd_overlay.ops import absorb_qk_cache, aiter_qk_cache, qk_cache, rmsnorm_pair
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import Mode, OverlaySettings
from k3_amd_overlay.targets import attend_hook, vllm_env
from k3_amd_overlay.targets.decode import DECODE_SITE, DecodeSite, EagerStep, into_output, triton_absorb_kernel
from k3_amd_overlay.targets.norm import QKV_NORM_SITE, QkvNormCallback, QkvNormSite

DECODE_FUSIONS = frozenset({QK_CACHE, ABSORB_QK_CACHE})  # both act at the one decode site
logger = logging.getLogger("vllm.k3_amd_overlay")
NOT_REQUESTED = LayerDecision(FusionState.DISABLED, None, "not requested")


def rotation_kind(rotary_emb: Any) -> Rotation:
    if rotary_emb is None:
        return Rotation.NONE
    return Rotation.IDENTITY if getattr(rotary_emb, "is_identity", False) is True else Rotation.REAL


def absorb_variant(attn: Any) -> AbsorbVariant:
    # The stock decode path's own precedence: fp4 before fp8 (both flags can be set), then AMX.
    if getattr(attn, "is_aiter_triton_fp4_bmm_enabled", False):
        return AbsorbVariant.FP4
    if getattr(attn, "is_aiter_triton_fp8_bmm_enabled", False):
        return AbsorbVariant.FP8
    if getattr(attn, "is_amx_bmm_enabled", False):
        return AbsorbVariant.AMX
    return AbsorbVariant.BF16


@functools.cache
def eager_step() -> EagerStep | None:
    """The decode site's step as vLLM's eager break, made once per process (None without breakable graphs)."""
    return vllm_env.breakable_eager_break(into_output)


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype by its name (``bfloat16``), as the decisions and the self-measurement name it."""
    return str(dtype).removeprefix("torch.")


def layer_device(wrapper: Any) -> torch.device:
    return wrapper.kv_a_layernorm.weight.device


@dataclass
class LayerInstaller:
    """Builds and attaches one layer's sites; records each decision in the evidence."""

    settings: OverlaySettings
    evidence: Evidence
    coverage_recorded: bool = False
    compile_seconds: dict[str, float] = field(default_factory=dict)  # per kernel, this process's installs
    measurement: measured.Loaded = field(default_factory=lambda: measured.Loaded(None))  # this GPU's, if any
    gates: dict[str, BucketGate | None] = field(default_factory=dict)  # per fusion, as the marker records them
    gated_kernels: dict[str, str] = field(default_factory=dict)  # per gated fusion, the kernel it launches
    gate_shape: str | None = None  # the decode gates' heads and W_UK absorption, as the marker names them
    layers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # every layer given sites, while alive
    retired: bool = False  # the overlay's patches are off (or inert): a layer built from now on gets no site

    def retire(self) -> None:
        """Give no layer built from now on a site (the patches were reverted, or one stays inert)."""
        self.retired = True

    def track(self, layer: Any) -> None:
        """Remember a layer given a site, for ``keep_routes`` (vLLM's layers are torch modules, which
        take weak references; an object that takes none is no such layer and is not kept)."""
        try:
            self.layers.add(layer)
        except TypeError:
            pass

    def keep_routes(self, reverted: Iterable[Applied]) -> None:
        """After ``reverted`` patches (in the order applied) are taken off their classes
        (``k3_amd_overlay.deactivate()``, or a live anchor check that failed): each layer given sites
        meanwhile keeps the routes through them, the reverted wrappers that route by a site (``kept_by``,
        composed as they were applied) bound on the instance around vLLM's own method. Without it the
        layer would keep its sites' decisions and lose their routes: on vLLM 0.32-0.33
        ``_fused_qk_prep`` stays True where the overlay extended vLLM's fused decode, and vLLM's own
        ``_fused_decode`` (AITER's fused write) would run on a layer vLLM itself does not fuse. A layer
        whose class overrides the method (it never ran the wrapper) is left as it is."""
        kept: dict[tuple[int, str], tuple[Any, Any, list[Wrapper], set[str]]] = {}
        for record in reverted:
            if record.spec.kept_by is None or record.spec.wrapper is None:
                continue
            parent, original, wrappers, sites = kept.setdefault(
                (id(record.parent), record.name), (record.parent, record.original, [], set()))
            wrappers.append(record.spec.wrapper)
            sites.add(record.spec.kept_by)
        for layer in list(self.layers):
            for (_, name), (parent, original, wrappers, sites) in kept.items():
                if (isinstance(layer, parent) and sites & set(vars(layer))
                        and inspect.getattr_static(type(layer), name, None) is original):
                    vars(layer)[name] = types.MethodType(functools.partial(_kept_route, tuple(wrappers), original),
                                                         layer)

    def record_coverage(self, wrapper: Any) -> None:
        """Once per process: what vLLM serves here, and the launch configs this GPU's kernels use (a
        launch-config file for this GPU that cannot be used is one ERROR line here, at the first
        layer, and the marker's ``error``: the shipped configs run, or stock where those are bad)."""
        if not self.coverage_recorded:
            self.coverage_recorded = True
            self.evidence.set_coverage(vllm_env.model_coverage())
            if not self.stock:
                described = launch.describe(layer_device(wrapper))
                self.evidence.set_launch_configs(described)
                self.load_measurement(described.get("arch"), described.get("device"))

    def load_measurement(self, arch: str | None, device: str | None) -> None:
        """Once per process: this GPU's self-measurement (measured.py), whose gates the sites take; a
        file that cannot be used is one ERROR line and the marker's ``error``, and every gate then
        refuses every batch (fail closed: its verdicts are not of this process's kernels)."""
        self.measurement = measured.load_here(arch or "", device)
        if self.measurement.error:
            logger.error("K3 AMD overlay: %s; the self-measurement cannot be used: every gated fused path runs "
                         "stock at every batch size until `%s` runs again", self.measurement.error, measured.COMMAND)
        self.evidence.set_measurement(measured.marker_entry(self.measurement))

    def measured_first(self, fusion: str, missing: dict[str, str | None]) -> dict[str, str | None]:
        """``missing`` as the provider choice takes it: under ``auto`` with this GPU's measurement, only
        the provider that measurement timed (measured.measured_first)."""
        return measured.measured_first(missing, self.settings.provider(fusion), self.measurement.measurement)

    def record_gates(self, gates: dict[str, BucketGate | None], shape: str | None) -> None:
        """The marker's record of where each fusion may run and every reason stock runs elsewhere (the
        decode gates name their ``shape``; the norm's, which has none, keeps it)."""
        if self.measurement.measurement is not None or self.measurement.error:
            self.gates.update(gates)
            self.gate_shape = shape or self.gate_shape
            self.evidence.set_measurement(measured.marker_entry(self.measurement, self.gates, self.gate_shape,
                                                                self.failed_configs()))

    def as_launched(self, gate: BucketGate, fusion: str, kernel: str, device: torch.device,
                    heads: int) -> BucketGate:
        """``gate``, also sending to stock each batch whose launch of ``kernel`` would not take the
        config the measurement timed: its config failed in this process and the safe one runs in its
        place, never measured against stock (launch_configs.failed_here)."""
        self.gated_kernels[fusion] = kernel
        where = target.of(device)
        return dataclasses.replace(gate, unlike_measured=functools.partial(
            launch_configs.failed_here, kernel, where.arch, launch.device_name(device), num_heads=heads))

    def failed_configs(self) -> dict[str, list[dict[str, Any]]]:
        """Per gated fusion, its kernel's configs that failed in this process (launch_configs.degraded)."""
        found = launch_configs.degraded()
        return {fusion: found[kernel] for fusion, kernel in self.gated_kernels.items() if kernel in found}

    def refuse_failed(self, fusion: str, why: str) -> None:
        """A fused kernel failed in this process: ``fusion`` is refused from now on (stock runs)."""
        self.evidence.set_fusion(fusion, FusionState.REFUSED, why)

    def record_degraded(self) -> None:
        """The configs degraded to the safe one in this process, for the marker (launch_configs.degraded)."""
        found = launch_configs.degraded()
        if found:
            self.evidence.update_launch_configs({"degraded": found})
            if self.gates:  # the measurement's buckets where the failed configs ran: stock now
                self.record_gates({}, None)

    def follow_world(self) -> None:
        """From now on the marker records this process's place in vLLM's world (a model is being built:
        the process has joined it), at each write."""
        self.evidence.follow_world(vllm_env.world_position)

    def note(self, fusion: str, decision: LayerDecision) -> None:
        """Tally this layer's decision; a fusion whose kernel failed in this process stays refused."""
        self.follow_world()
        self.evidence.note_layer(fusion, decision)
        why = kernel_failures.reason(fusion)
        if why is not None:
            self.evidence.set_fusion(fusion, FusionState.REFUSED, why)

    def compile_ahead(self, fusion: str, kernel: str, compile_kernel: Callable[[], float | None]) -> None:
        """Compile ``fusion``'s ``kernel`` now, at model load: its seconds to the marker (logged by the
        compile), a config degraded to the safe one recorded, a kernel whose safe config cannot build
        either refuses the fusion here (once: later layers do not try again)."""
        if fusion in kernel_failures.failed():
            return
        try:
            seconds = kernel_failures.guarded(fusion, compile_kernel)
        except kernel_failures.KernelFailed as failure:
            kernel_failures.refuse(failure, self.refuse_failed)
            seconds = None
        self.record_degraded()
        if seconds is not None:
            self.compile_seconds[kernel] = self.compile_seconds.get(kernel, 0.0) + seconds
            self.evidence.update_launch_configs({"compile_seconds": dict(self.compile_seconds)})

    @property
    def stock(self) -> bool:
        return self.settings.mode is Mode.STOCK

    def install_qkv_norm(self, wrapper: Any, upstream_fuses: bool) -> QkvNormSite:
        self.record_coverage(wrapper)
        q_norm = wrapper.q_a_layernorm
        kv_norm = wrapper.kv_a_layernorm
        has_q = q_norm is not None
        inputs = QkvNormInputs(
            stock_mode=self.stock,
            has_q_norm=has_q,
            upstream_fuses=upstream_fuses,
            provider_setting=self.settings.provider(QKV_NORM),
            provider_missing=self.measured_first(QKV_NORM, vllm_env.with_vllm_aiter_switch(
                rmsnorm_pair.provider_missing(layer_device(wrapper), q_norm.variance_epsilon,
                                              kv_norm.variance_epsilon))) if has_q and not self.stock else {},
            traced_whole=vllm_env.whole_model_compiled(),
        )
        decision = decide_qkv_norm(inputs)
        callback = QkvNormCallback(q_norm, kv_norm, decision.provider) if decision.state is FusionState.APPLIED \
            else None
        gate = measured.norm_gate(self.measurement, decision.provider, upstream_fuses,
                                  dtype_name(kv_norm.weight.dtype)) if callback is not None else None
        if gate is not None:
            gate = self.as_launched(gate, QKV_NORM, RMSNORM_PAIR_KERNEL, layer_device(wrapper), 1)
        site = QkvNormSite(decision, callback,
                           self.evidence.effective_hook(QKV_NORM, wrapper.mla_attn.layer_name),
                           on_failure=self.refuse_failed, on_degraded=self.record_degraded, gate=gate)
        if gate is not None:
            self.record_gates({QKV_NORM: gate}, None)
        setattr(wrapper, QKV_NORM_SITE, site)
        self.track(wrapper)
        self.note(QKV_NORM, decision)
        if callback is not None:
            device, dtype = layer_device(wrapper), kv_norm.weight.dtype
            self.compile_ahead(QKV_NORM, RMSNORM_PAIR_KERNEL, lambda: callback.compile_ahead(device, dtype))
        return site

    def qk_cache_inputs(self, wrapper: Any, upstream_fuses: bool) -> QkCacheInputs:
        attn = wrapper.mla_attn
        impl = attn.impl
        return QkCacheInputs(
            stock_mode=self.stock,
            provider_setting=self.settings.provider(QK_CACHE),
            provider_missing={} if self.stock else self.measured_first(QK_CACHE, vllm_env.with_vllm_aiter_switch(
                qk_cache.provider_missing(layer_device(wrapper)))),
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
            traced_whole=vllm_env.whole_model_compiled(),
            activation_dtype=dtype_name(wrapper.kv_a_layernorm.weight.dtype),
        )

    def install_qk_cache(self, wrapper: Any, upstream_fuses: bool) -> DecodeSite:
        self.record_coverage(wrapper)
        attn = wrapper.mla_attn
        inputs = self.qk_cache_inputs(wrapper, upstream_fuses)
        requested = self.settings.requested
        decision = decide_qk_cache(inputs) if requested(QK_CACHE) else NOT_REQUESTED
        absorb = NOT_REQUESTED
        if requested(ABSORB_QK_CACHE):
            missing = {} if self.stock else self.measured_first(ABSORB_QK_CACHE, vllm_env.with_vllm_aiter_switch(
                absorb_qk_cache.provider_missing(
                    layer_device(wrapper), attn.qk_nope_head_dim, attn.kv_lora_rank, attn.qk_rope_head_dim,
                    fp8_weights=inputs.absorb is AbsorbVariant.FP8, mxfp4_weights=inputs.absorb is AbsorbVariant.FP4)))
            absorb = decide_absorb(inputs, decision, self.settings.provider(ABSORB_QK_CACHE), missing)
        if any(d.state is FusionState.APPLIED and d.provider == "aiter" for d in (decision, absorb)):
            # every table and buffer the fused path reads, built now, never inside a graph capture
            aiter_qk_cache.reserve_zero_positions(layer_device(wrapper), vllm_env.max_batched_tokens())
            aiter_qk_cache.reserve_identity_table(layer_device(wrapper), wrapper.kv_a_layernorm.weight.dtype,
                                                  attn.qk_rope_head_dim)
        gates = measured.decode_gates(self.measurement, inputs.num_heads, inputs.absorb.value,
                                      {QK_CACHE: decision.provider, ABSORB_QK_CACHE: absorb.provider},
                                      upstream_fuses=upstream_fuses, activations=inputs.activation_dtype)
        if gates is not None:
            kernels = {QK_CACHE: QK_CACHE_KERNEL, ABSORB_QK_CACHE: triton_absorb_kernel(inputs.absorb)}
            gates = {fusion: self.as_launched(gate, fusion, kernels[fusion], layer_device(wrapper), inputs.num_heads)
                     for fusion, gate in gates.items()}
        plan = DecodePlan(decision, absorb, inputs.absorb, upstream_fuses, measured=gates)
        if gates is not None and plan.overlay_fuses:
            applied = {QK_CACHE: decision, ABSORB_QK_CACHE: absorb}
            self.record_gates({f: g for f, g in gates.items() if applied[f].state is FusionState.APPLIED},
                              measured.shape_words(inputs.num_heads, inputs.absorb.value))
        site = DecodeSite(
            plan=plan,
            on_effective=self.evidence.effective_hook(QK_CACHE, attn.layer_name),
            on_absorb_effective=self.evidence.effective_hook(ABSORB_QK_CACHE, attn.layer_name),
            kv_transfer=vllm_env.kv_transfer_hooks(),
            query_heads=vllm_env.padded_query_heads(attn, inputs.num_heads),
            on_failure=self.refuse_failed,
            on_degraded=self.record_degraded,
        )
        if plan.overlay_fuses:
            site.fmt, site.context = vllm_env.vllm_fp8_format(), vllm_env.get_attention_context
        if plan.overlay_fuses or plan.upstream_keeps:
            site.eager_step = eager_step()
        setattr(wrapper, DECODE_SITE, site)
        self.track(wrapper)
        for fusion, layer_decision in ((QK_CACHE, decision), (ABSORB_QK_CACHE, absorb)):
            if requested(fusion):
                self.note(fusion, layer_decision)
        block_size = vllm_env.kv_cache_block_size() if plan.overlay_fuses else None
        if block_size is not None:  # unknown (no vLLM config in context): the first fused call compiles
            device, dtype = layer_device(wrapper), wrapper.kv_a_layernorm.weight.dtype
            for fusion, kernel in site.kernels():
                self.compile_ahead(fusion, kernel, functools.partial(site.compile_ahead, kernel, device, dtype,
                                                                     inputs.num_heads, block_size))
        return site


def _kept_route(wrappers: tuple[Wrapper, ...], original: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """``wrappers`` (innermost first) around ``original`` bound to ``layer``, called as that method
    (stored as a bound method of a partial: a deep copy of the layer binds the copy)."""
    call = original.__get__(layer, type(layer))
    for wrapper in wrappers:
        call = functools.partial(_through, wrapper, call, layer)
    return call(*args, **kwargs)


def _through(wrapper: Wrapper, inner: Callable[..., Any], layer: Any, *args: Any, **kwargs: Any) -> Any:
    return wrapper(inner, layer, args, kwargs)


def install_sites(installer: LayerInstaller, wrapper: Any, fusions: frozenset[str],
                  decode_via_attend_hook: bool) -> None:
    """Attach a freshly built K3 layer's per-layer sites (every vLLM shape comes through here). The
    decode site goes on the layer's MLAAttention where vLLM has no fused-decode helper to wrap, and
    in stock mode, where it only opens the census's profiler range around vLLM's attention call."""
    if installer.retired:
        return
    if QKV_NORM in fusions:
        upstream = bool(wrapper.__dict__.get("_use_eager_qk_rmsnorm_fusion", False))
        installer.install_qkv_norm(wrapper, upstream_fuses=upstream)
    if fusions & DECODE_FUSIONS and decode_via_attend_hook:
        site = installer.install_qk_cache(wrapper, upstream_fuses=False)
        if site.plan.overlay_fuses or installer.stock:  # stock: the census's range around stock's call, nothing else
            attend_hook.install(wrapper.mla_attn, site)
