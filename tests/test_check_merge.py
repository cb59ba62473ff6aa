"""``check --merge``: a deployment across nodes holds only where every node file contributes live
evidence matching the expectation. An empty node, a node whose own check failed, another
expectation's file, the same host twice, another host's record, a static or merged file, a node
with captures or warm-up only: each fails the deployment, naming the node (host, file) and what to
do. Every line names ``host H pid N``: the same pid on two nodes is told apart."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from records import off_process, process

from k3_amd_overlay.commands.cli import main
from k3_amd_overlay.package import __version__


def node(tmp_path: Path, host: str, *records: dict[str, Any], expect: str = "fused", holds: bool = True,
         file: str | None = None, **fields: Any) -> str:
    """One node's `check --json` output as that node's check writes it (records carry its host)."""
    path = tmp_path / (file or f"{host}.json")
    data = {"expect": expect, "holds": holds, "lines": [], "notes": [], "host": host,
            "marker_dir": "/run/user/1000/k3-amd-overlay", "records": [{**r, "host": host} for r in records],
            "checked_at": time.time(), **fields}
    path.write_text(json.dumps(data))
    return str(path)


def merge(capsys: pytest.CaptureFixture[str], expect: str, *files: str, json_out: bool = False) -> tuple[int, str]:
    code = main(["check", "--expect", expect, "--merge", *files, *(["--json"] if json_out else [])])
    return code, capsys.readouterr().out


def test_two_nodes_with_the_same_pid_hold_and_each_line_names_the_host(tmp_path, capsys):
    a = node(tmp_path, "node-a", process(pid=11))
    b = node(tmp_path, "node-b", process(pid=11, served=0, captured=(1,), replayed=4))
    code, out = merge(capsys, "fused", a, b)
    assert code == 0, out
    assert "ok   host node-a pid 11 (worker, vLLM 0.33.0): qk_cache=applied" in out
    assert "ok   host node-b pid 11 (worker, vLLM 0.33.0): qk_cache=applied" in out
    assert ("4 replays of the 1 graph (host node-b pid 11: sizes 1) that recorded it, for served batches (host node-b "
            "pid 11: 4); 3 eager batches after startup (host node-a pid 11: 3)") in out  # per host and pid
    assert "HOLDS: expect fused (2 processes)" in out


def test_a_node_with_no_process_fails_the_deployment_saying_how_to_get_its_evidence(tmp_path, capsys):
    """The node started without the plugin, without K3_AMD_OVERLAY or with another marker
    directory: it serves stock and its check found 0 processes."""
    a = node(tmp_path, "node-a", process(pid=11))
    empty = node(tmp_path, "node-b", holds=False)
    code, out = merge(capsys, "fused", a, empty)
    assert code == 1, out
    assert (f"FAIL node host node-b ({empty}): 0 processes: no live vLLM process left overlay evidence (is the "
            "server up there, k3-amd-overlay installed in its Python, K3_AMD_OVERLAY set, the marker directory the "
            "same?); run `k3-amd-overlay check --expect fused --json > FILE` on host node-b while its vLLM serves, "
            "and merge that FILE") in out
    assert "DOES NOT HOLD" in out


def test_a_node_whose_own_check_did_not_hold_fails_the_deployment(tmp_path, capsys):
    a = node(tmp_path, "node-a", process(pid=11))
    said = "FAIL absorb_qk_cache: no process has run its fused path yet"
    b = node(tmp_path, "node-b", process(pid=12), holds=False, lines=[said])
    code, out = merge(capsys, "fused", a, b)
    assert code == 1, out
    assert f"FAIL node host node-b ({b}): its own processes do not prove fused: absorb_qk_cache: no process" in out


def test_a_node_judged_against_another_expectation_fails(tmp_path, capsys):
    a = node(tmp_path, "node-a", process(pid=11))
    b = node(tmp_path, "node-b", process(pid=12), expect="stock", holds=False)
    code, out = merge(capsys, "fused", a, b)
    assert code == 1 and f"FAIL node host node-b ({b}): judged there against --expect stock, not fused" in out


def test_the_same_host_twice_fails(tmp_path, capsys):
    a = node(tmp_path, "node-a", process(pid=11))
    again = node(tmp_path, "node-a", process(pid=11), file="copy.json")
    code, out = merge(capsys, "fused", a, again)
    assert code == 1, out
    assert f"FAIL node host node-a ({again}): host node-a again (also {a}): one file per node, each once" in out


def test_another_hosts_record_in_a_node_file_fails(tmp_path, capsys):
    a = node(tmp_path, "node-a", process(pid=11))
    b = tmp_path / "node-b.json"
    data = json.loads(Path(node(tmp_path, "node-b", process(pid=12))).read_text())
    data["records"].append({**process(pid=13), "host": "node-c"})
    b.write_text(json.dumps(data))
    code, out = merge(capsys, "fused", a, str(b))
    assert code == 1, out
    assert f"FAIL node host node-b ({b}): holds host node-c pid 13 (worker, vLLM 0.33.0), another host's process" in out


@pytest.mark.parametrize("partial,why", [
    (process(pid=12, served=0, captured=(1, 2)), "captured into 2 graphs (host node-b pid 12: sizes 1, 2) at startup"),
    (process(pid=12, served=0, warmup=4), "its fused path ran only in vLLM's own warm-up batches (4)"),
    (process("stock", "forced-stock", pid=12), "host node-b pid 12 (worker, vLLM 0.33.0): qkv_norm=forced-stock"),
])
def test_a_node_with_captures_warm_up_or_stock_only_fails_though_another_served(tmp_path, capsys, partial, why):
    """Summed over the deployment the served traffic of node-a would cover node-b: each node must
    prove it on its own."""
    a = node(tmp_path, "node-a", process(pid=11))
    b = node(tmp_path, "node-b", partial)
    code, out = merge(capsys, "fused", a, b)
    assert code == 1, out
    assert f"FAIL node host node-b ({b}): its own processes do not prove fused: " in out and why in out


@pytest.mark.parametrize("fields", [{"marker_dir": None}, {"source": "static"}, {"source": "merge"}])
def test_a_static_or_merged_file_is_no_nodes_live_evidence(tmp_path, capsys, fields):
    a = node(tmp_path, "node-a", process(pid=11))
    b = node(tmp_path, "node-b", process(pid=12), **fields)
    code, out = merge(capsys, "fused", a, b)
    assert code == 1, out
    assert f"FAIL node host node-b ({b}): not read from that node's live markers (a --static or --merge output)" in out


def test_off_across_nodes_needs_an_off_record_on_each_node(tmp_path, capsys):
    a = node(tmp_path, "node-a", off_process(pid=11), expect="off")
    b = node(tmp_path, "node-b", off_process(pid=12), expect="off")
    assert merge(capsys, "off", a, b)[0] == 0
    empty = node(tmp_path, "node-c", expect="off")
    code, out = merge(capsys, "off", a, empty)
    assert code == 1, out
    assert f"FAIL node host node-c ({empty}): 0 processes: no live vLLM process left an off record" in out
    on = node(tmp_path, "node-d", process(pid=12), expect="off", holds=False)
    code, out = merge(capsys, "off", a, on)
    assert code == 1 and "FAIL host node-d pid 12 (worker, vLLM 0.33.0): overlay in auto mode" in out, out


def test_the_json_of_a_failed_merge_names_the_node(tmp_path, capsys):
    a = node(tmp_path, "node-a", process(pid=11))
    empty = node(tmp_path, "node-b")
    code, out = merge(capsys, "fused", a, empty, json_out=True)
    data = json.loads(out)
    assert code == 1 and data["holds"] is False and data["source"] == "merge"
    assert any(line.startswith(f"FAIL node host node-b ({empty}): 0 processes") for line in data["lines"])
    assert [r["host"] for r in data["records"]] == ["node-a"]


def test_a_record_without_a_host_is_its_node_files(tmp_path, capsys):
    """A record carrying no host (a marker an older overlay wrote, read by this one's check): it is
    that node's."""
    a = tmp_path / "old.json"
    a.write_text(json.dumps({"expect": "fused", "holds": True, "lines": [], "notes": [], "host": "node-a",
                             "marker_dir": "/tmp/m", "records": [process(pid=11)], "checked_at": time.time()}))
    b = node(tmp_path, "node-b", process(pid=11))
    code, out = merge(capsys, "fused", str(a), b)
    assert code == 0 and "ok   host node-a pid 11 (worker" in out, out


HOW_B = ("run `k3-amd-overlay check --expect fused --json > FILE` on host node-b while its vLLM serves, and merge "
         "that FILE")


def test_a_node_file_from_an_earlier_run_or_an_older_overlay_fails_the_deployment(tmp_path, capsys):
    """A node file proves that node as it was when its check ran: one written before --max-age (an
    earlier run, another deployment's), or one that says not when (an older overlay wrote it), fails."""
    a = node(tmp_path, "node-a", process(pid=11))
    old = node(tmp_path, "node-b", process(pid=12), checked_at=time.time() - 3600)
    code, out = merge(capsys, "fused", a, old)
    assert code == 1 and "DOES NOT HOLD" in out, out
    assert re.search(rf"FAIL node host node-b \({re.escape(old)}\): checked 36\d\d s ago, more than --max-age 900 s: "
                     "it proves", out), out  # 3600 s and the seconds a loaded machine took since
    assert code == 1 and HOW_B + " (or pass a larger --max-age to judge an archived run)" in out
    assert main(["check", "--expect", "fused", "--merge", a, old, "--max-age", "7200"]) == 0
    undated = node(tmp_path, "node-c", process(pid=13), checked_at=None)
    code, out = merge(capsys, "fused", a, undated)
    assert code == 1 and f"FAIL node host node-c ({undated}): says not when it was checked (an older " in out, out


def test_nodes_running_other_overlay_or_vllm_versions_are_not_one_deployment(tmp_path, capsys):
    a = node(tmp_path, "node-a", process(pid=11))
    b = node(tmp_path, "node-b", process(pid=12, overlay_version="0.1.0", vllm_version="0.29.0"))
    code, out = merge(capsys, "fused", a, b)
    assert code == 1, out
    assert (f"FAIL not one deployment: overlay versions differ: {__version__} (host node-a pid 11); 0.1.0 (host "
            "node-b pid 12)") in out
    assert ("FAIL not one deployment: vllm versions differ: 0.33.0 (host node-a pid 11); 0.29.0 (host node-b pid "
            "12)") in out


@pytest.mark.parametrize("args,said", [
    (["--max-age", "0"], "--max-age 0: seconds, more than 0 and finite"),
    (["--max-age", "-5"], "--max-age -5: seconds, more than 0 and finite"),
    (["--max-age", "nan"], "--max-age nan: seconds, more than 0 and finite"),
    (["--max-age", "inf"], "--max-age inf: seconds, more than 0 and finite"),
])
def test_max_age_must_be_positive(tmp_path, capsys, args, said):
    a = node(tmp_path, "node-a", process(pid=11))
    assert main(["check", "--expect", "fused", "--merge", a, *args]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("when", [float("nan"), float("inf"), "yesterday", True])
def test_a_node_file_whose_check_time_is_no_time_is_refused(tmp_path, capsys, when):
    """NaN compares false both ways: an age test written as "older than" would let it through."""
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"expect": "fused", "holds": True, "lines": [], "notes": [], "host": "node-a",
                                "marker_dir": "/m", "records": [{**process(pid=11), "host": "node-a"}],
                                "checked_at": when}))
    assert main(["check", "--expect", "fused", "--merge", str(path)]) == 2
    assert f"its checked_at is {when!r}, not a time" in capsys.readouterr().err


def test_max_age_without_merge_is_a_usage_error(capsys):
    assert main(["check", "--expect", "fused", "--max-age", "60"]) == 2
    assert "--max-age applies to --merge only" in capsys.readouterr().err


def test_a_check_json_says_when_it_ran_and_which_overlay_ran_it(tmp_path, capsys):

    before = time.time()
    main(["check", "--expect", "fused", "--marker-dir", str(tmp_path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert before <= data["checked_at"] <= time.time() and data["overlay_version"] == __version__


def test_a_node_file_can_come_on_standard_input(tmp_path, capsys, monkeypatch):
    """``-`` reads one node's check --json from standard input, judged with the files beside it."""
    import io

    a = node(tmp_path, "node-a", process(pid=11))
    b = Path(node(tmp_path, "node-b", process(pid=12))).read_text()
    monkeypatch.setattr("sys.stdin", io.StringIO(b))
    code, out = merge(capsys, "fused", a, "-")
    assert code == 0, out
    assert "ok   host node-b pid 12 (worker, vLLM 0.33.0): qk_cache=applied" in out
    assert "HOLDS: expect fused (2 processes)" in out


def test_a_node_file_can_come_through_a_pipe_as_from_process_substitution(tmp_path, capsys):
    """``--merge <(ssh node-b k3-amd-overlay check --json)`` names a pipe: read as ``-`` is (the
    exception docs/cli.md makes to refusing a FIFO where a file is read)."""
    import os
    import threading

    a = node(tmp_path, "node-a", process(pid=11))
    text = Path(node(tmp_path, "node-b", process(pid=12))).read_text()
    fifo = tmp_path / "node-b.pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)
    writer.start()
    code, out = merge(capsys, "fused", a, str(fifo))
    writer.join(timeout=10)
    assert code == 0, out
    assert "ok   host node-b pid 12 (worker, vLLM 0.33.0): qk_cache=applied" in out


def test_a_process_listed_twice_in_a_node_file_counts_once(tmp_path, capsys):
    """A node file whose records list one process twice (a copied marker read by an older check, a file
    edited by hand): that process counts once, its batches once; two records of it that differ fail."""
    a = node(tmp_path, "node-a", process(pid=11), process(pid=11))
    b = node(tmp_path, "node-b", process(pid=12))
    code, out = merge(capsys, "fused", a, b)
    assert code == 0, out
    assert f"ok   node host node-a ({a}): 1 live process prove fused there" in out
    assert "info host node-a pid 11: 2 copies of its record, counted once" in out
    assert f"note {a}: 1 process from host node-a" in out
    assert "6 eager batches after startup (host node-a pid 11: 3, host node-b pid 12: 3)" in out, out
    assert out.endswith("HOLDS: expect fused (2 processes)\n"), out
    differ = node(tmp_path, "node-a", process(pid=11), process(pid=11, served=40), file="differ.json")
    code, out = merge(capsys, "fused", differ, b)
    assert code == 1 and "FAIL host node-a pid 11: 2 records of one process that differ: which one is its own is " \
                         "unknown" in out, out
