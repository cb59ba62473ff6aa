"""How the benchmarks time a launch: the median over CUDA-graph replays (``per_graph`` launches per
graph, so replay overhead is amortised) or eager (Triton's do_bench median), and the device's copy
bandwidth, which with an empty launch floors every kernel's time; several arms timed in rounds taken
in turn (``tune`` and the experiment scripts)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch
import triton


def graph_us(fn: Callable[[], None], per_graph: int = 20, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / per_graph)
    return statistics.median(times)


Arm = TypeVar("Arm", bound=Hashable)


def in_turn(timers: Mapping[Arm, Callable[[], float]], rounds: int = 3) -> dict[Arm, list[float]]:
    """Each arm's readings over ``rounds`` rounds, the arms taken in turn within each round, so that
    the device's drift (clocks, temperature) falls on every arm alike."""
    readings: dict[Arm, list[float]] = {arm: [] for arm in timers}
    for _ in range(rounds):
        for arm, timer in timers.items():
            readings[arm].append(timer())
    return readings


def graphs_in_turn(runs: Mapping[str, Callable[[], None]], rounds: int = 3,
                   per_graph: int = 64) -> dict[str, list[float]]:
    """``in_turn`` of each run's ``graph_us`` (µs, three decimals)."""
    return in_turn({name: (lambda run=run: round(graph_us(run, per_graph=per_graph), 3)) for name, run in runs.items()},
                   rounds)


def per_round(readings: Mapping[str, list[float]], tag: str = "") -> dict[str, float]:
    """``graphs_in_turn``'s readings as the experiment scripts record them: ``{arm}{tag}_{round}``."""
    return {f"{arm}{tag}_{rnd}": us for arm, times in readings.items() for rnd, us in enumerate(times)}


def eager_us(fn: Callable[[], None]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0


def bandwidth_bytes_per_us() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = eager_us(lambda: dst.copy_(src))
    return 2 * src.numel() / us
