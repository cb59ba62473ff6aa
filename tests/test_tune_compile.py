"""``tune``'s compile workers, on a CPU: how the candidates are dealt, what a worker compiles and
under which config (Triton compiling, nothing run), that one job means no workers, that a broken
pool leaves the tuning process to compile as before, and that a run compiles each shape's candidates
(the shipped config first) before it checks and times them. The compile itself, and the tuning
process then compiling nothing new, are proven on a GPU (test_gpu_tune_compile.py)."""

from __future__ import annotations

import concurrent.futures
import typing

import pytest
import torch
from fakes_gpu import no_compile_workers

from k3_amd_overlay import fp8
from k3_amd_overlay.commands import tune, tune_compile
from k3_amd_overlay.kernels import launch, names, target


def test_candidates_are_dealt_round_robin_into_at_most_jobs_non_empty_shares():
    configs = [{"n": i} for i in range(7)]
    assert tune_compile.shares(configs, 3) == [[{"n": 0}, {"n": 3}, {"n": 6}], [{"n": 1}, {"n": 4}], [{"n": 2},
                                                                                                    {"n": 5}]]
    assert tune_compile.shares(configs[:2], 8) == [[{"n": 0}], [{"n": 1}]]
    assert tune_compile.shares(configs, 1) == [configs]
    assert tune_compile.shares([], 4) == []


class CompiledCase:
    """``tune.Case`` without tensors: each run records the config forced on it and whether a compile
    session (the device's own target) was open; configs named in ``failing`` fail to build."""

    made: typing.ClassVar[list[tuple[str, int, int, typing.Any, int]]] = []
    ran: typing.ClassVar[list[tuple[dict[str, int] | None, bool]]] = []
    failing: typing.ClassVar[list[dict[str, int]]] = []

    def __init__(self, kernel, tokens, heads, fmt):
        CompiledCase.made.append((kernel, tokens, heads, fmt, torch.initial_seed()))

        def run():
            config = launch._forced.get()
            session = target.compile_session()
            CompiledCase.ran.append((config, session is not None and session.target is None))
            if config in CompiledCase.failing:
                raise RuntimeError("out of resources")
        self.run = run


def test_a_worker_compiles_each_config_of_its_share_on_its_gpu_and_counts_what_built(monkeypatch):
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(fp8, "device_format", lambda device: fp8.E4M3FNUZ if device == torch.device("cuda", 3)
                        else pytest.fail(f"asked about {device}"))
    monkeypatch.setattr(tune, "Case", CompiledCase)
    CompiledCase.made, CompiledCase.ran, CompiledCase.failing = [], [], [{"BLOCK_N": 64}]
    torch.manual_seed(7)
    share = [{"BLOCK_N": 16}, {"BLOCK_N": 64}, {"BLOCK_N": 128}]
    assert tune_compile.compile_share(names.ABSORB_QK_CACHE_KERNEL, 8, 12, 3, share) == 2
    assert devices == [3]
    assert CompiledCase.made == [(names.ABSORB_QK_CACHE_KERNEL, 8, 12, fp8.E4M3FNUZ, 0)]  # tune's seed
    assert CompiledCase.ran == [(c, True) for c in share]  # each forced, each compiled only
    assert target.compile_session() is None and launch._forced.get() is None  # nothing left open


class FakePool:
    """An executor that runs each share in this process and records it."""

    def __init__(self, broken=False, failing_share=None):
        self.submitted, self.broken, self.shut, self.failing_share = [], broken, False, failing_share

    def submit(self, fn, *args):
        self.submitted.append(args)
        future = concurrent.futures.Future()
        if self.broken:
            future.set_exception(concurrent.futures.process.BrokenProcessPool("a worker died"))
        elif len(self.submitted) - 1 == self.failing_share:
            future.set_exception(torch.OutOfMemoryError("CUDA out of memory"))
        else:
            future.set_result(len(args[-1]) - 1)
        return future

    def shutdown(self, cancel_futures=False):
        self.shut = cancel_futures


def test_one_job_starts_no_worker_and_compiles_nothing_ahead():
    with tune_compile.Compiler(1, 0) as compiler:
        assert compiler.pool is None
        assert compiler.compile(names.QK_CACHE_KERNEL, 8, 12, [{"HEADS": 1, "num_warps": 2}]) is None


def test_the_shares_go_to_the_workers_and_their_counts_add_up(monkeypatch):
    pool = FakePool()
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", lambda jobs, mp_context: pool if jobs == 3 and
                        mp_context.get_start_method() == "spawn" else pytest.fail(f"{jobs} {mp_context}"))
    configs = [{"HEADS": h, "num_warps": 2} for h in (1, 2, 4, 8)]
    with tune_compile.Compiler(3, 5) as compiler:
        assert compiler.compile(names.QK_CACHE_KERNEL, 8, 12, configs) == 4 - 3
    assert pool.submitted == [(names.QK_CACHE_KERNEL, 8, 12, 5, share) for share in tune_compile.shares(configs, 3)]
    assert pool.shut is True and compiler.pool is None


def test_a_broken_pool_leaves_the_compiles_to_the_tuning_process_and_says_so(monkeypatch):
    pool = FakePool(broken=True)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", lambda jobs, mp_context: pool)
    said = []
    with tune_compile.Compiler(2, 0, warn=said.append) as compiler:
        assert compiler.compile(names.QK_CACHE_KERNEL, 8, 12, [{"HEADS": 1}, {"HEADS": 2}]) is None
        assert compiler.pool is None and pool.shut is True
        assert compiler.compile(names.QK_CACHE_KERNEL, 8, 12, [{"HEADS": 1}]) is None  # no pool started again
    assert len(pool.submitted) == 2
    assert len(said) == 1 and said[0].startswith("k3-amd-overlay tune: the compile workers stopped (")
    assert said[0].endswith("the candidates compile in this process from here on, one at a time")


@pytest.mark.parametrize(("cores", "jobs"), [(1, 1), (2, 2), (16, 16), (128, 16)])
def test_the_default_is_the_cores_this_process_may_use_at_most_sixteen(cores, jobs, monkeypatch):
    monkeypatch.setattr(tune_compile.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert tune_compile.default_jobs() == jobs


def test_the_default_counts_the_cores_of_this_process_not_of_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default asks for this process's own affinity (pid 0): the cores ``taskset`` or a container's
    CPU set left it, not another process's (init's, pid 1, may hold every core of the machine)."""
    asked: list[int] = []

    def sched_getaffinity(pid: int) -> set[int]:
        asked.append(pid)
        return set(range(3 if pid == 0 else 64))

    monkeypatch.setattr(tune_compile.os, "sched_getaffinity", sched_getaffinity, raising=False)
    assert tune_compile.default_jobs() == 3 and asked == [0]


@pytest.mark.parametrize(("count", "jobs"), [(None, 1), (1, 1), (8, 8), (64, 16)])
def test_without_affinity_the_default_is_the_cpu_count_at_most_sixteen_or_one_where_unknown(
        count: int | None, jobs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the OS has no CPU affinity (macOS, Windows) the default is ``os.cpu_count()`` capped at
    sixteen, and one job (no workers) where even that is unknown (``None``)."""
    monkeypatch.delattr(tune_compile.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(tune_compile.os, "cpu_count", lambda: count)
    assert tune_compile.default_jobs() == jobs


def test_a_share_that_fails_in_its_worker_is_left_to_the_tuning_process_and_the_pool_kept(monkeypatch):
    pool = FakePool(failing_share=0)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", lambda jobs, mp_context: pool)
    configs = [{"HEADS": h, "num_warps": 2} for h in (1, 2, 4, 8)]
    with tune_compile.Compiler(2, 0) as compiler:
        assert compiler.compile(names.QK_CACHE_KERNEL, 8, 12, configs) == 2 - 1  # the second share's count
        assert compiler.pool is pool and pool.shut is False
    assert pool.shut is True


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.CUDA, "sm90"))
    monkeypatch.setattr(launch, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(fp8, "device_format", lambda device: fp8.E4M3FN)
    no_compile_workers(monkeypatch)


def test_a_run_compiles_each_shapes_candidates_shipped_first_before_checking_them(fake_gpu, monkeypatch, tmp_path):
    events = []

    class Compiler:
        def __init__(self, jobs, device_index):
            events.append(("pool", jobs, device_index))

        def compile(self, kernel, tokens, heads, configs):
            events.append(("compile", kernel, tokens, heads, configs))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append(("closed",))

    class Case:
        def __init__(self, kernel, tokens, heads, fmt):
            events.append(("case", kernel, tokens, heads))

    def tune_case(case, shipped, tried, log):
        events.append(("tune", shipped, list(tried)))
        return shipped, 8.0, 10.0

    monkeypatch.setattr(tune_compile, "Compiler", Compiler)
    monkeypatch.setattr(tune, "Case", Case)
    monkeypatch.setattr(tune, "tune_case", tune_case)
    assert tune.main(["--out", str(tmp_path), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "1", "8", "--heads",
                      "12", "--jobs", "5"]) == 0
    assert events[0] == ("pool", 5, 2) and events[-1] == ("closed",)
    shapes = events[1:-1]
    assert [e[0] for e in shapes] == ["compile", "case", "tune"] * 2
    for (_, kernel, tokens, heads, configs), case, (_, shipped, tried) in zip(shapes[::3], shapes[1::3],
                                                                             shapes[2::3], strict=True):
        assert case == ("case", kernel, tokens, heads)
        assert tried == tune.candidates(kernel, tokens, amd=False)
        assert configs[0] == shipped and sorted(map(str, configs)) == sorted(map(str, [shipped, *(
            c for c in tried if c != shipped)])) and len(configs) == len({str(c) for c in configs})


@pytest.mark.parametrize(("jobs", "pools"), [(["--jobs", "1"], []), ([], [7])], ids=["one job", "default"])
def test_a_run_starts_the_workers_asked_for_and_the_default_count_without_jobs(jobs, pools, fake_gpu, monkeypatch,
                                                                               tmp_path):
    started = []
    monkeypatch.setattr(tune_compile, "default_jobs", lambda: 7)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor",
                        lambda jobs, mp_context: started.append(jobs) or FakePool())
    monkeypatch.setattr(tune, "Case", lambda kernel, tokens, heads, fmt: None)
    monkeypatch.setattr(tune, "tune_case", lambda case, shipped, tried, log: (shipped, 8.0, 10.0))
    assert tune.main(["--out", str(tmp_path), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "8", "--heads",
                      "12", *jobs]) == 0
    assert started == pools


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_jobs_below_one_is_refused_before_any_gpu_work(jobs, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked for a GPU"))
    assert tune.main(["--jobs", jobs]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3-amd-overlay tune: error: --jobs {jobs}: give a positive number of worker processes (1: none)")
