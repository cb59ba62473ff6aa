"""Stand-in for vLLM's breakable CUDA-graph capture (``vllm/compilation/breakable_cudagraph.py``,
vLLM 0.29.0-0.33.0) on the GPU machine, which has no vLLM. Written from that module's behaviour,
not its code:

- ``BreakableCUDAGraphCapture``: one active capture per thread (``current()``); it records graph
  segments, and ``add_eager(fn)`` ends the current segment, runs ``fn`` eagerly, keeps it, and
  begins a new segment; ``replay()`` runs the segments in order (graph replays and the kept Python
  calls). Like vLLM's model runner, the caller captures on a side stream.
- ``eager_break_during_capture(fn)``: outside a capture (or between segments) a plain call; inside
  a capture the call becomes an eager break. (vLLM also runs it plainly under a FULL runtime mode and
  weak-references the tensor arguments; neither matters to what is tested here.)

``install`` puts it in ``sys.modules`` under vLLM's module name, where the overlay looks for it."""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

MODULE = "vllm.compilation.breakable_cudagraph"


class BreakableCUDAGraphCapture:
    _tls = threading.local()

    @classmethod
    def current(cls) -> BreakableCUDAGraphCapture | None:
        return getattr(cls._tls, "active", None)

    def __init__(self, pool: Any | None = None) -> None:
        # one memory pool for every segment, as vLLM passes its own
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.segments: list[Callable[[], Any]] = []
        self._current_graph: torch.cuda.CUDAGraph | None = None
        self._capturing = False
        self.num_eager_breaks = 0

    def __enter__(self) -> BreakableCUDAGraphCapture:
        BreakableCUDAGraphCapture._tls.active = self
        self._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._end()
        finally:
            BreakableCUDAGraphCapture._tls.active = None

    def _begin(self) -> None:
        self._current_graph = torch.cuda.CUDAGraph()
        self._current_graph.capture_begin(pool=self.pool)
        self._capturing = True

    def _end(self) -> None:
        assert self._current_graph is not None
        self._current_graph.capture_end()
        self.segments.append(self._current_graph.replay)
        self._current_graph, self._capturing = None, False

    def add_eager(self, fn: Callable[[], Any]) -> Any:
        self._end()
        result = fn()
        self.segments.append(fn)
        self.num_eager_breaks += 1
        self._begin()
        return result

    def replay(self) -> None:
        for segment in self.segments:
            segment()


def eager_break_during_capture(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        capture = BreakableCUDAGraphCapture.current()
        if capture is None or not capture._capturing:
            return fn(*args, **kwargs)
        return capture.add_eager(lambda: fn(*args, **kwargs))

    return wrapper


def install(monkeypatch: Any) -> types.ModuleType:
    module = types.ModuleType(MODULE)
    module.BreakableCUDAGraphCapture = BreakableCUDAGraphCapture  # type: ignore[attr-defined]
    module.eager_break_during_capture = eager_break_during_capture  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, module)
    return module
