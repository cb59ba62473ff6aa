"""The statistics of the A/B tables, kept apart from running servers so they are tested on
outcome sets whose answer is known.

Serving: both arms run once per repeat (ABBA order), so repeat r gives a pair (A_r, B_r) per metric.
Each pair's ratio (> 1: B better) is one observation; the table gives each arm's median, the median
paired ratio, a 95% percentile-bootstrap interval of the mean paired log-ratio (10,000 resamples of
the pairs, seeded), and an exact two-sided sign-flip test of the paired log-ratios (every one of the
2^n sign patterns) for the verdict. With n pairs the smallest p an exact test can give is 2 / 2^n:
from 6 repeats on it can fall below 0.05; below that the table says no verdict is possible.

Accuracy: both arms answer the same questions, so the questions only one arm got right decide
(McNemar's exact test); with d such questions its smallest p is 2 / 2^d as well."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from k3_amd_overlay import json_values

SIGNIFICANCE = 0.05  # the two-sided level at which a paired difference is called a difference
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


def unusable_metric(record: Any) -> str | None:
    """Why a saved bench result cannot enter the table, naming the field, or None where it can: a
    JSON object with requests completed, a throughput above 0 and latencies of 0 or more. A metric it
    lacks, NaN where the bench measured none, and a latency of 0 (a time between tokens of outputs
    one token long) are left out of the table; an infinite one has no ratio; no request completed,
    or a throughput of 0, is what an arm whose requests all failed records; a negative one is no
    time."""
    if not isinstance(record, dict):
        return f"it holds {json_values.kind(record)}, not a JSON object"
    if "completed" in record and json_values.whole(record["completed"], least=1) is None:
        return f'"completed" is {record["completed"]!r}: no request completed (every request of the arm failed?)'
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


def pairs_for_a_verdict() -> int:
    """The fewest pairs whose smallest possible p is below SIGNIFICANCE (6 at 0.05)."""
    return next(n for n in itertools.count(1) if smallest_p(n) < SIGNIFICANCE)


def no_verdict_reason(n: int) -> str | None:
    """Why n pairs can never give a verdict, or None where they can."""
    if smallest_p(n) < SIGNIFICANCE:
        return None
    return (f"with n={n} the smallest possible p is {smallest_p(n):.3g}: no verdict possible "
            f"(p < {SIGNIFICANCE} needs n >= {pairs_for_a_verdict()})")


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
    ratio: float | None  # median paired ratio; > 1: arm B is better (lower latency or higher throughput)
    ci_low: float | None  # 95% bootstrap interval of the paired ratio (geometric mean)
    ci_high: float | None
    p_value: float | None  # exact sign-flip test of the paired log-ratios
    unusable: str | None = None  # why the row has no usable ratio; None where it has one

    @property
    def verdict(self) -> str:
        if self.unusable or self.ratio is None or self.p_value is None:
            return f"{UNUSABLE}: {self.unusable or 'no finite ratio'}"
        if no_verdict_reason(self.repeats):
            return f"no verdict possible at n={self.repeats}"
        if self.p_value < SIGNIFICANCE:
            return "faster" if self.ratio > 1 else "slower"
        return "no difference detected at this n"

    def to_json(self) -> dict[str, Any]:
        """The row as summary.json holds it: standard JSON (no NaN or Infinity), its verdict said."""
        fields = {k: v for k, v in asdict(self).items() if k != "unusable"}
        return {**fields, "verdict": self.verdict}


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
    paired by repeat; an unusable row (its verdict says why) where a paired ratio or a median is
    beyond what a float holds."""
    ratios = [(y / x if higher_better else x / y) for x, y in zip(a, b, strict=True)]
    median_a, median_b = statistics.median(a), statistics.median(b)
    if all(0 < r < math.inf for r in ratios):  # else a ratio overflowed, or underflowed to 0 (no logarithm)
        logs = [math.log(r) for r in ratios]
        low, high = bootstrap_interval(logs)
        ratio, ci_low, ci_high = statistics.median(ratios), _exp(low), _exp(high)
        if all(math.isfinite(v) for v in (median_a, median_b, ratio, ci_low, ci_high)):
            return MetricRow(concurrency, metric, len(ratios), median_a, median_b, ratio, ci_low, ci_high,
                             sign_flip_p(logs))
    why = (f"arm A's values {list(a)} and arm B's {list(b)} are too far apart for a finite paired ratio or median "
           "(no bench measures such times)")
    return MetricRow(concurrency, metric, len(ratios), _finite(median_a), _finite(median_b), None, None, None, None,
                     why)


def serving_rows(results: dict[str, dict[int, list[dict[str, Any]]]], candidate: str = "B",
                 baseline: str = "A") -> list[MetricRow]:
    """results[arm label][concurrency] = one bench JSON per repeat, in repeat order -> the rows of
    ``candidate`` against ``baseline``, over the repeats both arms completed (a metric either arm
    lacks is left out)."""
    rows = []
    for concurrency in sorted(results.get(baseline, {})):
        runs_a, runs_b = results[baseline][concurrency], results.get(candidate, {}).get(concurrency, [])
        pairs = list(zip(runs_a, runs_b, strict=False))
        for label, key, higher_better in SERVING_METRICS:
            usable = [(x[key], y[key]) for x, y in pairs if key in x and key in y and x[key] > 0 and y[key] > 0]
            if usable:
                a, b = zip(*usable, strict=True)
                rows.append(paired_row(concurrency, label, higher_better, a, b))
    return rows


def _shown(value: float | None, spec: str, unit: str = "") -> str:
    """A table cell: ``value`` formatted, or n/a where the row has none."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def render_serving(rows: Sequence[MetricRow]) -> str:
    lines = ["| conc | metric | A median | B median | B vs A (paired) | 95% CI | p | n | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        interval = "n/a" if r.ci_low is None or r.ci_high is None else f"{r.ci_low:.3f}-{r.ci_high:.3f}x"
        lines.append(f"| {r.concurrency} | {r.metric} | {_shown(r.median_a, '.2f')} | {_shown(r.median_b, '.2f')} | "
                     f"{_shown(r.ratio, '.3f', 'x')} | {interval} | {_shown(r.p_value, '.3f')} | {r.repeats} | "
                     f"{r.verdict} |")
    lines += [f"\n{reason}" for reason in sorted({no_verdict_reason(r.repeats) for r in rows} - {None})]
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
