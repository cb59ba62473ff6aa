"""Activation in this process against each release's source tree on disk, without importing vLLM:
the shape found, the patches grouped per module and hooked at import, every refusal and error in
full (outside the range, unrecognised code, a fusion's anchors missing, a live anchor failing),
deactivation, a second activation, and the Ray variable. The post-import hooks are recorded, not
registered: no vLLM module is patched here (the vLLM tests do that)."""

from __future__ import annotations

import shutil
import types

import pytest
from releases import MATRIX, minor, tree_of

from k3_amd_overlay import activation
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.package import FUSIONS, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import load_settings
from k3_amd_overlay.targets import sources as src

SHAPE_OF = {"0.29": "plain_wrapper", "0.30": "k3_norm_wrapper", "0.31": "k3_norm_wrapper",
            "0.32": "k3_decode_wrapper", "0.33": "k3_decode_wrapper"}
HOW_TO_PROCEED = ("to serve without the overlay set K3_AMD_OVERLAY=0; to serve with what can be installed and "
                  "record the rest as refused set K3_AMD_OVERLAY_STRICT=0; or install a k3-amd-overlay that "
                  "supports this vLLM")
# where the source probe finds no shape, non-strict would install nothing: the advice says so
HOW_TO_PROCEED_UNRECOGNISED = ("to serve without the overlay set K3_AMD_OVERLAY=0; K3_AMD_OVERLAY_STRICT=0 would "
                               "install nothing here (its K3 AMD code matches no shape this overlay knows); or "
                               "install a k3-amd-overlay that supports this vLLM")
# after a live anchor check fails non-strict reverts every patch and refuses every fusion too
HOW_TO_PROCEED_AFTER_A_LIVE_ANCHOR = (
    "to serve without the overlay set K3_AMD_OVERLAY=0; K3_AMD_OVERLAY_STRICT=0 would install nothing here (a failed "
    "live anchor check reverts every overlay patch and refuses every fusion, strict or not); or install a "
    "k3-amd-overlay that supports this vLLM")
MLA, LINEAR = "vllm.models.kimi_k3.amd.mla", "vllm.models.kimi_k3.amd.linear"


@pytest.fixture
def hooks(monkeypatch):
    """The post-import hooks activation registers, by module, in order."""
    registered: list[tuple[str, object]] = []
    monkeypatch.setattr(activation.wrapt, "register_post_import_hook",
                        lambda hook, name: registered.append((name, hook)))
    return registered


@pytest.fixture
def warnings(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(activation.logger, "warning", lambda fmt, *args: said.append(fmt % args))
    return said


@pytest.fixture(autouse=True)
def no_activation_left():
    yield
    activation.deactivate()


def _facing(monkeypatch, root, version: str) -> None:
    monkeypatch.setattr(activation.sources, "vllm_root", lambda: root)
    monkeypatch.setattr(activation, "installed_vllm_version", lambda: version)


def _settings(tmp_path, switch="1", strict="1"):
    return load_settings({"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_STRICT": strict,
                          "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "markers")})


@pytest.mark.parametrize("version", MATRIX)
def test_each_release_gets_its_shapes_patches_hooked_on_their_modules(version, tmp_path, monkeypatch, hooks,
                                                                      warnings):
    _facing(monkeypatch, tree_of(version), version)
    active = activation.activate(_settings(tmp_path))
    assert active is activation.active() and active.shape.name == SHAPE_OF[minor(version)]
    keys = [spec.key for specs in active.specs_by_module.values() for spec in specs]
    assert active.evidence.record.vllm_shape == active.shape.name and active.evidence.record.patches == keys
    assert [name for name, _ in hooks] == list(active.specs_by_module)
    for module, specs in active.specs_by_module.items():
        assert {spec.module for spec in specs} == {module}
    assert sorted(keys) == sorted(s.key for s in active.shape.build(activation.LayerInstaller(
        active.settings, active.evidence), frozenset(FUSIONS)))
    assert warnings == [] and active.live
    assert (tmp_path / "markers").is_dir() and active.evidence.marker_path is not None


def test_outside_the_supported_range_strict_stops_and_lenient_probes_on(tmp_path, monkeypatch, hooks, warnings):
    _facing(monkeypatch, tree_of(MATRIX[-1]), "0.28.0")
    with pytest.raises(activation.OverlayActivationError) as error:
        activation.activate(_settings(tmp_path))
    assert str(error.value) == ("k3-amd-overlay: vLLM 0.28.0 is outside the supported range (vllm >= 0.29, < 0.34); "
                                + HOW_TO_PROCEED)
    assert activation.active() is None and hooks == []
    active = activation.activate(_settings(tmp_path, strict="0"))
    assert warnings == ["k3-amd-overlay: vLLM 0.28.0 is outside the supported range (vllm >= 0.29, < 0.34); "
                        "probing anyway (K3_AMD_OVERLAY_STRICT=0)"]
    assert active.shape is not None and hooks


def test_outside_the_range_and_unrecognised_the_stop_does_not_offer_non_strict_as_a_way_to_fuse(tmp_path, monkeypatch,
                                                                                                 hooks, warnings):
    _facing(monkeypatch, tmp_path / "empty", "0.34.0")
    with pytest.raises(activation.OverlayActivationError) as error:
        activation.activate(_settings(tmp_path))
    assert str(error.value) == ("k3-amd-overlay: vLLM 0.34.0 is outside the supported range (vllm >= 0.29, < 0.34); "
                                + HOW_TO_PROCEED_UNRECOGNISED)
    assert activation.active() is None and hooks == []


def test_unrecognised_code_strict_stops_and_lenient_refuses_every_requested_fusion(tmp_path, monkeypatch, hooks,
                                                                                 warnings):
    _facing(monkeypatch, tmp_path / "empty", "0.33.0")
    with pytest.raises(activation.OverlayActivationError) as error:
        activation.activate(_settings(tmp_path, switch="qkv_norm,qk_cache"))
    message = str(error.value)
    assert message.startswith("k3-amd-overlay does not recognise the K3 AMD code of vLLM 0.33.0 (k3_decode_wrapper: "
                              f"missing {src.K3_MLA}: class {src.K3_WRAPPER}, ")
    assert f"; plain_wrapper: missing {src.LINEAR}: imports MultiHeadLatentAttentionWrapper" in message
    assert message.endswith(f"class KimiLinearModel); {HOW_TO_PROCEED_UNRECOGNISED}")
    active = activation.activate(_settings(tmp_path, switch="qkv_norm,qk_cache", strict="0"))
    reason = message.removesuffix(f"; {HOW_TO_PROCEED_UNRECOGNISED}")
    assert active.shape is None and hooks == [] and active.specs_by_module == {}
    for fusion in FUSIONS:
        entry = active.evidence.fusion(fusion)
        if fusion in (QKV_NORM, QK_CACHE):
            assert (entry.state, entry.reason) == (FusionState.REFUSED, reason)
        else:
            assert entry.state is FusionState.DISABLED
    assert warnings == [f"k3-amd-overlay: qk_cache, qkv_norm refused: {reason}"]
    assert active.evidence.marker_path is not None and active.evidence.marker_path.is_file()


def _without_the_normalize_call(tmp_path, version: str):
    tree = tmp_path / "vllm"
    for rel in (src.LINEAR, src.K3_MLA, src.SHARED_MLA, src.MLA_ATTENTION, src.ATTENTION):  # what the probes read
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree_of(version) / rel, tree / rel)
    mla = tree / src.K3_MLA
    mla.write_text(mla.read_text().replace("_normalize_q_kv", "_normalise_elsewhere"))
    return tree


def test_a_fusion_whose_anchors_are_missing_is_refused_alone_or_stops_startup(tmp_path, monkeypatch, hooks,
                                                                           warnings):
    _facing(monkeypatch, _without_the_normalize_call(tmp_path, MATRIX[-1]), "0.33.0")
    anchors = (f"{src.K3_MLA}: {src.K3_WRAPPER}._normalize_q_kv(q_c, kv_c); "
               f"{src.K3_MLA}: {src.K3_WRAPPER}.forward calls self._normalize_q_kv")
    with pytest.raises(activation.OverlayActivationError) as error:
        activation.activate(_settings(tmp_path))
    reason = f"vLLM 0.33.0 (k3_decode_wrapper) lacks the anchors qkv_norm needs: {anchors}"
    assert str(error.value) == f"k3-amd-overlay: {reason}; {HOW_TO_PROCEED}"
    assert hooks == []
    active = activation.activate(_settings(tmp_path, strict="0"))
    assert (active.evidence.fusion(QKV_NORM).state, active.evidence.fusion(QKV_NORM).reason) == (
        FusionState.REFUSED, reason)
    assert warnings == [f"k3-amd-overlay: qkv_norm refused: {reason}"]
    keys = [spec.key for specs in active.specs_by_module.values() for spec in specs]
    assert keys == ["k3_wrapper.fused_qk_prep_supported", "k3_wrapper.fused_decode", "linear.report_layers",
                    "mtp.report_layers"]
    assert all(QKV_NORM not in spec.fusions for specs in active.specs_by_module.values() for spec in specs)
    assert active.evidence.fusion(QK_CACHE).state is FusionState.PENDING


def test_a_stop_where_every_fusion_asked_for_lacks_anchors_does_not_offer_non_strict(tmp_path, monkeypatch, hooks,
                                                                                   warnings):
    _facing(monkeypatch, _without_the_normalize_call(tmp_path, MATRIX[-1]), "0.33.0")
    with pytest.raises(activation.OverlayActivationError) as error:
        activation.activate(_settings(tmp_path, switch="qkv_norm"))
    assert str(error.value).endswith(
        "; to serve without the overlay set K3_AMD_OVERLAY=0; K3_AMD_OVERLAY_STRICT=0 would install nothing here "
        "(this vLLM lacks anchors of every fusion asked for); or install a k3-amd-overlay that supports this vLLM")
    assert hooks == []


@pytest.mark.parametrize("strict", ["1", "0"])
def test_a_live_anchor_failing_reverts_everything_and_later_hooks_do_nothing(tmp_path, monkeypatch, hooks,
                                                                            warnings, strict):
    _facing(monkeypatch, tree_of(MATRIX[-1]), "0.33.0")
    active = activation.activate(_settings(tmp_path, strict=strict))
    (first, on_mla), (second, on_linear), (third, _) = hooks
    assert (first, second, third) == (MLA, LINEAR, "vllm.models.kimi_k3.amd.mtp")
    reverted = []
    monkeypatch.setattr(active.engine, "revert_all", lambda: reverted.append(True) or [])
    drifted = types.ModuleType(MLA)  # the module as imported lacks the class the anchors named
    if strict == "1":
        errors: list[str] = []
        monkeypatch.setattr(activation.logger, "error", lambda fmt, *args: errors.append(fmt % args))
        with pytest.raises(activation.OverlayActivationError) as error:
            on_mla(drifted)
        message = str(error.value)
        assert message.startswith(f"k3-amd-overlay (vLLM 0.33.0): live anchor check failed in {MLA}: ")
        # non-strict would revert every patch and refuse every fusion as well: the advice says so (it
        # said STRICT=0 would "serve with what can be installed")
        assert message.endswith(f"; every overlay patch reverted; {HOW_TO_PROCEED_AFTER_A_LIVE_ANCHOR}")
        assert isinstance(error.value.__cause__, activation.AnchorError)
        # vLLM's model registry may catch the stop and say only that inspecting the model failed: the
        # overlay's own ERROR line says why, and the marker says refused (it said "patched" before)
        assert errors == [message]
        refused = [active.evidence.fusion(f) for f in FUSIONS]
        assert {e.state for e in refused} == {FusionState.REFUSED}
        assert refused[0].reason.startswith(f"live anchor check failed in {MLA}: ")
    else:
        on_mla(drifted)
        refused = [active.evidence.fusion(f) for f in FUSIONS]
        assert {e.state for e in refused} == {FusionState.REFUSED}
        assert refused[0].reason.startswith(f"live anchor check failed in {MLA}: ")
        assert refused[0].reason.endswith("; every overlay patch reverted")
        assert warnings == [f"k3-amd-overlay: {', '.join(sorted(FUSIONS))} refused: {refused[0].reason}"]
    assert reverted == [True] and active.live is False
    applied = []
    monkeypatch.setattr(active, "apply_module", lambda *args: applied.append(args))
    on_linear(types.ModuleType(LINEAR))
    assert applied == []


def test_a_hook_applies_its_own_modules_patches(tmp_path, monkeypatch, hooks):
    _facing(monkeypatch, tree_of(MATRIX[-1]), "0.33.0")
    active = activation.activate(_settings(tmp_path))
    seen = []
    monkeypatch.setattr(active.engine, "apply", lambda specs, module: seen.append((specs, module)) or [])
    module = types.ModuleType(LINEAR)
    dict(hooks)[LINEAR](module)
    assert seen == [(active.specs_by_module[LINEAR], module)]


def test_stopping_reverts_and_records_every_requested_fusion_refused_as_deactivated(tmp_path, monkeypatch, hooks):
    _facing(monkeypatch, tree_of(MATRIX[-1]), "0.33.0")
    active = activation.activate(_settings(tmp_path, switch="qkv_norm"))
    monkeypatch.setattr(active.engine, "revert_all", lambda: ["k3_wrapper.init"])
    assert activation.deactivate() == ["k3_wrapper.init"]
    assert activation.active() is None and active.live is False and activation.deactivate() == []
    assert (active.evidence.fusion(QKV_NORM).state, active.evidence.fusion(QKV_NORM).reason) == (
        FusionState.REFUSED, activation.DEACTIVATED)
    assert active.evidence.fusion(QK_CACHE).reason == "not requested by K3_AMD_OVERLAY='qkv_norm'"


def test_a_second_activation_returns_the_first_and_warns_only_if_it_differs(tmp_path, monkeypatch, hooks,
                                                                            warnings):
    _facing(monkeypatch, tree_of(MATRIX[-1]), "0.33.0")
    assert activation.activate(_settings(tmp_path, switch="0")) is None and activation.active() is None
    first = activation.activate(_settings(tmp_path))
    assert activation.activate(_settings(tmp_path)) is first and warnings == []
    assert activation.activate(_settings(tmp_path, switch="stock")) is first
    assert warnings == ["k3-amd-overlay: already active as 1; ignoring a second activation as stock"]
    assert activation.activate(_settings(tmp_path, switch="qk_cache")) is first and len(warnings) == 2


@pytest.mark.parametrize(("before", "after"), [
    (None, "K3_AMD_OVERLAY"),
    ("", "K3_AMD_OVERLAY"),
    ("NCCL_, HF_", "NCCL_,HF_,K3_AMD_OVERLAY"),
    ("NCCL_,K3_AMD_OVERLAY", "NCCL_,K3_AMD_OVERLAY"),
])
def test_the_switch_travels_to_ray_workers(monkeypatch, before, after):
    if before is None:
        monkeypatch.delenv(activation.RAY_PREFIXES, raising=False)
    else:
        monkeypatch.setenv(activation.RAY_PREFIXES, before)
    activation.forward_switch_to_ray()
    assert activation.RAY_PREFIXES == "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
    import os

    assert os.environ[activation.RAY_PREFIXES] == after


@pytest.mark.parametrize("triggering", [False, True])
def test_the_known_defects_of_the_vllm_faced_are_recorded_with_their_trigger(tmp_path, monkeypatch, hooks,
                                                                            triggering):
    from k3_amd_overlay.targets.defects import REAL_POSITIONS_IN_FUSED_DECODE, W_UK_T_BEFORE_LOAD

    for name, value in (("VLLM_ROCM_USE_AITER", "1"), ("VLLM_ROCM_USE_AITER_FP8BMM", "0"),
                        ("VLLM_ROCM_USE_AITER_FP4BMM", "0")):
        if triggering:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    version = next((v for v in MATRIX if minor(v) == "0.32"), None)
    if version is None:
        pytest.skip("vLLM 0.32 is not in the matrix")
    _facing(monkeypatch, tree_of(version), version)
    active = activation.activate(_settings(tmp_path))
    assert active.evidence.record.upstream_defects == [  # None: may fire, decided per layer by vLLM
        {"name": d.name, "what": d.what, "when": d.when, "triggered": None if triggering else False}
        for d in (W_UK_T_BEFORE_LOAD, REAL_POSITIONS_IN_FUSED_DECODE)]


def test_log_lines_go_to_vllms_logger_tree():
    """vLLM configures the "vllm" logger (its handlers, VLLM_LOGGING_LEVEL): the overlay's lines
    are emitted under it, so they appear wherever vLLM's own do."""
    assert activation.logger.name == "vllm.k3_amd_overlay"


def test_the_plugin_warns_of_a_provider_set_for_a_fusion_not_switched_on(monkeypatch, caplog):
    import logging
    import os

    from k3_amd_overlay import plugin, process_identity

    for name in [k for k in os.environ if k.upper().startswith("K3_AMD_OVERLAY")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("K3_AMD_OVERLAY", "qkv_norm")
    monkeypatch.setenv("K3_AMD_OVERLAY_QK_CACHE_PROVIDER", "triton")
    monkeypatch.setattr(process_identity, "is_cli_client", lambda: False)
    monkeypatch.setattr(process_identity, "is_model_inspection", lambda: False)
    started: list = []
    monkeypatch.setattr(activation, "activate", started.append)
    with caplog.at_level(logging.WARNING, logger="vllm.k3_amd_overlay"):
        plugin.register()
    assert [s.fusions for s in started] == [frozenset({QKV_NORM})]
    assert ("k3-amd-overlay: K3_AMD_OVERLAY_QK_CACHE_PROVIDER=triton has no effect with K3_AMD_OVERLAY='qkv_norm' "
            "(qk_cache is not switched on)") in caplog.messages
