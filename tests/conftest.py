"""Test session setup (tests/machine.py decides GPU or interpreter, vLLM or not) and the fixtures
shared across test files: the AITER stand-in and the real-vLLM layer session."""

import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiter_standin import AiterStandIn
from machine import HAS_GPU, HAS_VLLM


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU: run scripts/gpu_check.sh on the GPU machine")
    skip_vllm = pytest.mark.skip(reason="needs a real vLLM: run through scripts/run_tests.sh (one venv per vLLM)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not HAS_VLLM:
            item.add_marker(skip_vllm)


@pytest.fixture(autouse=True)
def no_exit_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Evidence made by a test registers its marker's exit flush; by the interpreter's exit the
    test's directory is gone, so the flush would only print failures. Tests see the registration
    through this stand-in ``atexit`` instead."""
    from k3_amd_overlay import evidence

    monkeypatch.setattr(evidence, "atexit", types.SimpleNamespace(register=lambda function: None))


@pytest.fixture
def aiter_triton(monkeypatch: pytest.MonkeyPatch) -> Any:
    """AMD's AITER Triton kernels, callable here (``k3_amd_overlay.bench.aiter_peers``), with the
    overlay's AITER providers let onto this GPU; skips with the reason where they are not."""
    from k3_amd_overlay.bench import aiter_peers
    from k3_amd_overlay.ops import aiter_absorb

    if not HAS_GPU:
        pytest.skip("AITER's Triton kernels need a GPU")
    why = aiter_peers.enable()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(aiter_absorb, "device_missing", lambda device: None)  # on ROCm it is None anyway
    return aiter_peers


@pytest.fixture
def aiter_standin(monkeypatch: pytest.MonkeyPatch) -> Callable[..., AiterStandIn]:
    """``aiter_standin(version=..., fmt=...)``: AITER's op replaced by the stand-in
    (tests/aiter_standin.py) for this test; everything it changed is undone after it."""

    def install(**kwargs: Any) -> AiterStandIn:
        return AiterStandIn(**kwargs).install(monkeypatch)

    return install


@pytest.fixture(scope="session")
def vllm_layer_session() -> Iterator[None]:
    """The vLLM config, process group and CPU attention core that tests/layer_harness.py builds
    layers in, opened once per session and closed (every change undone) at its end."""
    if not HAS_VLLM:
        yield
        return
    import layer_harness

    with layer_harness.session():
        yield
