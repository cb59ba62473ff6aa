"""Experiment (issue 28): does a launch's argument list cost time under CUDA-graph replay? On an H100
``w_read_floor.py``'s read-only kernel (5 arguments) took 1.77 / 1.82 µs at 12 / 16 heads where the
ladder's ``r0_read`` (the same loads, reduction and store; 8 more SASS instructions; 30 arguments)
took 1.93 / 2.07. Timed here side by side: the benchmarks' empty kernel and ``w_read_floor.py``'s
read-only kernel (one program per head and column block), each with its own arguments only and with 24 more (unused: 8 pointers, 16 integers, as the absorb kernels' strides and
sizes), beside the shipped absorbed launch at one token. CUDA-graph replay medians of 64 launches,
three rounds in turn.

    PYTHONPATH=$PWD python scripts/launch_params_cost.py OUT.json        (a GPU, torch, Triton)

Results in docs/benchmarks.md."""
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from k3_amd_overlay import k3
from k3_amd_overlay.commands.bench.baselines import _empty_kernel
from k3_amd_overlay.commands.bench.kernels import bf16_weights, decode_step_inputs
from k3_amd_overlay.commands.bench.timing import graphs_in_turn, per_round
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from w_read_floor import w_read_kernel

BLOCK_N = 16


@triton.jit
def empty_kernel_wide(x_ptr, p1, p2, p3, p4, p5, p6, p7, p8, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12,
                      i13, i14, i15, i16):
    pass


@triton.jit
def read_kernel_wide(w_ptr, out_ptr, s_w_h, s_w_k, s_w_n, p1, p2, p3, p4, p5, p6, p7, p8, i1, i2, i3, i4, i5, i6,
                     i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, P: tl.constexpr, L: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    w_read_kernel(w_ptr, out_ptr, s_w_h, s_w_k, s_w_n, P, L, BLOCK_N, 1)


def main(out_path: str) -> None:
    x = torch.randn(1024, device="cuda")
    pointers = [torch.empty(16, device="cuda") for _ in range(8)]
    integers = list(range(3, 19))  # none is 1 (Triton would fold it) or 16-divisible twice over
    rows = []
    for heads in (12, 16):
        torch.manual_seed(heads)
        w = bf16_weights(heads)
        out = torch.empty(heads * k3.KV_LORA_RANK, dtype=torch.float32, device="cuda")
        grid = (heads * (k3.KV_LORA_RANK // BLOCK_N),)
        q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(1, heads)
        strides = (w.stride(0), w.stride(1), w.stride(2))
        runs = {
            "empty": lambda: _empty_kernel[(1,)](x),
            "empty_wide": lambda: empty_kernel_wide[(1,)](x, *pointers, *integers),
            "read": lambda: w_read_kernel[grid](w, out, *strides, P=k3.QK_NOPE_HEAD_DIM, L=k3.KV_LORA_RANK,
                                                BLOCK_N=BLOCK_N, SPLIT=1, num_warps=1),
            "read_wide": lambda: read_kernel_wide[grid](w, out, *strides, *pointers, *integers,
                                                        P=k3.QK_NOPE_HEAD_DIM, L=k3.KV_LORA_RANK, BLOCK_N=BLOCK_N,
                                                        num_warps=1),
            "shipped": lambda: absorb_qk_cache(q_nope, w, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out,
                                               E4M3FN),
        }
        readings = graphs_in_turn(runs)
        row = {"H": heads, **per_round(readings),
               "medians": {name: round(statistics.median(times), 3) for name, times in readings.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
