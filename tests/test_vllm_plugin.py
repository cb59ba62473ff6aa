"""The plugin as vLLM loads it: ``vllm.plugins.load_general_plugins()`` in a fresh process, with
each switch value; strict and non-strict against simulated drift; Ray forwarding; the check."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from machine import HAS_VLLM
from vllm_support import ACTIVE, SNAPSHOT, run_doctor_process, run_vllm_process, shape_name

import k3_amd_overlay

pytestmark = pytest.mark.vllm

EXPECTED_PATCHES = {
    "plain_wrapper": ["linear.mla_wrapper", "linear.report_layers", "mtp.report_layers"],
    "k3_norm_wrapper": ["k3_wrapper.init", "k3_wrapper.normalize_q_kv", "linear.report_layers", "mtp.report_layers"],
    "k3_decode_wrapper": ["k3_wrapper.init", "k3_wrapper.normalize_q_kv",
                          "k3_wrapper.fused_qk_prep_supported", "k3_wrapper.fused_decode", "linear.report_layers",
                          "mtp.report_layers"],
}
STOCK_PATCHES = {
    "plain_wrapper": EXPECTED_PATCHES["plain_wrapper"],
    "k3_norm_wrapper": ["k3_wrapper.init", "k3_wrapper.normalize_q_kv", "linear.report_layers", "mtp.report_layers"],
    "k3_decode_wrapper": EXPECTED_PATCHES["k3_decode_wrapper"],
}

@pytest.fixture(scope="module")
def shape():
    return shape_name() if HAS_VLLM else None


# A second spelling of off, a misspelt variable, non-strict live drift: the setting's handling is the
# same on every release, whose own behaviour the first case of each runs: they run once (any_release).


@pytest.mark.parametrize("switch", [None, pytest.param("0", marks=pytest.mark.any_release)])
def test_off_installs_nothing_and_leaves_stock_objects_and_an_off_record(switch, tmp_path):
    variables = {} if switch is None else {"K3_AMD_OVERLAY": switch}
    proc, res = run_vllm_process(SNAPSHOT + """
before = snapshot()
from vllm.plugins import load_general_plugins
load_general_plugins()
import sys
loaded = sorted(m for m in sys.modules if m.startswith("k3_amd_overlay"))
import wrapt
marker_dir = os.environ["K3_AMD_OVERLAY_MARKER_DIR"]
result(changed=same(before, snapshot()), loaded=loaded, pid=os.getpid(),
       wrapped=[k for k, v in snapshot().items() if isinstance(v, wrapt.FunctionWrapper)],
       markers={m: json.load(open(os.path.join(marker_dir, m))) for m in os.listdir(marker_dir)})
""", tmp_path, **variables, K3_AMD_OVERLAY_TYPO="1")
    assert res is not None, proc.stderr[-3000:]
    assert res["changed"] == [] and res["wrapped"] == [], res
    assert not {"k3_amd_overlay.activation", "k3_amd_overlay.engine", "k3_amd_overlay.targets"} & set(res["loaded"])
    # the one side effect: this process's off record, the evidence `check --expect off` needs
    assert list(res["markers"]) == [f"{res['pid']}.json"]
    record = res["markers"][f"{res['pid']}.json"]
    assert record["mode"] == "off" and record["pid"] == res["pid"] and record["patches"] == []
    assert record["vllm_version"] and record["start_ticks"] is not None and record["switch"] == (switch or "")
    assert "ignoring unknown variables K3_AMD_OVERLAY_TYPO" in proc.stderr + proc.stdout


def test_on_patches_at_import_writes_markers_forwards_to_ray_and_reverts(shape, tmp_path):
    # The worker order: plugins load first, the K3 modules are imported later by model loading.
    proc, res = run_vllm_process("""
from vllm.plugins import load_general_plugins
load_general_plugins()
import sys
before_import = "vllm.models.kimi_k3.amd.linear" in sys.modules
""" + SNAPSHOT + ACTIVE + """
first = applied()
wrapped_now = snapshot()
from k3_amd_overlay import plugin
plugin.register()  # a second registration in the same process
import vllm.plugins
vllm.plugins.plugins_loaded = False
load_general_plugins()  # and vLLM loading its plugins again
second = applied()
unchanged = same(wrapped_now, snapshot())
from vllm.ray.ray_env import get_env_vars_to_copy
ray_vars = sorted(v for v in get_env_vars_to_copy() if v.startswith("K3_AMD_OVERLAY"))
marker = json.load(open(os.path.join(os.environ["K3_AMD_OVERLAY_MARKER_DIR"], f"{os.getpid()}.json")))
import k3_amd_overlay
reverted = k3_amd_overlay.deactivate()
SHARED = "MultiHeadLatentAttentionWrapper"
result(before_import=before_import, first=first, second=second, unchanged=unchanged, ray=ray_vars,
       marker_mode=marker["mode"], marker_shape=marker["vllm_shape"], reverted=reverted,
       linear_wrapper_is_shared=getattr(linear, SHARED, None) is getattr(shared, SHARED),
       wrapped_after=[k for k, v in snapshot().items() if type(v).__name__ == "FunctionWrapper"])
""", tmp_path, K3_AMD_OVERLAY="1", K3_AMD_OVERLAY_STRICT="1")
    assert res is not None, proc.stderr[-3000:]
    assert res["before_import"] is False
    assert res["first"] == EXPECTED_PATCHES[shape] == res["second"]
    assert res["unchanged"] == []
    assert res["ray"] == ["K3_AMD_OVERLAY", "K3_AMD_OVERLAY_MARKER_DIR", "K3_AMD_OVERLAY_STRICT"]
    assert (res["marker_mode"], res["marker_shape"]) == ("auto", shape)
    assert res["reverted"] == list(reversed(EXPECTED_PATCHES[shape]))
    assert res["wrapped_after"] == [] and res["linear_wrapper_is_shared"] is (shape == "plain_wrapper")
    assert res["unchanged"] == []
    assert f"k3-amd-overlay {k3_amd_overlay.__version__}: pid=" in proc.stderr + proc.stdout


@pytest.mark.any_release  # the child's command, `python -m vllm.model_executor.models.registry`, is 0.29-0.33's
def test_vllm_model_inspection_child_patches_nothing_and_leaves_no_marker(tmp_path):
    """vLLM's registry reads a model class's facts in a child (``_run_in_subprocess``) that loads the
    general plugins and exits: with the overlay on, the plugin runs there, patches nothing and writes
    no marker (it would be a stale file beside a server's live ones); the parent's marker stays."""
    proc, res = run_vllm_process("""
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.models.registry import _run_in_subprocess
def child_facts():
    import os, sys
    return os.getpid(), sorted(m for m in sys.modules if m.startswith("k3_amd_overlay"))
child, loaded = _run_in_subprocess(child_facts)
result(pid=os.getpid(), child=child, loaded=loaded, markers=sorted(os.listdir(os.environ["K3_AMD_OVERLAY_MARKER_DIR"])))
""", tmp_path, K3_AMD_OVERLAY="1")
    assert res is not None, proc.stderr[-3000:]
    assert res["child"] != res["pid"] and "k3_amd_overlay.plugin" in res["loaded"], res  # vLLM ran the plugin there
    assert "k3_amd_overlay.activation" not in res["loaded"], res
    assert res["markers"] == [f"{res['pid']}.json"], res


def test_stock_mode_disables_only_what_this_vllm_fuses_itself(shape, tmp_path):
    proc, res = run_vllm_process("""
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm.models.kimi_k3.amd.linear
import vllm.models.kimi_k3.amd.mtp
""" + ACTIVE + "result(applied=applied(), fusions=fusions())", tmp_path, K3_AMD_OVERLAY="stock")
    assert res is not None, proc.stderr[-3000:]
    assert res["applied"] == STOCK_PATCHES[shape]
    assert {f: s for f, (s, _) in res["fusions"].items()} == {
        "qkv_norm": "forced-stock", "qk_cache": "forced-stock", "absorb_qk_cache": "forced-stock"}


@pytest.mark.parametrize("variables,message", [
    ({"K3_AMD_OVERLAY": "yes"}, "K3_AMD_OVERLAY='yes' is not valid"),
    pytest.param({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_STRCT": "0"},
                 "unknown overlay variable(s) K3_AMD_OVERLAY_STRCT", marks=pytest.mark.any_release),
])
def test_bad_values_stop_vllm_startup(variables, message, tmp_path):
    proc, res = run_vllm_process("""
from vllm.plugins import load_general_plugins
load_general_plugins()
result(loaded=True)
""", tmp_path, **variables)
    assert res is None and proc.returncode != 0
    assert message in proc.stderr


DRIFT = {  # how to make each shape lose the anchors qkv_norm needs, in the source the probe reads
    "plain_wrapper": ("model_executor/layers/mla.py", "self.kv_a_layernorm(", "self.kv_norm("),
    "k3_norm_wrapper": ("models/kimi_k3/amd/mla.py", "_normalize_q_kv", "_normalise_q_kv"),
    "k3_decode_wrapper": ("models/kimi_k3/amd/mla.py", "_normalize_q_kv", "_normalise_q_kv"),
}
SIMULATE_SOURCE_DRIFT = """
from k3_amd_overlay.targets import sources
rel, old, new = {drift!r}
original_text = sources.VllmSources.text
def drifted(self, path):
    text = original_text(self, path)
    return text.replace(old, new) if text is not None and path == rel else text
sources.VllmSources.text = drifted
"""


@pytest.mark.parametrize("strict", ["1", "0"])
def test_source_drift_strict_raises_non_strict_refuses_that_fusion(shape, strict, tmp_path):
    proc, res = run_vllm_process(SIMULATE_SOURCE_DRIFT.format(drift=DRIFT[shape]) + """
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm.models.kimi_k3.amd.linear
""" + ACTIVE + "result(applied=applied(), fusions=fusions())", tmp_path, K3_AMD_OVERLAY="1",
                                 K3_AMD_OVERLAY_STRICT=strict)
    if strict == "1":
        assert res is None and proc.returncode != 0
        assert "OverlayActivationError" in proc.stderr and "lacks the anchors qkv_norm needs" in proc.stderr
        assert "K3_AMD_OVERLAY_STRICT=0" in proc.stderr and "vLLM 0." in proc.stderr
    else:
        assert res is not None, proc.stderr[-3000:]
        assert res["fusions"]["qkv_norm"][0] == "refused" and "lacks the anchors" in res["fusions"]["qkv_norm"][1]
        assert res["fusions"]["qk_cache"][0] == "pending"
        assert "k3_wrapper.normalize_q_kv" not in res["applied"]


def test_unrecognised_vllm_code_is_a_loud_error(tmp_path):
    proc, res = run_vllm_process(SIMULATE_SOURCE_DRIFT.format(
        drift=("models/kimi_k3/amd/linear.py", "class KimiMLAAttention", "class KimiMLAAttentionV2")) + """
from vllm.plugins import load_general_plugins
load_general_plugins()
result(loaded=True)
""", tmp_path, K3_AMD_OVERLAY="qk_cache")
    assert res is None and "does not recognise the K3 AMD code of vLLM" in proc.stderr


LIVE_DRIFT = """
import vllm.models.kimi_k3.amd.linear as linear
import vllm.model_executor.layers.mla as shared
k3 = getattr(linear, "KimiK3MultiHeadLatentAttentionWrapper", None)
if k3 is not None:
    del k3._normalize_q_kv  # the source still has it; the live class no longer does
else:
    from vllm.model_executor.custom_op import op_registry_oot
    base = shared.MultiHeadLatentAttentionWrapper
    op_registry_oot["MultiHeadLatentAttentionWrapper"] = type("OotWrapper", (base,), {})
before = dict(vars(k3)) if k3 is not None else dict(vars(linear))
from vllm.plugins import load_general_plugins
try:
    load_general_plugins()
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
after = dict(vars(k3)) if k3 is not None else dict(vars(linear))
""" + ACTIVE + """
result(error=error, untouched=all(after[k] is before[k] for k in before) and set(after) == set(before),
       applied=applied(), fusions=fusions(), plain=k3 is None)
"""
OOT_REFUSAL = ("vllm.models.kimi_k3.amd.linear:MultiHeadLatentAttentionWrapper: an out-of-tree replacement "
               "<class '__main__.OotWrapper'> is registered for MultiHeadLatentAttentionWrapper; every overlay "
               "patch reverted")


@pytest.mark.parametrize("strict", ["1", pytest.param("0", marks=pytest.mark.any_release)])
def test_live_drift_reverts_everything(strict, tmp_path):
    proc, res = run_vllm_process(LIVE_DRIFT, tmp_path, K3_AMD_OVERLAY="1", K3_AMD_OVERLAY_STRICT=strict)
    assert res is not None, proc.stderr[-3000:]
    assert res["untouched"] is True and res["applied"] == []
    if strict == "1":
        assert res["error"].startswith("OverlayActivationError") and "live anchor check failed" in res["error"]
        assert (OOT_REFUSAL in res["error"]) is res["plain"], res["error"]
    else:
        assert res["error"] is None
        assert {s for s, _ in res["fusions"].values()} == {"refused"}
        assert all((OOT_REFUSAL in reason) is res["plain"] for _, reason in res["fusions"].values()), res["fusions"]


def test_live_check_follows_the_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    markers = tmp_path / "markers"
    env.update(VLLM_TARGET_DEVICE="cpu", K3_AMD_OVERLAY="stock", K3_AMD_OVERLAY_MARKER_DIR=str(markers))
    server = subprocess.Popen([sys.executable, "-c", "from vllm.plugins import load_general_plugins; "
                               "load_general_plugins(); print('up', flush=True); import time; time.sleep(300)"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = iter(server.stdout.readline, "")
        assert any(line.strip() == "up" for line in lines)  # vLLM may log to stdout first
        check = [sys.executable, "-m", "k3_amd_overlay.commands.cli", "check", "--marker-dir", str(markers), "--expect"]
        live = subprocess.run([*check, "stock"], capture_output=True, text=True)
        assert ": 1 live, 0 stale, 0 unreadable" in live.stdout, live.stdout
        # live, but it built no model: no stock arm on its own (a worker may have run anything)
        assert live.returncode == 1 and "FAIL no live process has built a K3 MLA layer" in live.stdout, live.stdout
        fused = subprocess.run([*check, "fused"], capture_output=True, text=True)
        assert fused.returncode == 1 and "overlay in stock mode" in fused.stdout
    finally:
        server.kill()
        server.wait()
    time.sleep(0.1)
    gone = subprocess.run([*check, "stock"], capture_output=True, text=True)
    assert gone.returncode == 1 and "stale, ignored" in gone.stdout and ": 0 live, 1 stale" in gone.stdout


DOCTOR_TOP = {"versions", "gpu", "vllm_shape", "switch", "qk_cache_by_tp", "providers_here", "launch_configs",
              "self_test", "fusions", "ab_baseline", "verdict", "healthy", "patched", "evidence"}
IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]*$")


def keys_not_identifiers(value: object, path: str = "") -> list[str]:
    """Every key, at any depth, that is not a snake_case identifier of at most 32 characters."""
    if isinstance(value, dict):
        return [bad for k, v in value.items()
                for bad in ([f"{path}/{k}"] if not (IDENTIFIER.match(k) and len(k) <= 32) else [])
                + keys_not_identifiers(v, f"{path}/{k}")]
    if isinstance(value, list):
        return [bad for v in value for bad in keys_not_identifiers(v, path)]
    return []


def test_doctor_main_job_is_healthy(tmp_path):
    """README's first command: the doctor with the overlay on, on CPU with this vLLM, its self-test
    run for real: healthy, with a verdict; its JSON keys, the vLLM sections' and the self-test rows'
    among them, stable identifiers; no marker left behind (the doctor is no vLLM process)."""
    proc = run_doctor_process(tmp_path, "--json", K3_AMD_OVERLAY="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # one JSON object, no vLLM log line before it (vLLM 0.29 logs to stdout)
    assert report["healthy"] is True and report["verdict"].startswith("ready: ")
    assert "layer_check" not in report  # a layer is proved by `check` against real processes
    assert {p["key"] for p in report["patched"]} and "qkv_norm=pending" in report["evidence"]
    assert report["self_test"] and all(r["pass"] for r in report["self_test"] if r.get("ran"))
    assert DOCTOR_TOP <= set(report), sorted(report)
    assert set(report["providers_here"]) == {"qkv_norm", "qk_cache", "absorb_qk_cache", "absorb_qk_cache_fp8",
                                             "absorb_qk_cache_mxfp4"}
    assert set(report["qk_cache_by_tp"][0]) <= {"tp", "heads_per_rank", "kv_lora_rank_heads", "overlay",
                                                "upstream_fuses"}
    assert {"recognised", "releases", "fuses_by_itself", "known_defects"} <= set(report["vllm_shape"])
    assert keys_not_identifiers(report) == []
    assert not list((tmp_path / "markers").glob("*.json"))


def test_doctor_for_people_ends_with_its_verdict(tmp_path):
    """The text form: tables and sentences ending in the verdict line, for a fusion that cannot run
    here (the self-test run, its rows among the tables), stock, off and a mistyped switch (those
    three with the self-test left out: their verdict lines are what is asked)."""
    proc = run_doctor_process(tmp_path, K3_AMD_OVERLAY="1", K3_AMD_OVERLAY_QK_CACHE_PROVIDER="aiter")
    lines = proc.stdout.rstrip().splitlines()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1].startswith("not ready: qk_cache cannot fuse here: no provider can run here (aiter: ")
    assert "== self-test" in proc.stdout and "pass (identical" in proc.stdout
    assert "{" not in proc.stdout and "None" not in proc.stdout  # tables and sentences, no dict reprs
    stock = run_doctor_process(tmp_path, K3_AMD_OVERLAY="stock", self_test=False)
    assert stock.returncode == 0 and stock.stdout.rstrip().splitlines()[-1].startswith("ready (stock): ")
    off = run_doctor_process(tmp_path, self_test=False)
    assert off.returncode == 0 and off.stdout.rstrip().splitlines()[-1] == (
        "off: K3_AMD_OVERLAY is unset or 0, nothing is patched (vLLM runs as it is)")
    bad = run_doctor_process(tmp_path, K3_AMD_OVERLAY="fast", self_test=False)
    assert bad.returncode == 1 and bad.stdout.rstrip().splitlines()[-1].startswith(
        "not ready: K3_AMD_OVERLAY='fast' is not valid") and "Traceback" not in bad.stderr


def test_doctor_on_a_vllm_outside_the_range_says_why_without_a_traceback(tmp_path, monkeypatch):
    from k3_amd_overlay import activation
    from k3_amd_overlay.commands import doctor

    monkeypatch.setenv("K3_AMD_OVERLAY", "1")
    monkeypatch.setenv("K3_AMD_OVERLAY_MARKER_DIR", str(tmp_path / "markers"))
    monkeypatch.setattr(activation, "installed_vllm_version", lambda: "0.28.0")
    monkeypatch.setattr(activation, "_active", None)
    monkeypatch.setattr(doctor, "selftest", lambda device: [])
    report, healthy = doctor.run_doctor()
    assert not healthy and report["verdict"].startswith("not ready: k3-amd-overlay: vLLM 0.28.0 is outside the "
                                                        "supported range")
