"""The one way the overlay's kernels are launched: the config for the launch from the arch's
launch-config table, and the launch itself, which in compile-only mode (``kernels --arch``)
compiles for the named AMD arch and records the result instead of running."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from k3_amd_overlay.kernels import launch_configs, target

_forced: ContextVar[dict[str, int] | None] = ContextVar("k3_amd_overlay_forced_config", default=None)


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
    if config is not None:
        amd = where.backend == target.HIP
        return {k: v for k, v in config.items() if amd or k not in launch_configs.AMD_ONLY_OPTIONS}
    session = target.compile_session()
    name = None if session is not None and session.target is not None else device_name(device)
    return launch_configs.choose(kernel, where.arch, name, num_tokens, num_heads, amd=where.backend == target.HIP)


def describe(device: torch.device) -> dict[str, Any]:
    """For the marker: the arch, the GPU, and where each kernel's launch configs come from."""
    where = target.of(device)
    name = device_name(device)
    return {"arch": where.arch, "device": name, "kernels": launch_configs.sources(where.arch, name)}


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
    """``kernel[grid](*args, **options)``, or its compile for the compile-only target."""
    session = target.compile_session()
    if session is None:
        kernel[grid](*args, **options)
    else:
        session.compiled.append((kernel.fn.__name__, options, kernel.warmup(*args, grid=grid, **options)))
