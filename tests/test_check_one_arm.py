"""``check`` judges one arm: every process it judges must share this check's overlay version, one vLLM
and one switch, and must have a fusion to judge. A process of another install beside the server,
or one whose overlay was deactivated, must not let a verdict hold (each case held before)."""

from __future__ import annotations

import pytest
from records import judge, off_process, process

from k3_amd_overlay import activation
from k3_amd_overlay.package import __version__


def _fails(verdict) -> list[str]:
    return [line for line in verdict.lines if line.startswith("FAIL ")]


@pytest.mark.parametrize("mode,expect", [("auto", "fused"), ("stock", "stock")])
def test_a_process_whose_every_fusion_is_disabled_proves_nothing(mode, expect):
    disabled = process(mode, "disabled", pid=7, host="h", layers=2)
    for entry in disabled["fusions"].values():
        entry["reason"] = "deactivated"  # as a marker of an earlier release said after deactivate()
    verdict = judge([disabled], expect, None, require_effective=False)
    assert not verdict.holds
    assert _fails(verdict) == ["FAIL host h pid 7 (worker, vLLM 0.33.0): no fusion to judge: every fusion is "
                               "disabled in its record (qkv_norm: deactivated; qk_cache: deactivated)"], verdict.lines


@pytest.mark.parametrize("mode,expect", [("auto", "fused"), ("stock", "stock")])
def test_a_deactivated_process_fails_either_arm(mode, expect):
    record = process(mode, "refused", pid=7, host="h", layers=2)
    for entry in record["fusions"].values():
        entry["reason"] = activation.DEACTIVATED
    verdict = judge([record], expect, None, require_effective=False)
    assert not verdict.holds
    assert len(_fails(verdict)) == 2 and all(activation.DEACTIVATED in line for line in _fails(verdict))


def test_processes_with_other_switches_are_not_one_arm():
    verdict = judge([process(pid=4, host="h", switch="1"), process(pid=5, host="h", switch="qkv_norm")], "fused", None,
                    require_effective=True)
    assert not verdict.holds
    assert _fails(verdict) == ["FAIL not one deployment: K3_AMD_OVERLAY values differ: auto (qkv_norm, qk_cache, "
                               "absorb_qk_cache) (host h pid 4: '1'); auto (qkv_norm) (host h pid 5: 'qkv_norm')"], \
        verdict.lines


def test_switches_that_name_one_arm_are_one_arm():
    """``1`` and every fusion listed, in any order, with spaces, name the same arm (nodes spell it
    differently): one deployment."""
    spellings = ["1", "absorb_qk_cache, qk_cache,qkv_norm", " 1"]
    verdict = judge([process(pid=4 + i, host="h", switch=s) for i, s in enumerate(spellings)], "fused", None,
                    require_effective=True)
    assert verdict.holds and not _fails(verdict), verdict.lines


def test_another_install_that_served_does_not_prove_the_one_that_did_not():
    idle = process(pid=4, host="h", served=0, warmup=5)
    other = process(pid=5, host="h", overlay_version="0.2.0", vllm_version="0.31.0")
    verdict = judge([idle, other], "fused", None, require_effective=True)
    assert not verdict.holds
    fails = _fails(verdict)
    assert (f"FAIL host h pid 5 (worker, vLLM 0.31.0): its record was written by k3-amd-overlay 0.2.0, this "
            f"check is {__version__}: judge it with the k3-amd-overlay of the install that wrote it (check in the "
            "Python vLLM runs in; --merge with that version)") in fails, verdict.lines
    assert (f"FAIL not one deployment: overlay versions differ: {__version__} (host h pid 4); 0.2.0 (host h "
            "pid 5)") in fails
    assert "FAIL not one deployment: vllm versions differ: 0.33.0 (host h pid 4); 0.31.0 (host h pid 5)" in fails


@pytest.mark.parametrize("expect,make", [("fused", process), ("off", off_process)])
@pytest.mark.parametrize("version", ["0.2.0", ""])
def test_a_record_of_another_overlay_version_fails_alone(version, expect, make):
    """Off records too (2026-12-07: `off` judged no overlay version)."""
    verdict = judge([make(pid=4, host="h", overlay_version=version)], expect, None, require_effective=True)
    assert not verdict.holds
    assert _fails(verdict) == [
        f"FAIL host h pid 4 (worker, vLLM 0.33.0): its record was written by k3-amd-overlay {version or '(unknown)'}"
        f", this check is {__version__}: judge it with the k3-amd-overlay of the install that wrote it (check in the "
        "Python vLLM runs in; --merge with that version)"], verdict.lines


def test_one_install_one_switch_still_holds():
    verdict = judge([process(pid=4, host="h"), process(pid=5, host="h", role="api-server", layers=0, served=0)],
                    "fused", None, require_effective=True)
    assert verdict.holds and not _fails(verdict), verdict.lines
