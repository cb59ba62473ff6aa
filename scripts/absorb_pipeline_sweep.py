"""Experiment (issue 28): the absorb kernels' product over P as a pipelined loop of slices (K_STEPS)
at eight tokens, and the pipeline's depth (``num_stages``) at 256 tokens.

Two questions no earlier sweep asked:

- At eight tokens the shipped rules take one 8-row ``tl.dot`` over all of P: W's slice goes from
  global memory to registers, then to shared memory for the tensor cores. In a loop of K_STEPS slices
  Triton's pipeliner copies each slice straight to shared memory (``cp.async``) and the first slice's
  dot starts before the last slice lands. The 2026-12-04 slice sweep timed it only with 16-row tiles
  (no gain at eight tokens); the loader refuses K_STEPS with fewer than 16 rows until this is measured.
  bf16: the shipped kernel with K_STEPS 1-8 at BLOCK_T 8. fp8 (``steps_fp8_kernel`` here, as the
  shipped fp8 kernel takes no K_STEPS): each token's dynamic scale from its whole q_nope row first, then
  the slices, each quantised with that scale and multiplied in a loop.
- At 256 tokens the shipped bf16 rule (12 heads) loops over 4 slices at Triton's default depth;
  depths 2-4 and 2-8 slices, tiles of 64 x 128, 64 x 256 and 128 x 256 (tokens x columns), 4 or 8 warps.

Every candidate's q_out and cache bytes are compared with the shipped launch's (what it must write
poisoned first). A first round times each candidate once (graphs of 64 launches, 50 replays), then the
shipped launch and the three fastest exact candidates of each shape are timed in three rounds taken in
turn (medians of 64-launch graphs, 200 replays).

    PYTHONPATH=$PWD python scripts/absorb_pipeline_sweep.py OUT.json [--shapes bf16:12x8,fp8:16x8]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/absorb_pipeline_sweep.py --check   (CPU: bytes only)

Results in docs/benchmarks.md."""
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from k3_amd_overlay.kernels import absorb_qk_cache as bf16_module
from k3_amd_overlay.kernels.absorb_qk_cache import load_rope, query_block, store_query, write_kv_program
from k3_amd_overlay.kernels.qk_cache import _fp8_bits
from k3_amd_overlay.kernels.rounding import to_dtype_rne

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from absorb_small_dot import Shape, sweep  # the same inputs, shipped launch, bytes check and sweep

SHAPES = [("bf16", 12, 8), ("bf16", 16, 8), ("fp8", 12, 8), ("fp8", 16, 8), ("bf16", 12, 256),
          ("bf16", 16, 256)]


@triton.jit
def steps_fp8_kernel(
    w_ptr, q_nope_ptr, num_heads, num_tokens, s_w_h, s_w_n, s_w_k, s_qn_t, s_qn_h,
    w_scale_ptr, q_scale_ptr, q_pe_ptr, s_qp_t, s_qp_h, q_out_ptr, s_qo_t, s_qo_h, fmax,
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size,
    P: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_ROWS: tl.constexpr, W_FMAX: tl.constexpr, FP8_MODE: tl.constexpr, W_FP8_MODE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr, K_STEPS: tl.constexpr,
):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(num_tokens, BLOCK_T)
    column_blocks: tl.constexpr = L // BLOCK_N
    if pid < num_heads * token_blocks * column_blocks:
        column, head, t64, live, offs_n = query_block(pid, num_tokens, token_blocks, L, BLOCK_T, BLOCK_N)
        q_rows = q_nope_ptr + t64 * s_qn_t + head * s_qn_h
        q_nope = tl.load(q_rows + tl.arange(0, P)[None, :], mask=live, other=0.0)
        pe, rope = load_rope(column, head, t64, live, q_pe_ptr, s_qp_t, s_qp_h, R)
        w_scale = tl.load(w_scale_ptr)
        scale = tl.load(q_scale_ptr)
        amax = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), axis=1), 1e-10)[:, None]
        a_scale = amax * (1.0 / W_FMAX)
        a_recip = 1.0 / a_scale
        BLOCK_K: tl.constexpr = P // K_STEPS
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + head.to(tl.int64) * s_w_h + offs_k[:, None] * s_w_k + offs_n[None, :] * s_w_n
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k in range(K_STEPS):
            q_slice = tl.load(q_rows + k * BLOCK_K + offs_k[None, :], mask=live, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k * BLOCK_K * s_w_k)
            if DOT_IN_FP32:
                q8 = _fp8_bits(q_slice, a_recip, W_FMAX, W_FP8_MODE).to(w_ptr.dtype.element_ty, bitcast=True)
                acc = tl.dot(q8.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                q8 = tl.clamp(q_slice * a_recip, -W_FMAX, W_FMAX).to(w_ptr.dtype.element_ty)
                acc = tl.dot(q8, w, acc, max_num_imprecise_acc=0)
        ql = acc * a_scale * w_scale
        ql = to_dtype_rne(ql, q_nope_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        store_query(ql, inv, pe, rope, head, t64, live, offs_n, q_out_ptr, s_qo_t, s_qo_h, fmax, L, R, FP8_MODE)
    else:
        write_kv_program(pid - num_heads * token_blocks * column_blocks, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr,
                         slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row, block_size, fmax, L, R, KV_ROWS,
                         FP8_MODE)


def candidates(kind: str, tokens: int, device: str) -> list[dict]:
    """Launch configs tried (``num_stages`` only where the product loops)."""
    if device == "cpu":
        return [dict(BLOCK_T=bt, BLOCK_N=32, K_STEPS=k, num_warps=1) for bt in (1, 4, 16) for k in (1, 2, 4)]
    found = []
    if tokens <= 16:
        steps = (1, 2, 4, 8) if kind == "bf16" else (1, 2, 4)  # an fp8 dot takes K of 32 at least
        for n, k, w in itertools.product((32, 64, 128), steps, (4, 8)):
            found += [dict(BLOCK_T=8, BLOCK_N=n, K_STEPS=k, num_warps=w, **({"num_stages": s} if s else {}))
                      for s in ((None,) if k == 1 else (2, 3))]
        return found
    for (t, n), k, w, s in itertools.product(((64, 128), (64, 256), (128, 256)), (2, 4, 8), (4, 8), (2, 3, 4)):
        found.append(dict(BLOCK_T=t, BLOCK_N=n, K_STEPS=k, num_warps=w, num_stages=s, KV_ROWS=16))
    return found


def kind_shapes(argv: list[str], default: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """(kind, heads, tokens) from ``--shapes bf16:12x8,fp8:16x64`` in ``argv``, else ``default``."""
    if "--shapes" not in argv:
        return default
    found = []
    for spec in argv[argv.index("--shapes") + 1].split(","):
        kind, hb = spec.split(":")
        found.append((kind, *(int(v) for v in hb.split("x"))))
    return found


def name(config: dict) -> str:
    return "_".join(f"{key}{value}" for key, value in config.items())


class Sweep(Shape):
    """``Shape`` whose variant is the shipped bf16 kernel, or ``steps_fp8_kernel``, with ``config``."""

    def variant(self, config: dict, cache: torch.Tensor, q_out: torch.Tensor) -> None:
        kernel = bf16_module.absorb_qk_cache_kernel if self.kind == "bf16" else steps_fp8_kernel
        self.launched_as(kernel, config, cache, q_out)


def main() -> None:
    if "--check" in sys.argv:
        for kind in ("bf16", "fp8"):
            for heads, tokens in ((2, 1), (2, 19)):
                for config in candidates(kind, tokens, "cpu"):
                    if kind == "fp8" and config["K_STEPS"] > 1 and 128 // config["K_STEPS"] < 32:
                        continue
                    print(kind, heads, tokens, name(config), "bytes identical:",
                          Sweep(kind, heads, tokens, "cpu").identical(config), flush=True)
        return
    shapes = kind_shapes(sys.argv, SHAPES)
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for kind, heads, tokens in shapes:
        tried = candidates(kind, tokens, "cuda")
        row = sweep(Sweep(kind, heads, tokens, "cuda"), tried, name, first_reps=50)
        results["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("kind", "H", "B", "medians", "ratios")}), f"{len(row['failed'])} failed",
              f"of {len(tried)}", flush=True)
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
