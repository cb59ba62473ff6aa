"""Whether each kind of provider can run here, as a reason string (None when it can). Shared by
the ops' ``auto`` choice, the fusions' predicates and the doctor. Never imports vLLM or AITER."""

from __future__ import annotations

import importlib.util
import os

import torch


class ProviderUnavailable(RuntimeError):
    """A provider asked for by name cannot run here; the message says what is missing."""


def triton_missing(device: torch.device) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"triton needs GPU tensors (got {device.type}; TRITON_INTERPRET=1 runs it on CPU)"


def gpu_missing(device: torch.device) -> str | None:
    return None if device.type == "cuda" else f"needs ROCm/CUDA GPU tensors (got {device.type})"


def torch_op_missing(namespace: str, name: str) -> str | None:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return f"torch.ops.{namespace}.{name} is not registered (vLLM registers it on ROCm with AITER on)"
    return None


def first_available(candidates: dict[str, str | None], wanted: str, op: str) -> str:
    """The provider to run: ``wanted`` itself (raising if it cannot run) or, for ``auto``, the
    first candidate with no missing reason."""
    if wanted != "auto":
        if wanted not in candidates:
            raise ValueError(f"{op}: provider {wanted!r} is unknown; allowed: auto, {', '.join(candidates)}")
        if candidates[wanted] is not None:
            raise ProviderUnavailable(f"{op}: provider {wanted!r} is unavailable: {candidates[wanted]}")
        return wanted
    for name, missing in candidates.items():
        if missing is None:
            return name
    reasons = "; ".join(f"{n}: {m}" for n, m in candidates.items())
    raise ProviderUnavailable(f"{op}: no provider can run here ({reasons})")
