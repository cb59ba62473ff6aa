"""``tune.Case`` (built on the GPU it tunes) on a CPU: its tensors made on the CPU instead (torch's
factories told ``device="cuda"`` answer CPU tensors), its launches run by Triton's interpreter. For
each tuned kernel the shipped config's bytes match the stock reference (no code further than one
step off, none unwritten), and a launch that writes nothing is caught: the bytes check sees every
poisoned code."""

from __future__ import annotations

import pytest

from k3_amd_overlay.commands import tune
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import names

LAUNCHING_MODULES = ("rmsnorm_pair", "qk_cache", "absorb_qk_cache", "absorb_fp8_qk_cache", "absorb_mxfp4_qk_cache",
                     "static_quant")


@pytest.fixture
def launched(monkeypatch):
    """The names of the Triton kernels launched (each launcher module's ``launch``, spied on)."""
    import importlib

    seen = []
    for name in LAUNCHING_MODULES:
        module = importlib.import_module(f"k3_amd_overlay.kernels.{name}")

        def spy(kernel, grid, *args, _launch=module.launch, **options):
            seen.append(getattr(kernel, "fn", kernel).__name__)
            return _launch(kernel, grid, *args, **options)

        monkeypatch.setattr(module, "launch", spy)
    return seen


@pytest.mark.parametrize("kernel", tune.TUNED_KERNELS)
def test_a_case_checks_the_shipped_config_against_the_stock_reference(kernel, cpu_for_cuda, launched):
    case = tune.Case(kernel, 2, 1, E4M3FN)
    assert case.kernel == kernel
    assert all(o.device.type == "cpu" for o in case.outputs)
    assert launched == []  # building the case launches nothing of the overlay's
    near, far = case.mismatches(None)
    assert launched == [kernel]  # the kernel tuned, and only it
    assert far == 0
    assert near <= tune.MISMATCH_ALLOWANCE * sum(w.numel() for w in case.wanted)
    if kernel == names.RMSNORM_PAIR_KERNEL:
        assert [tuple(o.shape) for o in case.outputs] == [(2, 1536), (2, 512)]
    else:
        assert tuple(case.outputs[0].shape) == (2, 1, 576)  # q_out: a head of 512 + 64 codes
    written = case.run

    def nothing():
        return None

    case.run = nothing  # a launch that writes nothing leaves the poison: every wanted code is off
    assert sum(case.mismatches(None)) > 0
    case.run = written
