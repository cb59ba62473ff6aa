"""fused_absorb_qk_cache: the W_UK absorption folded into the fused decode launch, against the
reference (the stock path's bmm in the query dtype, then the same quant), with poisoned outputs; and planted faults (a
transposed W_UK_T, heads swapped, a skipped head) are caught."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch
import triton
import triton.language as tl
from machine import DEVICE
from parity import (
    GPU_LAYOUTS,
    POISON_A,
    absorb_graph_replay_problems,
    absorb_problems,
    make_qk_case,
    skip_under_interpreter,
)

from k3_amd_overlay import k3
from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ, Fp8Format
from k3_amd_overlay.kernels import absorb_qk_cache, launch
from k3_amd_overlay.ops import fused_absorb_qk_cache

pytestmark = pytest.mark.kernels  # scripts/gpu_check.sh runs these on the GPU


def absorb_case(tokens: int, heads: int, fmt: Fp8Format, seed: int | None = None):
    case = make_qk_case(tokens, heads, fmt, device=DEVICE, extremes=False, seed=seed)
    gen = torch.Generator().manual_seed(seed or 0)
    q = torch.randn(tokens, heads, k3.QK_NOPE_HEAD_DIM + k3.QK_ROPE_HEAD_DIM, generator=gen)
    q = (q * 2).to(torch.bfloat16).to(DEVICE)
    # vLLM's W_UK_T is a permuted view of W_UK [L, N, P]; keep that layout
    w_uk = (torch.randn(k3.KV_LORA_RANK, heads, k3.QK_NOPE_HEAD_DIM, generator=gen) / 8).to(torch.bfloat16).to(DEVICE)
    return case, q[..., :128], w_uk.permute(1, 2, 0)


def run(case, q_nope, w, provider: str, poison: int):
    cache = torch.full(case.cache_shape, poison, dtype=torch.uint8, device=DEVICE)
    q_out = torch.full((*q_nope.shape[:2], k3.LATENT_ROW), poison, dtype=torch.uint8, device=DEVICE)
    fused_absorb_qk_cache(q_nope, w, case.q_pe, case.kv_c, case.k_pe, cache, case.slot_mapping, case.k_scale,
                          case.q_scale, q_out=q_out.view(case.fmt.dtype), provider=provider,
                          kv_format=case.fmt.name)
    return cache, q_out


def problems(case, q_nope, w, runner=None) -> list[str]:
    runner = runner or (lambda c, q, ww, p: run(c, q, ww, "triton", p))
    return absorb_problems(case, lambda poison: runner(case, q_nope, w, poison),
                           run(case, q_nope, w, "reference", POISON_A))


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ], ids=lambda f: f.name)
@pytest.mark.parametrize("heads", [1, 3, 12, 16])
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 256])
def test_absorb_matches_reference(fmt, heads, tokens):
    skip_under_interpreter(tokens, heads, fmt)
    case, q_nope, w = absorb_case(tokens, heads, fmt)
    assert problems(case, q_nope, w) == []


ONE_TOKEN = GPU_LAYOUTS["absorb_one_token"]  # programs of one token: no tensor-core tile
FEW_TOKENS = GPU_LAYOUTS["absorb_few_tokens"]  # programs of two tokens: no tensor-core tile either
EIGHT_TOKENS = GPU_LAYOUTS["absorb_eight_token_dot"]  # programs of eight tokens: a dot of 8 rows


@pytest.mark.parametrize(("tokens", "heads"), [(1, 12), (1, 16), (3, 16), (7, 3)])
def test_one_token_programs_match_the_reference(tokens, heads):
    """BLOCK_T 1 (the GPU rules' one-token path): the exact bf16 products summed in fp32."""
    case, q_nope, w = absorb_case(tokens, heads, E4M3FN, seed=tokens + heads)
    with launch.forced(ONE_TOKEN):
        assert problems(case, q_nope, w) == []


@pytest.mark.parametrize(("tokens", "heads", "block_t"), [(2, 12, 2), (5, 3, 2), (4, 16, 2), (7, 3, 4)])
def test_few_token_programs_match_the_reference(tokens, heads, block_t):
    """BLOCK_T 2 (the GPU rules' two-token path) and 4 (the most without a dot): the exact bf16
    products summed in fp32, the last token block part-filled at 5 and 7 tokens."""
    case, q_nope, w = absorb_case(tokens, heads, E4M3FN, seed=tokens * heads)
    with launch.forced({**FEW_TOKENS, "BLOCK_T": block_t, "BLOCK_N": FEW_TOKENS["BLOCK_N"] * 2 // block_t}):
        assert problems(case, q_nope, w) == []


@pytest.mark.parametrize(("tokens", "heads"), [(8, 4), (11, 3), (3, 16)])
def test_eight_token_dots_match_the_reference(tokens, heads):
    """BLOCK_T 8 (sm90's 8-token path): a dot of 8 rows, which Triton pads onto the tensor cores; one
    token block part-filled at 3 tokens, the second at 11."""
    case, q_nope, w = absorb_case(tokens, heads, E4M3FN, seed=tokens + 2 * heads)
    with launch.forced(EIGHT_TOKENS):
        assert problems(case, q_nope, w) == []


@pytest.mark.parametrize("config", [None, ONE_TOKEN, FEW_TOKENS, EIGHT_TOKENS],
                         ids=["shipped", "one_token", "few_tokens", "eight_tokens"])
@pytest.mark.parametrize("fault", ["transposed", "heads_swapped", "skipped_head"])
def test_planted_faults_are_caught(fault, config):
    case, q_nope, w = absorb_case(7, 3, E4M3FNUZ, seed=3)

    def mutated(c, q, ww, poison):
        if fault == "transposed":  # W_UK read as if [H, L, P]
            ww = ww.transpose(1, 2).contiguous().view(ww.shape)
        elif fault == "heads_swapped":
            ww = ww[[1, 0, 2]]
        cache, q_out = run(c, q, ww, "triton", poison)
        if fault == "skipped_head":  # the last head's query never written
            q_out[:, 2] = poison
        return cache, q_out

    with launch.forced(config) if config else contextlib.nullcontext():
        assert any(p.startswith("q_out") for p in problems(case, q_nope, w, mutated))


@pytest.mark.parametrize("kv_rows", [4, 16])
@pytest.mark.parametrize("tokens", [7, 33])
def test_kv_programs_of_several_rows_write_each_valid_row_once(kv_rows, tokens):
    """KV programs of KV_ROWS tokens each (the many-token configs): a last program only partly
    filled, padding slots among the rows, each valid row written with the reference's bytes and
    nothing else."""
    case, q_nope, w = absorb_case(tokens, 2, E4M3FN, seed=11)
    with launch.forced({"BLOCK_N": 128, "BLOCK_T": 16, "KV_ROWS": kv_rows, "num_warps": 4}):
        assert problems(case, q_nope, w) == []


def test_a_kv_program_left_out_is_caught(monkeypatch):
    """Planted fault for the test above: the grid one KV program short, so the last KV_ROWS tokens'
    rows are never written."""
    case, q_nope, w = absorb_case(34, 2, E4M3FN, seed=11)  # the last KV program holds tokens 32-33; 33 has a slot
    real = absorb_qk_cache.absorb_launch

    def short(*args, **kwargs):
        (programs,), config = real(*args, **kwargs)
        return (programs - 1,), config

    monkeypatch.setattr(absorb_qk_cache, "absorb_launch", short)
    with launch.forced({"BLOCK_N": 128, "BLOCK_T": 16, "KV_ROWS": 16, "num_warps": 4}):
        assert "cache: written bytes are not exactly the valid slots' rows" in problems(case, q_nope, w)


SLICED = {"BLOCK_N": 64, "BLOCK_T": 16, "KV_ROWS": 4, "num_warps": 4}


@pytest.mark.parametrize("k_steps", [2, 4, 8])
def test_the_dot_in_pipelined_slices_gives_the_one_dot_bytes(k_steps):
    """K_STEPS (the many-token configs): the dot over P in slices writes the reference's bytes, and
    exactly the bytes of the same launch with one dot."""
    case, q_nope, w = absorb_case(33, 2, E4M3FN, seed=5)
    with launch.forced({**SLICED, "K_STEPS": k_steps}):
        assert problems(case, q_nope, w) == []
        sliced = run(case, q_nope, w, "triton", POISON_A)
    with launch.forced(SLICED):
        one = run(case, q_nope, w, "triton", POISON_A)
    assert all(torch.equal(a, b) for a, b in zip(sliced, one, strict=True))


def test_a_slice_left_out_of_the_dot_is_caught(monkeypatch):
    """Planted fault for the test above: the last of the K_STEPS slices of P never multiplied."""

    @triton.jit
    def short(q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, head, t64, live, offs_n, P: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, K_STEPS: tl.constexpr, DOT_IN_FP32: tl.constexpr):
        BLOCK_K: tl.constexpr = P // K_STEPS
        offs_k = tl.arange(0, BLOCK_K)
        q_ptrs = q_nope_ptr + t64 * s_qn_t + head * s_qn_h + offs_k[None, :]
        w_ptrs = w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k in range(K_STEPS - 1):
            q_nope = tl.load(q_ptrs + k * BLOCK_K, mask=live, other=0.0).to(tl.float32)
            acc = tl.dot(q_nope, tl.load(w_ptrs + k * BLOCK_K * s_w_k).to(tl.float32), acc, input_precision="ieee")
        return acc

    monkeypatch.setattr(absorb_qk_cache, "product_in_steps", short)
    # a new kernel object: a GPU's compiled kernel keeps the helper it was first compiled with
    fresh = triton.jit(absorb_qk_cache.absorb_qk_cache_kernel.fn)
    monkeypatch.setattr(absorb_qk_cache, "absorb_qk_cache_kernel", fresh)
    case, q_nope, w = absorb_case(33, 2, E4M3FN, seed=5)
    with launch.forced({**SLICED, "K_STEPS": 4}):
        assert any(p.startswith("q_out") for p in problems(case, q_nope, w))


def test_fp8_bmm_weights_are_refused_with_a_reason():
    case, q_nope, w = absorb_case(2, 3, E4M3FN)
    with pytest.raises(ValueError, match="fused_absorb_fp8_qk_cache takes vLLM's fp8 W_K"):
        fused_absorb_qk_cache(q_nope, w.to(torch.float8_e4m3fn), case.q_pe, case.kv_c, case.k_pe,
                              torch.zeros(case.cache_shape, dtype=torch.uint8, device=DEVICE), case.slot_mapping,
                              case.k_scale, case.q_scale, kv_format="e4m3fn")


def graph_replay_problems(tokens: int, heads: int) -> list[str]:
    """Captured once, replayed on new inputs, new slots and new weights (``absorb_graph_replay_problems``)."""
    return absorb_graph_replay_problems(partial(absorb_case, tokens, heads, E4M3FN),
                                        fused_absorb_qk_cache)


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "heads"), [(1, 12), (2, 12), (2, 16), (32, 12), (256, 12), (256, 16)])
def test_absorb_graph_replay_with_new_inputs(tokens, heads):
    """At 2 tokens the sm90 rules take programs of two tokens (no dot); at 256 KV programs of several rows."""
    assert graph_replay_problems(tokens, heads) == []


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 256])
def test_a_kv_program_left_out_of_the_graph_is_caught(monkeypatch, tokens):
    """Planted fault for the test above: the captured grid one KV program short, so the last
    KV_ROWS tokens' rows are never written on replay."""
    real = absorb_qk_cache.absorb_launch

    def short(*args, **kwargs):
        (programs,), config = real(*args, **kwargs)
        return (programs - 1,), config

    monkeypatch.setattr(absorb_qk_cache, "absorb_launch", short)
    assert any(p.startswith("seed 2: cache:") for p in graph_replay_problems(tokens, 12))


def test_non_power_of_two_widths_make_the_triton_provider_unavailable():
    """The decision reads the same availability as the op: a layer with P, L or R not a power of
    two is refused the Triton path with the reason, instead of reaching the kernel."""
    from k3_amd_overlay.ops import ProviderUnavailable, absorb_qk_cache

    missing = absorb_qk_cache.provider_missing(DEVICE, 96, 512, 64)
    assert "power-of-two P, L, R (got 96, 512, 64)" in missing["triton"] and missing["reference"] is None
    case, q_nope, w = absorb_case(2, 3, E4M3FN)
    with pytest.raises(ProviderUnavailable, match="power-of-two"):
        fused_absorb_qk_cache(q_nope[..., :96], w[:, :96], case.q_pe, case.kv_c, case.k_pe,
                              torch.zeros(case.cache_shape, dtype=torch.uint8, device=DEVICE), case.slot_mapping,
                              case.k_scale, case.q_scale, kv_format="e4m3fn", provider="triton")
