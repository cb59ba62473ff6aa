"""Experiment (issue 28): the kernels with their small loads (the norm weight; the q_scale, and the fp8
W_K scale) issued with the operands, against the same kernels as of an earlier tree, which loaded them
after a reduction or a dot: a barrier the compiler does not move a load over, so such a load waits a
second memory round trip. Each pair is checked byte for byte (outputs and cache rows poisoned first)
and timed under CUDA-graph replay in interleaved rounds (medians), at K3 shapes.

    mkdir -p old && for f in rmsnorm_pair absorb_qk_cache absorb_fp8_qk_cache absorb_mxfp4_qk_cache; do
      git show REV:k3_amd_overlay/kernels/$f.py > old/$f.py; done
    PYTHONPATH=$PWD python scripts/hoisted_loads_ab.py OUT.json old [--rounds N] [--only KERNEL,...]
                                                                       (a GPU, torch, Triton)

Results (H200) in docs/benchmarks.md."""
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from k3_amd_overlay.commands.bench.kernels import (
    bf16_weights,
    decode_step_inputs,
    fp8_weights,
    mxfp4_weights,
    norm_pair_inputs,
)
from k3_amd_overlay.commands.bench.timing import graph_us
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import absorb_fp8_qk_cache, absorb_mxfp4_qk_cache, absorb_qk_cache, rmsnorm_pair


def load_old(directory: Path, name: str):
    """Module ``name`` of the kernels from ``directory`` (an earlier tree's file), under its own name."""
    spec = importlib.util.spec_from_file_location(f"old_{name}", directory / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(label: dict, old_fn, new_fn, outputs: list[torch.Tensor], poison, rounds: int) -> dict:
    """Bytes of both (outputs poisoned before each), then ``rounds`` interleaved graph timings of each."""
    got = []
    for fn in (old_fn, new_fn):
        poison()
        fn()
        torch.cuda.synchronize()
        got.append([t.clone() for t in outputs])
    exact = all(torch.equal(a, b) for a, b in zip(*got, strict=True))
    old_us, new_us = [], []
    for _ in range(rounds):
        old_us.append(graph_us(old_fn))
        new_us.append(graph_us(new_fn))
    row = dict(label, exact=exact, old_us=round(statistics.median(old_us), 3),
               new_us=round(statistics.median(new_us), 3))
    row["old_over_new"] = round(row["old_us"] / row["new_us"], 3)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    argv = list(sys.argv)
    options = {}
    for name in ("--rounds", "--only"):
        if name in argv:
            options[name] = argv.pop(argv.index(name) + 1)
            argv.remove(name)
    rounds = int(options.get("--rounds", 3))
    only = options["--only"].split(",") if "--only" in options else None
    out_path, old_dir = argv[1], Path(argv[2])
    new = {m.__name__.rsplit(".", 1)[-1]: m
           for m in (rmsnorm_pair, absorb_qk_cache, absorb_fp8_qk_cache, absorb_mxfp4_qk_cache)}
    old = {name: load_old(old_dir, name) for name in new}
    fmt = E4M3FN
    rows = []
    for tokens in (1, 8, 64, 512) if only is None or "rmsnorm_pair" in only else ():
        q, kv, q_w, kv_w, q_out, kv_out = norm_pair_inputs(tokens)

        def poison():
            q_out.fill_(float("nan"))
            kv_out.fill_(float("nan"))

        def run(module):
            return lambda: module.rmsnorm_pair(q, kv, q_w, kv_w, 1e-6, 1e-6, q_out, kv_out)

        rows.append(compare(dict(kernel="rmsnorm_pair", B=tokens), run(old["rmsnorm_pair"]), run(new["rmsnorm_pair"]),
                            [q_out, kv_out], poison, rounds))
    for heads in (12, 16):
        w_uk_t = bf16_weights(heads)
        w_k, w_k_scale = fp8_weights(heads, fmt)
        w4, w4_scale = mxfp4_weights(heads)
        for tokens in (1, 2, 8, 64, 256):
            q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)
            slots[3::7] = -1
            live = slots[slots >= 0]

            def poison():
                q_out.fill_(0xAB)
                cache[live // cache.shape[1], live % cache.shape[1]] = 0x5A

            tail = (q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)
            for kernel, weights in (("absorb_qk_cache", (w_uk_t,)), ("absorb_fp8_qk_cache", (w_k, w_k_scale)),
                                    ("absorb_mxfp4_qk_cache", (w4, w4_scale))):
                if (kernel == "absorb_mxfp4_qk_cache" and tokens > 64) or (only and kernel not in only):
                    continue
                fns = [(lambda m=m, k=kernel, w=weights: getattr(m, k)(q_nope, *w, *tail))
                       for m in (old[kernel], new[kernel])]
                rows.append(compare(dict(kernel=kernel, H=heads, B=tokens), *fns, [q_out, cache], poison, rounds))
            with open(out_path, "w") as f:
                json.dump(rows, f, indent=1)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
