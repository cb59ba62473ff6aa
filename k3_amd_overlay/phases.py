"""Where in a vLLM process's life a fused path runs: inside a CUDA/HIP-graph capture, in one of
vLLM's own dummy or warm-up batches (profile run, compile warm-up, kernel warm-up, graph warm-up,
DP padding, a drafter's dummy run), on a batch the engine is serving, or in a replay of a graph
whose capture recorded it. ``check --expect fused`` counts only served batches and replays as
proof: a capture alone happens at startup, before any request.

The phase is the phase of the engine step that runs the batch, read from the thread that runs the
step (vLLM's worker or model runner, 0.29-0.33): served only where a step method that serves the
scheduler's batches (``execute_model``, ``sample_tokens``, and for the model runner V2 only with
its ``dummy_run`` argument false) is running and none of vLLM's own batch-making methods is. A
thread that runs part of a step for another thread (dual-batch overlap: ``UBatchWrapper`` in
vllm/v1/worker/gpu_ubatch_wrapper.py, ``UBatchRunner`` in vllm/v1/worker/gpu/ubatch_utils.py)
takes the phase of the thread that started it and waits for it. Anything else is not served:
the phase fails closed. vLLM's forward context carries no mark of a dummy batch in 0.29-0.33
(``create_forward_context`` takes the same fields from ``_dummy_run`` as from ``execute_model``,
and the microbatch contexts are made afresh with ``CUDAGraphMode.NONE``), so the step's own
methods are the only statement vLLM makes of it."""

from __future__ import annotations

import dataclasses
import enum
import sys
import threading
from collections.abc import Iterator
from typing import Any


class Phase(str, enum.Enum):
    WARMUP = "warmup"  # a dummy batch vLLM runs itself, or one no served step can be shown to run
    CAPTURE = "capture"  # recorded into a graph that replays this path for served batches
    SERVED = "served"  # an eager batch the engine scheduled for requests
    REPLAY = "replay"  # a replay of a graph that recorded the fused path, for a batch the engine scheduled


# vLLM's model-runner and worker methods (v1/worker/, 0.29-0.33) that run batches of their own
# making; any of them in the step makes the batch a warm-up batch. Read, never patched. ``dummy_run``
# is the drafters' (v1/spec_decode/: EAGLE/MTP, draft model, DFlash, Medusa...): the V1 model runner
# calls it from ``_dummy_run`` and, with data parallelism, from ``sample_tokens`` on a batch of one
# token that keeps the ranks in step; no served path has that name.
WARMUP_FRAMES = frozenset({
    "_dummy_run", "profile_run", "capture_model", "_warmup_and_capture", "_capture_cudagraphs",
    "warming_up_model", "compile_or_warm_up_model", "execute_dummy_batch", "profile_cudagraph_memory",
    "warmup", "capture", "warmup_kernels", "run_mixed_prefill_decode_warmup", "dummy_run",
})
# The worker's and model runners' methods that run the scheduler's batch (the forward in
# ``execute_model``, the speculative proposer in ``sample_tokens``).
SERVED_FRAMES = frozenset({"execute_model", "sample_tokens"})
# The model runner V2 runs its dummy batches through ``execute_model`` with this argument true.
DUMMY_RUN_ARGUMENT = "dummy_run"
MAX_STARTERS = 4  # a thread started by a thread started by ...: more is no layout vLLM has
JOIN_CODE = threading.Thread.join.__code__


class Step(str, enum.Enum):
    WARMUP = "warmup"
    SERVED = "served"
    UNKNOWN = "unknown"


def capturing() -> bool:
    """A CUDA/HIP graph is being captured on the current stream (False without a GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def _walk(frame: Any) -> Iterator[Any]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _holds(value: Any, thread: threading.Thread) -> bool:
    if value is thread:
        return True
    return isinstance(value, (list, tuple)) and any(item is thread for item in value)


def _joining(top: Any) -> bool:
    return any(frame.f_code is JOIN_CODE for frame in _walk(top))


def _starter(thread: threading.Thread) -> tuple[int, Any] | None:
    """The id and current frame of the thread that started ``thread`` and waits for it: it is in
    ``Thread.join`` and holds ``thread`` in a running frame (vLLM's microbatch runners keep the threads
    they start, alone or in a list, and join them one after another), or None."""
    for ident, top in sys._current_frames().items():
        if ident == thread.ident or not _joining(top):
            continue
        for frame in _walk(top):
            if any(_holds(value, thread) for value in frame.f_locals.values()):
                return ident, top
    return None


def _starters() -> Iterator[Any]:
    """The current frame of the thread that started this one and waits for it, of the one that
    started that one, and so on."""
    thread = threading.current_thread()
    seen = {thread.ident}
    for _ in range(MAX_STARTERS):
        found = _starter(thread)
        if found is None or found[0] in seen:
            return
        ident, top = found
        seen.add(ident)
        yield top
        thread = next((t for t in threading.enumerate() if t.ident == ident), None)
        if thread is None:
            return


def _stacks(frame: Any) -> Iterator[Any]:
    """This thread's frames from ``frame`` up, then those of the threads that started it."""
    yield from _walk(frame)
    for top in _starters():
        yield from _walk(top)


def _own_step(frame: Any) -> Step:
    served = False
    for f in _walk(frame):
        name = f.f_code.co_name
        if name in WARMUP_FRAMES:
            return Step.WARMUP
        if name in SERVED_FRAMES:
            if f.f_locals.get(DUMMY_RUN_ARGUMENT):
                return Step.WARMUP
            served = True
    return Step.SERVED if served else Step.UNKNOWN


def step_of(frame: Any) -> Step:
    """The step running at ``frame``: WARMUP where one of vLLM's batch-making methods (or the model
    runner V2's ``execute_model`` with ``dummy_run`` true) runs it, SERVED where only a serving step
    method does, UNKNOWN where neither is found (not served). A thread in no step of its own (a
    microbatch thread) takes the step of the thread that started it."""
    step = _own_step(frame)
    if step is not Step.UNKNOWN:
        return step
    for top in _starters():
        step = _own_step(top)
        if step is not Step.UNKNOWN:
            return step
    return Step.UNKNOWN


def current_phase() -> Phase:
    if capturing():
        return Phase.CAPTURE
    return Phase.SERVED if step_of(sys._getframe(1)) is Step.SERVED else Phase.WARMUP


def replay_phase() -> Phase:
    """The phase of a graph replay made by the caller's caller: a replay for a served step, or not."""
    return Phase.REPLAY if step_of(sys._getframe(2)) is Step.SERVED else Phase.WARMUP


def _graph_in(frame: Any, graph_type: type) -> Any:
    values = list(frame.f_locals.values())
    for value in values:
        if isinstance(value, graph_type):
            return value
    for value in values:  # a holder of the graph being captured (UBatchWrapper's CUDAGraphMetaData)
        if dataclasses.is_dataclass(value) and isinstance(getattr(value, "cudagraph", None), graph_type):
            return value.cudagraph
    return None


def capturing_graph() -> Any:
    """The ``torch.cuda.CUDAGraph`` recording the current stream, or None where it cannot be found.
    vLLM's own capture code holds it: a local of the capturing frame (``CUDAGraphWrapper.__call__``
    in vllm/compilation/cuda_graph.py; the model runner V2's capture in
    vllm/v1/worker/gpu/cudagraph_utils.py; 0.29-0.33), the current segment of a breakable capture
    (``BreakableCUDAGraphCapture`` in vllm/compilation/breakable_cudagraph.py), or, for a batch run
    in a dual-batch-overlap thread, the frame of the thread that started it and captures
    (``UBatchWrapper._capture_ubatches`` holds it in its ``CUDAGraphMetaData``)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    graph_type = torch.cuda.CUDAGraph
    breakable = sys.modules.get("vllm.compilation.breakable_cudagraph")
    if breakable is not None:
        capture = breakable.BreakableCUDAGraphCapture.current()
        if capture is not None and isinstance(getattr(capture, "_current_graph", None), graph_type):
            return capture._current_graph
    for frame in _stacks(sys._getframe(1)):
        graph = _graph_in(frame, graph_type)
        if graph is not None:
            return graph
    return None
