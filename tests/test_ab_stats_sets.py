"""The A/B statistics (``k3_amd_overlay.commands.ab_stats``) on outcome sets that tell the quantities apart:
medians that are not means, a geometric-mean paired ratio that is neither the median paired ratio nor
the ratio of medians, zero and missing metrics, unequal repeat counts, one pair, ties and all-zero
differences, the sign-flip test past its exact range, and McNemar's test on small and lopsided
splits. Verdict wording is checked only where n can reach a verdict (n >= 6 pairs or discordant
questions)."""

from __future__ import annotations

import math
import statistics

import pytest

from k3_amd_overlay.commands import ab_stats as stats


def _runs(key, values):
    return [{key: v} for v in values]


def test_a_row_takes_medians_not_means_and_the_geometric_mean_paired_ratio_not_the_ratio_of_medians():
    a = [10.0, 10.0, 11.0, 12.0, 40.0, 100.0]  # median 11.5, mean 30.5
    b = [5.0, 10.0, 22.0, 6.0, 20.0, 10.0]  # median 10, ratios a/b: 2, 1, 0.5, 2, 2, 10
    row = stats.paired_row(4, "TPOT p50 (ms)", False, a, b)
    assert (row.concurrency, row.metric, row.repeats) == (4, "TPOT p50 (ms)", 6)
    assert (row.median_a, row.median_b) == (11.5, 10.0)
    # (2 * 1 * 0.5 * 2 * 2 * 10) ** (1/6): the median paired ratio would be 2, the ratio of medians 1.15
    assert row.ratio == pytest.approx(40 ** (1 / 6))
    logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    assert row.ratio == pytest.approx(math.exp(statistics.fmean(logs)))  # the quantity the CI and the test are about
    low, high = stats.bootstrap_interval(logs)
    assert (row.ci_low, row.ci_high) == (math.exp(low), math.exp(high))  # geometric: of the log-ratios
    assert row.ci_low < row.ratio < row.ci_high
    assert row.p_value == stats.sign_flip_p(logs)
    higher = stats.paired_row(4, "out tok/s", True, a, b)  # throughput: B/A
    assert higher.ratio == pytest.approx(40 ** (-1 / 6)) and (higher.median_a, higher.median_b) == (11.5, 10.0)
    assert higher.p_value == row.p_value


def test_one_pair_gives_its_ratio_and_no_evidence():
    row = stats.paired_row(1, "TTFT p50 (ms)", False, [30.0], [20.0])
    assert (row.repeats, row.median_a, row.median_b, row.ratio) == (1, 30.0, 20.0, 1.5)
    assert row.ci_low == pytest.approx(1.5) and row.ci_high == pytest.approx(1.5)
    assert row.p_value == 1.0  # both signs of one difference reach it


def test_zero_and_missing_metrics_are_left_out_pair_by_pair_and_unfinished_repeats_unpaired():
    a = [{"median_tpot_ms": 10.0, "median_ttft_ms": 0.0, "output_throughput": 100.0}] * 6 + \
        [{"median_tpot_ms": 99.0, "output_throughput": 1.0}]  # A's 7th repeat: B never ran it
    b = [{"median_tpot_ms": 0.0, "median_ttft_ms": 5.0, "output_throughput": 120.0}] + \
        [{"median_tpot_ms": 8.0, "median_ttft_ms": 5.0}] * 5
    rows = stats.serving_rows({"A": {16: a}, "B": {16: b}})
    by_metric = {r.metric: r for r in rows}
    assert set(by_metric) == {"TPOT p50 (ms)", "out tok/s"}  # TTFT: zero in every A run; others absent
    tpot = by_metric["TPOT p50 (ms)"]
    assert (tpot.repeats, tpot.median_a, tpot.median_b, tpot.ratio) == (5, 10.0, 8.0, 1.25)  # B's 0.0 left out
    tput = by_metric["out tok/s"]
    assert (tput.repeats, tput.median_a, tput.median_b) == (1, 100.0, 120.0) and tput.ratio == 1.2


def test_rows_follow_the_baselines_concurrencies_in_order_and_the_metrics_in_table_order():
    values = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    run = [{key: v for _, key, _ in stats.SERVING_METRICS} for v in values]
    results = {"A": {64: run, 1: run, 8: run}, "B": {1: run, 64: run}, "C": {8: run}}
    rows = stats.serving_rows(results)
    assert [r.concurrency for r in rows] == [1] * 9 + [64] * 9  # 8: B never ran it
    assert [r.metric for r in rows[:9]] == [label for label, _, _ in stats.SERVING_METRICS]
    assert all(r.ratio == 1.0 and r.p_value == 1.0 for r in rows)  # identical arms: every difference 0
    other = stats.serving_rows(results, candidate="C", baseline="B")
    assert other == []  # C ran only concurrency 8, B never did
    assert [r.concurrency for r in stats.serving_rows(results, candidate="C")] == [8] * 9
    assert stats.serving_rows({"B": {1: run}}) == []


def test_the_sign_flip_test_on_ties_zeros_and_one_value():
    assert stats.sign_flip_p([0.0] * 6) == 1.0
    assert stats.sign_flip_p([0.7]) == 1.0
    assert stats.sign_flip_p([2.0, -2.0, 2.0, -2.0, 2.0, -2.0]) == 1.0
    assert stats.sign_flip_p([1.0] * 6) == 2 / 64
    assert stats.sign_flip_p([1.0, 1.0, 1.0, 1.0, 1.0, 0.0]) == 4 / 64  # the 0 takes either sign
    assert stats.sign_flip_p([3.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == 2 / 64  # no flip of the 1s reaches |mean| 8/6
    assert stats.sign_flip_p([1.0] * 16) == 2 / 2 ** 16  # the largest n enumerated exactly


def test_the_bootstrap_interval_is_seeded_and_brackets_the_mean():
    values = [0.1, 0.2, 0.4, 0.8, 1.6, -0.3, 0.05, 0.7]
    assert stats.bootstrap_interval(values) == stats.bootstrap_interval(values, seed=0)
    assert stats.bootstrap_interval(values) == (pytest.approx(0.1), pytest.approx(0.85))  # seed 0's resamples
    assert stats.bootstrap_interval(values, seed=1) != stats.bootstrap_interval(values)
    low, high = stats.bootstrap_interval(values)
    assert low < statistics.fmean(values) < high and min(values) < low and high < max(values)
    assert stats.bootstrap_interval([3.0]) == (3.0, 3.0)


def test_the_verdict_needs_p_below_the_level_the_interval_on_the_ratios_side_and_an_effect_of_1pct():
    def row(ratio, p, low=None, high=None):
        low, high = (ratio, ratio) if low is None else (low, high)
        return stats.MetricRow(8, "TPOT p50 (ms)", 6, 1.0, 1.0, ratio, low, high, p)

    assert row(1.1, 0.049).verdict == "faster" and row(0.9, 0.049).verdict == "slower"
    assert row(1.0, 0.01).verdict.startswith("no verdict: p is below the level, but the 95% CI includes 1x")
    assert row(1.005, 0.01).verdict == "no verdict: effect under 1%"  # better by too little to name
    assert row(1.0099, 0.01).verdict == "no verdict: effect under 1%"
    assert row(1.0101, 0.01).verdict == "faster" and row(1 / 1.0101, 0.01).verdict == "slower"
    assert row(1.1, 0.049, 0.9, 1.2).verdict == ("no verdict: p is below the level, but the 95% CI includes 1x (the "
                                                  "test and the interval disagree)")
    assert row(1.1, 0.049, 0.8, 0.95).verdict == "no verdict: the ratio lies on the other side of 1x from its 95% CI"
    assert row(1.5, 0.05).verdict == "no difference detected at this n"  # the level itself is not below it
    assert row(1.5, 0.05).to_json() == {"concurrency": 8, "metric": "TPOT p50 (ms)", "repeats": 6, "median_a": 1.0,
                                        "median_b": 1.0, "ratio": 1.5, "ci_low": 1.5, "ci_high": 1.5, "p_value": 0.05,
                                        "family": 1, "p_adjusted": 0.05, "verdict": "no difference detected at this n"}
    assert stats.SIGNIFICANCE == 0.05 and stats.BOOTSTRAP_RESAMPLES == 10_000 and stats.MIN_EFFECT == 0.01


def test_mcnemar_on_small_and_lopsided_splits():
    assert stats.mcnemar_exact_p(1, 0) == 1.0
    assert stats.mcnemar_exact_p(0, 5) == 2 / 32
    assert stats.mcnemar_exact_p(0, 6) == 2 / 64
    assert stats.mcnemar_exact_p(2, 7) == pytest.approx(2 * (1 + 9 + 36) / 512)
    assert stats.mcnemar_exact_p(3, 3) == 1.0


def test_paired_accuracy_pairs_only_shared_questions_and_names_the_direction():
    a = {q: q < 50 for q in range(100)}
    b = {q: q < 40 or 60 <= q < 70 for q in range(100)}
    b.update({"extra": True, 1000: True})  # answered by B only: unpaired, left out
    paired = stats.PairedAccuracy.from_outcomes(a, b)
    assert (paired.questions, paired.right_a, paired.right_b, paired.only_a, paired.only_b) == (100, 50, 50, 10, 10)
    assert (paired.accuracy_a, paired.accuracy_b, paired.delta) == (0.5, 0.5, 0.0)
    assert paired.verdict().startswith("no difference detected at this n: McNemar exact p = 1.0000 (>= 0.05) over "
                                       "100 paired questions")
    better = stats.PairedAccuracy.from_outcomes(a, {q: q < 60 for q in range(100)})
    assert (better.only_a, better.only_b, better.right_b, better.delta) == (0, 10, 60, pytest.approx(0.1))
    assert better.verdict() == ("B is more accurate than A: McNemar exact p = 0.0020 (< 0.05); 0 questions only A "
                                "answered right, 10 only B")
    worse = stats.PairedAccuracy.from_outcomes({q: q < 60 for q in range(100)}, a)
    assert worse.verdict().startswith("B is less accurate than A: McNemar exact p = 0.0020")
    with pytest.raises(ValueError, match=r"^the arms answered no question in common: nothing to pair$"):
        stats.PairedAccuracy.from_outcomes({1: True}, {2: True})


def test_past_16_pairs_the_sign_flip_test_draws_2_to_the_16_seeded_patterns():
    p = stats.sign_flip_p([1.0] * 17)
    assert p * 2 ** 16 == int(p * 2 ** 16) and p != 2 / 2 ** 17  # drawn, not enumerated
    assert p == 6 / 2 ** 16  # seeded (random.Random(0)): the same draw every time


def test_each_metric_reads_vllms_bench_key_and_faces_the_right_way():
    """`vllm bench serve --save-result` keys; latencies better lower, throughput better higher: B at
    half A's value is 2x better for a latency and 0.5x for throughput."""
    keys = {"TTFT p50 (ms)": "median_ttft_ms", "TTFT p99 (ms)": "p99_ttft_ms", "TPOT p50 (ms)": "median_tpot_ms",
            "TPOT p99 (ms)": "p99_tpot_ms", "ITL p50 (ms)": "median_itl_ms", "ITL p99 (ms)": "p99_itl_ms",
            "E2EL p50 (ms)": "median_e2el_ms", "E2EL p99 (ms)": "p99_e2el_ms", "out tok/s": "output_throughput"}
    for label, key in keys.items():
        (row,) = stats.serving_rows({"A": {2: _runs(key, [10.0] * 6)}, "B": {2: _runs(key, [5.0] * 6)}})
        assert (row.metric, row.ratio) == (label, 0.5 if key == "output_throughput" else 2.0), label


def test_the_table_is_one_row_a_line_and_names_what_n_cannot_reach():
    a = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    six = stats.paired_row(8, "TPOT p50 (ms)", False, a, a)
    three = stats.paired_row(16, "TPOT p50 (ms)", False, a[:3], a[:3])
    lines = stats.render_serving([six, three]).split("\n")
    assert lines[:2] == ["| conc | metric | A median | B median | B vs A (geo. mean of paired ratios) | 95% CI | p | "
                         "p adj. | n | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    assert lines[2].startswith("| 8 | TPOT p50 (ms) [primary] | 12.50 | 12.50 | 1.000x |")
    assert lines[3].startswith("| 16 |")
    assert lines[4:] == ["", "with n=3 the smallest possible p is 0.25: no verdict possible (p < 0.05 needs n >= 6)"]
    assert stats.render_serving([six], "C").split("\n")[0].startswith("| conc | metric | A median | C median | C vs A")


def test_paired_outcomes_are_frozen():
    import dataclasses

    paired = stats.PairedAccuracy.from_outcomes({1: True}, {1: False})
    with pytest.raises(dataclasses.FrozenInstanceError):
        paired.only_a = 0
