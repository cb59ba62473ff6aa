"""``check --static`` agrees with ``doctor``: it holds only where doctor's own verdict
(``doctor.verdict_line``) for the fusions asked is the one the expectation needs ("ready" for
fused, each asked fusion fusing here), whatever the probe's record says; with the switch unset
it says plainly that the overlay is off here; a mistyped switch is its one-line reason, never a
traceback, in text and ``--json``."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from cli_process import cli_command
from records import process

from k3_amd_overlay.commands import cli
from k3_amd_overlay.record import MarkerRecord


def run_check(*args: str, doctor: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """``check --static`` in a fresh process, doctor's self-test left out (whether each provider
    matches its reference is not what these tests ask); ``doctor=False``: the plain command line,
    for paths that stop before doctor runs."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    environ.update(VLLM_TARGET_DEVICE="cpu", **env)
    return subprocess.run(cli_command("check", "--static", *args, self_test=not doctor), env=environ,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("switch", [None, "0"])
def test_the_overlay_off_here_is_said_plainly(switch):
    proc = run_check("--expect", "fused", doctor=False, **({} if switch is None else {"K3_AMD_OVERLAY": switch}))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "FAIL the overlay is off in this environment (K3_AMD_OVERLAY unset or 0): a vLLM process started here "
        "patches nothing, so it cannot be fused; set K3_AMD_OVERLAY=1 (or a list of fusions)",
        "DOES NOT HOLD: expect fused (0 processes)"]
    assert "pid 0" not in proc.stdout and "None" not in proc.stdout


@pytest.mark.parametrize("variables,reason", [
    ({"K3_AMD_OVERLAY": "fast"}, "K3_AMD_OVERLAY='fast' is not valid (unknown: 'fast'); allowed: '0' (off), '1' (all "
                                 "fusions), 'stock' (force unfused), or a comma list of: qkv_norm, qk_cache, "
                                 "absorb_qk_cache"),
    ({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_STRICT": "yes"}, "K3_AMD_OVERLAY_STRICT='yes' is not valid; allowed: "
                                                               "'1' (default, raise) or '0' (warn)"),
])
def test_a_mistyped_variable_is_its_one_line_reason_in_text_and_json(variables, reason):
    text = run_check("--expect", "fused", doctor=False, **variables)
    assert text.returncode == 1 and text.stdout.splitlines() == [
        f"FAIL {reason}", "DOES NOT HOLD: expect fused (0 processes)"], text.stdout + text.stderr[-3000:]
    assert "Traceback" not in text.stdout + text.stderr
    out = run_check("--expect", "fused", "--json", doctor=False, **variables)
    data = json.loads(out.stdout)
    assert out.returncode == 1 and data["holds"] is False and data["lines"] == [f"FAIL {reason}"]
    assert data["source"] == "static" and data["records"] == [] and "Traceback" not in out.stdout + out.stderr


def report(mode: str = "auto", **outlook: str) -> dict[str, Any]:
    """A doctor report as run_doctor builds it, for a recognised vLLM with nothing falling short:
    each fusion's outlook state as given (fused, stock with no provider, off)."""
    fusions = {}
    for fusion in ("qkv_norm", "qk_cache", "absorb_qk_cache"):
        state = outlook.get(fusion, "off")
        fusions[fusion] = {"state": state, "provider": "triton" if state == "fused" else None,
                           "why": {"fused": "triton runs here", "off": "not requested"}.get(
                               state, "stock mode (the unfused A/B baseline)" if mode == "stock" else
                               "no provider can run here (aiter: not installed)")}
    return {"switch": {"mode": mode}, "vllm shape": {"recognised": "k3_decode_wrapper"}, "launch configs": {},
            "self-test": [], "fusions": fusions}


def static(monkeypatch, capsys, expect: str, doctor_report: dict[str, Any], record: dict[str, Any],
           *args: str, switch: str = "1") -> tuple[int, list[str]]:
    """`check --static` with this doctor report and this probe record (the real verdict logic of both)."""
    from k3_amd_overlay.commands import doctor

    monkeypatch.setenv("K3_AMD_OVERLAY", switch)
    monkeypatch.setattr(doctor, "run_doctor", lambda switch=None: (doctor_report, True))
    monkeypatch.setattr(cli, "static_record", lambda timeout=600.0: (MarkerRecord.from_json(record), ""))
    code = cli.main(["check", "--expect", expect, "--static", *args])
    return code, capsys.readouterr().out.splitlines()


PATCHED = process(state="pending", layers=0, served=0, warmup=0, role="main")


def test_a_patched_probe_does_not_hold_where_doctor_says_a_fusion_cannot_fuse_here(monkeypatch, capsys):
    code, lines = static(monkeypatch, capsys, "fused", report(qkv_norm="fused", qk_cache="stock"), PATCHED)
    assert code == 1, lines
    assert ("FAIL doctor on this machine for qkv_norm, qk_cache: not ready: qk_cache cannot fuse here: no provider "
            "can run here (aiter: not installed)") in lines


def test_only_the_fusions_asked_are_judged_by_doctor(monkeypatch, capsys):
    code, lines = static(monkeypatch, capsys, "fused", report(qkv_norm="fused", qk_cache="stock"), PATCHED,
                         "--fusions", "qkv_norm")
    assert code == 0 and "ok   doctor on this machine: ready: qkv_norm fuses here via triton" in lines, lines
    # asked for a fusion the switch does not request: doctor says "not requested", so it is not fused here
    code, lines = static(monkeypatch, capsys, "fused", report(qkv_norm="fused"), PATCHED, "--fusions",
                         "qkv_norm,qk_cache", switch="qkv_norm")
    assert code == 1 and "FAIL doctor on this machine: qk_cache would not fuse here (not requested)" in lines, lines


@pytest.mark.parametrize("expect,doctor_mode,outlook", [
    ("stock", "auto", {"qkv_norm": "fused"}),  # doctor: ready to fuse, not the stock arm
    ("fused", "stock", {"qkv_norm": "stock", "qk_cache": "stock"}),  # doctor: ready (stock)
])
def test_doctor_ready_for_another_arm_does_not_hold(monkeypatch, capsys, expect, doctor_mode, outlook):
    record = process("stock", "forced-stock", layers=0, served=0, warmup=0) if expect == "stock" else PATCHED
    code, lines = static(monkeypatch, capsys, expect, report(doctor_mode, **outlook), record)
    assert code == 1 and any(line.startswith("FAIL doctor on this machine") for line in lines), lines


def test_a_marker_dir_the_server_would_refuse_does_not_hold(monkeypatch, capsys):
    """Doctor's marker-directory reason fails the static check, though the probe (which writes to a
    throwaway directory) says every fusion is patched: the real server would write no marker."""
    why = "K3_AMD_OVERLAY_MARKER_DIR=/m: a vLLM process would write no marker there"
    doctor_report = {**report(qkv_norm="fused", qk_cache="fused"), "marker dir": {"path": "/m", "error": why}}
    code, lines = static(monkeypatch, capsys, "fused", doctor_report, PATCHED)
    assert code == 1 and f"FAIL doctor on this machine for qkv_norm, qk_cache: not ready: {why}" in lines, lines


@pytest.mark.vllm
def test_static_does_not_hold_with_a_marker_dir_the_server_refuses(tmp_path):
    """This vLLM on CPU: with K3_AMD_OVERLAY_MARKER_DIR a directory writable by all (or a file: the doctor's
    tests), a server writes no marker, so no live check could hold: the static check, which held, fails
    naming it."""
    path = tmp_path / "markers"
    path.mkdir()
    path.chmod(0o777)
    proc = run_check("--expect", "fused", "--json", K3_AMD_OVERLAY="1", K3_AMD_OVERLAY_MARKER_DIR=str(path))
    data = json.loads(proc.stdout)
    assert proc.returncode == 1 and data["holds"] is False, proc.stdout + proc.stderr[-3000:]
    assert any(line.startswith("FAIL doctor on this machine") and f"K3_AMD_OVERLAY_MARKER_DIR={path}: a vLLM process "
               "would write no marker there" in line for line in data["lines"]), data["lines"]


@pytest.mark.vllm
def test_static_holds_only_where_the_real_doctor_is_ready():
    """This vLLM on CPU: with qk_cache forced to AITER (absent here) doctor is not ready and the
    probe's record (every fusion patched, pending) no longer makes check --static hold."""
    proc = run_check("--expect", "fused", K3_AMD_OVERLAY="1", K3_AMD_OVERLAY_QK_CACHE_PROVIDER="aiter")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "FAIL doctor on this machine for qkv_norm, qk_cache, absorb_qk_cache: not ready: " in proc.stdout
    assert "qk_cache cannot fuse here: no provider can run here (aiter: " in proc.stdout


@pytest.mark.vllm
def test_static_off_holds_on_the_plugins_off_record():
    """With the switch unset the probe's process loads the plugin, which leaves an off record, and
    doctor says off: that is the positive evidence for --expect off."""
    proc = run_check("--expect", "off", "--json")
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and data["holds"], proc.stdout + proc.stderr[-3000:]
    assert [r["mode"] for r in data["records"]] == ["off"] and data["records"][0]["pid"] != 0
    assert data["lines"][-1] == ("ok   doctor on this machine: off: K3_AMD_OVERLAY is unset or 0, nothing is patched "
                                 "(vLLM runs as it is)")


# The arm the switch does not give fails alike on every release (the probe's record and doctor's
# verdict are those of the matching case, which runs on each): those two run once (any_release).


@pytest.mark.vllm
@pytest.mark.parametrize("switch,expect,code", [
    ("1", "fused", 0), pytest.param("1", "stock", 1, marks=pytest.mark.any_release), ("stock", "stock", 0),
    pytest.param("stock", "fused", 1, marks=pytest.mark.any_release), ("0", "stock", 1),
])
def test_static_check(switch, expect, code):
    proc = run_check("--expect", expect, K3_AMD_OVERLAY=switch)
    assert proc.returncode == code, proc.stdout + proc.stderr[-2000:]
    if switch == "0":
        assert "the overlay is off in this environment (K3_AMD_OVERLAY unset or 0)" in proc.stdout
