"""Issue 27 item 8: the doctor gives only the real reasons. A bad K3_AMD_OVERLAY* variable (switch,
provider, strict) is its own reason, never also "this vLLM's K3 AMD code is not recognised" on a
vLLM that is recognised; where vLLM's code really is not recognised, that is still said."""

from __future__ import annotations

import pytest
from machine import HAS_VLLM

from k3_amd_overlay.commands import doctor

NOT_RECOGNISED = "this vLLM's K3 AMD code is not recognised"


def test_a_report_that_never_looked_at_vllm_gives_only_its_own_reason():
    assert doctor.verdict_line({"switch": {"error": "K3_AMD_OVERLAY='fast' is not valid"}}) == (
        "not ready: K3_AMD_OVERLAY='fast' is not valid", False)


@pytest.mark.parametrize("variable,value,reason", [
    ("K3_AMD_OVERLAY", "fast", "K3_AMD_OVERLAY='fast' is not valid"),
    ("K3_AMD_OVERLAY_QK_CACHE_PROVIDER", "fastest", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER='fastest' is not valid"),
    ("K3_AMD_OVERLAY_STRICT", "maybe", "K3_AMD_OVERLAY_STRICT='maybe' is not valid"),
])
def test_a_bad_variable_on_a_recognised_vllm_is_the_only_reason(monkeypatch, variable, value, reason):
    if not HAS_VLLM:
        pytest.skip("needs a real vLLM whose K3 AMD code is recognised")
    monkeypatch.setenv("K3_AMD_OVERLAY", "1")
    monkeypatch.setenv(variable, value)
    report, healthy = doctor.run_doctor()
    assert report["verdict"].startswith(f"not ready: {reason}") and NOT_RECOGNISED not in report["verdict"]
    assert not healthy and report["vllm shape"]["recognised"]  # vLLM was looked at, and is recognised
    assert report["verdict"].count(";") == report["switch"]["error"].count(";")  # one reason, whole
    text = doctor.render(report)
    assert "recognised: " in text and text.rstrip().splitlines()[-1] == report["verdict"]


def test_a_bad_variable_on_an_unrecognised_vllm_gives_both_real_reasons(monkeypatch):
    if not HAS_VLLM:
        pytest.skip("needs a real vLLM source tree to probe")
    from k3_amd_overlay.targets import shapes

    monkeypatch.setenv("K3_AMD_OVERLAY", "fast")
    monkeypatch.setattr(shapes, "recognise", lambda sources: shapes.Recognition(None, {"k3": ["an anchor"]}, {}))
    report, healthy = doctor.run_doctor()
    assert not healthy and report["verdict"].startswith("not ready: K3_AMD_OVERLAY='fast' is not valid")
    assert report["verdict"].endswith(f"; {NOT_RECOGNISED} (see vllm shape)")
    assert "NOT recognised: k3: missing an anchor" in doctor.render(report)


def test_a_provider_that_raises_in_the_self_test_is_a_failed_row_not_a_crash(monkeypatch):
    """A kernel that raises (a compile error on this GPU, an fp8 type this Triton lacks) fails its
    own self-test row, with what it raised; the other providers are still tested and the doctor
    still gives its verdict (found on an H200 host's Triton 3.6 interpreter, which cannot convert
    AMD's fnuz fp8: the whole doctor ended in a traceback)."""
    import random

    import torch

    from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
    from k3_amd_overlay.ops import qk_cache as qk_op
    from k3_amd_overlay.ops import rmsnorm_pair

    why = f"cannot compile config {random.randrange(10**6)}"
    for module in (rmsnorm_pair, qk_op, absorb_op):
        monkeypatch.setattr(module, "provider_missing", lambda *a, **k: {"reference": None, "boom": None})

    def raising(real):
        def op(*args, provider, **kwargs):
            if provider == "boom":
                raise RuntimeError(f"triton said:\n{why}")
            return real(*args, provider=provider, **kwargs)
        return op

    monkeypatch.setattr(rmsnorm_pair, "fused_q_kv_rmsnorm", raising(rmsnorm_pair.fused_q_kv_rmsnorm))
    monkeypatch.setattr(qk_op, "fused_qk_cache", raising(qk_op.fused_qk_cache))
    for name in ("fused_absorb_qk_cache", "fused_absorb_fp8_qk_cache", "fused_absorb_mxfp4_qk_cache"):
        monkeypatch.setattr(absorb_op, name, raising(getattr(absorb_op, name)))
    rows = doctor.selftest(torch.device("cpu"))
    booms = [r for r in rows if r["provider"] == "boom"]
    assert len(booms) == 1 + 2 * (1 + 3)  # the norm; per fp8 format, qk_cache and the three W_UK variants
    assert all(r["ran"] and not r["pass"] and r["raised"] == f"RuntimeError: {why}" for r in booms), booms
    references = [r for r in rows if r["provider"] == "reference"]
    assert len(references) == len(booms) and all(r["pass"] for r in references)
    verdict, healthy = doctor.verdict_line({"self-test": rows})
    assert not healthy and verdict.startswith("not ready: self-test failed: qkv_norm boom, ")
    report, healthy = doctor.run_doctor(switch="0")  # the whole doctor, with the switch off: nothing activated
    assert not healthy and report["verdict"].startswith("not ready: self-test failed: qkv_norm boom, ")
    assert f"FAIL (raised RuntimeError: {why})" in doctor.render(report)


@pytest.mark.parametrize(("value", "loads"), [("k3_amd_overlay", True), ("other,k3_amd_overlay", True),
                                              ("other", False), ("", False), ("other, k3_amd_overlay", False)])
def test_vllm_plugins_is_read_as_vllm_reads_it(value, loads):
    """vLLM 0.29-0.33 (vllm/envs.py, vllm/plugins/__init__.py) split VLLM_PLUGINS at commas and load
    the entry points whose names are among the pieces, exactly: unset loads every plugin."""
    assert doctor.plugin_exclusion({}) is None
    found = doctor.plugin_exclusion({"VLLM_PLUGINS": value})
    assert (found is None) is loads
    if not loads:
        assert found.startswith(f"VLLM_PLUGINS={value!r} does not name k3_amd_overlay")
        assert found.endswith(f"add k3_amd_overlay to it ({doctor.with_overlay_plugin(value)}) or unset it")


def test_vllm_plugins_leaving_the_overlay_out_is_not_ready(monkeypatch):
    """Audit: with VLLM_PLUGINS set and not naming the overlay's plugin, vLLM loads no overlay
    (K3_AMD_OVERLAY=1 is ignored), and the doctor said "ready" listing the patches it applied itself."""
    activated = []
    monkeypatch.setattr(doctor, "selftest", lambda device: [])
    monkeypatch.setattr(doctor, "_activate_here", lambda env: activated.append(env) or {"patched": []})
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver")
    report, healthy = doctor.run_doctor(switch="1")
    why = ("VLLM_PLUGINS='lora_resolver' does not name k3_amd_overlay: vLLM loads only the general plugins it names "
           "(split at commas, each name exactly), so no vLLM process started with this environment loads the overlay "
           "and K3_AMD_OVERLAY='1' is ignored; add k3_amd_overlay to it (VLLM_PLUGINS=lora_resolver,k3_amd_overlay) "
           "or unset it")
    assert not healthy and why in report["verdict"]
    assert report["vllm plugins"] == {"VLLM_PLUGINS": "lora_resolver", "loads the overlay": False, "error": why}
    assert activated == [] and "patched" not in report  # vLLM would patch nothing: neither does the doctor
    assert f"== vLLM plugins\n  UNUSABLE: {why}" in doctor.render(report)
    report, healthy = doctor.run_doctor(switch="0")  # off: nothing to load, no reason
    assert report["vllm plugins"] == {"VLLM_PLUGINS": "lora_resolver", "loads the overlay": False}
    assert "VLLM_PLUGINS" not in report["verdict"]
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver,k3_amd_overlay")
    report, healthy = doctor.run_doctor(switch="1")
    assert report["vllm plugins"] == {"VLLM_PLUGINS": "lora_resolver,k3_amd_overlay", "loads the overlay": True}
    assert "VLLM_PLUGINS" not in report["verdict"] and activated


def test_the_plugin_name_the_doctor_looks_for_is_the_entry_points():
    """package.PLUGIN_NAME is the one name: the entry point pyproject.toml declares must be it."""
    from pathlib import Path

    from k3_amd_overlay.package import PLUGIN_NAME

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert list(project["entry-points"]["vllm.general_plugins"]) == [PLUGIN_NAME]
