"""Every overlay kernel's Triton cache key worked out in one order, once per process, before its first
launch. On an H100 with Triton 3.6 (2026-12-07) a kernel's on-disk cache key in a process depended on
which kernels' keys that process had worked out before, with the same source, TTIR and options: a
fresh ``tune`` compile worker (the kernel its first) and the tuning process (other kernels launched
before) missed each other's compiles, and every process that launched the kernels in another order
compiled them again. Worked out in one order first, the keys are the same in every process."""

from __future__ import annotations

import functools
import importlib

# The modules holding the overlay's @triton.jit functions, in the order their keys are worked out.
KERNEL_MODULES = ("rounding", "qk_cache", "rmsnorm_pair", "static_quant", "absorb_qk_cache", "absorb_fp8_qk_cache",
                  "absorb_mxfp4_qk_cache")


@functools.cache
def settle() -> int:
    """Work out the cache key of every Triton function the kernel modules define (by module, then by
    name); how many."""
    count = 0
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"k3_amd_overlay.kernels.{name}")
        for _, value in sorted(vars(module).items()):
            if getattr(value, "__module__", None) == module.__name__ and isinstance(
                    getattr(type(value), "cache_key", None), property):
                value.cache_key  # noqa: B018 -- the property works the key out and keeps it
                count += 1
    return count
