"""How the benchmarks time a launch: the median over CUDA-graph replays (``per_graph`` launches per
graph, so replay overhead is amortised) or eager (Triton's do_bench median), and the device's copy
bandwidth, which with an empty launch floors every kernel's time."""

from __future__ import annotations

import statistics
from collections.abc import Callable

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


def eager_us(fn: Callable[[], None]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0


def bandwidth_bytes_per_us() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = eager_us(lambda: dst.copy_(src))
    return 2 * src.numel() / us
