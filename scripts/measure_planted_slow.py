"""Issue 28's "never slower" check on a GPU, with a planted slow kernel: ``k3-amd-overlay measure``'s
measuring (k3_amd_overlay/commands/self_measure.py) at the given shapes, but in one bucket the fused path of one
fusion launches an extra spin kernel (``torch.cuda._sleep``) after its own; the result file is
written, read back as the server reads it (measured.load_here), and the decode plan built from it
(fusions/qk_cache.py) must leave the slowed fusion in that bucket, saying why (stock where no other
fused launch was measured faster there; qk_cache's launch where the absorbed one was slowed and
qk_cache's measured faster), and take the fastest fused launch the measurement let through in every
other bucket. Prints the table, each bucket's decision, the marker entry and ``check``'s line; exit 0
where the gate did so, 1 otherwise.

    PYTHONPATH=$PWD python3 scripts/measure_planted_slow.py --heads 12 --variant bf16 \\
        --buckets 1 8 64 256 512 --slow qk_cache 512 --cycles 80000 --out OUT_DIR

A test scaffold, never shipped: the hook lives here, not in the package."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from k3_amd_overlay import measured
from k3_amd_overlay.commands import self_measure
from k3_amd_overlay.fp8 import device_format
from k3_amd_overlay.fusions.qk_cache import BatchFacts, DecodePath, DecodePlan
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.kernels import target
from k3_amd_overlay.kernels.launch import device_name
from k3_amd_overlay.package import ABSORB_MAX_TOKENS, ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import KERNEL_CONFIGS

SLOWED = {ABSORB_QK_CACHE: DecodePath.ABSORB, QK_CACHE: DecodePath.QK_CACHE}  # the launch a slowed fusion is


def slowed(pair: self_measure.Pair, cycles: int) -> self_measure.Pair:
    """``pair`` whose fused path also spins ``cycles`` GPU clock cycles (its bytes unchanged)."""
    fused = pair.fused

    def fused_then_spin() -> None:
        fused()
        torch.cuda._sleep(cycles)

    pair.fused = fused_then_spin
    return pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--variant", default="bf16", choices=measured.VARIANTS)
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    parser.add_argument("--slow", nargs=2, metavar=("FUSION", "TOKENS"), default=["qk_cache", "512"],
                        help=f"the fusion and bucket to slow (qk_cache above the absorbed launch's {ABSORB_MAX_TOKENS} "
                             "tokens: stock runs there)")
    parser.add_argument("--cycles", type=int, default=20000, help="the planted spin (about 10 µs at 2 GHz)")
    parser.add_argument("--rounds", type=int, default=self_measure.ROUNDS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    slow = (args.slow[0], int(args.slow[1]))
    if args.variant == "fp8":
        from k3_amd_overlay.commands.bench import aiter_peers

        if why := aiter_peers.enable():
            print(why, file=sys.stderr)
            return 1
    device = torch.device("cuda", torch.cuda.current_device())
    arch, name, fmt = target.of(device).arch, device_name(device), device_format(device)
    assert name is not None
    print(f"{name} ({arch}); planted: {args.cycles} spin cycles after the {slow[0]} launch at bucket {slow[1]}")
    found = self_measure.pairs([args.heads], [args.variant], sorted(args.buckets), device, fmt, seed=2812)
    rows = self_measure.measure((slowed(p, args.cycles) if (p.fusion, p.tokens) == slow else p for p in found),
                                self_measure.graph_timer(), args.rounds)
    path = self_measure.write(self_measure.result(rows, arch, name, fmt.name, 2812), Path(args.out))
    loaded = measured.load_here(arch, name, {KERNEL_CONFIGS: args.out})
    if loaded.measurement is None:
        print(f"the server would not use {path}: {loaded.error}", file=sys.stderr)
        return 1
    gates = measured.decode_gates(loaded, args.heads, args.variant)
    assert gates is not None
    applied = LayerDecision(FusionState.APPLIED, "triton", "planted check")
    plan = DecodePlan(applied, applied, measured=gates)
    print("\n| tokens | the server's decode path | reason |\n|---|---|---|")
    ok = True
    planted = next((r for r in rows if (r.fusion, r.tokens) == slow), None)
    for tokens in sorted({t for b in args.buckets for t in (b, b + 1)}):
        path_taken, why = plan.choose(BatchFacts(tokens, tokens, True, False))
        print(f"| {tokens} | {path_taken.value if path_taken else 'stock'} | {why or ''} |")
        if tokens not in args.buckets:
            continue
        allowed = {r.fusion for r in rows if r.tokens == tokens and r.fusion != QKV_NORM and r.fused}
        want = (DecodePath.ABSORB if ABSORB_QK_CACHE in allowed and tokens <= ABSORB_MAX_TOKENS
                else DecodePath.QK_CACHE if QK_CACHE in allowed else None)
        ok = ok and path_taken is want
        if tokens == slow[1]:  # the planted bucket: measured slower, exact, and not taken there
            ok = ok and planted is not None and planted.exact and not planted.fused and path_taken is not SLOWED[slow[0]]
            if path_taken is None:  # stock runs, the reason in the batch's decision
                ok = ok and f"{slow[0]}: stock at " in (why or "") and "of stock on this GPU" in (why or "")
    entry = measured.marker_entry(loaded, {**gates, QKV_NORM: measured.norm_gate(loaded)},
                                  measured.shape_words(args.heads, args.variant))
    reasons = entry.get("stock", {}).get(slow[0], [])
    ok = ok and any(r.startswith("stock at ") and r.endswith("of stock on this GPU") and f"{slow[1]} token" in r
                    for r in reasons)  # the marker says where and why
    print("\nmarker measurement entry:\n" + json.dumps(entry, indent=1))
    print("\ncheck prints: " + measured.summary(entry))
    print(f"\nplanted-slow gate check: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
