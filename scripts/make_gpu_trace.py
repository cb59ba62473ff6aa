#!/usr/bin/env python3
"""Make the small real GPU profiler traces kept in tests/data for the census tests: a decode-like
window of STEPS steps x LAYERS MLA layers, replayed from a CUDA graph, once with the three unfused
launches of qk_cache and once with the fused launch, recorded by torch.profiler and saved gzipped.

    PYTHONPATH=. python3 scripts/make_gpu_trace.py OUTDIR      (needs a GPU; no vLLM)

Known counts per trace: the fused trace has STEPS*LAYERS launches of qk_cache_kernel and nothing
else of the overlay; the baseline trace has STEPS*LAYERS of each of its three kernels."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import torch

from k3_amd_overlay import k3
from k3_amd_overlay.commands.bench.baselines import concat_and_cache_mla_like_kernel
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels.qk_cache import fp8_mode, qk_cache
from k3_amd_overlay.kernels.static_quant import scaled_quant

STEPS, LAYERS, HEADS, TOKENS = 4, 3, 12, 8


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lora, rope, fmt = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, E4M3FN
    layers = []
    for _ in range(LAYERS):
        q_full = torch.randn(TOKENS, HEADS, k3.QK_NOPE_HEAD_DIM + k3.QK_ROPE_HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        layers.append(dict(
            ql=torch.randn(TOKENS, HEADS, lora, dtype=torch.bfloat16, device="cuda"), qp=q_full[..., 128:],
            kv=torch.randn(TOKENS, lora, dtype=torch.bfloat16, device="cuda"),
            kpe=torch.randn(TOKENS, 1, rope, dtype=torch.bfloat16, device="cuda")[:, 0],
            cache=torch.zeros(4, 16, lora + rope, dtype=torch.uint8, device="cuda"),
            slots=torch.randperm(64, device="cuda")[:TOKENS].to(torch.int64),
            ks=torch.tensor([1.1], device="cuda"), qs=torch.tensor([0.9], device="cuda"),
            qo=torch.empty(TOKENS, HEADS, lora + rope, dtype=torch.uint8, device="cuda"),
            cat=torch.empty(TOKENS, HEADS, lora + rope, dtype=torch.bfloat16, device="cuda")))
    mode = fp8_mode(fmt, torch.device("cuda"))

    def baseline_step() -> None:
        for t in layers:
            concat_and_cache_mla_like_kernel[(TOKENS,)](t["kv"], t["kpe"], t["cache"], t["slots"], t["ks"], t["kv"].stride(0),
                                        t["kpe"].stride(0), t["cache"].stride(0), t["cache"].stride(1), 16,
                                        fmt.fmax, L=lora, R=rope, FP8_MODE=mode, num_warps=4)
            torch.cat([t["ql"], t["qp"]], dim=-1, out=t["cat"])
            scaled_quant(t["cat"], t["qs"], t["qo"], fmt)

    def fused_step() -> None:
        for t in layers:
            qk_cache(t["ql"], t["qp"], t["kv"], t["kpe"], t["cache"], t["slots"], t["ks"], t["qs"], t["qo"], fmt)

    for name, step in (("baseline", baseline_step), ("fused", fused_step)):
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                graph.replay()
            torch.cuda.synchronize()
        export_gzipped(prof, out / f"trace-{name}-rank0.json", name)


def export_gzipped(prof: torch.profiler.profile, raw: Path, label: str) -> dict:
    """Write the profiler's Kineto JSON as ``raw``.gz, print its kernels (and the overlay's ranges)
    by name and count, and return the trace."""
    prof.export_chrome_trace(str(raw))
    data = json.loads(raw.read_text())
    kernels = [e["name"] for e in data["traceEvents"] if e.get("cat") == "kernel"]
    ranges = [e["name"] for e in data["traceEvents"] if e.get("cat") == "user_annotation"
              and e["name"].startswith("k3_amd_overlay::")]
    print(f"{label}: {len(kernels)} kernel events, {len(ranges)} overlay ranges {sorted(set(ranges))}: " +
          "; ".join(f"{n[:90]} x{kernels.count(n)}" for n in sorted(set(kernels))))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return data


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "trace-out"))
