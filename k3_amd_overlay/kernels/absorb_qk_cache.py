"""Triton kernel for the whole decode query path after q_b_proj, in one launch: the W_UK
absorption (ql_nope = q_nope @ W_UK_T, fp32 accumulate, rounded to the query dtype as vLLM's
``torch.bmm`` output is), the ``[ql_nope | q_pe]`` concat, the static fp8 query quant, and the fp8
KV-cache write. ql_nope never goes to memory.

Query programs take one head, BLOCK_T tokens and BLOCK_N of the L output columns: the W_UK_T slice
they need (P x BLOCK_N) is read by that program only, so the weight read is spread over many
programs (one program streaming a head's whole W_UK_T was bound by a single SM's bandwidth); one
bf16 ``tl.dot`` (at many tokens, where a rule sets K_STEPS, a pipelined loop of dots over slices of P;
at 1, 2 or 4 tokens a program, the exact products summed in fp32 with no tensor-core tile; at 8 off
AMD, a dot whose rows Triton pads onto the tensor cores),
then the quant and the store. KV programs write KV_ROWS tokens' latent rows each
(``write_kv_row`` of ``kernels/qk_cache.py`` for one, ``write_kv_rows`` for more)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.kernels import launch_configs, target
from k3_amd_overlay.kernels.launch import check_cache_alignment, config_for, launch
from k3_amd_overlay.kernels.names import ABSORB_QK_CACHE_KERNEL
from k3_amd_overlay.kernels.qk_cache import CACHE_POINTER, _fp8_bits, fp8_mode, write_kv_row, write_kv_rows
from k3_amd_overlay.kernels.rounding import emulate_bf16, to_dtype_rne

# Programs of at most this many tokens sum the products lane by lane (no tl.dot)
FEW_TOKEN_MOST = tl.constexpr(launch_configs.FEW_TOKEN_MOST)


def absorb_launch(kernel_name: str, q_nope: torch.Tensor, lora: int, block_n: int | None, num_warps: int | None,
                  block_tokens: int | None) -> tuple[tuple[int], dict[str, int]]:
    """Grid and launch options of an absorb kernel: the arch's config for this batch and head count
    (``launch_configs``; tl.dot takes at least 16 tokens a program, larger batches more so that each
    weight slice is re-read fewer times), any of BLOCK_N, num_warps, BLOCK_T overridden (benchmark
    sweeps), BLOCK_N at most L. Query programs (head, token block, column block), then the KV
    programs, KV_ROWS tokens each."""
    num_tokens, num_heads, _ = q_nope.shape
    config = {**launch_configs.OPTIONAL_PARAMETERS[kernel_name],
              **config_for(kernel_name, q_nope.device, num_tokens, num_heads)}
    config["BLOCK_N"] = min(block_n or config["BLOCK_N"], lora)
    config["num_warps"] = num_warps or config["num_warps"]
    config["BLOCK_T"] = block_tokens or config["BLOCK_T"]
    query_programs = num_heads * triton.cdiv(num_tokens, config["BLOCK_T"]) * (lora // config["BLOCK_N"])
    return (query_programs + triton.cdiv(num_tokens, config["KV_ROWS"]),), config


@triton.jit
def query_block(pid, num_tokens, token_blocks, L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """A query program's share: its latent column block, head, token rows (int64 offsets, live mask)
    and columns."""
    column_blocks: tl.constexpr = L // BLOCK_N
    column = pid % column_blocks
    head = pid // (column_blocks * token_blocks)
    tokens = ((pid // column_blocks) % token_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = (tokens < num_tokens)[:, None]
    t64 = tokens.to(tl.int64)[:, None]
    offs_n = column * BLOCK_N + tl.arange(0, BLOCK_N)
    return column, head, t64, live, offs_n


@triton.jit
def query_rows(pid, q_nope_ptr, s_qn_t, s_qn_h, num_tokens, token_blocks, P: tl.constexpr, L: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """``query_block`` and the q_nope rows [BLOCK_T, P] the program multiplies."""
    column, head, t64, live, offs_n = query_block(pid, num_tokens, token_blocks, L, BLOCK_T, BLOCK_N)
    q_nope = tl.load(q_nope_ptr + t64 * s_qn_t + head * s_qn_h + tl.arange(0, P)[None, :], mask=live, other=0.0)
    return column, head, t64, live, offs_n, q_nope


@triton.jit
def query_operands(pid, q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, num_tokens, token_blocks,
                   P: tl.constexpr, L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """``query_rows`` and the W slice [P, BLOCK_N] the program multiplies them by."""
    column, head, t64, live, offs_n, q_nope = query_rows(pid, q_nope_ptr, s_qn_t, s_qn_h, num_tokens, token_blocks,
                                                         P, L, BLOCK_T, BLOCK_N)
    offs_k = tl.arange(0, P)
    w = tl.load(w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n)
    return column, head, t64, live, offs_n, q_nope, w


@triton.jit
def summed_products(a, w):
    """a [BLOCK_T, K] @ w [K, BLOCK_N] for programs of at most FEW_TOKEN_MOST tokens: each product
    (of bf16, fp8 or MXFP4 values: exact in fp32) summed in fp32 over K. At one or two tokens (the GPU
    rules' few-token programs) one token's row at a time against w in w's own layout, summed over K
    by warp shuffles; a [BLOCK_T, K, BLOCK_N] broadcast instead moved w through shared memory (on
    sm90 ldmatrix and a barrier, 128 registers at one token against 64; on gfx942 4 KiB of LDS against
    0.25). Four tokens (a ``tune`` candidate only) keep the broadcast."""
    if a.shape[0] == 1:
        return row_products(tl.reshape(a, [a.shape[1]]), w)[None, :]
    elif a.shape[0] == 2:
        first, second = tl.split(tl.trans(a))
        return tl.trans(tl.join(row_products(first, w), row_products(second, w)))
    return tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def row_products(a, w):
    """One token's a [K] @ w [K, BLOCK_N], the products summed in fp32 over K."""
    return tl.sum(a.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)


@triton.jit
def product_in_steps(q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, head, t64, live, offs_n,
                     P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, K_STEPS: tl.constexpr,
                     DOT_IN_FP32: tl.constexpr):
    """q_nope @ W_UK_T for the program's rows and columns [BLOCK_T, BLOCK_N], fp32, over P in K_STEPS
    slices: Triton pipelines the loop, the next slice's loads going to shared memory while the tensor
    cores take this one. The same products summed in the same order as one ``tl.dot`` over P (on the
    H200 the bytes were identical to it in every config measured)."""
    BLOCK_K: tl.constexpr = P // K_STEPS
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_nope_ptr + t64 * s_qn_t + head * s_qn_h + offs_k[None, :]
    w_ptrs = w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k in range(K_STEPS):
        q_nope = tl.load(q_ptrs + k * BLOCK_K, mask=live, other=0.0)
        w = tl.load(w_ptrs + k * BLOCK_K * s_w_k)
        if DOT_IN_FP32:
            acc = tl.dot(q_nope.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(q_nope, w, acc)
    return acc


@triton.jit
def load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R: tl.constexpr):
    """The rope lanes [BLOCK_T, R] that column block 0's program writes (masked off in the others),
    and their mask. Loaded with the operands, before the dot: loaded after the ql_nope store, they
    waited a second memory round trip (as far as the compiler knows q_out may alias q_pe, so the load
    cannot move above the store); 0.1-0.3 µs a launch on the H200 at 1-64 tokens."""
    offs_r = tl.arange(0, R)
    rope = live & ((offs_r[None, :] * 0 + column) == 0)  # broadcast first: the interpreter rejects scalar & vector
    pe = tl.load(q_pe_ptr + t64 * s_qp_t + head * s_qp_h + offs_r[None, :], mask=rope, other=0.0)
    return pe, rope


@triton.jit
def store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L: tl.constexpr,
                R: tl.constexpr, FP8_MODE: tl.constexpr):
    """The program's ql_nope columns and, where ``rope`` (column block 0), the rope lanes ``pe``,
    quantised with ``inv`` (1 / q_scale) into q_out."""
    out = q_out_ptr + t64 * s_qo_t + head * s_qo_h
    tl.store(out + offs_n[None, :], _fp8_bits(ql, inv, fmax, FP8_MODE), mask=live)
    tl.store(out + L + tl.arange(0, R)[None, :], _fp8_bits(pe.to(tl.float32), inv, fmax, FP8_MODE), mask=rope)


@triton.jit
def write_kv_program(kv_pid, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t,
                     s_c_blk, s_c_row, block_size, fmax, L: tl.constexpr, R: tl.constexpr, KV_ROWS: tl.constexpr,
                     FP8_MODE: tl.constexpr):
    """KV program ``kv_pid``'s share of the cache write: its KV_ROWS tokens' latent rows. One row a
    program keeps the few-token launch as it was; at hundreds of tokens, programs of 16 rows beat one
    program a row (each sized like a query program) on the H200 (docs/benchmarks.md)."""
    if KV_ROWS == 1:
        write_kv_row(kv_pid.to(tl.int64), kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t,
                     s_c_blk, s_c_row, block_size, fmax, L, R, L, R, FP8_MODE)
    else:
        write_kv_rows(kv_pid.to(tl.int64) * KV_ROWS, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr,
                      k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS, FP8_MODE)


# The arguments come in the order a query program first reads them (the W and q_nope pointers, the
# counts of its program-range test, the W and q_nope strides; the KV program's last). Each launch's
# arguments are read cold under graph replay; with num_heads at the end of the list the range test read
# it before the W arguments at the start. On an H200 this order made the one-token launch 5-9% faster
# (docs/benchmarks.md, 2026-12-06). The fp8 and MXFP4 kernels follow it.
@triton.jit(do_not_specialize=CACHE_POINTER)
def absorb_qk_cache_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_k, s_w_n, s_qn_t, s_qn_h,
    q_pe_ptr, s_qp_t, s_qp_h, q_scale_ptr, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, K_STEPS: tl.constexpr, FP8_MODE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    # Query programs: (head, token block, column block of ql_nope); the column-block-0 program also
    # writes the rope lanes. Then the KV programs, KV_ROWS tokens each.
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        if K_STEPS == 1:  # one load of each operand, one dot: the fastest at few tokens
            column, head, t64, live, offs_n, q_nope, w = query_operands(
                pid, q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, num_tokens, token_blocks, P, L,
                BLOCK_T, BLOCK_N)
            pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
            if BLOCK_T <= FEW_TOKEN_MOST:  # few tokens: the exact products summed in fp32 beat a padded dot
                ql = summed_products(q_nope, w)
            elif DOT_IN_FP32:  # the CPU interpreter mishandles low-precision dots; same products in fp32
                ql = tl.dot(q_nope.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                ql = tl.dot(q_nope, w)  # fp32 accumulation of exact bf16 products
        else:
            column, head, t64, live, offs_n = query_block(pid, num_tokens, token_blocks, L, BLOCK_T, BLOCK_N)
            pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
            ql = product_in_steps(q_nope_ptr, w_ptr, s_qn_t, s_qn_h, s_w_h, s_w_k, s_w_n, head, t64, live, offs_n,
                                  P, BLOCK_T, BLOCK_N, K_STEPS, DOT_IN_FP32)
        scale = tl.load(q_scale_ptr)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        # Round to the query dtype first, as the stock path's bmm output is, so that the fp8 codes
        # match stock's except where the two fp32 sums straddle a rounding boundary.
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


def absorb_qk_cache(q_nope: torch.Tensor, w_uk_t: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                    k_pe: torch.Tensor, cache_bytes: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor, q_scale: torch.Tensor, q_out_bytes: torch.Tensor,
                    fmt: Fp8Format, block_n: int | None = None) -> None:
    """Launch on validated inputs (power-of-two P, L, R; k_pe 2-D; uint8 views of cache and q_out);
    ``block_n``: latent columns per program (default the arch's config; benchmarks compare others)."""
    num_tokens, num_heads, nope = q_nope.shape
    lora, rope = w_uk_t.shape[-1], q_pe.shape[-1]
    grid, config = absorb_launch(ABSORB_QK_CACHE_KERNEL, q_nope, lora, block_n, None, None)
    check_cache_alignment(ABSORB_QK_CACHE_KERNEL, cache_bytes)
    launch(
        absorb_qk_cache_kernel, grid,
        w_uk_t, q_nope, num_heads, num_tokens, w_uk_t.stride(0), w_uk_t.stride(1), w_uk_t.stride(2),
        q_nope.stride(0), q_nope.stride(1),
        q_pe, q_pe.stride(0), q_pe.stride(1), q_scale, q_out_bytes, q_out_bytes.stride(0), q_out_bytes.stride(1),
        fmt.fmax,
        kv_c, k_pe, cache_bytes, slot_mapping, k_scale, kv_c.stride(0), k_pe.stride(0), cache_bytes.stride(0),
        cache_bytes.stride(1), cache_bytes.shape[1],
        P=nope, L=lora, R=rope, FP8_MODE=fp8_mode(fmt, q_nope.device),
        DOT_IN_FP32=not target.of(q_nope.device).gpu or q_nope.dtype == torch.float32,
        EMULATE_BF16=emulate_bf16(q_nope.device), **config,
    )
