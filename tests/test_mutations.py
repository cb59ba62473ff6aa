"""Each parity check catches a planted fault: the checks the kernel tests rely on are shown to
fail on a provider with a wrong scale, a skipped KV write, a divided-instead-of-multiplied scale,
a rotation applied (cos 0.5, or twice), swapped weights, an ignored eps."""

from __future__ import annotations

import pytest
import torch
from machine import DEVICE
from parity import (
    make_qk_case,
    qk_cache_problems,
    reference_pair,
    rmsnorm_inputs,
    rmsnorm_problems,
    run_provider,
)

from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ
from k3_amd_overlay.ops import aiter_qk_cache, fused_q_kv_rmsnorm

pytestmark = pytest.mark.kernels  # scripts/gpu_check.sh runs these on the GPU

TRITON = run_provider("triton")


def _case(fmt=E4M3FN):
    return make_qk_case(7, 3, fmt, device=DEVICE, extremes=False)


def test_real_providers_pass_the_checks_that_catch_mutations():
    assert qk_cache_problems(_case(), TRITON) == []


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ], ids=lambda f: f.name)
def test_wrong_k_scale_is_caught(fmt):
    def mutated(case, cache, q_out):
        case2 = type(case)(**{**case.__dict__, "k_scale": case.k_scale * 2.7})
        TRITON(case2, cache, q_out)

    problems = qk_cache_problems(_case(fmt), mutated)
    assert any(p.startswith("cache:") for p in problems)


def test_skipped_kv_write_is_caught():
    def mutated(case, cache, q_out):
        case2 = type(case)(**{**case.__dict__, "slot_mapping": torch.full_like(case.slot_mapping, -1)})
        TRITON(case2, cache, q_out)

    assert any("not written" in p for p in qk_cache_problems(_case(), mutated))


def test_divided_instead_of_multiplied_scale_is_caught():
    """x * scale instead of x / scale, with a scale that is not a power of two."""
    def mutated(case, cache, q_out):
        case2 = type(case)(**{**case.__dict__, "q_scale": 1.0 / case.q_scale})
        TRITON(case2, cache, q_out)

    problems = qk_cache_problems(_case(), mutated)
    assert any(p.startswith("q_out:") for p in problems)


@pytest.mark.parametrize("fault", ["cos_half", "rotation_twice"])
def test_a_rotation_in_the_aiter_path_is_caught(fault, monkeypatch, aiter_standin):
    """The identity table is what keeps AITER's RoPE a no-op: cos 0.5 (or a real rotation,
    applied on top of the one the model already did) changes the rope lanes."""
    aiter_standin(fmt=E4M3FN)
    original = aiter_qk_cache.identity_rope_table

    def bad_table(device, dtype, rope_dim):
        cos, sin = original(device, dtype, rope_dim)
        if fault == "cos_half":
            return cos * 0.5, sin
        angle = torch.linspace(0.1, 1.0, cos.shape[-1], dtype=torch.float32)
        return angle.cos().to(dtype)[None], angle.sin().to(dtype)[None]

    monkeypatch.setattr(aiter_qk_cache, "identity_rope_table", bad_table)
    case = make_qk_case(5, 12, E4M3FN, extremes=False)
    problems = qk_cache_problems(case, run_provider("aiter"))
    assert any(p.startswith("q_out:") for p in problems)
    assert any(p.startswith("cache:") for p in problems)


def test_swapped_norm_weights_are_caught():
    q, kv, q_w, kv_w = rmsnorm_inputs(7, torch.bfloat16, DEVICE, q_size=512, kv_size=512)
    got = fused_q_kv_rmsnorm(q, kv, kv_w, q_w, 1e-5, 1e-5, provider="triton")
    assert rmsnorm_problems(got, reference_pair(q, kv, q_w, kv_w, 1e-5, 1e-5))


def test_an_ignored_eps_is_caught():
    q, kv, q_w, kv_w = rmsnorm_inputs(7, torch.float32, DEVICE)
    kv = kv * 1e-3  # small rows, so eps matters
    got = fused_q_kv_rmsnorm(q, kv, q_w, kv_w, 1e-5, 1e-5, provider="triton")
    assert rmsnorm_problems(got, reference_pair(q, kv, q_w, kv_w, 1e-5, 1e-2))


def test_aiter_tables_are_never_built_inside_a_capture(monkeypatch):
    """CPU stand-in for a capture (tests/test_gpu_graphs.py has the real one): once a capture is
    under way, a table or buffer not built before is refused; those built before are served."""
    from k3_amd_overlay.ops import aiter_qk_cache

    cpu = torch.device("cpu")
    aiter_qk_cache.reserve_identity_table(cpu, torch.bfloat16, 64)
    aiter_qk_cache.reserve_zero_positions(cpu, 16)
    monkeypatch.setattr(aiter_qk_cache, "_capturing", lambda device: True)
    cos, sin = aiter_qk_cache.identity_rope_table(cpu, torch.bfloat16, 64)
    assert cos.eq(1).all() and sin.eq(0).all() and aiter_qk_cache.zero_positions(cpu, 16).eq(0).all()
    with pytest.raises(aiter_qk_cache.BuiltInsideCapture, match="identity rope table"):
        aiter_qk_cache.identity_rope_table(cpu, torch.float16, 64)
    with pytest.raises(aiter_qk_cache.BuiltInsideCapture, match="zero-positions buffer"):
        aiter_qk_cache.zero_positions(cpu, 10_000_000)
