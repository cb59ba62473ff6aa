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
