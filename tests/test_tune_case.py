"""``tune.Case`` (built on the GPU it tunes) on a CPU: its tensors made on the CPU instead (torch's
factories told ``device="cuda"`` answer CPU tensors), its launches run by Triton's interpreter. For
each tuned kernel the shipped config's bytes match the stock reference (no code further than one
step off, none unwritten), and a launch that writes nothing is caught: the bytes check sees every
poisoned code."""

from __future__ import annotations

import pytest

from k3_amd_overlay.commands import tune
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import launch, launch_configs, names

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
    assert near <= case.allowance()
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


@pytest.mark.parametrize("planted", ["every query code one step off", "one cache byte one step off"])
def test_a_candidate_off_the_reference_beyond_the_query_allowance_or_in_any_cache_byte_is_rejected(
        planted, cpu_for_cuda, monkeypatch):
    """The allowance is a share of the query codes alone, and the KV cache must match byte for byte
    (before, the allowance counted every cache byte: at one token and three heads it exceeded all
    1728 query codes, and a cache byte one step off passed)."""
    bad = {"HEADS": 2, "num_warps": 2}
    kernel = names.QK_CACHE_KERNEL
    case = tune.Case(kernel, 1, 3, E4M3FN)
    q_out, cache = case.outputs
    assert case.allowance() == int(tune.MISMATCH_ALLOWANCE * q_out.numel())
    real = case.run

    def run():
        real()
        if launch._forced.get() == bad:
            if planted.startswith("every"):
                flat = q_out.view(-1)
                flat.copy_(flat ^ 1)  # the lowest bit: each magnitude one code away
            else:
                written = (case.wanted[1].view(-1) != 0xA5).nonzero()[0, 0]
                cache.view(-1)[written] ^= 1

    case.run = run
    shipped = dict(launch_configs.rule_for(tune.shipped_rules("sm90", kernel), 1, 3).config)
    assert case.mismatches(shipped)[1] == 0
    monkeypatch.setattr(tune, "time_us", lambda run, config: 1.0 if config == bad else 10.0)
    logged = []
    assert tune.tune_case(case, shipped, [bad], logged.append)[0] == shipped
    assert "rejected" in logged[0]
