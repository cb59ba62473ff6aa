"""Experiment (issue 28): what separates the shipped absorbed launch at one token (one-token programs:
BLOCK_T 1, BLOCK_N 16, one warp) from a launch that only reads ``W_UK_T`` in the same layout (0.6 µs on
the H200: 2.18 against 1.52 µs in ``w_read_floor.py``). One kernel, parts added one at a time:

- ``r0_read``: load the W slice, store its fp32 column sums (``w_read_floor.py``'s kernel, this layout);
- ``r1_product``: also load the query row, store the fp32 products summed over P instead;
- ``r2_quant``: the column sums rounded to bf16, quantised with a constant scale, stored as fp8 codes;
- ``r3_scale``: the same with the query scale loaded (``1 / q_scale``, as shipped);
- ``r4_rope``: and column block 0's programs load and store the rope lanes;
- ``r5_query``: the products instead of the column sums (every query-program part, no KV program);
- ``r6_full``: and the KV program: the shipped kernel's work (bytes checked against the shipped launch).

Beside them ``floor``: ``w_read_floor.py``'s own read-only kernel in the same layout (BLOCK_N 16, one
warp, one program per head and column block), so that the floor of 2026-12-03 and ``r0_read`` are
compared in one call on one GPU.

Each under CUDA-graph replay (median; graphs of 64 launches; ``--graphs 20 64`` for both sizes), three
rounds in turn, beside the shipped launch, an empty launch and a one-load launch.

    PYTHONPATH=$PWD python scripts/absorb_one_token_ladder.py OUT.json      (a GPU, torch, Triton)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/absorb_one_token_ladder.py --check   (CPU: bytes only)

Results in docs/benchmarks.md."""
import json
import sys

import torch
import triton
import triton.language as tl

from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels.absorb_qk_cache import (
    absorb_qk_cache,
    load_rope,
    query_block,
    summed_products,
    write_kv_program,
)
from k3_amd_overlay.kernels.qk_cache import _fp8_bits, fp8_mode
from k3_amd_overlay.kernels.rounding import emulate_bf16, to_dtype_rne

RUNGS = {  # name: (QROW, QUANT, SCALE, ROPE, KV)
    "r0_read": (False, False, False, False, False),
    "r1_product": (True, False, False, False, False),
    "r2_quant": (False, True, False, False, False),
    "r3_scale": (False, True, True, False, False),
    "r4_rope": (False, True, True, True, False),
    "r5_query": (True, True, True, True, False),
    "r6_full": (True, True, True, True, True),
}
BLOCK_N, WARPS = 16, 1  # sm90.json's one-token rule at 3-16 heads


@triton.jit
def ladder_kernel(q_nope_ptr, w_ptr, q_pe_ptr, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, q_scale_ptr,
                  q_out_ptr, sums_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, s_qp_t, s_qp_h, s_kv_t, s_kpe_t,
                  s_c_blk, s_c_row, s_qo_t, s_qo_h, num_tokens, num_heads, block_size, fmax,
                  P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, FP8_MODE: tl.constexpr,
                  QROW: tl.constexpr, QUANT: tl.constexpr, SCALE: tl.constexpr, ROPE: tl.constexpr,
                  KV: tl.constexpr, EMULATE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    query_programs = num_heads * num_tokens * (L // BLOCK_N)
    if pid < query_programs:
        column, head, t64, live, offs_n = query_block(pid, num_tokens, num_tokens, L, 1, BLOCK_N)
        offs_k = tl.arange(0, P)
        w = tl.load(w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n)
        if QROW:
            q_nope = tl.load(q_nope_ptr + t64 * s_qn_t + head * s_qn_h + offs_k[None, :], mask=live, other=0.0)
            ql = summed_products(q_nope, w)
        else:
            ql = tl.sum(w.to(tl.float32), axis=0)[None, :]
        if QUANT:
            if ROPE:
                pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
            if SCALE:
                scale = tl.load(q_scale_ptr)
                inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
            else:
                inv = 1.0
            ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
            out = q_out_ptr + t64 * s_qo_t + head * s_qo_h
            tl.store(out + offs_n[None, :], _fp8_bits(ql, inv, fmax, FP8_MODE), mask=live)
            if ROPE:
                tl.store(out + L + tl.arange(0, R)[None, :], _fp8_bits(pe.to(tl.float32), inv, fmax, FP8_MODE),
                         mask=rope)
        else:
            tl.store(sums_ptr + pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], ql)
    elif KV:
        write_kv_program(pid - query_programs, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr,
                         s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, 1, FP8_MODE)


def ladder(rung, q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, sums, fmt):
    qrow, quant, scale, rope, kv = RUNGS[rung]
    tokens, heads, nope = q_nope.shape
    lora = w_uk_t.shape[-1]
    query_programs = heads * tokens * (lora // BLOCK_N)
    ladder_kernel[(query_programs + (tokens if kv else 0),)](
        q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, sums,
        q_nope.stride(0), q_nope.stride(1), w_uk_t.stride(0), w_uk_t.stride(1), w_uk_t.stride(2),
        q_pe.stride(0), q_pe.stride(1), kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        q_out.stride(0), q_out.stride(1), tokens, heads, cache.shape[1], fmt.fmax,
        P=nope, L=lora, R=q_pe.shape[-1], BLOCK_N=BLOCK_N, FP8_MODE=fp8_mode(fmt, q_nope.device), QROW=qrow,
        QUANT=quant, SCALE=scale, ROPE=rope, KV=kv, EMULATE_BF16=emulate_bf16(q_nope.device), num_warps=WARPS)


def full_bytes_match(args, sums) -> bool:
    """``r6_full``'s q_out and cache bytes against the shipped launch's (the cache rows poisoned first)."""
    q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = args
    ref_cache, ref_out = cache.clone(), torch.full_like(q_out, 0xAB)
    absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, ref_cache, slots, k_scale, q_scale, ref_out, E4M3FN)
    got_cache, got_out = cache.clone(), torch.full_like(q_out, 0xAB)
    live = slots[slots >= 0]
    got_cache[live // cache.shape[1], live % cache.shape[1]] = 0x5A
    ladder("r6_full", q_nope, w_uk_t, q_pe, kv_c, k_pe, got_cache, slots, k_scale, q_scale, got_out, sums, E4M3FN)
    return torch.equal(got_out, ref_out) and torch.equal(got_cache, ref_cache)


def main() -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from absorb_token_block_loop import inputs  # the experiments' shared input builder

    if "--check" in sys.argv:
        torch.manual_seed(0)
        for heads in (2, 3):
            args = inputs(1, heads, "cpu")
            sums = torch.empty(heads * 512, dtype=torch.float32)
            print("r6_full bytes identical to the shipped launch:", full_bytes_match(args, sums))
        return
    from w_read_floor import w_read_kernel

    from k3_amd_overlay.commands.bench.baselines import _empty_kernel, _one_load_kernel
    from k3_amd_overlay.commands.bench.timing import graph_us, graphs_in_turn, per_round

    graphs = [int(n) for n in sys.argv[sys.argv.index("--graphs") + 1:]] if "--graphs" in sys.argv else [64]

    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    floors = {"empty": graph_us(lambda: _empty_kernel[(1,)](x)), "one_load": graph_us(lambda: _one_load_kernel[(128,)](x, y))}
    print(json.dumps({k: round(v, 3) for k, v in floors.items()}), flush=True)
    rows = []
    for heads in (12, 16):
        torch.manual_seed(heads)
        args = inputs(1, heads, "cuda")
        sums = torch.empty(heads * 512, dtype=torch.float32, device="cuda")
        row = {"H": heads, "B": 1, "r6_full_bytes_identical": full_bytes_match(args, sums)}
        w = args[1]

        def floor():
            w_read_kernel[(heads * (w.shape[-1] // BLOCK_N),)](w, sums, w.stride(0), w.stride(1), w.stride(2),
                                                              P=w.shape[1], L=w.shape[-1], BLOCK_N=BLOCK_N, SPLIT=1,
                                                              num_warps=WARPS)

        runs = {"shipped": lambda: absorb_qk_cache(*args, E4M3FN), "floor": floor,
                **{rung: (lambda r=rung: ladder(r, *args, sums, E4M3FN)) for rung in RUNGS}}
        for per_graph in graphs:
            row |= per_round(graphs_in_turn(runs, per_graph=per_graph), f"_g{per_graph}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"floors": floors, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
