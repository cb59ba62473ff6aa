"""How ``tune`` and the benchmarks time a launch (``k3_amd_overlay.commands.bench.timing``), on a CPU through a
fake CUDA runtime (``tests/fakes_gpu.py``): the launch is run once before the capture (so the
capture holds no compile), ``per_graph`` launches are captured in one graph, five untimed replays
warm it, then each timed replay is bracketed by events and the median per launch kept; eager
timing is Triton's median; the copy bandwidth counts both directions."""

from __future__ import annotations

import contextlib
import types

import pytest
from fakes_gpu import FakeEvent, FakeGraph

from k3_amd_overlay.commands.bench import timing


@pytest.fixture
def cuda(monkeypatch):
    log: list[str] = []
    state = {"clock": iter(())}

    @contextlib.contextmanager
    def graph(g):
        log.append("capture")
        yield
        log.append("captured")

    fake = types.SimpleNamespace(
        synchronize=lambda: log.append("sync"),
        CUDAGraph=lambda: FakeGraph(log),
        graph=graph,
        Event=lambda enable_timing=False: (FakeEvent(state["clock"], log) if enable_timing
                                           else pytest.fail("an event without timing")))
    fake_torch = types.SimpleNamespace(cuda=fake, uint8="uint8",
                                       empty=lambda n, dtype, device: types.SimpleNamespace(
                                           numel=lambda: n, dtype=dtype, device=device),
                                       empty_like=lambda t: types.SimpleNamespace(
                                           copy_=lambda src: log.append(f"copy {src.numel()} {src.dtype} on "
                                                                        f"{src.device}")))
    monkeypatch.setattr(timing, "torch", fake_torch)
    return log, state


def test_graph_timing_captures_warms_and_takes_the_median_per_launch(cuda):
    log, state = cuda
    state["clock"] = iter([1.0, 2.0, 100.0, 3.0, 2.5])  # ms per replay of 20 launches: one outlier
    us = timing.graph_us(lambda: log.append("fn"), per_graph=20, reps=5)
    assert us == 125.0  # median of 50, 100, 5000, 150, 125 µs; the mean would be 1085
    timed = ["record", "replay", "record", "event-sync"]
    assert log == ["fn", "sync", "capture", *["fn"] * 20, "captured", *["replay"] * 5, "sync", *timed * 5]


def test_graph_timing_defaults_to_20_launches_a_graph_and_200_replays(cuda):
    log, state = cuda
    state["clock"] = iter([0.2] * 200 + [99.0])
    assert timing.graph_us(lambda: log.append("fn")) == pytest.approx(10.0)
    assert log.count("fn") == 21 and log.count("replay") == 205


def test_eager_timing_is_tritons_median_in_microseconds(monkeypatch):
    asked = []

    def do_bench(fn, warmup, rep, return_mode):
        asked.append((fn, warmup, rep, return_mode))
        return 0.0125

    monkeypatch.setattr(timing.triton.testing, "do_bench", do_bench)

    def fn():
        return None

    assert timing.eager_us(fn) == 12.5
    assert asked == [(fn, 25, 100, "median")]


def test_bandwidth_counts_the_read_and_the_write_of_a_gibibyte_copy(cuda, monkeypatch):
    log, _ = cuda
    monkeypatch.setattr(timing, "eager_us", lambda fn: fn() or 1000.0)
    assert timing.bandwidth_bytes_per_us() == 2 * (1 << 30) / 1000.0
    assert log == [f"copy {1 << 30} uint8 on cuda"]  # a GiB of bytes, on the GPU


def test_scripts_time_their_arms_in_turn_each_round_rounded_and_recorded_per_round(monkeypatch):
    calls = []
    readings = iter([1.23449, 2.0, 1.5, 2.5, 1.1, 2.2])
    monkeypatch.setattr(timing, "graph_us", lambda fn, per_graph: calls.append((fn(), per_graph)) or next(readings))
    got = timing.graphs_in_turn({"a": lambda: "a", "b": lambda: "b"}, per_graph=32)
    assert calls == [("a", 32), ("b", 32)] * 3
    assert got == {"a": [1.234, 1.5, 1.1], "b": [2.0, 2.5, 2.2]}
    assert timing.per_round(got, "_g32") == {"a_g32_0": 1.234, "a_g32_1": 1.5, "a_g32_2": 1.1,
                                             "b_g32_0": 2.0, "b_g32_1": 2.5, "b_g32_2": 2.2}
    calls.clear()
    readings = iter([4.0])
    assert timing.graphs_in_turn({"a": lambda: "a"}, rounds=1) == {"a": [4.0]} and calls == [("a", 64)]
