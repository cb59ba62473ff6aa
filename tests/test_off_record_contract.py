"""The off record's contract: what ``build`` puts in it, entry by entry as its JSON carries it (each
fusion disabled with the reason naming the switch as it was given), the process's own identity, and
``current()``: None in a process where the plugin never ran, the record just written once it has."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time

from k3_amd_overlay import markers, off_record
from k3_amd_overlay.package import FUSIONS, __version__
from k3_amd_overlay.process_identity import process_role
from k3_amd_overlay.record import MarkerRecord
from k3_amd_overlay.settings import Mode, load_settings
from k3_amd_overlay.versions import installed_vllm_version


def disabled(switch: str) -> dict:
    return {"state": "disabled", "provider": None, "reason": f"overlay off (K3_AMD_OVERLAY={switch!r})", "layers": 0,
            "layer_states": {}, "effective": False, "effective_layers": 0,
            "runs": {"warmup": 0, "capture": 0, "served": 0, "replay": 0}, "captured_sizes": []}


def test_the_off_record_of_this_process_entry_by_entry(tmp_path):
    for switch in (" 0 ", ""):
        settings = load_settings({"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "m")})
        before = time.time()
        data = off_record.build(settings).to_json()
        assert before <= data["updated"] <= time.time()
        assert data["fusions"] == {f: disabled(switch) for f in FUSIONS}
        pid = os.getpid()
        assert {k: data[k] for k in ("pid", "mode", "switch", "start_ticks", "role", "process_name",
                                     "overlay_version", "vllm_version", "patches")} == {
            "pid": pid, "mode": Mode.OFF.value, "switch": switch, "start_ticks": markers.process_start_ticks(pid),
            "role": process_role(), "process_name": multiprocessing.current_process().name,
            "overlay_version": __version__, "vllm_version": installed_vllm_version(), "patches": []}
        assert set(data) == set(MarkerRecord(pid=pid, mode=Mode.OFF, fusions={}).to_json())


CURRENT = """
import json, os, sys
from k3_amd_overlay import off_record
from k3_amd_overlay.settings import load_settings
print("BEFORE=" + repr(off_record.current()))
written = off_record.leave(load_settings())
print("SAME=" + repr(off_record.current() is written))
print("AFTER=" + json.dumps(off_record.current().to_json()))
"""


def test_current_is_none_until_the_plugin_leaves_the_record_then_that_record(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    environ.update(K3_AMD_OVERLAY="0", K3_AMD_OVERLAY_MARKER_DIR=str(tmp_path / "m"))
    proc = subprocess.run([sys.executable, "-c", CURRENT], env=environ, capture_output=True, text=True, timeout=120)
    said = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert (proc.returncode, said["BEFORE"], said["SAME"]) == (0, "None", "True"), proc.stderr[-2000:]
    after = json.loads(said["AFTER"])
    assert after["fusions"] == {f: disabled("0") for f in FUSIONS}
    assert json.loads((tmp_path / "m" / f"{after['pid']}.json").read_text()) == after
