#!/usr/bin/env python3
"""Make the real GPU profiler traces kept in tests/data for the census's region attribution: an
eager decode window of STEPS steps x LAYERS K3-like decoder layers, recorded by torch.profiler, once
stock and once fused, through the overlay's own sites (QkvNormSite, DecodeSite: the code that opens
the profiler ranges in a vLLM process). Around them, the model's other work the census must not
count: an input and a post-attention RMSNorm (a kernel named like vLLM's ``fused_add_rms_norm_kernel``),
the q_a, q_b and o projections and a MoE-like batched GEMM, and, inside the decode region, the
attention kernel and the W_UV GEMM.

    PYTHONPATH=. python3 scripts/make_region_traces.py OUTDIR      (needs a GPU; no vLLM)

Known counts per trace (STEPS x LAYERS = N layer calls): stock: 2N ``rms_norm_kernel`` in the qkv_norm
ranges (and 2N ``fused_add_rms_norm_kernel`` outside them), in the decode ranges N KV writes
(``concat_and_cache_mla``), N W_UK GEMMs, N concat-and-quant kernels (inductor's, as vLLM's); fused: N ``rmsnorm_pair_kernel``
and N ``absorb_qk_cache_kernel``, no W_UK GEMM. The script prints each trace's kernel names."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from make_gpu_trace import export_gzipped  # scripts/, beside this one

from k3_amd_overlay import k3
from k3_amd_overlay.commands.bench.baselines import concat_and_cache_mla_like_kernel
from k3_amd_overlay.fp8 import device_format
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant, DecodePlan
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.kernels.qk_cache import fp8_mode
from k3_amd_overlay.ops.reference import absorb_w_uk_reference
from k3_amd_overlay.targets.decode import DecodeSite
from k3_amd_overlay.targets.norm import QkvNormCallback, QkvNormSite

STEPS, LAYERS, HEADS, TOKENS, HIDDEN, EXPERTS = 3, 4, 8, 4, 1024, 4
NOPE, ROPE, LORA, V, Q_LORA = k3.QK_NOPE_HEAD_DIM, k3.QK_ROPE_HEAD_DIM, k3.KV_LORA_RANK, k3.V_HEAD_DIM, k3.Q_LORA_RANK


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr):  # named as vLLM's
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def fused_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr):  # as vLLM's
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32) + \
        tl.load(res_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(res_ptr + row * D + cols, x.to(res_ptr.dtype.element_ty), mask=cols < D)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * D + cols, (x * inv * w).to(x_ptr.dtype.element_ty), mask=cols < D)


class Norm:
    """An RMSNorm module as the site reads it: weight, variance_epsilon, called on a tensor."""

    def __init__(self, dim: int) -> None:
        self.weight = (1 + 0.1 * torch.randn(dim, device="cuda")).bfloat16()
        self.variance_epsilon = 1e-6

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        rms_norm_kernel[(x.shape[0],)](x, self.weight, out, self.variance_epsilon, D=x.shape[1],
                                       BLOCK=triton.next_power_of_2(x.shape[1]))
        return out


class Layer:
    def __init__(self, fmt, fused: bool, runs: list[int]) -> None:
        dev = "cuda"
        self.fmt, self.fused = fmt, fused
        self.q_norm, self.kv_norm, self.in_norm, self.post_norm = Norm(Q_LORA), Norm(LORA), Norm(HIDDEN), Norm(HIDDEN)
        self.w_qa = torch.randn(Q_LORA + LORA + ROPE, HIDDEN, device=dev).bfloat16() / 32
        self.w_qb = torch.randn(HEADS * (NOPE + ROPE), Q_LORA, device=dev).bfloat16() / 40
        self.w_o = torch.randn(HIDDEN, HEADS * V, device=dev).bfloat16() / 32
        self.w_moe = torch.randn(EXPERTS, HIDDEN, HIDDEN, device=dev).bfloat16() / 32
        self.attn = SimpleNamespace(
            layer_name="model.layers.0.self_attn.attn", kv_cache_dtype="fp8", qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE, kv_lora_rank=LORA,
            W_UK_T=(torch.randn(HEADS, NOPE, LORA, device=dev) / 12).bfloat16(),
            W_UV=(torch.randn(HEADS, LORA, V, device=dev) / 24).bfloat16(),
            _k_scale=torch.tensor([0.9], device=dev), _q_scale=torch.tensor([1.1], device=dev),
            impl=SimpleNamespace(forward_mqa=self.forward_mqa), _v_up_proj=self.v_up_proj)
        self.cache = torch.zeros(16, 16, LORA + ROPE, dtype=fmt.dtype, device=dev)
        self.slots = torch.arange(TOKENS, device=dev, dtype=torch.int64) * 3
        # the concat and the static quant compiled together, as vLLM's stock decode runs them (one inductor kernel)
        self.cat_quant = torch.compile(lambda ql, qp, s: (torch.cat([ql, qp], dim=-1).float() * torch.reciprocal(s))
                                       .clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype))
        state = FusionState.APPLIED if fused else FusionState.FORCED_STOCK
        self.norm_site = QkvNormSite(LayerDecision(state, "triton" if fused else None, "trace"),
                                     QkvNormCallback(self.q_norm, self.kv_norm, "triton") if fused else None,
                                     runs.append)
        plan = DecodePlan(LayerDecision(FusionState.DISABLED, None, "not requested"),
                          LayerDecision(state, "triton" if fused else None, "trace"), AbsorbVariant.BF16)
        metadata = SimpleNamespace(num_actual_tokens=TOKENS, num_decode_tokens=TOKENS)
        self.decode_site = DecodeSite(plan=plan, on_effective=runs.append, on_absorb_effective=runs.append,
                                      fmt=fmt if fused else None, query_heads=HEADS,
                                      context=(lambda name: (metadata, self.attn, self.cache, self.slots))
                                      if fused else None)

    def forward_mqa(self, q_out, kv_cache, attn_metadata, layer):
        rows = kv_cache.view(-1, LORA + ROPE)[:TOKENS * 3].float()
        scores = torch.softmax(torch.einsum("thd,cd->thc", q_out.float(), rows) / 24.0, dim=-1)
        return torch.einsum("thc,cl->thl", scores, rows[:, :LORA]).bfloat16(), None

    def v_up_proj(self, x, out):
        torch.bmm(x.transpose(0, 1), self.attn.W_UV, out=out.view(-1, HEADS, V).transpose(0, 1))

    def stock_attention(self, q, kv_c, k_pe, output_shape=None, q_dcp_replicated=None):
        """vLLM's unfused decode: KV write, W_UK absorption, concat, static query quant, MQA, W_UV."""
        concat_and_cache_mla_like_kernel[(TOKENS,)](kv_c, k_pe, self.cache.view(torch.uint8), self.slots,
                                                    self.attn._k_scale,
                                                    kv_c.stride(0), k_pe.stride(0), self.cache.stride(0),
                                                    self.cache.stride(1), 16, self.fmt.fmax, L=LORA, R=ROPE,
                                                    FP8_MODE=fp8_mode(self.fmt, q.device), num_warps=4)
        q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
        ql_nope = absorb_w_uk_reference(q_nope, self.attn.W_UK_T)
        q_out = self.cat_quant(ql_nope, q_pe, self.attn._q_scale)
        attn_out, _ = self.forward_mqa(q_out, self.cache, None, self.attn)
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        self.v_up_proj(attn_out, output)
        return output

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        fused_add_rms_norm_kernel[(TOKENS,)](hidden, residual, self.in_norm.weight, 1e-6, D=HIDDEN, BLOCK=HIDDEN)
        latent = torch.nn.functional.linear(hidden, self.w_qa)
        q_c, kv_c, k_pe = latent.split([Q_LORA, LORA, ROPE], dim=-1)
        q_c, kv_c = self.norm_site.normalize(self.q_norm, self.kv_norm, None, q_c.contiguous(), kv_c.contiguous())
        q = torch.nn.functional.linear(q_c, self.w_qb).view(TOKENS, HEADS, NOPE + ROPE)
        out = self.decode_site.attend(self.attn, self.stock_attention, q, kv_c, k_pe.contiguous().unsqueeze(1),
                                      output_shape=(TOKENS, HEADS * V))
        hidden = torch.nn.functional.linear(out, self.w_o)
        fused_add_rms_norm_kernel[(TOKENS,)](hidden, residual, self.post_norm.weight, 1e-6, D=HIDDEN, BLOCK=HIDDEN)
        return torch.bmm(hidden.expand(EXPERTS, -1, -1), self.w_moe).sum(0).bfloat16()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    fmt = device_format()
    for name, fused in (("stock", False), ("fused", True)):
        runs: list[int] = []
        layers = [Layer(fmt, fused, runs) for _ in range(LAYERS)]

        def step() -> None:
            hidden = torch.randn(TOKENS, HIDDEN, device="cuda").bfloat16()
            residual = torch.zeros_like(hidden)
            for layer in layers:
                hidden = layer(hidden, residual)

        step()  # compile outside the window
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
        export_gzipped(prof, out / f"region-{name}-rank0.json", name)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "trace-out"))
