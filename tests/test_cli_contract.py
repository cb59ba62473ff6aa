"""The exact contract of ``commands/cli.py`` beyond the verdicts it calls: which marker files the
local ``check`` counts as live, stale, unreadable or another host's, and the note for each (word for
word, as an operator reads them); what ``--prune`` removes and what it leaves; what ``--merge``
reads from each node file and the note it prints; what the static probe's subprocess is given and
each way its answer is read; the ``check --json`` object on each source; the tool dispatch."""

from __future__ import annotations

import importlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from kineto_traces import ATTENTION, kernel_trace
from records import off_process, process

from k3_amd_overlay import k3, markers
from k3_amd_overlay.commands import census, cli, usage
from k3_amd_overlay.commands.usage import EXIT_FAILED, UsageError
from k3_amd_overlay.record import MarkerRecord
from k3_amd_overlay.settings import MARKER_DIR

HOST = socket.gethostname()
ME = os.getpid()


def marker(directory: Path, name: str, record: dict[str, Any] | str) -> Path:
    path = directory / name
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return path


PARENT = os.getppid()  # a running pid that is not this process
OTHER_HOSTS_PIDS = (ME + 1, ME + 2)  # pids on other nodes (any: they are not looked up here)


@pytest.fixture
def markers_dir(tmp_path: Path) -> dict[str, Path]:
    """One file of each kind, each named as its writer names it (``<pid>.json``; the unreadable one
    aside): live here, stale here (a running pid with another start time: a reused pid), unreadable,
    another host's live pid, another host's dead one."""
    directory = tmp_path / "markers"
    directory.mkdir()
    live_elsewhere, dead_elsewhere = OTHER_HOSTS_PIDS
    return {
        "live": marker(directory, f"{ME}.json", off_process(pid=ME, host=HOST)),
        "stale": marker(directory, f"{PARENT}.json", off_process(pid=PARENT, host=HOST, start_ticks=1)),
        "unreadable": marker(directory, "c.json", "{not json"),
        "foreign": marker(directory, f"{live_elsewhere}.json", off_process(pid=live_elsewhere, host="node-z")),
        "foreign_dead": marker(directory, f"{dead_elsewhere}.json",
                               off_process(pid=dead_elsewhere, host="node-y", start_ticks=1)),
    }


def test_live_records_counts_each_kind_and_notes_each_file_word_for_word(markers_dir):
    directory = markers_dir["live"].parent
    records, notes = cli.live_records(directory, prune=False)
    assert [(r.pid, r.host, r.start_ticks) for r in records] == [(ME, HOST, markers.process_start_ticks(ME))]
    live_elsewhere, dead_elsewhere = OTHER_HOSTS_PIDS
    said = {
        "stale": f"host {HOST} pid {PARENT} is gone (or its pid was reused); stale, ignored (--prune removes such "
                 "files)",
        "unreadable": "unreadable marker: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        "foreign": f"host node-z pid {live_elsewhere} was written on another host, whose processes cannot be checked "
                   f"from {HOST}; ignored (a marker directory shared between nodes? give each node its own and judge "
                   "them with --merge)",
        "foreign_dead": f"host node-y pid {dead_elsewhere} was written on another host, whose processes cannot be "
                        f"checked from {HOST}; ignored (a marker directory shared between nodes? give each node its "
                        "own and judge them with --merge)",
    }
    assert notes == [f"markers read from {directory}: 1 live, 1 stale, 1 unreadable, 2 of other hosts",
                     *(f"note {markers_dir[kind]}: {said[kind]}" for kind in sorted(said, key=markers_dir.get))]
    assert all(path.exists() for path in markers_dir.values())  # without --prune nothing is removed


def test_a_record_without_a_start_time_is_stale_where_this_host_shows_one(tmp_path):
    """The plugin records its start time; a record of a running pid without one (an earlier process
    with that pid, or a hand-made file) proves nothing about that process and counts as stale."""
    marker(tmp_path, f"{ME}.json", off_process(pid=ME, host=HOST, start_ticks=None))
    records, notes = cli.live_records(tmp_path, prune=False)
    assert records == [] and notes == [
        f"markers read from {tmp_path}: 0 live, 1 stale, 0 unreadable",
        f"note {tmp_path / f'{ME}.json'}: host {HOST} pid {ME} runs, but the record has no start time to tell it "
        "from an earlier process with that pid; stale, ignored (--prune removes such files)"]


def test_prune_removes_only_this_hosts_stale_markers(markers_dir):
    directory = markers_dir["live"].parent
    records, notes = cli.live_records(directory, prune=True)
    assert [r.pid for r in records] == [ME]
    assert f"note {markers_dir['stale']}: host {HOST} pid {PARENT} is gone; stale marker removed (--prune)" in notes
    assert not markers_dir["stale"].exists()
    for kept in ("live", "unreadable", "foreign", "foreign_dead"):
        assert markers_dir[kept].exists(), kept  # another host's file is that host's to prune


def test_a_directory_without_other_hosts_says_no_host_count(tmp_path):
    marker(tmp_path, f"{ME}.json", off_process(pid=ME, host=HOST))
    records, notes = cli.live_records(tmp_path, prune=False)
    assert notes == [f"markers read from {tmp_path}: 1 live, 0 stale, 0 unreadable"] and len(records) == 1


def test_a_record_without_a_host_is_this_machines(tmp_path):
    marker(tmp_path, f"{ME}.json", off_process(pid=ME))
    records, _ = cli.live_records(tmp_path, prune=False)
    assert [r.host for r in records] == [HOST]


@pytest.mark.parametrize("kind,said", [("file", " (it is a file, not a directory)"),
                                       ("missing", " (no such directory)")])
def test_a_marker_dir_that_is_not_a_directory_is_named(tmp_path, kind, said):
    path = tmp_path / "markers"
    if kind == "file":
        path.write_text("{}")
    said = f"markers read from {path}: 0 live, 0 stale, 0 unreadable{said}"
    assert cli.live_records(path, prune=False) == ([], [said])


def test_check_json_reports_the_marker_dir_it_read_and_the_records(markers_dir, capsys, monkeypatch):
    directory = markers_dir["live"].parent
    monkeypatch.setenv(MARKER_DIR, str(directory))
    code = cli.main(["check", "--expect", "off", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"] is True and data["holds"] is True and data["exit_status"] == 0
    assert data["command"] == "check" and data["source"] == "markers" and data["expect"] == "off"
    assert data["marker_dir"] == str(directory) and data["host"] == HOST
    assert [r["pid"] for r in data["records"]] == [ME] and data["records"][0]["host"] == HOST
    assert data["notes"][0] == f"markers read from {directory}: 1 live, 1 stale, 1 unreadable, 2 of other hosts"
    # --marker-dir wins over the environment
    other = directory.parent / "other"
    code = cli.main(["check", "--expect", "off", "--json", "--marker-dir", str(other)])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["ok"] is False and data["exit_status"] == 1 and data["marker_dir"] == str(other)
    assert data["records"] == []


def test_check_text_ends_with_the_verdict_and_a_process_count(markers_dir, capsys, monkeypatch):
    monkeypatch.setenv(MARKER_DIR, str(markers_dir["live"].parent))
    assert cli.main(["check", "--expect", "off"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("markers read from ") and lines[-1] == "HOLDS: expect off (1 process)"
    assert cli.main(["check", "--expect", "fused"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "DOES NOT HOLD: expect fused (1 process)"


def test_the_default_marker_dir_is_the_per_user_one(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(MARKER_DIR, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    cli.main(["check", "--expect", "off", "--json"])
    assert json.loads(capsys.readouterr().out)["marker_dir"] == str(tmp_path / "k3-amd-overlay")


def node_file(tmp_path: Path, name: str, data: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_merged_records_reads_each_node_and_notes_its_count_and_host(tmp_path):
    two = node_file(tmp_path, "a.json", {"host": "node-a", "expect": "fused", "holds": True, "lines": ["ok", "3"],
                                         "marker_dir": "/m", "records": [process(pid=1), process(pid=2, host="x")]})
    one = node_file(tmp_path, "b.json", {"host": "node-b", "marker_dir": "/m", "source": "static",
                                         "records": [process(pid=3)]})
    none = node_file(tmp_path, "c.json", {"records": []})
    older = node_file(tmp_path, "d.json", {"marker_dir": "/m", "records": [process(pid=4)]})
    nodes, notes = cli.merged_records([two, one, none, older])
    assert notes == [f"note {two}: 2 processes from host node-a", f"note {one}: 1 process from host node-b",
                     f"note {none}: 0 processes from host unknown", f"note {older}: 1 process from host unknown"]
    a, b, c, d = nodes
    assert (a.source, a.host, a.expect, a.holds, a.live, a.lines) == (two, "node-a", "fused", True, True, ["ok", "3"])
    assert [(r.pid, r.host) for r in a.records] == [(1, "node-a"), (2, "x")]  # a record's own host wins
    assert (b.host, b.expect, b.holds, b.live, b.lines) == ("node-b", None, None, False, [])  # a --static output
    assert (c.host, c.live, c.records) == (None, False, [])  # no marker_dir: not read from live markers
    assert [r.host for r in d.records] == [""] and d.live is True  # neither says: not this machine's


@pytest.mark.parametrize("data,detail", [
    ({"host": "h"}, "its records are None, not a list"),
    ([1, 2], "its JSON is a list, not an object holding a list of records"),
    ({"records": 5}, "its records are 5, not a list"),
    ({"records": [{"mode": "auto"}]}, "records[0]: marker field 'pid' is missing, expected a process id"),
    ({"records": [process(pid=3), {**process(pid=4), "fusions": {"qk_cache": {"state": "zzz"}}}]},
     "records[1]: fusion 'qk_cache': 'state' is 'zzz'; allowed: pending, applied, upstream, forced-stock, refused, "
     "disabled"),
    ({"records": [{**process(pid=4), "fusions": {"qkv_norm": {"state": "applied", "runs": [1]}}}]},
     "records[0]: fusion 'qkv_norm': 'runs' is [1], expected an object of phase: count"),
    ({"records": [[4]]}, "records[0]: a record is a JSON object (pid, mode, fusions, ...), not a list"),
    ({"records": [], "checked_at": 10 ** 400}, "its checked_at is 1000"),  # an OverflowError before
    ({"records": [], "host": ["node-a"]}, "its host is ['node-a'], not a host name"),  # a TypeError in the verdict
])
def test_merged_records_refuses_a_file_that_is_not_a_check_output_naming_it(tmp_path, data, detail):
    path = node_file(tmp_path, "bad.json", data)
    with pytest.raises(UsageError) as raised:
        cli.merged_records([path])
    assert str(raised.value).startswith(f"--merge: {path} is not the output of `k3-amd-overlay check --json`: {detail}")


def test_merged_records_reads_standard_input_for_a_dash(monkeypatch):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(read=lambda *a: json.dumps(
        {"host": "node-s", "marker_dir": "/m", "records": [process(pid=9)]})))
    nodes, notes = cli.merged_records(["-"])
    assert notes == ["note -: 1 process from host node-s"] and nodes[0].records[0].host == "node-s"


class FakeRun:
    """subprocess.run as the static probe calls it: records the call, answers ``result``."""

    def __init__(self, stdout: str = "", stderr: str = "", returncode: int = 0, raises: Exception | None = None):
        self.result = subprocess.CompletedProcess([], returncode, stdout, stderr)
        self.raises = raises
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        directory = kwargs["env"][MARKER_DIR]
        self.calls.append((argv, {**kwargs, "mode": os.stat(directory).st_mode & 0o777}))
        if self.raises:
            raise self.raises
        return self.result


def probe(monkeypatch, fake: FakeRun, **kwargs: Any) -> tuple[MarkerRecord | None, str]:
    monkeypatch.setattr(cli.subprocess, "run", fake)
    return cli.static_record(**kwargs)


def test_the_static_probe_runs_this_python_with_a_private_throwaway_marker_dir(monkeypatch):
    monkeypatch.setenv("K3OVL_SEEN_BY_PROBE", "yes")
    record = off_process(pid=77)
    fake = FakeRun(stdout="loading\nK3_AMD_OVERLAY_RECORD=" + json.dumps(record) + "\n")
    got, reason = probe(monkeypatch, fake, timeout=12.0)
    assert reason == "" and got is not None and got.pid == 77
    (argv, kwargs), = fake.calls
    assert argv == [sys.executable, "-c", cli.STATIC_PROBE]
    assert kwargs["timeout"] == 12.0 and kwargs["capture_output"] is True and kwargs["text"] is True
    assert kwargs["env"]["K3OVL_SEEN_BY_PROBE"] == "yes" and kwargs["mode"] == 0o700
    assert not os.path.exists(kwargs["env"][MARKER_DIR])  # removed after the probe


@pytest.mark.parametrize("fake,reason", [
    (FakeRun(raises=subprocess.TimeoutExpired("python", 7)),
     "the probe took over 7 s (vLLM plugin loading + the K3 AMD import)"),
    (FakeRun(stdout="K3_AMD_OVERLAY_RECORD=null\n"),
     "vLLM's plugin loading never ran k3-amd-overlay's plugin in this Python (is k3-amd-overlay installed in it, "
     "under the vllm.general_plugins entry point?)"),
    (FakeRun(stdout="K3_AMD_OVERLAY_RECORD={oops\n"), "unreadable record from the static probe: Expecting property"),
    (FakeRun(stdout='K3_AMD_OVERLAY_RECORD={"pid": 1}\n'), "unreadable record from the static probe: marker field "),
    (FakeRun(stdout="out\n", stderr="Traceback\n  File x\nImportError: no vllm\n  \n", returncode=1),
     "vLLM plugin loading or the K3 AMD import failed: ImportError: no vllm (`k3-amd-overlay doctor` says more)"),
    (FakeRun(stdout="first\n  last said  \n\n", returncode=1),
     "vLLM plugin loading or the K3 AMD import failed: last said (`k3-amd-overlay doctor` says more)"),
    (FakeRun(returncode=3),
     "vLLM plugin loading or the K3 AMD import failed: exit 3 (`k3-amd-overlay doctor` says more)"),
])
def test_each_way_the_static_probe_ends_is_one_line(monkeypatch, fake, reason):
    got, said = probe(monkeypatch, fake, timeout=7.0)
    assert got is None and said.startswith(reason) and "\n" not in said


def test_a_probe_whose_vllm_plugins_leave_the_overlay_out_says_so_not_not_installed(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    got, said = probe(monkeypatch, FakeRun(stdout="K3_AMD_OVERLAY_RECORD=null\n"), timeout=7.0)
    assert got is None and said.startswith("VLLM_PLUGINS='lora_filesystem_resolver' does not name k3_amd_overlay")
    assert "VLLM_PLUGINS=lora_filesystem_resolver,k3_amd_overlay" in said and "installed" not in said


def test_fusions_are_split_trimmed_and_checked():
    assert cli._fusions(None) is None
    with pytest.raises(UsageError, match="--fusions '' names no fusion"):
        cli._fusions("")  # "$FUSIONS" unset in a script: not "every fusion each process requested"
    assert cli._fusions(" qk_cache , qkv_norm ") == ["qk_cache", "qkv_norm"]
    with pytest.raises(UsageError, match=r"--fusions 'qk_cache, ,qkv_norm': an empty name \(a stray comma\?\)"):
        cli._fusions("qk_cache, ,qkv_norm")  # "qk_cache,$OTHER" with OTHER unset would judge one fusion of two
    with pytest.raises(UsageError, match="--fusions ',' names no fusion; allowed: qkv_norm, qk_cache, absorb_qk_cache"):
        cli._fusions(",")  # an empty list judged nothing: it must not pass as "every fusion asked held"


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_marker_dir_is_a_usage_error_not_the_default_directory(blank, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["check", "--expect", "fused", "--marker-dir", blank])
    assert exited.value.code == 2
    assert (f"argument --marker-dir: {blank!r} names no path (an empty value: an unset variable?); give the path, or "
            "leave the option out for its default") in capsys.readouterr().err


@pytest.mark.parametrize("blank", ["   ", "\t"])
def test_a_blank_marker_dir_variable_is_the_settings_usage_error(blank: str, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """K3_AMD_OVERLAY_MARKER_DIR holding only blanks was read as a directory of that name relative to here;
    it is the settings module's error, a usage error naming the variable; --marker-dir still wins over it."""
    monkeypatch.setenv(MARKER_DIR, blank)
    assert cli.main(["check", "--expect", "fused"]) == 2
    assert f"check: error: {MARKER_DIR}={blank!r} names no directory; unset it for the per-user directory" in (
        capsys.readouterr().err)
    assert cli.main(["check", "--expect", "off", "--marker-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().out.startswith(f"markers read from {tmp_path}: 0 live")


@pytest.mark.parametrize("expect,option,said", [
    ("off", "--allow-mixed", "--allow-mixed applies to --expect fused only (it accepts a partly fused process), not "
                             "--expect off"),
    ("stock", "--allow-mixed", "--allow-mixed applies to --expect fused only (it accepts a partly fused process), not "
                               "--expect stock"),
    ("off", "--no-effective", "--no-effective applies to --expect fused only (it drops the need for served traffic on "
                              "a fused path), not --expect off"),
    ("stock", "--no-effective", "--no-effective applies to --expect fused only (it drops the need for served traffic "
                                "on a fused path), not --expect stock"),
    ("off", "--fusions=qkv_norm", "--fusions applies to --expect fused or stock only (an off process runs no fusion "
                                  "to judge), not --expect off"),
])
def test_an_option_the_expectation_ignores_is_a_usage_error(expect: str, option: str, said: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--allow-mixed and --no-effective judge a fused arm, --fusions a fused or stock one: given with an
    expectation that ignores them they were dropped without a word; each is a usage error naming it."""
    for source in (["--marker-dir", str(tmp_path)], ["--merge", str(tmp_path / "node.json")], ["--static"]):
        assert cli.main(["check", "--expect", expect, option, *source]) == 2
        assert capsys.readouterr().err.endswith(f"check: error: {said}\n")


def test_fusions_still_name_the_fusions_a_stock_arm_is_judged_on(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--fusions means something for --expect stock (only those fusions are judged): no usage error there."""
    record = process("stock", "forced-stock", pid=ME, host=HOST)
    record["fusions"]["qkv_norm"]["state"] = "refused"  # not the stock arm's state: judged, it fails
    marker(tmp_path, f"{ME}.json", record)
    assert cli.main(["check", "--expect", "stock", "--marker-dir", str(tmp_path)]) == 1
    capsys.readouterr()
    assert cli.main(["check", "--expect", "stock", "--fusions", "qk_cache", "--marker-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "HOLDS: expect stock (1 process)"


def test_a_marker_dir_option_naming_a_file_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "markers"
    path.write_text("{}")
    assert cli.main(["check", "--expect", "fused", "--marker-dir", str(path)]) == 2
    assert f"--marker-dir {path}: a file, not a directory of markers" in capsys.readouterr().err


def test_the_check_json_usage_error_has_checks_keys():
    data = cli._check_json_error("bad")
    assert {k: data[k] for k in ("expect", "holds", "lines", "notes", "host", "source", "marker_dir", "records")} == {
        "expect": None, "holds": False, "lines": ["FAIL usage: bad"], "notes": [], "host": HOST, "source": None,
        "marker_dir": None, "records": []}
    assert data["command"] == "check" and data["usage_error"] == "bad"


@pytest.fixture
def fake_tool(monkeypatch):
    """A tool module of the shape cli.TOOLS names: its parser, its main, what it was given."""
    seen: dict[str, Any] = {}
    module = types.ModuleType("k3ovl_fake_tool")

    def parser():
        seen["parsed"] = True
        return types.SimpleNamespace(parse_args=lambda argv: seen.setdefault("parse_args", list(argv)))

    module.parser = parser
    module.main = lambda argv: seen.setdefault("main", list(argv)) and 5
    monkeypatch.setitem(sys.modules, "k3ovl_fake_tool", module)
    monkeypatch.setitem(cli.TOOLS, "faketool", ("k3ovl_fake_tool", "a fake"))
    return module, seen


def test_a_tool_without_needs_runs_with_its_arguments(fake_tool):
    _, seen = fake_tool
    assert cli.main(["faketool", "--x", "1"]) == 5
    assert seen == {"main": ["--x", "1"]}  # no parse before the run: it needs nothing from the image


def test_a_tool_with_needs_parses_first_then_looks_for_them(fake_tool, monkeypatch, capsys):
    module, seen = fake_tool
    module.legacy_argv = lambda argv: ["converted", *argv]
    monkeypatch.setitem(cli.TOOL_NEEDS, "faketool", ("torch", "triton"))
    looked: list[str] = []

    def find_spec(name, *args):
        looked.append(name)
        return None if name == "triton" else object()

    monkeypatch.setattr("importlib.util.find_spec", find_spec)
    assert cli.main(["faketool", "--json", "a"]) == 1
    assert seen == {"parsed": True, "parse_args": ["converted", "--json", "a"]} and looked == ["torch", "triton"]
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["command"] == "faketool" and data["missing"] == "triton" and data["ok"] is False
    assert data["exit_status"] == 1 and data["error"] == err.strip()
    assert err.startswith(f"k3-amd-overlay faketool: needs triton, which this Python ({sys.executable}) cannot import "
                          "(No module named 'triton'). Run k3-amd-overlay with the Python vLLM is installed in")


def test_a_tool_with_needs_is_parsed_and_checked_once_then_runs_checked(fake_tool, monkeypatch):
    module, seen = fake_tool
    checks: list[Any] = []
    module.check_args = checks.append
    module.checked_main = lambda args: seen.setdefault("checked_main", args) and 7
    monkeypatch.setitem(cli.TOOL_NEEDS, "faketool", ("torch",))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: object())
    assert cli.main(["faketool", "--x", "1"]) == 7
    assert checks == [["--x", "1"]] and seen["checked_main"] is checks[0] and "main" not in seen


def test_a_tools_usage_error_stops_before_its_run(fake_tool, monkeypatch, capsys):
    module, seen = fake_tool

    def check_args(args):
        raise UsageError("--x 1: not allowed")

    module.check_args = check_args
    module.parser = lambda: cli.Parser(prog="k3-amd-overlay faketool")
    module.checked_main = lambda args: seen.setdefault("checked_main", args) and 7
    monkeypatch.setitem(cli.TOOL_NEEDS, "faketool", ("torch",))
    assert cli.main(["faketool"]) == 2 and "checked_main" not in seen
    assert "k3-amd-overlay faketool: error: --x 1: not allowed" in capsys.readouterr().err


@pytest.mark.parametrize("tool,argv", [("tune", []), ("measure", ["--heads", "12"]), ("kernels", []), ("bench", [])])
def test_the_cli_checks_a_real_tools_arguments_once(tool, argv, monkeypatch):
    """Before, the CLI ran a tool's check_args and then the tool's main ran it again (measure read the
    model's config.json twice, tune --compare parsed its file twice)."""
    module = importlib.import_module(cli.TOOLS[tool][0])
    checks: list[Any] = []
    monkeypatch.setattr(module, "check_args", checks.append)
    monkeypatch.setattr(module, "checked_main", lambda args: 0)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: object())
    assert cli.main([tool, *argv]) == 0 and len(checks) == 1


def test_a_sub_tool_runs_its_own_module_with_the_rest(monkeypatch):
    got: dict[str, Any] = {}
    module = types.ModuleType("k3ovl_fake_sub")
    module.main = lambda argv: got.setdefault("argv", list(argv)) and 0
    monkeypatch.setitem(sys.modules, "k3ovl_fake_sub", module)
    monkeypatch.setitem(cli.SUBTOOLS, ("bench", "draw"), "k3ovl_fake_sub")
    assert cli.main(["bench", "draw", "f.json", "--x"]) == 0 and got == {"argv": ["f.json", "--x"]}


def test_another_missing_module_is_not_hidden(fake_tool):
    module, _ = fake_tool

    def main(argv):
        raise ModuleNotFoundError("No module named 'yaml'", name="yaml")

    module.main = main
    with pytest.raises(ModuleNotFoundError):
        cli.main(["faketool"])


@pytest.mark.parametrize("name,missing", [("torch", "torch"), ("triton.language", "triton"), ("torchvision", None),
                                          (None, None)])
def test_only_torch_and_triton_are_the_images_to_name(name, missing):
    assert usage.missing_image_module(ModuleNotFoundError("x", name=name)) == missing


def test_the_missing_message_without_a_command():
    said = cli._missing_message("", "torch", ModuleNotFoundError("No module named 'torch'"))
    assert said.startswith(f"k3-amd-overlay: needs torch, which this Python ({sys.executable}) cannot import")
    assert said.endswith("or install torch into this one (pip install torch; on ROCm, the ROCm build of torch, which "
                         "brings triton)")


def test_a_usage_error_is_the_subcommands_or_else_the_top_parsers():
    parser = cli.build_parser()
    assert cli._subcommand_parser(parser, "census").prog.endswith("census")
    assert cli._subcommand_parser(parser, "nope") is parser


@pytest.mark.parametrize("argv,said", [
    (["--layers", "0"], "--layers 0: from 1 to 1000000000"),
    (["--steps", "0"], "--steps 0: from 1 to 1000000000"),
])
def test_census_counts_below_one_are_usage_errors(tmp_path, capsys, argv, said):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    assert cli.main(["census", str(trace), *argv]) == 2
    assert said in capsys.readouterr().err


CHECK_KEYS = ["command", "ok", "exit_status", "expect", "holds", "lines", "notes", "host", "source", "marker_dir",
              "checked_at", "overlay_version", "records"]


def test_check_json_has_exactly_its_keys_in_order_one_space_indented(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(MARKER_DIR, str(tmp_path))
    cli.main(["check", "--expect", "off", "--json"])
    out = capsys.readouterr().out
    data = json.loads(out)
    assert list(data) == [*CHECK_KEYS, "error"] and out.startswith('{\n "command": "check",\n "ok": false,')
    fails = [line.removeprefix("FAIL ") for line in data["lines"] if line.startswith("FAIL ")]
    assert fails and data["error"] == f"does not hold: expect off: {fails[0]}"
    assert "error" not in json.loads(_held_check(tmp_path, capsys))


@pytest.mark.parametrize("how", ["usage error", "missing torch"])
def test_an_unjudged_check_json_has_a_judged_ones_keys_in_order_and_the_time_of_the_check(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Where check judged nothing (a usage error; torch missing under the doctor of ``--static``) its
    --json object still has every key of a judged check's, in the same order among its own, and
    ``checked_at`` is the time of this check: a script reading check's keys reads them on every path."""
    from k3_amd_overlay.commands import doctor

    def run_doctor(switch: str | None = None) -> None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(doctor, "run_doctor", run_doctor)
    monkeypatch.setenv("K3_AMD_OVERLAY", "1")
    not_a_dir = tmp_path / "markers"
    not_a_dir.write_text("x")
    argv, code, own = {"usage error": (["--marker-dir", str(not_a_dir)], 2, "usage_error"),
                       "missing torch": (["--static"], 1, "missing")}[how]
    before = time.time()
    assert cli.main(["check", "--expect", "fused", *argv, "--json"]) == code
    data = json.loads(capsys.readouterr().out)
    assert [k for k in data if k in CHECK_KEYS] == CHECK_KEYS and own in data and data["exit_status"] == code
    assert before <= data["checked_at"] <= time.time()


def _held_check(tmp_path: Path, capsys: Any) -> str:
    from k3_amd_overlay import markers

    markers.write_marker(tmp_path, os.getpid(), {**off_process(pid=os.getpid()),
                                                 "start_ticks": markers.process_start_ticks(os.getpid())})
    assert cli.main(["check", "--expect", "off", "--marker-dir", str(tmp_path), "--json"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "a symlink"])
def test_a_live_check_of_a_directory_anyone_could_write_does_not_hold(how: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Markers in a directory the server refuses (group/world-writable, a symlink) were written by no
    process of this overlay, and any user could have put them there: the check fails naming why, though
    the record in it would hold (the same directory at 0700 holds)."""
    from k3_amd_overlay import markers

    directory = tmp_path / "markers"
    directory.mkdir(mode=0o700)
    markers.write_marker(directory, os.getpid(), {**off_process(pid=os.getpid()),
                                                  "start_ticks": markers.process_start_ticks(os.getpid())})
    assert cli.main(["check", "--expect", "off", "--marker-dir", str(directory)]) == 0
    capsys.readouterr()
    read = directory
    if how == "a symlink":
        read = tmp_path / "link"
        read.symlink_to(directory)
    else:
        directory.chmod(0o770 if how == "group-writable" else 0o707)
    assert cli.main(["check", "--expect", "off", "--marker-dir", str(read), "--json"]) == EXIT_FAILED
    data = json.loads(capsys.readouterr().out)
    assert data["holds"] is False
    (line,) = [line for line in data["lines"] if line.startswith("FAIL ")]
    assert line.startswith(f"FAIL marker directory {read} is ") and line.endswith("nothing read there is evidence")


def test_every_failed_verdict_under_json_has_its_one_line_error(tmp_path, capsys, monkeypatch):
    """docs/cli.md: a failure has ``error``; a verdict's failure (doctor not ready, a census that does not
    hold, kernels falling short) had none, only its own keys."""
    from k3_amd_overlay.commands import compile_report, doctor

    monkeypatch.setattr(doctor, "run_doctor", lambda switch=None, serve_args=None: (
        {"verdict": "not ready: qk_cache cannot fuse here: no provider"}, False))
    assert cli.main(["doctor", "--json"]) == EXIT_FAILED
    assert json.loads(capsys.readouterr().out)["error"] == "not ready: qk_cache cannot fuse here: no provider"

    trace = kernel_trace(tmp_path / "t.json", {"fused_qk_cache_kernel": 3})
    assert cli.main(["census", str(trace), "--expect", "absorb=2", "--json"]) == EXIT_FAILED
    data = json.loads(capsys.readouterr().out)
    assert data["error"] == "does not hold: " + "; ".join(data["expect"]["problems"]) and data["expect"]["problems"]
    assert cli.main(["census", str(trace), "--expect", "qk_cache=3", "--json"]) == 0
    assert "error" not in json.loads(capsys.readouterr().out)

    short = {"problems": ["spills 4 VGPRs"]}
    monkeypatch.setattr(compile_report, "run_worker", lambda arch, device_name=None: {
        "kernels": [short, {"problems": []}], "unchecked": ["a tuned file went unchecked"]})
    monkeypatch.setattr(compile_report, "missing_kernels", lambda report, arch: [])  # two rows: a sample
    assert compile_report.main(["--arch", "gfx942", "--json"]) == EXIT_FAILED
    assert json.loads(capsys.readouterr().out)["error"] == ("1 of 2 configurations fall short on gfx942; a tuned file "
                                                            "went unchecked")


def static_check(monkeypatch, capsys, expect: str, *extra: str, switch: str | None = None,
                 probe: tuple[Any, str] | None = None, **env: str) -> tuple[int, dict[str, Any]]:
    """``check --static --json`` in this process: doctor and the probe replaced where the path reaches them."""
    from k3_amd_overlay.commands import doctor

    for name in [k for k in os.environ if k.startswith("K3_AMD_OVERLAY")]:
        monkeypatch.delenv(name)
    if switch is not None:
        monkeypatch.setenv("K3_AMD_OVERLAY", switch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    reached: list[str] = []
    mode = "auto" if switch else "off"
    monkeypatch.setattr(doctor, "run_doctor", lambda switch=None: reached.append("doctor") or (
        {"switch": {"mode": mode}, "vllm shape": {"recognised": "k3_decode_wrapper"}, "launch configs": {},
         "self-test": [], "fusions": {}}, True))
    monkeypatch.setattr(cli, "static_record", lambda timeout=600.0: reached.append("probe") or probe)
    code = cli.main(["check", "--expect", expect, "--static", "--json", *extra])
    data = json.loads(capsys.readouterr().out)
    data["reached"] = reached
    return code, data


@pytest.mark.parametrize("expect,wanted", [("fused", "1 (or a list of fusions)"), ("stock", "stock")])
def test_static_with_the_overlay_off_here_says_what_to_set(monkeypatch, capsys, expect, wanted):
    code, data = static_check(monkeypatch, capsys, expect)
    assert code == 1 and data["source"] == "static" and data["records"] == [] and data["reached"] == []
    assert data["lines"] == [
        f"FAIL the overlay is off in this environment (K3_AMD_OVERLAY unset or 0): a vLLM process started here "
        f"patches nothing, so it cannot be {expect}; set K3_AMD_OVERLAY={wanted}"]


def test_static_expecting_off_with_the_overlay_off_asks_the_probe(monkeypatch, capsys):
    code, data = static_check(monkeypatch, capsys, "off", probe=(MarkerRecord.from_json(off_process(pid=5)), ""))
    assert code == 0 and data["holds"] is True and data["reached"] == ["doctor", "probe"]
    assert [r["pid"] for r in data["records"]] == [5]


def test_static_with_a_mistyped_switch_is_its_reason_and_no_process(monkeypatch, capsys):
    code, data = static_check(monkeypatch, capsys, "fused", switch="fast")
    assert code == 1 and data["records"] == [] and data["reached"] == [] and len(data["lines"]) == 1
    assert data["lines"][0].startswith("FAIL K3_AMD_OVERLAY='fast' is not valid")
    code, text = cli.main(["check", "--expect", "fused", "--static"]), capsys.readouterr().out
    assert code == 1 and text.splitlines()[-1] == "DOES NOT HOLD: expect fused (0 processes)"


def test_static_when_the_probe_does_not_complete_says_why(monkeypatch, capsys):
    code, data = static_check(monkeypatch, capsys, "fused", switch="1", probe=(None, "it broke"))
    assert code == 1 and data["records"] == [] and data["reached"] == ["doctor", "probe"]
    assert data["lines"][0] == "FAIL the static probe did not complete: it broke"


def test_merge_json_says_its_source_and_no_marker_dir(tmp_path, capsys):
    path = node_file(tmp_path, "a.json", {"host": "node-a", "expect": "off", "holds": True, "marker_dir": "/m",
                                          "records": [off_process(pid=3)], "checked_at": time.time()})
    code = cli.main(["check", "--expect", "off", "--merge", path, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["source"] == "merge" and data["marker_dir"] is None
    assert data["notes"] == [f"note {path}: 1 process from host node-a"]


def test_no_effective_is_passed_to_the_verdict(tmp_path, capsys, monkeypatch):
    """A fused process whose fused path has not run yet: it holds only with --no-effective."""
    marker(tmp_path, f"{ME}.json", process(pid=ME, host=HOST, served=0, warmup=0))
    monkeypatch.setenv(MARKER_DIR, str(tmp_path))
    assert cli.main(["check", "--expect", "fused"]) == 1
    assert cli.main(["check", "--expect", "fused", "--no-effective"]) == 0


def test_a_record_with_an_equals_sign_in_it_is_read_whole(monkeypatch):
    record = off_process(pid=8, process_name="VLLM::Worker a=b=c")
    fake = FakeRun(stdout="K3_AMD_OVERLAY_RECORD=" + json.dumps(record) + "\n")
    got, reason = probe(monkeypatch, fake)
    assert reason == "" and got is not None and got.process_name == "VLLM::Worker a=b=c"


def test_the_probe_waits_ten_minutes_by_default_in_a_named_directory(monkeypatch):
    got, reason = probe(monkeypatch, FakeRun(raises=subprocess.TimeoutExpired("python", 600)))
    assert got is None and reason == "the probe took over 600 s (vLLM plugin loading + the K3 AMD import)"
    fake = FakeRun(returncode=1)
    probe(monkeypatch, fake)
    assert Path(fake.calls[0][1]["env"][MARKER_DIR]).name.startswith("k3ovl-static-")


def test_pruning_a_marker_another_check_removed_first_is_no_error(tmp_path, monkeypatch):
    from k3_amd_overlay import markers

    gone = markers.MarkerFile(tmp_path / "9.json", MarkerRecord.from_json(off_process(pid=ME, host=HOST)), None, False)
    monkeypatch.setattr(cli.markers, "read_markers", lambda directory: [gone])
    records, notes = cli.live_records(tmp_path, prune=True)
    assert records == []
    assert notes[1] == f"note {gone.path}: host {HOST} pid {ME} is gone; stale marker removed (--prune)"


def test_two_stale_markers_here_are_counted_apart_from_another_hosts(tmp_path):
    for pid in (ME, PARENT):
        marker(tmp_path, f"{pid}.json", off_process(pid=pid, host=HOST, start_ticks=1))
    marker(tmp_path, f"{ME + 1}.json", off_process(pid=ME + 1, host="node-z", start_ticks=1))
    _, notes = cli.live_records(tmp_path, prune=False)
    assert notes[0] == f"markers read from {tmp_path}: 0 live, 2 stale, 0 unreadable, 1 of other hosts"


@pytest.mark.parametrize("argv", [["--layers", "1", "--steps", "2"], ["--steps", "1"],
                                  ["--layers", "1", "--steps", "1"]])
def test_census_takes_one_layer_and_one_step(tmp_path, capsys, argv):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    assert cli.main(["census", str(trace), "--baseline", str(trace), *argv]) in (0, 1)
    assert "from 1 to" not in capsys.readouterr().err


def test_census_counts_below_one_are_one_whole_message(tmp_path, capsys):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    assert cli.main(["census", str(trace), "--steps", "-2", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["usage_error"] == (
        "--steps -2: from 1 to 1000000000 (--layers: the model's MLA layers; --steps: decode steps in the "
        "profiled window)")  # the value given, not the other option's


def test_the_version_and_a_missing_command(capsys):
    from k3_amd_overlay.package import __version__

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"k3-amd-overlay {__version__}\n"
    with pytest.raises(SystemExit) as exited:
        cli.main([])
    assert exited.value.code == 2 and "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_main_reads_the_command_line_when_given_none(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["k3-amd-overlay", "census", "--layers", "0", "x.json"])
    assert cli.main() == 2 and "--layers 0: from 1 to" in capsys.readouterr().err


def test_the_module_runs_as_a_script():
    proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay.commands.cli", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("k3-amd-overlay "), proc.stderr[-2000:]


def test_the_missing_module_json_is_one_space_indented(fake_tool, monkeypatch, capsys):
    module, _ = fake_tool

    def main(argv):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    module.main = main
    assert cli.main(["faketool", "--json"]) == 1
    assert capsys.readouterr().out.startswith('{\n "command": "faketool",\n "ok": false,')


@pytest.mark.parametrize("healthy", [True, False])
def test_doctor_json_carries_the_command_its_exit_status_and_returns_it(healthy, capsys, monkeypatch):
    from k3_amd_overlay.commands import doctor

    monkeypatch.setattr(doctor, "run_doctor", lambda switch, serve_args: ({"rows": []}, healthy))
    monkeypatch.setattr(doctor, "json_report", lambda report: {"report": report})
    code = cli.main(["doctor", "--json"])
    out = capsys.readouterr().out
    data = json.loads(out)
    assert code == (0 if healthy else 1)
    assert data["command"] == "doctor" and data["ok"] is healthy and data["healthy"] is healthy
    assert data["exit_status"] == code
    assert data["report"] == {"rows": []}
    assert out.startswith('{\n "command"')  # indent=1, as every --json of the CLI
    assert ("error" in data) is not healthy


@pytest.mark.parametrize("argv,said", [
    (["--switch", "bogus"], "--switch: K3_AMD_OVERLAY='bogus' is not valid"),
    (["--serve-args", "'x"], "--serve-args \"'x\": No closing quotation (quote it as a shell would)"),
])
def test_doctor_usage_errors_need_no_torch(argv: list[str], said: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """In a Python without torch the doctor's bad arguments are usage errors (exit 2, under --json one
    object saying so), not "needs torch": they are checked before the doctor's module is imported."""
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails, as where it is not installed
    monkeypatch.delitem(sys.modules, "k3_amd_overlay.commands.doctor", raising=False)
    assert cli.main(["doctor", *argv, "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["usage_error"].startswith(said) and f"doctor: error: {said}" in err
    assert cli.main(["doctor", "--json"]) == 1  # the arguments are fine: now the doctor needs torch
    assert json.loads(capsys.readouterr().out)["missing"] == "torch"


def census_json(capsys, *argv: str) -> tuple[int, dict[str, Any]]:
    """``census --json``: main's exit code and the object, its stdout exactly one-space-indented JSON."""
    code = cli.main(["census", *argv, "--json"])
    out = capsys.readouterr().out
    data = json.loads(out)
    assert out == json.dumps(data, indent=1) + "\n"  # indent=1, as every --json of the CLI
    return code, data


CENSUS_KEYS = ["command", "ok", "exit_status", "ranks", "total", "expect"]
CENSUS_BASELINE_KEYS = ["command", "ok", "exit_status", "ranks", "total", "baseline", "comparison", "expect"]


@pytest.mark.parametrize("holds", [True, False])
def test_census_json_carries_the_command_its_exit_status_and_returns_it(holds, tmp_path, capsys):
    count = random.randint(2, 40)
    trace = kernel_trace(tmp_path / "t_rank0.json", {"qk_cache_kernel": count, "other_kernel": count + 1})
    expected = count if holds else count + random.randint(1, 5)
    code, data = census_json(capsys, str(trace), "--expect", f"qk_cache_kernel={expected}")
    assert code == data["exit_status"] == (0 if holds else EXIT_FAILED), (count, expected)
    assert data["command"] == "census" and data["ok"] is holds
    assert list(data) == CENSUS_KEYS + ([] if holds else ["error"])
    assert {k: data[k] for k in ("ranks", "total")} == census.read_census([trace]).to_json()
    assert set(data["expect"]) == {"problems", "holds", "items"}
    assert data["expect"]["holds"] is holds
    (item,) = data["expect"]["items"]
    assert item["name"] == "qk_cache_kernel" and item["count"] == expected and item["holds"] is holds
    if holds:
        assert data["expect"]["problems"] == []
    else:
        (problem,) = data["expect"]["problems"]
        assert f"ran {count} times, expected {expected}" in problem


def test_census_json_without_expect_holds_and_says_so(tmp_path, capsys):
    trace = kernel_trace(tmp_path / "t_rank0.json", {"qk_cache_kernel": random.randint(1, 30)})
    code, data = census_json(capsys, str(trace))
    assert code == data["exit_status"] == 0 and data["ok"] is True and data["command"] == "census"
    assert list(data) == CENSUS_KEYS and data["expect"] == {"problems": [], "holds": True, "items": []}


def test_census_json_with_a_baseline_carries_it_and_the_comparison(tmp_path, capsys):
    before, after = random.randint(5, 40), random.randint(1, 4)
    base = kernel_trace(tmp_path / "b_rank0.json", {"void vllm::rms_norm_kernel<x>": before, ATTENTION: 2})
    cand = kernel_trace(tmp_path / "c_rank0.json", {"rmsnorm_pair_kernel": after, ATTENTION: 2})
    code, alone = census_json(capsys, str(base))
    assert code == 0
    code, data = census_json(capsys, str(cand), "--baseline", str(base), "--expect", f"rmsnorm_pair_kernel={after}")
    assert code == data["exit_status"] == 0 and data["ok"] is True and data["command"] == "census", (before, after)
    assert list(data) == CENSUS_BASELINE_KEYS
    # the baseline's own census, as `census --json` says it on the baseline alone
    assert data["baseline"] == census.read_census([base]).to_json()
    assert data["baseline"] == {k: v for k, v in alone.items() if k not in ("command", "ok", "exit_status", "expect")}
    assert data["baseline"]["total"][0]["count"] == before
    assert {k: data[k] for k in ("ranks", "total")} == census.read_census([cand]).to_json()
    comparison = census.compare(census.read_census([base]), census.read_census([cand]), None, k3.MLA_LAYERS).to_json()
    assert data["comparison"] == comparison and comparison["holds"] is True
    assert data["expect"]["holds"] is True and data["expect"]["problems"] == []


def test_census_json_with_a_baseline_that_cannot_compare_fails_and_still_carries_it(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    count = random.randint(1, 20)
    base = [kernel_trace(tmp_path / "b" / f"rank{r}.json", {"concat_and_cache_mla_kernel": count}) for r in range(2)]
    cand = kernel_trace(tmp_path / "c_rank0.json", {"qk_cache_kernel": count})
    code, data = census_json(capsys, str(cand), "--baseline", *map(str, base))
    assert code == data["exit_status"] == EXIT_FAILED and data["ok"] is False and data["command"] == "census"
    assert list(data) == [*CENSUS_BASELINE_KEYS, "error"]
    assert data["error"] == "does not hold: " + "; ".join(data["comparison"]["problems"])
    assert data["baseline"] == census.read_census(base).to_json() and sorted(data["baseline"]["ranks"]) == ["0", "1"]
    assert data["comparison"]["holds"] is False and data["comparison"]["problems"]
    assert data["expect"] == {"problems": [], "holds": True, "items": []}  # the comparison alone failed it


@pytest.mark.parametrize("json_wanted", [False, True])
def test_an_unknown_census_argument_is_the_census_usage_error(json_wanted, tmp_path, capsys):
    trace = kernel_trace(tmp_path / "t_rank0.json", {"qk_cache_kernel": 1})
    with pytest.raises(SystemExit) as exited:
        cli.main(["census", str(trace), "--bogus", *(["--json"] if json_wanted else [])])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("usage: k3-amd-overlay census ")
    assert captured.err.splitlines()[-1] == "k3-amd-overlay census: error: unrecognized arguments: --bogus"
    if json_wanted:
        data = json.loads(captured.out)
        assert data["command"] == "census" and data["ok"] is False and data["exit_status"] == 2
        assert data["usage_error"] == "unrecognized arguments: --bogus"
    else:
        assert captured.out == ""
