"""Experiment (issue 28): the absorb kernels' rope lanes and scalar scales loaded before the operands.

Compiled for sm90 (Triton 3.6), a query program with a tensor-core dot stores its W slice to shared
memory right after W's load (Triton places the ``local_alloc`` of a dot operand at the operand's
load) and waits at a barrier for it; the shipped kernels load the rope lanes and the scales after
``query_operands``, so in the SASS those loads are issued after that barrier, once W has arrived: a
second memory round trip, overlapped only by the dot. Here the same query programs load the rope
lanes and the scales first, then a barrier (``EARLY_BARRIER``; without it ptxas sinks those loads
below the W tile's store again, and loading W first with the barrier after the small loads does not
help either: Triton places W's ``local_alloc``, its shared-memory store, right after W's load, before
the barrier), then q_nope and W (``early_bf16_kernel``, ``early_fp8_kernel``), launched
with the shipped launcher's arguments and configs, at 1-256 tokens, 12 and 16 heads (at 1 and 2 tokens
the shipped programs sum the products without a dot and have no such store: what the variant's
barrier costs by itself).

Every variant's q_out and cache bytes are compared with the shipped launch's (what it must write
poisoned first); the shipped and early launches are timed in five rounds taken in turn (medians of
64-launch CUDA graphs).

    PYTHONPATH=$PWD python scripts/absorb_early_loads.py OUT.json [--shapes bf16:12x8,fp8:16x64]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/absorb_early_loads.py --check   (CPU: bytes only)

Results in docs/benchmarks.md."""
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from k3_amd_overlay.kernels.absorb_qk_cache import (
    FEW_TOKEN_MOST,
    load_rope,
    product_in_steps,
    query_block,
    store_query,
    summed_products,
    write_kv_program,
)
from k3_amd_overlay.kernels.qk_cache import _fp8_bits
from k3_amd_overlay.kernels.rounding import to_dtype_rne

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from absorb_pipeline_sweep import kind_shapes
from absorb_small_dot import Shape  # the same inputs, shipped launch and bytes check

SHAPES = [(kind, heads, tokens) for kind in ("bf16", "fp8") for tokens in (1, 2, 8, 32, 64, 256) for heads in (12, 16)]


@triton.jit
def operands(q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, head, t64, live, offs_n, P: tl.constexpr):
    """The program's q_nope rows [BLOCK_T, P] and W slice [P, BLOCK_N]."""
    q_nope = tl.load(q_nope_ptr + t64 * s_qn_t + head * s_qn_h + tl.arange(0, P)[None, :], mask=live, other=0.0)
    offs_k = tl.arange(0, P)
    w = tl.load(w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n)
    return q_nope, w


@triton.jit
def early_bf16_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_k, s_w_n, s_qn_t, s_qn_h,
    q_pe_ptr, s_qp_t, s_qp_h, q_scale_ptr, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, K_STEPS: tl.constexpr, FP8_MODE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EMULATE_BF16: tl.constexpr, EARLY_BARRIER: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        column, head, t64, live, offs_n = query_block(pid, num_tokens, token_blocks, L, BLOCK_T, BLOCK_N)
        pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
        scale = tl.load(q_scale_ptr)
        if EARLY_BARRIER:
            tl.debug_barrier()
        if K_STEPS == 1:
            q_nope, w = operands(q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, head, t64, live, offs_n, P)
            if BLOCK_T <= FEW_TOKEN_MOST:
                ql = summed_products(q_nope, w)
            elif DOT_IN_FP32:
                ql = tl.dot(q_nope.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                ql = tl.dot(q_nope, w)
        else:
            ql = product_in_steps(q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, head, t64, live, offs_n,
                                  P, BLOCK_T, BLOCK_N, K_STEPS, DOT_IN_FP32)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


@triton.jit
def early_fp8_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_n, s_w_k, s_qn_t, s_qn_h,
    w_scale_ptr, q_scale_ptr, q_pe_ptr, s_qp_t, s_qp_h, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, W_FMAX: tl.constexpr, FP8_MODE: tl.constexpr, W_FP8_MODE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr, EARLY_BARRIER: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        column, head, t64, live, offs_n = query_block(pid, num_tokens, token_blocks, L, BLOCK_T, BLOCK_N)
        pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
        w_scale = tl.load(w_scale_ptr)
        scale = tl.load(q_scale_ptr)
        if EARLY_BARRIER:
            tl.debug_barrier()
        q_nope, w = operands(q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, head, t64, live, offs_n, P)
        amax = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), axis=1), 1e-10)[:, None]
        a_scale = amax * (1.0 / W_FMAX)
        a_recip = 1.0 / a_scale
        if DOT_IN_FP32:
            q8 = _fp8_bits(q_nope.to(tl.float32), a_recip, W_FMAX, W_FP8_MODE).to(w_ptr.dtype.element_ty, bitcast=True)
        else:
            q8 = tl.clamp(q_nope.to(tl.float32) * a_recip, -W_FMAX, W_FMAX).to(w_ptr.dtype.element_ty)
        if BLOCK_T <= FEW_TOKEN_MOST:
            ql = summed_products(q8, w)
        elif DOT_IN_FP32:
            ql = tl.dot(q8.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            ql = tl.dot(q8, w, max_num_imprecise_acc=0)
        ql = ql * a_scale * w_scale
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


class Early(Shape):
    """``Shape`` whose variant is the early-load kernel on the shipped launcher's grid and config."""

    def variant(self, config: dict, cache: torch.Tensor, q_out: torch.Tensor) -> None:
        self.launched_as(early_bf16_kernel if self.kind == "bf16" else early_fp8_kernel, config, cache, q_out)


def main() -> None:
    if "--check" in sys.argv:
        for kind in ("bf16", "fp8"):
            for heads, tokens in ((2, 1), (2, 19), (3, 40)):
                print(kind, heads, tokens, "bytes identical:", Early(kind, heads, tokens, "cpu").identical({}),
                      flush=True)
        return
    from k3_amd_overlay.commands.bench.timing import graphs_in_turn

    shapes = kind_shapes(sys.argv, SHAPES)
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for kind, heads, tokens in shapes:
        shape = Early(kind, heads, tokens, "cuda")
        cache, q_out = shape.outputs(False)
        row = {"kind": kind, "H": heads, "B": tokens, "identical": shape.identical({})}
        if row["identical"]:
            rounds = graphs_in_turn({"shipped": lambda: shape.shipped(cache, q_out),
                                     "early": lambda: shape.variant({}, cache, q_out)}, rounds=5)
            row["rounds"] = rounds
            row["medians"] = {n: statistics.median(t) for n, t in rounds.items()}
            row["shipped_over_early"] = round(row["medians"]["shipped"] / row["medians"]["early"], 3)
        results["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
