"""What a kernel launch is built for: the backend (``hip``, ``cuda`` or Triton's CPU
``interpreter``) and the GPU arch (``gfx942``, ``gfx950``, ``sm90``, ...), from the tensors'
device; and the compile-only mode in which ``kernels --arch`` builds AMD code objects on a machine
without an AMD GPU (each launch compiles for the named arch and hands back the compiled kernel
instead of running it)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from k3_amd_overlay.kernels.launch_configs import INTERPRETER_ARCH

HIP = "hip"
CUDA = "cuda"
INTERPRETER = "interpreter"


@dataclass(frozen=True)
class Target:
    backend: str  # HIP, CUDA or INTERPRETER
    arch: str  # gfx942, sm90, ...; INTERPRETER_ARCH under the interpreter

    @property
    def gpu(self) -> bool:
        return self.backend != INTERPRETER


@dataclass
class CompileOnly:
    """Launches compile for ``target`` (None: their device's own) and are recorded here, not run."""

    target: Target | None
    compiled: list[tuple[str, dict[str, Any], Any]] = field(default_factory=list)  # (kernel, options, result)


_compile_only: ContextVar[CompileOnly | None] = ContextVar("k3_amd_overlay_compile_only", default=None)


def arch_of(device: torch.device) -> str:
    """The GPU arch of a CUDA/HIP ``device`` as the launch configs name it: gfx942 (the part of
    ROCm's ``gcnArchName`` before its feature flags) or sm90 (CUDA capability 9.0)."""
    return _arch_of_index(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _arch_of_index(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        return str(props.gcnArchName).split(":")[0]
    return f"sm{props.major}{props.minor}"


def of(device: torch.device) -> Target:
    """The target a launch on ``device`` is built for (the compile-only target while one is set)."""
    session = _compile_only.get()
    if session is not None and session.target is not None:
        return session.target
    if device.type != "cuda":
        return Target(INTERPRETER, INTERPRETER_ARCH)
    return Target(HIP if torch.version.hip is not None else CUDA, arch_of(device))


def compile_session() -> CompileOnly | None:
    return _compile_only.get()


@contextlib.contextmanager
def compile_only(arch: str | None) -> Iterator[CompileOnly]:
    """Within: every launch compiles and is collected, nothing runs: for AMD ``arch`` (Triton's
    active driver must answer that target: ``compile_report`` sets it), or, with None, for the
    device the launch's tensors are on."""
    session = CompileOnly(None if arch is None else Target(HIP, arch))
    token = _compile_only.set(session)
    try:
        yield session
    finally:
        _compile_only.reset(token)
