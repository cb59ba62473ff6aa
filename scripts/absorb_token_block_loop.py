"""Experiment (issue 28): the absorbed bf16 launch at many tokens with query programs that keep their
W_UK_T slice and walk T_LOOP token blocks in a loop (load q_nope, dot, round, quant, store each), so
that a head's W slice is read once per column block, not once per token block, and Triton's loop
pipelining overlaps the next block's q_nope load with this block's dot and stores. The KV programs
are the shipped ones. Every candidate's q_out and cache bytes are compared with the shipped launch's
(the cache rows to be written poisoned first) and, on a GPU, timed under CUDA-graph replay (median)
beside the shipped launch and the two-launch path (``torch.bmm`` + ``qk_cache``) in the same call.

    PYTHONPATH=$PWD python scripts/absorb_token_block_loop.py OUT.json [HxB,...]      (a GPU, torch, Triton)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/absorb_token_block_loop.py --check   (CPU: bytes only)

Results (an H100, 2026-12-05: slower than the shipped launch at every shape) in docs/benchmarks.md.
The few-token counterpart, one token at a time without tensor cores, is
``absorb_token_loop_experiment.py``."""
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from k3_amd_overlay import k3
from k3_amd_overlay.commands.bench.kernels import bf16_weights, decode_step_inputs
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache, load_rope, store_query, write_kv_program
from k3_amd_overlay.kernels.qk_cache import fp8_mode, qk_cache
from k3_amd_overlay.kernels.rounding import emulate_bf16, to_dtype_rne

# (BLOCK_N, BLOCK_T, T_LOOP): a program's columns, its tokens a step, its steps
CANDIDATES = [(64, 64, 4), (64, 64, 2), (128, 64, 4), (128, 64, 2), (64, 32, 8), (64, 32, 4), (128, 32, 8),
              (128, 32, 4), (32, 64, 4), (256, 64, 2), (256, 64, 4), (32, 32, 8)]


@triton.jit
def token_loop_kernel(
    q_nope_ptr, w_ptr, q_pe_ptr, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, q_scale_ptr, q_out_ptr,
    s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, s_qp_t, s_qp_h, s_kv_t, s_kpe_t, s_c_blk, s_c_row, s_qo_t, s_qo_h,
    num_tokens, num_heads, block_size, fmax,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    T_LOOP: tl.constexpr, KV_ROWS: tl.constexpr, FP8_MODE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EMULATE_BF16: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    groups = tl.cdiv(tl.cdiv(num_tokens, BLOCK_T), T_LOOP)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * groups * column_blocks:
        column = pid % column_blocks
        group = (pid // column_blocks) % groups
        head = pid // (column_blocks * groups)
        offs_n = column * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, P)
        w = tl.load(w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n)
        if DOT_IN_FP32:
            w = w.to(tl.float32)
        scale = tl.load(q_scale_ptr)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        for step in tl.range(0, T_LOOP, num_stages=STAGES):
            tokens = (group * T_LOOP + step) * BLOCK_T + tl.arange(0, BLOCK_T)
            live = (tokens < num_tokens)[:, None]
            t64 = tokens.to(tl.int64)[:, None]
            q_nope = tl.load(q_nope_ptr + t64 * s_qn_t + head * s_qn_h + offs_k[None, :], mask=live, other=0.0)
            pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
            if DOT_IN_FP32:
                ql = tl.dot(q_nope.to(tl.float32), w, input_precision="ieee")
            else:
                ql = tl.dot(q_nope, w)
            ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
            store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * groups * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


def token_loop(q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt, bn, bt, loop,
               warps, stages, kv_rows=16):
    tokens, heads, nope = q_nope.shape
    lora, rope = w_uk_t.shape[-1], q_pe.shape[-1]
    groups = triton.cdiv(triton.cdiv(tokens, bt), loop)
    grid = (heads * groups * (lora // bn) + triton.cdiv(tokens, kv_rows),)
    gpu = q_nope.device.type == "cuda"
    token_loop_kernel[grid](
        q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out,
        q_nope.stride(0), q_nope.stride(1), w_uk_t.stride(0), w_uk_t.stride(1), w_uk_t.stride(2),
        q_pe.stride(0), q_pe.stride(1), kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        q_out.stride(0), q_out.stride(1), tokens, heads, cache.shape[1], fmt.fmax,
        P=nope, L=lora, R=rope, BLOCK_T=bt, BLOCK_N=bn, T_LOOP=loop, KV_ROWS=kv_rows,
        FP8_MODE=fp8_mode(fmt, q_nope.device), DOT_IN_FP32=not gpu, EMULATE_BF16=emulate_bf16(q_nope.device),
        STAGES=stages, num_warps=warps)


def inputs(tokens, heads, device):
    """The bench's decode-step inputs and bf16 W_UK_T, in the absorb launcher's argument order, with
    random cache bytes (rows not written keep their own) and a padding slot every seventh token."""
    q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads, device)
    cache.random_(0, 256)
    slots[3::7] = -1  # padding rows: no write
    return q_nope, bf16_weights(heads, device), q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out


def bytes_match(args, ref_cache, ref_out, *config):
    q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = args
    got_cache, got_out = ref_cache.clone(), torch.full_like(q_out, 0xAB)
    live = slots[slots >= 0]
    got_cache[live // cache.shape[1], live % cache.shape[1]] = 0x5A  # poison the rows to be written
    token_loop(q_nope, w_uk_t, q_pe, kv_c, k_pe, got_cache, slots, k_scale, q_scale, got_out, E4M3FN, *config)
    return torch.equal(got_out, ref_out) and torch.equal(got_cache, ref_cache)


def reference(args):
    q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = args
    ref_cache, ref_out = cache.clone(), torch.full_like(q_out, 0xAB)
    absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, ref_cache, slots, k_scale, q_scale, ref_out, E4M3FN)
    return ref_cache, ref_out


def check_on_cpu() -> None:
    """Bytes only, in Triton's interpreter: two partly filled groups, and a planted fault caught."""
    torch.manual_seed(0)
    args = inputs(37, 2, "cpu")
    ref_cache, ref_out = reference(args)
    for config in ((64, 16, 2, 4, 1), (128, 16, 3, 4, 2), (512, 16, 1, 4, 1)):
        print("bytes", config, bytes_match(args, ref_cache, ref_out, *config), flush=True)
    bad = list(args)
    bad[8] = args[8] * 1.01  # a wrong query scale
    print("planted wrong scale caught:", not bytes_match(tuple(bad), ref_cache, ref_out, 64, 16, 2, 4, 1))


def main() -> None:
    if "--check" in sys.argv:
        return check_on_cpu()
    from k3_amd_overlay.commands.bench.timing import graph_us

    shapes = [(16, 256), (12, 256), (16, 128), (12, 128)]
    if len(sys.argv) > 2:
        shapes = [(int(h), int(b)) for h, b in (s.split("x") for s in sys.argv[2].split(","))]
    rows = []
    for H, B in shapes:
        torch.manual_seed(H * 1000 + B)
        args = inputs(B, H, "cuda")
        ref_cache, ref_out = reference(args)
        q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = args
        ql_nope = torch.empty(B, H, k3.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")

        def two():
            torch.bmm(q_nope.transpose(0, 1), w_uk_t, out=ql_nope.transpose(0, 1))
            qk_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, E4M3FN)

        base, shipped = graph_us(two), graph_us(lambda: absorb_qk_cache(*args, E4M3FN))
        best = None
        for (bn, bt, loop), warps, stages, kv in itertools.product(CANDIDATES, (4, 8), (1, 2, 3), (16,)):
            config = (bn, bt, loop, warps, stages, kv)
            try:
                exact = bytes_match(args, ref_cache, ref_out, *config)
                torch.cuda.synchronize()
            except Exception as exc:  # out of shared memory or registers: report, go on
                print("fail", H, B, config, type(exc).__name__, str(exc)[:160], flush=True)
                continue
            us = graph_us(lambda: token_loop(*args, E4M3FN, *config))
            row = dict(H=H, B=B, bn=bn, bt=bt, loop=loop, warps=warps, stages=stages, kv=kv, us=round(us, 3),
                       shipped=round(shipped, 3), bmm_qk_cache=round(base, 3), exact=exact)
            rows.append(row)
            if exact and (best is None or us < best["us"]):
                best = row
        print(json.dumps(best and best | {"over_bmm_qk_cache": round(base / best["us"], 3),
                                          "shipped_over_bmm_qk_cache": round(base / shipped, 3)}), flush=True)
        with open(sys.argv[1], "w") as f:  # after each shape: a run cut short keeps what it measured
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
