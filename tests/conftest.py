"""Test session setup: on a machine without a GPU the overlay's Triton kernels run under the
Triton interpreter (set before anything imports triton); vLLM, when installed, runs on CPU."""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    import vllm  # noqa: F401

    HAS_VLLM = True
except ImportError:
    HAS_VLLM = False

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU: run scripts/gpu_check.sh on the GPU machine")
    skip_vllm = pytest.mark.skip(reason="needs a real vLLM: run through scripts/run_tests.sh (one venv per vLLM)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not HAS_VLLM:
            item.add_marker(skip_vllm)
