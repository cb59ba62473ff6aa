"""The fused decode site under vLLM's breakable CUDA-graph capture (vLLM 0.29's default for K3 on
ROCm; 0.30-0.33 with VLLM_USE_BREAKABLE_CUDAGRAPH=1): captured with a decode-only dummy batch, as
the model runner V2 captures every size, then replayed with decode, mixed and prefill batches.
Output and KV cache must equal the stock path run eagerly on the same batch, byte for byte.

The capture is tests/breakable_standin.py (vLLM's mechanism, no vLLM on the GPU machine); the site
is the overlay's own DecodeSite with its Triton qk_cache provider; the attention layer is a small
torch model of vLLM's MLA: the decode kernel reads only its decode metadata (sequence lengths of
decode rows, zero for prefill rows, as vLLM's decode metadata covers decode requests only), the
stock path attends every row with its true causal length."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import breakable_standin
import pytest
import torch

from k3_amd_overlay import k3
from k3_amd_overlay.fp8 import device_format
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant, DecodePlan
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.ops import qk_cache as qk_cache_op
from k3_amd_overlay.ops.reference import absorb_w_uk_reference
from k3_amd_overlay.targets.decode import DecodeSite, into_output

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]

TOKENS, HEADS, BLOCK, BLOCKS, CONTEXT = 8, 4, 16, 64, 40
NOPE, ROPE, LORA, V = k3.QK_NOPE_HEAD_DIM, k3.QK_ROPE_HEAD_DIM, k3.KV_LORA_RANK, k3.V_HEAD_DIM


@dataclass
class Metadata:  # what the site reads of vLLM's MLA metadata, plus the toy kernels' lengths
    num_actual_tokens: int
    num_decode_tokens: int


class ToyMLA:
    """vLLM's MLAAttention as the fused site uses it: scales, W_UK_T, the decode MQA kernel
    (``impl.forward_mqa``) and the V up-projection, over static buffers a graph can replay."""

    def __init__(self, fmt, generator):
        dev = "cuda"
        self.layer_name, self.kv_cache_dtype = "model.layers.0.self_attn.attn", "fp8"
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank = NOPE, ROPE, LORA
        self.fmt = fmt
        self.W_UK_T = (torch.randn(HEADS, NOPE, LORA, generator=generator, device=dev) / 12).bfloat16()
        self.W_UV = (torch.randn(HEADS, LORA, V, generator=generator, device=dev) / 24).bfloat16()
        self._k_scale = torch.tensor([0.9], device=dev)
        self._q_scale = torch.tensor([1.37], device=dev)
        self.kv_cache = torch.zeros(BLOCKS, BLOCK, LORA + ROPE, dtype=fmt.dtype, device=dev)
        self.slot_mapping = torch.zeros(TOKENS, dtype=torch.int64, device=dev)
        self.context_slots = torch.zeros(TOKENS, CONTEXT, dtype=torch.int64, device=dev)
        self.decode_lens = torch.zeros(TOKENS, dtype=torch.int64, device=dev)  # the decode kernel's metadata
        self.true_lens = torch.zeros(TOKENS, dtype=torch.int64, device=dev)  # every row's causal length
        self.metadata = Metadata(TOKENS, TOKENS)
        self.impl = SimpleNamespace(forward_mqa=self.forward_mqa)

    def attend(self, q_fp8: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        rows = self.kv_cache.view(-1, LORA + ROPE)[self.context_slots].float() * self._k_scale  # [T, C, 576]
        q = q_fp8.float() * self._q_scale
        scores = torch.einsum("thd,tcd->thc", q, rows) / 24.0
        live = torch.arange(CONTEXT, device=q.device)[None, None, :] < lens[:, None, None]
        weights = torch.softmax(scores.masked_fill(~live, float("-inf")), dim=-1)
        return torch.einsum("thc,tcl->thl", weights, rows[..., :LORA]).bfloat16()

    def forward_mqa(self, q_out, kv_cache, attn_metadata, layer):
        return self.attend(q_out, self.decode_lens), None

    def _v_up_proj(self, x, out):
        out.copy_(torch.einsum("thl,hlv->thv", x.float(), self.W_UV.float()).bfloat16().reshape(out.shape))

    def stock(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        """The unfused path for any batch: KV write, absorbed query quant, attention at each row's true
        causal length (a prefill row attends the prompt before it), V up-projection."""
        q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
        q_out = torch.empty(q.shape[0], HEADS, LORA + ROPE, dtype=self.fmt.dtype, device=q.device)
        qk_cache_op.run_provider("reference", absorb_w_uk_reference(q_nope, self.W_UK_T), q_pe, kv_c_normed,
                                 k_pe.reshape(q.shape[0], -1), self.kv_cache, self.slot_mapping, self._k_scale,
                                 self._q_scale, q_out, self.fmt)
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        self._v_up_proj(self.attend(q_out, self.true_lens), output)
        return output


def batch(attn: ToyMLA, decodes: int, generator) -> dict[str, torch.Tensor]:
    """``decodes`` one-token decode rows first (as vLLM orders them), then one prefill request's
    rows; fresh random activations; slots and lengths written into the layer's static buffers."""
    dev = "cuda"
    lens, slots = [], []
    for row in range(decodes):  # each decode request owns its own context of 9 + row tokens
        length = 9 + row
        base = row * (CONTEXT + 8)
        lens.append(length)
        slots.append(list(range(base, base + length)))
    prompt_base, prefill_rows = 10 * (CONTEXT + 8), TOKENS - decodes
    for i in range(prefill_rows):
        lens.append(i + 1)
        slots.append(list(range(prompt_base, prompt_base + i + 1)))
    context = torch.zeros(TOKENS, CONTEXT, dtype=torch.int64)
    for row, s in enumerate(slots):
        context[row, :len(s)] = torch.tensor(s)
    attn.context_slots.copy_(context)
    attn.slot_mapping.copy_(torch.tensor([s[-1] for s in slots]))
    attn.true_lens.copy_(torch.tensor(lens))
    attn.decode_lens.copy_(torch.tensor(lens[:decodes] + [0] * prefill_rows))
    attn.metadata = Metadata(TOKENS, decodes)
    return {"q": torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=generator, device=dev).bfloat16(),
            "kv_c": torch.randn(TOKENS, LORA, generator=generator, device=dev).bfloat16(),
            "k_pe": torch.randn(TOKENS, 1, ROPE, generator=generator, device=dev).bfloat16()}


def make_site(attn: ToyMLA, runs: list[int], eager_step) -> DecodeSite:
    plan = DecodePlan(LayerDecision(FusionState.APPLIED, "triton", "test"),
                      LayerDecision(FusionState.DISABLED, None, "not requested"), AbsorbVariant.BF16)
    return DecodeSite(plan=plan, on_effective=runs.append, on_absorb_effective=runs.append, fmt=attn.fmt,
                      context=lambda name: (attn.metadata, attn, attn.kv_cache, attn.slot_mapping),
                      query_heads=HEADS, eager_step=eager_step)


def replay_against_stock(broken: bool, monkeypatch) -> tuple[list[tuple[str, bool, bool]], list[int], int]:
    """Capture once with a decode-only batch, replay decode / mixed / prefill batches; per batch:
    (kind, output equal to stock's, KV cache equal to stock's)."""
    breakable_standin.install(monkeypatch)
    generator = torch.Generator(device="cuda").manual_seed(19)
    attn = ToyMLA(device_format(), generator)
    runs: list[int] = []
    site = make_site(attn, runs, breakable_standin.eager_break_during_capture(into_output) if broken else None)
    static = batch(attn, TOKENS, generator)
    result = torch.empty(TOKENS, HEADS * V, dtype=torch.bfloat16, device="cuda")

    def forward() -> None:  # the model around the layer: recorded graph segments before and after it
        q = static["q"] * 1
        out = site.attend(attn, attn.stock, q, static["kv_c"] + 0, static["k_pe"] + 0, output_shape=(TOKENS, HEADS * V))
        result.copy_(out * 1)

    forward()  # compile the kernel outside the capture, as vLLM's warm-up does
    torch.cuda.synchronize()
    capture = breakable_standin.BreakableCUDAGraphCapture()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), capture:
        forward()
    torch.cuda.synchronize()
    runs.clear()
    outcomes = []
    for kind, decodes in (("decode", TOKENS), ("mixed", 5), ("prefill", 0), ("decode", TOKENS)):
        fresh = batch(attn, decodes, generator)
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        before = torch.randn(attn.kv_cache.shape, generator=generator, device="cuda").to(attn.fmt.dtype)
        attn.kv_cache.copy_(before)
        result.fill_(float("nan"))
        capture.replay()
        torch.cuda.synchronize()
        got_out, got_cache = result.clone(), attn.kv_cache.clone()
        attn.kv_cache.copy_(before)
        want_out = attn.stock(static["q"], static["kv_c"], static["k_pe"], output_shape=(TOKENS, HEADS * V))
        outcomes.append((kind, torch.equal(got_out.view(torch.int16), want_out.view(torch.int16)),
                         torch.equal(got_cache.view(torch.uint8), attn.kv_cache.view(torch.uint8))))
    return outcomes, runs, capture.num_eager_breaks


def test_breakable_replays_of_decode_mixed_and_prefill_batches_equal_stock(monkeypatch):
    """The site as the overlay installs it under breakable graphs (an eager break): every replayed
    batch decides for itself; decode batches take the fused launch (counted once per replay)."""
    outcomes, runs, breaks = replay_against_stock(True, monkeypatch)
    assert outcomes == [("decode", True, True), ("mixed", True, True), ("prefill", True, True),
                        ("decode", True, True)]
    assert runs == [TOKENS, TOKENS] and breaks == 1


def test_the_replay_test_catches_a_site_recorded_into_the_graph(monkeypatch):
    """The planted fault (issue 19, fault 1; the site before the fix): the fused decode recorded with
    the capture's decode-only dummy batch is replayed for mixed and prefill batches: their output
    differs from stock's (decode batches still match), so the test above can fail."""
    outcomes, runs, breaks = replay_against_stock(False, monkeypatch)
    assert [kind for kind, out, _ in outcomes if not out] == ["mixed", "prefill"]
    assert breaks == 0 and runs == []
