"""A/B arms for serving and accuracy runs: each arm is a vLLM server started with identical
arguments except ``K3_AMD_OVERLAY``, proved (``k3-amd-overlay check``) to run the path it claims
before anything is measured, and stopped cleanly. Shared by scripts/ab_serve.py and
scripts/gsm8k_ab.py; the statistics of their tables live here too."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3_amd_overlay.settings import MARKER_DIR, SWITCH


@dataclass(frozen=True)
class Arm:
    label: str  # "A" (baseline) or "B" (candidate)
    switch: str  # the K3_AMD_OVERLAY value
    expect: str  # what `check` must prove: "stock" or "fused"


def default_arms(switch_a: str = "stock", switch_b: str = "1") -> tuple[Arm, Arm]:
    def expect(switch: str) -> str:
        return "stock" if switch == "stock" else "fused"

    return Arm("A", switch_a, expect(switch_a)), Arm("B", switch_b, expect(switch_b))


def abba(arms: tuple[Arm, Arm], repeats: int) -> list[tuple[int, Arm]]:
    """(repeat, arm) in alternating order: AB, BA, AB, ... so neither arm always runs first."""
    order = []
    for r in range(repeats):
        pair = arms if r % 2 == 0 else arms[::-1]
        order += [(r, arm) for arm in pair]
    return order


class ArmFailed(RuntimeError):
    """An arm could not be started or proved; the message says where its logs are."""


class Server:
    """One ``vllm serve`` (or stand-in) for one arm, in its own process group."""

    def __init__(self, command: Sequence[str], arm: Arm, workdir: Path, port: int) -> None:
        self.command = list(command)
        self.arm = arm
        self.port = port
        self.workdir = workdir
        self.marker_dir = workdir / "markers"
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != SWITCH}
        env.update({SWITCH: self.arm.switch, MARKER_DIR: str(self.marker_dir)})
        return env

    def start(self, health_timeout: float) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.marker_dir.mkdir(mode=0o700, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=True)
        deadline = time.monotonic() + health_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise ArmFailed(f"arm {self.arm.label}: server exited with {code}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ArmFailed(f"arm {self.arm.label}: not healthy after {health_timeout:.0f} s; log: {self.log_path}")

    def request(self, model: str) -> None:
        """One short completion, so the decode path has run (and marked itself effective)."""
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as response:
            response.read()

    def prove(self) -> str:
        """Run the check against this server's own markers; raise ArmFailed unless it holds."""
        proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay.cli", "check", "--expect", self.arm.expect,
                               "--marker-dir", str(self.marker_dir)], capture_output=True, text=True)
        (self.workdir / "check.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise ArmFailed(f"arm {self.arm.label} ({SWITCH}={self.arm.switch}) is not {self.arm.expect}:\n"
                            f"{proc.stdout.strip()}\nlogs: {self.workdir}")
        return proc.stdout

    def stop(self, grace: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def split_command(text: str) -> list[str]:
    return shlex.split(text)


@contextlib.contextmanager
def proved_server(arm: Arm, serve_cmd: str, model: str, serve_args: str, port: int, workdir: Path,
                  health_timeout: float, served_name: str | None = None) -> Iterator[Server]:
    """One arm's whole lifecycle: start ``serve_cmd MODEL --port PORT SERVE_ARGS`` with only this
    arm's switch differing, wait for health, send one request, prove the arm's path with ``check``;
    the server is stopped however the block ends. ArmFailed says which step failed and where the
    logs are."""
    command = [*split_command(serve_cmd), model, "--port", str(port), *split_command(serve_args)]
    server = Server(command, arm, workdir, port)
    try:
        server.start(health_timeout)
        server.request(served_name or model)
        server.prove()
        yield server
    finally:
        server.stop()


# --- statistics --------------------------------------------------------------------------------

# (label, result key, higher is better) for `vllm bench serve --save-result` JSON
SERVING_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("TTFT p50 (ms)", "median_ttft_ms", False),
    ("TPOT p50 (ms)", "median_tpot_ms", False),
    ("ITL p50 (ms)", "median_itl_ms", False),
    ("ITL p90 (ms)", "p90_itl_ms", False),
    ("E2EL p50 (ms)", "median_e2el_ms", False),
    ("out tok/s", "output_throughput", True),
)


def spread_pct(values: Sequence[float]) -> float:
    """max - min over the repeats, as a percentage of their mean: the ±rng of the serving A/B in
    the vLLM pull request "[ROCm][Kimi-K3][Perf] Fuse MLA decode KV-cache write and Q-prep via AITER"."""
    mean = statistics.fmean(values)
    return 100.0 * (max(values) - min(values)) / mean if mean else 0.0


@dataclass(frozen=True)
class MetricRow:
    concurrency: int
    metric: str
    baseline: float
    fused: float
    ratio: float  # > 1 means the fused arm is better (lower latency or higher throughput)
    spread_a: float
    spread_b: float

    @property
    def inside_noise(self) -> bool:
        return abs(self.ratio - 1.0) * 100.0 <= max(self.spread_a, self.spread_b)


def serving_rows(results: dict[str, dict[int, list[dict[str, Any]]]]) -> list[MetricRow]:
    """results[arm label][concurrency] = one bench JSON per repeat -> the table's rows (means)."""
    rows = []
    for concurrency in sorted(results["A"]):
        for label, key, higher_better in SERVING_METRICS:
            a = [r[key] for r in results["A"][concurrency] if key in r]
            b = [r[key] for r in results["B"].get(concurrency, []) if key in r]
            if not a or not b:
                continue
            mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
            ratio = mean_b / mean_a if higher_better else mean_a / mean_b
            rows.append(MetricRow(concurrency, label, mean_a, mean_b, ratio, spread_pct(a), spread_pct(b)))
    return rows


def render_serving(rows: Sequence[MetricRow]) -> str:
    lines = ["| conc | metric | baseline | fused | ratio | A ±rng | B ±rng | |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.concurrency} | {r.metric} | {r.baseline:.2f} | {r.fused:.2f} | {r.ratio:.3f}x | "
                     f"{r.spread_a:.2f}% | {r.spread_b:.2f}% | {'inside noise' if r.inside_noise else ''} |")
    return "\n".join(lines)


SIGNIFICANCE = 0.05  # the two-sided level at which a paired difference is called a difference


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
        if p >= SIGNIFICANCE:
            return (f"no difference detected at this n: McNemar exact p = {p:.4f} (>= {SIGNIFICANCE}) over "
                    f"{self.questions} paired questions")
        direction = "less" if self.delta < 0 else "more"
        return (f"B is {direction} accurate than A: McNemar exact p = {p:.4f} (< {SIGNIFICANCE}); "
                f"{self.only_a} questions only A answered right, {self.only_b} only B")
