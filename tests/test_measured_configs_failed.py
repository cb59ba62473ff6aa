"""A launch config that fails (``launch_configs.degrade``: the safe config runs in its place from then
on) and the self-measurement: a row ``measure`` timed after such a failure is not usable (it may have
timed the safe config, which a server where the table's config builds never runs); a server whose
config failed sends the batches that config would have run to stock where the measurement allowed
them (only the table's config was measured), and its marker says so; the measurement's shape
survives the norm site's install after the decode site's (vLLM 0.32+'s order); a tuned-config file
named without a suffix puts the results beside it, never inside it."""

from __future__ import annotations

import json

import pytest
import torch
from test_installer import _installer, here  # noqa: F401  (the fixture)
from test_measured_wiring import _bf16_layer, batch, gpu_here, planted  # noqa: F401  (the fixture)
from test_self_measure import FakeTimer, fake_pair

from k3_amd_overlay import measured
from k3_amd_overlay.commands import self_measure
from k3_amd_overlay.fusions.qk_cache import DecodePath
from k3_amd_overlay.fusions.states import BucketGate
from k3_amd_overlay.kernels import launch_configs, names, target
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import KERNEL_CONFIGS

CPU = target.of(torch.device("cpu")).arch  # the tests' layers are CPU tensors: the interpreter's table


@pytest.fixture(autouse=True)
def no_failures(monkeypatch):
    monkeypatch.setattr(launch_configs, "_degraded", {})


def fail(kernel: str, tokens: int, heads: int = 8, why: str = "out of resources: shared memory") -> None:
    """``kernel``'s config at this size failed in this process (as a launch's failure records it)."""
    launch_configs.degrade(kernel, CPU, None, tokens, heads, why)


def test_rows_measured_from_a_config_failure_on_are_not_usable_and_say_why():
    timer = FakeTimer({f"{QK_CACHE}{t}-{side}": [s] for t in (1, 8, 64)
                       for side, s in (("stock-a", 9.0), ("stock-b", 9.0), ("fused", 3.0))})
    pairs = [fake_pair(QK_CACHE, 1), fake_pair(QK_CACHE, 8), fake_pair(QK_CACHE, 64)]
    pairs[1].parity = lambda: fail(names.QK_CACHE_KERNEL, 8) or []  # the config fails in the second bucket
    rows = self_measure.measure(pairs, timer, rounds=1, out=lambda line: None)
    assert [r.fused for r in rows] == [True, False, False]
    config = dict(launch_configs.rule_for(launch_configs.resolve(CPU)[names.QK_CACHE_KERNEL][0],
                                          8, 8).config)
    assert rows[1].problems == rows[2].problems == (
        f"measured after a launch config failed in this run ({names.QK_CACHE_KERNEL} {config} (out of resources: "
        "shared memory)): the safe config ran in its place, which a server where that config builds does not run; "
        f"run {measured.COMMAND} again",)
    gate = measured.gate_for(measured.Measurement(
        path="", arch="sm90", device="NVIDIA H200", date="2026-12-02T11:00:00+00:00",
        overlay_version=measured.__version__, stock="s", seed=3, rows=tuple(rows),
        **measured.conditions("sm90", "NVIDIA H200")), QK_CACHE, 12, "bf16")
    assert gate.allows(1) and not gate.allows(2) and not gate.allows(64)


def test_without_a_failure_measure_keeps_its_rows():
    row = measured.Row(QK_CACHE, 8, 12, "bf16", True, 9.0, 3.0)
    assert self_measure.config_failed(row) is row


def test_a_gate_sends_to_stock_a_batch_whose_config_failed_where_its_bucket_allowed_it():
    asked = []

    def unlike(tokens: int) -> str | None:
        asked.append(tokens)
        failed = "k's launch config {'X': 1} failed here (boom); the safe config runs in its place"
        return failed if tokens > 4 else None

    gate = BucketGate(((8, None), (16, "stock at 9-16 tokens: 0.90x of stock on this GPU")), unlike_measured=unlike)
    assert gate.refusal(4) is None
    assert gate.refusal(5) == ("stock at 5 tokens: k's launch config {'X': 1} failed here (boom); the safe config runs "
                               "in its place, and only the table's config was measured on this GPU")
    assert gate.refusal(12) == "stock at 9-16 tokens: 0.90x of stock on this GPU"
    assert asked == [4, 5]  # asked only where the bucket allows the fusion
    assert gate == BucketGate(gate.buckets)  # the question is no part of the gate's value


def test_failed_here_names_the_config_only_for_the_batches_its_rules_pick():
    rules, _ = launch_configs.resolve(CPU)[names.QK_CACHE_KERNEL]
    assert launch_configs.failed_here(names.QK_CACHE_KERNEL, CPU, None, 8, 8) is None
    fail(names.QK_CACHE_KERNEL, 8)
    failed = launch_configs.rule_for(rules, 8, 8).config
    for tokens in (1, 8, 64, 512, 4096):
        said = launch_configs.failed_here(names.QK_CACHE_KERNEL, CPU, None, tokens, 8)
        assert (said is not None) == (launch_configs.rule_for(rules, tokens, 8).config == failed)
    assert launch_configs.failed_here(names.QK_CACHE_KERNEL, CPU, None, 8, 8) == (
        f"{names.QK_CACHE_KERNEL}'s launch config {dict(failed)} failed here (out of resources: shared memory); the "
        "safe config runs in its place")
    assert launch_configs.failed_here(names.RMSNORM_PAIR_KERNEL, CPU, None, 8) is None  # another kernel's


def test_a_server_whose_config_failed_runs_stock_where_the_measurement_allowed_it(tmp_path, here, gpu_here):  # noqa: F811
    gpu_here.write_text(json.dumps(planted(heads=8)))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference", qkv_norm="reference")
    layer = _bf16_layer()
    norm_site = inst.install_qkv_norm(layer, upstream_fuses=False)
    plan = inst.install_qk_cache(layer, upstream_fuses=False).plan
    assert [plan.path_for(batch(t)) for t in (1, 8, 64)] == [DecodePath.ABSORB] * 3
    assert norm_site.gate.allows(8)
    fail(names.ABSORB_QK_CACHE_KERNEL, 8)
    fail(names.RMSNORM_PAIR_KERNEL, 8, heads=1)
    inst.record_degraded()  # as the failing launch's site does
    absorb_rules, _ = launch_configs.resolve(CPU)[names.ABSORB_QK_CACHE_KERNEL]
    failed = launch_configs.rule_for(absorb_rules, 8, 8).config
    for tokens in (1, 8, 64):
        taken = plan.path_for(batch(tokens))
        if launch_configs.rule_for(absorb_rules, tokens, 8).config == failed:
            assert taken == DecodePath.QK_CACHE  # qk_cache's launch, measured faster there, takes the batch
            assert plan.choose(batch(tokens))[0] == DecodePath.QK_CACHE
        else:
            assert taken == DecodePath.ABSORB
    path, _ = plan.choose(batch(8))
    assert path == DecodePath.QK_CACHE
    assert plan.measured_refusal(ABSORB_QK_CACHE, 8).startswith(
        f"stock at 8 tokens: {names.ABSORB_QK_CACHE_KERNEL}'s launch config")
    assert not norm_site.gate.allows(8)
    entry = inst.evidence.record.measurement
    assert entry["shape"] == "8 heads, bf16 W_UK"
    for fusion, kernel in ((ABSORB_QK_CACHE, names.ABSORB_QK_CACHE_KERNEL), (QKV_NORM, names.RMSNORM_PAIR_KERNEL)):
        (said,) = [why for why in entry["stock"][fusion] if "never measured" in why]
        assert said == measured.config_failed_reason(launch_configs.degraded()[kernel][0])
    assert not [why for why in entry["stock"][QK_CACHE] if "never measured" in why]  # its kernel did not fail
    assert measured.config_failed_reason(launch_configs.degraded()[names.RMSNORM_PAIR_KERNEL][0]).startswith(
        "stock where rules ")


def test_the_measurements_shape_survives_the_norm_sites_install_after_the_decode_sites(tmp_path, here,  # noqa: F811
                                                                                      gpu_here):  # noqa: F811
    gpu_here.write_text(json.dumps(planted(heads=8)))
    inst = _installer(tmp_path, qk_cache="reference", absorb_qk_cache="reference", qkv_norm="reference")
    layer = _bf16_layer()
    inst.install_qk_cache(layer, upstream_fuses=False)  # vLLM 0.32+: inside the layer's __init__
    inst.install_qkv_norm(layer, upstream_fuses=False)  # then the sites installed after it
    entry = inst.evidence.record.measurement
    assert entry["shape"] == "8 heads, bf16 W_UK"
    assert set(entry["fused_buckets"]) == {QKV_NORM, QK_CACHE, ABSORB_QK_CACHE}
    assert "8 heads, bf16 W_UK" in measured.summary(entry)


def test_a_launch_config_file_named_without_a_suffix_keeps_its_results_beside_it(tmp_path):
    tuned = tmp_path / "k3-tuned"
    tuned.write_text("{}")
    assert measured.result_dir({KERNEL_CONFIGS: str(tuned)}) == tmp_path
    assert measured.result_dir({KERNEL_CONFIGS: str(tmp_path / "tuned.json")}) == tmp_path
    assert measured.result_dir({KERNEL_CONFIGS: str(tmp_path / "results")}) == tmp_path / "results"  # made by measure
    assert measured.result_dir({KERNEL_CONFIGS: str(tmp_path)}) == tmp_path
