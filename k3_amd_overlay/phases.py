"""Where in a vLLM process's life a fused path runs: inside a CUDA/HIP-graph capture, in one of
vLLM's own dummy or warm-up batches (profile run, compile warm-up, graph warm-up, DP padding), or
on a batch the engine is serving. ``check --expect fused`` counts only the last two as proof."""

from __future__ import annotations

import enum
import sys


class Phase(str, enum.Enum):
    WARMUP = "warmup"  # a dummy batch vLLM runs itself: nothing served went through it
    CAPTURE = "capture"  # recorded into a graph that replays this path for served batches
    SERVED = "served"  # an eager batch the engine scheduled for requests


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


def current_phase() -> Phase:
    if capturing():
        return Phase.CAPTURE
    frame = sys._getframe(1)
    for _ in range(MAX_DEPTH):
        if frame is None:
            break
        if frame.f_code.co_name in WARMUP_FRAMES:
            return Phase.WARMUP
        frame = frame.f_back
    return Phase.SERVED
