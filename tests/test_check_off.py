"""``off`` proven positively: with the plugin installed and the overlay off, ``plugin.register()``
leaves a small off record (nothing patched, no wrapt), a forked child its own, a ``vllm`` CLI
client none; ``check --expect off`` holds only on a live process's off record. Nothing running,
a dead or reused pid, another host's record, and off mixed with on never hold."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from records import judge, off_process, process

from k3_amd_overlay import markers
from k3_amd_overlay.commands.cli import main

REGISTER = """
import json, multiprocessing, os, sys
sys.argv = json.loads(sys.argv[1])
from k3_amd_overlay import plugin
plugin.register()
plugin.register()  # vLLM may load plugins twice in one process: still one record, one fork hook
loaded = sorted(m for m in sys.modules if m.startswith("k3_amd_overlay"))
child = {}
if os.environ.get("FORK") == "os":
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    child = {"child": pid}
elif os.environ.get("FORK") == "multiprocessing":
    process = multiprocessing.get_context("fork").Process(target=lambda: None, name="EngineCore_DP0")
    process.start()
    process.join()
    child = {"child": process.pid}
print("RESULT=" + json.dumps({"pid": os.getpid(), "wrapt": "wrapt" in sys.modules, "loaded": loaded, **child}))
"""


def register(tmp_path: Path, argv: list[str] | None = None, marker_dir: Path | None = None,
             **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``plugin.register()`` in a fresh process with the overlay off (K3_AMD_OVERLAY as given)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    environ.update(K3_AMD_OVERLAY_MARKER_DIR=str(marker_dir or tmp_path / "markers"), **env)
    proc = subprocess.run([sys.executable, "-c", REGISTER, json.dumps(argv or ["vllm", "serve", "m"])],
                          env=environ, capture_output=True, text=True, timeout=120)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT=")), None)
    assert result is not None, proc.stderr[-3000:]
    return proc, result


def records_in(directory: Path) -> dict[int, dict]:
    return {r["pid"]: r for r in (json.loads(p.read_text()) for p in directory.glob("*.json"))}


@pytest.mark.parametrize("switch", [None, "0"])
def test_the_plugin_off_leaves_an_off_record_and_patches_nothing(tmp_path, switch):
    proc, result = register(tmp_path, **({} if switch is None else {"K3_AMD_OVERLAY": switch}))
    found = records_in(tmp_path / "markers")
    assert list(found) == [result["pid"]], found
    record = found[result["pid"]]
    assert record["mode"] == "off" and record["role"] == "api-server" and record["host"] == socket.gethostname()
    assert record["switch"] == (switch or "") and record["overlay_version"]
    assert record["start_ticks"] is not None and record["patches"] == []
    assert {f["state"] for f in record["fusions"].values()} == {"disabled"}
    assert not result["wrapt"] and "k3_amd_overlay.activation" not in result["loaded"]  # nothing patched
    assert "k3_amd_overlay.engine" not in result["loaded"]
    assert proc.stderr == ""


@pytest.mark.parametrize("argv", [["vllm", "bench", "serve", "--model", "m"],
                                  ["vllm", "bench", "sweep", "serve", "--serve-cmd", "vllm serve m", "--bench-cmd",
                                   "vllm bench serve"],
                                  ["vllm", "launch", "render", "m"], ["vllm", "preload", "--model", "m"],
                                  ["/venv/lib/python3.11/site-packages/vllm/model_executor/models/registry.py"]],
                         ids=["cli-client", "bench-sweep", "launch-render", "preload", "model-inspection"])
def test_a_process_building_no_model_leaves_no_record_where_a_server_leaves_one(tmp_path, argv, capsys):
    """A `vllm` command that runs no model (each builds the serve parser, so vLLM loads the plugins) leaves
    no off record: with no server up, `check --expect off` does not hold on its record alone."""
    register(tmp_path, argv, marker_dir=tmp_path / "client")
    register(tmp_path, ["vllm", "serve", "m"], marker_dir=tmp_path / "server")
    assert not (tmp_path / "client").exists() or not list((tmp_path / "client").glob("*.json"))
    assert len(list((tmp_path / "server").glob("*.json"))) == 1
    assert main(["check", "--expect", "off", "--marker-dir", str(tmp_path / "client")]) == 1
    assert "FAIL no live vLLM process left an off record" in capsys.readouterr().out


@pytest.mark.parametrize("fork,role", [("os", "api-server"), ("multiprocessing", "engine-core")])
def test_a_forked_child_leaves_its_own_off_record(tmp_path, fork, role):
    """vLLM's fork start method: the child loads no plugin again; it must still be seen as its own
    process (its pid, its start time, its role once multiprocessing has named it)."""
    _, result = register(tmp_path, FORK=fork)
    found = records_in(tmp_path / "markers")
    assert set(found) == {result["pid"], result["child"]}
    child = found[result["child"]]
    assert child["mode"] == "off" and child["role"] == role
    assert child["start_ticks"] != found[result["pid"]]["start_ticks"] or child["start_ticks"] is None


def test_an_unusable_marker_directory_warns_once_and_never_stops_vllm(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    proc, _ = register(tmp_path, marker_dir=open_dir, FORK="os")
    warnings = [line for line in proc.stderr.splitlines() if "writes no off record" in line]
    # the parent once; the forked child once more (its own process), never a traceback
    assert len(warnings) == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert warnings[0] == ("k3-amd-overlay: WARNING: the overlay is off, but this process writes no off record, so "
                           f"`k3-amd-overlay check --expect off` cannot see it: marker directory {open_dir} is "
                           "writable by group or others (mode 777); chmod 700 it")
    assert not list(open_dir.glob("*.json"))
    (tmp_path / "a-file").write_text("")
    proc, _ = register(tmp_path, marker_dir=tmp_path / "a-file")  # a file, not a directory
    assert proc.returncode == 0 and "writes no off record" in proc.stderr


def check(directory: Path, *args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay", "check", "--expect", "off", "--marker-dir",
                           str(directory), *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout


def live(pid: int | None = None, **fields) -> dict:
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start_ticks": markers.process_start_ticks(pid), **fields}


def test_nothing_running_is_no_proof_of_off(tmp_path):
    code, out = check(tmp_path / "markers")
    assert code == 1, out
    assert ("FAIL no live vLLM process left an off record (is the server up, k3-amd-overlay installed in its Python "
            "(with K3_AMD_OVERLAY unset or 0 its plugin leaves one), the same K3_AMD_OVERLAY_MARKER_DIR?)") in out
    assert not judge([], "off", None, require_effective=True).holds


def test_a_live_off_process_holds_and_its_record_goes_stale_when_it_exits(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    environ["K3_AMD_OVERLAY_MARKER_DIR"] = str(tmp_path / "markers")
    server = subprocess.Popen([sys.executable, "-c", "import sys; sys.argv = ['offline_bench.py']\n"
                               "from k3_amd_overlay import plugin; plugin.register(); print('up', flush=True)\n"
                               "sys.stdin.read()"], env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        code, out = check(tmp_path / "markers")
        assert code == 0 and f"ok   host {socket.gethostname()} pid {server.pid} (main, vLLM" in out, out
        assert "HOLDS: expect off (1 process)" in out
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    code, out = check(tmp_path / "markers")
    assert code == 1 and "1 stale" in out and "no live vLLM process left an off record" in out, out


def test_an_api_servers_off_record_alone_proves_nothing_about_the_model():
    """An API server runs no model: its engine core and workers may have left their records elsewhere
    (another marker directory, node or Python) or run the overlay; off needs one of theirs."""
    alone = judge([off_process(pid=3, host="h", role="api-server")], "off", None, require_effective=True)
    assert not alone.holds and alone.lines == [
        "ok   host h pid 3 (api-server, vLLM 0.33.0): overlay off",
        "FAIL only API server processes left an off record: no engine core, worker or offline engine did, so what "
        "ran the model is not known (its processes may use another K3_AMD_OVERLAY_MARKER_DIR, run on another node "
        "or another Python, or run with another K3_AMD_OVERLAY)"]
    for role in ("engine-core", "worker", "main"):
        assert judge([off_process(pid=3, host="h", role="api-server"), off_process(pid=4, host="h", role=role)],
                     "off", None, require_effective=True).holds, role


def test_a_reused_pid_another_hosts_record_and_mixed_arms_never_hold(tmp_path):
    directory = markers.ensure_marker_dir(tmp_path / "m")
    # this process's pid with another start time: the pid was reused by another process
    markers.write_marker(directory, os.getpid(), {**off_process(), **live(), "start_ticks": 1})
    code, out = check(directory)
    assert code == 1 and "0 live, 1 stale" in out, out
    # a live pid here, but written on another host (a marker directory shared between nodes)
    markers.write_marker(directory, os.getpid(), {**off_process(), **live(), "host": "node-b"})
    code, out = check(directory)
    assert code == 1 and "was written on another host" in out, out
    # off and on: not one arm
    parent = os.getppid()
    markers.write_marker(directory, os.getpid(), {**off_process(), **live()})
    markers.write_marker(directory, parent, {**process("stock", "forced-stock"), **live(parent)})
    code, out = check(directory)
    assert code == 1 and "FAIL mixed: 1 process with the overlay off, 1 with it on: not one arm" in out, out


def test_off_verdict_lines_word_for_word():
    host = socket.gethostname()
    assert judge([off_process(pid=3, host="h")], "off", None, require_effective=True).lines == [
        "ok   host h pid 3 (worker, vLLM 0.33.0): overlay off"]
    verdict = judge([off_process(pid=3), process(pid=4, switch="1")], "off", None, require_effective=True)
    assert not verdict.holds and verdict.lines == [
        f"ok   host {host} pid 3 (worker, vLLM 0.33.0): overlay off",
        f"FAIL host {host} pid 4 (worker, vLLM 0.33.0): overlay in auto mode (K3_AMD_OVERLAY='1')",
        "FAIL mixed: 1 process with the overlay off, 1 with it on: not one arm"]
    # a CLI client's record proves nothing: it builds no model
    assert not judge([off_process(role="cli-client")], "off", None, require_effective=True).holds


def _fails(verdict) -> list[str]:
    return [line for line in verdict.lines if line.startswith("FAIL ")]


def test_off_records_of_two_deployments_are_not_one_baseline():
    """Off processes of two installs (another vLLM, another overlay) are not one arm, as fused and
    stock processes are not: `off` fails naming what differs."""
    verdict = judge([off_process(pid=3, host="h", vllm_version="0.32.0"), off_process(pid=4, host="h")], "off", None,
                    require_effective=False)
    assert not verdict.holds
    assert _fails(verdict) == ["FAIL not one deployment: vllm versions differ: 0.32.0 (host h pid 3); 0.33.0 (host h "
                               "pid 4)"], verdict.lines


def test_off_switches_that_name_the_same_arm_are_one_baseline():
    """Unset (``''``) and ``0`` both leave the overlay off: one arm."""
    verdict = judge([off_process(pid=3, host="h", switch=""), off_process(pid=4, host="h", switch=" 0")], "off", None,
                    require_effective=False)
    assert verdict.holds and not _fails(verdict), verdict.lines


def test_check_json_when_off_is_not_proved(tmp_path, capsys):
    code = main(["check", "--expect", "off", "--marker-dir", str(tmp_path / "none"), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["holds"] is False and data["records"] == []
    assert data["lines"][0].startswith("FAIL no live vLLM process left an off record")
