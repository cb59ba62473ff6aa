"""The self-measurement wired into a served layer (targets/installer.py, targets/norm.py): the installer
reads this GPU's result file at the first layer; the decode plan and the norm site take its gates, so
a bucket measured slower runs stock and the marker says why; a malformed file, or one measured under
other conditions than the server's (a launch-config file tuned since, another torch), is one ERROR
line and the marker's error, every fused path then running as without a file; without a file, as
before."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_installer import _installer, _layer, here  # noqa: F401  (the fixture)

from k3_amd_overlay import measured
from k3_amd_overlay.fusions.qk_cache import BatchFacts, DecodePath
from k3_amd_overlay.kernels import launch, launch_configs
from k3_amd_overlay.package import ABSORB_MAX_TOKENS, ABSORB_QK_CACHE, QK_CACHE, QKV_NORM, __version__
from k3_amd_overlay.settings import KERNEL_CONFIGS

ARCH, DEVICE = "sm90", "NVIDIA H200"
SLOWER = "stock at 65-256 tokens: 0.80x of stock on this GPU"


def planted(heads: int, provider: str = "reference") -> dict:
    """A result file for this GPU, as if ``measure`` had timed ``provider``'s launches (the tests'
    installers run the CPU reference provider)."""
    rows = [measured.Row(QKV_NORM, 8, None, None, True, 3.0, 2.0),
            measured.Row(QKV_NORM, 256, None, None, True, 2.0, 3.0),
            measured.Row(ABSORB_QK_CACHE, 64, heads, "bf16", True, 10.0, 4.0),
            measured.Row(QK_CACHE, 64, heads, "bf16", True, 10.0, 6.0),
            measured.Row(QK_CACHE, 256, heads, "bf16", True, 10.0, 12.5)]
    return measured.Measurement(path="", arch=ARCH, device=DEVICE, date="2026-12-02T11:00:00+00:00",
                                overlay_version=__version__, stock="s", seed=1, rows=tuple(rows), provider=provider,
                                **measured.conditions(ARCH, DEVICE)).to_json()


@pytest.fixture
def gpu_here(monkeypatch, tmp_path):
    """This process on an H200 whose result file lives in ``tmp_path/configs``."""
    configs = tmp_path / "configs"
    configs.mkdir()
    monkeypatch.setenv(KERNEL_CONFIGS, str(configs))
    monkeypatch.setattr(launch, "describe", lambda device: {"arch": ARCH, "device": DEVICE, "kernels": {}})
    return configs / measured.result_name(ARCH, DEVICE)


def _bf16_layer(dtype: torch.dtype = torch.bfloat16):
    """The installer tests' layer with K3's activations (its norms' weights in ``dtype``), as measured."""
    layer = _layer()
    layer.q_a_layernorm.weight = layer.q_a_layernorm.weight.to(dtype)
    layer.kv_a_layernorm.weight = layer.kv_a_layernorm.weight.to(dtype)
    return layer


def batch(tokens: int) -> BatchFacts:
    return BatchFacts(tokens, tokens, True, False)


def test_a_bucket_measured_slower_runs_stock_and_the_marker_says_why(tmp_path, here, gpu_here):  # noqa: F811
    gpu_here.write_text(json.dumps(planted(heads=8)))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference", qkv_norm="reference")
    layer = _bf16_layer()
    norm_site = inst.install_qkv_norm(layer, upstream_fuses=False)
    site = inst.install_qk_cache(layer, upstream_fuses=False)
    plan = site.plan
    assert [plan.path_for(batch(t)) for t in (1, 64, 65, 256, 257)] == [
        DecodePath.ABSORB, DecodePath.ABSORB, None, None, None]
    assert plan.choose(batch(100)) == (None, "absorb_qk_cache: stock above 64 tokens: not measured on this GPU; "
                                             f"qk_cache: {SLOWER}")
    entry = inst.evidence.record.measurement
    assert entry["state"] == "used" and entry["file"] == str(gpu_here) and entry["shape"] == "8 heads, bf16 W_UK"
    assert entry["stock"][QK_CACHE] == [SLOWER, "stock above 256 tokens: not measured on this GPU"]
    assert entry["stock"][QKV_NORM] == ["stock at 9-256 tokens: 0.66x of stock on this GPU",
                                        "stock above 256 tokens: not measured on this GPU"]
    assert entry["fused_buckets"] == {QKV_NORM: [8], QK_CACHE: [64], ABSORB_QK_CACHE: [64]}
    # the norm site: the fused pair at 8 tokens, the layer's own two norms at 9
    calls = []
    q_norm = lambda x: calls.append("stock") or x  # noqa: E731
    for tokens in (8, 9):
        q_c, kv_c = torch.randn(tokens, 4).bfloat16(), torch.randn(tokens, 4).bfloat16()
        norm_site.normalize(q_norm, q_norm, None, q_c, kv_c)
    assert calls == ["stock", "stock"] and inst.evidence.fusion(QKV_NORM).effective_layers == 1


def test_a_malformed_file_is_one_error_and_every_gated_path_runs_stock(tmp_path, here, gpu_here, caplog):  # noqa: F811
    """Fail closed: a file for this GPU that cannot be used sent every batch to the fused paths, as
    if there were none; now every gated fusion runs stock at every batch size, the marker and the
    ERROR line saying why and what to run."""
    data = planted(heads=8)
    data["results"][4]["ratio"] = 2.0
    gpu_here.write_text(json.dumps(data))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference", qkv_norm="reference")
    layer = _bf16_layer()
    with caplog.at_level(logging.ERROR, logger="vllm.k3_amd_overlay"):
        norm_site = inst.install_qkv_norm(layer, upstream_fuses=False)
        site = inst.install_qk_cache(layer, upstream_fuses=False)
    assert [site.plan.path_for(batch(t)) for t in (1, 64, ABSORB_MAX_TOKENS + 1)] == [None, None, None]
    assert norm_site.gate is not None and not norm_site.gate.allows(1)
    entry = inst.evidence.record.measurement
    why = f"stock at every batch size: the self-measurement cannot be used ({entry['error']})"
    assert entry["state"] == "unusable" and "results[4]: field 'ratio' is 2.0" in entry["error"]
    assert entry["stock"] == {QKV_NORM: [why], QK_CACHE: [why], ABSORB_QK_CACHE: [why]}
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert caplog.records[0].getMessage().endswith("the self-measurement cannot be used: every gated fused path "
                                                   "runs stock at every batch size until `k3-amd-overlay measure` "
                                                   "runs again")


@pytest.mark.parametrize("change", ["tuned since", "another torch"])
def test_a_file_measured_under_other_conditions_is_one_error_at_server_start(tmp_path, here, gpu_here, caplog,  # noqa: F811
                                                                            change):
    data = planted(heads=8)  # measured with the shipped launch configs and this torch
    if change == "tuned since":  # `tune` then wrote this GPU's file beside it
        tuned = json.loads((launch_configs.CONFIG_DIR / f"{ARCH}.json").read_text())
        config = tuned["kernels"]["rmsnorm_pair_kernel"][-1]["config"]
        config["num_warps"] = 8 if config["num_warps"] != 8 else 4
        (gpu_here.parent / launch_configs.tuned_name(ARCH, DEVICE)).write_text(json.dumps({**tuned, "tuned_on": {
            "device": DEVICE}}))
        launch_configs._resolve.cache_clear()  # the server starts after it
        launch_configs._tuned.cache_clear()
        field, now = "launch_configs", measured.configs_fingerprint(ARCH, DEVICE)
        assert now != data["launch_configs"]
    else:
        data["torch"] = "2.8.0+rocm6.3"
        field, now = "torch", str(torch.__version__)
    gpu_here.write_text(json.dumps(data))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference")
    with caplog.at_level(logging.ERROR, logger="vllm.k3_amd_overlay"):
        site = inst.install_qk_cache(_bf16_layer(), upstream_fuses=False)
    assert site.plan.path_for(batch(1)) is None and site.plan.path_for(batch(4096)) is None
    entry = inst.evidence.record.measurement
    error = (f"{gpu_here}: field {field!r} is {data[field]!r}, this process's is {now!r}: this process does not run "
             "the kernels it timed; run `k3-amd-overlay measure` again")
    why = f"stock at every batch size: the self-measurement cannot be used ({error})"
    assert entry == {"file": str(gpu_here), "state": "unusable", "error": error, "shape": "8 heads, bf16 W_UK",
                     "fused_buckets": {QK_CACHE: [], ABSORB_QK_CACHE: []},
                     "stock": {QK_CACHE: [why], ABSORB_QK_CACHE: [why]}}
    assert [r.levelname for r in caplog.records] == ["ERROR"] and entry["error"] in caplog.records[0].getMessage()


def test_without_a_file_every_batch_is_fused_as_before_and_the_marker_says_none(tmp_path, here, gpu_here):  # noqa: F811
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference")
    site = inst.install_qk_cache(_bf16_layer(), upstream_fuses=False)
    assert site.plan.measured is None and site.plan.path_for(batch(4096)) is DecodePath.QK_CACHE
    assert inst.evidence.record.measurement == {"file": str(gpu_here), "state": "none"}


def test_a_result_file_beside_the_tuned_configs_is_not_warned_about(tmp_path, caplog):
    from k3_amd_overlay.kernels import launch_configs

    (tmp_path / measured.result_name(ARCH, DEVICE)).write_text("{}")
    (tmp_path / "notes.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="vllm.k3_amd_overlay"):
        assert launch_configs.tuned_file(str(tmp_path), ARCH, DEVICE) is None
    assert [r.getMessage().split(": ignored ")[1] for r in caplog.records] == [
        "notes.json (only <arch>-<device>.json files, as `k3-amd-overlay tune` names them, are read)"]


def test_a_layer_of_another_provider_than_the_one_measured_runs_stock_everywhere(tmp_path, here, gpu_here):  # noqa: F811
    """The file timed the Triton launches; these layers run the reference provider, named by its
    variables: no verdict of the file is about them, so stock runs at every batch, saying so (before,
    the Triton verdicts let them run at 1-64 tokens)."""
    gpu_here.write_text(json.dumps(planted(heads=8, provider="triton")))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference", qkv_norm="reference")
    layer = _bf16_layer()
    norm_site = inst.install_qkv_norm(layer, upstream_fuses=False)
    plan = inst.install_qk_cache(layer, upstream_fuses=False).plan
    assert [plan.path_for(batch(t)) for t in (1, 8, 64, 256)] == [None] * 4
    why = ("stock: k3-amd-overlay measure timed the triton provider's launch on this GPU, this layer's is "
           "reference's: not measured")
    assert plan.choose(batch(8)) == (None, f"absorb_qk_cache: {why}; qk_cache: {why}")
    entry = inst.evidence.record.measurement
    assert entry["stock"] == {QKV_NORM: [why], QK_CACHE: [why], ABSORB_QK_CACHE: [why]}
    calls = []
    q_norm = lambda x: calls.append("stock") or x  # noqa: E731
    norm_site.normalize(q_norm, q_norm, None, torch.randn(8, 4).bfloat16(), torch.randn(8, 4).bfloat16())
    assert calls == ["stock", "stock"]


def test_auto_takes_the_provider_measured_and_a_named_one_is_left_to_its_gate():
    found = measured.parse(planted(heads=8, provider="triton"), "f.json")
    here_too = {"aiter": None, "triton": None}
    chosen = measured.measured_first(here_too, "auto", found)
    assert chosen == {"aiter": "not the provider k3-amd-overlay measure timed on this GPU (triton), so never "
                               "measured against stock", "triton": None}
    assert measured.measured_first(here_too, "aiter", found) == here_too
    assert measured.measured_first(here_too, "auto", None) == here_too
    assert measured.measured_first({"aiter": None, "triton": "no GPU"}, "auto", found)["triton"] == "no GPU"


def test_a_file_that_names_no_provider_is_not_used(tmp_path):
    data = planted(heads=8)
    del data["provider"]
    with pytest.raises(measured.MeasuredError, match=r"f\.json: field 'provider' is None, expected str"):
        measured.parse(data, "f.json")


def test_on_a_layer_vllm_fuses_the_absorbed_launch_runs_only_where_it_beats_the_fused_decode(tmp_path, here,  # noqa: F811
                                                                                            gpu_here):
    """The file says absorb 4.0 µs and the two-launch fused decode (qk_cache's path) 6.0 at 64 tokens:
    on a layer vLLM fuses itself the absorbed launch runs there; with the fused decode timed faster
    (3.0) vLLM's own fused decode keeps the bucket, and the marker says against what."""
    data = planted(heads=8)
    gpu_here.write_text(json.dumps(data))
    inst = _installer(tmp_path, absorb_qk_cache="reference")
    site = inst.install_qk_cache(_bf16_layer(), upstream_fuses=True)
    assert site.plan.upstream_keeps and site.plan.path_for(batch(64)) is DecodePath.ABSORB
    for entry in data["results"]:
        if entry["fusion"] == QK_CACHE and entry["tokens"] == 64:
            entry["fused_us"], entry["ratio"] = 3.0, 10.0 / 3.0
    gpu_here.write_text(json.dumps(data))
    inst = _installer(tmp_path, absorb_qk_cache="reference")
    site = inst.install_qk_cache(_bf16_layer(), upstream_fuses=True)
    assert site.plan.path_for(batch(64)) is None  # vLLM's own fused decode
    assert inst.evidence.record.measurement["stock"][ABSORB_QK_CACHE][0] == (
        "stock at 1-64 tokens: 0.75x of the two-launch fused decode (W_UK BMM + one fused cache write, as vLLM's "
        "own fused decode) on this GPU")


def test_the_marker_records_the_gates_of_the_fusions_a_layer_runs_only(tmp_path, here, gpu_here):  # noqa: F811
    """absorb_qk_cache refused on the layer (no provider for it), qk_cache applied: the marker said
    "absorb_qk_cache fused in 1 bucket" all the same."""
    gpu_here.write_text(json.dumps(planted(heads=8)))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="aiter")
    site = inst.install_qk_cache(_bf16_layer(), upstream_fuses=False)
    assert site.plan.absorb_decision.state.value == "refused" and site.plan.decision.state.value == "applied"
    entry = inst.evidence.record.measurement
    assert set(entry["fused_buckets"]) == {QK_CACHE} and ABSORB_QK_CACHE not in entry["stock"]


def test_a_layer_of_other_activations_than_measured_runs_stock_everywhere(tmp_path, here, gpu_here):  # noqa: F811
    """`measure` times bf16 activations: a float16 model's layers took the bf16 rows' verdicts (another
    kernel specialisation); now every batch runs stock there, saying why."""
    gpu_here.write_text(json.dumps(planted(heads=8)))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference", qkv_norm="reference")
    layer = _bf16_layer(torch.float16)
    norm_site = inst.install_qkv_norm(layer, upstream_fuses=False)
    site = inst.install_qk_cache(layer, upstream_fuses=False)
    why = "stock: k3-amd-overlay measure timed bfloat16 activations on this GPU, this layer's are float16: not measured"
    assert [site.plan.path_for(batch(t)) for t in (1, 64)] == [None, None]
    assert site.plan.choose(batch(64)) == (None, f"absorb_qk_cache: {why}; qk_cache: {why}")
    assert norm_site.gate is not None and norm_site.gate.buckets == () and norm_site.gate.unmeasured == why


def test_a_named_provider_on_a_layer_vllm_fuses_itself_runs_vllms_own_launch_everywhere(tmp_path, here,  # noqa: F811
                                                                                         gpu_here):
    """The installer hands the gates the layer's ``upstream_fuses``: the norm site's gate ignored it,
    so with a provider named on a layer vLLM fuses itself the overlay's pair ran wherever it beat the
    two unfused norms, against which nothing runs there (vLLM's own fused norm does)."""
    gpu_here.write_text(json.dumps(planted(heads=8)))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference", qkv_norm="reference")
    layer = _bf16_layer()
    norm_site = inst.install_qkv_norm(layer, upstream_fuses=True)
    site = inst.install_qk_cache(layer, upstream_fuses=True)
    assert norm_site.gate is not None and norm_site.gate.buckets == () and not norm_site.gate.allows(8)
    assert site.plan.measured[QK_CACHE].buckets == ()
    assert inst.evidence.record.measurement["fused_buckets"][QKV_NORM] == []
