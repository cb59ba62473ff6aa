"""Evidence: the per-user marker directory, atomic writes under concurrency, liveness of the
processes behind markers, the effective hook, and the check verdicts."""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from records import SWITCH_OF, judge

from k3_amd_overlay import log_lines, marker_writes, markers, phases, process_hooks, run_counts
from k3_amd_overlay.evidence import Evidence, process_role
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.package import __version__
from k3_amd_overlay.record import LayerTally, MarkerRecord
from k3_amd_overlay.settings import Mode, load_settings

HOST = socket.gethostname()  # a record without a host is this machine's; check's lines name host and pid


def settings_for(tmp_path, switch="1"):
    return load_settings({"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "m")})


def test_marker_dir_is_created_private(tmp_path):
    directory = markers.ensure_marker_dir(tmp_path / "m")
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"


def test_symlinked_foreign_and_open_dirs_are_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(markers.MarkerDirError, match="is a symlink"):
        markers.ensure_marker_dir(tmp_path / "link")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(markers.MarkerDirError, match="writable by group or others"):
        markers.ensure_marker_dir(open_dir)
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 4242, 4242)
        with pytest.raises(markers.MarkerDirError, match="owned by uid 4242"):
            markers.ensure_marker_dir(foreign)


def test_unusable_marker_dir_is_reported_never_raised(tmp_path, emitted):
    (tmp_path / "m").symlink_to(tmp_path)
    evidence = Evidence(settings_for(tmp_path))
    evidence.publish()
    assert evidence.marker_path is None and "symlink" in evidence.marker_error
    assert emitted[-2][0] == logging.WARNING and "marker-error=" in emitted[-2][1]


def test_write_failure_is_reported_once_and_serving_goes_on(tmp_path, emitted):
    evidence = Evidence(settings_for(tmp_path))
    os.rmdir(tmp_path / "m")
    (tmp_path / "m").write_text("the directory went away")  # every later write fails (even as root)
    evidence.set_fusion("qk_cache", FusionState.REFUSED, "x")
    evidence.set_fusion("qk_cache", FusionState.REFUSED, "y")
    assert sum("marker write failed" in line for _, line in emitted) == 1
    assert evidence.fusion("qk_cache").reason == "y"


def _writer(directory: str, worker: int, go: multiprocessing.synchronize.Event) -> None:
    go.wait(60)
    for i in range(50):
        markers.write_marker(markers.Path(directory), 777, {"pid": 777, "worker": worker, "i": i, "pad": "x" * 5000})


def test_concurrent_writers_never_leave_a_torn_marker(tmp_path):
    directory = markers.ensure_marker_dir(tmp_path / "m")
    go = multiprocessing.Event()  # the writers start once the reader reads
    procs = [multiprocessing.Process(target=_writer, args=(str(directory), w, go)) for w in range(4)]
    seen: list = []
    while_writing = []

    def reader():  # reads until the writers end; a thread's exception would not fail the test by itself
        path = directory / "777.json"
        while True:
            writing = any(p.is_alive() for p in procs)
            if path.exists():
                try:
                    seen.append(json.loads(path.read_text())["pid"])
                    while_writing.append(writing)
                except Exception as torn:  # every failed read is a finding
                    seen.append(f"torn: {type(torn).__name__}: {torn}")
            if not writing:
                break

    for p in procs:
        p.start()
    thread = threading.Thread(target=reader)
    thread.start()
    go.set()
    for p in procs:
        p.join(120)
    thread.join(120)
    assert not thread.is_alive() and not any(p.is_alive() for p in procs)
    assert any(while_writing), "no read while a writer was writing: nothing was tested"
    assert seen and set(seen) == {777}
    assert [p.name for p in directory.iterdir()] == ["777.json"]  # no temp files left behind


def execute_model(run, *args):  # named as vLLM's worker and model runners name the step serving a batch
    return run(*args)


def test_effective_hook_records_once_and_counts_layers(tmp_path):
    evidence = Evidence(settings_for(tmp_path))
    hooks = [evidence.effective_hook("qk_cache", f"layer.{i}") for i in range(3)]
    for hook in hooks * 5:
        execute_model(hook, 4)
    evidence.flush()  # the fifth batch's count waits for the interval or the exit flush
    entry = MarkerRecord.from_json(json.loads(evidence.marker_path.read_text())).fusions["qk_cache"]
    assert entry.effective is True and entry.effective_layers == 3
    # batches are counted at one layer: 5 batches through 3 layers are 5 batches, not 15
    assert entry.runs == {"warmup": 0, "capture": 0, "served": 5, "replay": 0}


def _dummy_run(hook):  # named as vLLM's model runner names its own dummy batches
    hook(8)


def test_runs_are_counted_by_phase(tmp_path):
    evidence = Evidence(settings_for(tmp_path))
    hook = evidence.effective_hook("qkv_norm", "layer.0")
    _dummy_run(hook)
    _dummy_run(hook)
    execute_model(hook, 3)
    hook(3)  # outside any step of vLLM's: not shown to be served, so not counted as served
    entry = evidence.fusion("qkv_norm")
    assert entry.runs == {"warmup": 3, "capture": 0, "served": 1, "replay": 0}
    evidence.flush()
    assert json.loads(evidence.marker_path.read_text())["fusions"]["qkv_norm"]["runs"]["served"] == 1


def test_layer_decisions_set_state_and_flag_mixed(tmp_path):
    evidence = Evidence(settings_for(tmp_path))
    evidence.note_layer("qkv_norm", LayerDecision(FusionState.APPLIED, "triton", "ok"))
    evidence.note_layer("qkv_norm", LayerDecision(FusionState.APPLIED, "triton", "ok"))
    assert evidence.fusion("qkv_norm").layers == 2 and evidence.fusion("qkv_norm").provider == "triton"
    evidence.note_layer("qkv_norm", LayerDecision(FusionState.REFUSED, None, "no provider"))
    assert evidence.fusion("qkv_norm").reason.startswith("mixed across layers")
    assert evidence.fusion("qkv_norm").layer_states == {
        FusionState.APPLIED: LayerTally(2, "ok"), FusionState.REFUSED: LayerTally(1, "no provider")}


def test_layer_summary_warns_when_a_requested_fusion_fuses_on_no_layer(tmp_path):
    evidence = Evidence(settings_for(tmp_path))
    for _ in range(2):
        evidence.note_layer("qk_cache", LayerDecision(FusionState.REFUSED, None, "kv cache dtype 'auto'"))
        evidence.note_layer("qkv_norm", LayerDecision(FusionState.APPLIED, "reference", "forced"))
    lines = dict((line.split("=")[0], (level, line)) for level, line in evidence.layer_summary())
    assert lines["qk_cache"] == (logging.WARNING, "qk_cache=refused on 2/2 layers (kv cache dtype 'auto') "
                                 "-- requested but fused on no layer: this process runs it stock")
    assert lines["qkv_norm"] == (logging.INFO, "qkv_norm=applied on 2/2 layers (forced)")


def test_layer_summary_says_a_fusion_refused_after_its_layers_were_decided(tmp_path):
    """A kernel that fails at load refuses the fusion after the layers took it: the summary said
    "applied on 3/3 layers" at INFO, beside the earlier ERROR; it says the refusal, as a WARNING."""
    evidence = Evidence(settings_for(tmp_path))
    for _ in range(3):
        evidence.note_layer("qkv_norm", LayerDecision(FusionState.APPLIED, "triton", "forced by setting"))
    evidence.set_fusion("qkv_norm", FusionState.REFUSED, "its kernel failed on this GPU")
    assert evidence.layer_summary() == [(logging.WARNING, "qkv_norm=applied on 3/3 layers (forced by setting) -- then "
                                                          "refused: its kernel failed on this GPU: the overlay's "
                                                          "launch runs on none of them")]


@pytest.mark.parametrize("argv,name,role", [
    (["/venv/bin/vllm", "serve", "model"], "MainProcess", "api-server"),
    (["/venv/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py", "--model", "m"],
     "MainProcess", "api-server"),
    (["/venv/bin/vllm", "serve", "model"], "EngineCore_DP0", "engine-core"),
    (["/venv/bin/vllm", "serve", "model"], "VllmWorker-0", "worker"),
    (["/venv/bin/vllm", "serve", "model"], "ApiServer_1", "api-server"),
    (["/venv/bin/vllm", "bench", "serve", "--model", "m"], "MainProcess", "cli-client"),
    (["/venv/bin/vllm", "--version"], "MainProcess", "cli-client"),
    (["/venv/bin/vllm", "collect-env"], "MainProcess", "cli-client"),
    (["/venv/bin/vllm", "bench", "throughput", "--model", "m"], "MainProcess", "main"),
    (["script.py"], "MainProcess", "main"),
    # `python -m vllm.entrypoints.cli.main ...`: argv[0] is the module's file
    (["/venv/lib/python3.11/site-packages/vllm/entrypoints/cli/main.py", "serve", "m"], "MainProcess", "api-server"),
    (["/venv/lib/python3.11/site-packages/vllm/entrypoints/cli/main.py", "bench", "serve"], "MainProcess",
     "cli-client"),
])
def test_process_roles(argv, name, role):
    assert process_role(argv, name) == role


def record(mode, qkv, qk, effective=True, pid=1, layers=2, served=3, captured=(), warmup=5, role="worker",
           replayed=0):
    runs = {"warmup": warmup if effective else 0, "capture": len(captured), "served": served if effective else 0,
            "replay": replayed}
    entry = {"provider": "triton", "reason": "r", "effective": effective, "layers": layers,
             "runs": runs, "captured_sizes": list(captured)}
    return {"pid": pid, "role": role, "vllm_version": "0.33.0", "mode": mode, "overlay_version": __version__,
            "switch": SWITCH_OF[mode],
            "fusions": {"qkv_norm": {"state": qkv, **entry}, "qk_cache": {"state": qk, **entry}}}


@pytest.mark.parametrize("records,expect,holds", [
    ([record("auto", "applied", "upstream")], "fused", True),
    ([record("auto", "applied", "upstream", effective=False)], "fused", False),
    ([record("auto", "applied", "upstream", served=0)], "fused", False),  # warm-up batches only
    # a capture alone happens at startup, before any request: it proves nothing (issue 19, fault 4)
    ([record("auto", "applied", "upstream", served=0, captured=(1, 2, 4))], "fused", False),
    ([record("auto", "applied", "upstream", served=0, captured=(1, 2, 4), replayed=7)], "fused", True),
    ([record("auto", "applied", "upstream", served=0, captured=(1, 2, 4), warmup=3)], "fused", False),
    ([record("auto", "applied", "refused")], "fused", False),
    ([record("auto", "pending", "pending", layers=0, effective=False, role="api-server"),
      record("auto", "applied", "applied", pid=2)], "fused", True),
    ([record("auto", "pending", "pending", layers=0, effective=False, role="api-server")], "fused", False),
    ([record("stock", "forced-stock", "forced-stock", layers=0, effective=False, role="api-server"),
      record("auto", "applied", "applied", pid=2)], "fused", False),
    ([record("off", "disabled", "disabled")], "fused", False),
    ([record("off", "disabled", "disabled")], "stock", False),
    ([record("stock", "forced-stock", "forced-stock", effective=False)], "stock", True),
    ([record("stock", "forced-stock", "forced-stock", effective=False),
      record("auto", "applied", "applied", pid=2)], "stock", False),
    ([record("auto", "applied", "applied")], "stock", False),
    ([], "fused", False), ([], "stock", False),
])
def test_check_verdicts(records, expect, holds):
    assert judge(records, expect, ["qkv_norm", "qk_cache"], require_effective=True).holds is holds


def test_check_says_what_it_proved():
    lines = judge([record("auto", "applied", "upstream", served=7, captured=(1, 2), replayed=40)], "fused",
                  ["qk_cache"], require_effective=True).lines
    assert lines[-1] == (f"ok   qk_cache: served traffic took the fused path: 40 replays of the 2 graphs (host {HOST} "
                         f"pid 1: sizes 1, 2) that recorded it, for served batches (host {HOST} pid 1: 40); 7 eager "
                         f"batches after startup (host {HOST} pid 1: 7)")
    lines = judge([record("auto", "applied", "upstream", served=0)], "fused", ["qk_cache"],
                  require_effective=True).lines
    assert lines[-1].startswith("FAIL qk_cache: its fused path ran only in vLLM's own warm-up batches (5)")


def test_a_server_with_graphs_that_served_no_request_fails_with_that_reason():
    """Issue 19, fault 4: captures happen at startup; before the first request nothing was served."""
    lines = judge([record("auto", "applied", "applied", served=0, captured=(1, 2, 4))], "fused", ["qk_cache"],
                  require_effective=True).lines
    assert lines[-1] == (f"FAIL qk_cache: captured into 3 graphs (host {HOST} pid 1: sizes 1, 2, 4) at startup, but "
                         "no served batch has run it yet (no replay of those graphs, no eager batch): send a request "
                         "(a decode step) first")


def test_check_reads_live_markers_and_ignores_dead_ones(tmp_path):
    directory = markers.ensure_marker_dir(tmp_path / "m")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    markers.write_marker(directory, dead.pid, {**record("auto", "applied", "applied", pid=dead.pid),
                                               "start_ticks": 1})
    markers.write_marker(directory, os.getpid(), {**record("stock", "forced-stock", "forced-stock", False,
                                                           pid=os.getpid()),
                                                  "start_ticks": markers.process_start_ticks(os.getpid())})
    (directory / "junk.json").write_text("{not json")
    from k3_amd_overlay.commands.cli import main

    assert main(["check", "--expect", "stock", "--marker-dir", str(directory)]) == 0
    assert main(["check", "--expect", "fused", "--marker-dir", str(directory)]) == 1


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(phases.WARMUP_FRAMES))
def test_each_warm_up_name_is_a_method_of_vllms_workers_and_marks_a_warm_up_batch(name):
    """Every name the phase test looks for is a method vLLM's model runners, workers or drafters define
    (0.29-0.33, read from the installed source), and a batch run under it counts as warm-up."""
    import pathlib

    import vllm

    v1 = pathlib.Path(vllm.__file__).parent / "v1"
    defined = any(f"def {name}(" in path.read_text() for folder in ("worker", "spec_decode")
                  for path in (v1 / folder).rglob("*.py"))
    assert defined, f"{name} is not a method of this vLLM's workers or drafters"

    def batch_runner():
        return phases.current_phase()

    runner = types.FunctionType(batch_runner.__code__.replace(co_name=name), batch_runner.__globals__)
    assert execute_model(runner) is phases.Phase.WARMUP  # a step of vLLM's own inside the served step's method
    assert execute_model(batch_runner) is phases.Phase.SERVED
    assert batch_runner() is phases.Phase.WARMUP  # no step at all: not served


def test_the_proof_line_sums_processes_and_names_each():
    """Two worker processes: graphs and eager batches listed per process and summed, and the
    absorbed launch's runs counted for qk_cache, said so."""
    one = record("auto", "applied", "applied", pid=1, served=3, captured=(1, 2), replayed=6)
    two = record("auto", "applied", "applied", pid=2, served=5, captured=(4,), replayed=1)
    two["fusions"]["absorb_qk_cache"] = {**two["fusions"]["qk_cache"], "captured_sizes": [], "runs": {
        "warmup": 0, "capture": 0, "served": 2, "replay": 0}}
    lines = judge([one, two], "fused", ["qk_cache"], require_effective=True).lines
    one_, two_ = f"host {HOST} pid 1", f"host {HOST} pid 2"
    assert lines[-1] == (f"ok   qk_cache: served traffic took the fused path: 7 replays of the 3 graphs ({one_}: sizes "
                         f"1, 2; {two_}: sizes 4) that recorded it, for served batches ({one_}: 6, {two_}: 1); 10 "
                         f"eager batches after startup ({one_}: 3, {two_}: 5, {two_} in the absorb_qk_cache launch: 2)")


@pytest.mark.parametrize("served,captured,replayed,text", [
    (1, (8,), 1, f"1 replay of the 1 graph (host {HOST} pid 1: sizes 8) that recorded it, for served batches (host "
                 f"{HOST} pid 1: 1); 1 eager batch after startup (host {HOST} pid 1: 1)"),
    (2, (), 0, f"2 eager batches after startup (host {HOST} pid 1: 2)"),
])
def test_the_proof_line_counts_in_words(served, captured, replayed, text):
    lines = judge([record("auto", "applied", "applied", served=served, captured=captured, replayed=replayed)], "fused",
                  ["qk_cache"], require_effective=True).lines
    assert lines[-1] == f"ok   qk_cache: served traffic took the fused path: {text}"


def test_warm_up_batches_are_summed_over_processes():
    records = [record("auto", "applied", "applied", pid=p, served=0, warmup=w) for p, w in ((1, 3), (2, 4))]
    lines = judge(records, "fused", ["qk_cache"], require_effective=True).lines
    assert lines[-1].startswith("FAIL qk_cache: its fused path ran only in vLLM's own warm-up batches (7)")


def test_pending_holds_only_for_a_static_check():
    """A fusion patched but not yet decided (no layer built) proves nothing about a running server:
    only ``--static`` accepts it."""
    rec = record("auto", "pending", "pending", layers=0, effective=False)
    assert judge([rec], "fused", ["qk_cache"], require_effective=False, static=True).holds
    assert not judge([rec], "fused", ["qk_cache"], require_effective=False).holds


def test_a_fusion_asked_for_but_missing_from_a_record_fails_by_name():
    verdict = judge([record("auto", "applied", "applied")], "fused", ["absorb_qk_cache"], require_effective=False)
    assert not verdict.holds
    assert "absorb_qk_cache=disabled (not in this process's record)" in verdict.lines[0]


def test_the_verdict_lines_word_for_word():
    """No process, a process with the overlay off (named, then the next one still judged), and a CLI
    client's record (left out: it never builds a model)."""
    assert judge([], "fused", None, require_effective=True).lines == [
        "FAIL no live vLLM process has left overlay evidence (is the server up, the plugin installed, "
        "K3_AMD_OVERLAY set, the marker directory the same?)"]
    off = record("off", "disabled", "disabled", pid=7)
    stock = record("stock", "forced-stock", "forced-stock", effective=False, pid=8)
    lines = judge([off, stock], "stock", ["qk_cache"], require_effective=True).lines
    assert lines == [f"FAIL host {HOST} pid 7 (worker, vLLM 0.33.0): overlay off: proves neither fused nor stock",
                     f"ok   host {HOST} pid 8 (worker, vLLM 0.33.0): qk_cache=forced-stock provider=triton on 2 "
                     "layers (r)"]
    client = {**off, "role": "cli-client", "pid": 9}
    assert judge([client, record("auto", "applied", "applied")], "fused", ["qk_cache"], require_effective=True).holds


def test_a_process_without_layers_under_expect_fused_word_for_word():
    """An api-server (no K3 MLA layer) is fine when the overlay is on, named when it is in stock
    mode; a fusion on one layer is "1 layer"."""
    server = record("auto", "pending", "pending", layers=0, effective=False, role="api-server", pid=4)
    stock = record("stock", "forced-stock", "forced-stock", layers=0, effective=False, role="api-server", pid=5)
    worker = record("auto", "applied", "applied", pid=6, layers=1)
    lines = judge([server, stock, worker], "fused", ["qkv_norm", "qk_cache"], require_effective=True).lines
    assert lines[:4] == [
        f"ok   host {HOST} pid 4 (api-server, vLLM 0.33.0): overlay on (qkv_norm, qk_cache); builds no K3 MLA layer, "
        "nothing to fuse here",
        f"FAIL host {HOST} pid 5 (api-server, vLLM 0.33.0): overlay in stock mode",
        f"ok   host {HOST} pid 6 (worker, vLLM 0.33.0): qkv_norm=applied provider=triton on 1 layer (r)",
        f"ok   host {HOST} pid 6 (worker, vLLM 0.33.0): qk_cache=applied provider=triton on 1 layer (r)",
    ]


def test_a_process_without_layers_whose_fusions_were_refused_at_startup_fails():
    """Refused at activation (vLLM's code not recognised, an anchor missing) is a fact of the install:
    a process that built no layer but refused a fusion is no part of a fused arm, whatever its workers
    recorded (on vLLM 0.34 with K3_AMD_OVERLAY_STRICT=0 every process refuses every fusion)."""
    server = record("auto", "refused", "pending", layers=0, effective=False, role="api-server", pid=4)
    server["fusions"]["qkv_norm"]["reason"] = "k3-amd-overlay does not recognise the K3 AMD code of vLLM 0.34.0"
    worker = record("auto", "applied", "applied", pid=6, layers=1)
    verdict = judge([server, worker], "fused", ["qkv_norm", "qk_cache"], require_effective=True)
    assert not verdict.holds
    assert verdict.lines[0] == (f"FAIL host {HOST} pid 4 (api-server, vLLM 0.33.0): qkv_norm=refused at startup "
                                "(k3-amd-overlay does not recognise the K3 AMD code of vLLM 0.34.0)")
    assert not any("nothing to fuse here" in line for line in verdict.lines)


def test_mixed_stock_ran_and_unproved_verdict_lines_word_for_word():
    split = record("auto", "applied", "applied", pid=3, layers=24, served=0, warmup=0, effective=False)
    split["fusions"]["qk_cache"]["layer_states"] = {"applied": {"layers": 1, "reason": "triton"},
                                                    "refused": {"layers": 23, "reason": "x"}}
    who = f"host {HOST} pid 3 (worker, vLLM 0.33.0)"
    mixed = (f"{who}: qk_cache=applied provider=triton on 24 layers (r); mixed across layers: "
             "applied on 1/24 (triton), refused on 23/24 (x)")
    assert judge([split], "fused", ["qk_cache"], require_effective=True).lines == [
        f"FAIL {mixed} (pass --allow-mixed to accept a partly fused process)",
        "FAIL qk_cache: no process has run its fused path yet (send a request first, or pass --no-effective)"]
    assert judge([split], "fused", ["qk_cache"], require_effective=False, allow_mixed=True).lines == [f"ok   {mixed}"]
    warm = record("auto", "applied", "applied", pid=3, served=0, warmup=4)
    assert judge([warm], "fused", ["qk_cache"], require_effective=True).lines[-1] == (
        "FAIL qk_cache: its fused path ran only in vLLM's own warm-up batches (4), which proves nothing about "
        "served traffic; send a request (a decode step) first")
    ran = record("stock", "forced-stock", "forced-stock", pid=3, served=2)
    assert judge([ran], "stock", ["qk_cache"], require_effective=True).lines == [
        f"FAIL {who}: qk_cache=forced-stock provider=triton on 2 layers (r); its fused path ran"]
    server = record("auto", "pending", "pending", layers=0, effective=False, role="api-server", pid=4)
    assert judge([server], "fused", ["qk_cache"], require_effective=False).lines == [
        f"ok   host {HOST} pid 4 (api-server, vLLM 0.33.0): overlay on (qk_cache); builds no K3 MLA layer, nothing to "
        "fuse here",
        "FAIL no live process has built a K3 MLA layer (is the model loaded in a process that shares this "
        "marker directory?)"]


def test_only_a_static_check_accepts_a_pending_fusion_and_never_a_refused_one():
    pending = record("auto", "pending", "pending", effective=False)
    refused = record("auto", "refused", "refused", effective=False)
    assert not judge([pending], "fused", ["qk_cache"], require_effective=False).holds
    assert judge([pending], "fused", ["qk_cache"], require_effective=False, static=True).holds
    assert not judge([refused], "fused", ["qk_cache"], require_effective=False, static=True).holds


def test_a_fresh_record_serialises_with_its_defaults_and_schema_2():
    """The marker's schema number and every default, as a reader of old and new markers sees them."""
    from k3_amd_overlay.record import FusionEntry
    from k3_amd_overlay.settings import Mode

    assert (LayerTally().layers, LayerTally().reason) == (0, "")
    entry = FusionEntry(FusionState.PENDING)
    assert entry.to_json() == {"state": "pending", "provider": None, "reason": "", "layers": 0, "layer_states": {},
                               "effective": False, "effective_layers": 0,
                               "runs": {"warmup": 0, "capture": 0, "served": 0, "replay": 0}, "captured_sizes": []}
    record = MarkerRecord(pid=3, mode=Mode.AUTO, fusions={"qk_cache": entry})
    data = record.to_json()
    assert data["schema"] == 2 and data["mode"] == "auto" and data["fusions"]["qk_cache"] == entry.to_json()
    assert MarkerRecord.from_json(data) == record


def test_the_default_marker_directory(tmp_path, monkeypatch):
    """Under XDG_RUNTIME_DIR where that directory exists, else a per-user directory in the temp dir."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert markers.default_marker_dir() == tmp_path / "k3-amd-overlay"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "absent"))
    import tempfile

    assert markers.default_marker_dir() == Path(tempfile.gettempdir()) / f"k3-amd-overlay-{os.getuid()}"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert markers.default_marker_dir() == Path(tempfile.gettempdir()) / f"k3-amd-overlay-{os.getuid()}"
    nested = markers.ensure_marker_dir(tmp_path / "a" / "b")  # parents made too
    assert nested.is_dir()


@pytest.mark.parametrize("mode,refused", [(0o700, False), (0o711, False), (0o701, False), (0o720, True),
                                          (0o702, True), (0o770, True)])
def test_only_group_or_other_write_permission_is_refused(tmp_path, mode, refused):
    directory = tmp_path / "m"
    directory.mkdir()
    os.chmod(directory, mode)
    if refused:
        with pytest.raises(markers.MarkerDirError) as err:
            markers.ensure_marker_dir(directory)
        assert str(err.value) == (f"marker directory {directory} is writable by group or others "
                                  f"(mode {mode:o}); chmod 700 it")
    else:
        assert markers.ensure_marker_dir(directory) == directory


def test_each_marker_directory_error_in_full(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(markers.MarkerDirError) as err:
        markers.ensure_marker_dir(tmp_path / "link")
    assert str(err.value) == f"marker directory {tmp_path / 'link'} is a symlink; refusing to follow it"
    (tmp_path / "file").write_text("x")
    with pytest.raises(markers.MarkerDirError) as err:
        markers.ensure_marker_dir(tmp_path / "file" / "sub")
    assert str(err.value).startswith(f"cannot create marker directory {tmp_path / 'file' / 'sub'}: ")
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 4242, 4242)
        with pytest.raises(markers.MarkerDirError) as err:
            markers.ensure_marker_dir(foreign)
        assert str(err.value) == (f"marker directory {foreign} is owned by uid 4242, not this user (0); "
                                  "set K3_AMD_OVERLAY_MARKER_DIR to a directory you own")



def _marker_dir_case(tmp_path: Path, kind: str) -> tuple[Path, str | None]:
    """A marker directory setting of one kind, and the refusal the server gives it (None: usable)."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "file").write_text("x")
    cases = {
        "missing": (tmp_path / "new" / "m", None),
        "private": (real, None),
        "file": (tmp_path / "file", f"marker directory {tmp_path / 'file'} is not a directory"),
        "open": (tmp_path / "open", f"marker directory {tmp_path / 'open'} is writable by group or others (mode 777); "
                                    "chmod 700 it"),
        "symlink": (tmp_path / "link", f"marker directory {tmp_path / 'link'} is a symlink; refusing to follow it"),
        "under a file": (tmp_path / "file" / "m", f"cannot create marker directory {tmp_path / 'file' / 'm'}: "),
    }
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    (tmp_path / "link").symlink_to(real)
    return cases[kind]


def test_a_forgeable_directory_of_another_owner_is_named_by_what_decided_it(tmp_path: Path, monkeypatch) -> None:
    """A group-writable directory of another user reads "writable" (what decided it, whoever owns it),
    not the server's first reason ("owned by uid ..."). A private one of another user: root checking the
    vLLM user's markers may read it (each marker's owner is checked against its process's); a checker
    that is not root may not, as the server of that user refuses it (another user may have put anything
    there)."""
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir()
    shared.chmod(0o770)
    private.mkdir(mode=0o700)
    owner = os.stat(tmp_path).st_uid
    monkeypatch.setattr(markers.os, "getuid", lambda: owner + 1)
    assert markers.forgeable(shared) == (f"marker directory {shared} is writable by group or others (mode 770); "
                                         "chmod 700 it")
    assert markers.forgeable(private) == markers.marker_dir_refusal(str(private)) == (
        f"marker directory {private} is owned by uid {owner}, not this user ({owner + 1}); set "
        "K3_AMD_OVERLAY_MARKER_DIR to a directory you own")
    monkeypatch.setattr(markers.os, "getuid", lambda: 0)  # root
    assert markers.forgeable(private) is None
    assert markers.forgeable(shared).endswith("is writable by group or others (mode 770); chmod 700 it")


def test_a_check_by_another_user_than_the_directorys_owner_does_not_hold(tmp_path: Path, monkeypatch, capsys) -> None:
    """Another user squats the checker's marker directory (its default one under a shared /tmp) and plants
    a record naming the checker's live vLLM process: a checker that is not root fails, as its own vLLM
    processes refuse to write there."""
    from k3_amd_overlay.commands.cli import main

    directory = tmp_path / "m"
    directory.mkdir(mode=0o700)
    markers.write_marker(directory, os.getpid(), record("auto", "applied", "applied", pid=os.getpid())
                         | {"start_ticks": markers.process_start_ticks(os.getpid())})
    owner = os.stat(directory).st_uid
    monkeypatch.setattr(markers.os, "getuid", lambda: owner + 1)  # the checker: another user, not root
    monkeypatch.setattr(markers, "process_uid", lambda pid: owner, raising=False)  # its owner wrote the file
    assert main(["check", "--expect", "fused", "--marker-dir", str(directory)]) == 1
    assert (f"FAIL marker directory {directory} is owned by uid {owner}, not this user ({owner + 1}); set "
            "K3_AMD_OVERLAY_MARKER_DIR to a directory you own: no vLLM process of this overlay run by this user "
            "writes its marker there, and another user could have written any of it: nothing read there is "
            "evidence") in capsys.readouterr().out


def _runs_as(pid: int) -> int:
    return os.stat(f"/proc/{pid}").st_uid


def _another_users_live_process() -> tuple[int, int]:
    """A live process here and a uid other than the one it runs as: this one (a file chowned away
    from it needs root), else pid 1 (init runs as root)."""
    if os.getuid() == 0:
        return os.getpid(), 4242
    try:
        init_runs_as = _runs_as(1)
    except OSError:  # /proc mounted with hidepid
        init_runs_as = os.getuid()
    if init_runs_as == os.getuid():
        pytest.skip("no process of another user to name here")
    return 1, os.getuid()


def test_a_marker_owned_by_another_user_than_its_process_is_foreign_and_fails_check(tmp_path, capsys):
    """A record naming a live process (its start time is world-readable) in a file that another user
    owns: no writer of that process left it. It proves nothing and the check fails, as on an unreadable
    marker of a live process; the same record in a file its process's user owns holds."""
    from k3_amd_overlay.commands.cli import main

    pid, other = _another_users_live_process()
    directory = tmp_path / "m"
    directory.mkdir(mode=0o700)
    path = markers.write_marker(directory, pid, record("auto", "applied", "applied", pid=pid)
                                | {"start_ticks": markers.process_start_ticks(pid), "host": HOST})
    owner, runs_as = os.stat(path).st_uid, _runs_as(pid)
    if owner == runs_as:
        os.chown(path, other, other)
        owner = other
    assert main(["check", "--expect", "fused", "--marker-dir", str(directory)]) == 1
    out = capsys.readouterr().out
    (found,) = markers.read_markers(directory)
    assert found.live and found.foreign == f"owned by uid {owner}, but pid {pid} runs as uid {runs_as}: another " \
                                           "user wrote it"
    assert (f"note {path}: owned by uid {owner}, but pid {pid} runs as uid {runs_as}: another user wrote it; it "
            "proves nothing (left in place)") in out
    assert (f"FAIL {path}: names pid {pid}, which runs on this host, but it is not that process's marker (owned by "
            f"uid {owner}, but pid {pid} runs as uid {runs_as}: another user wrote it): what it ran is unknown "
            "(remove the file if it is a copy or not yours)") in out
    assert "DOES NOT HOLD: expect fused (0 processes)" in out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: a process and files of another user")
def test_root_checks_the_markers_of_the_user_vllm_runs_as(tmp_path, capsys):
    """Root checking a directory of the user vLLM runs as, whose marker that user's live process wrote
    (the owners match): it holds."""
    from k3_amd_overlay.commands.cli import main

    user = subprocess.Popen(["sleep", "60"], user=4242, group=4242)
    try:
        directory = tmp_path / "m"
        directory.mkdir(mode=0o700)
        path = markers.write_marker(directory, user.pid, record("off", "disabled", "disabled", pid=user.pid)
                                    | {"start_ticks": markers.process_start_ticks(user.pid)})
        os.chown(path, 4242, 4242)
        os.chown(directory, 4242, 4242)
        assert _runs_as(user.pid) == 4242
        assert main(["check", "--expect", "off", "--marker-dir", str(directory)]) == 0, capsys.readouterr().out
    finally:
        user.kill()
        user.wait()


def test_a_copy_of_a_marker_is_foreign_and_never_counts_its_process_twice(tmp_path, capsys):
    """A copy of a live process's marker under another name (backup.json) is not the marker its writer
    left (``<pid>.json``): it proves nothing, the process counts once (its batches once), and the
    check fails while the copy names a live process."""
    from k3_amd_overlay.commands.cli import main

    directory = markers.ensure_marker_dir(tmp_path / "m")
    path = markers.write_marker(directory, os.getpid(), record("auto", "applied", "applied", pid=os.getpid())
                                | {"start_ticks": markers.process_start_ticks(os.getpid())})
    shutil.copy(path, directory / "backup.json")
    assert main(["check", "--expect", "fused", "--marker-dir", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "6 eager batches" not in out and "3 eager batches" in out, out
    assert f"note {directory / 'backup.json'}: named backup.json, but the marker of pid {os.getpid()} is named " \
           f"{os.getpid()}.json: a copy or a file written by hand, not that process's marker; it proves nothing" in out
    assert out.endswith("DOES NOT HOLD: expect fused (1 process)\n"), out
    (directory / "backup.json").unlink()
    assert main(["check", "--expect", "fused", "--marker-dir", str(directory)]) == 0
    assert capsys.readouterr().out.endswith("HOLDS: expect fused (1 process)\n")


def test_a_process_with_two_records_counts_once_and_records_that_differ_fail():
    one = record("auto", "applied", "applied", pid=7)
    verdict = judge([one, dict(one)], "fused", ["qk_cache"], require_effective=True)
    assert verdict.holds and f"info host {HOST} pid 7: 2 copies of its record, counted once" in verdict.lines
    assert verdict.lines[-1].endswith(f"3 eager batches after startup (host {HOST} pid 7: 3)"), verdict.lines
    verdict = judge([one, record("auto", "applied", "applied", pid=7, served=9)], "fused", ["qk_cache"],
                    require_effective=True)
    assert not verdict.holds
    assert f"FAIL host {HOST} pid 7: 2 records of one process that differ: which one is its own is unknown" in \
        verdict.lines
    assert verdict.lines[-1].endswith(f"3 eager batches after startup (host {HOST} pid 7: 3)"), verdict.lines


@pytest.mark.parametrize("kind", ["missing", "private", "file", "open", "symlink", "under a file"])
def test_the_marker_directory_is_judged_by_the_servers_rule_without_creating_it(tmp_path: Path, kind: str) -> None:
    """``marker_dir_refusal`` (what doctor and ``check --static`` judge) refuses exactly what
    ``ensure_marker_dir`` (what a vLLM process calls) refuses, in its words, and creates nothing: a
    missing directory that would be created is usable."""
    path, refusal = _marker_dir_case(tmp_path, kind)
    said = markers.marker_dir_refusal(path)
    assert not (tmp_path / "new").exists()
    if refusal is None:
        assert said is None and markers.ensure_marker_dir(path) == path
        return
    assert said is not None and said.startswith(refusal), said
    with pytest.raises(markers.MarkerDirError) as err:
        markers.ensure_marker_dir(path)
    assert str(err.value).startswith(refusal) and said.split(": ")[0] == str(err.value).split(": ")[0]


def test_a_marker_is_sorted_json_and_leaves_no_temporary_file(tmp_path):
    directory = markers.ensure_marker_dir(tmp_path / "m")
    path = markers.write_marker(directory, 12, {"b": 1, "a": 2, "pid": 12})
    assert path == directory / "12.json" and path.read_text() == '{"a": 2, "b": 1, "pid": 12}'
    assert sorted(p.name for p in directory.iterdir()) == ["12.json"]


def test_markers_are_rewritten_at_powers_of_two_then_at_most_every_interval(tmp_path, monkeypatch):
    """Counting a served batch must not rewrite the marker every time (a file write per decode step):
    at counts 1, 2, 4, 8 ..., a new captured size, or MARKER_INTERVAL_S after the last write."""
    evidence = Evidence(settings_for(tmp_path))
    writes = []
    real_write = markers.write_marker
    monkeypatch.setattr(markers, "write_marker", lambda *a: writes.append(a) or real_write(*a))
    clock = [1000.0]
    monkeypatch.setattr(marker_writes.time, "monotonic", lambda: clock[0])
    hook = evidence.effective_hook("qk_cache", "layer.0")
    for _ in range(9):
        hook(4)
    assert len(writes) == 4  # batches 1 (first run), 2, 4, 8
    clock[0] += marker_writes.MARKER_INTERVAL_S  # the interval passed: the next batch writes
    hook(4)
    assert len(writes) == 5
    hook(4)  # batch 11, just after a write
    assert len(writes) == 5
    monkeypatch.setattr(run_counts, "current_phase", lambda: phases.Phase.CAPTURE)
    hook(16)
    hook(8)
    hook(16)  # a size seen already: count 3, not a power of two
    assert len(writes) == 7 and evidence.fusion("qk_cache").captured_sizes == [8, 16]
    assert marker_writes.MARKER_INTERVAL_S == 2.0


def test_initial_states_and_reasons_word_for_word(tmp_path):
    for switch, state, reason in (
            ("qkv_norm", FusionState.DISABLED, "not requested by K3_AMD_OVERLAY='qkv_norm'"),
            ("stock", FusionState.FORCED_STOCK, "stock mode"),
            ("1", FusionState.PENDING, "patched; decided per layer when K3 MLA layers are built")):
        entry = Evidence(settings_for(tmp_path, switch)).fusion("qk_cache")
        assert (entry.state, entry.reason) == (state, reason)


def test_shape_coverage_and_defects_are_recorded_and_warned_word_for_word(tmp_path, emitted):
    evidence = Evidence(settings_for(tmp_path))
    evidence.set_shape("k3_decode_wrapper", ["a", "b"])
    evidence.set_coverage({"not_covered": ["MTP draft layers"], "serves": "x"})
    defect = {"name": "w_uk_t_read_early", "what": "reads W_UK_T before load", "triggered": True}
    evidence.set_upstream_defects([defect, {**defect, "name": "other", "triggered": False}])
    saved = json.loads(evidence.marker_path.read_text())
    assert (saved["vllm_shape"], saved["patches"], saved["coverage"]["serves"]) == ("k3_decode_wrapper", ["a", "b"],
                                                                                  "x")
    assert [d["name"] for d in saved["upstream_defects"]] == ["w_uk_t_read_early", "other"]
    assert emitted == [
        (logging.WARNING, "k3-amd-overlay: not covered in this process: MTP draft layers"),
        (logging.WARNING, "k3-amd-overlay: this vLLM has a known defect that this environment triggers, with or "
                          "without the overlay: w_uk_t_read_early: reads W_UK_T before load"),
    ]


def test_layer_tallies_mixed_reason_and_log_lines_word_for_word(tmp_path, emitted):
    evidence = Evidence(settings_for(tmp_path))
    evidence.note_layer("qk_cache", LayerDecision(FusionState.APPLIED, "triton", "ok"))
    evidence.note_layer("qk_cache", LayerDecision(FusionState.APPLIED, "aiter", "ok"))  # another provider: mixed
    entry = evidence.fusion("qk_cache")
    assert (entry.state, entry.provider, entry.layers) == (FusionState.APPLIED, "triton", 2)
    assert entry.reason == "mixed across layers; latest: applied (ok)"
    evidence.note_layer("qk_cache", LayerDecision(FusionState.REFUSED, None, "no provider"))
    evidence.publish_layers()
    prefix = f"k3-amd-overlay: pid={os.getpid()} role={evidence.record.role} layers built: "
    assert emitted == [(logging.INFO, prefix + "qk_cache=applied on 2/3 layers (ok); refused on 1/3 layers "
                                               "(no provider)")]


def test_the_summary_line_word_for_word(tmp_path, emitted):
    evidence = Evidence(settings_for(tmp_path, "qk_cache"))
    evidence.set_fusion("qk_cache", FusionState.APPLIED, "fused", provider="triton")
    line = evidence.summary_line()
    r = evidence.record
    assert line == " | ".join([
        f"k3-amd-overlay {r.overlay_version}: pid={r.pid} role={r.role}",
        f"vllm={r.vllm_version} mode=auto shape=None",
        "qkv_norm=disabled (not requested by K3_AMD_OVERLAY='qk_cache')",
        "qk_cache=applied provider=triton (fused)",
        "absorb_qk_cache=disabled (not requested by K3_AMD_OVERLAY='qk_cache')",
        f"marker={evidence.marker_path}"])
    evidence.publish()
    assert emitted[-1] == (logging.INFO, line)
    shutil.rmtree(tmp_path / "m")
    (tmp_path / "m").write_text("gone")
    evidence.flush()
    assert evidence.marker_error.startswith(f"marker write failed in {tmp_path / 'm'}: ")
    assert emitted[-1] == (logging.WARNING, f"k3-amd-overlay: {evidence.marker_error}")


def test_a_failed_write_voids_the_last_marker_so_check_never_trusts_what_the_process_was(tmp_path, monkeypatch,
                                                                                         emitted, capsys):
    """A marker write that fails (a full disk) after a good one: the state change it carried (every
    fusion refused: the stock path runs from now on) never reaches the file, so the last marker is
    emptied and `check` fails on this live process instead of holding on what it was; the next write
    that succeeds restores it."""
    import errno

    from k3_amd_overlay import json_files
    from k3_amd_overlay.commands.cli import main

    evidence = Evidence(settings_for(tmp_path))
    for fusion in ("qkv_norm", "qk_cache", "absorb_qk_cache"):
        evidence.note_layer(fusion, LayerDecision(FusionState.APPLIED, "triton", "ok"))
        hook = evidence.effective_hook(fusion, "layer.0")
        for _ in range(4):
            execute_model(hook, 1)
    evidence.flush()
    marker = tmp_path / "m" / f"{os.getpid()}.json"
    assert main(["check", "--expect", "fused", "--marker-dir", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    written = json_files.replace_atomically

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json_files, "replace_atomically", full)
    for fusion in ("qkv_norm", "qk_cache", "absorb_qk_cache"):
        evidence.set_fusion(fusion, FusionState.REFUSED, "its kernel failed on this GPU: the stock path runs")
    assert marker.read_text() == ""
    assert evidence.marker_error == (f"marker write failed in {tmp_path / 'm'}: [Errno 28] No space left on device; "
                                     f"its last marker {marker} emptied, so `check` fails on this process until a "
                                     "write succeeds")
    assert emitted[-1] == (logging.WARNING, f"k3-amd-overlay: {evidence.marker_error}")
    assert main(["check", "--expect", "fused", "--marker-dir", str(tmp_path / "m")]) == 1
    out = capsys.readouterr().out
    assert (f"FAIL {marker}: pid {os.getpid()} runs on this host, but its marker is unreadable (unreadable marker: "
            "empty (") in out, out
    monkeypatch.setattr(json_files, "replace_atomically", written)  # space again: the next write tells the truth
    evidence.flush()
    assert main(["check", "--expect", "fused", "--marker-dir", str(tmp_path / "m")]) == 1
    assert "qk_cache=refused" in capsys.readouterr().out


def test_a_marker_that_can_be_neither_emptied_nor_removed_is_said_to_be_stale(tmp_path, monkeypatch):
    writer = marker_writes.MarkerWriter(str(tmp_path / "m"))
    record = MarkerRecord(pid=os.getpid(), mode=Mode.AUTO, fusions={})
    writer.write(record)

    def refused(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(markers.json_files, "replace_atomically", refused)
    monkeypatch.setattr(markers.os, "truncate", refused)
    monkeypatch.setattr(markers.Path, "unlink", refused)
    writer.write(record)
    assert writer.error.endswith(f"its last marker {writer.path} could be neither emptied nor removed (Read-only "
                                 "file system): it is stale")


@pytest.mark.parametrize("argv,role", [
    (["python", "serve"], "main"),  # only the `vllm` program's own arguments are commands
    ([], "main"),
    (["/usr/bin/vllm", "-v"], "cli-client"), (["vllm", "--help"], "cli-client"), (["vllm", "-h"], "cli-client"),
    (["vllm", "chat"], "cli-client"), (["vllm", "complete"], "cli-client"), (["vllm", "collect-env"], "cli-client"),
    (["vllm", "--version"], "cli-client"), (["vllm", "bench", "serve"], "cli-client"),
    (["vllm", "bench", "throughput"], "main"),  # an offline engine: it builds the model
    # deny by default: a command that builds the serve parser (loading the plugins) but runs no model
    (["vllm", "bench", "sweep", "serve", "--serve-cmd", "vllm serve m"], "cli-client"),
    (["vllm", "launch", "render", "m"], "cli-client"), (["vllm", "preload", "--model", "m"], "cli-client"),
    (["vllm", "snapshot", "create", "m"], "cli-client"), (["vllm", "download-kernels"], "cli-client"),
    (["vllm"], "cli-client"), (["vllm", "a-command-of-a-later-release", "m"], "cli-client"),
    # the commands that build the engine in their own process, 0.29-0.33
    (["vllm", "bench", "latency", "--model", "m"], "main"), (["vllm", "bench", "startup", "--model", "m"], "main"),
    (["vllm", "bench", "forward", "--model", "m"], "main"), (["vllm", "bench", "mm-processor"], "main"),
    (["vllm", "run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"], "main"),
])
def test_command_lines_that_are_not_vllm_servers(argv, role):
    assert process_role(argv, "MainProcess") == role
    assert process_role([], "APIServer_0") == process_role([], "ApiServer_1") == "api-server"  # by name alone


@pytest.mark.parametrize("name,role", [("EngineCore_DP0", "engine-core"), ("VllmWorker-0", "worker")])
def test_a_child_vllm_names_is_its_role_whatever_command_it_inherited(name, role):
    """A child of a command that is no engine command (one a later release adds) keeps that command
    line: vLLM's name for it says it runs the model, so the plugin loads there and it leaves evidence."""
    from k3_amd_overlay.process_identity import is_cli_client

    argv = ["vllm", "a-command-of-a-later-release", "m"]
    assert process_role(argv, name) == role and not is_cli_client(argv, name)
    assert process_role(argv, "MainProcess") == "cli-client" and is_cli_client(argv, "MainProcess")


def _bench_commands(vllm_dir: Path) -> dict[str, Path]:
    """Each ``vllm bench`` subcommand of the installed vLLM with the benchmark module it runs."""
    import re

    found = {}
    for path in (vllm_dir / "entrypoints" / "cli" / "benchmark").glob("*.py"):
        text = path.read_text()
        name = re.search(r'^    name = "([^"]+)"', text, re.MULTILINE)
        module = re.search(r"^from (vllm\.benchmarks[\w.]*) import", text, re.MULTILINE)
        if name and module and name.group(1) != "bench":
            found[name.group(1)] = vllm_dir.parent / (module.group(1).replace(".", "/") + ".py")
    return found


@pytest.mark.vllm
def test_each_vllm_command_of_this_release_has_the_role_of_what_it_runs():
    """Read from the installed vLLM's CLI: a ``vllm bench`` subcommand whose benchmark builds an engine
    (an ``LLM`` or an engine client) is an engine command (role main), every other one a client; the
    top-level commands are those reviewed (a new one is a client until it is)."""
    import re

    import vllm

    vllm_dir = Path(vllm.__file__).parent
    bench = _bench_commands(vllm_dir)
    assert {"latency", "throughput", "serve"} <= set(bench), bench
    for name, module in bench.items():
        builds = re.search(r"LLM\.from_engine_args|build_async_engine_client", module.read_text())
        assert process_role(["vllm", "bench", name], "MainProcess") == ("main" if builds else "cli-client"), name
    top = {m.group(1) for path in (vllm_dir / "entrypoints" / "cli").glob("*.py")
           for m in re.finditer(r'^    name = "([^"]+)"', path.read_text(), re.MULTILINE)}
    reviewed = {"serve", "run-batch", "bench", "chat", "complete", "collect-env", "launch", "render", "preload",
                "snapshot", "download-kernels"}
    assert top <= reviewed, f"commands no release 0.29-0.33 had: {top - reviewed}: review their roles"
    assert process_role(["vllm", "serve", "m"], "MainProcess") == "api-server"
    assert process_role(["vllm", "run-batch"], "MainProcess") == "main"


def test_lines_go_through_vllms_logger_once_it_has_handlers(capsys, monkeypatch):
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    log_lines.emit(logging.INFO, "before vLLM's logging")
    assert capsys.readouterr().err == "before vLLM's logging\n"
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    monkeypatch.setattr(vllm_logger, "handlers", [Keep()])
    log_lines.emit(logging.WARNING, "after")
    assert seen == ["after"] and capsys.readouterr().err == ""


def test_the_marker_keeps_up_with_new_layers_and_each_phases_first_batch(tmp_path, monkeypatch):
    """Between interval rewrites the marker is still rewritten for a new layer's first fused run and a
    phase's first batch; its time stamp is each write's; the exit flush is registered once."""
    evidence = Evidence(settings_for(tmp_path))
    registered = []
    monkeypatch.setattr(process_hooks, "register_exit_flush", registered.append)
    monkeypatch.setattr(marker_writes.time, "monotonic", lambda: 1000.0)  # the interval never passes
    phase = [phases.Phase.WARMUP]
    monkeypatch.setattr(run_counts, "current_phase", lambda: phase[0])
    first, second = (evidence.effective_hook("qk_cache", f"layer.{i}") for i in range(2))

    def saved():
        return json.loads(evidence.marker_path.read_text())["fusions"]["qk_cache"]

    first(4)
    second(4)
    assert saved()["effective_layers"] == 2
    for _ in range(3):
        first(4)
    phase[0] = phases.Phase.SERVED
    before = time.time()
    first(4)  # served batch 1 after 4 warm-up batches
    assert saved()["runs"] == {"warmup": 4, "capture": 0, "served": 1, "replay": 0}
    assert before <= json.loads(evidence.marker_path.read_text())["updated"] <= time.time()
    assert registered == [evidence.flush]


def test_an_unusable_marker_directory_is_named_in_the_summary_line(tmp_path):
    (tmp_path / "m").symlink_to(tmp_path)
    evidence = Evidence(settings_for(tmp_path))
    assert evidence.summary_line().endswith(f" | marker-error={evidence.marker_error}")


CHILD_WITH_ODD_NAME = """
import ctypes, signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # whatever the parent ignores or blocks: a stray signal
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGHUP])  # would end it
ctypes.CDLL(None).prctl(15, b"k3) odd (name", 0, 0, 0)  # PR_SET_NAME: a ")" inside /proc/<pid>/stat's name
print("ready", flush=True)
time.sleep(60)
"""


def test_start_ticks_and_liveness_of_a_process_named_with_a_parenthesis():
    """The start time is field 22 of /proc/<pid>/stat, counted after the name's last ")"; checking a
    process is alive sends it no signal."""
    started = time.time()
    child = subprocess.Popen([sys.executable, "-c", CHILD_WITH_ODD_NAME], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        ticks = markers.process_start_ticks(child.pid)
        assert ticks is not None
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        start = boot + ticks / os.sysconf("SC_CLK_TCK")
        assert started - 2 <= start <= time.time() + 2  # btime is whole seconds
        assert markers.is_alive(child.pid, ticks) and markers.is_running(child.pid)
        assert not markers.is_alive(child.pid, ticks + 1)
        # A record without a start time, where this host shows one, may be of an earlier process with that pid.
        assert not markers.is_alive(child.pid, None)
        with pytest.raises(subprocess.TimeoutExpired):  # not ended by a signal (even on a loaded machine)
            child.wait(timeout=2)
    finally:
        child.kill()
        child.wait()
    assert not markers.is_alive(child.pid, None) and not markers.is_running(child.pid)
    assert markers.process_start_ticks(child.pid) is None


def test_an_exited_unreaped_child_is_not_alive(tmp_path):
    """A worker that exited but was never reaped (a zombie: a PID 1 that does not reap keeps it so)
    still answers kill(pid, 0) with its start time, yet runs nothing: its marker is stale and proves
    nothing in ``check``."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = markers.process_start_ticks(child.pid)
    try:
        deadline = time.time() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # exited, unreaped
            assert time.time() < deadline, "the child never exited"
            time.sleep(0.05)
        assert markers.process_start_ticks(child.pid) == ticks
        assert not markers.is_alive(child.pid, ticks)
        marker_dir = tmp_path / "m"
        marker_dir.mkdir(mode=0o700)
        record = {"pid": child.pid, "mode": Mode.AUTO.value, "start_ticks": ticks, "fusions": {}}
        (marker_dir / f"{child.pid}.json").write_text(json.dumps(record))
        assert [m.live for m in markers.read_markers(marker_dir)] == [False]
    finally:
        child.wait()


def test_unreadable_markers_are_listed_with_the_readable_ones(tmp_path):
    import dataclasses

    (tmp_path / "1.json").write_text("{not json")
    markers.write_marker(tmp_path, 2, MarkerRecord(pid=os.getpid(), mode=load_settings({}).mode, fusions={},
                                                   start_ticks=markers.process_start_ticks(os.getpid())).to_json())
    (tmp_path / "3.txt").write_text("{}")
    bad, good = markers.read_markers(tmp_path)
    assert (bad.path.name, bad.record, bad.live) == ("1.json", None, False)
    assert bad.error.startswith("unreadable marker: Expecting property name enclosed in double quotes")
    assert (good.path.name, good.error, good.live) == ("2.json", None, True) and good.record.pid == os.getpid()
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.live = False


@pytest.mark.parametrize("field,value,said", [
    ("launch_configs", "gfx942", "marker field 'launch_configs' is 'gfx942', expected an object"),
    ("measurement", ["used"], "marker field 'measurement' is ['used'], expected an object"),
    ("patches", "k3_wrapper.init", "marker field 'patches' is 'k3_wrapper.init', expected a list"),
    ("strict", "yes", "marker field 'strict' is 'yes', expected true or false"),
    ("host", 7, "marker field 'host' is 7, expected a string"),
    ("fusions", {"qk_cache": {"state": "applied", "runs": [3]}},
     "fusion 'qk_cache': 'runs' is [3], expected an object of phase: count"),
])
def test_a_marker_field_of_the_wrong_kind_is_an_unreadable_marker_not_a_crash(tmp_path, field, value, said):
    """A marker written by hand or another tool: ``check`` sets it aside with the field named, and the
    other processes are still judged (a crash here stopped the verdict on every process)."""
    good = MarkerRecord(pid=os.getpid(), mode=load_settings({}).mode, fusions={},
                        start_ticks=markers.process_start_ticks(os.getpid())).to_json()
    markers.write_marker(tmp_path, 1, {**good, "pid": 1, field: value})
    markers.write_marker(tmp_path, 2, good)
    bad, read = markers.read_markers(tmp_path)
    assert bad.record is None and bad.error.startswith(f"unreadable marker: {said}"), bad.error
    assert read.error is None and read.live


ENTRY = {"state": "applied", "provider": "triton", "reason": "r", "layers": 2, "effective": True,
         "runs": {"served": 3}, "captured_sizes": [1, 2]}

STATES = "pending, applied, upstream, forced-stock, refused, disabled"


@pytest.mark.parametrize("record_fields,said", [
    ({"pid": None, "fusions": {}}, "marker field 'pid' is None, expected a process id (1-2147483647)"),
    ({"mode": "on", "fusions": {}}, "marker field 'mode' is 'on'; allowed: off, auto, stock"),
    ({"fusions": {"qk_cache": {**ENTRY, "state": "zzz"}}}, f"fusion 'qk_cache': 'state' is 'zzz'; allowed: {STATES}"),
    ({"fusions": {"qk_cache": {"provider": "triton"}}}, f"fusion 'qk_cache': 'state' is missing; allowed: {STATES}"),
    ({"fusions": {"qk_cache": ["applied"]}},
     "fusion 'qk_cache' is a list, expected an object (state, provider, reason, ...)"),
    ({"fusions": {"qk_cache": {**ENTRY, "runs": {"served": 1, "later": 2}}}},
     "fusion 'qk_cache': 'runs' has a key 'later'; allowed: warmup, capture, served, replay"),
    ({"fusions": {"qk_cache": {**ENTRY, "layer_states": [["applied", 2]]}}},
     "fusion 'qk_cache': 'layer_states' is [['applied', 2]], expected an object of state: {layers, reason}"),
    ({"fusions": {"qk_cache": {**ENTRY, "layer_states": {"fused": {"layers": 2}}}}},
     f"fusion 'qk_cache': 'layer_states' has a key 'fused'; allowed: {STATES}"),
    ({"fusions": {"qk_cache": {**ENTRY, "layer_states": {"applied": {"reason": "r"}}}}},
     "fusion 'qk_cache': 'layer_states.applied.layers' is missing, expected a whole number >= 0"),
    ({"fusions": {"qk_cache": {**ENTRY, "state": "x" * 5000}}},
     f"fusion 'qk_cache': 'state' is 'xxxxxxxxxxxx...xxxxxxxxxxxxx'; allowed: {STATES}"),
])
def test_an_unreadable_marker_names_the_fusion_the_field_and_what_is_allowed(tmp_path: Path, record_fields: dict,
                                                                              said: str) -> None:
    """A marker that is no record says which fusion and field, whether the field is missing or which
    value it holds (cut short), and the values or shape allowed; never Python's own words ("is not a
    valid FusionState", "'list' object has no attribute") nor the whole entry it sits in."""
    good = MarkerRecord(pid=os.getpid(), mode=Mode.AUTO, fusions={}).to_json()
    markers.write_marker(tmp_path, 1, {**good, **record_fields})
    (bad,) = markers.read_markers(tmp_path)
    assert bad.record is None and bad.error == f"unreadable marker: {said}"
    assert "'provider': 'triton'" not in bad.error and "valid" not in bad.error and "object has no" not in bad.error


@pytest.mark.parametrize("record_fields,said", [
    ({"pid": 0}, "marker field 'pid' is 0, expected a process id (1-2147483647)"),
    ({"pid": -1}, "marker field 'pid' is -1, expected a process id"),
    ({"pid": True}, "marker field 'pid' is True, expected a process id"),
    ({"pid": 1e30}, "marker field 'pid' is 1e+30, expected a process id"),
    ({"pid": 2**40}, "marker field 'pid' is 1099511627776, expected a process id"),
    ({"start_ticks": -5}, "'start_ticks' is -5, expected a whole number >= 0"),
    ({"updated": float("inf")}, "marker field 'updated' is inf, expected a finite time in seconds"),
    ({"updated": 10**400}, "marker field 'updated' is 1000"),
    ({"fusions": {"qk_cache": {**ENTRY, "runs": {"replay": -5}}}}, "'runs.replay' is -5, expected a whole number"),
    ({"fusions": {"qk_cache": {**ENTRY, "layers": 1e400}}}, "'layers' is inf, expected a whole number >= 0"),
    ({"fusions": {"qk_cache": {**ENTRY, "layers": 2.0}}}, "'layers' is 2.0, expected a whole number >= 0"),
    ({"fusions": {"qk_cache": {**ENTRY, "effective": "false"}}}, "'effective' is 'false', expected true or false"),
    ({"fusions": {"qk_cache": {**ENTRY, "captured_sizes": "12"}}}, "'captured_sizes' is '12', expected a list"),
    ({"fusions": {"qk_cache": {**ENTRY, "provider": 5}}}, "'provider' 5 and 'reason' 'r': expected a string"),
])
def test_impossible_evidence_is_an_unreadable_marker_never_a_live_process_or_a_count(tmp_path, capsys, record_fields,
                                                                                     said):
    """A pid of 0 or below answers ``kill`` as a process group (it read as live, never pruned), a negative
    count printed "-5 replays" in a verdict that held, and a number too large for a float crashed ``check``:
    each such marker is set aside as unreadable, naming the field, and proves nothing."""
    good = MarkerRecord(pid=os.getpid(), mode=Mode.AUTO, fusions={}).to_json()
    markers.write_marker(tmp_path, 1, {**good, "fusions": {"qk_cache": ENTRY}, **record_fields})
    (bad,) = markers.read_markers(tmp_path)
    assert bad.record is None and not bad.live and said in bad.error, bad.error
    from k3_amd_overlay.commands.cli import main

    assert main(["check", "--marker-dir", str(tmp_path), "--expect", "fused", "--fusions", "qk_cache",
                 "--no-effective"]) == 1
    assert "no live vLLM process has left overlay evidence" in capsys.readouterr().out


def test_an_unreadable_marker_of_a_running_process_fails_the_verdict_beside_a_good_one(tmp_path, capsys):
    """What a running process ran is unknown where its marker cannot be read (another overlay version's,
    or impossible evidence): the verdict held on the readable processes alone before."""
    from records import process

    from k3_amd_overlay.commands.cli import main

    good = {**process(pid=os.getpid(), role="worker"), "start_ticks": markers.process_start_ticks(os.getpid())}
    markers.write_marker(tmp_path, os.getpid(), good)
    argv = ["check", "--marker-dir", str(tmp_path), "--expect", "fused", "--no-effective"]
    assert main(argv) == 0
    capsys.readouterr()
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        markers.write_marker(tmp_path, sibling.pid, {**good, "pid": sibling.pid, "schema": 3})
        assert main(argv) == 1
        out = capsys.readouterr().out
        assert (f"FAIL {tmp_path / f'{sibling.pid}.json'}: pid {sibling.pid} runs on this host, but its marker is "
                "unreadable (unreadable marker: marker schema 3;") in out, out
        assert "remove the file if that process is no vLLM)" in out
    finally:
        sibling.kill()
        sibling.wait()
    assert main(argv) == 0  # once it is gone, its unreadable marker is a note again


def _forked_worker(evidence: Evidence, layer: str) -> None:
    """A forked vLLM worker: it builds a layer and runs a batch, with the record it inherited."""
    evidence.note_layer("qk_cache", LayerDecision(FusionState.APPLIED, "triton", "r"))
    execute_model(evidence.effective_hook("qk_cache", layer), 4)
    evidence.flush()


def test_each_forked_process_writes_its_own_marker(tmp_path):
    """Issue 19, fault 3: vLLM's fork start method (an offline LLM's engine core and workers) does not
    load plugins again in the child. Each child must still leave its own marker: its pid, start time
    and role, and its own runs, not the parent's file, pid or counts."""
    evidence = Evidence(settings_for(tmp_path))
    evidence.effective_hook("qk_cache", "parent.layer")(4)  # a run in the parent, not the children's
    evidence.flush()
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_forked_worker, args=(evidence, f"layer.{i}"), name=name)
                for i, name in enumerate(("EngineCore_DP0", "VllmWorker-0"))]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    records = {r.pid: r for r in (m.record for m in markers.read_markers(tmp_path / "m"))}
    assert set(records) == {os.getpid(), *(c.pid for c in children)}
    for child, role in zip(children, ("engine-core", "worker"), strict=True):
        mine = records[child.pid]
        assert (mine.role, mine.process_name) == (role, child.name)
        assert mine.fusions["qk_cache"].runs[phases.Phase.SERVED] == 1 and mine.fusions["qk_cache"].layers == 1
        assert mine.fusions["qk_cache"].effective_layers == 1
    parent = records[os.getpid()]
    assert parent.role == "main" and parent.fusions["qk_cache"].layers == 0
    assert parent.start_ticks == markers.process_start_ticks(os.getpid())


def test_a_ray_actor_is_a_worker():
    argv = ["/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py", "--node-ip-address=x"]
    assert process_role(argv, "MainProcess") == "worker"


def test_a_defect_decided_per_layer_records_what_the_layer_build_showed(tmp_path):
    """A defect the environment leaves possible (None) becomes True or False once vLLM built a layer;
    a True stays True (one layer that fired is enough)."""
    evidence = Evidence(settings_for(tmp_path))
    evidence.set_upstream_defects([{"name": "d", "what": "w", "when": "x", "triggered": None}])
    evidence.defect_outcome("d", fired=False)
    assert evidence.record.upstream_defects[0]["triggered"] is False
    evidence.defect_outcome("d", fired=True)
    evidence.defect_outcome("d", fired=False)
    assert evidence.record.upstream_defects[0]["triggered"] is True


def test_check_merges_the_json_of_several_nodes_into_one_verdict(tmp_path, capsys):
    """Issue 19: across nodes each node's `check --json` sees only its own markers; `--merge` judges
    their records together: both nodes fused holds, one node stock fails, naming the process."""
    from k3_amd_overlay.commands.cli import main

    def node(name, *records):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"expect": "fused", "holds": True, "lines": [], "notes": [], "host": name,
                                    "marker_dir": "/m", "source": "markers", "checked_at": time.time(),
                                    "records": [{**MarkerRecord.from_json(r).to_json(), "host": name}
                                                for r in records]}))
        return str(path)

    one = node("node-a", record("auto", "applied", "applied", pid=11))
    two = node("node-b", record("auto", "applied", "applied", pid=11, served=0, replayed=4, captured=(1,)))
    stock = node("node-c", record("stock", "forced-stock", "forced-stock", pid=12, effective=False))
    assert main(["check", "--expect", "fused", "--merge", one, two]) == 0
    out = capsys.readouterr().out
    assert f"note {one}: 1 process from host node-a" in out and "HOLDS: expect fused (2 processes)" in out
    assert main(["check", "--expect", "fused", "--merge", one, stock]) == 1
    assert "FAIL host node-c pid 12 (worker, vLLM 0.33.0): qkv_norm=forced-stock" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["check", "--expect", "fused", "--merge", str(tmp_path / "bad.json")]) == 2
    assert "bad.json is not the output of `k3-amd-overlay check --json`" in capsys.readouterr().err


def test_check_names_its_marker_directory_prunes_stale_markers_and_rejects_unknown_schemas(tmp_path, capsys):
    """Issue 21: `check` says which directory it read and what it found there; `--prune` removes the
    markers of processes that are gone; a marker of another schema is unreadable, not judged."""
    from k3_amd_overlay.commands.cli import main

    directory = markers.ensure_marker_dir(tmp_path / "m")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    markers.write_marker(directory, dead.pid, {**record("auto", "applied", "applied", pid=dead.pid), "start_ticks": 1})
    markers.write_marker(directory, os.getpid(), {**record("auto", "applied", "applied", pid=os.getpid()),
                                                  "start_ticks": markers.process_start_ticks(os.getpid()),
                                                  "schema": 99})
    assert main(["check", "--expect", "fused", "--marker-dir", str(directory)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"markers read from {directory}: 0 live, 1 stale, 1 unreadable\n")
    assert "marker schema 99; this k3-amd-overlay reads schema 2 (another version of the overlay wrote it)" in out
    assert "(--prune removes such files)" in out and (directory / f"{dead.pid}.json").exists()
    assert main(["check", "--expect", "fused", "--marker-dir", str(directory), "--prune"]) == 1
    assert f"pid {dead.pid} is gone; stale marker removed (--prune)" in capsys.readouterr().out
    assert not (directory / f"{dead.pid}.json").exists() and (directory / f"{os.getpid()}.json").exists()


@pytest.mark.parametrize("argv,message", [
    (["--fusions", "qk_cache,fast"], "--fusions: unknown fast; allowed: qkv_norm, qk_cache, absorb_qk_cache"),
    (["--fusions", "qk_cache,"], "--fusions 'qk_cache,': an empty name (a stray comma?); allowed: qkv_norm, qk_cache, "
                                 "absorb_qk_cache (comma separated)"),  # the switch refuses it too
    (["--static", "--merge", "x.json"], "--merge, --static and --prune each judge other processes: give at most one"),
    (["--static", "--prune"], "--merge, --static and --prune each judge other processes: give at most one"),
    # before, --marker-dir was dropped without a word (its JSON said marker_dir null)
    (["--merge", "x.json", "--marker-dir", "md"], "--marker-dir md names the markers a live check reads; --merge "
                                                  "reads none: give one of the two"),
    (["--static", "--marker-dir", "md"], "--marker-dir md names the markers a live check reads; --static reads none: "
                                         "give one of the two"),
])
def test_check_usage_errors_exit_2_with_the_reason(argv, message, capsys):
    from k3_amd_overlay.commands.cli import main

    assert main(["check", "--expect", "fused", *argv]) == 2
    assert capsys.readouterr().err.endswith(f"k3-amd-overlay check: error: {message}\n")  # its own usage


def test_check_json_is_json_when_the_static_probe_fails(monkeypatch, capsys):
    from k3_amd_overlay.commands import cli, doctor

    monkeypatch.setenv("K3_AMD_OVERLAY", "1")  # with the overlay off here no probe runs: it says so instead
    monkeypatch.setattr(doctor, "run_doctor", lambda: ({"switch": {"mode": "auto"}, "fusions": {}}, False))
    monkeypatch.setattr(cli, "static_record", lambda: (None, "ImportError: no vllm"))
    assert cli.main(["check", "--expect", "fused", "--static", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["holds"] is False and out["records"] == [] and "ImportError: no vllm" in out["lines"][0]


def test_an_unusable_marker_directory_is_a_warning_line_of_its_own(tmp_path, emitted):
    directory = tmp_path / "open"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    evidence = Evidence(load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(directory)}))
    evidence.publish()
    level, line = emitted[-1]
    assert level == logging.WARNING and line.startswith(
        "k3-amd-overlay: WARNING: this process writes no marker, so `k3-amd-overlay check` cannot see it: "
        f"marker directory {directory} is writable by group or others")


def test_python_m_runs_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("k3-amd-overlay ")
