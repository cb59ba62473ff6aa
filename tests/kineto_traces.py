"""Kineto-shaped profiler traces built in the census tests: kernels linked to their launches (a
runtime event on the CPU thread) by correlation id, optionally inside the overlay's ranges."""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Blocks = list[tuple[str | None, list[str]]]


def kernel_trace(path: Path, kernels: dict[str, int], **fields: Any) -> Path:
    """A chrome trace of GPU kernels alone, no launches: each name ``count`` launches of 2 µs; ``fields``
    are the trace's other top-level keys (``distributedInfo``, ``deviceProperties``)."""
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": i, "dur": 2.0}
              for name, count in kernels.items() for i in range(count)]
    path.write_text(json.dumps({"traceEvents": events, **fields}))
    return path


# A kernel no fusion touches (the census's table claims none of it): vLLM's MLA attention kernel on
# ROCm, one launch per layer step in both arms of a comparison, as in every serving trace.
ATTENTION = "mla_a8w8_decode_kernel"


def with_kernels(source: Path, path: Path, kernels: dict[str, int]) -> Path:
    """A copy at ``path`` of the trace at ``source`` (``.json`` or ``.json.gz``) with ``kernels`` added,
    each name ``count`` launches of 2 µs without a launch event (as graph-replayed kernels): a committed
    trace of the fused region alone, given the model's other work a profiled serving window holds."""
    raw = source.read_bytes()
    data = json.loads(gzip.decompress(raw) if source.name.endswith(".gz") else raw)
    data["traceEvents"] += [{"ph": "X", "cat": "kernel", "name": name, "ts": 10.0**9 + i, "dur": 2.0}
                            for name, count in kernels.items() for i in range(count)]
    path.write_text(json.dumps(data))
    return path


def ranged_events(steps: list[Blocks], ranges: bool = True,
                  durations: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Per step, blocks of (overlay range or None, kernels launched in it): the trace's events. Each
    kernel runs ``durations[name]`` µs (2.0 for a name not given)."""
    events: list[dict[str, Any]] = []
    t, corr = 0.0, 0
    for blocks in steps:
        for region_name, kernels in blocks:
            start = t
            for name in kernels:
                corr += 1
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                               "ts": t + 1, "dur": 1, "args": {"correlation": corr}})
                events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": t + 3,
                               "dur": (durations or {}).get(name, 2.0),
                               "args": {"correlation": corr}})
                t += 4
            if region_name and ranges:
                events.append({"ph": "X", "cat": "user_annotation", "name": region_name, "pid": 1, "tid": 1,
                               "ts": start, "dur": t - start})
            t += 1
    return events
