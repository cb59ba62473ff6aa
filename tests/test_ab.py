"""The A/B harnesses end to end against loopback stand-ins for `vllm serve`, `vllm bench serve`
and lm-eval: arms proved through the overlay's own markers, ABBA order, an arm that lies aborts
the run, and the tables' arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3_amd_overlay import arms

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


def test_abba_order():
    a, b = arms.default_arms()
    assert [(r, arm.label) for r, arm in arms.abba((a, b), 3)] == [(0, "A"), (0, "B"), (1, "B"), (1, "A"),
                                                                 (2, "A"), (2, "B")]
    assert (a.expect, b.expect) == ("stock", "fused")


def test_serving_table_arithmetic():
    results = {"A": {8: [{"median_tpot_ms": 20.0, "output_throughput": 100.0},
                         {"median_tpot_ms": 22.0, "output_throughput": 110.0}]},
               "B": {8: [{"median_tpot_ms": 20.0, "output_throughput": 104.0},
                         {"median_tpot_ms": 20.2, "output_throughput": 106.0}]}}
    tpot, tput = arms.serving_rows(results)
    assert (tpot.baseline, tpot.fused) == (21.0, 20.1)
    assert tpot.ratio == pytest.approx(21.0 / 20.1)
    assert tpot.spread_a == pytest.approx(100 * 2 / 21) and tpot.spread_b == pytest.approx(100 * 0.2 / 20.1)
    assert tpot.inside_noise  # 4.5% better, but arm A alone swings 9.5%
    assert tput.ratio == pytest.approx(105.0 / 105.0) and tput.inside_noise
    row = "| 8 | TPOT p50 (ms) | 21.00 | 20.10 | 1.045x | 9.52% | 1.00% | inside noise |"
    assert row in arms.render_serving([tpot])


def test_mcnemar_exact_p_values_known_by_hand():
    assert arms.mcnemar_exact_p(0, 0) == 1.0
    assert arms.mcnemar_exact_p(12, 0) == pytest.approx(2 / 2 ** 12)  # 0.000488
    assert arms.mcnemar_exact_p(1, 5) == pytest.approx(2 * (1 + 6) / 64)  # 0.21875
    assert arms.mcnemar_exact_p(5, 1) == arms.mcnemar_exact_p(1, 5)
    assert arms.mcnemar_exact_p(10, 10) == 1.0  # capped


def test_paired_accuracy_finds_what_an_unpaired_se_misses():
    """Issue 21: both arms answer the same 1319 questions; B loses 12 that A got right and gains
    none. Compared unpaired, -0.91 pp is 1.2 binomial standard errors (0.74 pp): nothing to see;
    paired, it is decisive: McNemar's exact p = 0.0005. Ten lost and ten gained are no difference."""
    a = {q: q % 30 != 0 for q in range(1319)}  # 1275 right
    lost = [q for q in range(1319) if a[q]][:12]
    b = {q: a[q] and q not in lost for q in range(1319)}
    paired = arms.PairedAccuracy.from_outcomes(a, b)
    assert (paired.questions, paired.only_a, paired.only_b, paired.right_a - paired.right_b) == (1319, 12, 0, 12)
    assert paired.delta == pytest.approx(-12 / 1319)
    assert round(paired.p_value, 4) == 0.0005
    assert paired.verdict() == ("B is less accurate than A: McNemar exact p = 0.0005 (< 0.05); 12 questions only A "
                                "answered right, 0 only B")
    flipped = {q for q in range(1319) if not a[q]}
    flipped = set(sorted(flipped)[:10]) | set(lost[:10])
    swapped = arms.PairedAccuracy.from_outcomes(a, {q: a[q] != (q in flipped) for q in range(1319)})
    assert (swapped.only_a, swapped.only_b) == (10, 10)
    assert swapped.verdict().startswith("no difference detected at this n: McNemar exact p = ")


def test_paired_accuracy_pairs_only_shared_questions():
    paired = arms.PairedAccuracy.from_outcomes({1: True, 2: False, 3: True}, {2: True, 3: True, 4: False})
    assert (paired.questions, paired.only_a, paired.only_b) == (2, 0, 1)
    with pytest.raises(ValueError, match="no question in common"):
        arms.PairedAccuracy.from_outcomes({1: True}, {2: True})


def test_ab_serve_end_to_end(tmp_path):
    proc = run_script("ab_serve.py", "--model", "k3", "--concurrency", "1", "8", "--repeats", "2",
                      "--out", str(tmp_path), "--port", str(free_port()), "--health-timeout", "60",
                      "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}",
                      "--bench-cmd", f"{sys.executable} {STANDINS / 'fake_bench.py'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = [line.split(", ", 1)[1].removesuffix(": starting")
              for line in proc.stdout.splitlines() if line.endswith(": starting")]
    assert starts == ["arm A (K3_AMD_OVERLAY=stock)", "arm B (K3_AMD_OVERLAY=1)",
                      "arm B (K3_AMD_OVERLAY=1)", "arm A (K3_AMD_OVERLAY=stock)"]
    rows = {(r["concurrency"], r["metric"]): r for r in json.loads((tmp_path / "summary.json").read_text())}
    tpot = rows[(8, "TPOT p50 (ms)")]
    assert tpot["baseline"] == pytest.approx(20.0, abs=0.06) and tpot["fused"] == pytest.approx(19.0, abs=0.06)
    assert tpot["ratio"] == pytest.approx(20 / 19, abs=0.01) and tpot["inside_noise"] is False
    assert "| 1 | out tok/s |" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repeat0-armA", "repeat0-armB", "repeat1-armA",
                                                         "repeat1-armB", "summary.json", "summary.md"]
    assert "HOLDS: expect fused" in (tmp_path / "repeat0-armB" / "check.txt").read_text()
    assert (tmp_path / "repeat1-armA" / "bench-c8.json").exists()


def test_ab_serve_aborts_when_arm_b_is_really_stock(tmp_path):
    proc = run_script("ab_serve.py", "--model", "k3", "--concurrency", "1", "--repeats", "1",
                      "--out", str(tmp_path), "--port", str(free_port()), "--health-timeout", "60",
                      "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}",
                      "--bench-cmd", f"{sys.executable} {STANDINS / 'fake_bench.py'}",
                      env={"STANDIN_LIE": "stock"})
    assert proc.returncode == 1
    assert "ABORTED: arm B (K3_AMD_OVERLAY=1) is not fused" in proc.stderr
    assert "forced-stock" in proc.stderr and str(tmp_path / "repeat0-armB") in proc.stderr
    assert not (tmp_path / "repeat0-armB" / "bench-c1.json").exists()


def test_gsm8k_ab_end_to_end(tmp_path):
    proc = run_script("gsm8k_ab.py", "--model", "k3", "--out", str(tmp_path), "--port", str(free_port()),
                      "--health-timeout", "60", "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}",
                      "--lm-eval-cmd", f"{sys.executable} {STANDINS / 'fake_lm_eval.py'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| A | stock | 0.9000 | 40 |" in proc.stdout and "| B | 1 | 0.8750 | 40 |" in proc.stdout
    assert "paired over 40 questions: delta (B - A) -2.50 pp; right only with A: 1, only with B: 0" in proc.stdout
    assert ("verdict: no difference detected at this n: McNemar exact p = 1.0000 (>= 0.05) over 40 paired "
            "questions") in proc.stdout
