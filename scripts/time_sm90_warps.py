"""Time the sm90 rules that hold more warps than 16x8 tiles against the same blocks cut to one warp per
tile, interleaved, graph replay (H200, 2026-12-02: docs/benchmarks.md). Run on the GPU from the repo root:
    PYTHONPATH=$PWD python3 scripts/time_sm90_warps.py OUT.json"""
import json
import sys

import torch

from k3_amd_overlay.commands.tune import Case, interleaved_us
from k3_amd_overlay.fp8 import device_format
from k3_amd_overlay.kernels import names

fmt = device_format(torch.device("cuda", 0))
A, F = names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL
cases = [  # kernel, heads, tokens list (the rule's bin), old config, new config
    (A, 3, [2, 4, 8], {"BLOCK_N": 16, "BLOCK_T": 16, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_T": 16, "num_warps": 2}),
    (F, 3, [2, 4, 8], {"BLOCK_N": 16, "BLOCK_T": 16, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_T": 16, "num_warps": 2}),
    (F, 3, [16, 32], {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 8}, {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 4}),
    (F, 6, [2, 4, 8], {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 8}, {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 4}),
]
rows = []
for kernel, heads, tokens_list, old, new in cases:
    for tokens in tokens_list:
        torch.manual_seed(tokens * 100 + heads)
        case = Case(kernel, tokens, heads, fmt)
        mm_old, mm_new = case.mismatches(old), case.mismatches(new)
        old_us, new_us = interleaved_us(case.run, [old, new], rounds=7)
        row = dict(kernel=kernel, heads=heads, tokens=tokens, old=old, new=new, old_us=round(old_us, 3),
                   new_us=round(new_us, 3), new_over_old=round(new_us / old_us, 3), mismatches_old=mm_old,
                   mismatches_new=mm_new)
        rows.append(row)
        print(f"{kernel:28s} H{heads:<2d} T{tokens:<3d} old {old['num_warps']}w {old_us:6.2f} us  new {new['num_warps']}w "
              f"{new_us:6.2f} us  new/old {new_us / old_us:5.3f}  bytes off (near, far) old {mm_old} new {mm_new}",
              flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
