"""Experiment (issue 28): tensor-core dots for programs of fewer than 16 tokens in the absorb kernels.

Triton 3.6's NVIDIA backend takes ``tl.dot`` operands of any M and N (``min_dot_size`` returns
(1, 1, 16) for 16-bit and (1, 1, 32) for 8-bit operands: small tiles are padded onto the tensor cores);
the kernels assumed 16 rows at least and, below that, summed the products lane by lane: at eight
tokens their rule padded a 16-row tile, at one and two tokens it summed lane by lane. Tried here
against the shipped launch, each a copy of the shipped kernel's query program with its product
replaced (``MODE``; what won, the plain dot of 8 rows at 3-8 tokens, shipped on 2026-12-06):

- ``dot``: ``tl.dot(q [BLOCK_T, P], W [P, BLOCK_N])`` with BLOCK_T of 1-8 (Triton pads the rows);
- ``swapped``: ``tl.trans(tl.dot(tl.trans(W) [BLOCK_N, P], tl.trans(q) [P, BLOCK_T]))``: the latent
  columns take the rows of the tile and the tokens its columns, where mma.sync m16n8k16 and Hopper's
  wgmma have an 8-wide N, so eight tokens fill it without padding.

bf16 and fp8 ``W_UK`` at 1, 2 and 8 tokens, 12 and 16 heads; BLOCK_N 16-64, 1-4 warps, BLOCK_T the
batch (and 4 at 8 tokens). Every candidate's q_out and cache bytes are compared with the shipped
launch's (what it must write poisoned first); a first round times every candidate once, then the
shipped launch and the three fastest exact candidates of each shape are timed in three rounds taken
in turn (medians of 64-launch CUDA graphs).

    PYTHONPATH=$PWD python scripts/absorb_small_dot.py OUT.json [--shapes 12x8,16x8]   (a GPU, torch, Triton)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/absorb_small_dot.py --check   (CPU: bytes only)

Results in docs/benchmarks.md."""
import contextlib
import json
import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from k3_amd_overlay.commands.bench.kernels import bf16_weights, decode_step_inputs, fp8_weights
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import absorb_fp8_qk_cache as fp8_module
from k3_amd_overlay.kernels import absorb_qk_cache as bf16_module
from k3_amd_overlay.kernels.absorb_qk_cache import (
    load_rope,
    query_operands,
    store_query,
    summed_products,
    write_kv_program,
)
from k3_amd_overlay.kernels.launch import forced
from k3_amd_overlay.kernels.qk_cache import _fp8_bits
from k3_amd_overlay.kernels.rounding import to_dtype_rne

MODES = {"dot": 1, "swapped": 2}
SHAPES = [(12, 1), (16, 1), (12, 2), (16, 2), (12, 8), (16, 8)]


@triton.jit
def product(q, w, MODE: tl.constexpr, FP8: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """q [BLOCK_T, P] @ w [P, BLOCK_N] in fp32: MODE 0 the products summed lane by lane (the shipped
    few-token path), 1 one tl.dot, 2 the dot with the operands' roles swapped."""
    if MODE == 0:
        return summed_products(q, w)
    elif DOT_IN_FP32:  # the CPU interpreter: the same exact products in fp32
        if MODE == 1:
            return tl.dot(q.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        return tl.trans(tl.dot(tl.trans(w.to(tl.float32)), tl.trans(q.to(tl.float32)), input_precision="ieee"))
    elif FP8:
        if MODE == 1:
            return tl.dot(q, w, max_num_imprecise_acc=0)
        return tl.trans(tl.dot(tl.trans(w), tl.trans(q), max_num_imprecise_acc=0))
    if MODE == 1:
        return tl.dot(q, w)
    return tl.trans(tl.dot(tl.trans(w), tl.trans(q)))


@triton.jit
def bf16_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_k, s_w_n, s_qn_t, s_qn_h,
    q_pe_ptr, s_qp_t, s_qp_h, q_scale_ptr, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, K_STEPS: tl.constexpr, FP8_MODE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EMULATE_BF16: tl.constexpr, MODE: tl.constexpr,
):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        column, head, t64, live, offs_n, q_nope, w = query_operands(
            pid, q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, num_tokens, token_blocks, P, L,
            BLOCK_T, BLOCK_N)
        pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
        ql = product(q_nope, w, MODE, False, DOT_IN_FP32)
        scale = tl.load(q_scale_ptr)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


@triton.jit
def fp8_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_n, s_w_k, s_qn_t, s_qn_h,
    w_scale_ptr, q_scale_ptr, q_pe_ptr, s_qp_t, s_qp_h, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, W_FMAX: tl.constexpr, FP8_MODE: tl.constexpr, W_FP8_MODE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr, MODE: tl.constexpr,
):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        column, head, t64, live, offs_n, q_nope, w = query_operands(
            pid, q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, num_tokens, token_blocks, P, L, BLOCK_T,
            BLOCK_N)
        pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
        w_scale = tl.load(w_scale_ptr)
        scale = tl.load(q_scale_ptr)
        amax = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), axis=1), 1e-10)[:, None]
        a_scale = amax * (1.0 / W_FMAX)
        a_recip = 1.0 / a_scale
        if DOT_IN_FP32:
            q8 = _fp8_bits(q_nope.to(tl.float32), a_recip, W_FMAX, W_FP8_MODE).to(w_ptr.dtype.element_ty, bitcast=True)
        else:
            q8 = tl.clamp(q_nope.to(tl.float32) * a_recip, -W_FMAX, W_FMAX).to(w_ptr.dtype.element_ty)
        ql = product(q8, w, MODE, True, DOT_IN_FP32)
        ql = ql * a_scale * w_scale
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


MODULES = {"bf16": (bf16_module, bf16_kernel), "fp8": (fp8_module, fp8_kernel)}


def candidates(tokens: int, device: str) -> list[dict]:
    """(MODE, BLOCK_T, BLOCK_N, num_warps) tried at ``tokens``."""
    if device == "cpu":
        return [dict(MODE=m, BLOCK_T=bt, BLOCK_N=16, num_warps=1) for m in MODES.values() for bt in (1, 2, 4)]
    blocks = [tokens] if tokens < 8 else [8, 4]
    return [dict(MODE=m, BLOCK_T=bt, BLOCK_N=bn, num_warps=nw) for m in MODES.values() for bt in blocks
            for bn in (16, 32, 64) for nw in (1, 2, 4)]


class Shape:
    """One shape's inputs, the shipped launch, and a launch of the experiment kernel with a config."""

    def __init__(self, kind: str, heads: int, tokens: int, device: str):
        torch.manual_seed(heads * 1000 + tokens)
        self.kind, self.heads, self.tokens = kind, heads, tokens
        (self.q_nope, self.q_pe, self.kv_c, self.k_pe, self.cache, self.slots, self.k_scale, self.q_scale,
         self.q_out) = decode_step_inputs(tokens, heads, device)
        self.cache.random_(0, 256)
        if tokens > 2:
            self.slots[1::3] = -1  # padding rows: no write
        if kind == "bf16":
            self.w = bf16_weights(heads, device)
        elif device == "cpu":
            self.w = (torch.randn(heads, 512, 128) * 40).clamp(-448, 448).to(E4M3FN.dtype)
            self.w_scale = torch.tensor(0.003)
        else:
            self.w, self.w_scale = fp8_weights(heads, E4M3FN)

    def shipped(self, cache: torch.Tensor, q_out: torch.Tensor) -> None:
        if self.kind == "bf16":
            bf16_module.absorb_qk_cache(self.q_nope, self.w, self.q_pe, self.kv_c, self.k_pe, cache, self.slots,
                                        self.k_scale, self.q_scale, q_out, E4M3FN)
        else:
            fp8_module.absorb_fp8_qk_cache(self.q_nope, self.w, self.w_scale, self.q_pe, self.kv_c, self.k_pe, cache,
                                           self.slots, self.k_scale, self.q_scale, q_out, E4M3FN)

    def launched_as(self, kernel: object, config: dict, cache: torch.Tensor, q_out: torch.Tensor) -> None:
        """The shipped launcher's own arguments, its kernel replaced by ``kernel``; its grid and options
        those of ``config`` (the shipped rule's where empty; an absorb kernel's optional parameters
        default to one KV row a program and one slice)."""
        module = MODULES[self.kind][0]
        shipped_launch = module.launch

        def launch(_kernel, grid, *args, **options):
            kernel[grid](*args, **options)

        module.launch = launch
        try:
            with forced(config) if config else contextlib.nullcontext():
                self.shipped(cache, q_out)
        finally:
            module.launch = shipped_launch

    def variant(self, config: dict, cache: torch.Tensor, q_out: torch.Tensor) -> None:
        """The experiment's kernel launched with ``config``."""
        self.launched_as(MODULES[self.kind][1], config, cache, q_out)

    def outputs(self, poisoned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache.clone()
        if poisoned:
            live = self.slots[self.slots >= 0]
            cache[live // cache.shape[1], live % cache.shape[1]] = 0x5A  # the rows to be written
        return cache, torch.full_like(self.q_out, 0xAB if poisoned else 0x3C)

    def identical(self, config: dict) -> bool:
        ref = self.outputs(False)
        self.shipped(*ref)
        got = self.outputs(True)
        self.variant(config, *got)
        return all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def sweep(shape: Shape, tried: list[dict], name: Callable[[dict], str], first_reps: int = 200) -> dict:
    """One shape's row: each candidate of ``tried`` checked for the shipped launch's bytes and timed
    once (64-launch graphs, ``first_reps`` replays; one that fails to build is a result), then the
    shipped launch and the three fastest exact candidates timed in three rounds taken in turn."""
    from k3_amd_overlay.commands.bench.timing import graph_us, graphs_in_turn

    cache, q_out = shape.outputs(False)
    first = {"shipped": round(graph_us(lambda: shape.shipped(cache, q_out), per_graph=64, reps=first_reps), 3)}
    failed = {}
    for config in tried:
        try:
            if not shape.identical(config):
                failed[name(config)] = "bytes differ"
                continue
            first[name(config)] = round(graph_us(lambda c=config: shape.variant(c, cache, q_out), per_graph=64,
                                                 reps=first_reps), 3)
        except Exception as error:  # a config that does not compile is a result here
            failed[name(config)] = f"{type(error).__name__}: {str(error)[:160]}"
    best = sorted((us, n) for n, us in first.items() if n != "shipped")[:3]
    by_name = {name(c): c for c in tried}
    runs = {"shipped": lambda: shape.shipped(cache, q_out)}
    runs.update({n: (lambda c=by_name[n]: shape.variant(c, cache, q_out)) for _, n in best})
    rounds = graphs_in_turn(runs)
    medians = {n: statistics.median(t) for n, t in rounds.items()}
    return {"kind": shape.kind, "H": shape.heads, "B": shape.tokens, "first_round": first, "failed": failed,
            "rounds": rounds, "medians": medians,
            "ratios": {n: round(medians["shipped"] / us, 3) for n, us in medians.items() if n != "shipped"}}


def name(config: dict) -> str:
    mode = {v: k for k, v in MODES.items()}[config["MODE"]]
    return f"{mode}_t{config['BLOCK_T']}_n{config['BLOCK_N']}_w{config['num_warps']}"


def main() -> None:
    if "--check" in sys.argv:
        for kind in MODULES:
            for heads, tokens in ((3, 1), (2, 3)):
                for config in candidates(tokens, "cpu"):
                    print(kind, heads, tokens, name(config), "bytes identical:",
                          Shape(kind, heads, tokens, "cpu").identical(config), flush=True)
        return
    shapes = SHAPES
    if "--shapes" in sys.argv:
        shapes = [tuple(int(v) for v in hb.split("x")) for hb in sys.argv[sys.argv.index("--shapes") + 1].split(",")]
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for kind in MODULES:
        for heads, tokens in shapes:
            row = sweep(Shape(kind, heads, tokens, "cuda"), candidates(tokens, "cuda"), name)
            results["rows"].append(row)
            print(json.dumps({k: row[k] for k in ("kind", "H", "B", "medians", "ratios")}),
                  f"{len(row['failed'])} failed", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
