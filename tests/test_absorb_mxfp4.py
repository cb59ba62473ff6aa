"""fused_absorb_mxfp4_qk_cache: vLLM's MXFP4 W_UK absorption (``VLLM_ROCM_USE_AITER_FP4BMM``) folded
into the fused decode launch. The reference (the AITER MXFP4 GEMM's arithmetic, rounding by ranges)
is checked against a stand-in written from AITER's bit procedure; every provider against the
reference with poisoned outputs at K3 shapes; on the GPU also against AMD's own kernels where AITER's
Triton kernels are importable, on inputs they handle there; planted faults caught."""

from __future__ import annotations

import inspect
from functools import partial

import pytest
import torch
from machine import DEVICE
from mxfp4_standin import batched_gemm_a16wfp4, dequantize, quantize
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

from k3_amd_overlay import k3, mxfp4
from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ, Fp8Format
from k3_amd_overlay.kernels import launch
from k3_amd_overlay.ops import absorb_qk_cache, aiter_absorb, fused_absorb_mxfp4_qk_cache, fused_qk_cache, reference

pytestmark = pytest.mark.kernels  # scripts/gpu_check.sh runs these on the GPU


def mxfp4_weights(heads: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's W_K and W_K_scale: W_UK [L, N, P] quantised along P (``quark_quantize_weight_to_mxfp4``,
    vllm/model_executor/layers/quantization/quark/utils.py), then both transposed to [N, L, ...]
    views, as vllm/model_executor/layers/attention/mla_attention.py stores them."""
    lora, nope = k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM
    w_uk = (torch.randn(lora, heads, nope, generator=gen) / 8).to(torch.bfloat16)
    packed, scales = quantize(w_uk.reshape(-1, nope))
    w_k = packed.view(lora, heads, nope // 2).to(DEVICE).transpose(0, 1)
    return w_k, scales.view(lora, heads, nope // mxfp4.GROUP).to(DEVICE).transpose(0, 1)


def mxfp4_case(tokens: int, heads: int, fmt: Fp8Format = E4M3FN, seed: int = 0, group_max_at_least: float = 0.0):
    """A decode batch with vLLM-layout MXFP4 weights; ``group_max_at_least``: every 32-lane group of
    q_nope gets one lane of at least this magnitude (AITER's quant is right on sm90 only from ~3.5)."""
    case = make_qk_case(tokens, heads, fmt, device=DEVICE, extremes=False, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q_full = torch.randn(tokens, heads, k3.QK_NOPE_HEAD_DIM + k3.QK_ROPE_HEAD_DIM, generator=gen) * 2
    if group_max_at_least:
        lanes = q_full[..., : k3.QK_NOPE_HEAD_DIM : mxfp4.GROUP]
        lanes.copy_(torch.sign(lanes) * (group_max_at_least + torch.rand(lanes.shape, generator=gen) * 4))
    q_nope = q_full.to(torch.bfloat16).to(DEVICE)[..., : k3.QK_NOPE_HEAD_DIM]  # a strided view, as vLLM's
    w_k, w_k_scale = mxfp4_weights(heads, gen)
    return case, q_nope, w_k, w_k_scale


def run(case, q_nope, w_k, w_k_scale, provider: str, poison: int):
    cache = torch.full(case.cache_shape, poison, dtype=torch.uint8, device=DEVICE)
    q_out = torch.full((*q_nope.shape[:2], k3.LATENT_ROW), poison, dtype=torch.uint8, device=DEVICE)
    fused_absorb_mxfp4_qk_cache(q_nope, w_k, w_k_scale, case.q_pe, case.kv_c, case.k_pe, cache, case.slot_mapping,
                                case.k_scale, case.q_scale, q_out=q_out.view(case.fmt.dtype), provider=provider,
                                kv_format=case.fmt.name)
    return cache, q_out


def unfused(case, ql_nope):
    """The stock path after the GEMM: concat, query quant and cache write (the overlay's qk_cache
    reference, bit-identical to vLLM's own ops)."""
    cache = torch.full(case.cache_shape, POISON_A, dtype=torch.uint8, device=DEVICE)
    q_out = fused_qk_cache(ql_nope, case.q_pe, case.kv_c, case.k_pe, cache, case.slot_mapping, case.k_scale,
                           case.q_scale, provider="reference", kv_format=case.fmt.name)
    return cache, q_out.view(torch.uint8)


def problems(case, q_nope, w_k, w_k_scale, provider="triton", want=None, max_differing=0.0):
    want = want or run(case, q_nope, w_k, w_k_scale, "reference", POISON_A)
    return absorb_problems(case, lambda poison: run(case, q_nope, w_k, w_k_scale, provider, poison), want,
                           max_differing)


# AITER's signatures of the two functions the stand-in replaces (parameter names and defaults), read
# from aiter/ops/triton/gemm/batched/batched_gemm_a16wfp4.py and aiter/ops/triton/quant/quant.py at
# AITER commit e4048607a5; vLLM calls both into AITER, which the CPU has not.
_REQUIRED = inspect.Parameter.empty
AITER_SIGNATURES = {
    "batched_gemm_a16wfp4": [("x", _REQUIRED), ("w", _REQUIRED), ("w_scales", _REQUIRED), ("dtype", torch.bfloat16),
                             ("y", None), ("config", None), ("transpose_bm", False), ("prequant", True),
                             ("y_scale", None)],
    "dynamic_mxfp4_quant": [("x", _REQUIRED), ("scaling_mode", "even")],
}


@pytest.mark.parametrize("name", sorted(AITER_SIGNATURES))
def test_the_standin_is_no_more_lenient_than_aiter(name):
    """Each stand-in takes AITER's parameters in AITER's order with AITER's defaults, or stops short of
    an optional one (a call passing it then fails here, loudly): no default AITER lacks, no parameter
    it has not."""
    import mxfp4_standin

    taken = [(p.name, p.default) for p in inspect.signature(getattr(mxfp4_standin, name)).parameters.values()]
    aiters = AITER_SIGNATURES[name]
    assert taken == aiters[: len(taken)], (taken, aiters)
    assert all(default is not _REQUIRED for _, default in aiters[len(taken):])


def test_reference_quant_agrees_with_aiters_bit_procedure():
    """Two independent codings of AITER's MXFP4 quant agree on every code and scale: ties at each
    e2m1 step, saturation, a zero group, tiny and huge groups, the max-rounding boundary."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 128, generator=gen) * torch.logspace(-30, 30, 48)[:, None]
    x[0, :32] = 0
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5] * 4) * 4  # every tie, then > 6
    x[2, :32] = 7.0  # max 7 = 1.75 * 4: rounds up to 8
    x[3, :32] = 6.96  # below 1.75 * 4: stays at 4
    x = x.to(torch.bfloat16)
    codes, scales = reference.mxfp4_quantize_reference(x)
    packed, aiter_scales = quantize(x)
    assert torch.equal(scales, aiter_scales)
    assert torch.equal(reference.unpack_e2m1(packed), codes)
    assert torch.equal(dequantize(packed, aiter_scales), reference.mxfp4_dequantize(codes, scales))
    assert scales[2, 0] - scales[3, 0] == 1  # the max's mantissa 1.75 moved the scale up a binade
    assert reference.mxfp4_dequantize(codes, scales)[1, :8].tolist() == [0, 4, 4, 8, 8, 16, 16, 24]


@pytest.mark.parametrize("q_scale", [1.0, 0.7123])
def test_reference_gemm_agrees_with_the_standin(q_scale):
    """ql_nope of the reference = the stand-in GEMM vLLM's stock path calls, y_scale included."""
    _, q_nope, w_k, w_k_scale = mxfp4_case(9, 3)
    y_scale = torch.tensor(q_scale, device=DEVICE)
    want = batched_gemm_a16wfp4(q_nope.transpose(0, 1).cpu(), w_k.cpu(), w_k_scale.cpu(), transpose_bm=True,
                                y_scale=y_scale.cpu())
    got = reference.absorb_w_k_mxfp4_reference(q_nope, w_k, w_k_scale, y_scale)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ], ids=lambda f: f.name)
@pytest.mark.parametrize("heads", [1, 3, 12, 16])
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 256])
def test_mxfp4_absorb_matches_reference(fmt, heads, tokens):
    skip_under_interpreter(tokens, heads, fmt)
    # every product is exact and these sums fit fp32: the same bytes in any summation order
    assert problems(*mxfp4_case(tokens, heads, fmt, seed=tokens + heads)) == []


@pytest.mark.parametrize("layout", ABSORB_GPU_LAYOUTS)
def test_mxfp4_absorb_in_the_gpu_layouts_matches_reference(layout):
    """One-token and two-token programs, and several column blocks a head over two token blocks (the
    second part-filled), as the GPU rules launch them; the interpreter's own rules never do."""
    with launch.forced(GPU_LAYOUTS[layout]):
        assert problems(*mxfp4_case(ABSORB_GPU_LAYOUTS[layout], 3, E4M3FNUZ, seed=5)) == []


@pytest.mark.parametrize("fault", ["activation_scale_a_binade_off", "weight_scale_a_binade_off", "nibbles_swapped",
                                   "y_scale_ignored", "skipped_kv_write", "doubled_write"])
def test_planted_faults_are_caught(fault, monkeypatch):
    """Each fault planted in the fused path (q_nope's group scales taken a binade off inside the
    kernel, the weight's scales a binade off, the packed lanes' order, vLLM's y_scale dropped, a
    token's KV row not written, a row written twice) fails the parity check above."""
    case, q_nope, w_k, w_k_scale = mxfp4_case(7, 3, seed=3)
    want = run(case, q_nope, w_k, w_k_scale, "reference", POISON_A)
    real = absorb_qk_cache.run_mxfp4_provider

    def planted(name, q, w, ws, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, *rest):
        if fault == "activation_scale_a_binade_off":  # read by the kernel at launch
            monkeypatch.setattr(mxfp4, "SCALE_EXPONENT_OFFSET", mxfp4.SCALE_EXPONENT_OFFSET - 1)
        elif fault == "weight_scale_a_binade_off":
            ws = ws - 1
        elif fault == "nibbles_swapped":
            w = (w >> 4) | (w << 4)
        elif fault == "y_scale_ignored":  # the query quant's scale kept, the GEMM's y_scale dropped
            q = (q.float() * q_scale.float()).to(q.dtype)
        real(name, q, w, ws, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, *rest)
        valid = slots[slots >= 0]
        if fault == "skipped_kv_write":
            cache.view(torch.uint8).view(-1, cache.shape[-1])[valid[0]] = POISON_A
        elif fault == "doubled_write":
            row = cache.view(torch.uint8).view(-1, cache.shape[-1])
            row[(valid[0] + 1) % row.shape[0]] = row[valid[0]]

    monkeypatch.setattr(absorb_qk_cache, "run_mxfp4_provider", planted)
    assert problems(case, q_nope, w_k, w_k_scale, want=want) != []


def test_inputs_outside_the_contract_are_refused_by_name():
    case, q_nope, w_k, w_k_scale = mxfp4_case(2, 3)
    args = (case.q_pe, case.kv_c, case.k_pe, torch.zeros(case.cache_shape, dtype=torch.uint8, device=DEVICE),
            case.slot_mapping, case.k_scale, case.q_scale)
    with pytest.raises(ValueError, match=r"must be uint8 \(packed e2m1, e8m0\), got torch.int8"):
        fused_absorb_mxfp4_qk_cache(q_nope, w_k.to(torch.int8), w_k_scale, *args, kv_format="e4m3fn")
    with pytest.raises(ValueError, match=r"W_K_scale must be \[H, L, P/32\] = \(3, 512, 4\), got \(3, 512, 2\)"):
        fused_absorb_mxfp4_qk_cache(q_nope, w_k, w_k_scale[..., :2], *args, kv_format="e4m3fn")
    with pytest.raises(ValueError, match=r"W_K must be \[H=3, L, P/2=64\]"):
        fused_absorb_mxfp4_qk_cache(q_nope, w_k[:2], w_k_scale, *args, kv_format="e4m3fn")
    with pytest.raises(ValueError, match=r"q_nope must be \[T, H, P\], W_K \[H, L, P/2\]"):
        fused_absorb_mxfp4_qk_cache(q_nope[0], w_k, w_k_scale, *args, kv_format="e4m3fn")
    missing = absorb_qk_cache.provider_missing(DEVICE, 32, 512, 64, mxfp4_weights=True)
    assert "takes P >= 64, got 32" in missing["triton"] and missing["reference"] is None
    why = absorb_qk_cache.provider_missing(DEVICE, 128, 512, 64, mxfp4_weights=True)["aiter"]
    assert aiter_absorb.AITER_FP4_NAME in why or "need ROCm GPU tensors" in why  # AITER absent, or off ROCm


# --- against AMD's own code (GPU, AITER's Triton kernels importable) ------------------------------

@pytest.fixture
def aiter_fp4(aiter_triton):
    why = aiter_triton.fp4_missing()
    if why:
        pytest.skip(why)
    return aiter_triton


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [3, 12, 16])
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_reference_gemm_is_aiters(aiter_fp4, heads, tokens):
    """The reference's ql_nope is AITER's own MXFP4 GEMM's (what vLLM's stock fp4 path calls), bit for
    bit, on inputs whose every group AITER quantises right on this GPU."""
    case, q_nope, w_k, w_k_scale = mxfp4_case(tokens, heads, seed=tokens * heads, group_max_at_least=4.0)
    for y_scale in (None, case.q_scale):
        got = reference.absorb_w_k_mxfp4_reference(q_nope, w_k, w_k_scale, y_scale)
        assert torch.equal(got, aiter_fp4.fp4_bmm(q_nope, w_k, w_k_scale, y_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [3, 12, 16])
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("provider", ["triton", "aiter", "reference"])
def test_every_provider_matches_the_unfused_path_vllm_runs(aiter_fp4, provider, heads, tokens):
    """vLLM's unfused fp4 path on AMD's own GEMM (then the concat, query quant and cache write):
    each provider writes the same cache bytes and the same query codes."""
    case, q_nope, w_k, w_k_scale = mxfp4_case(tokens, heads, seed=tokens + heads, group_max_at_least=4.0)
    want = unfused(case, aiter_fp4.fp4_bmm(q_nope, w_k, w_k_scale, case.q_scale))
    assert problems(case, q_nope, w_k, w_k_scale, provider, want=want) == []


# --- CUDA/HIP graphs (GPU) ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "heads"), [(1, 12), (1, 16), (8, 12), (256, 12), (256, 16)])
def test_mxfp4_absorb_graph_replay_with_new_inputs(tokens, heads):
    """Captured once, replayed on new inputs, slots, static scales and weights with their group scales:
    one token takes the programs without a tensor-core tile, 256 tokens the KV programs of several rows."""
    make = partial(mxfp4_case, tokens, heads, E4M3FN)
    assert absorb_graph_replay_problems(make, fused_absorb_mxfp4_qk_cache, max_differing=0.0) == []


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_a_weight_scale_held_from_before_the_capture_is_caught(tokens):
    """Planted fault for the test above: the fused path keeps the W_K group scales of its first call (as a
    prepared-weights cache would), so the replays scale by a stale value."""
    stale = weight_scale_held_from_first_call(fused_absorb_mxfp4_qk_cache)
    found = absorb_graph_replay_problems(partial(mxfp4_case, tokens, 12, E4M3FN), stale, max_differing=0.0)
    assert any(p.startswith("seed 2: q_out:") for p in found), found
