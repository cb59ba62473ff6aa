"""Bad input to the A/B tools, each refused with a message that names the value and what is
allowed, exit 2 and, under --json, exactly one JSON object on stdout: two arms that are one
setting however spelt, a timeout or window that is no finite positive number, a concurrency given
twice, an overlay variable in the environment that an arm's server would stop on, an option given
empty, and an ``ab-serve report`` directory whose bench results or summary a run did not write
that way (nothing rewritten). A FIFO where a run reads a file it or a tool wrote fails that read
without blocking."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from fifos import fifo_at, rescued
from test_ab_serve_contract import Lab, run_id_of
from test_gsm8k_ab_contract import Harness

from k3_amd_overlay import json_files
from k3_amd_overlay.commands import ab_serve, arms, gsm8k_ab
from k3_amd_overlay.commands.usage import UsageError
from k3_amd_overlay.settings import MARKER_DIR, PROVIDER_SETTINGS, SWITCH, SettingsError, load_settings

ALL_FUSIONS = "qkv_norm,qk_cache,absorb_qk_cache"


@pytest.fixture
def lab(tmp_path, monkeypatch):
    yield (made := Lab(tmp_path, monkeypatch))
    made.loopback.server.shutdown()
    made.loopback.server.server_close()


@pytest.fixture
def harness(tmp_path, monkeypatch) -> Harness:
    return Harness(tmp_path, monkeypatch)


def refused(printed, command: str, as_json: bool) -> str:
    """The usage error's message: the last line of stderr; under --json stdout is exactly one
    object saying the same (nothing else)."""
    prefix = f"k3-amd-overlay {command}: error: "
    last = printed.err.splitlines()[-1]
    assert last.startswith(prefix), printed.err
    message = last.removeprefix(prefix)
    if as_json:
        assert json.loads(printed.out) == {"command": command, "ok": False, "exit_status": 2,
                                           "usage_error": message, "error": message}
    else:
        assert printed.out == ""
    return message


# --- two arms that are the same setting ----------------------------------------------------------

SAME = [
    ("1", " 1", "auto: absorb_qk_cache, qk_cache, qkv_norm"),
    ("qkv_norm,qk_cache", "qk_cache,qkv_norm", "auto: qk_cache, qkv_norm"),
    ("1", ALL_FUSIONS, "auto: absorb_qk_cache, qk_cache, qkv_norm"),
    ("", "0", "off"),
    ("stock", "stock ", "stock"),
]


@pytest.mark.parametrize("arm_a,arm_b,said", SAME)
@pytest.mark.parametrize("as_json", [False, True])
def test_ab_serve_refuses_two_arms_that_are_one_setting(lab, capsys, arm_a, arm_b, said, as_json):
    assert lab.main("--arm-a", arm_a, "--arm-b", arm_b, *(["--json"] if as_json else [])) == 2
    assert refused(capsys.readouterr(), "ab-serve", as_json) == (
        f"the arms must differ: --arm-a {arm_a!r} and --arm-b {arm_b!r} are the same setting ({said}), "
        "an A/B of an arm against itself")
    assert not lab.out.exists() and lab.serves == []


def test_ab_serve_refuses_an_arm_b_that_is_the_stock_arm_however_spelt(lab, capsys):
    assert lab.main("--with-stock", "--arm-b", " stock") == 2
    assert refused(capsys.readouterr(), "ab-serve", False) == (
        "the arms must differ: --arm-b ' stock' and the stock arm 'stock' are the same setting (stock), "
        "an A/B of an arm against itself")


@pytest.mark.parametrize("arm_a,arm_b,said", SAME)
@pytest.mark.parametrize("as_json", [False, True])
def test_gsm8k_ab_refuses_two_arms_that_are_one_setting(harness, capsys, arm_a, arm_b, said, as_json):
    code = gsm8k_ab.main(harness.argv("--arm-a", arm_a, "--arm-b", arm_b, *(["--json"] if as_json else [])))
    assert code == 2
    assert refused(capsys.readouterr(), "gsm8k-ab", as_json) == (
        f"the arms must differ: --arm-a {arm_a!r} and --arm-b {arm_b!r} are the same setting ({said}), "
        "an A/B of an arm against itself")
    assert not harness.out.exists() and harness.servers == [] and harness.calls() == []


@pytest.mark.parametrize("switches", [("0", "1"), ("1", "stock"), ("qkv_norm", "1"), ("qkv_norm", "qk_cache"),
                                      ("0", "stock", "1")])
def test_arms_of_different_settings_pass(switches):
    arms.check_distinct([(f"arm {i}", s) for i, s in enumerate(switches)])


def test_the_same_setting_check_reads_the_overlays_own_parse():
    with pytest.raises(UsageError, match="'qk_cache, qkv_norm' and arm 1 'qkv_norm,qk_cache' are the same"):
        arms.check_distinct([("arm 0", "qk_cache, qkv_norm"), ("arm 1", "qkv_norm,qk_cache")])


# --- an overlay variable an arm's server would stop on ---------------------------------------------

def overlay_environment(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    """This process's K3_AMD_OVERLAY* variables (any case) are exactly ``variables``."""
    for name in list(os.environ):
        if name.upper().startswith(SWITCH):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def stops(arm: str, switch: str, variables: dict[str, str]) -> str:
    """The usage error naming ``arm``: the overlay loader's own words for the environment its server gets."""
    with pytest.raises(SettingsError) as caught:
        load_settings({**variables, SWITCH: switch, MARKER_DIR: "markers"})
    return f"{arm} ({SWITCH}={switch!r}) would stop its server at start on the environment it inherits: {caught.value}"


STRICT_MAYBE = {"K3_AMD_OVERLAY_STRICT": "maybe"}
MISSPELT = {"K3_AMD_OVERLAY_STRCT": "0"}
# (variables, arms given, the arm whose server would stop first and its switch); the off arm only
# warns of a misspelt name, so the arm on is the one named
STOPPING = [
    (STRICT_MAYBE, (), "arm A", "0"),
    ({"K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "cuda"}, (), "arm A", "0"),
    (MISSPELT, (), "arm B", "1"),
    ({"k3_amd_overlay_strict": "0"}, (), "arm B", "1"),
    (MISSPELT, ("--arm-a", "0", "--arm-b", "stock"), "arm B", "stock"),
    ({**STRICT_MAYBE, **MISSPELT, "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "cuda"}, (), "arm A", "0"),  # the audit's
]


@pytest.mark.parametrize("variables,given,arm,switch", STOPPING)
@pytest.mark.parametrize("as_json", [False, True])
def test_ab_serve_refuses_a_variable_an_arms_server_would_stop_on(lab, monkeypatch, capsys, variables, given, arm,
                                                                   switch, as_json):
    """Before, the run got past its checks and the first server stopped on it, after a model load."""
    overlay_environment(monkeypatch, variables)
    assert lab.main(*given, *(["--json"] if as_json else [])) == 2
    assert refused(capsys.readouterr(), "ab-serve", as_json) == stops(arm, switch, variables)
    assert not lab.out.exists() and lab.serves == []


def test_ab_serve_names_the_stock_arm_where_only_it_would_stop(lab, monkeypatch, capsys):
    """Arms A and B off and fused parse a misspelt name as the loader does; the stock arm C is checked too."""
    overlay_environment(monkeypatch, MISSPELT)
    assert lab.main("--arm-b", "1", "--with-stock") == 2
    assert refused(capsys.readouterr(), "ab-serve", False) == stops("arm B", "1", MISSPELT)
    with pytest.raises(UsageError) as caught:
        arms.check_environments([("arm A", "0"), ("arm C", "stock")])
    assert str(caught.value) == stops("arm C", "stock", MISSPELT)


@pytest.mark.parametrize("variables,given,arm,switch", STOPPING)
@pytest.mark.parametrize("as_json", [False, True])
def test_gsm8k_ab_refuses_a_variable_an_arms_server_would_stop_on(harness, monkeypatch, capsys, variables, given, arm,
                                                                  switch, as_json):
    overlay_environment(monkeypatch, variables)
    assert gsm8k_ab.main(harness.argv(*given, *(["--json"] if as_json else []))) == 2
    assert refused(capsys.readouterr(), "gsm8k-ab", as_json) == stops(arm, switch, variables)
    assert not harness.out.exists() and harness.servers == [] and harness.calls() == []


def test_variables_every_arms_server_starts_with_pass(monkeypatch):
    """A valid strictness and provider pass; so does a blank marker folder, which no arm's server
    inherits (each gets its own)."""
    provider = PROVIDER_SETTINGS["qk_cache"][-1]
    overlay_environment(monkeypatch, {"K3_AMD_OVERLAY_STRICT": "0", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": provider,
                                      MARKER_DIR: " "})
    arms.check_environments([("arm A", "0"), ("arm B", "1"), ("arm C", "stock")])
    assert arms.environment("1", "/m")[MARKER_DIR] == "/m"


# --- an option given empty (an unset "$VAR") --------------------------------------------------------

def names_nothing(option: str, value: str, default: str | None) -> str:
    leave = f", or leave it out for its default ({default})" if default else ""
    return f"{option} {value!r} names nothing (an empty value: an unset variable?); give a value{leave}"


@pytest.mark.parametrize("option,value,default", [("--model", "", None), ("--model", "  ", None),
                                                  ("--served-model-name", "", "the --model value"),
                                                  ("--tokenizer", " ", "the model")])
@pytest.mark.parametrize("as_json", [False, True])
def test_ab_serve_refuses_an_empty_value(lab, capsys, option, value, default, as_json):
    """Before, ``--model ''`` started arm A's server with no model."""
    assert lab.main(option, value, *(["--json"] if as_json else [])) == 2
    assert refused(capsys.readouterr(), "ab-serve", as_json) == names_nothing(option, value, default)
    assert not lab.out.exists() and lab.serves == []


@pytest.mark.parametrize("option,value,default", [("--model", "", None), ("--served-model-name", " ", "the --model "
                                                  "value"), ("--task", "", "gsm8k"), ("--task", "\t", "gsm8k")])
@pytest.mark.parametrize("as_json", [False, True])
def test_gsm8k_ab_refuses_an_empty_value(harness, capsys, option, value, default, as_json):
    """Before, ``--task ''`` started arm A's server and ran lm-eval on no task."""
    assert gsm8k_ab.main(harness.argv(option, value, *(["--json"] if as_json else []))) == 2
    assert refused(capsys.readouterr(), "gsm8k-ab", as_json) == names_nothing(option, value, default)
    assert not harness.out.exists() and harness.servers == [] and harness.calls() == []


# --- numbers that are no finite positive number ---------------------------------------------------

NOT_FINITE = [("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), ("1e999", "inf")]


@pytest.mark.parametrize("given,shown", NOT_FINITE)
@pytest.mark.parametrize("option", ["--health-timeout", "--profile-window"])
@pytest.mark.parametrize("as_json", [False, True])
def test_ab_serve_refuses_a_time_that_is_not_finite(lab, capsys, option, given, shown, as_json):
    assert lab.main(f"{option}={given}", *(["--json"] if as_json else [])) == 2
    assert refused(capsys.readouterr(), "ab-serve", as_json) == (
        f"{option} {shown}: must be a positive, finite number of seconds")
    assert not lab.out.exists() and lab.serves == []


@pytest.mark.parametrize("given,shown", NOT_FINITE)
@pytest.mark.parametrize("as_json", [False, True])
def test_gsm8k_ab_refuses_a_health_timeout_that_is_not_finite(harness, capsys, given, shown, as_json):
    assert gsm8k_ab.main(harness.argv(f"--health-timeout={given}", *(["--json"] if as_json else []))) == 2
    assert refused(capsys.readouterr(), "gsm8k-ab", as_json) == (
        f"--health-timeout {shown}: must be a positive, finite number of seconds")
    assert not harness.out.exists() and harness.servers == []


# --- a concurrency given twice --------------------------------------------------------------------

@pytest.mark.parametrize("given,repeated", [(["8", "8"], "8"), (["1", "8", "1", "32", "8"], "1, 8")])
@pytest.mark.parametrize("as_json", [False, True])
def test_ab_serve_refuses_a_concurrency_given_twice(lab, capsys, given, repeated, as_json):
    assert lab.main("--concurrency", *given, *(["--json"] if as_json else [])) == 2
    shown = "[" + ", ".join(given) + "]"
    assert refused(capsys.readouterr(), "ab-serve", as_json) == (
        f"--concurrency {shown}: {repeated} given more than once; each concurrency at most once (a second bench "
        "would overwrite the first's result)")
    assert not lab.out.exists() and lab.serves == [] and lab.benches() == []


# --- ab-serve report over results no run wrote that way ------------------------------------------

def finished_run(lab: Lab, capsys) -> Path:
    assert lab.main("--repeats", "1", "--concurrency", "1") == 0
    capsys.readouterr()
    return lab.out


def edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def report_refuses(out: Path, capsys, message: str) -> None:
    """``ab-serve report OUT`` with and without --json: exit 2 with ``message``, nothing rewritten."""
    kept = {p: p.read_bytes() for p in out.glob("summary.*")}
    for flags in ([], ["--json"]):
        assert ab_serve.main(["report", str(out), *flags]) == 2
        printed = capsys.readouterr()
        assert "Traceback" not in printed.err
        assert refused(printed, "ab-serve report", bool(flags)) == message
    assert {p: p.read_bytes() for p in out.glob("summary.*")} == kept


@pytest.mark.parametrize("value", ["abc", None, True, [1.0], {"ms": 1}, 10 ** 400])  # 10**400: an OverflowError before
def test_report_refuses_a_bench_metric_that_is_no_number(lab, capsys, value):
    out = finished_run(lab, capsys)
    bench = out / "repeat0-armA" / "bench-c1.json"
    edit_json(bench, median_tpot_ms=value)
    report_refuses(out, capsys, f'{bench} is no bench result the table can read: "median_tpot_ms" is {value!r}, '
                                "not a finite number")


def test_report_refuses_an_infinite_bench_metric(lab, capsys):
    out = finished_run(lab, capsys)
    bench = out / "repeat0-armB" / "bench-c1.json"
    bench.write_text(json.dumps({**json.loads(bench.read_text()), "output_throughput": float("inf")}))
    report_refuses(out, capsys, f'{bench} is no bench result the table can read: "output_throughput" is inf, '
                                "not a finite number")


def test_report_refuses_a_bench_result_that_is_no_object(lab, capsys):
    out = finished_run(lab, capsys)
    bench = out / "repeat0-armA" / "bench-c1.json"
    bench.write_text("[1, 2]")
    report_refuses(out, capsys, f"{bench} is no bench result the table can read: it holds a list, not a JSON object")


@pytest.mark.parametrize("name", ["bench-cX.json", "bench-c.json", "bench-c08.json", "bench-c-1.json",
                                  "bench-c1.old.json"])
def test_report_refuses_a_bench_file_whose_name_gives_no_concurrency(lab, capsys, name):
    out = finished_run(lab, capsys)
    stray = out / "repeat0-armB" / name
    stray.write_text((out / "repeat0-armB" / "bench-c1.json").read_text())
    raw = name.removeprefix("bench-c").removesuffix(".json")
    report_refuses(out, capsys, f"{stray}: the concurrency in its name, {raw!r}, is not a positive whole number "
                                "(bench-c8.json: concurrency 8), so no bench of this run wrote it: move it out")


@pytest.mark.parametrize("hazards", [5, "a hazard", [1], {"arm A": "x"}])
def test_report_refuses_baseline_hazards_that_are_no_list_of_strings(lab, capsys, hazards):
    out = finished_run(lab, capsys)
    summary = out / "summary.json"
    data = json.loads(summary.read_text())
    summary.write_text(json.dumps({**data, "environment": {**data["environment"], "baseline_hazards": hazards}}))
    report_refuses(out, capsys, f'{summary} is no ab-serve summary: its "baseline_hazards" is {hazards!r}, not a '
                                "list of strings")


def test_report_refuses_an_environment_that_is_no_object(lab, capsys):
    out = finished_run(lab, capsys)
    summary = out / "summary.json"
    edit_json(summary, environment=5)
    report_refuses(out, capsys, f'{summary} is no ab-serve summary: its "environment" is 5, not an object')


def test_report_still_reads_recorded_hazards_and_a_nan_metric(lab, capsys):
    """What a run does write is read as before: a list of hazard strings, and NaN (a bench that
    measured nothing) left out of the table."""
    out = finished_run(lab, capsys)
    summary = out / "summary.json"
    data = json.loads(summary.read_text())
    summary.write_text(json.dumps({**data, "environment": {**data["environment"], "baseline_hazards": ["arm A: x"]}}))
    bench = out / "repeat0-armA" / "bench-c1.json"
    bench.write_text(json.dumps({**json.loads(bench.read_text()), "median_tpot_ms": float("nan")}))
    assert ab_serve.main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("WARNING, measured with --accept-baseline-hazard: arm A: x\n")
    assert "| 1 | TPOT p50 (ms) |" not in text and "| 1 | TTFT p50 (ms) |" in text
    assert run_id_of(out) == json.loads(summary.read_text())["run_id"]


# --- ab-serve report over bench results of 0, nested too deeply, or too far apart for a ratio ---------

@pytest.mark.parametrize("key,value,least", [
    ("output_throughput", 0, "more than 0 (a throughput; 0 is what a bench whose requests all failed records)"),
    ("median_tpot_ms", -5, "0 or more (a time)")])
def test_report_refuses_a_throughput_of_0_or_a_negative_metric(lab, capsys, key, value, least):
    """What an arm whose requests all failed records; before, its row was dropped without a word."""
    out = finished_run(lab, capsys)
    bench = out / "repeat0-armA" / "bench-c1.json"
    edit_json(bench, **{key: value})
    report_refuses(out, capsys, f'{bench} is no bench result the table can read: "{key}" is {value!r}, not a number '
                                f"{least}")


def test_report_refuses_a_bench_result_nested_too_deeply(lab, capsys):
    out = finished_run(lab, capsys)
    bench = out / "repeat0-armB" / "bench-c1.json"
    bench.write_text("[" * 100_000 + "]" * 100_000)
    report_refuses(out, capsys, f"{bench} is unreadable (JSON nested too deep to read)")


def test_report_of_a_ratio_beyond_a_float_writes_it_unusable_in_standard_json(lab, capsys):
    """1e308 ms against 1e-308 ms: before, "ratio": Infinity in summary.json and on stdout, exit 0. A
    row without a usable ratio answers nothing: the report fails (exit 1), naming the row."""
    out = finished_run(lab, capsys)
    edit_json(out / "repeat0-armA" / "bench-c1.json", median_tpot_ms=1e308)
    edit_json(out / "repeat0-armB" / "bench-c1.json", median_tpot_ms=1e-308)
    assert ab_serve.main(["report", str(out), "--json"]) == 1

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the output")

    printed = json.loads(capsys.readouterr().out, parse_constant=refuse)
    json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    (row,) = [r for r in printed["rows"]["B_vs_A"] if r["metric"] == "TPOT p50 (ms)"]
    assert (row["ratio"], row["ci_low"], row["ci_high"], row["p_value"]) == (None, None, None, None)
    assert row["verdict"].startswith("unusable: arm A's values [1e+308] and arm B's [1e-308] are too far apart")
    assert not printed["ok"] and printed["error"].startswith(
        "1 row without a usable ratio: B_vs_A TPOT p50 (ms) at concurrency 1: unusable: arm A's values"), printed


# --- a FIFO where a run reads a file ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["run.json", "repeat0-armB/bench-c1.json"])
def test_report_refuses_a_fifo_as_a_record_unread(lab, capsys, name):
    """Before, the report blocked reading it."""
    out = finished_run(lab, capsys)
    with rescued(fifo_at(out / name)) as fifo:
        assert ab_serve.main(["report", str(out), "--json"]) == 2
    assert refused(capsys.readouterr(), "ab-serve report", True) == f"{fifo} is unreadable ({json_files.NOT_REGULAR})"


def test_report_takes_a_fifo_as_a_run_id_for_no_run_id(lab, capsys):
    """Before, the report blocked reading it."""
    out = finished_run(lab, capsys)
    with rescued(fifo_at(out / "repeat0-armA" / "run-id")):
        assert ab_serve.main(["report", str(out)]) == 2
    assert refused(capsys.readouterr(), "ab-serve report", False) == (
        f"results not written by run {run_id_of(out)}: repeat0-armA (no run id); a summary never mixes runs: move "
        "them out, or give each run its own --out")


def test_a_bench_that_leaves_a_fifo_fails_its_arm_unread(lab, tmp_path, capsys):
    """The bench stand-in makes a FIFO where its result goes; before, the run blocked reading it."""
    fifo_bench = tmp_path / "fifo_bench.py"
    fifo_bench.write_text("import os, sys\n\na = sys.argv\n"
                          "os.mkfifo(os.path.join(a[a.index('--result-dir') + 1],\n"
                          "                       a[a.index('--result-filename') + 1]))\n")
    result = lab.out / "repeat0-armA" / "bench-c1.json"
    with rescued(result):
        code = lab.main("--repeats", "1", "--concurrency", "1", "--bench-cmd", f"{sys.executable} {fifo_bench}")
    assert code == 1
    assert (f"ABORTED: arm A: bench at concurrency 1 wrote {result}, which cannot be read ({json_files.NOT_REGULAR}); "
            f"log: {result.with_suffix('.log')}") in capsys.readouterr().err


@pytest.mark.parametrize("read", ["results", "samples"])
def test_an_lm_eval_file_that_is_a_fifo_fails_the_arm_unread(tmp_path, read):
    """``gsm8k-ab`` reads lm-eval's newest results file and its samples file; a FIFO is neither."""
    (tmp_path / "model").mkdir()
    name = "results_2026-12-01T11.json" if read == "results" else "samples_gsm8k_2026-12-01T11.jsonl"
    with rescued(fifo_at(tmp_path / "model" / name)) as fifo, pytest.raises(arms.ArmFailed) as failed:
        if read == "results":
            gsm8k_ab.accuracy(tmp_path, "gsm8k", "exact_match,strict-match")
        else:
            gsm8k_ab.outcomes(tmp_path, "gsm8k", "exact_match,strict-match")
    assert str(failed.value) == f"{fifo} cannot be read: {json_files.NOT_REGULAR}"
