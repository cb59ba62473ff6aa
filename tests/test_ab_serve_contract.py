"""The contract of `k3-amd-overlay ab-serve` and `ab-serve report`, word for word: every option's
help, default and type; every usage error; the exact command line of each bench; every progress
line and when it reaches its reader; summary.md, summary.json (exact keys and values) and the
plot's every call; the report's output and errors; the --json object on each path. The arms'
servers are stood in for (each arm taken as proved: the proof is tested in test_ab.py), the bench is
the loopback stand-in of test_ab.py behind a wrapper that records its command line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cli_process import with_defaults
from test_ab import STANDINS

import k3_amd_overlay
from k3_amd_overlay import markers
from k3_amd_overlay.commands import ab_run, ab_serve, arms
from k3_amd_overlay.commands import ab_stats as stats
from k3_amd_overlay.commands.bench.plot import MATPLOTLIB_MISSING
from k3_amd_overlay.commands.usage import EPILOG, describe
from k3_amd_overlay.package import __version__
from k3_amd_overlay.record import MarkerRecord
from k3_amd_overlay.settings import SWITCH, Mode, SettingsError, load_settings

BENCH_ARGS = ("--backend openai-chat --endpoint /v1/chat/completions --dataset-name random "
              "--random-input-len 1024 --random-output-len 8192 --random-range-ratio 0 --ignore-eos "
              "--seed 42 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99")
NOTE = ("Paired over the ABBA repeats: the ratio is the geometric mean of the per-repeat ratios (exp of the mean "
        "paired log-ratio); 95% CI: percentile bootstrap (10,000 resamples) of the mean paired log-ratio; p: exact "
        "two-sided sign-flip test of the paired log-ratios; TPOT p50 (ms), the primary metric, is judged alone at each "
        "concurrency, every other row with Holm's correction across the comparison (p adj.); a verdict needs p adj. < "
        "0.05, the whole CI on the ratio's side of 1x and an effect of at least 1%.")
FUSIONS_HEAD = ("Fusions as each arm's check proved them after its measurement (applied: the overlay's; upstream: "
                "vLLM's own; forced-stock: off in stock mode):")
OFF_LINE = "overlay off (vLLM as shipped, its own fusions where it has them)"
ALL_APPLIED = "absorb_qk_cache applied; qk_cache applied; qkv_norm applied"
ALL_STOCK = "absorb_qk_cache forced-stock; qk_cache forced-stock; qkv_norm forced-stock"
NOT_RECORDED = "not recorded (no saved check for every measured repeat)"
NO_PLOT = "plot skipped: " + MATPLOTLIB_MISSING
GPU_COMMANDS = (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], ["amd-smi", "static", "--asic", "--csv"],
                ["rocm-smi", "--showproductname"])
DATE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")

BENCH_WRAPPER = """\
import json, os, runpy, sys
from pathlib import Path

seen = {name: Path(os.environ[var]).read_text() for name, var in (("stdout", "ABC_STDOUT"), ("stderr", "ABC_STDERR"))
        if os.environ.get(var)}
with open(os.environ["ABC_LOG"], "a") as handle:
    handle.write(json.dumps({"argv": sys.argv[1:], **seen}) + "\\n")
mode = os.environ.get("ABC_BENCH", "")
if mode != "no-result":
    runpy.run_path(os.environ["ABC_FAKE_BENCH"], run_name="__main__")
raise SystemExit(3 if mode == "exit-3" else 0)
"""


class Loopback:
    """The arm's server as the bench sees it: /standin/arm answers the arm being measured; every
    request other than a GET is recorded as (method, path)."""

    def __init__(self) -> None:
        self.switch = ""
        self.requests: list[tuple[str, str]] = []
        loop = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/standin/arm":
                    self.send_error(404)
                    return
                self._reply({"switch": loop.switch})

            def do_POST(self) -> None:
                loop.requests.append(("POST", self.path))
                self._reply({})

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Lab:
    """One ab-serve run's surroundings: the arms' servers stood in for (arms.proved_server, with its
    real signature), the baseline check recorded, the GPU query answered, the bench recorded."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.out = tmp_path / "out"
        self.loopback = Loopback()
        self.serves: list[tuple] = []
        self.baselines: list[tuple] = []
        self.hazards: list[str] = []
        self.fail: set[str] = set()  # arm folders whose proof fails
        self.fail_after: set[str] = set()  # arm folders whose proof no longer holds after their benches
        self.gpu: dict[str, str] = {}
        self.gpu_calls: list[list[str]] = []
        self.snapshots: list[tuple[str, str, str]] = []
        self.files: tuple[Path, Path] | None = None  # where stdout and stderr go, when they are files
        self.log = tmp_path / "bench-argv.jsonl"
        wrapper = tmp_path / "bench_wrapper.py"
        wrapper.write_text(BENCH_WRAPPER)
        self.bench_cmd = f"{sys.executable} {wrapper}"
        monkeypatch.setenv("ABC_LOG", str(self.log))
        monkeypatch.setenv("ABC_FAKE_BENCH", str(STANDINS / "fake_bench.py"))
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # no plot unless a test stands one in
        monkeypatch.setattr(arms, "proved_server", self.proved_server)
        monkeypatch.setattr(arms, "check_baselines", self.check_baselines)
        real_first_line = ab_serve._first_line

        def first_line(command: list[str]) -> str | None:
            if command[0] == "git":
                return real_first_line(command)
            self.gpu_calls.append(command)
            return self.gpu.get(command[0])

        monkeypatch.setattr(ab_serve, "_first_line", first_line)

    def snapshot(self, where: str) -> None:
        if self.files:
            self.snapshots.append((where, self.files[0].read_text(), self.files[1].read_text()))

    @contextlib.contextmanager
    def proved_server(self, arm: arms.Arm, serve_cmd: str, model: str, serve_args: str, port: int, workdir: Path,
                      health_timeout: float, served_name: str | None = None):
        self.serves.append((arm, serve_cmd, model, serve_args, port, workdir.name, health_timeout, served_name))
        self.snapshot(f"serve {workdir.name}")
        if workdir.name in self.fail:
            raise arms.ArmFailed(f"arm {arm.label} ({SWITCH}={arm.switch}) is not {arm.expect}:\nNOT HOLDING\n"
                                 f"logs: {workdir}")
        (workdir / "markers").mkdir()
        for pid, version in ((101, {"A": "0.33.0", "B": "0.32.1"}.get(arm.label)), (102, None)):
            record = MarkerRecord(pid=pid, mode=Mode.OFF, fusions={}, vllm_version=version)
            markers.write_marker(workdir / "markers", pid, record.to_json())
        self.loopback.switch = arm.switch
        yield arms.Server(["serve"], arm, workdir, self.loopback.port)
        if workdir.name in self.fail_after:
            raise arms.ArmFailed(f"arm {arm.label} ({SWITCH}={arm.switch}) is no longer {arm.expect} after its "
                                 f"measurement (its results are not used):\nREFUSED\nlogs: {workdir}")
        (workdir / arms.CHECK_AFTER_JSON).write_text(json.dumps({"command": "check", "holds": True,
                                                                 "records": check_records(arm.switch)}))

    def check_baselines(self, named, serve_args: str, accept: bool) -> list[str]:
        self.baselines.append((list(named), serve_args, accept))
        return list(self.hazards)

    def main(self, *args: str) -> int:
        return ab_serve.main(with_defaults({"--model": "k3", "--out": str(self.out), "--port": "8123",
                                            "--serve-cmd": sys.executable, "--bench-cmd": self.bench_cmd}, args))

    def benches(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def bench_argv(self, model: str, tokenizer: str, bench_args: str, prompts: int, concurrency: int,
                   folder: str) -> list[str]:
        return ["--model", model, "--tokenizer", tokenizer, "--base-url", self.loopback.url, *bench_args.split(),
                "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--save-result",
                "--result-dir", str(self.out / folder), "--result-filename", f"bench-c{concurrency}.json"]

    def results(self) -> dict[str, dict[int, list[dict]]]:
        """What the benches of the arms marked measured saved, read here: by arm, concurrency, in
        repeat order."""
        found: dict[str, dict[int, list[dict]]] = {}
        folders = sorted((int(m.group(1)), m.group(2), d) for d in self.out.iterdir()
                         if (m := re.fullmatch(r"repeat(\d+)-arm([ABC])", d.name)))
        for _, label, folder in folders:
            if not ab_run.measured(folder, run_id_of(self.out)):
                continue
            for path in sorted(folder.glob("bench-c*.json"), key=lambda p: int(p.stem[7:])):
                found.setdefault(label, {}).setdefault(int(path.stem[7:]), []).append(json.loads(path.read_text()))
        return found


@pytest.fixture
def lab(tmp_path, monkeypatch):
    yield (made := Lab(tmp_path, monkeypatch))
    made.loopback.server.shutdown()
    made.loopback.server.server_close()


def check_records(switch: str) -> list[dict]:
    """What a held `check --json` lists for an arm's server: a model process (each fusion on 61
    layers, applied, forced-stock or an off record) and an API server that builds no layer."""
    mode, fusions = arms.setting(switch)
    if mode is Mode.OFF:
        return [{"pid": 101, "mode": "off", "role": "main", "fusions": {}}]
    state = "forced-stock" if mode is Mode.STOCK else "applied"
    return [{"pid": 101, "mode": mode.value, "role": "main",
             "fusions": {f: {"state": state, "layers": 61} for f in sorted(fusions)}},
            {"pid": 102, "mode": mode.value, "role": "api-server",
             "fusions": {f: {"state": "pending", "layers": 0} for f in sorted(fusions)}}]


def proved(switch: str) -> dict:
    """summary.json's "fusions" entry of an arm whose every repeat saved check_records(switch)."""
    mode, fusions = arms.setting(switch)
    state = {Mode.OFF: "disabled", Mode.STOCK: "forced-stock"}.get(mode, "applied")
    return {"mode": mode.value, "fusions": {} if mode is Mode.OFF else {f: [state] for f in sorted(fusions)}}


def title(label: str, switch: str, switch_a: str, ran: str, ran_a: str) -> str:
    return f"### {label} ({SWITCH}={switch}) vs A ({SWITCH}={switch_a}): {ran} vs {ran_a}; {label} vs A > 1: " \
           f"{label} is better"


def expected_text(results: dict, candidates: list[tuple[str, str, str]], switch_a: str, ran_a: str,
                  fusions: list[str], aborted: str | None = None, hazards: tuple[str, ...] = (),
                  left_out: tuple[str, ...] = ()) -> tuple[str, dict]:
    """summary.md's text and summary.json's rows, restated here: each candidate (label, switch, what
    it ran), what A ran, each arm's fusion line."""
    sections, rows = [], {}
    for label, switch, ran in candidates:
        found = stats.serving_rows(results, label, "A")
        table = stats.render_serving(found, label) if found else "no repeat completed by both arms: nothing to compare"
        sections.append(f"{title(label, switch, switch_a, ran, ran_a)}\n\n{table}")
        rows[f"{label}_vs_A"] = [r.to_json() for r in found]
    text = "\n\n".join(sections) + "\n\n" + FUSIONS_HEAD + "\n" + "\n".join(fusions) + "\n\n" + NOTE
    if left_out:
        text = (f"not compared: {', '.join(left_out)} (the arm did not finish its benches with its check still "
                f"holding)\n\n{text}")
    if aborted:
        text = f"ABORTED ({aborted}); the table covers the repeats both arms completed\n\n{text}"
    for hazard in hazards:
        text = f"WARNING, measured with --accept-baseline-hazard: {hazard}\n\n{text}"
    return text, rows


def expected_environment(lab: Lab, summary_env: dict, arm_switches: dict[str, tuple[str, str]], **overrides) -> dict:
    env = {
        "overlay_version": __version__,
        "overlay_git_sha": ab_serve.overlay_git_sha(Path(k3_amd_overlay.__file__).resolve().parent),
        "vllm_versions": ["0.32.1", "0.33.0"],
        "gpu": None,
        "model": "k3", "served_model_name": "k3", "serve_args": "", "bench_args": BENCH_ARGS,
        "concurrency": [1], "num_prompts": "4 x concurrency", "repeats": 1, "baseline_hazards": [],
        "arms": {label: {"switch": s, "expect": e} for label, (s, e) in arm_switches.items()},
        "date": summary_env["date"],
    }
    env.update(overrides)
    assert DATE.fullmatch(summary_env["date"]), summary_env["date"]
    return env


def run_id_of(out: Path) -> str:
    record = json.loads((out / "run.json").read_text())
    assert record["tool"] == "ab-serve"
    return record["run_id"]


# --- the parsers --------------------------------------------------------------------------------------

def options(p) -> dict[str, tuple]:
    return {a.dest: (a.option_strings, a.help, a.default, a.type, a.nargs, a.metavar, a.required)
            for a in p._actions if a.dest != "help"}


def test_every_option_of_ab_serve_and_its_report_word_for_word():
    p = ab_serve.parser()
    assert (p.prog, p.description) == ("k3-amd-overlay ab-serve", describe(ab_serve.__doc__))
    assert p.epilog == ("k3-amd-overlay ab-serve report OUT re-summarises the runs saved under OUT (its own --help). "
                        + EPILOG)
    own = options(p)
    assert own["arm_a"] == (["--arm-a"], "K3_AMD_OVERLAY of the baseline arm (0: vLLM as it is)", "0", None, None,
                            None, False)
    assert {k: v for k, v in own.items() if k not in {"model", "served_model_name", "serve_args", "arm_a", "arm_b",
                                                       "accept_baseline_hazard", "port", "serve_cmd",
                                                       "health_timeout"}} == {
        "concurrency": (["--concurrency"], "bench concurrencies, each run", [1, 8, 32], int, "+", None, False),
        "num_prompts": (["--num-prompts"], "requests per bench run (default: 4 x the concurrency)", None, int, None,
                        None, False),
        "repeats": (["--repeats"], "ABBA repeats; the exact test can call a difference (p < 0.05) on the primary "
                    "metric (TPOT p50 (ms)) only from 6 on, on the other rows (Holm-corrected together) only from more",
                    6, int, None, None, False),
        "with_stock": (["--with-stock"], "a third arm C with K3_AMD_OVERLAY=stock: the unfused path, vLLM's own "
                       "fusions off too (on vLLM 0.30+ that also turns off what vLLM fuses by itself), compared with "
                       "A as well", False, None, 0, None, False),
        "out": (["--out"], "a new or empty directory for every raw result and the summary (a used one is refused)",
                None, Path, None, None, True),
        "bench_cmd": (["--bench-cmd"], "the command that runs one bench", "vllm bench serve", None, None, None, False),
        "bench_args": (["--bench-args"], "vllm bench serve arguments (the vLLM K3 PR's)", BENCH_ARGS, None, None,
                       None, False),
        "tokenizer": (["--tokenizer"], "passed to the bench (default: the model)", None, None, None, None, False),
        "profile_window": (["--profile-window"], "per arm: /start_profile this long after the bench starts, "
                           "/stop_profile after (the server needs --profiler-config in --serve-args)", None, float,
                           None, "SECONDS", False),
        "json": (["--json"], "one JSON object on stdout on every path (the summary; progress goes to stderr)", False,
                 None, 0, None, False),
    }
    r = ab_serve.report_parser()
    assert (r.prog, r.description) == ("k3-amd-overlay ab-serve report", (
        "Re-summarise the runs saved under an ab-serve --out directory: summary.md, summary.json and summary.png "
        "written again from the raw results of the run that claimed it."))
    assert options(r) == {
        "out": ([], "the --out directory of an ab-serve run", None, Path, None, None, True),
        "json": (["--json"], "one JSON object on stdout on every path (the summary)", False, None, 0, None, False),
    }


# --- usage errors -------------------------------------------------------------------------------------

def settings_error(value: str) -> str:
    with pytest.raises(SettingsError) as caught:
        load_settings({SWITCH: value})
    return str(caught.value)


@pytest.mark.parametrize("args,message", [
    (["--repeats", "0"], "--repeats 0: at least 1"),
    (["--concurrency", "4", "0"], "--concurrency [4, 0]: each at least 1"),
    (["--num-prompts", "0"], "--num-prompts 0: at least 1"),
    (["--health-timeout", "0"], "--health-timeout 0.0: must be a positive, finite number of seconds"),
    (["--health-timeout", "-1.5"], "--health-timeout -1.5: must be a positive, finite number of seconds"),
    (["--arm-a", "yes"], f"--arm-a: {settings_error('yes')}"),
    (["--arm-b", "fast"], f"--arm-b: {settings_error('fast')}"),
    (["--arm-a", "1"], "the arms must differ: --arm-a '1' and --arm-b '1' are the same setting "
                       "(auto: absorb_qk_cache, qk_cache, qkv_norm), an A/B of an arm against itself"),
    (["--with-stock", "--arm-b", "stock"], "the arms must differ: --arm-b 'stock' and the stock arm 'stock' are the "
                                           "same setting (stock), an A/B of an arm against itself"),
    (["--serve-cmd", "no-such-serve --x"],
     "--serve-cmd 'no-such-serve --x': no-such-serve is not an executable on PATH"),
    (["--bench-cmd", "no-such-bench"], "--bench-cmd 'no-such-bench': no-such-bench is not an executable on PATH"),
    (["--port", "99999"], "--port 99999: must be 1-65535"),
    (["--port", "0"], "--port 0: must be 1-65535"),
    (["--profile-window", "-1"], "--profile-window -1.0: must be a positive, finite number of seconds"),
    (["--profile-window", "0"], "--profile-window 0.0: must be a positive, finite number of seconds"),
    (["--bench-args", '--foo "x'], """--bench-args '--foo "x': No closing quotation (quote it as a shell would)"""),
    (["--serve-args", "--foo 'x"], """--serve-args "--foo 'x": No closing quotation (quote it as a shell would)"""),
    # the tool's own: passed on, vLLM would keep the last --port and the health poll wait on the other
    (["--serve-args", "--tp 8 --port 9000"], "--serve-args '--tp 8 --port 9000': --port is set by the tool itself; "
                                             "give the tool's --port (the server it polls for health is on that port)"),
    (["--serve-args=--port=9000"], "--serve-args '--port=9000': --port is set by the tool itself; give the tool's "
                                   "--port (the server it polls for health is on that port)"),
    (["--bench-args", "--seed 1 --base-url http://x:1"], "--bench-args '--seed 1 --base-url http://x:1': --base-url is "
                                                          "set by the tool itself; ab-serve points the bench at each "
                                                          "arm's proved server"),
    (["--bench-args=--num-prompts 9"], "--bench-args '--num-prompts 9': --num-prompts is set by the tool itself; give "
                                       "ab-serve's --num-prompts"),
    (["--bench-args", "--num_prompts 9"], "--bench-args '--num_prompts 9': --num-prompts is set by the tool itself; "
                                          "give ab-serve's --num-prompts"),  # vLLM reads _ as -
    (["--serve-args", "--uds /tmp/s"], "--serve-args '--uds /tmp/s': --uds is set by the tool itself; the tool polls "
                                       "each server over TCP on its --port"),
    (["--bench-args", ""], "--bench-args '' names nothing (an empty value: an unset variable?); give a value, or leave "
                           "it out for its default (the vLLM K3 PR's workload)"),
])
def test_each_usage_error_word_for_word_before_any_server_starts(lab, capsys, args, message):
    assert lab.main(*args) == 2
    printed = capsys.readouterr()
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay ab-serve: error: {message}"
    assert printed.out == "" and not lab.out.exists() and lab.serves == []


def test_serve_args_may_repeat_none_of_the_options_the_serve_command_sets():
    """SERVE_OWNED is what arms.serve_command sets (and --uds, which takes the server off TCP)."""
    from k3_amd_overlay.commands.usage import SERVE_OWNED

    command = arms.serve_command("vllm serve", "/models/k3", 8010, "--tensor-parallel-size 8")
    assert command == ["vllm", "serve", "/models/k3", "--port", "8010", "--tensor-parallel-size", "8"]
    own = {word for word in arms.serve_command("vllm serve", "m", 8010, "") if word.startswith("--")}
    assert own == set(SERVE_OWNED) - {"--uds"}


def test_bench_args_may_repeat_none_of_the_options_the_bench_command_sets(tmp_path):
    """BENCH_OWNED is what bench_command sets: an option it adds and BENCH_OWNED lacks would reach the
    bench twice from a --bench-args repeating it, one of the two dropped without a word."""
    args = ab_serve.parser().parse_args(["--model", "m", "--out", str(tmp_path), "--bench-args", "--seed 1",
                                "--bench-cmd", "vllm bench serve"])
    command = ab_serve.bench_command(args, "http://127.0.0.1:8010", 4, tmp_path / "bench-c4.json")
    tools_own = {word for word in command[3:] if word.startswith("--")} - {"--seed"}
    assert tools_own == set(ab_serve.BENCH_OWNED) - {"--host", "--port"}


@pytest.mark.parametrize("as_json", [False, True])
def test_an_out_that_cannot_be_created_is_a_usage_error_before_anything_starts(lab, tmp_path, capsys, as_json):
    (tmp_path / "a-file").write_text("")
    lab.out = tmp_path / "a-file" / "out"
    assert lab.main("--repeats", "1", *(["--json"] if as_json else [])) == 2
    printed = capsys.readouterr()
    message = f"--out {lab.out} cannot be created: Not a directory"
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay ab-serve: error: {message}"
    assert "warning" not in printed.err and lab.serves == [] and lab.benches() == []
    assert printed.out == (json.dumps({"command": "ab-serve", "ok": False, "exit_status": 2, "usage_error": message,
                                       "error": message}, indent=1) + "\n" if as_json else "")


# --- a whole run --------------------------------------------------------------------------------------

def test_a_run_prints_benches_and_summarises_exactly_this(lab, capsys):
    assert lab.main("--repeats", "2", "--concurrency", "1", "8", "--serve-args=--tensor-parallel-size 8") == 0
    printed = capsys.readouterr()
    run_id = run_id_of(lab.out)
    steps = [(0, "A", "0", "off"), (0, "B", "1", "fused"), (1, "B", "1", "fused"), (1, "A", "0", "off")]
    progress = []
    for step, (repeat, label, switch, expect) in enumerate(steps, start=1):
        progress += [f"[{step}/4] repeat {repeat}, arm {label} (K3_AMD_OVERLAY={switch}): starting",
                     f"[{step}/4] arm {label} proved {expect}",
                     f"[{step}/4] arm {label}: bench at concurrency 1",
                     f"[{step}/4] arm {label}: bench at concurrency 8"]
    results = lab.results()
    assert sorted(results) == ["A", "B"] and [len(results[a][c]) for a in "AB" for c in (1, 8)] == [2, 2, 2, 2]
    text, rows = expected_text(results, [("B", "1", "the overlay's fusions")], "0", "vLLM as shipped",
                               [f"- A (K3_AMD_OVERLAY=0): {OFF_LINE}", f"- B (K3_AMD_OVERLAY=1): {ALL_APPLIED}"])
    assert printed.out == "\n".join(progress) + "\n\n" + text + "\n\n" + NO_PLOT + "\n"
    assert printed.err == ("k3-amd-overlay ab-serve: warning: --repeats 2: with n=2 the smallest possible p is 0.5: "
                           "no verdict possible (p < 0.05 needs n >= 6)\n")
    assert (lab.out / "summary.md").read_text() == text + "\n"
    assert [b["argv"] for b in lab.benches()] == [
        lab.bench_argv("k3", "k3", BENCH_ARGS, 4 * c, c, f"repeat{r}-arm{a}") for r, a, *_ in steps for c in (1, 8)]
    assert [(s[0].label, s[0].switch, s[0].expect, *s[1:]) for s in lab.serves] == [
        (a, sw, e, sys.executable, "k3", "--tensor-parallel-size 8", 8123, f"repeat{r}-arm{a}", 3600.0, None)
        for r, a, sw, e in steps]
    assert lab.baselines == [([("arm A", "0"), ("arm B", "1")], "--tensor-parallel-size 8", False)]
    assert lab.loopback.requests == [] and lab.gpu_calls == list(GPU_COMMANDS)
    raw = (lab.out / "summary.json").read_text()
    summary = json.loads(raw)
    env = expected_environment(lab, summary["environment"], {"A": ("0", "off"), "B": ("1", "fused")},
                               concurrency=[1, 8], repeats=2, serve_args="--tensor-parallel-size 8")
    assert summary == {"run_id": run_id, "environment": env, "aborted": None,
                       "fusions": {"A": proved("0"), "B": proved("1")}, "rows": rows}
    assert raw == json.dumps(summary, indent=1, default=str)
    assert sorted(p.name for p in lab.out.iterdir()) == ["repeat0-armA", "repeat0-armB", "repeat1-armA",
                                                         "repeat1-armB", "run.json", "summary.json", "summary.md"]

    # ab-serve report, from the command line (sys.argv) and with --json: the same text, the same summary
    (lab.out / "summary.md").unlink()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["ab_serve.py", "report", str(lab.out)])
        assert ab_serve.main() == 0
    assert capsys.readouterr().out == text + "\n\n" + NO_PLOT + "\n"
    assert (lab.out / "summary.md").read_text() == text + "\n"
    assert ab_serve.main(["report", str(lab.out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again == {"command": "ab-serve report", "ok": True, "exit_status": 0, **summary, "error": None}


def test_served_name_tokenizer_prompts_bench_args_the_stock_arm_and_an_accepted_hazard(lab, capsys):
    lab.hazards = ["arm A: a hazard"]
    lab.gpu = {"rocm-smi": "AMD Instinct MI355X"}
    assert lab.main("--served-model-name", "kimi", "--tokenizer", "/tok", "--num-prompts", "1", "--repeats", "1",
                    "--concurrency", "3", "--bench-args=--seed 7 --ignore-eos", "--with-stock",
                    "--health-timeout", "0.5", "--accept-baseline-hazard") == 0
    printed = capsys.readouterr()
    steps = [("A", "0", "off"), ("B", "1", "fused"), ("C", "stock", "stock")]
    assert printed.out.splitlines()[:9] == [
        line for step, (label, switch, expect) in enumerate(steps, start=1)
        for line in (f"[{step}/3] repeat 0, arm {label} (K3_AMD_OVERLAY={switch}): starting",
                     f"[{step}/3] arm {label} proved {expect}", f"[{step}/3] arm {label}: bench at concurrency 3")]
    assert printed.err.splitlines()[0] == "k3-amd-overlay ab-serve: warning (--accept-baseline-hazard): arm A: a hazard"
    assert [b["argv"] for b in lab.benches()] == [
        lab.bench_argv("kimi", "/tok", "--seed 7 --ignore-eos", 1, 3, f"repeat0-arm{a}") for a, _, _ in steps]
    assert [(s[0].label, s[0].switch, s[0].expect, s[6], s[7]) for s in lab.serves] == [
        (a, sw, e, 0.5, "kimi") for a, sw, e in steps]
    assert lab.baselines == [([("arm A", "0"), ("arm B", "1"), ("arm C", "stock")], "", True)]
    text, rows = expected_text(lab.results(), [("B", "1", "the overlay's fusions"), ("C", "stock", "all unfused")], "0",
                               "vLLM as shipped", [f"- A (K3_AMD_OVERLAY=0): {OFF_LINE}",
                                                   f"- B (K3_AMD_OVERLAY=1): {ALL_APPLIED}",
                                                   f"- C (K3_AMD_OVERLAY=stock): {ALL_STOCK}"],
                               hazards=("arm A: a hazard",))
    assert printed.out.endswith("\n\n" + text + "\n\n" + NO_PLOT + "\n")
    assert list(rows) == ["B_vs_A", "C_vs_A"] and rows["C_vs_A"]
    summary = json.loads((lab.out / "summary.json").read_text())
    env = expected_environment(lab, summary["environment"],
                               {"A": ("0", "off"), "B": ("1", "fused"), "C": ("stock", "stock")},
                               gpu="AMD Instinct MI355X", served_model_name="kimi", concurrency=[3], num_prompts=1,
                               bench_args="--seed 7 --ignore-eos", baseline_hazards=["arm A: a hazard"])
    assert summary == {"run_id": run_id_of(lab.out), "environment": env, "aborted": None,
                       "fusions": {"A": proved("0"), "B": proved("1"), "C": proved("stock")}, "rows": rows}


def test_the_gpu_is_the_first_tool_that_names_it(lab, tmp_path):
    args = ab_serve.parser().parse_args(["--model", "k3", "--out", str(tmp_path / "none")])
    for answers, calls in (({"nvidia-smi": "NVIDIA H200", "amd-smi": "x", "rocm-smi": "y"}, 1),
                           ({"amd-smi": "MI300X", "rocm-smi": "y"}, 2), ({"rocm-smi": "MI355X"}, 3), ({}, 3)):
        lab.gpu, lab.gpu_calls = answers, []
        env = ab_serve.environment(args, [])
        assert env["gpu"] == next(iter(answers.values()), None) and lab.gpu_calls == list(GPU_COMMANDS[:calls])
        assert env["vllm_versions"] == [] and env["served_model_name"] == "k3" and env["arms"] == {}


def test_first_line_runs_the_tool_with_a_30_second_limit(monkeypatch):
    seen = []

    def fake_run(command, **kwargs):
        seen.append((command, kwargs))
        return subprocess.CompletedProcess(command, 0, stdout="  MI355X OAM \nsecond\n", stderr="")

    monkeypatch.setattr(ab_serve.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setattr(ab_serve.subprocess, "run", fake_run)
    assert ab_serve._first_line(["amd-smi", "static"]) == "MI355X OAM"
    assert seen == [(["amd-smi", "static"], {"capture_output": True, "text": True, "timeout": 30})]


# --- aborts and failures ------------------------------------------------------------------------------

def test_an_arm_that_fails_ends_the_run_and_the_summary_says_so(lab, capsys):
    lab.fail = {"repeat0-armB"}
    assert lab.main("--repeats", "2", "--concurrency", "1") == 1
    printed = capsys.readouterr()
    folder = lab.out / "repeat0-armB"
    aborted = "arm B (K3_AMD_OVERLAY=1) is not fused:"
    text, rows = expected_text(lab.results(), [("B", "1", "fusions not recorded")], "0", "vLLM as shipped",
                               [f"- A (K3_AMD_OVERLAY=0): {OFF_LINE}", f"- B (K3_AMD_OVERLAY=1): {NOT_RECORDED}"],
                               aborted=aborted, left_out=("repeat0-armB",))
    assert rows == {"B_vs_A": []} and "nothing to compare" in text
    assert printed.out == ("[1/4] repeat 0, arm A (K3_AMD_OVERLAY=0): starting\n[1/4] arm A proved off\n"
                           "[1/4] arm A: bench at concurrency 1\n[2/4] repeat 0, arm B (K3_AMD_OVERLAY=1): starting\n"
                           f"\n{text}\n\n{NO_PLOT}\n")
    assert printed.err.endswith(f"ABORTED: {aborted}\nNOT HOLDING\nlogs: {folder}\n")
    summary = json.loads((lab.out / "summary.json").read_text())
    assert (summary["aborted"], summary["rows"]) == (aborted, rows) and len(lab.serves) == 2
    assert ab_serve.main(["report", str(lab.out)]) == 1
    assert capsys.readouterr().out == text + "\n\n" + NO_PLOT + "\n"


def test_an_arm_whose_proof_lapses_during_its_benches_is_not_compared(lab, capsys):
    """Its benches ran and saved results, but its check no longer held after them: the run aborts
    with the after-check's reason, the results stay on disk and are left out of the table."""
    lab.fail_after = {"repeat0-armB"}
    assert lab.main("--repeats", "1", "--concurrency", "1") == 1
    printed = capsys.readouterr()
    folder = lab.out / "repeat0-armB"
    aborted = "arm B (K3_AMD_OVERLAY=1) is no longer fused after its measurement (its results are not used):"
    assert printed.err.endswith(f"ABORTED: {aborted}\nREFUSED\nlogs: {folder}\n")
    assert (folder / "bench-c1.json").is_file() and not (folder / ab_run.MEASURED_FILE).exists()
    assert ab_run.measured(lab.out / "repeat0-armA", run_id_of(lab.out))
    text, rows = expected_text({"A": lab.results()["A"]}, [("B", "1", "fusions not recorded")], "0", "vLLM as shipped",
                               [f"- A (K3_AMD_OVERLAY=0): {OFF_LINE}", f"- B (K3_AMD_OVERLAY=1): {NOT_RECORDED}"],
                               aborted=aborted, left_out=("repeat0-armB",))
    assert rows == {"B_vs_A": []} and printed.out.endswith(f"\n{text}\n\n{NO_PLOT}\n")
    summary = json.loads((lab.out / "summary.json").read_text())
    assert (summary["aborted"], summary["rows"]) == (aborted, rows)
    assert ab_serve.main(["report", str(lab.out)]) == 1
    assert capsys.readouterr().out == text + "\n\n" + NO_PLOT + "\n"


@pytest.mark.parametrize("mode", ["exit-3", "no-result"])
def test_a_bench_that_fails_or_saves_nothing_aborts_the_arm(lab, monkeypatch, capsys, mode):
    monkeypatch.setenv("ABC_BENCH", mode)
    assert lab.main("--repeats", "1", "--concurrency", "1") == 1
    log = lab.out / "repeat0-armA" / "bench-c1.log"
    message = f"arm A: bench at concurrency 1 failed; log: {log}"
    assert capsys.readouterr().err.endswith(f"ABORTED: {message}\n")
    assert json.loads((lab.out / "summary.json").read_text())["aborted"] == message and len(lab.serves) == 1


def test_json_is_one_object_on_stdout_on_every_path(lab, monkeypatch, capsys):
    assert lab.main("--json", "--repeats", "1", "--concurrency", "1") == 0
    printed = capsys.readouterr()
    summary = json.loads((lab.out / "summary.json").read_text())
    assert json.loads(printed.out) == {"command": "ab-serve", "ok": True, "exit_status": 0, **summary, "error": None}
    assert "[2/2] arm B: bench at concurrency 1" in printed.err

    lab.out, lab.fail = lab.out.parent / "aborted", {"repeat0-armB"}
    assert lab.main("--json", "--repeats", "1", "--concurrency", "1") == 1
    summary = json.loads((lab.out / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == {"command": "ab-serve", "ok": False, "exit_status": 1, **summary,
                                                   "error": "arm B (K3_AMD_OVERLAY=1) is not fused:"}

    # a folder of another run appears meanwhile: no summary is written, the run says why
    lab.fail = set()
    real = lab.proved_server

    @contextlib.contextmanager
    def with_a_stranger(arm, *args, **kwargs):
        (lab.out / "repeat7-armA").mkdir(exist_ok=True)
        with real(arm, *args, **kwargs) as server:
            yield server

    monkeypatch.setattr(arms, "proved_server", with_a_stranger)
    for flags in ([], ["--json"]):
        lab.out = lab.out.parent / f"foreign{len(flags)}"
        assert lab.main(*flags, "--repeats", "1", "--concurrency", "1") == 1
        printed = capsys.readouterr()
        stranger = (f"k3-amd-overlay ab-serve: results not written by run {run_id_of(lab.out)}: repeat7-armA "
                    "(no run id); a summary never mixes runs: move them out, or give each run its own --out")
        assert printed.err.splitlines()[-1] == stranger and not (lab.out / "summary.json").exists()
        if flags:
            assert json.loads(printed.out) == {"command": "ab-serve", "ok": False, "exit_status": 1,
                                               "error": stranger.removeprefix("k3-amd-overlay ab-serve: ")}


def test_progress_and_warnings_reach_their_reader_before_each_next_step(lab, tmp_path, monkeypatch):
    """Progress is flushed as it is printed: what a server's start and a bench see of stdout and
    stderr (files, so block-buffered) already holds each line printed before it."""
    lab.hazards, lab.fail = ["arm A: a hazard"], {"repeat0-armB"}
    lab.files = (tmp_path / "stdout.txt", tmp_path / "stderr.txt")
    monkeypatch.setenv("ABC_STDOUT", str(lab.files[0]))
    monkeypatch.setenv("ABC_STDERR", str(lab.files[1]))
    real_environment = ab_serve.environment

    def environment(args, arm_list):
        lab.snapshot("summary")
        return real_environment(args, arm_list)

    monkeypatch.setattr(ab_serve, "environment", environment)
    with open(lab.files[0], "w") as out, open(lab.files[1], "w") as err, pytest.MonkeyPatch.context() as streams:
        streams.setattr(sys, "stdout", out)
        streams.setattr(sys, "stderr", err)
        code = lab.main("--repeats", "1", "--concurrency", "2", "--accept-baseline-hazard")
    assert code == 1
    warnings = ("k3-amd-overlay ab-serve: warning (--accept-baseline-hazard): arm A: a hazard\n"
                "k3-amd-overlay ab-serve: warning: --repeats 1: with n=1 the smallest possible p is 1: no verdict "
                "possible (p < 0.05 needs n >= 6)\n")
    start_a = "[1/2] repeat 0, arm A (K3_AMD_OVERLAY=0): starting\n"
    bench_a = start_a + "[1/2] arm A proved off\n[1/2] arm A: bench at concurrency 2\n"
    aborted = "ABORTED: arm B (K3_AMD_OVERLAY=1) is not fused:\nNOT HOLDING\n"
    assert [(where, o, e) for where, o, e in lab.snapshots] == [
        ("serve repeat0-armA", start_a, warnings),
        ("serve repeat0-armB", bench_a + "[2/2] repeat 0, arm B (K3_AMD_OVERLAY=1): starting\n", warnings),
        ("summary", bench_a + "[2/2] repeat 0, arm B (K3_AMD_OVERLAY=1): starting\n",
         warnings + aborted + f"logs: {lab.out / 'repeat0-armB'}\n")]
    assert [(b["stdout"], b["stderr"]) for b in lab.benches()] == [(bench_a, warnings)]

    # the hazard's warning alone (n = 6 can give a verdict: no second warning flushes it)
    lab.out, lab.fail, lab.snapshots = tmp_path / "six", {"repeat0-armA"}, []
    with open(lab.files[0], "w") as out, open(lab.files[1], "w") as err, pytest.MonkeyPatch.context() as streams:
        streams.setattr(sys, "stdout", out)
        streams.setattr(sys, "stderr", err)
        assert lab.main("--repeats", "6", "--concurrency", "2", "--accept-baseline-hazard") == 1
    assert lab.snapshots[0] == ("serve repeat0-armA", "[1/12] repeat 0, arm A (K3_AMD_OVERLAY=0): starting\n",
                                "k3-amd-overlay ab-serve: warning (--accept-baseline-hazard): arm A: a hazard\n")


def test_the_profile_window_posts_start_then_stop_from_a_daemon_thread_ended_with_the_bench(lab, monkeypatch):
    made = []

    class Recorded(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(ab_serve.threading, "Thread", Recorded)
    args = ab_serve.parser().parse_args(["--model", "k3", "--out", str(lab.out), "--bench-cmd", lab.bench_cmd,
                                         "--profile-window", "0.01", "--num-prompts", "9"])
    workdir = lab.out / "repeat0-armB"
    workdir.mkdir(parents=True)
    lab.loopback.switch = "1"
    server = arms.Server(["serve"], arms.Arm("B", "1", "fused"), workdir, lab.loopback.port)
    saved = ab_serve.bench(args, server, 2, workdir / "bench-c2.json")
    assert saved == json.loads((workdir / "bench-c2.json").read_text()) and saved["output_throughput"] > 0
    window = [t for t in made if t.name.endswith("(profile window)")]
    assert len(window) == 1 and window[0].daemon
    assert not window[0].is_alive()  # joined before bench returns: nothing of it reaches a later bench
    assert lab.loopback.requests == [("POST", "/start_profile"), ("POST", "/stop_profile")]
    assert [b["argv"] for b in lab.benches()] == [lab.bench_argv("k3", "k3", BENCH_ARGS, 9, 2, "repeat0-armB")]


# --- the report's errors ------------------------------------------------------------------------------

def test_report_refuses_a_summary_that_is_missing_or_another_runs(lab, capsys):
    assert lab.main("--repeats", "1", "--concurrency", "1") == 0
    capsys.readouterr()
    run_id, summary = run_id_of(lab.out), lab.out / "summary.json"
    kept = json.loads(summary.read_text())
    summary.write_text(json.dumps({**kept, "run_id": "feedbeef"}))
    assert ab_serve.main(["report", str(lab.out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3-amd-overlay ab-serve report: error: {summary} is run feedbeef's, {lab.out / 'run.json'} says run {run_id}")
    summary.unlink()
    assert ab_serve.main(["report", str(lab.out), "--json"]) == 2
    printed = capsys.readouterr()
    message = f"{summary} not found: run {run_id} wrote no summary"
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay ab-serve report: error: {message}"
    assert json.loads(printed.out) == {"command": "ab-serve report", "ok": False, "exit_status": 2,
                                       "usage_error": message, "error": message}


def test_report_refuses_a_summary_it_cannot_read(lab, capsys):
    assert lab.main("--repeats", "1", "--concurrency", "1") == 0
    capsys.readouterr()
    run_id, summary = run_id_of(lab.out), lab.out / "summary.json"
    for text, why in (
            ("{broken", "is unreadable (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
            ("[]", "is no ab-serve summary: []"),
            (json.dumps({"run_id": run_id, "environment": {"arms": {"A": {"switch": "0"}}}}),
             "is no ab-serve summary: its arms are unreadable (KeyError('expect'))")):
        summary.write_text(text)
        for flags in ([], ["--json"]):
            assert ab_serve.main(["report", str(lab.out), *flags]) == 2
            printed = capsys.readouterr()
            message = f"{summary} {why}"
            assert printed.err.splitlines()[-1] == f"k3-amd-overlay ab-serve report: error: {message}"
            assert printed.out == (json.dumps({"command": "ab-serve report", "ok": False, "exit_status": 2,
                                               "usage_error": message, "error": message}, indent=1) + "\n"
                                   if flags else "")


def test_the_report_of_an_aborted_run_fails_as_the_run_did(lab, capsys):
    lab.fail = {"repeat0-armB"}
    assert lab.main("--repeats", "1", "--concurrency", "1") == 1
    capsys.readouterr()
    assert ab_serve.main(["report", str(lab.out), "--json"]) == 1
    summary = json.loads((lab.out / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == {"command": "ab-serve report", "ok": False, "exit_status": 1,
                                                   **summary, "error": "arm B (K3_AMD_OVERLAY=1) is not fused:"}


def test_a_run_whose_benches_gave_nothing_to_compare_fails_and_so_does_its_report(lab, tmp_path, capsys):
    """Every arm ran, held its proof and saved a bench result, but no result has a metric: no row."""
    empty = tmp_path / "empty_bench.py"
    empty.write_text("import sys\nfrom pathlib import Path\n\na = sys.argv\n"
                     "Path(a[a.index('--result-dir') + 1], a[a.index('--result-filename') + 1]).write_text('{}')\n")
    assert lab.main("--json", "--repeats", "1", "--concurrency", "1", "--bench-cmd", f"{sys.executable} {empty}") == 1
    printed = capsys.readouterr()
    summary = json.loads((lab.out / "summary.json").read_text())
    assert (summary["aborted"], summary["rows"]) == (None, {"B_vs_A": []})
    error = "no repeat completed by both arms: nothing to compare (B_vs_A)"
    assert json.loads(printed.out) == {"command": "ab-serve", "ok": False, "exit_status": 1, **summary, "error": error}
    assert ab_serve.main(["report", str(lab.out), "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"command": "ab-serve report", "ok": False, "exit_status": 1,
                                                   **summary, "error": error}
    assert ab_serve.main(["report", str(lab.out)]) == 1


def test_a_bench_result_that_is_not_json_aborts_the_run_and_fails_the_report(lab, tmp_path, capsys):
    broken = tmp_path / "broken_bench.py"
    broken.write_text("import sys\nfrom pathlib import Path\n\na = sys.argv\n"
                      "Path(a[a.index('--result-dir') + 1], a[a.index('--result-filename') + 1]).write_text('{no')\n")
    assert lab.main("--repeats", "1", "--concurrency", "1", "--bench-cmd", f"{sys.executable} {broken}") == 1
    result = lab.out / "repeat0-armA" / "bench-c1.json"
    assert (f"arm A: bench at concurrency 1 wrote {result}, which is not JSON (Expecting property name enclosed in "
            f"double quotes: line 1 column 2 (char 1)); log: {result.with_suffix('.log')}") in capsys.readouterr().out
    capsys.readouterr()
    assert lab.main("--repeats", "1", "--concurrency", "1", "--out", str(tmp_path / "again")) == 0
    capsys.readouterr()
    saved = tmp_path / "again" / "repeat0-armB" / "bench-c1.json"
    saved.write_text("{no")
    assert ab_serve.main(["report", str(tmp_path / "again")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3-amd-overlay ab-serve report: error: {saved} is unreadable (Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1))")


def test_a_bench_result_the_table_cannot_read_fails_its_arm_not_the_summary(lab, tmp_path, capsys):
    """A metric that is no finite number (a bench that measured nothing writes such things) fails the arm
    as it happens; before, it was saved and the summary of the whole run refused it as foreign results."""
    odd = tmp_path / "odd_bench.py"
    odd.write_text("import sys\nfrom pathlib import Path\n\na = sys.argv\n"
                   "Path(a[a.index('--result-dir') + 1], a[a.index('--result-filename') + 1])"
                   ".write_text('{\"median_tpot_ms\": \"n/a\"}')\n")
    assert lab.main("--repeats", "1", "--concurrency", "1", "--bench-cmd", f"{sys.executable} {odd}") == 1
    result = lab.out / "repeat0-armA" / "bench-c1.json"
    printed = capsys.readouterr().out
    assert (f"arm A: bench at concurrency 1 wrote {result}, which the table cannot read: \"median_tpot_ms\" is "
            f"'n/a', not a finite number; log: {result.with_suffix('.log')}") in printed, printed
    summary = json.loads((lab.out / "summary.json").read_text())
    assert summary["aborted"].startswith("arm A: bench at concurrency 1 wrote") and summary["rows"] == {"B_vs_A": []}


# --- the plot -----------------------------------------------------------------------------------------

class FakePyplot:
    """matplotlib as plot_serving uses it (matplotlib is not installed here): every call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.figure = types.SimpleNamespace(
            tight_layout=lambda: self.calls.append(("tight_layout",)),
            savefig=lambda path, **kw: (self.calls.append(("savefig", path, kw)), Path(path).write_bytes(b"png")))
        self.matplotlib = types.ModuleType("matplotlib")
        self.matplotlib.use = lambda backend: self.calls.append(("use", backend))
        self.pyplot = types.ModuleType("matplotlib.pyplot")
        self.pyplot.subplots = self.subplots
        self.pyplot.close = lambda figure: self.calls.append(("close", figure is self.figure))
        self.matplotlib.pyplot = self.pyplot

    def subplots(self, nrows, ncols, **kw):
        self.calls.append(("subplots", nrows, ncols, kw))
        return self.figure, [self.axis(i) for i in range(ncols)]

    def axis(self, i: int) -> types.SimpleNamespace:
        def record(name):
            return lambda *a, **kw: self.calls.append((i, name, a, kw))
        return types.SimpleNamespace(**{name: record(name) for name in (
            "errorbar", "set_xscale", "set_xticks", "set_xlabel", "set_title", "legend")})


def test_the_plot_draws_each_arms_median_with_the_repeats_range(lab, monkeypatch):
    fake = FakePyplot()
    monkeypatch.setitem(sys.modules, "matplotlib", fake.matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", fake.pyplot)
    run_id = ab_run.claim(lab.out, "ab-serve")
    saved = {  # per repeat: arm -> concurrency -> bench JSON; A never saved a TTFT, nor a TPOT once
        0: {"A": {1: {"median_tpot_ms": 20.0, "output_throughput": 50.0},
                  4: {"median_tpot_ms": 30.0, "output_throughput": 120.0}},
            "B": {1: {"median_tpot_ms": 18.0, "median_ttft_ms": 90.0, "output_throughput": 55.0},
                  4: {"median_tpot_ms": 28.0, "median_ttft_ms": 95.0, "output_throughput": 130.0}}},
        1: {"A": {1: {"median_tpot_ms": 26.0, "output_throughput": 40.0}, 4: {"output_throughput": 100.0}},
            "B": {1: {"median_tpot_ms": 19.0, "median_ttft_ms": 80.0, "output_throughput": 52.0},
                  4: {"median_tpot_ms": 27.0, "median_ttft_ms": 99.0, "output_throughput": 125.0}}},
        2: {"A": {1: {"median_tpot_ms": 21.0, "output_throughput": 45.0},
                  4: {"median_tpot_ms": 34.0, "output_throughput": 110.0}},
            "B": {1: {"median_tpot_ms": 25.0, "median_ttft_ms": 85.0, "output_throughput": 60.0},
                  4: {"median_tpot_ms": 29.0, "median_ttft_ms": 97.0, "output_throughput": 140.0}}},
    }
    for repeat, by_arm in saved.items():
        for label, by_c in by_arm.items():
            ab_run.stamp(lab.out / f"repeat{repeat}-arm{label}", run_id)
            ab_run.mark_measured(lab.out / f"repeat{repeat}-arm{label}", run_id)
            for c, result in by_c.items():
                (lab.out / f"repeat{repeat}-arm{label}" / f"bench-c{c}.json").write_text(json.dumps(result))
    arm_list = [arms.Arm("A", "stock", "stock"), arms.Arm("B", "qk_cache", "fused")]
    text = ab_serve.summarise(lab.out, run_id, arm_list, {"baseline_hazards": []}, None)
    expected, rows = expected_text(lab.results(), [("B", "qk_cache", "fusions not recorded")], "stock",
                                   "fusions not recorded", [f"- A (K3_AMD_OVERLAY=stock): {NOT_RECORDED}",
                                                            f"- B (K3_AMD_OVERLAY=qk_cache): {NOT_RECORDED}"])
    assert text == expected + f"\n\nplot: {lab.out / 'summary.png'}"
    assert json.loads((lab.out / "summary.json").read_text()) == {"run_id": run_id, "environment": {
        "baseline_hazards": []}, "aborted": None, "fusions": {"A": None, "B": None}, "rows": rows}

    def bars(label, xs, mid, low, high, switch):
        return ("errorbar", (xs, mid), {"yerr": [low, high], "marker": "o", "capsize": 3,
                                        "label": f"{label}: K3_AMD_OVERLAY={switch}"})

    drawn = {
        "TPOT p50 (ms)": [bars("A", [1, 4], [21.0, 32.0], [1.0, 2.0], [5.0, 2.0], "stock"),
                          bars("B", [1, 4], [19.0, 28.0], [1.0, 1.0], [6.0, 1.0], "qk_cache")],
        "TTFT p50 (ms)": [bars("B", [1, 4], [85.0, 97.0], [5.0, 2.0], [5.0, 2.0], "qk_cache")],
        "out tok/s": [bars("A", [1, 4], [45.0, 110.0], [5.0, 10.0], [5.0, 10.0], "stock"),
                      bars("B", [1, 4], [55.0, 130.0], [3.0, 5.0], [5.0, 10.0], "qk_cache")],
    }
    calls = [("use", "Agg"), ("subplots", 1, 3, {"figsize": (15, 4)})]
    for i, (label, lines) in enumerate(drawn.items()):
        calls += [(i, name, a, kw) for name, a, kw in lines]
        calls += [(i, "set_xscale", ("log",), {"base": 2}), (i, "set_xticks", ([1, 4], ["1", "4"]), {}),
                  (i, "set_xlabel", ("concurrency",), {}), (i, "set_title", (label,), {}),
                  (i, "legend", (), {"fontsize": 8})]
    calls += [("tight_layout",), ("savefig", lab.out / "summary.png", {"dpi": 120}), ("close", True)]
    assert fake.calls == calls
    assert os.path.getsize(lab.out / "summary.png") == 3


def test_a_profile_window_never_outlives_its_bench(lab):
    """Closed when its bench ends: one that had not begun posts nothing (and says the bench gave no
    trace); one that began is stopped before close returns; a window's post that fails is said, never
    lost in its thread."""
    url = f"http://127.0.0.1:{lab.loopback.port}"
    early = ab_serve.ProfileWindow(url, 30.0)
    assert early.close() == ("it ended before its profile window began (30 s in): no trace; give a shorter "
                             "--profile-window or more prompts")
    assert lab.loopback.requests == []
    open_window = ab_serve.ProfileWindow(url, 0.05)
    deadline = time.monotonic() + 30
    while not open_window.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert open_window.close() is None
    assert lab.loopback.requests == [("POST", "/start_profile"), ("POST", "/stop_profile")]
    refused = ab_serve.ProfileWindow("http://127.0.0.1:9", 0.01)  # nothing listens on the discard port
    deadline = time.monotonic() + 30
    while refused.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refused.close().startswith("the profile window failed (URLError: ")
