"""Issue 27 item 7: an A/B run reads back only what it wrote, and says when its n cannot give a
verdict. ab-serve and gsm8k-ab refuse a used --out; `ab-serve report` refuses a directory that
mixes runs or carries no run id; a run that measured nothing prints no table; the default
--repeats can reach p < 0.05, and any n that cannot is named in the table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from test_ab import STANDINS, bench_runs, free_port, run_script, serve_standin

from k3_amd_overlay.commands import ab_serve, arms, gsm8k_ab
from k3_amd_overlay.commands import ab_stats as stats

ARMS = ("--arm-a", "stock", "--arm-b", "1")


@pytest.fixture
def unproved(monkeypatch):
    """Each arm taken as proved: what is read back is tested here, the proof in test_ab.py."""
    monkeypatch.setattr(arms.Server, "prove", lambda self, after=False: "")


def serve_in_process(out, *args, serve_cmd=f"{sys.executable} {STANDINS / 'fake_serve.py'}"):
    return ab_serve.main(["--model", "k3", "--out", str(out), "--port", str(free_port()), "--health-timeout", "60",
                          "--serve-cmd", serve_cmd, "--bench-cmd", f"{sys.executable} {STANDINS / 'fake_bench.py'}",
                          "--concurrency", "1", *args])


def earlier_run(out):
    """What an earlier ab-serve left: one repeat of each arm with a bench result."""
    for arm, tpot in (("A", 30.0), ("B", 10.0)):
        folder = out / f"repeat0-arm{arm}"
        folder.mkdir(parents=True)
        (folder / "bench-c1.json").write_text(json.dumps({"median_tpot_ms": tpot}))


def test_ab_serve_refuses_a_used_out_before_any_server_starts(tmp_path):
    earlier_run(tmp_path / "out")
    proc = serve_standin(tmp_path / "out", "--concurrency", "1", "--repeats", "1", *ARMS)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--out {tmp_path / 'out'} is not empty (repeat0-armA, repeat0-armB)" in proc.stderr
    assert "ab-serve report DIR" in proc.stderr  # the remedy is a command that exists
    assert "Traceback" not in proc.stderr and "starting" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["repeat0-armA", "repeat0-armB"]


def test_gsm8k_ab_refuses_a_used_out(tmp_path):
    (tmp_path / "out" / "armA" / "lm_eval").mkdir(parents=True)
    proc = run_script("gsm8k_ab.py", "--model", "k3", "--out", str(tmp_path / "out"), *ARMS,
                      "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}")
    assert proc.returncode == 2 and f"--out {tmp_path / 'out'} is not empty (armA)" in proc.stderr, proc.stderr
    assert "summary.md and summary.json" in proc.stderr and "report" not in proc.stderr  # gsm8k-ab has no report


def test_a_run_that_measured_nothing_prints_no_table(tmp_path, capsys):
    code = serve_in_process(tmp_path / "out", "--repeats", "1", *ARMS,
                            serve_cmd=f"{sys.executable} -c 'raise SystemExit(3)'")  # no server ever starts
    out = capsys.readouterr().out
    assert code == 1 and "no repeat completed by both arms: nothing to compare" in out
    assert "| conc | metric |" not in out


def test_report_re_summarises_its_own_run_and_refuses_a_mixed_or_unmarked_directory(tmp_path, unproved):
    out = tmp_path / "out"
    assert serve_in_process(out, "--repeats", "1", *ARMS) == 0
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert (out / "repeat0-armA" / "run-id").read_text().strip() == run_id
    assert json.loads((out / "summary.json").read_text())["run_id"] == run_id

    def report(directory):
        return subprocess.run([sys.executable, "-m", "k3_amd_overlay", "ab-serve", "report", str(directory)],
                              capture_output=True, text=True)

    again = report(out)
    assert again.returncode == 0 and "| 1 | TPOT p50 (ms) [primary] |" in again.stdout, again.stderr
    shutil.copytree(out / "repeat0-armA", out / "repeat1-armA")
    (out / "repeat1-armA" / "run-id").write_text("0123abcd\n")  # another run's folder moved in
    mixed = report(out)
    assert mixed.returncode == 2 and "Traceback" not in mixed.stderr, mixed.stderr
    assert f"results not written by run {run_id}: repeat1-armA (run 0123abcd)" in mixed.stderr
    (out / "repeat1-armA" / "run-id").unlink()
    assert "repeat1-armA (no run id)" in report(out).stderr
    old = tmp_path / "old"  # what a version without run ids left
    earlier_run(old)
    (old / "summary.json").write_text(json.dumps({"environment": {"arms": {}}, "aborted": None}))
    unmarked = report(old)
    assert unmarked.returncode == 2 and f"{old / 'run.json'} not found" in unmarked.stderr, unmarked.stderr


def test_load_results_reads_only_its_own_run(tmp_path):
    from k3_amd_overlay.commands import ab_run

    run_id = ab_run.claim(tmp_path / "out", "ab-serve")
    for label in "AB":
        ab_run.stamp(tmp_path / "out" / f"repeat0-arm{label}", run_id)
        (tmp_path / "out" / f"repeat0-arm{label}" / "bench-c1.json").write_text(json.dumps({"median_tpot_ms": 1.0}))
    ab_run.mark_measured(tmp_path / "out" / "repeat0-armA", run_id)
    # B's benches saved a result but the arm was never marked measured (its proof lapsed, or it never finished)
    assert ab_serve.load_results(tmp_path / "out", run_id) == (
        {"A": {1: {0: {"median_tpot_ms": 1.0}}}}, ["repeat0-armB"])
    (tmp_path / "out" / "repeat0-armB" / ab_run.MEASURED_FILE).write_text("0123abcd\n")  # another run's mark
    assert ab_serve.load_results(tmp_path / "out", run_id)[1] == ["repeat0-armB"]
    ab_run.mark_measured(tmp_path / "out" / "repeat0-armB", run_id)
    assert ab_serve.load_results(tmp_path / "out", run_id) == (
        {label: {1: {0: {"median_tpot_ms": 1.0}}} for label in "AB"}, [])
    (tmp_path / "out" / "repeat1-armB").mkdir()
    with pytest.raises(ab_run.ForeignResults, match="repeat1-armB \\(no run id\\)"):
        ab_serve.load_results(tmp_path / "out", run_id)
    with pytest.raises(Exception, match="not empty"):
        ab_run.claim(tmp_path / "out", "ab-serve")  # a claimed directory is used


def test_default_repeats_can_reach_a_verdict():
    args = ab_serve.parser().parse_args(["--model", "m", "--out", "x"])
    assert stats.smallest_p(args.repeats) < stats.SIGNIFICANCE
    assert args.repeats == stats.pairs_for_a_verdict() == 6
    assert [stats.smallest_p(n) for n in (1, 3, 5, 6)] == [1.0, 0.25, 0.0625, 0.03125]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_table_says_when_n_cannot_give_a_verdict(n):
    a = [20.0, 22.0, 21.0, 20.5, 21.5][:n]
    (row,) = stats.serving_rows({"A": {8: bench_runs("median_tpot_ms", a)},
                                 "B": {8: bench_runs("median_tpot_ms", [x / 1.5 for x in a])}})
    assert row.verdict == f"no verdict possible at n={n}"
    assert (f"with n={n} the smallest possible p is {stats.smallest_p(n):.3g}: no verdict possible"
            in stats.render_serving([row]))


def test_six_pairs_can_give_a_verdict_and_carry_no_note():
    a = [20.0, 22.0, 21.0, 20.5, 21.5, 20.8]
    (row,) = stats.serving_rows({"A": {8: bench_runs("median_tpot_ms", a)},
                                 "B": {8: bench_runs("median_tpot_ms", [x / 1.5 for x in a])}})
    assert row.verdict == "faster" and "no verdict possible" not in stats.render_serving([row])


def test_paired_accuracy_says_when_too_few_questions_differ():
    few = stats.PairedAccuracy.from_outcomes({q: True for q in range(40)}, {q: q >= 3 for q in range(40)})
    assert few.verdict() == ("no verdict possible: 3 of 40 paired questions were answered right by one arm only; "
                             "with n=3 the smallest possible p is 0.25: no verdict possible (p < 0.05 needs n >= 6)")
    six = stats.PairedAccuracy.from_outcomes({q: True for q in range(40)}, {q: q >= 6 for q in range(40)})
    assert six.verdict().startswith("B is less accurate than A: McNemar exact p = 0.0312")


def test_small_n_is_warned_at_the_start(tmp_path, unproved, capsys):
    assert serve_in_process(tmp_path / "out", "--repeats", "1", *ARMS) == 0
    printed = capsys.readouterr()
    assert "warning: --repeats 1: with n=1 the smallest possible p is 1: no verdict possible" in printed.err
    assert "no verdict possible at n=1" in printed.out
    args = gsm8k_ab.parse_args(["--model", "m", "--out", str(tmp_path / "g"), "--limit", "3"])
    assert stats.no_verdict_reason(args.limit).startswith("with n=3 the smallest possible p is 0.25")


def test_gsm8k_ab_stamps_its_arms_with_its_run(tmp_path, unproved, capsys):
    code = gsm8k_ab.main(["--model", "k3", "--out", str(tmp_path / "out"), "--port", str(free_port()), *ARMS,
                          "--health-timeout", "60", "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}",
                          "--lm-eval-cmd", f"{sys.executable} {STANDINS / 'fake_lm_eval.py'}"])
    assert code == 0
    run_id = json.loads((tmp_path / "out" / "run.json").read_text())["run_id"]
    assert {(tmp_path / "out" / f"arm{a}" / "run-id").read_text().strip() for a in "AB"} == {run_id}
    assert f"run {run_id}" in capsys.readouterr().out


def test_the_report_pairs_each_repeat_of_one_arm_with_the_same_repeat_of_the_other(tmp_path):
    """A repeat one arm lacks (an unmeasured folder or a lost bench file) is left out; the repeats
    after it are never shifted onto another repeat of the other arm (they were, by list position)."""
    from k3_amd_overlay.commands import ab_run

    out = tmp_path / "out"
    run_id = ab_run.claim(out, "ab-serve")
    for repeat in range(4):
        for label, tpot in (("A", 10.0 + repeat), ("B", 20.0 + repeat)):
            folder = out / f"repeat{repeat}-arm{label}"
            ab_run.stamp(folder, run_id)
            if (repeat, label) != (0, "A"):  # A's first repeat lost its bench file
                (folder / "bench-c8.json").write_text(json.dumps({"median_tpot_ms": tpot}))
            ab_run.mark_measured(folder, run_id)
    results, _ = ab_serve.load_results(out, run_id)
    paired = ab_serve.in_pairs(results, "B")
    assert [(a["median_tpot_ms"], b["median_tpot_ms"]) for a, b in zip(paired["A"][8], paired["B"][8], strict=True)] \
        == [(11.0, 21.0), (12.0, 22.0), (13.0, 23.0)]
