"""Turning the overlay on and off in one process: recognise the vLLM shape, install the patches
of the requested fusions through post-import hooks on the K3 AMD modules, publish the evidence.

Nothing here imports model code: the shape is probed from source on disk, and each patch is
applied by a wrapt post-import hook when vLLM itself imports the module it targets."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import wrapt

from k3_amd_overlay.engine import AnchorError, PatchEngine, PatchSpec
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.package import SUPPORTED_VLLM
from k3_amd_overlay.settings import ENV_PREFIX, STRICT, SWITCH, Mode, OverlaySettings, load_settings
from k3_amd_overlay.targets import sources
from k3_amd_overlay.targets.defects import present_defects
from k3_amd_overlay.targets.installer import LayerInstaller
from k3_amd_overlay.targets.shapes import Recognition, VllmShape, recognise
from k3_amd_overlay.versions import in_supported_range, installed_vllm_version

logger = logging.getLogger("vllm.k3_amd_overlay")
RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


class OverlayActivationError(RuntimeError):
    """The overlay was asked for something this vLLM cannot take (strict mode)."""


NO_SHAPE = "its K3 AMD code matches no shape this overlay knows"
NO_ANCHORS = "this vLLM lacks anchors of every fusion asked for"
LIVE_ANCHOR_FAILED = "a failed live anchor check reverts every overlay patch and refuses every fusion, strict or not"
DEACTIVATED = ("deactivated (k3_amd_overlay.deactivate()): the overlay's patches reverted in this process; layers "
               "built before keep the overlay's sites, later ones run vLLM's own code: neither one arm nor the other")


def _how_to_proceed(installs_nothing: str | None = None) -> str:
    """The ways on from a strict stop; where non-strict would install nothing, why, instead of it."""
    lenient = (f"to serve with what can be installed and record the rest as refused set {STRICT}=0"
               if installs_nothing is None else f"{STRICT}=0 would install nothing here ({installs_nothing})")
    return (f"to serve without the overlay set {SWITCH}=0; {lenient}; or install a k3-amd-overlay that supports "
            "this vLLM")


def _installs_nothing_here(requested: list[str]) -> str | None:
    """Why non-strict would install none of ``requested`` in the installed vLLM (None: something, or the
    probe cannot tell): for the advice of a stop only, which stands either way."""
    try:
        found = recognise(sources.VllmSources(sources.vllm_root()))
    except Exception:  # advice only: the error being raised is the verdict
        return None
    return _nothing_installable(found, requested)


def _nothing_installable(found: Recognition, requested: list[str]) -> str | None:
    if found.shape is None:
        return NO_SHAPE
    return NO_ANCHORS if requested and all(found.missing_for_fusion.get(f) for f in requested) else None


def forward_switch_to_ray() -> None:
    """Make every K3_AMD_OVERLAY* variable travel to Ray workers: vLLM copies only some variables
    to Ray actors, plus the prefixes listed in VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY."""
    listed = [p.strip() for p in os.environ.get(RAY_PREFIXES, "").split(",") if p.strip()]
    if ENV_PREFIX not in listed:
        os.environ[RAY_PREFIXES] = ",".join([*listed, ENV_PREFIX])


@dataclass
class Activation:
    """The overlay as installed in this process."""

    settings: OverlaySettings
    evidence: Evidence
    shape: VllmShape | None = None
    engine: PatchEngine = field(default_factory=PatchEngine)
    specs_by_module: dict[str, list[PatchSpec]] = field(default_factory=dict)
    installer: LayerInstaller | None = None
    live: bool = True

    def refuse(self, fusions: list[str] | tuple[str, ...], reason: str) -> None:
        for fusion in fusions:
            self.evidence.set_fusion(fusion, FusionState.REFUSED, reason)
        logger.warning("k3-amd-overlay: %s refused: %s", ", ".join(fusions), reason)

    def start(self) -> None:
        forward_switch_to_ray()
        version = installed_vllm_version()
        requested = sorted(self.settings.fusions)
        if not in_supported_range(version):
            problem = f"vLLM {version} is outside the supported range ({SUPPORTED_VLLM})"
            if self.settings.strict:
                raise OverlayActivationError(
                    f"k3-amd-overlay: {problem}; {_how_to_proceed(_installs_nothing_here(requested))}")
            logger.warning("k3-amd-overlay: %s; probing anyway (%s=0)", problem, STRICT)
        vllm_sources = sources.VllmSources(sources.vllm_root())
        found = recognise(vllm_sources)
        self.evidence.set_upstream_defects([
            {"name": d.name, "what": d.what, "when": d.when, "triggered": d.triggered(os.environ)}
            for d in present_defects(vllm_sources)])
        if found.shape is None:
            detail = "; ".join(f"{name}: missing {', '.join(miss)}" for name, miss in found.missing_identity.items())
            message = f"k3-amd-overlay does not recognise the K3 AMD code of vLLM {version} ({detail})"
            if self.settings.strict:
                raise OverlayActivationError(f"{message}; {_how_to_proceed(NO_SHAPE)}")
            self.refuse(requested, message)
            self.evidence.publish()
            return
        self.shape = found.shape
        installable = set(self.settings.fusions)
        for fusion in requested:
            missing = found.missing_for_fusion.get(fusion, [])
            if missing:
                message = (f"vLLM {version} ({found.shape.name}) lacks the anchors {fusion} needs: "
                           f"{'; '.join(missing)}")
                if self.settings.strict:
                    raise OverlayActivationError(
                        f"k3-amd-overlay: {message}; {_how_to_proceed(_nothing_installable(found, requested))}")
                self.refuse([fusion], message)
                installable.discard(fusion)
        installer = self.installer = LayerInstaller(self.settings, self.evidence)
        specs = found.shape.build(installer, frozenset(installable))
        grouped: dict[str, list[PatchSpec]] = defaultdict(list)
        for spec in specs:
            grouped[spec.module].append(spec)
        self.specs_by_module = dict(grouped)
        self.evidence.set_shape(found.shape.name, [s.key for s in specs])
        self.evidence.publish()
        for module_name in self.specs_by_module:
            wrapt.register_post_import_hook(self._hook_for(module_name), module_name)

    def _hook_for(self, module_name: str) -> Any:
        def _k3_overlay_on_import(module: Any) -> None:
            if self.live:
                self.apply_module(module_name, module)

        return _k3_overlay_on_import

    def apply_module(self, module_name: str, module: Any) -> None:
        specs = self.specs_by_module.get(module_name, [])
        left_out = set(self.engine.left_out)
        try:
            self.engine.apply(specs, module)
        except Exception as exc:  # AnchorError, or wrapt failing to patch: either way nothing of it stays
            self.live = False  # hooks of modules imported later must not patch a half-reverted overlay
            self.revert()
            fusions = sorted({f for s in self.specs_by_module.values() for spec in s for f in spec.fusions})
            what = str(exc) if isinstance(exc, AnchorError) else f"{type(exc).__name__}: {exc}"
            message = f"live anchor check failed in {module_name}: {what}; every overlay patch reverted"
            if not self.settings.strict:
                self.refuse(fusions, message)
                return
            for fusion in fusions:  # the marker says so before the stop
                self.evidence.set_fusion(fusion, FusionState.REFUSED, message)
            stop = (f"k3-amd-overlay (vLLM {installed_vllm_version()}): {message}; "
                    f"{_how_to_proceed(LIVE_ANCHOR_FAILED)}")
            # raised from an import hook, vLLM's model registry may catch it and say only that the
            # architecture failed to be inspected: this line says why in the overlay's words
            logger.error("%s", stop)
            raise OverlayActivationError(stop) from exc
        newly_left_out = sorted(set(self.engine.left_out) - left_out)
        for key in newly_left_out:
            logger.warning("k3-amd-overlay: %s left out (it only logs each model's layer decisions, which the "
                           "marker holds all the same): %s", key, self.engine.left_out[key])
        if newly_left_out:
            self._record_patches([s.key for specs in self.specs_by_module.values() for s in specs
                                  if s.key not in self.engine.left_out])

    def _record_patches(self, keys: list[str]) -> None:
        """The marker's ``patches``: those planned or in place."""
        self.evidence.set_shape(self.shape.name if self.shape else None, keys)

    def revert(self) -> list[str]:
        """Every patch off its target (the identical originals back); layers built meanwhile keep
        their sites' routes (LayerInstaller.keep_routes), layers built later get no site. A patch
        someone else has wrapped since stays under that wrapper, inert: with no site on a layer it
        calls vLLM's own code. The keys reverted."""
        applied = list(self.engine.applied)
        reverted = self.engine.revert_all()
        if self.installer is not None:
            self.installer.retire()
            self.installer.keep_routes([record for record in applied if record.spec.key in reverted])
        for record in self.engine.applied:
            logger.warning("k3-amd-overlay: %s was wrapped again after the overlay patched it; the overlay's "
                           "patch stays under that wrapper, inert (layers built from now on get no overlay "
                           "site, so it calls vLLM's own code)", record.spec.target)
        self._record_patches([a.spec.key for a in self.engine.applied])
        return reverted

    def stop(self) -> list[str]:
        self.live = False
        reverted = self.revert()
        for fusion in self.settings.fusions:
            # refused, not disabled: requested, yet the process is neither arm now (layers built before
            # keep the overlay's routes, later ones run vLLM's own code)
            self.evidence.set_fusion(fusion, FusionState.REFUSED, DEACTIVATED)
        return reverted


_active: Activation | None = None


def active() -> Activation | None:
    return _active


def activate(settings: OverlaySettings | None = None) -> Activation | None:
    """Turn the overlay on as the switch says; a second call returns the first activation."""
    global _active
    settings = load_settings() if settings is None else settings
    if _active is not None:
        if (settings.mode, settings.fusions) != (_active.settings.mode, _active.settings.fusions):
            logger.warning("k3-amd-overlay: already active as %s; ignoring a second activation as %s",
                           _active.settings.raw, settings.raw)
        return _active
    if settings.mode is Mode.OFF:
        return None
    activation = Activation(settings, Evidence(settings))
    activation.start()
    _active = activation
    return activation


def deactivate() -> list[str]:
    """Take every patch off (the identical original objects back); returns the keys reverted. A patch
    another tool has wrapped since stays under that wrapper, inert (no layer built from then on gets
    a site). Layers built while active keep the per-layer sites they were given."""
    global _active
    if _active is None:
        return []
    activation, _active = _active, None
    return activation.stop()
