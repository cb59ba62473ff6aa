"""Experiment (issue 28): where the absorbed bf16 launch's time goes at 1-8 tokens (other batches
on the command line). One kernel built
from the shipped kernel's own pieces (``kernels/absorb_qk_cache.py``) with parts switched off by
constexprs, each timed under CUDA-graph replay (median) at the shipped config of the shape, beside
the shipped launch and the floors (an empty launch, a one-load launch):

- ``full``: every part (its bytes are checked against the shipped launch's: identical);
- ``no_kv``: the query programs only, no KV program;
- ``kv_only``: the KV programs only;
- ``no_dot``: W loaded, the dot replaced by two row/column sums (both loads kept live);
- ``q_only``: no W and no dot: each query program loads its [BLOCK_T, BLOCK_N] share of q_nope's
  columns and quantises and stores it with the rope lanes (the concat-and-quant work in this grid);
- ``w_read``: the query programs load their W slice and store its column sums, quantised (the W
  read with the program's one reduction, nothing of q); KV programs as shipped;
- ``no_rope``: every part but the rope lanes (no q_pe load, no rope store);
- ``kv_first``: every part, the KV programs taking the first program ids (dispatched first) rather
  than the last; its bytes are checked against the shipped launch's too.

Beside them, at 2-8 tokens: the shipped launch with programs of fewer tokens than a tensor-core tile
forced (``FEW_TOKEN_CONFIGS``: BLOCK_T 1-8, the exact products summed in fp32), bytes checked.

Programs of one token (BLOCK_T 1, the shipped rule at one token) sum the exact products in fp32, as
the shipped kernel does, where the others take ``tl.dot``.

Also printed: W_UK_T's bytes at the measured copy bandwidth (the least a launch that reads them adds),
and vLLM's bf16 W_UK step alone (``torch.bmm``, cuBLAS here) for the same tokens and heads.

    PYTHONPATH=$PWD python scripts/absorb_chain_ablation.py OUT.json [B ...]   (a GPU, torch, Triton)

Timings, not bytes, are the point of the variants other than ``full``; results in docs/benchmarks.md."""
import json
import sys

import torch
import triton
import triton.language as tl

from k3_amd_overlay.commands.bench.baselines import _empty_kernel, _one_load_kernel
from k3_amd_overlay.commands.bench.kernels import bf16_weights, decode_step_inputs
from k3_amd_overlay.commands.bench.timing import bandwidth_bytes_per_us, graph_us
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import launch
from k3_amd_overlay.kernels.absorb_qk_cache import (
    FEW_TOKEN_MOST,
    absorb_launch,
    absorb_qk_cache,
    load_rope,
    query_rows,
    store_query,
    summed_products,
    write_kv_program,
)
from k3_amd_overlay.kernels.names import ABSORB_QK_CACHE_KERNEL
from k3_amd_overlay.kernels.qk_cache import fp8_mode
from k3_amd_overlay.kernels.rounding import emulate_bf16, to_dtype_rne

VARIANTS = {  # name: (QUERY, KV, W, Q, ROPE, KV_FIRST)  W: 0 none, 1 loaded and multiplied, 2 loaded and summed
    "full": (True, True, 1, True, True, False),
    "no_kv": (True, False, 1, True, True, False),
    "kv_only": (False, True, 1, True, True, False),
    "no_dot": (True, True, 2, True, True, False),
    "q_only": (True, True, 0, True, True, False),
    "w_read": (True, True, 2, False, True, False),
    "no_rope": (True, True, 1, True, False, False),
    "kv_first": (True, True, 1, True, True, True),
}
EXACT = ("full", "kv_first")
FEW_TOKEN_CONFIGS = [{"BLOCK_N": n, "BLOCK_T": t, "num_warps": w} for t, n, w in (
    (1, 16, 1), (1, 32, 1), (1, 16, 2), (2, 16, 1), (2, 16, 2), (4, 16, 2), (4, 16, 4), (8, 16, 4), (8, 8, 4),
    (8, 16, 8))]  # variants whose bytes must equal the shipped launch's


@triton.jit
def ablated_kernel(q_nope_ptr, w_ptr, q_pe_ptr, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, q_scale_ptr,
                   q_out_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, s_qp_t, s_qp_h, s_kv_t, s_kpe_t, s_c_blk,
                   s_c_row, s_qo_t, s_qo_h, num_tokens, num_heads, block_size, fmax,
                   P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                   KV_ROWS: tl.constexpr, FP8_MODE: tl.constexpr, QUERY: tl.constexpr, W: tl.constexpr,
                   Q: tl.constexpr, ROPE: tl.constexpr, KV_FIRST: tl.constexpr, EMULATE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    query_programs = num_heads * token_blocks * column_blocks if QUERY else 0
    kv_programs = tl.cdiv(num_tokens, KV_ROWS)
    if KV_FIRST:  # the KV programs first: query program i is program kv_programs + i
        pid = tl.where(pid < kv_programs, pid + query_programs, pid - kv_programs)
    if pid < query_programs:
        column, head, t64, live, offs_n, q_nope = query_rows(pid, q_nope_ptr, s_qn_t, s_qn_h, num_tokens,
                                                             token_blocks, P, L, BLOCK_T, BLOCK_N)
        offs_k = tl.arange(0, P)
        pe, rope = load_rope(column, head, t64, live & ROPE, q_pe_ptr, s_qp_t, s_qp_h, R)
        scale = tl.load(q_scale_ptr)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        if W == 0:
            ql = tl.load(q_nope_ptr + t64 * s_qn_t + head * s_qn_h + (offs_n % P)[None, :], mask=live,
                         other=0.0).to(tl.float32)
        else:
            w = tl.load(w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n)
            if W == 1 and BLOCK_T <= FEW_TOKEN_MOST:
                ql = summed_products(q_nope, w)
            elif W == 1 and EMULATE_BF16:  # Triton's CPU interpreter: the same products in fp32
                ql = tl.dot(q_nope.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            elif W == 1:
                ql = tl.dot(q_nope, w)
            else:
                ql = tl.sum(w.to(tl.float32), axis=0)[None, :] + tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
                if Q:
                    ql += tl.sum(q_nope.to(tl.float32), axis=1)[:, None]
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - query_programs, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr,
                         s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS, FP8_MODE)


def ablated(variant, q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt):
    query, kv, w, q, rope, kv_first = VARIANTS[variant]
    T, H, P = q_nope.shape
    L, R = w_uk_t.shape[-1], q_pe.shape[-1]
    (programs,), config = absorb_launch(ABSORB_QK_CACHE_KERNEL, q_nope, L, None, None, None)
    config.pop("K_STEPS")  # the variants are of the one-dot program (the shipped config at 1-8 tokens)
    kv_programs = triton.cdiv(T, config["KV_ROWS"])
    grid = ((programs if query else kv_programs) - (0 if kv else kv_programs),)
    ablated_kernel[grid](q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out,
                         q_nope.stride(0), q_nope.stride(1), w_uk_t.stride(0), w_uk_t.stride(1), w_uk_t.stride(2),
                         q_pe.stride(0), q_pe.stride(1), kv_c.stride(0), k_pe.stride(0), cache.stride(0),
                         cache.stride(1), q_out.stride(0), q_out.stride(1), T, H, cache.shape[1], fmt.fmax,
                         P=P, L=L, R=R, FP8_MODE=fp8_mode(fmt, q_nope.device), QUERY=query, W=w, Q=q,
                         ROPE=rope, KV_FIRST=kv_first, EMULATE_BF16=emulate_bf16(q_nope.device), **config)


def main(out_path: str, batches: tuple[int, ...] = (1, 2, 8)) -> None:
    fmt = E4M3FN
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    floors = {"empty": graph_us(lambda: _empty_kernel[(1,)](x)), "one_load": graph_us(lambda: _one_load_kernel[(128,)](x, y))}
    bandwidth = bandwidth_bytes_per_us()
    print(json.dumps({k: round(v, 3) for k, v in floors.items()} | {"copy_TB_s": round(bandwidth / 1e6, 2)}),
          flush=True)
    rows = []
    for H in (12, 16):
        w_uk_t = bf16_weights(H)
        for B in batches:
            q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(B, H)
            ref_cache, ref_out = cache.clone(), torch.full_like(q_out, 0xAB)
            absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, ref_cache, slots, k_scale, q_scale, ref_out, fmt)
            row = {"H": H, "B": B, "w_bytes_us": round(w_uk_t.numel() * 2 / bandwidth, 3)}
            for variant in EXACT:
                got_cache, got_out = cache.clone(), torch.full_like(q_out, 0xAB)
                ablated(variant, q_nope, w_uk_t, q_pe, kv_c, k_pe, got_cache, slots, k_scale, q_scale, got_out, fmt)
                torch.cuda.synchronize()
                row[f"{variant}_bytes_identical"] = torch.equal(got_cache, ref_cache) and torch.equal(got_out, ref_out)
            args = (q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)
            ql_nope = torch.empty(B, H, w_uk_t.shape[-1], dtype=q_nope.dtype, device="cuda")
            for rnd in range(2):  # two rounds in turn, the median of each kept
                row[f"shipped_{rnd}"] = round(graph_us(lambda: absorb_qk_cache(*args)), 3)
                row[f"bmm_{rnd}"] = round(graph_us(
                    lambda: torch.bmm(q_nope.transpose(0, 1), w_uk_t, out=ql_nope.transpose(0, 1))), 3)
                for variant in VARIANTS:
                    row[f"{variant}_{rnd}"] = round(graph_us(lambda v=variant: ablated(v, *args)), 3)
            for config in FEW_TOKEN_CONFIGS if B > 1 else ():
                name = "forced_T{BLOCK_T}_N{BLOCK_N}_w{num_warps}".format(**config)
                got_cache, got_out = cache.clone(), torch.full_like(q_out, 0xAB)
                with launch.forced(config):
                    try:
                        absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, got_cache, slots, k_scale, q_scale,
                                        got_out, fmt)
                        torch.cuda.synchronize()
                    except Exception as exc:  # out of registers or shared memory: report, go on
                        row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
                        continue
                    row[f"{name}_bytes_identical"] = torch.equal(got_cache, ref_cache) and torch.equal(got_out, ref_out)
                    row[name] = round(graph_us(lambda: absorb_qk_cache(*args)), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump({"floors": floors, "copy_bytes_per_us": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(b) for b in sys.argv[2:]) or (1, 2, 8))
