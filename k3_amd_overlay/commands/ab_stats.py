"""The statistics of the A/B tables, kept apart from running servers so they are tested on
outcome sets whose answer is known.

Serving: both arms run once per repeat (ABBA order), so repeat r gives a pair (A_r, B_r) per metric.
Each pair's ratio (> 1: B better) is one observation, and one quantity is estimated, tested and
bounded: the mean paired log-ratio. The table gives each arm's median, the geometric mean of the
paired ratios (exp of that mean: the point estimate), a 95% percentile-bootstrap interval of it
(10,000 resamples of the pairs, seeded) and an exact two-sided sign-flip test of the paired
log-ratios (every one of the 2^n sign patterns). The median paired ratio is not reported: it can
sit on the other side of 1 from the mean the test and the interval are about (7 pairs 0.1% better
and 6 pairs 26% worse), and a verdict must not read its direction from another quantity.

A verdict ("faster", "slower") holds only on positive, matching evidence: p below SIGNIFICANCE after
the correction below, the whole interval on the point estimate's side of 1x, and an effect of at
least MIN_EFFECT. Multiplicity: a table holds 9 metrics per concurrency (27 rows at 3), and at 5%
one of 27 null rows is called by chance more often than not. PRIMARY_METRIC (TPOT p50, the decode
step the overlay's fusions change) is declared in advance and judged alone at each concurrency, one
question per workload; every other row of the comparison is judged with Holm's step-down
correction across all of them (family-wise error 5%). Holm over all 27 rows would make a verdict
impossible at the documented minimum of 6 repeats (the smallest exact p, 2/64, exceeds 0.05/27), so
the primary rows are kept out of that family: at 6 repeats only they can be called; the secondary
rows need the n ``pairs_for_a_verdict(family)`` names (10 for 24 rows).

Accuracy: both arms answer the same questions, so the questions only one arm got right decide
(McNemar's exact test, one test per run: no correction); with d such questions its smallest p is
2 / 2^d as well."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from k3_amd_overlay import json_values

SIGNIFICANCE = 0.05  # the two-sided level (family-wise, for the rows judged together) of a verdict
# The smallest effect a verdict names: a geometric-mean ratio within 1% of 1x is no verdict however small
# its p. Serving numbers move by about that much between otherwise identical runs (GPU clocks, heat,
# scheduling), so a consistent 0.2% at n=6 says nothing an operator could act on.
MIN_EFFECT = 0.01
PRIMARY_METRIC = "TPOT p50 (ms)"  # judged alone at each concurrency; every other row: Holm across the comparison
BOOTSTRAP_RESAMPLES = 10_000
EXACT_MAX_PAIRS = 16  # up to 2^16 sign patterns enumerated; beyond, the same number drawn at random

# (label, key in `vllm bench serve --save-result` JSON, higher is better)
SERVING_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("TTFT p50 (ms)", "median_ttft_ms", False),
    ("TTFT p99 (ms)", "p99_ttft_ms", False),
    ("TPOT p50 (ms)", "median_tpot_ms", False),
    ("TPOT p99 (ms)", "p99_tpot_ms", False),
    ("ITL p50 (ms)", "median_itl_ms", False),
    ("ITL p99 (ms)", "p99_itl_ms", False),
    ("E2EL p50 (ms)", "median_e2el_ms", False),
    ("E2EL p99 (ms)", "p99_e2el_ms", False),
    ("out tok/s", "output_throughput", True),
)
METHOD = ("Paired over the ABBA repeats: the ratio is the geometric mean of the per-repeat ratios (exp of the mean "
          "paired log-ratio); 95% CI: percentile bootstrap (10,000 resamples) of the mean paired log-ratio; p: exact "
          f"two-sided sign-flip test of the paired log-ratios; {PRIMARY_METRIC}, the primary metric, is judged alone "
          "at each concurrency, every other row with Holm's correction across the comparison (p adj.); a verdict "
          f"needs p adj. < {SIGNIFICANCE}, the whole CI on the ratio's side of 1x and an effect of at least "
          f"{MIN_EFFECT:.0%}.")


def unusable_metric(record: Any) -> str | None:
    """Why a saved bench result cannot enter the table, naming the field, or None where it can: a
    JSON object with requests completed and none failed, a throughput above 0 and latencies of 0 or more. A metric it
    lacks, NaN where the bench measured none, and a latency of 0 (a time between tokens of outputs
    one token long) are left out of the table; an infinite one has no ratio; no request completed,
    or a throughput of 0, is what an arm whose requests all failed records; a negative one is no
    time."""
    if not isinstance(record, dict):
        return f"it holds {json_values.kind(record)}, not a JSON object"
    if "completed" in record and json_values.whole(record["completed"], least=1) is None:
        return f'"completed" is {record["completed"]!r}: no request completed (every request of the arm failed?)'
    if "failed" in record and json_values.whole(record["failed"]) != 0:
        return (f'"failed" is {record["failed"]!r}: requests failed, so its latencies and throughputs are those of the '
                "requests that completed under less load, not of the run (vLLM's bench exits 0 all the same)")
    for _, key, higher_better in SERVING_METRICS:
        if key not in record:
            continue
        value = record[key]
        number = json_values.as_float(value)
        if number is None or math.isinf(number):
            return f'"{key}" is {value!r}, not a finite number'
        if number < 0 or (higher_better and number == 0):  # NaN compares false: left out, as above
            least = "more than 0 (a throughput; 0 is what a bench whose requests all failed records)" \
                if higher_better else "0 or more (a time)"
            return f'"{key}" is {value!r}, not a number {least}'
    return None


def smallest_p(n: int) -> float:
    """The smallest two-sided p an exact sign-flip test of n pairs (or McNemar's exact test of n
    discordant questions) can give: every observation on one side, 2 patterns of 2^n."""
    return min(1.0, 2.0 / 2 ** n) if n > 0 else 1.0


def pairs_for_a_verdict(family: int = 1) -> int:
    """The fewest pairs whose smallest possible p, Holm-adjusted in a family of ``family`` rows (the
    first step multiplies it by ``family``), is below SIGNIFICANCE: 6 for a row judged alone, 10 for 24."""
    return next(n for n in itertools.count(1) if family * smallest_p(n) < SIGNIFICANCE)


def no_verdict_reason(n: int, family: int = 1) -> str | None:
    """Why n pairs can never give a verdict in a family of ``family`` rows judged together (1: a row
    judged alone), or None where they can."""
    least = min(1.0, family * smallest_p(n))
    if least < SIGNIFICANCE:
        return None
    if family == 1:
        return (f"with n={n} the smallest possible p is {least:.3g}: no verdict possible "
                f"(p < {SIGNIFICANCE} needs n >= {pairs_for_a_verdict()})")
    return (f"with n={n} and {family} rows judged together (Holm) the smallest possible adjusted p is {least:.3g}: "
            f"no verdict possible on them (p adj. < {SIGNIFICANCE} needs n >= {pairs_for_a_verdict(family)})")


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: sorted ascending, the k-th smallest
    (from 0) times (m - k), never below the one before it, capped at 1. Each adjusted p below a
    level rejects at that family-wise level."""
    m = len(p_values)
    adjusted = [1.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def sign_flip_p(values: Sequence[float]) -> float:
    """Exact two-sided sign-flip (paired permutation) test that ``values`` (paired differences)
    are centred on 0: the share of sign patterns whose |mean| is at least the observed one."""
    n = len(values)
    if n == 0:
        return 1.0
    observed = abs(statistics.fmean(values)) - 1e-12
    if n <= EXACT_MAX_PAIRS:
        patterns = itertools.product((1, -1), repeat=n)
        total = 2 ** n
    else:
        rng = random.Random(0)
        total = 2 ** EXACT_MAX_PAIRS
        patterns = (tuple(rng.choice((1, -1)) for _ in range(n)) for _ in range(total))
    hits = sum(abs(statistics.fmean(s * v for s, v in zip(signs, values, strict=True))) >= observed
               for signs in patterns)
    return hits / total


def bootstrap_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of ``values``."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(BOOTSTRAP_RESAMPLES))
    return means[int(0.025 * BOOTSTRAP_RESAMPLES)], means[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]


UNUSABLE = "unusable"  # how a row's verdict starts where it has no ratio to judge (ab_serve.unanswered reads it)


@dataclass(frozen=True)
class MetricRow:
    """One metric at one concurrency, paired by repeat. Where its numbers are not all finite (a ratio
    of values too far apart for a float), ``unusable`` says so, the numbers that are not are None
    and the row has no verdict."""

    concurrency: int
    metric: str
    repeats: int
    median_a: float | None
    median_b: float | None
    ratio: float | None  # geometric mean of the paired ratios; > 1: arm B is better (lower latency, higher throughput)
    ci_low: float | None  # 95% bootstrap interval of that geometric mean
    ci_high: float | None
    p_value: float | None  # exact sign-flip test of the paired log-ratios
    unusable: str | None = None  # why the row has no usable ratio; None where it has one
    family: int = 1  # rows judged together with this one (Holm); 1: judged alone (the primary metric)
    p_adjusted: float | None = None  # Holm-adjusted p over ``family`` rows; None: p_value (judged alone)

    @property
    def p_judged(self) -> float | None:
        """The p the verdict reads: Holm-adjusted where the row is judged in a family."""
        return self.p_value if self.p_adjusted is None else self.p_adjusted

    @property
    def verdict(self) -> str:
        """faster / slower only on matching evidence (module docstring); else why there is none."""
        p = self.p_judged
        if self.unusable or self.ratio is None or p is None or self.ci_low is None or self.ci_high is None:
            return f"{UNUSABLE}: {self.unusable or 'no finite ratio'}"
        if no_verdict_reason(self.repeats, self.family):
            return f"no verdict possible at n={self.repeats}" + (
                f" (Holm over {self.family} rows)" if self.family > 1 else "")
        if p >= SIGNIFICANCE:
            return "no difference detected at this n"
        return _judged(self.ratio, self.ci_low, self.ci_high)

    def to_json(self) -> dict[str, Any]:
        """The row as summary.json holds it: standard JSON (no NaN or Infinity), its verdict said."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("unusable", "p_adjusted")}
        return {**fields, "p_adjusted": self.p_judged, "verdict": self.verdict}


def _judged(ratio: float, ci_low: float, ci_high: float) -> str:
    """The verdict of a row whose p is below the level: its direction where the interval agrees
    with the ratio and the effect is large enough to name."""
    if ci_low <= 1.0 <= ci_high:
        return "no verdict: p is below the level, but the 95% CI includes 1x (the test and the interval disagree)"
    if (ratio > 1.0) != (ci_low > 1.0):
        return "no verdict: the ratio lies on the other side of 1x from its 95% CI"
    if abs(math.log(ratio)) < math.log1p(MIN_EFFECT):
        return f"no verdict: effect under {MIN_EFFECT:.0%}"
    return "faster" if ratio > 1 else "slower"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _exp(value: float) -> float:
    """e ** value; an infinity where that is beyond a float."""
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf


def paired_row(concurrency: int, metric: str, higher_better: bool, a: Sequence[float],
               b: Sequence[float]) -> MetricRow:
    """One metric at one concurrency from the arms' per-repeat values (each more than 0 and finite),
    paired by repeat, judged alone; an unusable row (its verdict says why) where a paired ratio or a
    median is beyond what a float holds."""
    ratios = [(y / x if higher_better else x / y) for x, y in zip(a, b, strict=True)]
    median_a, median_b = statistics.median(a), statistics.median(b)
    if all(0 < r < math.inf for r in ratios):  # else a ratio overflowed, or underflowed to 0 (no logarithm)
        logs = [math.log(r) for r in ratios]
        low, high = bootstrap_interval(logs)
        ratio, ci_low, ci_high = _exp(statistics.fmean(logs)), _exp(low), _exp(high)
        if all(math.isfinite(v) and v > 0 for v in (ratio, ci_low, ci_high)) and \
                all(math.isfinite(v) for v in (median_a, median_b)):
            return MetricRow(concurrency, metric, len(ratios), median_a, median_b, ratio, ci_low, ci_high,
                             sign_flip_p(logs))
    why = (f"arm A's values {list(a)} and arm B's {list(b)} are too far apart for a finite paired ratio or median "
           "(no bench measures such times)")
    return MetricRow(concurrency, metric, len(ratios), _finite(median_a), _finite(median_b), None, None, None, None,
                     why)


def judge_together(rows: Sequence[MetricRow]) -> list[MetricRow]:
    """``rows`` (one comparison) as they are judged: PRIMARY_METRIC's rows alone, every other usable
    row with Holm's correction across all of them (unusable rows have no p to correct)."""
    secondary = [i for i, r in enumerate(rows) if r.metric != PRIMARY_METRIC and r.p_value is not None]
    adjusted = holm([rows[i].p_value for i in secondary])  # type: ignore[misc]  # not None: filtered above
    judged = list(rows)
    for index, p in zip(secondary, adjusted, strict=True):
        judged[index] = dataclasses.replace(rows[index], family=len(secondary), p_adjusted=p)
    return judged


def serving_rows(results: dict[str, dict[int, list[dict[str, Any]]]], candidate: str = "B",
                 baseline: str = "A") -> list[MetricRow]:
    """results[arm label][concurrency] = one bench JSON per repeat, in repeat order -> the rows of
    ``candidate`` against ``baseline``, over the repeats both arms completed (a metric either arm
    lacks is left out), judged together (judge_together)."""
    rows = []
    for concurrency in sorted(results.get(baseline, {})):
        runs_a, runs_b = results[baseline][concurrency], results.get(candidate, {}).get(concurrency, [])
        pairs = list(zip(runs_a, runs_b, strict=False))
        for label, key, higher_better in SERVING_METRICS:
            usable = [(x[key], y[key]) for x, y in pairs if key in x and key in y and x[key] > 0 and y[key] > 0]
            if usable:
                a, b = zip(*usable, strict=True)
                rows.append(paired_row(concurrency, label, higher_better, a, b))
    return judge_together(rows)


def _shown(value: float | None, spec: str, unit: str = "") -> str:
    """A table cell: ``value`` formatted, or n/a where the row has none."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _metric_cell(row: MetricRow) -> str:
    """The metric's name, marked where it is the primary metric judged alone."""
    return f"{row.metric} [primary]" if row.metric == PRIMARY_METRIC and row.family == 1 else row.metric


def render_serving(rows: Sequence[MetricRow], candidate: str = "B") -> str:
    """The comparison's table (``candidate`` against A), then each reason a row can give no verdict."""
    lines = [f"| conc | metric | A median | {candidate} median | {candidate} vs A (geo. mean of paired ratios) | "
             "95% CI | p | p adj. | n | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        interval = "n/a" if r.ci_low is None or r.ci_high is None else f"{r.ci_low:.3f}-{r.ci_high:.3f}x"
        lines.append(f"| {r.concurrency} | {_metric_cell(r)} | {_shown(r.median_a, '.2f')} | "
                     f"{_shown(r.median_b, '.2f')} | {_shown(r.ratio, '.3f', 'x')} | {interval} | "
                     f"{_shown(r.p_value, '.3f')} | {_shown(r.p_judged, '.3f')} | {r.repeats} | {r.verdict} |")
    reasons = {no_verdict_reason(r.repeats, r.family) for r in rows}
    lines += [f"\n{reason}" for reason in sorted(reasons - {None})]
    return "\n".join(lines)


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """McNemar's exact test (two-sided): of the questions exactly one arm answered right, is the
    split between the arms more uneven than a fair coin's? The binomial tail of min(b, c) in b + c
    trials at 1/2, doubled, capped at 1."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class PairedAccuracy:
    """Both arms' per-question outcomes on the same questions (lm-eval's --log_samples)."""

    questions: int
    right_a: int
    right_b: int
    only_a: int  # questions arm A answered right and arm B wrong
    only_b: int  # questions arm B answered right and arm A wrong

    @classmethod
    def from_outcomes(cls, a: dict[Any, bool], b: dict[Any, bool]) -> PairedAccuracy:
        """Outcomes keyed by question; only questions both arms answered are compared (the rest
        would be unpaired): ValueError where the arms share none."""
        shared = sorted(set(a) & set(b), key=str)
        if not shared:
            raise ValueError("the arms answered no question in common: nothing to pair")
        return cls(len(shared), sum(a[q] for q in shared), sum(b[q] for q in shared),
                   sum(a[q] and not b[q] for q in shared), sum(b[q] and not a[q] for q in shared))

    @property
    def accuracy_a(self) -> float:
        return self.right_a / self.questions

    @property
    def accuracy_b(self) -> float:
        return self.right_b / self.questions

    @property
    def delta(self) -> float:
        return self.accuracy_b - self.accuracy_a

    @property
    def p_value(self) -> float:
        return mcnemar_exact_p(self.only_a, self.only_b)

    def verdict(self) -> str:
        p = self.p_value
        discordant = self.only_a + self.only_b
        if no_verdict_reason(discordant):
            return (f"no verdict possible: {discordant} of {self.questions} paired questions were answered right by "
                    f"one arm only; {no_verdict_reason(discordant)}")
        if p >= SIGNIFICANCE:
            return (f"no difference detected at this n: McNemar exact p = {p:.4f} (>= {SIGNIFICANCE}) over "
                    f"{self.questions} paired questions")
        direction = "less" if self.delta < 0 else "more"
        return (f"B is {direction} accurate than A: McNemar exact p = {p:.4f} (< {SIGNIFICANCE}); "
                f"{self.only_a} questions only A answered right, {self.only_b} only B")
