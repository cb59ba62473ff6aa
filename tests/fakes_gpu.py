"""Fakes for the decisions the overlay makes only on a GPU, so a CPU test can reach them: a CUDA
runtime that answers device names and indices (and counts the questions), a Triton JIT function
that records its launches and compiles (and fails those a test plants), a timer whose answers are
scripted per config, and a CUDA graph and events whose elapsed times are scripted. And
``no_compile_workers``: a ``tune`` run on a faked GPU starts no spawned compile worker by default."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any


class FakeCuda:
    """Stands in for ``torch.cuda``'s device queries: ``names[index]`` is the GPU at that index."""

    def __init__(self, names: dict[int, str], current: int = 0) -> None:
        self.names, self.current, self.asked = names, current, []

    def get_device_name(self, index: int) -> str:
        self.asked.append(index)
        return self.names[index]

    def current_device(self) -> int:
        return self.current


class FakeJit:
    """A Triton JIT function: ``kernel[grid](*args, **options)`` runs (recorded in ``runs``);
    ``kernel.warmup(*args, grid=..., **options)`` compiles (recorded in ``warmups``, returns a token)."""

    class _Fn:
        def __init__(self, name: str) -> None:
            self.__name__ = name

    class Compiled:
        """A compiled kernel whose load onto the device (``_init_handles``) raises ``error``, if any."""

        def __init__(self, token: str, error: BaseException | None) -> None:
            self.token, self.error, self.loads = token, error, 0

        def _init_handles(self) -> None:
            self.loads += 1
            if self.error is not None:
                raise self.error

    def __init__(self, name: str, fails: Callable[[dict[str, Any]], BaseException | None] | None = None,
                 load_fails: Callable[[dict[str, Any]], BaseException | None] | None = None) -> None:
        self.fn = self._Fn(name)
        self.fails = fails  # options -> the error Triton raises for them (None: it builds)
        self.load_fails = load_fails  # options -> the error loading their compile raises (set: warmup gives Compiled)
        self.runs: list[tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]] = []
        self.warmups: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.refused: list[dict[str, Any]] = []  # options of each compile or launch that raised

    def _check(self, options: dict[str, Any]) -> None:
        error = self.fails(options) if self.fails is not None else None
        if error is not None:
            self.refused.append(options)
            raise error

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def run(*args: Any, **options: Any) -> None:
            self._check(options)
            self.runs.append((grid, args, options))
        return run

    def warmup(self, *args: Any, **options: Any) -> Any:
        self._check(options)
        self.warmups.append((args, options))
        token = f"compiled-{len(self.warmups)}"
        return token if self.load_fails is None else self.Compiled(token, self.load_fails(options))


def config_key(config: dict[str, int] | None) -> tuple[tuple[str, int], ...] | None:
    return None if config is None else tuple(sorted(config.items()))


class ScriptedTimer:
    """``time_us(run, config)``: each config's answers in turn (its list's last one repeated), every
    call recorded in order; a config without a script is a test error."""

    def __init__(self, script: dict[tuple[tuple[str, int], ...] | None, Iterable[float]]) -> None:
        self.script = {key: list(values) for key, values in script.items()}
        self.calls: list[tuple[tuple[str, int], ...] | None] = []
        self._next = {key: itertools.count() for key in self.script}

    def __call__(self, run: Callable[[], None], config: dict[str, int] | None) -> float:
        key = config_key(config)
        self.calls.append(key)
        values = self.script[key]
        return values[min(next(self._next[key]), len(values) - 1)]


class FakeEvent:
    """``torch.cuda.Event``: ``elapsed_time`` answers the next scripted milliseconds."""

    def __init__(self, clock: Iterable[float], log: list[str]) -> None:
        self.clock, self.log = clock, log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("event-sync")

    def elapsed_time(self, end: FakeEvent) -> float:
        return next(self.clock)


class FakeGraph:
    """``torch.cuda.CUDAGraph``: a capture records the calls made inside it; replay counts."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def replay(self) -> None:
        self.log.append("replay")


def no_compile_workers(monkeypatch: Any) -> None:
    """``tune``'s default ``--jobs`` as 1 (its workers would meet no GPU here, only cost a spawn)."""
    from k3_amd_overlay.commands import tune_compile

    monkeypatch.setattr(tune_compile, "default_jobs", lambda: 1)
