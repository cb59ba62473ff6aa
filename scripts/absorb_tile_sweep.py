"""Experiment (issue 28): the absorbed bf16 launch at many tokens over tiles beyond those ``tune`` and
the many-token experiment tried: BLOCK_T up to 128 and BLOCK_N up to 512 (fewer re-reads of W_UK_T
and of q_nope, fewer programs), 4 or 8 warps, 1-3 pipeline stages, KV programs of 16 rows; first the
shipped launcher (``absorb_qk_cache``, its config forced) with one load of each operand and one
``tl.dot`` over all P, then (``--k-loop``) with the dot over P in K_STEPS 1, 2 or 4 pipelined slices (``product_in_steps``; the
run of 2026-12-04 used this script's own copy of that loop, its stage count set on the loop rather
than on the launch, before it shipped). Every candidate's q_out and cache bytes are compared with the
shipped launch's (the cache rows to be written poisoned first), each timed under CUDA-graph replay
(median) beside the shipped launch and the two-launch path (``torch.bmm`` + ``qk_cache``) in the
same call.

    PYTHONPATH=$PWD python scripts/absorb_tile_sweep.py OUT.json [HxB,...] [--k-loop] [--tiles NxT,...]
                                                        [--kv-rows K,...]     (a GPU, torch, Triton)

Results (H200) in docs/benchmarks.md."""
import itertools
import json
import sys

import torch

from k3_amd_overlay import k3
from k3_amd_overlay.commands.bench.kernels import bf16_weights, decode_step_inputs
from k3_amd_overlay.commands.bench.timing import graph_us
from k3_amd_overlay.commands.tune import WIDE_TILE_ELEMENTS
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import launch
from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache
from k3_amd_overlay.kernels.qk_cache import qk_cache

TILES = [(bn, bt) for bn, bt in itertools.product((64, 128, 256, 512), (16, 32, 64, 128))
         if bn * bt <= WIDE_TILE_ELEMENTS]
K_LOOP_TILES = [(64, 64), (64, 128), (128, 64), (128, 128), (256, 32), (256, 64), (512, 32)]  # the fastest above
FEW_TOKEN_TILES = [(32, 16), (64, 16), (128, 16)]  # below 64 tokens, as the shipped rules


def run_config(args, bn, bt, warps, stages, k_steps=1, kv=16):
    """The shipped launcher (``absorb_qk_cache``) with this config forced, as ``tune`` times candidates."""
    with launch.forced({"BLOCK_N": bn, "BLOCK_T": bt, "KV_ROWS": kv, "K_STEPS": k_steps, "num_warps": warps,
                        "num_stages": stages}):
        absorb_qk_cache(*args)


def main() -> None:
    fmt = E4M3FN
    k_loop = "--k-loop" in sys.argv
    argv = [a for a in sys.argv if a != "--k-loop"]
    options = {}
    for name in ("--tiles", "--kv-rows"):
        if name in argv:
            options[name] = argv.pop(argv.index(name) + 1)
            argv.remove(name)
    tiles = [tuple(int(x) for x in t.split("x")) for t in options["--tiles"].split(",")] if "--tiles" in options else None
    kv_all = [int(k) for k in options.get("--kv-rows", "16").split(",")]
    shapes = [(12, 128), (12, 256), (16, 128), (16, 256)]
    if len(argv) > 2:
        shapes = [(int(h), int(b)) for h, b in (s.split("x") for s in argv[2].split(","))]
    k_steps_all = (1, 2, 4) if k_loop else (1,)
    rows = []
    for H, B in shapes:
        w_uk_t = bf16_weights(H)
        q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(B, H)
        slots[3::7] = -1  # padding rows: no write
        ref_cache, ref_out = cache.clone(), torch.full_like(q_out, 0xAB)
        absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, ref_cache, slots, k_scale, q_scale, ref_out, fmt)
        ql_nope = torch.empty(B, H, k3.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
        args = (q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)

        def two():
            torch.bmm(q_nope.transpose(0, 1), w_uk_t, out=ql_nope.transpose(0, 1))
            qk_cache(ql_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)

        base, shipped = graph_us(two), graph_us(lambda: absorb_qk_cache(*args))
        best = None
        for (bn, bt), warps, stages, k_steps, kv in itertools.product(
                tiles or ((K_LOOP_TILES if B >= 64 else FEW_TOKEN_TILES) if k_loop else TILES), (4, 8), (1, 2, 3),
                k_steps_all, kv_all):
            got_cache, got_out = ref_cache.clone(), torch.full_like(q_out, 0xAB)
            live = slots[slots >= 0]
            got_cache[live // cache.shape[1], live % cache.shape[1]] = 0x5A  # poison the rows to be written
            try:
                run_config((q_nope, w_uk_t, q_pe, kv_c, k_pe, got_cache, slots, k_scale, q_scale, got_out, fmt), bn,
                           bt, warps, stages, k_steps, kv)
                torch.cuda.synchronize()
            except Exception as exc:  # out of shared memory or registers: report, go on
                print("fail", H, B, bn, bt, warps, stages, k_steps, kv, type(exc).__name__, str(exc)[:160], flush=True)
                continue
            exact = torch.equal(got_out, ref_out) and torch.equal(got_cache, ref_cache)
            us = graph_us(lambda: run_config(args, bn, bt, warps, stages, k_steps, kv))
            row = dict(H=H, B=B, bn=bn, bt=bt, warps=warps, stages=stages, k_steps=k_steps, kv=kv, us=round(us, 3),
                       shipped=round(shipped, 3), bmm_qk_cache=round(base, 3), exact=exact)
            rows.append(row)
            if exact and (best is None or us < best["us"]):
                best = row
        print(json.dumps(best and best | {"over_bmm_qk_cache": round(base / best["us"], 3)}), flush=True)
        with open(argv[1], "w") as f:  # after each shape: a run cut short keeps what it measured
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
