"""Where in a vLLM process's life a fused path runs: inside a CUDA/HIP-graph capture, in one of
vLLM's own dummy or warm-up batches (profile run, compile warm-up, graph warm-up, DP padding), on
a batch the engine is serving, or in a replay of a graph whose capture recorded it. ``check
--expect fused`` counts only served batches and replays outside vLLM's warm-up as proof: a capture
alone happens at startup, before any request."""

from __future__ import annotations

import enum
import sys
from typing import Any


class Phase(str, enum.Enum):
    WARMUP = "warmup"  # a dummy batch vLLM runs itself: nothing served went through it
    CAPTURE = "capture"  # recorded into a graph that replays this path for served batches
    SERVED = "served"  # an eager batch the engine scheduled for requests
    REPLAY = "replay"  # a replay of a graph that recorded the fused path, for a batch the engine scheduled


# vLLM's model-runner and worker methods (v1/worker/, 0.29-0.33) that run batches of their own
# making; any of them on the stack makes the batch a warm-up batch. Read, never patched.
WARMUP_FRAMES = frozenset({
    "_dummy_run", "profile_run", "capture_model", "_warmup_and_capture", "_capture_cudagraphs",
    "warming_up_model", "compile_or_warm_up_model", "execute_dummy_batch", "profile_cudagraph_memory",
    "warmup", "capture",
})
MAX_DEPTH = 80


def capturing() -> bool:
    """A CUDA/HIP graph is being captured on the current stream (False without a GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def in_warmup(frame: Any) -> bool:
    """One of vLLM's own batch-making methods is on the stack at or above ``frame``."""
    for _ in range(MAX_DEPTH):
        if frame is None:
            break
        if frame.f_code.co_name in WARMUP_FRAMES:
            return True
        frame = frame.f_back
    return False


def current_phase() -> Phase:
    if capturing():
        return Phase.CAPTURE
    return Phase.WARMUP if in_warmup(sys._getframe(1)) else Phase.SERVED


def capturing_graph() -> Any:
    """The ``torch.cuda.CUDAGraph`` recording the current stream, or None where it cannot be found.
    vLLM's own capture code holds it: a local of the capturing frame (``CUDAGraphWrapper.__call__``
    in vllm/compilation/cuda_graph.py; the model runner V2's capture in
    vllm/v1/worker/gpu/cudagraph_utils.py; 0.29-0.33), or the current segment of a breakable capture
    (``BreakableCUDAGraphCapture`` in vllm/compilation/breakable_cudagraph.py)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    graph_type = torch.cuda.CUDAGraph
    breakable = sys.modules.get("vllm.compilation.breakable_cudagraph")
    if breakable is not None:
        capture = breakable.BreakableCUDAGraphCapture.current()
        if capture is not None and isinstance(getattr(capture, "_current_graph", None), graph_type):
            return capture._current_graph
    frame = sys._getframe(1)
    for _ in range(MAX_DEPTH):
        if frame is None:
            break
        for value in frame.f_locals.values():
            if isinstance(value, graph_type):
                return value
        frame = frame.f_back
    return None
