"""Compile ``tune``'s candidates in worker processes before they are checked and timed.

Compiling is most of a tune's time (on an H100 over 1.9 s a candidate at 256 tokens, where a graph
replay of one takes microseconds), and Triton compiles one config at a time on one core. Each worker
(a spawned process on the same GPU) builds the shape's inputs and compiles its share of the
candidates without running them, which leaves each compiled kernel in Triton's on-disk cache; the
tuning process then finds it there at its first launch of that config. Nothing here decides
anything: a candidate a worker could not compile is compiled (and fails) again in the tuning
process, which skips it as before, and a worker that dies costs only the time it would have saved.

Workers are spawned, so each imports the module that started the tune afresh: the command line is
safe; a script of its own that calls ``tune.main`` must do so under ``if __name__ == "__main__":``,
or its workers break at start (the tune then compiles in its own process, and says so)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

# The most workers a default run starts: the count measured (on a 16-core H100 machine, 2026-12-06, a
# shape's candidates compiled 3.9x faster in 16 workers than in the tuning process alone).
DEFAULT_JOBS_MAX = 16


def default_jobs() -> int:
    """The cores this process may run on, at most ``DEFAULT_JOBS_MAX``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(DEFAULT_JOBS_MAX, cores))


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def shares(configs: Sequence[dict[str, int]], jobs: int) -> list[list[dict[str, int]]]:
    """``configs`` dealt round-robin into at most ``jobs`` non-empty shares (neighbouring candidates,
    alike in size and compile time, go to different workers)."""
    dealt: list[list[dict[str, int]]] = [[] for _ in range(max(1, min(jobs, len(configs))))]
    for i, config in enumerate(configs):
        dealt[i % len(dealt)].append(config)
    return [share for share in dealt if share]


def compile_share(kernel: str, tokens: int, heads: int, device_index: int, configs: list[dict[str, int]]) -> int:
    """In a worker: compile (not run) ``kernel`` at ``tokens`` and ``heads`` under each of ``configs`` on
    GPU ``device_index``; how many compiled."""
    import torch

    from k3_amd_overlay.commands.tune import Case
    from k3_amd_overlay.fp8 import device_format
    from k3_amd_overlay.kernels import target
    from k3_amd_overlay.kernels.launch import forced

    torch.cuda.set_device(device_index)
    torch.manual_seed(0)  # the tuning process's inputs, so that Triton specialises the same way
    case = Case(kernel, tokens, heads, device_format(torch.device("cuda", device_index)))
    built = 0
    with target.compile_only(None):
        for config in configs:
            try:
                with forced(config):
                    case.run()
            except Exception:  # the tuning process meets the same failure and skips the candidate
                continue
            built += 1
    return built


class Compiler:
    """A pool of ``jobs`` spawned workers on GPU ``device_index``, each holding a GPU context beside the
    tuning process's (none for one job: the tuning process compiles as it launches)."""

    def __init__(self, jobs: int, device_index: int, warn: Callable[[str], None] = _to_stderr) -> None:
        self.device_index = device_index
        self.warn = warn
        self.pool: concurrent.futures.Executor | None = None
        if jobs > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        self.jobs = jobs

    def compile(self, kernel: str, tokens: int, heads: int, configs: Sequence[dict[str, int]]) -> int | None:
        """Compile ``configs`` across the workers and wait for them: how many compiled (None without
        workers, or where the pool broke). What a worker did not compile, the tuning process compiles
        itself at its first launch."""
        if self.pool is None:
            return None
        futures = [self.pool.submit(compile_share, kernel, tokens, heads, self.device_index, share)
                   for share in shares(configs, self.jobs)]
        built = 0
        for future in futures:
            try:
                built += future.result()
            except concurrent.futures.process.BrokenProcessPool as exc:
                self.warn(f"k3-amd-overlay tune: the compile workers stopped ({exc}); the candidates compile in "
                          "this process from here on, one at a time")
                self.close()
                return None
            except Exception:  # a share whose inputs the worker could not build (its GPU memory, say)
                continue
        return built

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
