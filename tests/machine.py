"""What this test machine has, decided once before anything imports triton or vLLM: a GPU (else the
overlay's Triton kernels run under the Triton interpreter and vLLM on CPU) and a real vLLM."""

import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if os.environ.get("K3OVL_TESTS_WITHOUT_VLLM") == "1":  # mutation runs: no vLLM import per mutant
    HAS_VLLM = False
else:
    try:
        import vllm  # noqa: F401

        HAS_VLLM = True
    except ImportError:
        HAS_VLLM = False

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
