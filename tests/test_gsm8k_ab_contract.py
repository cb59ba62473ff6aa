"""The contract of `k3-amd-overlay gsm8k-ab`, word for word: each option's help, default and
requirement; each usage error and abort message; the lm-eval command line of each arm and the
local task file it is pointed at; the table printed and written to summary.md; summary.json and
the --json object on success and on failure; every progress and warning line flushed as it is
printed. The arms' servers are a recording stand-in of ``arms.proved_server`` (the real one is run
against loopback servers in test_ab.py); lm-eval is a stand-in script that logs its command line
and writes the files each test plans, in lm-eval's layout."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from cli_process import with_defaults
from test_ab import free_port

from k3_amd_overlay.commands import ab_stats, arms, baseline_hazard, gsm8k_ab
from k3_amd_overlay.commands.usage import UsageError
from k3_amd_overlay.settings import SettingsError, load_settings

K3_ARGS = "--tensor-parallel-size 8 --kv-cache-dtype fp8 --trust-remote-code"
HAZARD_ENV = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_ROCM_USE_AITER": "1"}
FACTS = baseline_hazard.VllmFacts("0.33.0", True)  # a vLLM with a fused decode of its own (0.32-0.33)
HEADER = "| arm | K3_AMD_OVERLAY | {task} {metric} | questions |"

FAKE_LM_EVAL = '''
"""lm-eval stand-in: logs its argv, writes the files its arm's plan names (paths relative to
--output_path), prints one line to each stream and exits with the plan's status."""
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["FAKE_LM_EVAL_CALLS"], "a") as calls:
    calls.write(json.dumps([sys.executable, *sys.argv]) + "\\n")
out = Path(argv[argv.index("--output_path") + 1])
out.mkdir(parents=True, exist_ok=True)
plan = json.loads(Path(os.environ["FAKE_LM_EVAL_PLAN"]).read_text())[out.parent.name]
for rel, text in plan["files"].items():
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
print("stdout of", out.parent.name, flush=True)
print("stderr of", out.parent.name, file=sys.stderr, flush=True)
sys.exit(plan.get("exit", 0))
'''


class Tracked(io.StringIO):
    """A text stream that knows how much of what was written has been flushed."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed = 0

    def flush(self) -> None:
        self.flushed = len(self.getvalue())
        super().flush()

    def unflushed(self) -> str:
        return self.getvalue()[self.flushed:]


class Harness:
    """The stand-ins one run uses, and what they saw."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp_path
        self.out = tmp_path / "out"
        self.script = tmp_path / "fake_lm_eval.py"
        self.script.write_text(FAKE_LM_EVAL)
        self.calls_file = tmp_path / "lm_eval_calls.jsonl"
        self.plan_file = tmp_path / "plan.json"
        self.servers: list[dict] = []
        self.streams: tuple[Tracked, Tracked] | None = None
        self.unflushed_seen: list[tuple[str, str, str]] = []
        monkeypatch.setenv("FAKE_LM_EVAL_CALLS", str(self.calls_file))
        monkeypatch.setenv("FAKE_LM_EVAL_PLAN", str(self.plan_file))
        monkeypatch.setattr(baseline_hazard, "facts_here", lambda: FACTS)
        for name in HAZARD_ENV:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv("K3_AMD_OVERLAY", raising=False)
        monkeypatch.setattr(arms, "proved_server", self.proved_server)
        real_run = subprocess.run

        def run(*args, **kwargs):
            self.note_unflushed("lm-eval")
            return real_run(*args, **kwargs)

        monkeypatch.setattr(gsm8k_ab.subprocess, "run", run)

    def track_streams(self, monkeypatch: pytest.MonkeyPatch) -> tuple[Tracked, Tracked]:
        self.streams = (Tracked(), Tracked())
        monkeypatch.setattr(sys, "stdout", self.streams[0])
        monkeypatch.setattr(sys, "stderr", self.streams[1])
        return self.streams

    def note_unflushed(self, where: str) -> None:
        if self.streams:
            self.unflushed_seen.append((where, self.streams[0].unflushed(), self.streams[1].unflushed()))

    @contextlib.contextmanager
    def proved_server(self, arm: arms.Arm, serve_cmd: str, model: str, serve_args: str, port: int, workdir: Path,
                      health_timeout: float, served_name: str | None = None):
        self.note_unflushed(f"server {arm.label}")
        self.servers.append({"arm": (arm.label, arm.switch, arm.expect), "serve_cmd": serve_cmd, "model": model,
                             "serve_args": serve_args, "port": port, "workdir": workdir,
                             "health_timeout": health_timeout, "served_name": served_name,
                             "stamped": (workdir / "run-id").read_text()})
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{port}")

    def lm_eval_cmd(self) -> str:
        return f"{sys.executable} {self.script}"

    def calls(self) -> list[list[str]]:
        if not self.calls_file.exists():
            return []
        return [json.loads(line) for line in self.calls_file.read_text().splitlines()]

    def plan(self, plans: dict[str, dict]) -> None:
        self.plan_file.write_text(json.dumps(plans))

    def argv(self, *extra: str) -> list[str]:
        return with_defaults({"--model": "k3", "--out": str(self.out), "--serve-cmd": sys.executable,
                              "--lm-eval-cmd": self.lm_eval_cmd()}, extra)


@pytest.fixture
def harness(tmp_path, monkeypatch) -> Harness:
    return Harness(tmp_path, monkeypatch)


def random_outcomes(rng: random.Random) -> tuple[int, set[int], set[int]]:
    """n questions; the ones A and B get right: B loses 8-15 of A's and gains 1-3 (so |delta| moves
    the second decimal of a percentage by more than one step per percent of scale)."""
    n = rng.randint(60, 90)
    a_right = set(rng.sample(range(n), rng.randint(n // 2, n - 20)))
    lost = set(rng.sample(sorted(a_right), rng.randint(8, 15)))
    gained = set(rng.sample(sorted(set(range(n)) - a_right), rng.randint(1, 3)))
    return n, a_right, (a_right - lost) | gained


def arm_files(task: str, n: int, right: set[int], accuracy: float, rng: random.Random) -> dict[str, str]:
    """What lm-eval --log_samples leaves for one arm: two older results and samples files (other
    numbers) and the newest, the flexible-extract filter scoring each question the other way."""
    files = {}
    for stamp in ("2026-12-01T09-00-00", "2026-12-01T10-00-00"):
        stale = {q for q in range(n) if rng.random() < 0.5}
        files[f"model/results_{stamp}.json"] = json.dumps({
            "results": {task: {"exact_match,strict-match": rng.random(), "exact_match,flexible-extract": 0.25}},
            "n-samples": {task: {"original": 7, "effective": 3}}})
        files[f"model/samples_{task}_{stamp}.jsonl"] = "".join(
            json.dumps({"doc_id": q, "filter": "strict-match", "exact_match": float(q in stale)}) + "\n"
            for q in range(n))
    files["model/results_2026-12-01T11-00-00.json"] = json.dumps({
        "results": {task: {"exact_match,strict-match": accuracy, "exact_match,flexible-extract": 1 - accuracy}},
        "n-samples": {task: {"original": 1319, "effective": n}}})
    files[f"model/samples_{task}_2026-12-01T11-00-00.jsonl"] = "".join(
        json.dumps({"doc_id": q, "filter": f, "metrics": ["exact_match"], "exact_match": float((q in right) == keep)})
        + "\n" for q in range(n) for f, keep in (("strict-match", True), ("flexible-extract", False)))
    return files


def planned(h: Harness, task: str = "gsm8k", flexible: bool = False) -> dict:
    """Plan both arms from fresh random outcomes; what the run must report under the strict-match
    filter (or, ``flexible``, under flexible-extract, where the plan scores each question the other way)."""
    rng = random.Random()
    n, a_right, b_right = random_outcomes(rng)
    acc = {"A": rng.uniform(0.5, 0.95), "B": rng.uniform(0.5, 0.95)}
    h.plan({"armA": {"files": arm_files(task, n, a_right, acc["A"], rng)},
            "armB": {"files": arm_files(task, n, b_right, acc["B"], rng)}})
    if flexible:
        a_right, b_right = set(range(n)) - a_right, set(range(n)) - b_right
        acc = {"A": 1 - acc["A"], "B": 1 - acc["B"]}
    only_a, only_b = len(a_right - b_right), len(b_right - a_right)
    paired = ab_stats.PairedAccuracy(n, len(a_right), len(b_right), only_a, only_b)
    assert paired.delta == len(b_right) / n - len(a_right) / n and abs(paired.delta) > 0.05
    return {"n": n, "acc": acc, "only_a": only_a, "only_b": only_b, "delta": paired.delta,
            "verdict": paired.verdict(), "task": task}


def expected_lines(e: dict, run_id: str, switches=("0", "1"), metric="exact_match,strict-match",
                   hazards=()) -> list[str]:
    return [
        HEADER.format(task=e["task"], metric=metric), "|---|---|---|---|",
        f"| A | {switches[0]} | {e['acc']['A']:.4f} | {e['n']} |",
        f"| B | {switches[1]} | {e['acc']['B']:.4f} | {e['n']} |",
        "",
        f"paired over {e['n']} questions: delta (B - A) {100 * e['delta']:+.2f} pp; right only with A: {e['only_a']}, "
        f"only with B: {e['only_b']}",
        f"verdict: {e['verdict']}",
        "", f"run {run_id}",
        *(f"WARNING, measured with --accept-baseline-hazard: {hazard}" for hazard in hazards)]


def expected_summary(e: dict, run_id: str, switches=("0", "1"), metric="exact_match,strict-match",
                     hazards=()) -> dict:
    return {"run_id": run_id, "task": e["task"], "metric": metric,
            "arms": {"A": {"switch": switches[0], "accuracy": e["acc"]["A"], "questions": e["n"]},
                     "B": {"switch": switches[1], "accuracy": e["acc"]["B"], "questions": e["n"]}},
            "paired": {"questions": e["n"], "delta": e["delta"], "only_a": e["only_a"], "only_b": e["only_b"],
                       "verdict": e["verdict"]},
            "baseline_hazards": list(hazards)}


def run_id_of(out: Path) -> str:
    record = json.loads((out / "run.json").read_text())
    assert sorted(record) == ["run_id", "started", "tool"] and record["tool"] == "gsm8k-ab"
    return record["run_id"]


def lm_eval_argv(h: Harness, label: str, model_args: str, task="gsm8k", fewshot="5", tail=()) -> list[str]:
    return [sys.executable, str(h.script), "--model", "local-completions", "--model_args", model_args, "--tasks", task,
            "--num_fewshot", fewshot, "--output_path", str(h.out / f"arm{label}" / "lm_eval"), "--log_samples", *tail]


# ---------------------------------------------------------------- the options


def test_every_option_its_help_default_and_requirement():
    p = gsm8k_ab.parser()
    assert p.prog == "k3-amd-overlay gsm8k-ab"
    got = [(a.option_strings, a.dest, a.default, a.required, a.type, a.help) for a in p._actions]
    assert got == [
        (["-h", "--help"], "help", "==SUPPRESS==", False, None, "show this help message and exit"),
        (["--model"], "model", None, True, None, "the checkpoint the server loads"),
        (["--served-model-name"], "served_model_name", None, False, None,
         "the name the server answers to (default: the --model value)"),
        (["--serve-args"], "serve_args", "", False, None, "server arguments, identical for every arm"),
        (["--arm-a"], "arm_a", "0", False, None,
         "K3_AMD_OVERLAY of the baseline arm (0: vLLM as it is; stock: the unfused path, vLLM's own fusions off too)"),
        (["--arm-b"], "arm_b", "1", False, None, "K3_AMD_OVERLAY of the candidate arm"),
        (["--accept-baseline-hazard"], "accept_baseline_hazard", False, False, None,
         "run even where an arm is no valid baseline on this vLLM (breakable CUDA graphs record vLLM's own fused "
         "decode into the graph; see baseline_hazard.py): the summary says so"),
        (["--port"], "port", 8010, False, int, "the port each arm's server listens on"),
        (["--serve-cmd"], "serve_cmd", "vllm serve", False, None, "the command that starts a server"),
        (["--health-timeout"], "health_timeout", 3600.0, False, float, "seconds for a server to become healthy"),
        (["--out"], "out", None, True, Path,
         "a new or empty directory for the arms' results and the summary (a used one is refused)"),
        (["--lm-eval-cmd"], "lm_eval_cmd", "lm_eval", False, None, "the lm-eval command (lm-eval[api] installed)"),
        (["--task"], "task", "gsm8k", False, None, "the lm-eval task"),
        (["--num-fewshot"], "num_fewshot", 5, False, int, "few-shot examples in each prompt"),
        (["--limit"], "limit", None, False, int, "questions per arm (default: all)"),
        (["--num-concurrent"], "num_concurrent", 32, False, int, "lm-eval's concurrent requests to the server"),
        (["--metric"], "metric", "exact_match,strict-match", False, None, "the lm-eval metric and filter compared"),
        (["--extra-model-args"], "extra_model_args", "", False, None,
         "appended to lm-eval's --model_args, e.g. max_gen_toks=256,max_length=4096"),
        (["--data-file"], "data_file", None, False, Path, "a local GSM8K-format JSONL instead of the hub data set"),
        (["--json"], "json", False, False, None,
         "one JSON object on stdout on every path (the result; progress goes to stderr)"),
    ]


def test_out_and_model_are_required(capsys):
    with pytest.raises(SystemExit) as exited:
        gsm8k_ab.parse_args(["--model", "k3"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("k3-amd-overlay gsm8k-ab: error: the following arguments "
                                                        "are required: --out")


# ---------------------------------------------------------------- usage errors, word for word


def switch_error(value: str) -> str:
    with pytest.raises(SettingsError) as refused:
        load_settings({"K3_AMD_OVERLAY": value})
    return str(refused.value)


@pytest.mark.parametrize("extra,message", [
    (["--limit", "0"], "--limit 0: at least 1"),
    (["--limit", "-3"], "--limit -3: at least 1"),
    (["--data-file", "{tmp}/no-such.jsonl"], "--data-file {tmp}/no-such.jsonl: no such file"),
    (["--data-file", "{tmp}"], "--data-file {tmp}: a directory, not a file"),  # said "no such file" before
    (["--arm-a", "fast"], "--arm-a: {switch_error_fast}"),
    (["--arm-b", "fast"], "--arm-b: {switch_error_fast}"),
    (["--arm-a", "stock", "--arm-b", "stock"], "the arms must differ: --arm-a 'stock' and --arm-b 'stock' are the "
                                               "same setting (stock), an A/B of an arm against itself"),
    (["--serve-cmd", "no-such-vllm serve"], "--serve-cmd 'no-such-vllm serve': no-such-vllm is not an executable on "
                                            "PATH"),
    (["--lm-eval-cmd", "no-such-lm-eval --x"], "--lm-eval-cmd 'no-such-lm-eval --x': no-such-lm-eval is not an "
                                               "executable on PATH"),
    *((["--metric", metric], f"--metric {metric!r}: lm-eval names each result METRIC,FILTER, e.g. "
                             "exact_match,strict-match (acc,none where the task has no filter)")
      for metric in ("exact_match", "exact_match,strict-match,x", "exact_match, strict-match", ",strict-match", "")),
    (["--num-fewshot", "-1"], "--num-fewshot -1: at least 0"),
    (["--num-concurrent", "0"], "--num-concurrent 0: at least 1"),
    (["--port", "99999"], "--port 99999: must be 1-65535"),
    (["--port", "0"], "--port 0: must be 1-65535"),
    (["--health-timeout", "0"], "--health-timeout 0.0: must be a positive, finite number of seconds"),
    (["--serve-args", '--foo "x'], """--serve-args '--foo "x': No closing quotation (quote it as a shell would)"""),
    (["--serve-args", "--port 9000"], "--serve-args '--port 9000': --port is set by the tool itself; give the tool's "
                                      "--port (the server it polls for health is on that port)"),
    # lm-eval would take one of two num_concurrent values without a word
    (["--extra-model-args", "max_gen_toks=256, num_concurrent=8"], "--extra-model-args 'max_gen_toks=256, "
                                                                   "num_concurrent=8': num_concurrent is set by the "
                                                                   "tool itself; give gsm8k-ab's --num-concurrent"),
    (["--extra-model-args", "base_url=http://x/v1"], "--extra-model-args 'base_url=http://x/v1': base_url is set by "
                                                     "the tool itself; gsm8k-ab points lm-eval at each arm's proved "
                                                     "server"),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_each_usage_error_word_for_word_before_anything_starts(harness, capsys, extra, message, as_json):
    tmp = str(harness.tmp)
    extra = [x.format(tmp=tmp) for x in extra]
    message = message.format(tmp=tmp, switch_error_fast=switch_error("fast") if "fast" in extra else "")
    code = gsm8k_ab.main(harness.argv(*extra, *(["--json"] if as_json else [])))
    printed = capsys.readouterr()
    assert code == 2
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay gsm8k-ab: error: {message}"
    assert printed.err.startswith("usage: k3-amd-overlay gsm8k-ab ")
    if as_json:
        assert json.loads(printed.out) == {"command": "gsm8k-ab", "ok": False, "exit_status": 2,
                                           "usage_error": message, "error": message}
    else:
        assert printed.out == ""
    assert not harness.out.exists() and harness.servers == [] and harness.calls() == []


@pytest.mark.parametrize("as_json", [False, True])
def test_an_out_that_cannot_be_created_is_a_usage_error_before_anything_starts(harness, capsys, as_json):
    (harness.tmp / "a-file").write_text("")
    harness.out = harness.tmp / "a-file" / "out"
    assert gsm8k_ab.main(harness.argv("--limit", "1", *(["--json"] if as_json else []))) == 2
    printed = capsys.readouterr()
    message = f"--out {harness.out} cannot be created: Not a directory"
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay gsm8k-ab: error: {message}"
    assert "warning" not in printed.err and harness.servers == [] and harness.calls() == []
    assert printed.out == (json.dumps({"command": "gsm8k-ab", "ok": False, "exit_status": 2, "usage_error": message,
                                       "error": message}, indent=1) + "\n" if as_json else "")


def test_a_hazardous_baseline_is_refused_word_for_word(harness, monkeypatch, capsys):
    for name, value in HAZARD_ENV.items():
        monkeypatch.setenv(name, value)
    why = baseline_hazard.baseline_hazard(FACTS, dict(os.environ), K3_ARGS, "0")
    assert why
    assert gsm8k_ab.main(harness.argv("--serve-args", K3_ARGS)) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3-amd-overlay gsm8k-ab: error: arm A: {why} (to measure it anyway, pass --accept-baseline-hazard: the "
        "summary says so)")
    assert not harness.out.exists()


# ---------------------------------------------------------------- a whole run, word for word


def test_a_run_prints_writes_and_calls_lm_eval_word_for_word(harness, monkeypatch):
    """Every non-default option, an accepted hazard and --limit 1 (the smallest allowed): the
    warnings, progress, table, summary.md, summary.json, each arm's server and lm-eval command
    line, each lm-eval log; every progress and warning line flushed before the next step."""
    for name, value in HAZARD_ENV.items():
        monkeypatch.setenv(name, value)
    why = baseline_hazard.baseline_hazard(FACTS, dict(os.environ), K3_ARGS, "0")
    e = planned(harness)
    out_stream, err_stream = harness.track_streams(monkeypatch)
    code = gsm8k_ab.main(harness.argv("--serve-args", K3_ARGS, "--accept-baseline-hazard", "--limit", "1",
                                      "--served-model-name", "k3-served", "--port", "18123", "--health-timeout", "75",
                                      "--num-concurrent", "7", "--num-fewshot", "3",
                                      "--extra-model-args", "max_gen_toks=256,max_length=4096"))
    assert code == 0, err_stream.getvalue()
    run_id = run_id_of(harness.out)
    hazards = [f"arm A: {why}"]
    assert err_stream.getvalue() == (
        f"k3-amd-overlay gsm8k-ab: warning (--accept-baseline-hazard): arm A: {why}\n"
        f"k3-amd-overlay gsm8k-ab: warning: --limit 1: at most 1 questions can differ between the arms; "
        f"{ab_stats.no_verdict_reason(1)}\n")
    lines = expected_lines(e, run_id, hazards=hazards)
    assert out_stream.getvalue() == "\n".join([
        "arm A (K3_AMD_OVERLAY=0): starting", "arm A proved off; running gsm8k",
        "arm B (K3_AMD_OVERLAY=1): starting", "arm B proved fused; running gsm8k", *lines]) + "\n"
    assert (harness.out / "summary.md").read_text() == "\n".join(lines) + "\n"
    assert (harness.out / "summary.json").read_text() == json.dumps(expected_summary(e, run_id, hazards=hazards),
                                                                     indent=1)
    assert harness.unflushed_seen == [(w, "", "") for w in ("server A", "lm-eval", "server B", "lm-eval")]
    assert harness.servers == [
        {"arm": (label, switch, expect), "serve_cmd": sys.executable, "model": "k3", "serve_args": K3_ARGS,
         "port": 18123, "workdir": harness.out / f"arm{label}", "health_timeout": 75.0, "served_name": "k3-served",
         "stamped": run_id + "\n"}
        for label, switch, expect in (("A", "0", "off"), ("B", "1", "fused"))]
    model_args = ("model=k3-served,base_url=http://127.0.0.1:18123/v1/completions,num_concurrent=7,"
                  "tokenized_requests=False,max_gen_toks=256,max_length=4096")
    assert harness.calls() == [lm_eval_argv(harness, label, model_args, fewshot="3", tail=("--limit", "1"))
                               for label in "AB"]
    for label in "AB":
        log = harness.out / f"arm{label}" / "lm_eval.log"
        assert log.read_text() == f"stdout of arm{label}\nstderr of arm{label}\n"
    assert sorted(p.name for p in harness.out.iterdir()) == ["armA", "armB", "run.json", "summary.json",
                                                            "summary.md"]


def test_extra_model_args_may_repeat_none_of_the_keys_the_tool_sets():
    """MODEL_ARGS_OWNED is what lm_eval_model_args sets: a key it adds and MODEL_ARGS_OWNED lacks
    would reach lm-eval twice from an --extra-model-args repeating it."""
    args = gsm8k_ab.parser().parse_args(["--model", "m", "--out", "o", "--extra-model-args", "max_length=4096"])
    keys = [item.split("=", 1)[0] for item in gsm8k_ab.lm_eval_model_args(args, "m", "http://h:1").split(",")]
    assert keys[-1] == "max_length" and set(keys[:-1]) == set(gsm8k_ab.MODEL_ARGS_OWNED)


def test_defaults_and_json_one_object_on_stdout(harness, capsys):
    """All defaults (task, metric, few-shot, concurrency, the arms, the served name, no limit):
    the lm-eval command line, no warning, and with --json stdout exactly the result object."""
    e = planned(harness)
    code = gsm8k_ab.main(harness.argv("--json"))
    printed = capsys.readouterr()
    assert code == 0, printed.err
    run_id = run_id_of(harness.out)
    summary = expected_summary(e, run_id)
    assert printed.out == json.dumps({"command": "gsm8k-ab", "ok": True, "exit_status": 0, **summary}, indent=1) + "\n"
    assert printed.err == "\n".join([
        "arm A (K3_AMD_OVERLAY=0): starting", "arm A proved off; running gsm8k",
        "arm B (K3_AMD_OVERLAY=1): starting", "arm B proved fused; running gsm8k",
        *expected_lines(e, run_id)]) + "\n"
    assert (harness.out / "summary.json").read_text() == json.dumps(summary, indent=1)
    assert [s["served_name"] for s in harness.servers] == ["k3", "k3"]
    assert [(s["port"], s["health_timeout"], s["serve_args"]) for s in harness.servers] == [(8010, 3600.0, "")] * 2
    model_args = "model=k3,base_url=http://127.0.0.1:8010/v1/completions,num_concurrent=32,tokenized_requests=False"
    assert harness.calls() == [lm_eval_argv(harness, label, model_args) for label in "AB"]


def test_another_metric_task_and_arms_name_themselves(harness, monkeypatch):
    """Arm B hazardous, accepted, and a --limit that can reach a verdict (no warning): the
    hazard's warning flushed before the first arm starts."""
    for name, value in HAZARD_ENV.items():
        monkeypatch.setenv(name, value)
    hazards = [f"arm B: {baseline_hazard.baseline_hazard(FACTS, dict(os.environ), K3_ARGS, 'qkv_norm')}"]
    e = planned(harness, task="gsm8k_cot", flexible=True)
    metric, switches = "exact_match,flexible-extract", ("stock", "qkv_norm")
    out_stream, err_stream = harness.track_streams(monkeypatch)
    code = gsm8k_ab.main(harness.argv("--task", "gsm8k_cot", "--metric", metric, "--arm-a", "stock",
                                      "--arm-b", "qkv_norm", "--limit", "6", "--serve-args", K3_ARGS,
                                      "--accept-baseline-hazard"))
    assert code == 0, err_stream.getvalue()
    assert err_stream.getvalue() == f"k3-amd-overlay gsm8k-ab: warning (--accept-baseline-hazard): {hazards[0]}\n"
    assert harness.unflushed_seen == [(w, "", "") for w in ("server A", "lm-eval", "server B", "lm-eval")]
    run_id = run_id_of(harness.out)
    assert (harness.out / "summary.json").read_text() == json.dumps(
        expected_summary(e, run_id, switches, metric, hazards), indent=1)
    assert out_stream.getvalue() == "\n".join([
        "arm A (K3_AMD_OVERLAY=stock): starting", "arm A proved stock; running gsm8k_cot",
        "arm B (K3_AMD_OVERLAY=qkv_norm): starting", "arm B proved fused; running gsm8k_cot",
        *expected_lines(e, run_id, switches, metric, hazards)]) + "\n"
    model_args = "model=k3,base_url=http://127.0.0.1:8010/v1/completions,num_concurrent=32,tokenized_requests=False"
    assert harness.calls() == [lm_eval_argv(harness, label, model_args, task="gsm8k_cot", tail=("--limit", "6"))
                               for label in "AB"]


# ---------------------------------------------------------------- aborts, word for word


def test_an_arm_whose_lm_eval_fails_aborts_word_for_word(harness, monkeypatch, capsys):
    """And --json says ok: false, whatever --out holds (here a summary.json the failed arm left)."""
    e = planned(harness)
    plans = json.loads(harness.plan_file.read_text())
    plans["armB"] = {"files": {"../../summary.json": json.dumps({"stale": True})}, "exit": 3}
    harness.plan(plans)
    err_stream = Tracked()
    monkeypatch.setattr(sys, "stderr", err_stream)
    code = gsm8k_ab.main(harness.argv("--json"))
    assert code == 1 and e
    log = harness.out / "armB" / "lm_eval.log"
    assert err_stream.getvalue().splitlines()[-1] == f"ABORTED: arm B: lm-eval failed; log: {log}"
    assert err_stream.unflushed() == ""
    assert capsys.readouterr().out == json.dumps({"command": "gsm8k-ab", "ok": False, "exit_status": 1,
                                                  "error": f"arm B: lm-eval failed; log: {log}"}, indent=1) + "\n"
    assert log.read_text() == "stdout of armB\nstderr of armB\n"
    assert sorted(p.name for p in harness.out.iterdir()) == ["armA", "armB", "run.json", "summary.json"]


def test_an_arm_without_its_samples_aborts_word_for_word(harness, capsys):
    e = planned(harness)
    plans = json.loads(harness.plan_file.read_text())
    plans["armA"]["files"] = {k: v for k, v in plans["armA"]["files"].items() if "samples_" not in k}
    harness.plan(plans)
    assert gsm8k_ab.main(harness.argv()) == 1 and e
    printed = capsys.readouterr()
    assert printed.err == (f"ABORTED: no lm-eval samples_gsm8k_*.jsonl under {harness.out / 'armA' / 'lm_eval'} "
                           "(was --log_samples passed?)\n")
    assert printed.out == "arm A (K3_AMD_OVERLAY=0): starting\narm A proved off; running gsm8k\n"
    assert not (harness.out / "summary.json").exists() and len(harness.servers) == 1


def test_a_metric_lm_eval_did_not_give_aborts_after_arm_a_naming_those_it_did(harness, capsys):
    e = planned(harness)
    code = gsm8k_ab.main(harness.argv("--metric", "exact_match,strict", "--json"))
    printed = capsys.readouterr()
    assert code == 1 and e
    newest = harness.out / "armA" / "lm_eval" / "model" / "results_2026-12-01T11-00-00.json"
    assert printed.err.splitlines()[-1] == (
        "ABORTED: lm-eval gave task 'gsm8k' no metric 'exact_match,strict' (--metric); it gave: "
        f"'exact_match,flexible-extract', 'exact_match,strict-match' (in {newest})")
    assert json.loads(printed.out) == {"command": "gsm8k-ab", "ok": False, "exit_status": 1,
                                       "error": printed.err.splitlines()[-1].removeprefix("ABORTED: ")}
    assert len(harness.servers) == 1 and not (harness.out / "summary.json").exists()


@pytest.mark.parametrize("case", ["results not JSON", "no such task", "samples line not JSON",
                                  "samples without the metric", "no question in common"])
def test_lm_eval_files_that_cannot_be_read_abort_the_arm_word_for_word(harness, capsys, case):
    """Whatever lm-eval left that cannot give the comparison: an ABORTED line naming the file and
    what is wrong, exit 1, the --json object; never a traceback."""
    e = planned(harness)
    plans = json.loads(harness.plan_file.read_text())
    results, samples = "model/results_2026-12-01T11-00-00.json", "model/samples_gsm8k_2026-12-01T11-00-00.jsonl"
    folder = harness.out / "armB" / "lm_eval"
    if case == "results not JSON":
        plans["armB"]["files"][results] = '{"results": '
        why = f"{folder / results} is not JSON: Expecting value: line 1 column 13 (char 12)"
    elif case == "no such task":
        plans["armB"]["files"][results] = json.dumps({"results": {"other": {"exact_match,strict-match": 1.0}}})
        why = f"{folder / results} holds no results of task 'gsm8k'"
    elif case == "samples line not JSON":
        plans["armB"]["files"][samples] += "{oops\n"
        why = (f"{folder / samples} line {2 * e['n'] + 1} gives no 'exact_match,strict-match' outcome of a question "
               "(JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1))")
    elif case == "samples without the metric":
        plans["armB"]["files"][samples] = json.dumps({"doc_id": 0, "filter": "strict-match", "acc": 1.0}) + "\n"
        why = (f"{folder / samples} line 1 gives no 'exact_match,strict-match' outcome of a question "
               "(KeyError: 'exact_match')")
    else:
        plans["armB"]["files"][samples] = json.dumps({"doc_id": 10 ** 6, "filter": "strict-match",
                                                      "exact_match": 1.0}) + "\n"
        why = (f"the arms answered no question in common: nothing to pair (arm A: {e['n']} questions, arm B: 1; see "
               f"each arm's lm_eval folder under {harness.out})")
    harness.plan(plans)
    code = gsm8k_ab.main(harness.argv("--json"))
    printed = capsys.readouterr()
    assert code == 1 and "Traceback" not in printed.err
    assert printed.err.splitlines()[-1] == f"ABORTED: {why}"
    assert json.loads(printed.out) == {"command": "gsm8k-ab", "ok": False, "exit_status": 1, "error": why}
    assert not (harness.out / "summary.json").exists()


def test_json_error_is_why_the_run_aborted_as_ab_serve_says_it(tmp_path, monkeypatch, capsys):
    """The real arms, with a --serve-cmd that exits at once: --json's error is the reason on the
    ABORTED line (before: "aborted (see stderr)")."""
    monkeypatch.setattr(baseline_hazard, "facts_here", lambda: FACTS)
    for name in (*HAZARD_ENV, "K3_AMD_OVERLAY"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "ge"
    code = gsm8k_ab.main(["--model", "m", "--out", str(out), "--serve-cmd", "true", "--lm-eval-cmd", "true",
                          "--port", str(free_port()), "--health-timeout", "60", "--json"])
    printed = capsys.readouterr()
    reason = f"arm A: server exited with 0; log: {out / 'armA' / 'server.log'}"
    assert code == 1 and printed.err.splitlines()[-1] == f"ABORTED: {reason}"
    assert json.loads(printed.out) == {"command": "gsm8k-ab", "ok": False, "exit_status": 1, "error": reason}


def test_json_error_of_a_proof_that_fails_is_its_first_line(harness, monkeypatch, capsys):
    """As ab-serve's summary says it: the check's output and the logs' folder stay on stderr."""
    @contextlib.contextmanager
    def unproved(arm: arms.Arm, *args, **kwargs):
        raise arms.ArmFailed(f"arm {arm.label} (K3_AMD_OVERLAY={arm.switch}) is not {arm.expect}:\nNOT HOLDING\n"
                             "logs: there")
        yield

    monkeypatch.setattr(arms, "proved_server", unproved)
    assert gsm8k_ab.main(harness.argv("--json")) == 1
    printed = capsys.readouterr()
    assert printed.err.endswith("ABORTED: arm A (K3_AMD_OVERLAY=0) is not off:\nNOT HOLDING\nlogs: there\n")
    assert json.loads(printed.out) == {"command": "gsm8k-ab", "ok": False, "exit_status": 1,
                                       "error": "arm A (K3_AMD_OVERLAY=0) is not off:"}


# ---------------------------------------------------------------- --data-file: the local task


def fake_lm_eval_package(root: Path, monkeypatch: pytest.MonkeyPatch, tasks=("gsm8k",)) -> Path:
    """An importable ``lm_eval`` package holding tasks/<task>/<task>.yaml; its directory."""
    package = root / "site" / "lm_eval"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for task in tasks:
        (package / "tasks" / task).mkdir(parents=True)
        (package / "tasks" / task / f"{task}.yaml").write_text(f"task: {task}\n")
    monkeypatch.delitem(sys.modules, "lm_eval", raising=False)
    monkeypatch.syspath_prepend(str(root / "site"))
    return package


def local_yaml(base: Path, data: Path, name: str = "gsm8k_local") -> str:
    return textwrap.dedent(f"""\
        include: "{base}"
        task: {name}
        tag: []
        dataset_path: json
        dataset_name: null
        dataset_kwargs:
          data_files:
            train: "{data}"
            test: "{data}"
        training_split: train
        fewshot_split: train
        test_split: test
        """)


def test_local_task_writes_lm_eval_s_own_task_over_the_file(tmp_path, monkeypatch):
    package = fake_lm_eval_package(tmp_path, monkeypatch, tasks=("gsm8k", "gsm8k_cot"))
    data = tmp_path / "data" / "gsm8k-test.jsonl"
    data.parent.mkdir()
    data.write_text('{"question": "q", "answer": "#### 1"}\n')
    deep = tmp_path / "a" / "b" / "tasks"  # its parents made too
    assert gsm8k_ab.local_task("gsm8k", data, deep) == "gsm8k_local"
    assert sorted(p.name for p in deep.iterdir()) == ["gsm8k_local.yaml"]
    assert (deep / "gsm8k_local.yaml").read_text() == local_yaml(package / "tasks" / "gsm8k" / "gsm8k.yaml", data)
    monkeypatch.chdir(data.parent)  # a relative file is written as its absolute path
    assert gsm8k_ab.local_task("gsm8k_cot", Path("gsm8k-test.jsonl"), deep) == "gsm8k_cot_local"  # an existing dir
    assert (deep / "gsm8k_cot_local.yaml").read_text() == local_yaml(
        package / "tasks" / "gsm8k_cot" / "gsm8k_cot.yaml", data, "gsm8k_cot_local")


def test_local_task_failures_word_for_word(tmp_path, monkeypatch):
    """Usage errors: validate asks the same before --out is claimed."""
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # not importable
    needs = "--data-file needs lm-eval importable by this Python (pip install 'lm-eval[api]')"
    with pytest.raises(UsageError) as failed:
        gsm8k_ab.local_task("gsm8k", data, tmp_path / "tasks")
    assert str(failed.value) == needs
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "lm_eval.py").write_text("")  # a module, not the package
    monkeypatch.delitem(sys.modules, "lm_eval")
    monkeypatch.syspath_prepend(str(tmp_path / "plain"))
    with pytest.raises(UsageError) as failed:
        gsm8k_ab.local_task("gsm8k", data, tmp_path / "tasks")
    assert str(failed.value) == needs
    monkeypatch.delitem(sys.modules, "lm_eval", raising=False)
    package = fake_lm_eval_package(tmp_path / "pkg", monkeypatch)
    (package / "tasks" / "nosuch").mkdir()
    (package / "tasks" / "nosuch" / "other.yaml").write_text("")
    with pytest.raises(UsageError) as failed:
        gsm8k_ab.local_task("nosuch", data, tmp_path / "tasks")
    assert str(failed.value) == ("--task 'nosuch' with --data-file: lm-eval has no task file "
                                 f"{package / 'tasks' / 'nosuch' / 'nosuch.yaml'}")
    assert not (tmp_path / "tasks").exists()


def test_a_data_file_run_points_lm_eval_at_the_local_task(harness, monkeypatch, capsys):
    package = fake_lm_eval_package(harness.tmp, monkeypatch)
    data = harness.tmp / "gsm8k-test.jsonl"
    data.write_text('{"question": "q", "answer": "#### 1"}\n')
    e = planned(harness, task="gsm8k_local")
    code = gsm8k_ab.main(harness.argv("--data-file", str(data)))
    printed = capsys.readouterr()
    assert code == 0, printed.err
    tasks = harness.out / "tasks"
    assert (tasks / "gsm8k_local.yaml").read_text() == local_yaml(package / "tasks" / "gsm8k" / "gsm8k.yaml", data)
    model_args = "model=k3,base_url=http://127.0.0.1:8010/v1/completions,num_concurrent=32,tokenized_requests=False"
    assert harness.calls() == [lm_eval_argv(harness, label, model_args, task="gsm8k_local",
                                            tail=("--include_path", str(tasks))) for label in "AB"]
    run_id = run_id_of(harness.out)
    assert printed.out.splitlines()[4:] == expected_lines(e, run_id)
    assert printed.out.splitlines()[1] == "arm A proved off; running gsm8k_local"


@pytest.mark.parametrize("missing", ["lm-eval", "the task"])
def test_a_data_file_run_without_lm_eval_or_the_task_is_a_usage_error_before_out_is_claimed(harness, monkeypatch,
                                                                                            capsys, missing):
    data = harness.tmp / "gsm8k-test.jsonl"
    data.write_text("{}\n")
    if missing == "lm-eval":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # not importable
        message = "--data-file needs lm-eval importable by this Python (pip install 'lm-eval[api]')"
    else:
        package = fake_lm_eval_package(harness.tmp, monkeypatch)
        message = (f"--task 'nosuch' with --data-file: lm-eval has no task file "
                   f"{package / 'tasks' / 'nosuch' / 'nosuch.yaml'}")
    code = gsm8k_ab.main(harness.argv("--data-file", str(data), "--task", "nosuch", "--json"))
    printed = capsys.readouterr()
    assert code == 2
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay gsm8k-ab: error: {message}"
    assert json.loads(printed.out) == {"command": "gsm8k-ab", "ok": False, "exit_status": 2, "usage_error": message,
                                       "error": message}
    assert not harness.out.exists() and harness.servers == [] and harness.calls() == []


# ---------------------------------------------------------------- reading lm-eval's files


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_accuracy_reads_the_newest_results_and_the_questions_it_scored(tmp_path):
    rng = random.Random()
    values = [rng.uniform(0.1, 0.9) for _ in range(3)]
    for stamp, value, count in zip(("09", "10", "11"), values, (11, 12, 13), strict=True):
        write(tmp_path / "m" / f"results_2026-12-01T{stamp}.json", json.dumps({
            "results": {"gsm8k": {"exact_match,strict-match": value}},
            "n-samples": {"gsm8k": {"original": 1319, "effective": count}}}))
    assert gsm8k_ab.accuracy(tmp_path, "gsm8k", "exact_match,strict-match") == (values[2], 13)
    write(tmp_path / "m" / "results_2026-12-01T12.json", json.dumps({
        "results": {"gsm8k": {"exact_match,strict-match": 0.5}}, "n-samples": {"gsm8k": {"original": 1319}}}))
    assert gsm8k_ab.accuracy(tmp_path, "gsm8k", "exact_match,strict-match") == (0.5, 1319)
    write(tmp_path / "m" / "results_2026-12-01T13.json", json.dumps({
        "results": {"gsm8k": {"exact_match,strict-match": 0.25}}, "n-samples": {"other": {"original": 9}}}))
    assert gsm8k_ab.accuracy(tmp_path, "gsm8k", "exact_match,strict-match") == (0.25, 0)
    write(tmp_path / "m" / "results_2026-12-01T14.json", json.dumps({"results": {"gsm8k": {"acc": 0.75}}}))
    assert gsm8k_ab.accuracy(tmp_path, "gsm8k", "acc") == (0.75, 0)
    odd = write(tmp_path / "m" / "results_2026-12-01T15.json", json.dumps({
        "results": {"gsm8k": {"acc,none": 0.5, "alias": "gsm8k"}}, "n-samples": {"gsm8k": {"effective": "many"}}}))
    with pytest.raises(arms.ArmFailed) as failed:
        gsm8k_ab.accuracy(tmp_path, "gsm8k", "acc,none")
    assert str(failed.value) == (f"{odd}: n-samples of task 'gsm8k' is no question count (invalid literal for int() "
                                 "with base 10: 'many')")
    with pytest.raises(arms.ArmFailed) as failed:
        gsm8k_ab.accuracy(tmp_path, "gsm8k", "alias")
    assert str(failed.value) == ("lm-eval gave task 'gsm8k' no metric 'alias' (--metric); it gave: 'acc,none' "
                                 f"(in {odd})")
    with pytest.raises(arms.ArmFailed) as failed:
        gsm8k_ab.accuracy(tmp_path / "empty", "gsm8k", "acc")
    assert str(failed.value) == f"no lm-eval results*.json under {tmp_path / 'empty'}"


def test_outcomes_per_question_under_the_metric_and_its_filter(tmp_path):
    rows = [{"doc_id": 0, "filter": "strict-match", "exact_match": 0.0},
            {"doc_id": 0, "filter": "flexible-extract", "exact_match": 1.0},
            {"doc_id": 1, "filter": "strict-match", "exact_match": 1.0},
            {"doc_id": 1, "filter": "flexible-extract", "exact_match": 0.0},
            {"doc_id": "2", "filter": "strict-match", "exact_match": 0.5},
            {"doc_id": 2, "filter": "flexible-extract", "exact_match": 0.0}]
    write(tmp_path / "m" / "samples_gsm8k_2026-12-01T09.jsonl", json.dumps({"doc_id": 7, "filter": "strict-match",
                                                                            "exact_match": 1.0}) + "\n")
    write(tmp_path / "m" / "samples_gsm8k_2026-12-01T10.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert gsm8k_ab.outcomes(tmp_path, "gsm8k", "exact_match,strict-match") == {0: False, 1: True, 2: True}
    assert gsm8k_ab.outcomes(tmp_path, "gsm8k", "exact_match,flexible-extract") == {0: True, 1: False, 2: False}
    plain = tmp_path / "plain"
    write(plain / "samples_arc_2026-12-01T09.jsonl", "".join(json.dumps({"doc_id": q, "acc": float(q % 2)}) + "\n"
                                                             for q in range(4)))
    assert gsm8k_ab.outcomes(plain, "arc", "acc") == {0: False, 1: True, 2: False, 3: True}


def test_outcomes_failures_word_for_word(tmp_path):
    with pytest.raises(arms.ArmFailed) as failed:
        gsm8k_ab.outcomes(tmp_path, "gsm8k", "exact_match,strict-match")
    assert str(failed.value) == f"no lm-eval samples_gsm8k_*.jsonl under {tmp_path} (was --log_samples passed?)"
    for stamp in ("09", "10", "11"):
        write(tmp_path / "m" / f"samples_gsm8k_2026-12-01T{stamp}.jsonl",
              json.dumps({"doc_id": 1, "filter": "flexible-extract", "exact_match": 1.0}) + "\n")
    with pytest.raises(arms.ArmFailed) as failed:
        gsm8k_ab.outcomes(tmp_path, "gsm8k", "exact_match,strict-match")
    newest = tmp_path / "m" / "samples_gsm8k_2026-12-01T11.jsonl"
    assert str(failed.value) == f"{newest} has no exact_match,strict-match outcome"
