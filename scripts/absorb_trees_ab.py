"""The absorbed launch (bf16 W_UK and fp8 W_K) of two trees of this package, timed side by side on
one GPU: run it once per tree, alternating, in one session; each prints CUDA-graph replay medians (µs)
per heads and batch on the same seeded inputs (the benchmarks' decode-step inputs, block 1536).

    PYTHONPATH=$PWD python scripts/absorb_trees_ab.py OLD_TREE old
    PYTHONPATH=$PWD python scripts/absorb_trees_ab.py . new

OLD_TREE: e.g. ``git archive REV k3_amd_overlay | tar -x -C OLD_TREE``. Needs a GPU, torch, Triton."""

from __future__ import annotations

import json
import sys


def main(tree: str, label: str) -> None:
    sys.path.insert(0, tree)
    import torch

    from k3_amd_overlay import k3
    from k3_amd_overlay.commands.bench.kernels import decode_step_inputs
    from k3_amd_overlay.commands.bench.timing import graph_us
    from k3_amd_overlay.fp8 import E4M3FN
    from k3_amd_overlay.kernels import absorb_qk_cache as bf16_module
    from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache

    print(f"{label}: {bf16_module.__file__}", file=sys.stderr)
    torch.manual_seed(0)
    out = {}
    for heads in (12, 16):
        w_uk_t = (torch.randn(k3.KV_LORA_RANK, heads, k3.QK_NOPE_HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                  / 8).permute(1, 2, 0)
        w_k = (torch.randn(heads, k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM, device="cuda") * 40).to(torch.float8_e4m3fn)
        w_k_scale = torch.tensor([0.01], device="cuda")
        for tokens in (1, 2, 8, 32, 64):
            q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)
            bf16 = graph_us(lambda: bf16_module.absorb_qk_cache(q_nope, w_uk_t, q_pe, kv_c, k_pe, cache, slots, k_scale,
                                                                q_scale, q_out, E4M3FN))
            fp8 = graph_us(lambda: absorb_fp8_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache, slots, k_scale,
                                                       q_scale, q_out, E4M3FN))
            out[f"H{heads} B{tokens}"] = [round(bf16, 3), round(fp8, 3)]
    print(label, json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
