"""Diagnostic (issue 28): where the small loads sit in the PTX of the absorbed and norm kernels, an
earlier tree's against this one's, as runs of instruction kinds in program order (LD: global load,
LD(scalar): a one-register global load such as a scale, BAR: barrier, MMA: tensor-core op, SHFL:
warp shuffle, ST: global store). 12 heads, fp8 cache, 1 and 8 tokens; the norm pair at one token.

    PYTHONPATH=$PWD python scripts/ptx_load_order.py OLD_DIR     (OLD_DIR as for hoisted_loads_ab.py; a GPU)

Output (H200) in docs/bench-raw/2026-12-04-h200-ptx-load-order.log."""
import re
import sys
from pathlib import Path

from hoisted_loads_ab import load_old  # scripts/, beside this one

from k3_amd_overlay.commands.bench.kernels import bf16_weights, decode_step_inputs, fp8_weights, norm_pair_inputs
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import absorb_fp8_qk_cache, absorb_qk_cache, rmsnorm_pair

SCALAR_LOAD = re.compile(r"ld\.global[.\w:]*\.b32 \{?\s*%r\d+\s*\}?,")


def last_ptx(jit) -> str:
    """The PTX of the kernel's latest compile (Triton 3.x keeps compiles per device)."""
    compiled = [c for entry in jit.device_caches.values() for c in entry[0].values()]
    return compiled[-1].asm["ptx"]


def kind_of(line: str) -> str | None:
    s = line.strip()
    if s.startswith(("bar.sync", "barrier")):
        return "BAR"
    if "ld.global" in s:
        return "LD(scalar)" if SCALAR_LOAD.search(s) and "v2" not in s and "v4" not in s else "LD"
    if "st.global" in s:
        return "ST"
    if s.startswith("mma") or "wgmma.mma_async" in s:
        return "MMA"
    if "shfl" in s:
        return "SHFL"
    return None


def summary(ptx: str) -> str:
    runs: list[list] = []
    for kind in filter(None, map(kind_of, ptx.splitlines())):
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return " ".join(f"{k}x{n}" for k, n in runs)


def main() -> None:
    fmt, heads = E4M3FN, 12
    for tokens in (1, 8):
        q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads)
        w_k, w_k_scale = fp8_weights(heads, fmt)
        w_uk_t = bf16_weights(heads)
        tail = (q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out, fmt)
        for tag, module in (("old", load_old(Path(sys.argv[1]), "absorb_fp8_qk_cache")), ("new", absorb_fp8_qk_cache)):
            module.absorb_fp8_qk_cache(q_nope, w_k, w_k_scale, *tail)
            print("fp8", tag, tokens, summary(last_ptx(module.absorb_fp8_qk_cache_kernel)), flush=True)
        for tag, module in (("old", load_old(Path(sys.argv[1]), "absorb_qk_cache")), ("new", absorb_qk_cache)):
            module.absorb_qk_cache(q_nope, w_uk_t, *tail)
            print("bf16", tag, tokens, summary(last_ptx(module.absorb_qk_cache_kernel)), flush=True)
    q, kv, q_w, kv_w, q_out, kv_out = norm_pair_inputs(1)
    for tag, module in (("old", load_old(Path(sys.argv[1]), "rmsnorm_pair")), ("new", rmsnorm_pair)):
        module.rmsnorm_pair(q, kv, q_w, kv_w, 1e-6, 1e-6, q_out, kv_out)
        print("norm", tag, summary(last_ptx(module.rmsnorm_pair_kernel)), flush=True)


if __name__ == "__main__":
    main()
