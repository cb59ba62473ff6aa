"""Helpers for the tests that need a real vLLM: the installed shape, in-process activation, and
running vLLM's own plugin loading in a fresh subprocess."""

from __future__ import annotations

import inspect
import itertools
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cli_process import cli_command

import k3_amd_overlay
from k3_amd_overlay.settings import load_settings

_layer_index = itertools.count(10)


def next_layer_index() -> int:
    return next(_layer_index)


def shape_name() -> str | None:
    from k3_amd_overlay.targets import sources
    from k3_amd_overlay.targets.shapes import recognise

    found = recognise(sources.VllmSources(sources.vllm_root()))
    return found.shape.name if found.shape else None


@contextmanager
def overlay(tmp_path: Path, **variables: str):
    """The overlay active in this process with exactly these K3_AMD_OVERLAY* variables."""
    env = {k: v for k, v in variables.items()}
    env.setdefault("K3_AMD_OVERLAY_MARKER_DIR", str(tmp_path / "markers"))
    activation = k3_amd_overlay.activate(load_settings(env))
    try:
        yield activation
    finally:
        k3_amd_overlay.deactivate()


# Code for run_vllm_process: snapshot() maps the K3 AMD modules' and the MLA wrapper classes' attributes
# to their objects; same(a, b) names those that differ (a patch left behind, or one that never took).
SNAPSHOT = """
import importlib, inspect
import vllm.models.kimi_k3.amd.linear as linear
import vllm.models.kimi_k3.amd.mtp  # the MTP draft model's module (imported for speculative decoding)
import vllm.model_executor.layers.mla as shared
def snapshot():
    objs = {"linear." + k: v for k, v in vars(linear).items()}
    for cls in (shared.MultiHeadLatentAttentionWrapper, getattr(linear, "KimiK3MultiHeadLatentAttentionWrapper", None)):
        if cls is not None:
            objs.update({cls.__name__ + "." + k: v for k, v in vars(cls).items()})
    return objs
def same(a, b):
    return sorted(k for k in set(a) | set(b) if a.get(k) is not b.get(k))
"""


# Code for run_vllm_process: the overlay active in the process, its applied patches and fusion states.
ACTIVE = """
from k3_amd_overlay.activation import active
act = active()
def applied():
    return [a.spec.key for a in act.engine.applied] if act else []
def fusions():
    return {f: (e.state, e.reason) for f, e in act.evidence.record.fusions.items()} if act else {}
"""


PRELUDE = """
import json, os, sys
def result(**values):
    print("RESULT=" + json.dumps(values, default=str), flush=True)
"""


def run_vllm_process(code: str, tmp_path: Path, timeout: float = 300,
                     **variables: str) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    env.update(VLLM_TARGET_DEVICE="cpu", K3_AMD_OVERLAY_MARKER_DIR=str(tmp_path / "markers"), **variables)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT="):
            return proc, json.loads(line[len("RESULT="):])
    return proc, None


def with_real_signature(real: Any, standin: Any) -> Any:
    """``standin`` behind the installed release's real signature of ``real``: a call that would not
    bind on the real function raises its TypeError here too, then the stand-in gets the arguments in
    the real function's order, defaults applied. A lenient stand-in (a default the
    real one lacks) once hid a TypeError on vLLM 0.29-0.30."""
    signature = inspect.signature(real)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return standin(*bound.args, **bound.kwargs)

    call.__signature__ = signature  # type: ignore[attr-defined]
    return call


def run_doctor_process(tmp_path: Path, *args: str, self_test: bool = True,
                       **env_extra: str) -> subprocess.CompletedProcess:
    """``k3-amd-overlay doctor ARGS`` in a fresh process, with exactly these K3_AMD_OVERLAY* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    env.update(VLLM_TARGET_DEVICE="cpu", TRITON_INTERPRET="1", K3_AMD_OVERLAY_MARKER_DIR=str(tmp_path / "markers"),
               **env_extra)
    return subprocess.run(cli_command("doctor", *args, self_test=self_test), env=env, capture_output=True,
                          text=True, timeout=600)
