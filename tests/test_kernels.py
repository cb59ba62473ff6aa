"""Kernel parity: every provider of the two fused ops against the torch reference, on fresh random
inputs, with poisoned outputs (every byte meant to be written was, no other was). The Triton
kernels must match bit for bit, on a GPU and on CPU under Triton's interpreter (where the kernels
round to fp8 on the integer bits: the interpreter's own e4m3fn cast loses mantissa carries)."""

from __future__ import annotations

import pytest
import torch
from machine import DEVICE, HAS_GPU
from parity import (
    GPU_LAYOUTS,
    absorb_problems,
    make_qk_case,
    qk_cache_problems,
    reference_pair,
    rmsnorm_inputs,
    rmsnorm_problems,
    run_provider,
)

from k3_amd_overlay import k3
from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ, FP8_FORMATS
from k3_amd_overlay.kernels import launch
from k3_amd_overlay.ops import ProviderUnavailable, fused_q_kv_rmsnorm, fused_qk_cache

pytestmark = pytest.mark.kernels  # scripts/gpu_check.sh runs these on the GPU

FORMATS = [E4M3FN, E4M3FNUZ]


def _interpreter_budget(tokens: int, heads: int, block_size: int) -> None:
    if not HAS_GPU and (tokens * (heads + 1) > 120 or (block_size > 16 and tokens > 7)):
        pytest.skip("too slow under the Triton interpreter; the GPU run (scripts/gpu_check.sh) covers it")


def test_a_batch_of_only_padding_fails_both_parity_checks():
    """A parity check holds only on bytes it compared: where every token is padding (slot -1) no
    query is compared, and both checks say so instead of passing."""
    case = make_qk_case(2, 1, E4M3FN, extremes=False, device=DEVICE, seed=0)
    case.slot_mapping.fill_(-1)
    nothing = "no token has a slot: the query bytes would go unchecked"
    assert qk_cache_problems(case, run_provider("reference")) == [nothing]

    def untouched(poison: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full(case.cache_shape, poison, dtype=torch.uint8, device=DEVICE),
                torch.full((2, 1, k3.LATENT_ROW), poison, dtype=torch.uint8, device=DEVICE))

    assert absorb_problems(case, untouched, untouched(0)) == [nothing]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("block_size", [1, 16, 1536])
@pytest.mark.parametrize("heads", [1, 3, 12, 16])
@pytest.mark.parametrize("tokens", [0, 1, 7, 256])
def test_qk_cache_triton_matches_reference(fmt, block_size, heads, tokens):
    _interpreter_budget(tokens, heads, block_size)
    case = make_qk_case(tokens, heads, fmt, block_size=block_size, device=DEVICE)
    assert qk_cache_problems(case, run_provider("triton")) == []


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_qk_cache_in_a_gpu_layout_matches_reference(fmt):
    """Several heads a program with the last one part-filled, as the GPU rules launch it (the
    interpreter's own rules take 16 heads a program)."""
    case = make_qk_case(7, 3, fmt, device=DEVICE, seed=7)
    with launch.forced(GPU_LAYOUTS["qk_cache"]):
        assert qk_cache_problems(case, run_provider("triton")) == []


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("version", [(0, 1, 19), (0, 1, 19, 1), (0, 1, 20)],
                         ids=["aiter-0.1.19", "aiter-0.1.19.post1", "aiter-0.1.20"])
@pytest.mark.parametrize("heads,block_size", [(1, 16), (3, 16), (12, 1), (12, 16), (16, 1536)])
@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
def test_qk_cache_aiter_standin_matches_reference(fmt, version, heads, block_size, tokens, aiter_standin):
    """The AITER provider keeps AITER's contract (the stand-in raises otherwise) on every kernel
    AITER would pick, on AITER versions with and without the position clamp."""
    standin = aiter_standin(version=version, fmt=fmt)
    case = make_qk_case(tokens, heads, fmt, block_size=block_size, extremes=False, device="cpu")
    assert qk_cache_problems(case, run_provider("aiter")) == []
    assert all(call["identity"] and call["positions_max"] in (0, None) for call in standin.calls)
    assert {call["arity"] for call in standin.calls} <= {15 if version >= (0, 1, 19, 1) else 14}


def test_aiter_rope_lanes_are_not_clamped_by_aiter(aiter_standin):
    """A documented difference: AITER's rope lanes skip the clamp, so an overflowing q_pe value
    becomes NaN there (fp8 e4m3fn has no inf) where the spec and the Triton kernel saturate."""
    aiter_standin(fmt=E4M3FN)
    case = make_qk_case(4, 12, E4M3FN, extremes=True, padding_every=0)
    out = fused_qk_cache(case.ql_nope, case.q_pe, case.kv_c, case.k_pe,
                         torch.zeros(case.cache_shape, dtype=torch.uint8), case.slot_mapping,
                         case.k_scale, case.q_scale, provider="aiter", kv_format="e4m3fn")
    ref = fused_qk_cache(case.ql_nope, case.q_pe, case.kv_c, case.k_pe,
                         torch.zeros(case.cache_shape, dtype=torch.uint8), case.slot_mapping,
                         case.k_scale, case.q_scale, provider="reference", kv_format="e4m3fn")
    inf_lanes = case.q_pe.isinf()
    assert inf_lanes.sum() >= 10  # the case places them (it once did not: the asserts below held on nothing)
    assert out[..., k3.KV_LORA_RANK:].float()[inf_lanes].isnan().all()
    assert ref[..., k3.KV_LORA_RANK:].float()[inf_lanes].abs().eq(448).all()
    assert torch.equal(out[..., :k3.KV_LORA_RANK].view(torch.uint8), ref[..., :k3.KV_LORA_RANK].view(torch.uint8))


def test_the_aiter_provider_refuses_a_q_out_whose_heads_are_not_one_row_apart(aiter_standin):
    """AITER's decode kernels bound each token's q_out stores to heads x (L+R) elements but address
    heads by the head stride: with a wider one the later heads' stores are dropped (wrong bytes). The
    stand-in took it, so the provider passed it on; now the provider refuses it, naming the strides."""
    aiter_standin(fmt=E4M3FN)
    case = make_qk_case(2, 4, E4M3FN, padding_every=0)
    wide = torch.zeros(2, 4, 1024, dtype=E4M3FN.dtype)[..., :k3.LATENT_ROW]
    with pytest.raises(ValueError, match=r"q_out's heads must be 576 elements apart .* got strides \(4096, 1024, 1\)"):
        fused_qk_cache(case.ql_nope, case.q_pe, case.kv_c, case.k_pe, torch.zeros(case.cache_shape, dtype=torch.uint8),
                       case.slot_mapping, case.k_scale, case.q_scale, q_out=wide, provider="aiter", kv_format="e4m3fn")


def test_qk_cache_errors_name_the_value_and_what_is_allowed():
    case = make_qk_case(3, 2, E4M3FN)
    cache = torch.zeros(case.cache_shape, dtype=torch.uint8)
    args = (case.ql_nope, case.q_pe, case.kv_c, case.k_pe, cache, case.slot_mapping, case.k_scale, case.q_scale)
    with pytest.raises(ValueError, match="uint8: name its fp8 format"):
        fused_qk_cache(*args)
    with pytest.raises(ValueError, match=r"slot_mapping must be int64 \[T=3\], got torch.int32"):
        fused_qk_cache(*args[:5], case.slot_mapping.int(), *args[6:], kv_format="e4m3fn")
    with pytest.raises(ValueError, match="k_scale must be a one-element float32 tensor"):
        fused_qk_cache(*args[:6], case.k_scale.double(), case.q_scale, kv_format="e4m3fn")
    with pytest.raises(ValueError, match=r"kv_c must be \[T=3, L=512\]"):
        fused_qk_cache(case.ql_nope, case.q_pe, case.kv_c[:, :100], *args[3:], kv_format="e4m3fn")
    with pytest.raises(ValueError, match="fp8 format 'e5m2' is not supported; allowed"):
        fused_qk_cache(*args, kv_format="e5m2")
    with pytest.raises(ValueError, match="provider 'cuda' is unknown; allowed: auto, aiter, triton, reference"):
        fused_qk_cache(*args, kv_format="e4m3fn", provider="cuda")
    with pytest.raises(ProviderUnavailable, match="provider 'aiter' is unavailable: AITER"):
        fused_qk_cache(*args, kv_format="e4m3fn", provider="aiter")
    strided = torch.tensor([3, 99, 7, 99, 11, 99])[::2]  # every provider's kernel reads slots by pointer
    with pytest.raises(ValueError, match=r"slot_mapping must be dense \(stride 1\), got stride 2"):
        fused_qk_cache(*args[:5], strided, *args[6:], kv_format="e4m3fn")
    # the kernels store cache rows 16 bytes at a time (their pointer unspecialized, the alignment stated);
    # on the device the triton provider runs on (a GPU's, or the CPU's under the interpreter)
    on = make_qk_case(3, 2, E4M3FN, device=DEVICE)
    shifted = torch.zeros(cache.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(cache.shape)
    with pytest.raises(ValueError, match=r"qk_cache_kernel: kv_cache rows must start on 16-byte boundaries \(the "
                                         r"kernel stores them 16 bytes at a time\): its data pointer is 1 bytes past "
                                         r"one and its block and row strides are \(9216, 576\); all must be multiples "
                                         r"of 16"):
        fused_qk_cache(on.ql_nope, on.q_pe, on.kv_c, on.k_pe, shifted, on.slot_mapping, on.k_scale, on.q_scale,
                       kv_format="e4m3fn", provider="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 512, 4096, 16384])
def test_rmsnorm_pair_triton_matches_reference(dtype, tokens):
    if not HAS_GPU and tokens > 64:
        pytest.skip("too slow under the Triton interpreter; the GPU run (scripts/gpu_check.sh) covers it")
    q, kv, q_w, kv_w = rmsnorm_inputs(tokens, dtype, DEVICE)
    got = fused_q_kv_rmsnorm(q, kv, q_w, kv_w, 1e-5, 1e-3, provider="triton")
    assert rmsnorm_problems(got, reference_pair(q, kv, q_w, kv_w, 1e-5, 1e-3)) == []
    assert got[0].is_contiguous() and got[1].is_contiguous()


def test_rmsnorm_pair_in_a_gpu_layout_matches_reference():
    """Two q rows and four kv rows a program, the last ones part-filled, as the GPU rules launch it."""
    q, kv, q_w, kv_w = rmsnorm_inputs(7, torch.bfloat16, DEVICE)
    with launch.forced(GPU_LAYOUTS["rmsnorm_pair"]):
        got = fused_q_kv_rmsnorm(q, kv, q_w, kv_w, 1e-5, 1e-3, provider="triton")
    assert rmsnorm_problems(got, reference_pair(q, kv, q_w, kv_w, 1e-5, 1e-3)) == []


def test_rmsnorm_pair_errors_name_the_value():
    q, kv, q_w, kv_w = rmsnorm_inputs(3, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="q_c has 3 rows but kv_c has 2"):
        fused_q_kv_rmsnorm(q, kv[:2], q_w, kv_w, 1e-5, 1e-5)
    with pytest.raises(ValueError, match=r"kv_eps=0\.0 must be a finite float > 0"):
        fused_q_kv_rmsnorm(q, kv, q_w, kv_w, 1e-5, 0.0)
    with pytest.raises(ValueError, match="q_c needs unit stride in its last dim"):
        fused_q_kv_rmsnorm(q.t().contiguous().t(), kv, q_w, kv_w, 1e-5, 1e-5)
    with pytest.raises(ProviderUnavailable, match="provider 'vllm' is unavailable"):
        fused_q_kv_rmsnorm(q, kv, q_w, kv_w, 1e-5, 1e-6, provider="vllm")
    assert [t.shape for t in fused_q_kv_rmsnorm(q[:0], kv[:0], q_w, kv_w, 1e-5, 1e-5)] == [(0, 1536), (0, 512)]


def test_fp8_formats_are_the_torch_formats():
    assert FP8_FORMATS["e4m3fn"].fmax == torch.finfo(torch.float8_e4m3fn).max
    assert FP8_FORMATS["e4m3fnuz"].fmax == torch.finfo(torch.float8_e4m3fnuz).max


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_fp8_code_neighbourhood_rounds_like_torch(fmt):
    """Each finite code, values just above and below it, the midpoints (ties to even), saturation,
    subnormals, NaN: the Triton kernel's bits equal torch's cast (on CPU through the integer
    rounding the kernels use under the interpreter, whose own e4m3fn cast loses mantissa carries)."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    codes = codes[~codes.isnan()].sort().values
    special = torch.tensor([1e9, -1e9, 300.0, -235.0, 233.0, 232.0, 450.0, float("nan"), -1e-9, 1e-30])
    values = torch.cat([codes, codes * 1.0001, codes * 0.9999, (codes[:-1] + codes[1:]) / 2, special])
    tokens = -(-values.numel() // k3.LATENT_ROW)
    x = torch.zeros(tokens * k3.LATENT_ROW)
    x[: values.numel()] = values
    x = x.view(tokens, 1, k3.LATENT_ROW).to(DEVICE)
    one = torch.ones(1, device=DEVICE)
    cache = torch.zeros(2, 16, k3.LATENT_ROW, dtype=torch.uint8, device=DEVICE)
    no_slots = torch.full((tokens,), -1, dtype=torch.int64, device=DEVICE)
    out = fused_qk_cache(x[..., :k3.KV_LORA_RANK].contiguous(), x[..., k3.KV_LORA_RANK:].contiguous(),
                         torch.zeros(tokens, k3.KV_LORA_RANK, device=DEVICE),
                         torch.zeros(tokens, k3.QK_ROPE_HEAD_DIM, device=DEVICE),
                         cache, no_slots, one, one, provider="triton", kv_format=fmt.name)
    want = (x.float().clamp(-fmt.fmax, fmt.fmax)).to(fmt.dtype)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", [1.0, 0.37, 0.05], ids=["k1", "k0.37", "k0.05-saturating"])
@pytest.mark.parametrize("heads", [3, 6, 12, 16])
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("provider", ["triton", "reference"])
def test_qk_cache_matches_aiters_own_triton_kernel(provider, tokens, heads, k_scale):
    """AMD's AITER ``fused_qk_rope_cat_and_cache_mla`` (Triton, identity rotation) as the oracle
    nobody here wrote: at q_scale 1 (it takes no query scale) every provider writes the same query
    and cache bytes, padding slots included. Skipped where AITER's Triton kernels are not importable."""
    from k3_amd_overlay.commands.bench import aiter_peers

    why = aiter_peers.enable()
    if why:
        pytest.skip(why)
    case = make_qk_case(tokens, heads, E4M3FN, device=DEVICE, extremes=False, seed=tokens * 31 + heads)
    case.k_scale.fill_(k_scale)
    case.q_scale.fill_(1.0)
    k_pe = case.k_pe.reshape(tokens, -1)
    ours = torch.full(case.cache_shape, 0xA5, dtype=torch.uint8, device=DEVICE)
    theirs = ours.clone()
    q_ours = fused_qk_cache(case.ql_nope, case.q_pe, case.kv_c, case.k_pe, ours, case.slot_mapping, case.k_scale,
                            case.q_scale, provider=provider, kv_format="e4m3fn")
    q_theirs = aiter_peers.qk_cache(case.ql_nope, case.q_pe, case.kv_c, k_pe, theirs.view(E4M3FN.dtype),
                                    case.slot_mapping, case.k_scale)
    assert torch.equal(ours, theirs)  # every byte of the cache, untouched rows included
    assert torch.equal(q_ours.view(torch.uint8), q_theirs.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_static_query_quant_writes_each_row_bit_exact(fmt):
    """The one-launch static quant (the AITER provider's second launch): every code equal to the
    reference's, into a strided view (a head-padded buffer), nothing else touched."""
    from k3_amd_overlay.kernels.static_quant import scaled_quant
    from k3_amd_overlay.ops.reference import quantize_fp8

    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(5, 3, k3.LATENT_ROW, generator=gen) * 40).to(torch.bfloat16).to(DEVICE)
    scale = torch.tensor([0.37], device=DEVICE)
    padded = torch.full((5, 4, k3.LATENT_ROW), 0xA5, dtype=torch.uint8, device=DEVICE)
    scaled_quant(x, scale, padded[:, :3], fmt)
    assert torch.equal(padded[:, :3], quantize_fp8(x, scale, fmt).view(torch.uint8))
    assert padded[:, 3].eq(0xA5).all()
