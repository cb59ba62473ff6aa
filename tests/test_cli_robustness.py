"""Input no command was written for, each met with a usage error or a failed arm that names the
value and the file, never a traceback, a hang or a silent default: JSON nested 100,000 deep, a FIFO
among the markers, a marker directory that cannot be listed, an accuracy or a bench ratio that is no
finite number, a bench metric of 0 or less, an empty path, an absorb column block the kernel cannot
take, node-file lines that are no list of strings, and ``--json=VALUE``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from fifos import fifo_at, rescued
from test_gsm8k_ab_contract import Harness, planned

from k3_amd_overlay import json_files, markers
from k3_amd_overlay.commands import ab_run, ab_stats, arms, cli, gsm8k_ab, self_measure
from k3_amd_overlay.commands.bench import kernels
from k3_amd_overlay.commands.usage import wants_json

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads recurses once a level: a RecursionError long before the end


def strict_json(text: str) -> dict:
    """``text`` as one standard JSON object: NaN and Infinity refused, as any other JSON reader would."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant} in the output")

    data = json.loads(text, parse_constant=refuse)
    assert isinstance(data, dict)
    return data


def exit_status(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether returned or raised (argparse exits on its own errors)."""
    try:
        return main(argv)
    except SystemExit as exited:
        return int(exited.code or 0)


def usage_error(capsys: pytest.CaptureFixture[str], code: int, command: str) -> str:
    """Exit 2, no traceback, one JSON object on stdout naming the error; the message."""
    printed = capsys.readouterr()
    assert code == 2 and "Traceback" not in printed.err, printed.err
    data = strict_json(printed.out)
    assert (data["command"], data["ok"], data["exit_status"]) == (command, False, 2)
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay {command}: error: {data['usage_error']}"
    return data["usage_error"]


# --- 1. JSON nested too deeply ----------------------------------------------------------------------

def test_merge_of_a_node_file_nested_100000_deep_is_a_usage_error(tmp_path, capsys):
    node = tmp_path / "node.json"
    node.write_text('{"records": [' + DEEP + "]}")
    code = cli.main(["check", "--expect", "off", "--merge", str(node), "--json"])
    assert usage_error(capsys, code, "check") == (f"--merge: {node} is not the output of `k3-amd-overlay check "
                                                  "--json`: its JSON is nested too deeply to read")


def test_a_run_record_nested_100000_deep_is_foreign_results_naming_the_file(tmp_path):
    record = tmp_path / "bench-c1.json"
    record.write_text(DEEP)
    with pytest.raises(ab_run.ForeignResults) as refused:
        ab_run.read_json(record)
    assert str(refused.value) == f"{record} is unreadable (JSON nested too deep to read)"


# --- 3. the marker directory: a FIFO among the markers, a directory that cannot be listed ------------

def test_a_fifo_named_as_a_marker_is_set_aside_unread_without_blocking(tmp_path):
    """Before, the check opened the FIFO and waited for a writer for ever (here: 3 s, then one
    comes, so that the old code fails this test rather than hanging it)."""
    markers.write_marker(tmp_path, 7, {"pid": 7, "mode": "auto", "fusions": {}})
    with rescued(fifo_at(tmp_path / "4242.json"), 3.0):
        found = markers.read_markers(tmp_path)
    assert [(m.path.name, m.error) for m in found] == [
        ("4242.json", f"unreadable marker: {json_files.NOT_REGULAR}"), ("7.json", None)]


def test_a_folder_named_as_a_marker_is_set_aside_as_not_a_regular_file(tmp_path):
    (tmp_path / "5.json").mkdir()
    (found,) = markers.read_markers(tmp_path)
    assert (found.record, found.error, found.live) == (None, f"unreadable marker: {json_files.NOT_REGULAR}", False)


def test_a_marker_directory_that_cannot_be_listed_is_an_error_naming_it(tmp_path, monkeypatch, capsys):
    """Path.glob swallows the PermissionError and lists nothing, which a check read as 0 processes
    (as root chmod 000 stops no listing, so the listing is made to fail)."""
    listed = os.scandir

    def denied(path=None):
        if path is not None and Path(path) == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return listed(path) if path is not None else listed()

    monkeypatch.setattr(os, "scandir", denied)
    with pytest.raises(markers.MarkerDirError) as refused:
        markers.read_markers(tmp_path)
    assert str(refused.value) == f"cannot read marker directory {tmp_path}: Permission denied"
    code = cli.main(["check", "--expect", "fused", "--marker-dir", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["usage_error"] and out["error"] == (
        f"--marker-dir: cannot read marker directory {tmp_path}: Permission denied"), out


# --- 4. an accuracy that is no number from 0 to 1; a ratio beyond a float ---------------------------

def _results(tmp_path: Path, value: object) -> Path:
    path = tmp_path / "m" / "results_2026-12-01T09.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": {"gsm8k": {"exact_match,strict-match": value}},
                                "n-samples": {"gsm8k": {"effective": 10}}}))
    return path


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.1, 1.5])
def test_an_accuracy_that_is_no_finite_number_from_0_to_1_fails_the_arm_naming_file_and_field(tmp_path, value):
    path = _results(tmp_path, value)
    with pytest.raises(arms.ArmFailed) as failed:
        gsm8k_ab.accuracy(tmp_path, "gsm8k", "exact_match,strict-match")
    assert str(failed.value) == (f"{path}: results.gsm8k.exact_match,strict-match (--metric) is {value!r}, not an "
                                 "accuracy (a finite number from 0 to 1)")


@pytest.mark.parametrize("value", [0, 0.0, 1, 0.75])
def test_an_accuracy_from_0_to_1_is_read(tmp_path, value):
    _results(tmp_path, value)
    assert gsm8k_ab.accuracy(tmp_path, "gsm8k", "exact_match,strict-match") == (value, 10)


def test_a_nan_accuracy_aborts_the_run_and_no_summary_holds_it(tmp_path, monkeypatch, capsys):
    harness = Harness(tmp_path, monkeypatch)
    planned(harness)
    plans = json.loads(harness.plan_file.read_text())
    name = "model/results_2026-12-01T11-00-00.json"
    data = json.loads(plans["armB"]["files"][name])
    data["results"]["gsm8k"]["exact_match,strict-match"] = float("nan")
    plans["armB"]["files"][name] = json.dumps(data)
    harness.plan(plans)
    assert gsm8k_ab.main(harness.argv("--json")) == 1
    printed = capsys.readouterr()
    path = harness.out / "armB" / "lm_eval" / name
    assert printed.err.splitlines()[-1] == (f"ABORTED: {path}: results.gsm8k.exact_match,strict-match (--metric) is "
                                            "nan, not an accuracy (a finite number from 0 to 1)")
    assert strict_json(printed.out)["exit_status"] == 1 and not (harness.out / "summary.json").exists()


@pytest.mark.parametrize("a,b", [(1e308, 1e-308), (1e-308, 1e308)])  # the ratio overflows; underflows to 0
def test_a_paired_ratio_beyond_a_float_is_an_unusable_row_in_standard_json(a, b):
    (row,) = ab_stats.serving_rows({"A": {1: [{"median_tpot_ms": a}]}, "B": {1: [{"median_tpot_ms": b}]}})
    assert (row.ratio, row.ci_low, row.ci_high, row.p_value) == (None, None, None, None)
    assert row.verdict == (f"unusable: arm A's values [{a!r}] and arm B's [{b!r}] are too far apart for a finite "
                           "paired ratio or median (no bench measures such times)")
    assert json.loads(json.dumps(row.to_json(), allow_nan=False))["median_a"] == a
    assert "| n/a | n/a | n/a | 1 | unusable: " in ab_stats.render_serving([row])


def test_medians_beyond_a_float_are_unusable_too():
    row = ab_stats.paired_row(1, "TPOT p50 (ms)", False, [1e308, 1.7e308], [1e308, 1.7e308])
    assert row.median_a is None and row.ratio is None and row.verdict.startswith("unusable: ")


# --- 5. a bench metric of 0 or less ------------------------------------------------------------------

@pytest.mark.parametrize("key,value,least", [
    ("output_throughput", 0, "more than 0 (a throughput; 0 is what a bench whose requests all failed records)"),
    ("output_throughput", -5, "more than 0 (a throughput; 0 is what a bench whose requests all failed records)"),
    ("median_tpot_ms", -1.5, "0 or more (a time)")])
def test_a_throughput_of_0_or_a_negative_metric_is_unusable_naming_the_field(key, value, least):
    expected = f'"{key}" is {value!r}, not a number {least}'
    assert ab_stats.unusable_metric({"median_ttft_ms": 10.0, key: value}) == expected


def test_no_request_completed_is_unusable_and_a_latency_of_0_is_left_out():
    """An arm whose requests all failed records "completed": 0; outputs one token long record a time
    between tokens of 0 (vLLM's bench: the median of none), a legitimate TTFT-only A/B."""
    assert ab_stats.unusable_metric({"completed": 0, "output_throughput": 1.0}) == (
        '"completed" is 0: no request completed (every request of the arm failed?)')
    one_token = {"completed": 8, "median_ttft_ms": 10.0, "median_tpot_ms": 0.0, "p99_itl_ms": 0,
                 "output_throughput": 9.0}
    assert ab_stats.unusable_metric(one_token) is None
    rows = ab_stats.serving_rows({"A": {1: [one_token] * 6}, "B": {1: [one_token] * 6}})
    assert {r.metric for r in rows} == {"TTFT p50 (ms)", "out tok/s"}


@pytest.mark.parametrize("failed", [1, 126, "2", None, 1.5])
def test_a_bench_with_any_failed_request_is_unusable(failed):
    """vLLM's bench exits 0 with failed requests and times only those that completed, under less load
    than the run's: an arm whose requests mostly failed read as faster (0.33's bench serve records
    "failed")."""
    record = {"completed": 2, "failed": failed, "median_tpot_ms": 15.0, "output_throughput": 1.0}
    assert ab_stats.unusable_metric(record) == (
        f'"failed" is {failed!r}: requests failed, so its latencies and throughputs are those of the requests that '
        "completed under less load, not of the run (vLLM's bench exits 0 all the same)")
    assert ab_stats.unusable_metric({**record, "failed": 0}) is None
    del record["failed"]  # a bench that does not say: as before
    assert ab_stats.unusable_metric(record) is None


def test_a_probe_request_that_gets_no_answer_fails_the_arm_not_the_tool(tmp_path):
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def hang_up() -> None:
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.close()  # the server died on the POST: no status line

    threading.Thread(target=hang_up, daemon=True).start()
    server = arms.Server(["serve"], arms.Arm("A", "0", "off"), tmp_path, listener.getsockname()[1])
    with pytest.raises(arms.ArmFailed, match=r"^arm A: the probe completion for model 'k3' got no answer \("):
        server.request("k3")
    listener.close()  # nothing listens now: refused
    with pytest.raises(arms.ArmFailed, match=r"got no answer \(URLError: "):
        server.request("k3")


def test_a_nan_metric_is_still_left_out_rather_than_unusable():
    assert ab_stats.unusable_metric({"median_tpot_ms": float("nan"), "output_throughput": 1.0}) is None


# --- 6. an empty path ----------------------------------------------------------------------------------

EMPTY_PATH = "argument {}: '' names no path (an empty value: an unset variable?); give the path"


def test_gsm8k_ab_refuses_an_empty_out(tmp_path, monkeypatch, capsys):
    harness = Harness(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    code = exit_status(gsm8k_ab.main, harness.argv("--out", "", "--json"))
    assert usage_error(capsys, code, "gsm8k-ab") == EMPTY_PATH.format("--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake_lm_eval.py"] and harness.servers == []


def test_ab_serve_and_its_report_refuse_an_empty_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = exit_status(cli.main, ["ab-serve", "--model", "k3", "--out", "", "--json"])
    assert usage_error(capsys, code, "ab-serve") == EMPTY_PATH.format("--out")
    code = exit_status(cli.main, ["ab-serve", "report", "", "--json"])
    assert usage_error(capsys, code, "ab-serve report") == EMPTY_PATH.format("out")
    assert list(tmp_path.iterdir()) == []


OPTIONAL_EMPTY_PATH = EMPTY_PATH.format("{}") + ", or leave the option out for its default"


def test_an_empty_path_for_an_option_without_a_default_says_no_default(capsys):
    """bench --json-out writes no file when left out: "leave the option out for its default" promised one."""
    code = exit_status(kernels.main, ["--json-out", "", "--json"])
    assert usage_error(capsys, code, "bench") == EMPTY_PATH.format("--json-out") + ", or leave the option out"


def test_measure_refuses_an_empty_out(capsys):
    code = exit_status(self_measure.main, ["--heads", "12", "--out", "", "--json"])
    assert usage_error(capsys, code, "measure") == OPTIONAL_EMPTY_PATH.format("--out")


@pytest.mark.parametrize("argv,command", [(["tune", "--out", " "], "tune"),
                                          (["check", "--expect", "fused", "--marker-dir", ""], "check")])
def test_tune_and_check_refuse_an_empty_path_option_in_the_parser(argv, command, capsys):
    """One home for the empty-path check: tune's --out and check's --marker-dir are typed Path."""
    code = exit_status(cli.main, [*argv, "--json"])
    assert usage_error(capsys, code, command) == OPTIONAL_EMPTY_PATH.format(argv[-2]).replace("''", repr(argv[-1]))


# --- 7. --absorb-block-n -------------------------------------------------------------------------------

@pytest.mark.parametrize("values,bad", [(["0"], "0"), (["-5"], "-5"), (["64", "3"], "3"), (["1024"], "1024")])
def test_an_absorb_block_the_kernel_cannot_take_is_a_usage_error_naming_it(capsys, values, bad):
    code = kernels.main(["--absorb-block-n", *values, "--json"])
    assert usage_error(capsys, code, "bench") == (
        f"--absorb-block-n {bad}: a power of two from 1 to 512 (the kernel's latent columns per program, a Triton "
        "tile of the 512 it splits)")


def test_every_power_of_two_up_to_the_latent_width_is_an_absorb_block():
    kernels.check_absorb_block_n([1, 2, 16, 64, 256, 512])
    kernels.check_absorb_block_n(None)


# --- 8. --merge lines --------------------------------------------------------------------------------

@pytest.mark.parametrize("lines", ["abc", None, {"0": "ok"}, 5, ["FAIL x", 5], [["FAIL x"]], ["ok", None]])
def test_node_lines_that_are_no_list_refuse_the_node_file(tmp_path, capsys, lines):
    """Before, "abc" was read as the three lines a, b and c, and an item that is no string was
    turned into one."""
    node = tmp_path / "node.json"
    node.write_text(json.dumps({"records": [], "lines": lines}))
    code = cli.main(["check", "--expect", "off", "--merge", str(node), "--json"])
    assert usage_error(capsys, code, "check") == (
        f"--merge: {node} is not the output of `k3-amd-overlay check --json`: its lines are {lines!r}, not a list of "
        "strings")


# --- 10. --json=VALUE ----------------------------------------------------------------------------------

@pytest.mark.parametrize("given,value", [("--json=1", "'1'"), ("--json=yes", "'yes'"), ("--js=", "''")])
def test_json_given_a_value_is_a_usage_error_still_printed_as_one_json_object(capsys, given, value):
    code = exit_status(cli.main, ["check", "--expect", "off", given])
    message = usage_error(capsys, code, "check")
    assert message == f"--json takes no value (given {value}); give --json alone"


def test_a_tool_given_json_with_a_value_prints_the_one_object_too(tmp_path, capsys):
    code = exit_status(cli.main, ["gsm8k-ab", "--model", "k3", "--out", str(tmp_path / "o"), "--json=1"])
    assert usage_error(capsys, code, "gsm8k-ab") == "--json takes no value (given '1'); give --json alone"


def test_wants_json_reads_a_value_given_to_json_and_nothing_else():
    assert wants_json(["--json=1"]) and wants_json(["--js=x"]) and wants_json(["--json"])
    assert not wants_json(["--json-out=x"]) and not wants_json(["--", "--json=1"]) and not wants_json(["--jx=1"])
