"""The one way the overlay's kernels are launched: the config for the launch from the arch's
launch-config table, and the launch itself, which in compile-only mode (``kernels --arch``)
compiles for the named AMD arch and records the result instead of running (for the device's own
target, the sites' ahead-of-time compile, it also loads the result: a launch the device refuses
fails there). A launch (or a site's
ahead-of-time compile) that fails on the table's config degrades that config to the arch's safe one
and raises ``ConfigDegraded`` for the caller to try again (``launch_configs.degrade``); a forced
config (``tune``) and a compile for a named arch are never degraded: their failures are the answer."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.kernels import cache_keys, launch_configs, target

# The KV-cache rows the kernels write start on boundaries of this many bytes (its data pointer and block
# and row strides multiples of it): their launchers check it, the kernels state it to Triton
# (kernels/qk_cache.py), which no longer infers it from the pointer.
CACHE_ALIGNMENT = 16

_forced: ContextVar[dict[str, int] | None] = ContextVar("k3_amd_overlay_forced_config", default=None)
# The table's pick for the launch being prepared: (kernel, arch, GPU name, tokens, heads), for ``degrade``.
_picked: ContextVar[tuple[str, str, str | None, int, int] | None] = ContextVar("k3_amd_overlay_picked",
                                                                               default=None)


@contextlib.contextmanager
def forced(config: dict[str, int]) -> Iterator[None]:
    """Within: every launch takes ``config`` (``tune`` times candidates this way)."""
    token = _forced.set(dict(config))
    try:
        yield
    finally:
        _forced.reset(token)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str | None:
    """The GPU's name as ``tune`` records it (None on CPU)."""
    if device.type != "cuda":
        return None
    return _device_name(torch.cuda.current_device() if device.index is None else device.index)


def config_for(kernel: str, device: torch.device, num_tokens: int, num_heads: int = 1) -> dict[str, int]:
    """The launch config of ``kernel`` for this many tokens and heads on ``device``'s arch."""
    where = target.of(device)
    config = _forced.get()
    _picked.set(None)
    if config is not None:
        amd = where.backend == target.HIP
        return {k: v for k, v in config.items() if amd or k not in launch_configs.AMD_ONLY_OPTIONS}
    session = target.compile_session()
    named_arch = session is not None and session.target is not None
    name = None if named_arch else device_name(device)
    chosen = launch_configs.choose(kernel, where.arch, name, num_tokens, num_heads, amd=where.backend == target.HIP)
    if not named_arch:
        _picked.set((kernel, where.arch, name, num_tokens, num_heads))
    return chosen


def describe(device: torch.device) -> dict[str, Any]:
    """For the marker: the arch, the GPU, where each kernel's launch configs come from, and
    (``error``) the file for this GPU that cannot be used; never raises."""
    where = target.of(device)
    name = device_name(device)
    found: dict[str, Any] = {"arch": where.arch, "device": name}
    try:
        found["kernels"] = launch_configs.sources(where.arch, name)
    except launch_configs.LaunchConfigError as exc:  # the shipped file: every fused Triton kernel refused
        return {**found, "kernels": {}, "error": str(exc)}
    error = launch_configs.startup_error(where.arch, name)
    return {**found, "error": error} if error else found


def _load(compiled: Any) -> None:
    """Load a kernel compiled for this device onto it, as its first launch would (Triton's
    ``CompiledKernel._init_handles``, Triton 3.x): a launch the device refuses (more shared memory
    or threads than it has) fails here, in the ahead-of-time compile, not in a served batch."""
    init_handles = getattr(compiled, "_init_handles", None)
    if callable(init_handles):
        init_handles()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
    """``kernel[grid](*args, **options)``, or its compile for the compile-only target. A failure on
    the table's config degrades it and raises ``ConfigDegraded`` (from the failure) where the safe
    config is left to try; otherwise the failure itself."""
    picked, _ = _picked.get(), _picked.set(None)
    cache_keys.settle()
    session = target.compile_session()
    try:
        if session is None:
            kernel[grid](*args, **options)
        else:
            compiled = kernel.warmup(*args, grid=grid, **options)
            if session.target is None:
                _load(compiled)
            session.compiled.append((kernel.fn.__name__, options, compiled))
    except Exception as exc:
        if picked is None or picked[0] != kernel.fn.__name__:
            raise
        if launch_configs.degrade(*picked, kernel_failures.summary(exc)):
            raise launch_configs.ConfigDegraded(f"{picked[0]}: {kernel_failures.summary(exc)}") from exc
        raise


def check_cache_alignment(kernel: str, cache: torch.Tensor) -> None:
    """Refuse a KV cache whose rows do not start on CACHE_ALIGNMENT-byte boundaries: ``kernel`` stores
    them that many bytes at a time."""
    if any(v % CACHE_ALIGNMENT for v in (cache.data_ptr(), cache.stride(0), cache.stride(1))):
        raise ValueError(f"{kernel}: kv_cache rows must start on {CACHE_ALIGNMENT}-byte boundaries (the kernel stores "
                         f"them {CACHE_ALIGNMENT} bytes at a time): its data pointer is "
                         f"{cache.data_ptr() % CACHE_ALIGNMENT} bytes past one and its block and row strides are "
                         f"{cache.stride()[:2]}; all must be multiples of {CACHE_ALIGNMENT}")
