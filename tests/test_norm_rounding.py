"""The fused q/kv norm rounds where vLLM's RMSNorm rounds: the normalised value in fp32, rounded to
the weight's dtype, times the weight, rounded to the activation dtype. The reference is checked bit
for bit against the real vLLM RMSNorm module of each release (CPU), the Triton kernel bit for bit
against the same formula on a GPU; and the check is shown to catch one rounding instead of two."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from parity import rmsnorm_inputs

from k3_amd_overlay import k3
from k3_amd_overlay.ops import fused_q_kv_rmsnorm
from k3_amd_overlay.ops.reference import rmsnorm_reference

DTYPES = [torch.bfloat16, torch.float16]


def single_rounding(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The planted fault: x * inv_rms * weight in fp32, rounded once (what the overlay did before)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_vllms_rmsnorm_bit_for_bit(dtype):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    q, kv, q_w, kv_w = rmsnorm_inputs(64, dtype, "cpu")
    with set_current_vllm_config(VllmConfig()):
        for x, w, eps in ((q, q_w, k3.RMS_NORM_EPS), (kv, kv_w, 1e-3)):
            norm = RMSNorm(x.shape[1], eps=eps, dtype=dtype)
            norm.weight.data.copy_(w)
            stock = norm.forward_native(x)
            assert torch.equal(rmsnorm_reference(x, w, eps), stock)
            # the fault the check catches: a single rounding differs from vLLM on many elements
            assert (single_rounding(x, w, eps) != stock).float().mean() > 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 64, 512, 4096])
def test_triton_pair_rounds_like_vllms_rmsnorm(dtype, tokens):
    q, kv, q_w, kv_w = rmsnorm_inputs(tokens, dtype, DEVICE)
    q_eps, kv_eps = k3.RMS_NORM_EPS, 1e-3
    got_q, got_kv = fused_q_kv_rmsnorm(q, kv, q_w, kv_w, q_eps, kv_eps, provider="triton")
    want_q, want_kv = rmsnorm_reference(q, q_w, q_eps), rmsnorm_reference(kv, kv_w, kv_eps)
    mismatches = int((got_q != want_q).sum()) + int((got_kv != want_kv).sum())
    assert mismatches == 0, f"{mismatches} of {got_q.numel() + got_kv.numel()} elements differ"
    assert not torch.equal(single_rounding(q, q_w, q_eps), got_q)
