"""fused_absorb_fp8_qk_cache: vLLM's fp8 W_UK absorption (``VLLM_ROCM_USE_AITER_FP8BMM``) folded
into the fused decode launch. Against the reference (the AITER batched GEMM's arithmetic in torch,
then the same quant and cache write), with poisoned outputs, at K3 shapes; on the GPU also against
AMD's own code where AITER's Triton kernels are importable (the unfused path vLLM runs: AITER's fp8
BMM, then the concat, quant and cache write; and AITER's fused fp8 kernel); planted faults caught."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from machine import DEVICE, HAS_GPU
from parity import (
    ABSORB_GPU_LAYOUTS,
    GPU_LAYOUTS,
    POISON_A,
    absorb_graph_replay_problems,
    absorb_problems,
    make_qk_case,
    skip_under_interpreter,
    weight_scale_held_from_first_call,
)

from k3_amd_overlay import k3
from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ, Fp8Format
from k3_amd_overlay.kernels import launch
from k3_amd_overlay.ops import absorb_qk_cache, aiter_absorb, fused_absorb_fp8_qk_cache, fused_qk_cache

pytestmark = pytest.mark.kernels  # scripts/gpu_check.sh runs these on the GPU


def fp8_weights(heads: int, fmt: Fp8Format, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's W_K and W_K_scale: W_UK [L, N, P] transposed to [N, L, P], quantised per tensor
    (``dynamic_per_batched_tensor_quant`` in vllm/model_executor/layers/attention/mla_attention.py)."""
    w_uk = torch.randn(k3.KV_LORA_RANK, heads, k3.QK_NOPE_HEAD_DIM, generator=gen) / 8
    w_k = w_uk.transpose(0, 1)
    scale = fmt.fmax / w_k.abs().max().clamp(min=1e-10)
    w8 = (w_k * scale).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype).contiguous()
    return w8.to(DEVICE), scale.float().reciprocal().to(DEVICE)


def fp8_case(tokens: int, heads: int, fmt: Fp8Format, seed: int = 0):
    case = make_qk_case(tokens, heads, fmt, device=DEVICE, extremes=False, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q_nope = (torch.randn(tokens, heads, k3.QK_NOPE_HEAD_DIM + k3.QK_ROPE_HEAD_DIM, generator=gen) * 2)
    q_nope = q_nope.to(torch.bfloat16).to(DEVICE)[..., : k3.QK_NOPE_HEAD_DIM]  # a strided view, as vLLM's
    w_k, w_k_scale = fp8_weights(heads, fmt, gen)
    return case, q_nope, w_k, w_k_scale


def run(case, q_nope, w_k, w_k_scale, provider: str, poison: int):
    cache = torch.full(case.cache_shape, poison, dtype=torch.uint8, device=DEVICE)
    q_out = torch.full((*q_nope.shape[:2], k3.LATENT_ROW), poison, dtype=torch.uint8, device=DEVICE)
    fused_absorb_fp8_qk_cache(q_nope, w_k, w_k_scale, case.q_pe, case.kv_c, case.k_pe, cache, case.slot_mapping,
                              case.k_scale, case.q_scale, q_out=q_out.view(case.fmt.dtype), provider=provider,
                              kv_format=case.fmt.name)
    return cache, q_out


def problems(case, q_nope, w_k, w_k_scale, provider="triton", want=None, max_differing=0.002):
    want = want or run(case, q_nope, w_k, w_k_scale, "reference", POISON_A)
    return absorb_problems(case, lambda poison: run(case, q_nope, w_k, w_k_scale, provider, poison), want,
                           max_differing)


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ], ids=lambda f: f.name)
@pytest.mark.parametrize("heads", [1, 3, 12, 16])
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 256])
def test_fp8_absorb_matches_reference(fmt, heads, tokens):
    skip_under_interpreter(tokens, heads, fmt)
    if HAS_GPU and fmt is E4M3FNUZ and torch.version.hip is None:
        pytest.skip("e4m3fnuz weights (MI300's fp8) take an AMD GPU for the fp8 dot; checked on CPU")
    # under the interpreter the sums are fp32 in the reference's own order: bit-identical there; on a
    # GPU the tensor-core sum order differs from torch's, so a few codes sit one step apart
    assert problems(*fp8_case(tokens, heads, fmt), max_differing=0.005 if HAS_GPU else 0.0) == []


@pytest.mark.parametrize("layout", ABSORB_GPU_LAYOUTS)
def test_fp8_absorb_in_the_gpu_layouts_matches_reference(layout):
    """One-token and two-token programs, and several column blocks a head over two token blocks (the
    second part-filled), as the GPU rules launch them; the interpreter's own rules never do."""
    with launch.forced(GPU_LAYOUTS[layout]):
        case = fp8_case(ABSORB_GPU_LAYOUTS[layout], 3, E4M3FN, seed=5)
        assert problems(*case, max_differing=0.005 if HAS_GPU else 0.0) == []


@pytest.mark.parametrize("fault", ["weight_scale_ignored", "group_scale_ignored", "skipped_kv_write",
                                   "doubled_write"])
def test_planted_faults_are_caught(fault, monkeypatch):
    """Each fault planted in the fused path (a scale dropped, a token's KV row not written, a row
    written twice at another slot) fails the parity check above."""
    case, q_nope, w_k, w_k_scale = fp8_case(7, 3, E4M3FN, seed=3)
    want = run(case, q_nope, w_k, w_k_scale, "reference", POISON_A)
    real = absorb_qk_cache.run_fp8_provider

    def planted(name, q, w, ws, *rest):
        cache, slots = rest[3], rest[4]
        if fault == "weight_scale_ignored":
            ws = torch.ones_like(ws)
        elif fault == "group_scale_ignored":  # q_nope taken as if already fp8
            q = q * (w.new_tensor(448.0, dtype=torch.float32) / q.float().abs().amax(-1, keepdim=True)).to(q.dtype)
        real(name, q, w, ws, *rest)
        valid = slots[slots >= 0]
        if fault == "skipped_kv_write":
            cache.view(torch.uint8).view(-1, cache.shape[-1])[valid[0]] = POISON_A
        elif fault == "doubled_write":
            row = cache.view(torch.uint8).view(-1, cache.shape[-1])
            row[(valid[0] + 1) % row.shape[0]] = row[valid[0]]

    monkeypatch.setattr(absorb_qk_cache, "run_fp8_provider", planted)
    assert problems(case, q_nope, w_k, w_k_scale, want=want) != []


def test_inputs_outside_the_contract_are_refused_by_name():
    case, q_nope, w_k, w_k_scale = fp8_case(2, 3, E4M3FN)
    args = (case.q_pe, case.kv_c, case.k_pe, torch.zeros(case.cache_shape, dtype=torch.uint8, device=DEVICE),
            case.slot_mapping, case.k_scale, case.q_scale)
    with pytest.raises(ValueError, match=r"W_K dtype torch.bfloat16 is not fp8"):
        fused_absorb_fp8_qk_cache(q_nope, w_k.to(torch.bfloat16), w_k_scale, *args, kv_format="e4m3fn")
    with pytest.raises(ValueError, match=r"W_K_scale must be one float32 element, got torch.float32 with 3"):
        fused_absorb_fp8_qk_cache(q_nope, w_k, w_k_scale.repeat(3), *args, kv_format="e4m3fn")
    with pytest.raises(ValueError, match=r"W_K must be \[H=3, L, P=128\]"):
        fused_absorb_fp8_qk_cache(q_nope, w_k[:2], w_k_scale, *args, kv_format="e4m3fn")
    missing = absorb_qk_cache.provider_missing(DEVICE, 64, 512, 64, fp8_weights=True)
    assert "takes P = 128" in missing["triton"] and missing["reference"] is None
    assert "no fused kernel for a bf16 W_UK_T" in absorb_qk_cache.provider_missing(DEVICE, 128, 512, 64)["aiter"]


# --- against AMD's own code (GPU, AITER's Triton kernels importable) ------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("heads", [3, 12, 16])
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("provider", ["triton", "aiter", "reference"])
def test_every_provider_matches_the_unfused_path_vllm_runs(aiter_triton, provider, heads, tokens):
    """The unfused fp8 path of vLLM, on AMD's own code: AITER's fp8 BMM (what
    ``rocm_aiter_ops.triton_fp8_bmm`` calls), then the concat, query quant and cache write (the
    overlay's qk_cache launch, bit-identical to vLLM's own and to AITER's). Each provider of the
    fused op writes the same cache bytes and query codes, but one fp8 step on a few of them."""
    case, q_nope, w_k, w_k_scale = fp8_case(tokens, heads, E4M3FN, seed=tokens + heads)
    cache = torch.full(case.cache_shape, POISON_A, dtype=torch.uint8, device=DEVICE)
    ql_nope = aiter_triton.fp8_bmm(q_nope, w_k, w_k_scale)
    q_out = fused_qk_cache(ql_nope, case.q_pe, case.kv_c, case.k_pe, cache, case.slot_mapping, case.k_scale,
                           case.q_scale, provider="triton", kv_format="e4m3fn").view(torch.uint8)
    assert problems(case, q_nope, w_k, w_k_scale, provider, want=(cache, q_out), max_differing=0.01) == []


@pytest.mark.gpu
def test_aiters_fused_kernel_agrees_with_its_own_gemm(aiter_triton):
    """AMD's two codes agree with each other (the fused kernel's query in bf16 is the GEMM's, bit for
    bit), so the unfused path above is a faithful oracle."""
    case, q_nope, w_k, w_k_scale = fp8_case(32, 12, E4M3FN, seed=5)
    cache = torch.zeros(case.cache_shape, dtype=torch.uint8, device=DEVICE).view(E4M3FN.dtype)
    k_pe = case.k_pe.reshape(case.k_pe.shape[0], -1)
    query = aiter_absorb.fused_query(q_nope, w_k, w_k_scale, case.q_pe, case.kv_c, k_pe, cache, case.slot_mapping,
                                     case.k_scale, torch.bfloat16)
    assert torch.equal(query[..., : k3.KV_LORA_RANK], aiter_triton.fp8_bmm(q_nope, w_k, w_k_scale))


# --- CUDA/HIP graphs (GPU) ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "heads"), [(1, 12), (1, 16), (2, 12), (2, 16), (8, 12), (256, 12), (256, 16)])
def test_fp8_absorb_graph_replay_with_new_inputs(tokens, heads):
    """Captured once, replayed on new inputs, slots, static scales and weights with their scale: one
    token takes the programs without a tensor-core tile, 256 tokens the KV programs of several rows."""
    make = partial(fp8_case, tokens, heads, E4M3FN)
    assert absorb_graph_replay_problems(make, fused_absorb_fp8_qk_cache, max_differing=0.005) == []


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_a_weight_scale_held_from_before_the_capture_is_caught(tokens):
    """Planted fault for the test above: the fused path keeps the W_K scale of its first call (as a
    prepared-weights cache would), so the replays scale by a stale value."""
    stale = weight_scale_held_from_first_call(fused_absorb_fp8_qk_cache)
    found = absorb_graph_replay_problems(partial(fp8_case, tokens, 12, E4M3FN), stale, max_differing=0.005)
    assert any(p.startswith("seed 2: q_out:") for p in found), found
