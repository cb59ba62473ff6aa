"""The overlay beside a real vLLM release newer than its declared range (scripts/run_tests.sh runs this
file in the venv of scripts/beyond-range-vllm.txt; in a venv inside the range it skips). A newer
release is the foreign code a user meets first: on (strict) stops startup naming the release and the
range; ``K3_AMD_OVERLAY_STRICT=0`` probes its code, patches nothing and refuses every fusion by the
anchor it did not find, and ``check`` then refuses a fused arm; off leaves vLLM's objects as they are."""

from __future__ import annotations

import os

import pytest
from cli_process import cli_command
from machine import HAS_VLLM
from packaging.version import Version
from vllm_support import ACTIVE, SNAPSHOT, run_doctor_process, run_vllm_process

from k3_amd_overlay.package import SUPPORTED_VLLM
from k3_amd_overlay.targets.shapes import FUSED_DECODE_PARAMS, K3_WRAPPER
from k3_amd_overlay.versions import SUPPORTED_SPECIFIER, in_supported_range, installed_vllm_version

INSTALLED = installed_vllm_version() if HAS_VLLM else None
BEYOND = INSTALLED is not None and not in_supported_range(INSTALLED) and all(  # out of range, above its floor
    Version(INSTALLED) >= Version(s.version) for s in SUPPORTED_SPECIFIER if s.operator.startswith(">"))

if os.environ.get("K3OVL_EXPECT_BEYOND") == "1" and not BEYOND:  # the job for it must not pass by skipping
    raise RuntimeError(f"K3OVL_EXPECT_BEYOND=1 but the installed vLLM ({INSTALLED}) is not newer than "
                       f"{SUPPORTED_VLLM}: update scripts/beyond-range-vllm.txt")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not BEYOND, reason=f"needs a vLLM newer than {SUPPORTED_VLLM} (installed: {INSTALLED}); scripts/run_tests.sh "
                       "runs this file in the venv of scripts/beyond-range-vllm.txt")]

LOAD = """
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm.models.kimi_k3.amd.linear, vllm.models.kimi_k3.amd.mla, vllm.models.kimi_k3.amd.mtp
"""
OUT_OF_RANGE = f"vLLM {INSTALLED} is outside the supported range ({SUPPORTED_VLLM})"
# What 0.34.0 lacks of the newest shape: _fused_decode with 0.32-0.33's parameters (0.34 dropped positions).
MISSING_DECODE_ANCHOR = (f"k3_decode_wrapper: missing models/kimi_k3/amd/mla.py: "
                         f"{K3_WRAPPER}._fused_decode{FUSED_DECODE_PARAMS}")


def test_on_stops_startup_naming_the_release_and_the_range(tmp_path):
    proc, res = run_vllm_process(LOAD + "result(loaded=True)", tmp_path, K3_AMD_OVERLAY="1")
    assert res is None and proc.returncode != 0, proc.stdout[-2000:]
    assert f"OverlayActivationError: k3-amd-overlay: {OUT_OF_RANGE}" in proc.stderr, proc.stderr[-3000:]
    assert "set K3_AMD_OVERLAY=0" in proc.stderr and "K3_AMD_OVERLAY_STRICT=0" in proc.stderr
    # the probe finds no shape in this release: non-strict is not offered as a way to serve fused
    assert "K3_AMD_OVERLAY_STRICT=0 would install nothing here" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "markers").exists() or not any((tmp_path / "markers").iterdir())


def test_non_strict_patches_nothing_refuses_every_fusion_and_check_refuses_a_fused_arm(tmp_path):
    markers = tmp_path / "markers"
    check = cli_command("check", "--marker-dir", str(markers), "--expect", "fused")
    proc, res = run_vllm_process(f"CHECK = {check!r}\n" + SNAPSHOT + """
before = snapshot()
""" + LOAD + ACTIVE + """
import subprocess, wrapt
checked = subprocess.run(CHECK, capture_output=True, text=True)  # while this process lives
result(changed=same(before, snapshot()), applied=applied(), fusions=fusions(), shape=act.shape,
       wrapped=[k for k, v in snapshot().items() if isinstance(v, wrapt.ObjectProxy)],
       check_rc=checked.returncode, check_out=checked.stdout + checked.stderr)
""", tmp_path, K3_AMD_OVERLAY="1", K3_AMD_OVERLAY_STRICT="0")
    assert res is not None, proc.stderr[-3000:]
    assert f"{OUT_OF_RANGE}; probing anyway (K3_AMD_OVERLAY_STRICT=0)" in proc.stderr
    assert res["changed"] == [] and res["wrapped"] == [] and res["applied"] == [], res
    assert res["shape"] is None
    assert set(res["fusions"]) == {"qkv_norm", "qk_cache", "absorb_qk_cache"}
    for fusion, (state, reason) in res["fusions"].items():
        assert state == "refused", (fusion, state)
        assert reason.startswith(f"k3-amd-overlay does not recognise the K3 AMD code of vLLM {INSTALLED} ("), reason
        assert MISSING_DECODE_ANCHOR in reason, reason  # the anchor it looked for, by file and signature
    assert res["check_rc"] == 1 and "DOES NOT HOLD: expect fused" in res["check_out"], res["check_out"]
    assert f"qkv_norm=refused at startup (k3-amd-overlay does not recognise the K3 AMD code of vLLM {INSTALLED}" \
        in res["check_out"], res["check_out"]


def test_off_leaves_vllm_as_it_is_and_records_the_release(tmp_path):
    proc, res = run_vllm_process(SNAPSHOT + """
before = snapshot()
""" + LOAD + """
import wrapt
marker_dir = os.environ["K3_AMD_OVERLAY_MARKER_DIR"]
result(changed=same(before, snapshot()), pid=os.getpid(),
       loaded=sorted(m for m in sys.modules if m.startswith("k3_amd_overlay")),
       markers={m: json.load(open(os.path.join(marker_dir, m))) for m in os.listdir(marker_dir)})
""", tmp_path, K3_AMD_OVERLAY="0")
    assert res is not None, proc.stderr[-3000:]
    assert res["changed"] == [] and "k3_amd_overlay.activation" not in res["loaded"], res
    record = res["markers"][f"{res['pid']}.json"]
    assert (record["mode"], record["vllm_version"], record["patches"]) == ("off", INSTALLED, [])


def test_doctor_is_not_ready_and_says_why(tmp_path):
    proc = run_doctor_process(tmp_path, self_test=False, K3_AMD_OVERLAY="1")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert OUT_OF_RANGE in proc.stdout, proc.stdout[-3000:]
