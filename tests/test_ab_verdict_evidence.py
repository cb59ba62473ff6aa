"""The serving verdict holds only on positive, matching evidence (ab_stats.py): its direction is read
from the quantity its test and its interval are about (the geometric mean of the paired ratios, not
their median), an effect under 1% is named no verdict, and the 27 rows of a default table are judged
with the primary metric (TPOT p50) alone at each concurrency and Holm's correction across the rest,
so a verdict stays possible at the documented minimum of 6 repeats."""

from __future__ import annotations

import math
import random

import pytest

from k3_amd_overlay.commands import ab_stats as stats

CONCURRENCIES = (1, 8, 32)


def test_a_split_outcome_is_called_by_its_mean_not_its_median():
    """13 repeats: 7 with B 0.1% faster, 6 with B 26% slower (a TPOT 35% longer). The median paired
    ratio (1.001x) says faster; the mean log-ratio that the interval bounds and the test tests says
    slower, decisively."""
    a = [100.0] * 13
    b = [100.0 / 1.001] * 7 + [100.0 * 1.35] * 6
    row = stats.paired_row(1, "TPOT p50 (ms)", False, a, b)
    assert row.ratio == pytest.approx(math.exp((7 * math.log(1.001) - 6 * math.log(1.35)) / 13))
    assert row.ci_low < row.ratio < row.ci_high < 1 and row.p_value < 0.05
    assert row.verdict == "slower"


def test_no_verdict_contradicts_its_own_ratio_or_interval():
    """Outcome sets drawn from mixtures (most repeats a little better, a few much worse, and the
    reverse): wherever a row is called, its ratio and its whole interval are on that side of 1x."""
    rng = random.Random(11)
    called = 0
    for _ in range(400):
        n = rng.choice((6, 7, 9, 13))
        small, large = rng.uniform(0.0005, 0.02), rng.uniform(0.1, 0.5)
        sign = rng.choice((1, -1))
        logs = [sign * (small if rng.random() < 0.6 else -large) for _ in range(n)]
        row = stats.paired_row(8, "TPOT p50 (ms)", False, [100.0] * n, [100.0 / math.exp(v) for v in logs])
        if row.verdict == "faster":
            called += 1
            assert row.ratio > 1 and row.ci_low > 1, (logs, row)
        elif row.verdict == "slower":
            called += 1
            assert row.ratio < 1 and row.ci_high < 1, (logs, row)
    assert called > 20  # the sets do reach verdicts: the checks above ran


def test_a_consistent_effect_under_1pct_is_no_verdict():
    a = [100.0, 101.0, 99.5, 100.2, 100.7, 99.9]
    tiny = stats.paired_row(1, "TPOT p50 (ms)", False, a, [x / 1.002 for x in a])
    assert tiny.p_value == 2 / 64 and tiny.ci_low > 1  # every pair 0.2% better: as significant as 6 pairs get
    assert tiny.verdict == "no verdict: effect under 1%"
    clear = stats.paired_row(1, "TPOT p50 (ms)", False, a, [x / 1.02 for x in a])
    assert clear.verdict == "faster"


def test_holm_adjusted_p_values_by_hand():
    # sorted: 3 x 0.01; 2 x 0.03; 1 x 0.04, raised to the 0.06 before it
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert stats.holm([0.2, 0.01]) == pytest.approx([0.2, 0.02])
    assert stats.holm([0.6, 0.6]) == [1.0, 1.0] and stats.holm([0.3]) == [0.3] and stats.holm([]) == []


def full_table(repeats: int, faster_by: float) -> dict[str, dict[int, list[dict[str, float]]]]:
    """Every metric at every concurrency, B better by ``faster_by`` in every repeat (a little noise)."""
    rng = random.Random(repeats)
    runs = {"A": {}, "B": {}}
    for c in CONCURRENCIES:
        runs["A"][c], runs["B"][c] = [], []
        for _ in range(repeats):
            base = {key: rng.uniform(90.0, 110.0) for _, key, _ in stats.SERVING_METRICS}
            runs["A"][c].append(base)
            runs["B"][c].append({key: v * faster_by if higher else v / faster_by
                                 for (_, key, higher), v in zip(stats.SERVING_METRICS, base.values(), strict=True)})
    return runs


def test_at_the_minimum_repeats_only_the_primary_rows_of_a_full_table_are_called():
    """27 rows, every one 5% better in each of 6 pairs (p = 2/64 each, uncorrected). Holm over all 27
    would leave none callable at 6 repeats; the primary metric, judged alone at each concurrency, is;
    the 24 other rows, Holm-corrected together, need 10."""
    rows = stats.serving_rows(full_table(6, 1.05))
    assert len(rows) == 27 and stats.pairs_for_a_verdict() == 6
    primary = [r for r in rows if r.metric == "TPOT p50 (ms)"]  # stats.PRIMARY_METRIC
    others = [r for r in rows if r.metric != "TPOT p50 (ms)"]
    assert [(r.concurrency, r.verdict) for r in primary] == [(c, "faster") for c in CONCURRENCIES]
    assert {r.verdict for r in others} == {"no verdict possible at n=6 (Holm over 24 rows)"}
    assert {r.family for r in primary} == {1} and {(r.family, r.p_adjusted) for r in others} == {(24, 24 * 2 / 64)}
    assert stats.no_verdict_reason(6, 27)  # Holm over all 27 rows: no verdict at all at n=6
    assert stats.PRIMARY_METRIC == "TPOT p50 (ms)"
    assert ("with n=6 and 24 rows judged together (Holm) the smallest possible adjusted p is 0.75: no verdict "
            "possible on them (p adj. < 0.05 needs n >= 10)") in stats.render_serving(rows)
    assert stats.pairs_for_a_verdict(24) == 10
    ten = stats.serving_rows(full_table(10, 1.05))
    assert {r.verdict for r in ten} == {"faster"}
    assert {r.p_adjusted for r in ten if r.metric != stats.PRIMARY_METRIC} == {24 * 2 / 1024}


def test_a_secondary_row_called_alone_is_no_longer_called_among_many():
    """One uncorrected p of 2/64 among 24 secondary rows: Holm's adjusted p is 24 times it."""
    table = full_table(6, 1.05)
    out_tok = next(r for r in stats.serving_rows(table) if r.metric == "out tok/s" and r.concurrency == 8)
    assert out_tok.p_value == 2 / 64 and out_tok.verdict == "no verdict possible at n=6 (Holm over 24 rows)"
    a, b = ([run["output_throughput"] for run in table[arm][8]] for arm in "AB")
    assert stats.paired_row(8, "out tok/s", True, a, b).verdict == "faster"  # the same numbers as the only question
