"""``k3-amd-overlay bench plot BENCH.json``: the kernel benchmark as a picture, one panel per op:
time per launch (CUDA/HIP-graph replay, medians) against the batch, for the fused launch, the
unfused baseline and AMD's AITER kernels where the run measured them. Needs matplotlib (the
``plot`` extra), not torch or a GPU."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# (result key, legend) of the series drawn, where a result has them
SERIES = (("fused_us", "fused (overlay)"), ("baseline_us", "unfused baseline"), ("aiter_fused_us", "AITER fused"),
          ("aiter_us", "AITER"), ("aiter_provider_us", "overlay's aiter provider"))
PREFERRED_HEADS = 12  # heads per rank drawn for ops measured at several (K3 at TP 8)


def panels(results: list[dict[str, Any]], mode: str = "graph") -> dict[str, dict[str, list[tuple[int, float]]]]:
    """op -> series label -> [(tokens, µs)], for ``mode`` and, per op, one head count."""
    by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r.get("mode") == mode and "tokens" in r:
            by_op[r["op"]].append(r)
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for op, rows in by_op.items():
        heads = sorted({r["heads"] for r in rows if "heads" in r})
        if heads:
            pick = PREFERRED_HEADS if PREFERRED_HEADS in heads else heads[-1]
            rows = [r for r in rows if r.get("heads") == pick]
            op = f"{op} ({pick} heads)"
        series = {label: sorted((int(r["tokens"]), float(r[key])) for r in rows if key in r) for key, label in SERIES}
        out[op] = {label: points for label, points in series.items() if points}
    return out


def plot(data: dict[str, Any], path: Path, mode: str = "graph") -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panels(data["results"], mode)
    if not drawn:
        raise ValueError(f"no {mode} results to plot")
    figure, axes = plt.subplots(1, len(drawn), figsize=(4.5 * len(drawn), 4), squeeze=False)
    for axis, (op, series) in zip(axes[0], sorted(drawn.items()), strict=True):
        for label, points in series.items():
            axis.plot([t for t, _ in points], [us for _, us in points], marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tokens in the batch")
        axis.set_ylabel("µs per launch (median)")
        axis.set_title(op, fontsize=10)
        axis.legend(fontsize=7)
    figure.suptitle(f"{data.get('device', '?')}, triton {data.get('triton', '?')}, {mode}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return len(drawn)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3-amd-overlay bench plot", description=__doc__.splitlines()[0])
    p.add_argument("bench_json", type=Path, help="what `k3-amd-overlay bench --json` wrote")
    p.add_argument("--out", type=Path, help="the PNG (default: beside the JSON)")
    p.add_argument("--mode", choices=("graph", "eager"), default="graph")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("k3-amd-overlay bench plot: matplotlib is not installed (pip install 'k3-amd-overlay[plot]')",
              file=sys.stderr)
        return 2
    try:
        data = json.loads(args.bench_json.read_text())
        out = args.out or args.bench_json.with_suffix(".png")
        count = plot(data, out, args.mode)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"k3-amd-overlay bench plot: {args.bench_json}: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {count} panels")
    return 0
