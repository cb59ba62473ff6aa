"""The evidence record's contract where no test through vLLM reaches it: a captured graph's replays
(each fusion recorded into one graph counts once per replay, by the replay's phase, and the marker
is rewritten at powers of two and at the interval, as for batches); a forked child's record, at any
depth of forks, starts as its own (pid, start time, no runs, no first run, its own exit flush);
the identity of the process that made the record is read once; and the launch configs and
possible-defect warning, word for word."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path

from k3_amd_overlay import evidence as evidence_module
from k3_amd_overlay import marker_writes, markers, process_hooks, run_counts
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.phases import Phase
from k3_amd_overlay.settings import load_settings

REAL_EXIT_FLUSH = process_hooks.register_exit_flush  # read before the suite's stand-in (conftest) replaces it


def settings_for(tmp_path: Path, directory: str = "m"):
    return load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / directory)})


class StandInGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` (no capture without a GPU): counts its own replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def execute_model(run, *args):  # named as vLLM's worker and model runners name the step serving a batch
    return run(*args)


def test_each_replay_of_a_captured_graph_counts_once_for_every_fusion_it_recorded(tmp_path, monkeypatch):
    evidence = Evidence(settings_for(tmp_path))
    graph = StandInGraph()
    clock, phase, replayed_as = [5000.0], [Phase.CAPTURE], [Phase.REPLAY]
    monkeypatch.setattr(marker_writes.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(run_counts, "current_phase", lambda: phase[0])
    monkeypatch.setattr(run_counts, "capturing_graph", lambda: graph if phase[0] is Phase.CAPTURE else None)
    monkeypatch.setattr(run_counts, "replay_phase", lambda: replayed_as[0])
    writes = []
    real_write = markers.write_marker
    monkeypatch.setattr(markers, "write_marker", lambda *a: writes.append(a[2]["fusions"]) or real_write(*a))
    qk_cache, qkv_norm = (evidence.effective_hook(f, "model.layers.3.self_attn") for f in ("qk_cache", "qkv_norm"))
    for hook in (qk_cache, qkv_norm, qk_cache):  # both fusions recorded into one graph; qk_cache twice
        hook(24)
    assert "replay" in dir(graph)  # the graph stays an ordinary object: its instance attributes are names

    def runs(fusion: str) -> dict[str, int]:
        return json.loads(evidence.marker_path.read_text())["fusions"][fusion]["runs"]

    assert runs("qk_cache") == {"warmup": 0, "capture": 2, "served": 0, "replay": 0}
    assert evidence.fusion("qk_cache").captured_sizes == evidence.fusion("qkv_norm").captured_sizes == [24]
    phase[0] = Phase.SERVED
    written = len(writes)
    for expected_writes in (1, 2, 2, 3):  # replays 1, 2, 3, 4: rewritten at powers of two only
        graph.replay()
        assert len(writes) - written == expected_writes
    assert graph.replays == 4  # each counted replay replays the graph once
    assert runs("qk_cache") == {"warmup": 0, "capture": 2, "served": 0, "replay": 4}
    assert runs("qkv_norm") == {"warmup": 0, "capture": 1, "served": 0, "replay": 4}
    graph.replay()  # replay 5, before the interval: counted, not yet written
    assert len(writes) - written == 3 and evidence.fusion("qk_cache").runs[Phase.REPLAY] == 5
    clock[0] += marker_writes.MARKER_INTERVAL_S  # exactly the interval since the last write
    graph.replay()
    assert len(writes) - written == 4 and runs("qkv_norm")["replay"] == 6
    replayed_as[0] = Phase.WARMUP  # a replay in vLLM's own warm-up: its first is written at once
    graph.replay()
    assert len(writes) - written == 5 and runs("qk_cache") == {"warmup": 1, "capture": 2, "served": 0, "replay": 6}


def _observe_fork(evidence: Evidence, unusable: Evidence, hook: Callable[[int], None], out: str, depth: int) -> None:
    """In a forked child: what its record says before its first batch through the layer's hook (made
    and run in the parent), then after one; at depth 1 it forks a grandchild of its own after running
    its batch."""
    registered = []
    process_hooks.register_exit_flush = registered.append
    pid = os.getpid()
    before = json.loads((evidence.marker_path).read_text())  # written by the fork hook
    execute_model(hook, 12)
    evidence.flush()
    after = json.loads(evidence.marker_path.read_text())
    seen = {"pid": pid, "ticks": markers.process_start_ticks(pid), "before": before, "after": after,
            "marker": str(evidence.marker_path), "unusable_path": unusable.marker_path,
            "flush_registered": registered == [evidence.flush]}
    if depth == 1:
        grandchild = multiprocessing.get_context("fork").Process(
            target=_observe_fork, args=(evidence, unusable, hook, out + ".grandchild", 2))
        grandchild.start()
        grandchild.join(60)
        seen["grandchild_exit"] = grandchild.exitcode
    Path(out).write_text(json.dumps(seen))


def test_a_forked_child_and_its_own_child_each_start_a_record_of_their_own(tmp_path):
    """vLLM's fork start method forks an engine core, which forks its workers: each process's record
    starts with its own pid and start time, no runs and no first run of the parent's, registers its
    own exit flush, and records its own first batch on a layer the parent (or its parent) ran."""
    evidence = Evidence(settings_for(tmp_path))
    (tmp_path / "bad").symlink_to(tmp_path)
    unusable = Evidence(settings_for(tmp_path, "bad"))
    evidence.note_layer("qk_cache", LayerDecision(FusionState.APPLIED, "triton", "fits"))
    hook = evidence.effective_hook("qk_cache", "model.layers.5.self_attn")
    for size in (6, 6, 6):
        execute_model(hook, size)
    evidence.flush()
    parent = json.loads(evidence.marker_path.read_text())["fusions"]["qk_cache"]
    assert (parent["effective"], parent["effective_layers"], parent["runs"]["served"]) == (True, 1, 3)
    out = tmp_path / "child.json"
    child = multiprocessing.get_context("fork").Process(target=_observe_fork,
                                                        args=(evidence, unusable, hook, str(out), 1))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    fresh = {"warmup": 0, "capture": 0, "served": 0, "replay": 0}
    seen = json.loads(out.read_text())
    assert seen["grandchild_exit"] == 0
    for one in (seen, json.loads(Path(str(out) + ".grandchild").read_text())):
        before, after = one["before"], one["after"]
        assert one["ticks"] is not None and (before["pid"], before["start_ticks"]) == (one["pid"], one["ticks"])
        assert one["marker"] == str(tmp_path / "m" / f"{one['pid']}.json")
        entry = before["fusions"]["qk_cache"]
        assert (entry["effective"], entry["effective_layers"], entry["runs"], entry["captured_sizes"]) == (
            False, 0, fresh, [])
        assert (entry["state"], entry["layers"]) == ("applied", 1)  # its patches and built layers stay
        entry = after["fusions"]["qk_cache"]
        assert (entry["effective"], entry["effective_layers"], entry["runs"]) == (True, 1, {**fresh, "served": 1})
        assert one["flush_registered"] is True and one["unusable_path"] is None
    assert json.loads(evidence.marker_path.read_text())["fusions"]["qk_cache"]["runs"]["served"] == 3


def test_the_identity_of_the_process_that_made_the_record_is_read_once(tmp_path, monkeypatch):
    """Only a forked child reads its role and name again (multiprocessing names it after the fork
    hooks); the process that made the record keeps what it was when the record was made."""
    evidence = Evidence(settings_for(tmp_path))
    role, name = evidence.record.role, evidence.record.process_name
    monkeypatch.setattr(multiprocessing.current_process(), "name", "VllmWorker-7")
    monkeypatch.setattr(evidence_module, "process_role", lambda: "worker")
    evidence.flush()
    saved = json.loads(evidence.marker_path.read_text())
    assert (saved["role"], saved["process_name"]) == (role, name) != ("worker", "VllmWorker-7")


def test_launch_configs_reach_the_marker_and_a_possible_defect_is_warned_word_for_word(tmp_path, emitted):
    evidence = Evidence(settings_for(tmp_path))
    configs = {"arch": "gfx950", "device": "AMD Instinct MI355X", "kernels": {"qk_cache_kernel": {
        "file": "/opt/tuned/gfx950.json", "arch": "gfx950", "tuned_on": "AMD Instinct MI355X", "tuned_here": True}}}
    evidence.set_launch_configs(configs)
    assert json.loads(evidence.marker_path.read_text())["launch_configs"] == configs
    evidence.set_upstream_defects([{"name": "w_uk_t_read_early", "what": "reads W_UK_T before load",
                                    "when": "a layer built before the weights load", "triggered": None}])
    assert emitted == [(logging.WARNING, "k3-amd-overlay: this vLLM has a known defect that this environment may "
                                         "trigger (a layer built before the weights load), with or without the "
                                         "overlay: w_uk_t_read_early: reads W_UK_T before load")]


def _three_batches(evidence: Evidence) -> None:
    hook = evidence.effective_hook("qk_cache", "model.layers.2.self_attn")
    for _ in range(3):  # batches 1 and 2 rewrite the marker; batch 3 waits for the interval or the exit flush
        execute_model(hook, 9)


def test_a_fork_started_childs_last_counts_reach_its_marker_at_exit(tmp_path, monkeypatch):
    """vLLM's fork start method: a worker's counts since its marker's last rewrite must still reach
    the marker when it exits (multiprocessing ends such a child with os._exit, which runs no atexit
    function: the flush is a multiprocessing finalizer)."""
    monkeypatch.setattr(process_hooks, "register_exit_flush", REAL_EXIT_FLUSH)  # the real registration
    evidence = Evidence(settings_for(tmp_path))
    child = multiprocessing.get_context("fork").Process(target=_three_batches, args=(evidence,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    saved = json.loads((tmp_path / "m" / f"{child.pid}.json").read_text())
    assert saved["fusions"]["qk_cache"]["runs"]["served"] == 3


def test_the_measurement_and_later_launch_config_entries_reach_the_marker(tmp_path):
    """``set_measurement`` and ``update_launch_configs`` write what they are given at once, the latter
    added to what ``set_launch_configs`` recorded (the degraded configs and the compile seconds)."""
    import random

    evidence = Evidence(settings_for(tmp_path))
    measurement = {"file": f"/opt/tuned/gfx950-{random.randrange(10**6)}.measured.json",
                   "stock_buckets": {"qk_cache": [[129, 256, 0.93]]}}
    evidence.set_measurement(measurement)
    assert json.loads(evidence.marker_path.read_text())["measurement"] == measurement
    evidence.set_launch_configs({"arch": "gfx950", "kernels": {}})
    seconds = round(random.uniform(0.1, 9.0), 3)
    evidence.update_launch_configs({"compile_seconds": {"qk_cache_kernel": seconds}})
    assert json.loads(evidence.marker_path.read_text())["launch_configs"] == {
        "arch": "gfx950", "kernels": {}, "compile_seconds": {"qk_cache_kernel": seconds}}


def test_after_stop_writing_no_change_is_written_anywhere(tmp_path, monkeypatch):
    """``stop_writing`` (the doctor, before it removes its marker directory): later changes stay in the
    record and are written nowhere, neither the old marker nor a file in the working directory."""
    evidence = Evidence(settings_for(tmp_path))
    evidence.flush()
    marker = evidence.marker_path
    before = marker.read_text()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    evidence.stop_writing()
    evidence.set_fusion("qk_cache", FusionState.REFUSED, "stopped")
    evidence.effective_hook("qkv_norm", "layer.0")(8)
    evidence.flush()
    assert marker.read_text() == before and list(elsewhere.iterdir()) == []
    assert evidence.fusion("qk_cache").reason == "stopped" and evidence.fusion("qkv_norm").effective
