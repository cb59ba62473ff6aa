"""Sweep (issue 28): KV rows a KV program writes (the absorb kernels' KV_ROWS) for the bf16, fp8 and
MXFP4 absorbed launches at many-token batches. Per kernel, heads and batch: the arch's table config
with KV_ROWS 1, 4, 16 and 32 and BLOCK_N 64 / 128 (all else as the table has it), each output checked
byte for byte against the table config's (q_out poisoned, the cache rows to be written poisoned, one
token in seven a padding slot), each timed under CUDA-graph replay (median). Prints the fastest exact
candidate beside the table's; writes every row to OUT.json.

    PYTHONPATH=$PWD python scripts/absorb_kv_rows_sweep.py OUT.json [KERNEL ...]   (a GPU, torch, Triton)

KERNEL: the kernels to sweep (default all three), by their names in ``kernels/names.py``.

Results (H200) in docs/benchmarks.md."""
import json
import sys

import torch

from k3_amd_overlay import k3
from k3_amd_overlay.commands.bench.kernels import decode_step_inputs, mxfp4_weights
from k3_amd_overlay.commands.bench.timing import graph_us
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import launch, names
from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache
from k3_amd_overlay.kernels.absorb_mxfp4_qk_cache import absorb_mxfp4_qk_cache
from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache


def weights(kernel: str, heads: int):
    fmt = E4M3FN
    if kernel == names.ABSORB_QK_CACHE_KERNEL:
        w_uk = torch.randn(k3.KV_LORA_RANK, heads, k3.QK_NOPE_HEAD_DIM, dtype=torch.bfloat16, device="cuda") / 8
        return (w_uk.permute(1, 2, 0),)
    if kernel == names.ABSORB_FP8_QK_CACHE_KERNEL:
        w_k = torch.randn(heads, k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM, device="cuda") * 40
        return w_k.clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype), torch.tensor(0.003, device="cuda")
    return mxfp4_weights(heads)


RUN = {names.ABSORB_QK_CACHE_KERNEL: absorb_qk_cache, names.ABSORB_FP8_QK_CACHE_KERNEL: absorb_fp8_qk_cache,
       names.ABSORB_MXFP4_QK_CACHE_KERNEL: absorb_mxfp4_qk_cache}


def main() -> None:
    rows = []
    for kernel, fn in RUN.items():
        if sys.argv[2:] and kernel not in sys.argv[2:]:
            continue
        for heads in (12, 16):
            w = weights(kernel, heads)
            for tokens in (64, 128, 256, 512):
                q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)
                slots[3::7] = -1

                def call(c, o, q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, slots=slots, k_scale=k_scale,
                         q_scale=q_scale, w=w, fn=fn):
                    fn(q_nope, *w, q_pe, kv_c, k_pe, c, slots, k_scale, q_scale, o, E4M3FN)

                table = launch.config_for(kernel, q_nope.device, tokens, heads)
                ref_cache, ref_out = cache.clone(), torch.full_like(q_out, 0xAB)
                call(ref_cache, ref_out)
                table_us = graph_us(lambda: call(cache, q_out))
                best = None
                for block_n in (64, 128):
                    for kv_rows in (1, 4, 16, 32):
                        config = {**table, "BLOCK_N": block_n, "KV_ROWS": kv_rows}
                        c2, o2 = ref_cache.clone(), torch.full_like(q_out, 0xAB)
                        written = slots[slots >= 0]
                        c2[written // cache.shape[1], written % cache.shape[1]] = 0x5A
                        with launch.forced(config):
                            call(c2, o2)
                            torch.cuda.synchronize()
                            us = graph_us(lambda: call(cache, q_out))
                        row = dict(kernel=kernel, heads=heads, tokens=tokens, config=config, us=round(us, 3),
                                   table=table, table_us=round(table_us, 3), q_equal=torch.equal(o2, ref_out),
                                   cache_equal=torch.equal(c2, ref_cache))
                        rows.append(row)
                        if row["q_equal"] and row["cache_equal"] and (best is None or us < best["us"]):
                            best = row
                print(json.dumps(best), flush=True)
                with open(sys.argv[1], "w") as f:
                    json.dump(rows, f, indent=1)
    print("inexact:", sum(not (r["q_equal"] and r["cache_equal"]) for r in rows), "of", len(rows))


if __name__ == "__main__":
    main()
