"""The profiler ranges the overlay opens around the regions its fusions replace, wherever it installs
a site (in stock mode too, around vLLM's own calls: both ranges on every release; on 0.29, whose
shared forward calls the two norms itself, one qkv_norm range per norm call), so the kernel census
can count a fusion's kernels by where they were launched instead of by name alone: q_a/kv_a norms,
not every RMSNorm; the W_UK GEMM, not every GEMM. Opened only while a torch profiler records (one C
call to ask), so serving pays nothing. Imports no torch: the census reads the names without it."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

REGION_PREFIX = "k3_amd_overlay::"
QKV_NORM_REGION = f"{REGION_PREFIX}qkv_norm"  # one layer's q_a and kv_a RMSNorms (stock: two launches, fused: one)
DECODE_REGION = f"{REGION_PREFIX}mla_decode"  # one MLA attention call on a K3 layer (stock or fused decode)


def region(name: str) -> Any:
    """A ``record_function`` range named ``name`` while a profiler records, else a no-op (and under
    torch.compile tracing, which cannot trace the question)."""
    torch = sys.modules.get("torch")
    if torch is None or torch.compiler.is_compiling() or not torch._C._autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)
