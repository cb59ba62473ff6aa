"""Every rank of vLLM's world and this boot only: a process that built K3 layers records its global rank,
the world's size and vLLM's node count, and its host's boot id. ``check`` fails where a rank of that
world left no live record (its marker unwritten: what it ran is unknown), where two processes name one
rank or name different worlds; a node of several may lack the other nodes' ranks, ``--merge`` may not.
A marker written before the host last booted is stale, whatever its pid and start time say. Each of
these held (a false yes) before the records said where they sat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from records import judge, process

from k3_amd_overlay import markers
from k3_amd_overlay.commands.cli import main
from k3_amd_overlay.record import MarkerRecord, RecordError


def ranked(rank: int, size: int = 8, nodes: int | None = 1, **fields) -> dict:
    """A worker's fused record at ``rank`` of a world of ``size`` (pid 100 + rank)."""
    return process(pid=100 + rank, host="h", rank=rank, world_size=size, nodes=nodes, **fields)


def _fails(verdict) -> list[str]:
    return [line for line in verdict.lines if line.startswith("FAIL ")]


def test_every_rank_of_one_node_left_a_record_holds_and_says_so():
    verdict = judge([ranked(r) for r in range(8)], "fused", None, require_effective=True)
    assert verdict.holds, verdict.lines
    assert "info ranks 0-7 of a world of 8 ranks over 1 node: each left a live record" in verdict.lines


@pytest.mark.parametrize("expect,mode,state", [("fused", "auto", "applied"), ("stock", "stock", "forced-stock")])
def test_a_rank_that_left_no_record_fails_naming_it(expect, mode, state):
    records = [ranked(r, mode=mode, state=state) for r in (0, 1, 2, 3, 4, 6, 7)]
    verdict = judge(records, expect, None, require_effective=False)
    assert not verdict.holds
    assert _fails(verdict) == [
        "FAIL rank 5 of a world of 8 ranks over 1 node left no live record: what ran there is unknown (a rank whose "
        "marker could not be written says why in its log; on several nodes, judge each node's check --json together "
        "with --merge)"], verdict.lines


def test_a_world_of_unknown_nodes_is_judged_as_one_node():
    verdict = judge([ranked(0, size=2, nodes=None)], "fused", None, require_effective=False)
    assert not verdict.holds and "FAIL rank 1 of a world of 2 ranks left no live record" in " ".join(verdict.lines)


def test_one_node_of_two_holds_for_its_own_ranks_and_says_which_it_did_not_see():
    verdict = judge([ranked(r, size=16, nodes=2) for r in range(8)], "fused", None, require_effective=True)
    assert verdict.holds, verdict.lines
    assert ("info ranks 8-15 of a world of 16 ranks over 2 nodes are not on this host: this check proves this host's "
            "processes; --merge of every node's check --json proves the deployment") in verdict.lines
    one = judge([ranked(r, size=4, nodes=2) for r in range(3)], "fused", None, require_effective=True)
    assert one.holds and "info rank 3 of a world of 4 ranks over 2 nodes is not on this host: this check proves " \
        "this host's processes; --merge of every node's check --json proves the deployment" in one.lines, one.lines


def test_deployments_sharing_the_evidence_each_hold_every_rank_or_one_is_incomplete():
    """Two replicas of one world size on one host (or vLLM's independent data-parallel ranks of a dense
    model, each rank 0 of 1) hold each rank twice; a rank held once of them is one replica's missing rank.
    Worlds of other sizes are judged each on their own."""
    twice = [ranked(r, size=2) for r in (0, 1)] + [{**ranked(r, size=2), "pid": 300 + r} for r in (0, 1)]
    verdict = judge(twice, "fused", None, require_effective=False)
    assert verdict.holds, verdict.lines
    assert ("info ranks 0-1 of a world of 2 ranks over 1 node: each left a live record (2 deployments of this "
            "world)") in verdict.lines
    incomplete = judge(twice[:3], "fused", None, require_effective=False)
    assert _fails(incomplete) == [
        "FAIL rank 1 of a world of 2 ranks over 1 node left fewer live records than the others, 2 each (2 "
        "deployments of this world): one is incomplete: what ran there is unknown (a rank whose marker could not "
        "be written says why in its log; on several nodes, judge each node's check --json together with "
        "--merge)"], incomplete.lines
    worlds = judge([ranked(1, size=2), {**ranked(0, size=2), "pid": 300}, ranked(0, size=1)], "fused", None,
                   require_effective=False)
    assert worlds.holds, worlds.lines
    assert [line for line in worlds.lines if "of a world of" in line] == [  # smallest world first
        "info rank 0 of a world of 1 rank over 1 node: each left a live record",
        "info ranks 0-1 of a world of 2 ranks over 1 node: each left a live record"]


def test_a_rank_in_another_mode_fails_for_its_mode_not_as_missing():
    verdict = judge([ranked(0, size=2), ranked(1, size=2, mode="stock", state="forced-stock")], "fused", None,
                    require_effective=False)
    assert not verdict.holds and not any("live record" in line for line in _fails(verdict)), verdict.lines


def test_records_without_a_world_are_judged_as_before():
    """An API server or engine core builds no layer and joins no world: it names no rank."""
    verdict = judge([process(pid=3, host="h", role="api-server", layers=0), ranked(0, size=1)], "fused", None,
                    require_effective=True)
    assert verdict.holds, verdict.lines


BOTH = "both null, or a rank 0 to world_size - 1 of a world of 1 or more"


@pytest.mark.parametrize("fields,said", [
    ({"rank": 8, "world_size": 8}, "marker field 'rank' is 8, expected 0 to world_size - 1 (7)"),
    ({"rank": 0}, f"marker fields 'rank' (0) and 'world_size' (missing): {BOTH}"),
    ({"rank": None, "world_size": 4}, f"marker fields 'rank' (null) and 'world_size' (4): {BOTH}"),
    ({"world_size": 0, "rank": 0}, "'world_size' is 0, expected a whole number >= 1"),
    ({"rank": True, "world_size": 2}, "'rank' is True, expected a whole number >= 0"),
    ({"rank": "0", "world_size": 2}, "'rank' is '0', expected a whole number >= 0"),
    ({"rank": 0, "world_size": 2.0}, "'world_size' is 2.0, expected a whole number >= 1"),
    ({"rank": 0, "world_size": 2, "nodes": "1"}, "'nodes' is '1', expected a whole number >= 1"),
    ({"rank": 0, "world_size": 2, "nodes": 0}, "'nodes' is 0, expected a whole number >= 1"),
    ({"nodes": 2}, f"marker fields 'rank' (missing) and 'world_size' (missing): {BOTH}"),
    ({"boot_id": 7}, "marker field 'boot_id' is 7, expected a string or null"),
    ({"rank": 0, "world_size": 2**20 + 1}, "marker field 'world_size' is 1048577, expected at most 1048576"),
    ({"role": 5}, "marker field 'role' is 5, expected a string"),
    ({"process_name": None}, "marker field 'process_name' is None, expected a string"),
    ({"host": ["h"]}, "marker field 'host' is ['h'], expected a string"),
])
def test_a_record_naming_an_impossible_place_is_unreadable(fields, said):
    with pytest.raises(RecordError) as caught:
        MarkerRecord.from_json({**process(pid=3), **fields})
    assert str(caught.value) == said


def test_the_largest_world_a_record_may_name_is_read():
    record = MarkerRecord.from_json({**process(pid=3), "rank": 2**20 - 1, "world_size": 2**20, "nodes": 128})
    assert (record.rank, record.world_size, record.nodes) == (2**20 - 1, 2**20, 128)


def test_ranks_apart_are_named_apart():
    verdict = judge([ranked(r, size=9) for r in (0, 1, 3, 4, 8)], "fused", None, require_effective=False)
    assert "FAIL ranks 2, 5-7 of a world of 9 ranks over 1 node left no live record" in " ".join(verdict.lines)


def _node(tmp_path: Path, host: str, ranks: range, size: int = 16, nodes: int = 2) -> str:
    path = tmp_path / f"{host}.json"
    path.write_text(json.dumps({
        "expect": "fused", "holds": True, "lines": [], "notes": [], "host": host, "marker_dir": "/m",
        "source": "markers", "checked_at": time.time(),
        "records": [{**ranked(r, size=size, nodes=nodes), "host": host} for r in ranks]}))
    return str(path)


def test_a_merge_missing_a_node_fails_naming_its_ranks_and_holds_with_every_node(tmp_path, capsys):
    a, b = _node(tmp_path, "node-a", range(8)), _node(tmp_path, "node-b", range(8, 16))
    assert main(["check", "--expect", "fused", "--merge", a]) == 1
    out = capsys.readouterr().out
    assert ("FAIL ranks 8-15 of a world of 16 ranks over 2 nodes left no live record: what ran there is unknown (a "
            "rank whose marker could not be written says why in its log; every node's check must be merged)") in out
    assert main(["check", "--expect", "fused", "--merge", a, b]) == 0, capsys.readouterr().out


def test_a_merge_of_nodes_whose_records_miss_one_rank_fails(tmp_path, capsys):
    a, b = _node(tmp_path, "node-a", range(8)), _node(tmp_path, "node-b", range(9, 16))
    assert main(["check", "--expect", "fused", "--merge", a, b]) == 1
    assert "FAIL rank 8 of a world of 16 ranks over 2 nodes left no live record" in capsys.readouterr().out


def test_a_marker_of_an_earlier_boot_is_stale(tmp_path, monkeypatch):
    """The pid and start time of this very process, but another boot id: a marker kept on a disk across a
    reboot, whose process number and start tick came round again."""
    directory = markers.ensure_marker_dir(tmp_path / "m")
    mine = {**process(pid=os.getpid()), "boot_id": markers.boot_id()}
    markers.write_marker(directory, os.getpid(), mine)
    assert markers.boot_id() and [m.live for m in markers.read_markers(directory)] == [True]
    markers.write_marker(directory, os.getpid(), {**mine, "boot_id": "an-earlier-boot"})
    found = markers.read_markers(directory)
    assert [m.live for m in found] == [False]
    code = main(["check", "--expect", "fused", "--no-effective", "--marker-dir", str(directory)])
    assert code == 1


def test_a_record_says_its_boot_follows_its_world_and_a_forked_child_drops_its_parents_rank(tmp_path):
    """The world is read at every write (vLLM's elastic expert parallelism rescales it); a forked child
    inherits vLLM's world state, which names the parent's rank: it follows no world until it builds a
    model itself."""
    from k3_amd_overlay.evidence import Evidence
    from k3_amd_overlay.settings import load_settings

    settings = load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "m")})
    evidence = Evidence(settings)
    assert evidence.record.boot_id == markers.boot_id() is not None
    position = [(3, 8, 1)]
    evidence.follow_world(lambda: position[0])
    assert (evidence.record.rank, evidence.record.world_size, evidence.record.nodes) == (3, 8, 1)
    position[0] = (5, 16, 2)
    evidence.flush()
    written = MarkerRecord.from_json(json.loads((tmp_path / "m" / f"{os.getpid()}.json").read_text()))
    assert (written.rank, written.world_size, written.nodes) == (5, 16, 2)
    read, child = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its record names no rank, before or after a write
        os.close(read)
        evidence.flush()
        record = evidence.record
        os.write(child, json.dumps([record.pid, record.rank, record.world_size, record.nodes]).encode())
        os._exit(0)
    os.close(child)
    os.waitpid(pid, 0)
    with os.fdopen(read) as handle:
        assert json.loads(handle.read()) == [pid, None, None, None]


def test_a_pipeline_stage_without_mla_layers_names_its_rank(tmp_path, monkeypatch):
    """K3 is hybrid (KDA and MLA layers): a pipeline stage may build the text model with no MLA layer,
    so no layer decision is noted there. The wrapper of the text model's ``__init__`` still records the
    process's place in the world."""
    from k3_amd_overlay.evidence import Evidence
    from k3_amd_overlay.settings import load_settings
    from k3_amd_overlay.targets import k3_wrapper, vllm_env
    from k3_amd_overlay.targets.installer import LayerInstaller

    monkeypatch.setattr(vllm_env, "world_position", lambda: (1, 2, 1))
    settings = load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "m")})
    installer = LayerInstaller(settings, Evidence(settings))
    k3_wrapper.report_layers(installer)(lambda: None, object(), (), {})
    assert (installer.evidence.record.rank, installer.evidence.record.world_size) == (1, 2)


WORLD_PROBE = textwrap.dedent("""
    import json, socket
    from k3_amd_overlay.targets import vllm_env
    before = vllm_env.world_position()
    from vllm.distributed import parallel_state
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{port}")
    print("RESULT=" + json.dumps([before, vllm_env.world_position()]))
""")


@pytest.mark.vllm
def test_the_place_in_the_world_is_read_from_vllms_own_parallel_state():
    """The installed vLLM's ``init_distributed_environment`` (gloo, one rank): none before it, rank 0 of a
    world of 1 on 1 node after, as a CPU vLLM engine's only worker joins it."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-c", WORLD_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT=")]
    assert result and json.loads(result[-1].removeprefix("RESULT=")) == [None, [0, 1, 1]], proc.stdout[-2000:]
