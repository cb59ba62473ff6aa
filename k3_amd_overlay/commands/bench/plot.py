"""``k3-amd-overlay bench plot BENCH.json``: the kernel benchmark as a picture, one panel per op:
time per launch (CUDA/HIP-graph replay, medians) against the batch, for the fused launch, the
unfused baseline and AMD's AITER kernels where the run measured them. Needs matplotlib (the
``plot`` extra), not torch or a GPU.

``MATPLOTLIB_MISSING``: what a plotting command says to install where matplotlib is missing."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files, json_values
from k3_amd_overlay.commands.usage import EXIT_FAILED, Parser, UsageError, describe, json_result
from k3_amd_overlay.package import DISTRIBUTION, __version__

# The package is on no index: `pip install k3-amd-overlay[plot]` would fetch whatever one has under that name.
MATPLOTLIB_MISSING = (f"matplotlib is not installed (pip install matplotlib, or the overlay's wheel with its plot "
                      f"extra: pip install '{DISTRIBUTION.replace('-', '_')}-{__version__}-py3-none-any.whl[plot]')")

# (result key, legend) of the series drawn, where a result has them; a layer step (bench/layer_step.py)
# times vLLM's stock chain and the overlay's
SERIES = (("fused_us", "fused (overlay)"), ("baseline_us", "unfused baseline"), ("aiter_fused_us", "AITER fused"),
          ("aiter_us", "AITER"), ("aiter_provider_us", "overlay's aiter provider"),
          ("overlay_us", "overlay's layer step"), ("stock_us", "stock (vLLM's own launches)"))
PREFERRED_HEADS = 12  # heads per rank drawn for ops measured at several (K3 at TP 8)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # the first bytes of every PNG file (the PNG specification)
BENCH_SHAPE = ("an object whose 'results' is a list of measurements, each an object with 'op', 'mode', 'tokens' "
               "and times in µs such as 'fused_us'")
def _value(result: dict[str, Any], index: int, key: str, read: Callable[[Any], Any], wanted: str) -> Any:
    value = read(result[key])
    if value is None:
        raise ValueError(f"results[{index}] {key!r} is {result[key]!r}, expected {wanted}")
    return value


def _time(result: dict[str, Any], index: int, key: str) -> float:
    """A drawn time: finite and more than 0 (a launch takes time; the axis is logarithmic)."""
    value = _value(result, index, key, json_values.finite, "a finite time in µs")
    if value <= 0:
        raise ValueError(f"results[{index}] {key!r} is {result[key]!r}, expected a time in µs more than 0")
    return value


def panels(results: list[dict[str, Any]], mode: str = "graph") -> dict[str, dict[str, list[tuple[int, float]]]]:
    """op -> series label -> [(tokens, µs)], for ``mode`` and, per op, one head count; a ValueError
    naming the result and the field where a drawn value is not a number of its kind, or the op where
    none of its results has a time to draw (its panel would be empty)."""
    if not isinstance(results, list):
        raise ValueError(f"'results' is {json_values.kind(results)}, expected a list of results")
    by_op: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for index, r in enumerate(results):
        if not isinstance(r, dict):
            raise ValueError(f"results[{index}] is {r!r}, expected an object")
        if r.get("mode") == mode and "tokens" in r:
            by_op[_value(r, index, "op", lambda v: v if isinstance(v, str) else None, "a name")].append((index, r))
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for op, rows in by_op.items():
        heads = sorted({_value(r, i, "heads", lambda v: json_values.whole(v, 1), "a whole number >= 1")
                        for i, r in rows if "heads" in r})
        if heads:
            pick = PREFERRED_HEADS if PREFERRED_HEADS in heads else heads[-1]
            rows = [(i, r) for i, r in rows if r.get("heads") == pick]
            op = f"{op} ({pick} heads)"
        series = {label: sorted((_value(r, i, "tokens", lambda v: json_values.whole(v, 1), "a whole number >= 1"),
                                 _time(r, i, key))
                                for i, r in rows if key in r) for key, label in SERIES}
        out[op] = {label: points for label, points in series.items() if points}
        if not out[op]:
            raise ValueError(f"op {op!r} ({len(rows)} {mode} result{'s' if len(rows) != 1 else ''}) has no time to "
                             f"draw: none of {', '.join(key for key, _ in SERIES)}")
    return out


def matplotlib_missing() -> str | None:
    """MATPLOTLIB_MISSING where matplotlib cannot be imported, else None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return MATPLOTLIB_MISSING
    return None


def read_panels(bench_json: Path, mode: str) -> tuple[dict[str, Any], dict[str, dict[str, list[tuple[int, float]]]]]:
    """The benchmark ``bench_json`` holds and its panels for ``mode``; a UsageError naming the file
    where it is no benchmark's, or has nothing to draw."""
    try:
        data = json_files.load(bench_json)  # never blocks on a FIFO; refuses JSON nested too deep to read
    except (OSError, ValueError) as exc:
        raise UsageError(f"{bench_json}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{bench_json}: its JSON is {json_values.kind(data)}, not what bench --json-out writes "
                         f"({BENCH_SHAPE})")
    try:
        drawn = panels(data["results"], mode)
    except KeyError as exc:
        raise UsageError(f"{bench_json}: no {exc.args[0]!r} in it (not what bench --json-out writes: "
                         f"{BENCH_SHAPE})") from None
    except ValueError as exc:
        raise UsageError(f"{bench_json}: {exc}") from None
    except (TypeError, AttributeError) as exc:
        raise UsageError(f"{bench_json}: not what bench --json-out writes ({exc})") from None
    if not drawn:
        raise UsageError(f"{bench_json}: no {mode} results to plot")
    return data, drawn


def is_png(path: Path) -> bool:
    """Whether ``path`` is a regular file that starts as a PNG does (what an earlier plot wrote)."""
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE
    except OSError:
        return False


def png_path(bench_json: Path, out: Path | None) -> Path:
    """Where the PNG goes: ``out``, ``<input stem>.png`` inside it where it is a directory, or beside
    the input; a UsageError naming --out where that directory is missing or not writable, or where
    a file that is no PNG is there already (it would be overwritten)."""
    png = bench_json.with_suffix(".png")
    path = png if out is None else out / png.name if out.is_dir() else out
    named = f"--out {out}" if out is not None else f"{path} (the default; choose another with --out)"
    if path.suffix not in ("", ".png"):
        raise UsageError(f"{named}: a PNG is written; name it .png (or give no suffix)")
    if path.exists() and path.resolve() == bench_json.resolve():
        raise UsageError(f"{named}: that is the input {bench_json}")
    if not path.parent.is_dir():
        raise UsageError(f"{named}: no directory {path.parent}")
    if (path.exists() or path.is_symlink()) and not is_png(path):
        raise UsageError(f"{named}: {path} exists and is no PNG; it would be overwritten: name a new file (or "
                         "remove it)")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{named}: {path} cannot be written")
    return path


def plot(data: dict[str, Any], drawn: dict[str, dict[str, list[tuple[int, float]]]], path: Path, mode: str) -> int:
    """``drawn`` (``panels``) as one PNG at exactly ``path``; the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    figure.savefig(path, dpi=120, format="png")  # a format: else a path without a suffix gets ".png" appended
    plt.close(figure)
    return len(drawn)


def parser() -> Parser:
    p = Parser(prog="k3-amd-overlay bench plot", description=describe(__doc__))
    p.add_argument("bench_json", type=Path, metavar="BENCH.json",
                   help="what `k3-amd-overlay bench --json-out` wrote")
    p.add_argument("--out", type=Path,
                   help="the PNG, or a directory to write BENCH.png in (default: BENCH.png beside the JSON)")
    p.add_argument("--mode", choices=("graph", "eager"), default="graph",
                   help="the timings drawn: CUDA/HIP-graph replay or eager launches")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout on every path (the PNG drawn)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)

    def failed(message: str) -> int:
        if args.json:
            print(json_result("bench plot", False, error=message))
        print(f"k3-amd-overlay bench plot: {message}", file=sys.stderr)
        return EXIT_FAILED

    try:
        data, drawn = read_panels(args.bench_json, args.mode)
        out = png_path(args.bench_json, args.out)
    except UsageError as exc:
        return p.usage_error(exc)
    missing = matplotlib_missing()
    if missing:
        return failed(missing)
    if out.exists():  # png_path let only a PNG through
        print(f"k3-amd-overlay bench plot: replacing the PNG {out}", file=sys.stderr)
    try:
        count = plot(data, drawn, out, args.mode)
    except OSError as exc:
        return failed(f"{out} not written: {exc}")
    print(json_result("bench plot", True, png=str(out), panels=count) if args.json else f"{out}: {count} panels")
    return 0
