"""The A/B harnesses end to end against loopback stand-ins for `vllm serve`, `vllm bench serve`
and lm-eval: arms proved through the overlay's own markers, ABBA order, an arm that lies aborts
the run, and the tables' arithmetic."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import with_defaults

from k3_amd_overlay.commands import ab_stats as stats
from k3_amd_overlay.commands import arms
from k3_amd_overlay.package import FUSIONS

ROOT = Path(__file__).resolve().parent.parent
STANDINS = Path(__file__).parent / "standins"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          env=full_env, timeout=600)


def test_abba_order_and_the_default_arms_answer_the_operators_question():
    a, b = arms.default_arms()
    assert [(r, arm.label) for r, arm in arms.abba((a, b), 3)] == [(0, "A"), (0, "B"), (1, "B"), (1, "A"),
                                                                 (2, "A"), (2, "B")]
    assert (a.switch, a.expect, b.switch, b.expect) == ("0", "off", "1", "fused")  # vLLM as it is vs the overlay
    assert [arms.expectation(s) for s in ("stock", "qk_cache", "", "0")] == ["stock", "fused", "off", "off"]
    c = arms.Arm("C", "stock", "stock")
    assert [arm.label for _, arm in arms.abba((a, b, c), 2)] == ["A", "B", "C", "C", "B", "A"]


def bench_runs(key, values):
    return [{key: v} for v in values]


def test_paired_serving_statistics_on_known_sets():
    """Each repeat pairs A and B; the ratio is the median paired ratio, the p-value an exact
    sign-flip test: 6 repeats all 5% faster give the smallest p six pairs can give (2/64) and call it;
    3 repeats can never reach p < 0.05 (the smallest is 2/8), however consistent."""
    a = [20.0, 22.0, 21.0, 20.5, 21.5, 20.8]
    faster = {"A": {8: bench_runs("median_tpot_ms", a)}, "B": {8: bench_runs("median_tpot_ms", [x / 1.05 for x in a])}}
    (row,) = stats.serving_rows(faster)
    assert (row.repeats, row.median_a) == (6, statistics.median(a))
    assert row.ratio == pytest.approx(1.05) and row.ci_low == pytest.approx(1.05) and row.ci_high == pytest.approx(1.05)
    assert row.p_value == pytest.approx(2 / 64) and row.verdict == "faster"
    three = {"A": {8: bench_runs("median_tpot_ms", a[:3])},
             "B": {8: bench_runs("median_tpot_ms", [x * 1.2 for x in a[:3]])}}
    (row,) = stats.serving_rows(three)
    assert row.ratio == pytest.approx(1 / 1.2) and row.p_value == pytest.approx(2 / 8)
    assert row.verdict == "no verdict possible at n=3"
    slower = {"A": {1: bench_runs("output_throughput", a)},
              "B": {1: bench_runs("output_throughput", [x * 0.9 for x in a])}}
    (row,) = stats.serving_rows(slower)
    assert row.ratio == pytest.approx(0.9) and row.verdict == "slower"
    mixed = [1.05, 0.95, 1.04, 0.96, 1.05, 0.95]
    noisy = {"A": {1: bench_runs("output_throughput", a)},
             "B": {1: bench_runs("output_throughput", [x * m for x, m in zip(a, mixed, strict=True)])}}
    (row,) = stats.serving_rows(noisy)
    assert row.p_value > 0.5 and row.verdict == "no difference detected at this n" and row.ci_low < 1 < row.ci_high


def test_sign_flip_p_by_hand():
    assert stats.sign_flip_p([]) == 1.0
    assert stats.sign_flip_p([1.0, 1.0]) == 0.5  # (+,+) and (-,-) reach |mean| 1 of 4 patterns
    assert stats.sign_flip_p([1.0, -1.0, 2.0]) == pytest.approx(6 / 8)  # sums 2, -2, 4, 0, 0, -4, 2, -2: six reach 2


def test_the_serving_table_and_its_json():
    a = [20.0, 22.0, 21.0, 20.5, 21.5, 20.8]
    (row,) = stats.serving_rows({"A": {8: bench_runs("median_tpot_ms", a)},
                                 "B": {8: bench_runs("median_tpot_ms", [x / 1.05 for x in a])}})
    assert "| 8 | TPOT p50 (ms) [primary] | 20.90 | 19.90 | 1.050x | 1.050-1.050x | 0.031 | 0.031 | 6 | faster |" in \
        stats.render_serving([row])
    assert row.to_json()["verdict"] == "faster"
    assert [m for m, _, _ in stats.SERVING_METRICS] == [
        "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)",
        "E2EL p50 (ms)", "E2EL p99 (ms)", "out tok/s"]


def test_mcnemar_exact_p_values_known_by_hand():
    assert stats.mcnemar_exact_p(0, 0) == 1.0
    assert stats.mcnemar_exact_p(12, 0) == pytest.approx(2 / 2 ** 12)  # 0.000488
    assert stats.mcnemar_exact_p(1, 5) == pytest.approx(2 * (1 + 6) / 64)  # 0.21875
    assert stats.mcnemar_exact_p(5, 1) == stats.mcnemar_exact_p(1, 5)
    assert stats.mcnemar_exact_p(10, 10) == 1.0  # capped


def test_paired_accuracy_finds_what_an_unpaired_se_misses():
    """Issue 21: both arms answer the same 1319 questions; B loses 12 that A got right and gains
    none. Compared unpaired, -0.91 pp is 1.2 binomial standard errors (0.74 pp): nothing to see;
    paired, it is decisive: McNemar's exact p = 0.0005. Ten lost and ten gained are no difference."""
    a = {q: q % 30 != 0 for q in range(1319)}  # 1275 right
    lost = [q for q in range(1319) if a[q]][:12]
    b = {q: a[q] and q not in lost for q in range(1319)}
    paired = stats.PairedAccuracy.from_outcomes(a, b)
    assert (paired.questions, paired.only_a, paired.only_b, paired.right_a - paired.right_b) == (1319, 12, 0, 12)
    assert paired.delta == pytest.approx(-12 / 1319)
    assert round(paired.p_value, 4) == 0.0005
    assert paired.verdict() == ("B is less accurate than A: McNemar exact p = 0.0005 (< 0.05); 12 questions only A "
                                "answered right, 0 only B")
    flipped = {q for q in range(1319) if not a[q]}
    flipped = set(sorted(flipped)[:10]) | set(lost[:10])
    swapped = stats.PairedAccuracy.from_outcomes(a, {q: a[q] != (q in flipped) for q in range(1319)})
    assert (swapped.only_a, swapped.only_b) == (10, 10)
    assert swapped.verdict().startswith("no difference detected at this n: McNemar exact p = ")


def test_paired_accuracy_pairs_only_shared_questions():
    paired = stats.PairedAccuracy.from_outcomes({1: True, 2: False, 3: True}, {2: True, 3: True, 4: False})
    assert (paired.questions, paired.only_a, paired.only_b) == (2, 0, 1)
    with pytest.raises(ValueError, match="no question in common"):
        stats.PairedAccuracy.from_outcomes({1: True}, {2: True})


def serve_standin(tmp_path, *args, env=None):
    """ab-serve against the stand-ins; an option in ``args`` replaces its default here."""
    defaults = {"--model": "k3", "--out": str(tmp_path), "--port": str(free_port()), "--health-timeout": "60",
                "--serve-cmd": f"{sys.executable} {STANDINS / 'fake_serve.py'}",
                "--bench-cmd": f"{sys.executable} {STANDINS / 'fake_bench.py'}"}
    return run_script("ab_serve.py", *with_defaults(defaults, args), env=env)


def test_ab_serve_end_to_end(tmp_path):
    proc = serve_standin(tmp_path, "--concurrency", "1", "8", "--repeats", "2", "--num-prompts", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = [line.split(", ", 1)[1].removesuffix(": starting")
              for line in proc.stdout.splitlines() if line.endswith(": starting")]
    assert starts == ["arm A (K3_AMD_OVERLAY=0)", "arm B (K3_AMD_OVERLAY=1)",
                      "arm B (K3_AMD_OVERLAY=1)", "arm A (K3_AMD_OVERLAY=0)"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {(r["concurrency"], r["metric"]): r for r in summary["rows"]["B_vs_A"]}
    tpot = rows[(8, "TPOT p50 (ms)")]
    assert tpot["median_a"] == pytest.approx(20.0, abs=0.06) and tpot["median_b"] == pytest.approx(19.0, abs=0.06)
    assert tpot["ratio"] == pytest.approx(20 / 19, abs=0.01) and tpot["repeats"] == 2
    assert tpot["verdict"] == "no verdict possible at n=2"  # 2 pairs: the smallest exact p is 0.5
    assert (8, "TPOT p99 (ms)") in rows and "| 1 | out tok/s |" in proc.stdout
    env = summary["environment"]
    assert env["arms"] == {"A": {"switch": "0", "expect": "off"}, "B": {"switch": "1", "expect": "fused"}}
    assert env["overlay_version"] and env["num_prompts"] == 5 and env["repeats"] == 2 and summary["aborted"] is None
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["repeat0-armA", "repeat0-armB",
                                                                       "repeat1-armA", "repeat1-armB"]
    assert "HOLDS: expect fused" in (tmp_path / "repeat0-armB" / "check.txt").read_text()
    assert "HOLDS: expect off" in (tmp_path / "repeat0-armA" / "check.txt").read_text()
    assert "HOLDS: expect fused" in (tmp_path / "repeat1-armB" / "check-after.txt").read_text()
    assert json.loads((tmp_path / "repeat1-armB" / "check-after.json").read_text())["holds"] is True
    assert summary["fusions"] == {"A": {"mode": "off", "fusions": {f: ["disabled"] for f in FUSIONS}},
                                  "B": {"mode": "auto", "fusions": {f: ["applied"] for f in FUSIONS}}}
    assert "### B (K3_AMD_OVERLAY=1) vs A (K3_AMD_OVERLAY=0): the overlay's fusions vs vLLM as shipped" in proc.stdout
    assert (tmp_path / "repeat1-armA" / "bench-c8.json").exists()
    (tmp_path / "summary.md").unlink()
    again = subprocess.run([sys.executable, "-m", "k3_amd_overlay", "ab-serve", "report", str(tmp_path)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "| 8 | TPOT p50 (ms) [primary] |" in again.stdout and (tmp_path / "summary.md").exists()


def test_ab_serve_with_the_stock_arm_compares_both_with_off(tmp_path):
    proc = serve_standin(tmp_path, "--concurrency", "1", "--repeats", "1", "--with-stock")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "### B (K3_AMD_OVERLAY=1) vs A (K3_AMD_OVERLAY=0): the overlay's fusions vs vLLM as shipped" in proc.stdout
    assert "### C (K3_AMD_OVERLAY=stock) vs A (K3_AMD_OVERLAY=0): all unfused vs vLLM as shipped" in proc.stdout
    assert "- C (K3_AMD_OVERLAY=stock): absorb_qk_cache forced-stock; qk_cache forced-stock; qkv_norm forced-stock" \
        in proc.stdout
    assert "HOLDS: expect stock" in (tmp_path / "repeat0-armC" / "check.txt").read_text()


@pytest.mark.parametrize("args,message", [
    (["--repeats", "0"], "--repeats 0: at least 1"),
    (["--arm-b", "yes"], "--arm-b: K3_AMD_OVERLAY='yes' is not valid"),
    (["--arm-a", "1"], "the arms must differ: --arm-a '1' and --arm-b '1' are the same setting"),
    (["--num-prompts", "0"], "--num-prompts 0: at least 1"),
    (["--serve-cmd", "no-such-vllm serve"], "--serve-cmd 'no-such-vllm serve': no-such-vllm is not an executable"),
])
def test_ab_serve_rejects_bad_arguments_before_any_server_starts(tmp_path, args, message):
    proc = serve_standin(tmp_path / "out", "--concurrency", "1", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_ab_serve_out_pointing_at_a_file_and_a_wrong_served_name_say_so(tmp_path):
    (tmp_path / "file").write_text("")
    proc = serve_standin(tmp_path / "file", "--concurrency", "1")
    assert proc.returncode == 2 and "is a file, not a directory" in proc.stderr
    proc = serve_standin(tmp_path / "out", "--concurrency", "1", "--repeats", "1", env={"STANDIN_SERVED_NAME": "other"})
    assert proc.returncode == 1 and "HTTP 404" in proc.stderr and "--served-model-name" in proc.stderr
    assert "Traceback" not in proc.stderr and "ABORTED (" in (tmp_path / "out" / "summary.md").read_text()


def test_ab_serve_aborts_when_arm_b_is_really_stock(tmp_path):
    proc = serve_standin(tmp_path, "--concurrency", "1", "--repeats", "1", "--arm-a", "stock",
                         env={"STANDIN_LIE": "stock"})
    assert proc.returncode == 1
    assert "ABORTED: arm B (K3_AMD_OVERLAY=1) is not fused" in proc.stderr
    assert "forced-stock" in proc.stderr and str(tmp_path / "repeat0-armB") in proc.stderr
    assert not (tmp_path / "repeat0-armB" / "bench-c1.json").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["aborted"].startswith("arm B (K3_AMD_OVERLAY=1)")


def test_ab_serve_proves_each_arm_again_after_its_benches(tmp_path):
    """A fused kernel fails when the bench first reaches arm B's server: the overlay refuses every
    fusion and the rest of the run is stock. Proved fused before its bench, the arm is proved again
    after it: the run aborts with that check's reason and B's TPOT is credited to nothing."""
    proc = serve_standin(tmp_path, "--concurrency", "1", "--repeats", "1", env={"STANDIN_KERNEL_FAILS": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    folder = tmp_path / "repeat0-armB"
    assert "[2/2] arm B proved fused" in proc.stdout
    assert "ABORTED: arm B (K3_AMD_OVERLAY=1) is no longer fused after its measurement" in proc.stderr
    assert "its kernel failed on this GPU" in proc.stderr and str(folder) in proc.stderr
    assert "HOLDS: expect fused" in (folder / "check.txt").read_text()
    after = (folder / "check-after.txt").read_text()
    assert "DOES NOT HOLD: expect fused" in after and "refused" in after and "its kernel failed on this GPU" in after
    assert "HOLDS: expect off" in (tmp_path / "repeat0-armA" / "check-after.txt").read_text()
    assert (folder / "bench-c1.json").exists()  # kept, but not compared
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["aborted"].startswith("arm B (K3_AMD_OVERLAY=1) is no longer fused after its measurement")
    assert summary["rows"] == {"B_vs_A": []} and "| 1 | TPOT p50 (ms) |" not in proc.stdout
    assert "not compared: repeat0-armB" in (tmp_path / "summary.md").read_text()


def test_ab_serve_fails_an_arm_whose_fused_path_ran_in_no_batch_of_its_measurement(tmp_path):
    """Proved fused on its probe request, arm B's server ran every bench batch stock (a self-measurement
    sent those batch sizes to stock): its check still held after the benches, on the probe's batches, and
    the run credited stock's TPOT to the overlay. Now the proofs' counts of served batches must grow."""
    proc = serve_standin(tmp_path, "--concurrency", "1", "--repeats", "1", env={"STANDIN_GATED": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("ABORTED: arm B (K3_AMD_OVERLAY=1) ran the overlay's fused path in no batch of its measurement (its "
            "results are not used): decode (2 batches before it, 2 after); qkv_norm (1 batches before it, 1 after)"
            ) in proc.stderr
    assert "HOLDS: expect fused" in (tmp_path / "repeat0-armB" / "check-after.txt").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["aborted"].startswith(
        "arm B (K3_AMD_OVERLAY=1) ran the overlay's fused path in no batch")


def test_gsm8k_ab_proves_each_arm_again_after_lm_eval(tmp_path):
    proc = run_script("gsm8k_ab.py", "--model", "k3", "--out", str(tmp_path), "--port", str(free_port()),
                      "--health-timeout", "60", "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}",
                      "--lm-eval-cmd", f"{sys.executable} {STANDINS / 'fake_lm_eval.py'}", "--json",
                      env={"STANDIN_KERNEL_FAILS": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ABORTED: arm B (K3_AMD_OVERLAY=1) is no longer fused after its measurement" in proc.stderr
    assert "its kernel failed on this GPU" in (tmp_path / "armB" / "check-after.txt").read_text()
    assert "HOLDS: expect fused" in (tmp_path / "armB" / "check.txt").read_text()
    assert json.loads(proc.stdout)["ok"] is False and not (tmp_path / "summary.json").exists()


def test_gsm8k_ab_end_to_end(tmp_path):
    proc = run_script("gsm8k_ab.py", "--model", "k3", "--out", str(tmp_path), "--port", str(free_port()),
                      "--health-timeout", "60", "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}",
                      "--lm-eval-cmd", f"{sys.executable} {STANDINS / 'fake_lm_eval.py'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| A | 0 | 0.9000 | 40 |" in proc.stdout and "| B | 1 | 0.8750 | 40 |" in proc.stdout
    assert "paired over 40 questions: delta (B - A) -2.50 pp; right only with A: 1, only with B: 0" in proc.stdout
    assert ("verdict: no verdict possible: 1 of 40 paired questions were answered right by one arm only; with n=1 "
            "the smallest possible p is 1: no verdict possible") in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--arm-a", "1"], "the arms must differ: --arm-a '1' and --arm-b '1' are the same setting"),
    (["--arm-b", "fast"], "--arm-b: K3_AMD_OVERLAY='fast' is not valid"),
    (["--limit", "0"], "--limit 0: at least 1"),
    (["--lm-eval-cmd", "no-such-lm-eval"], "--lm-eval-cmd 'no-such-lm-eval': no-such-lm-eval is not an executable"),
])
def test_gsm8k_ab_rejects_bad_arguments_before_any_server_starts(tmp_path, args, message):
    proc = run_script("gsm8k_ab.py", "--model", "k3", "--out", str(tmp_path / "out"),
                      "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
