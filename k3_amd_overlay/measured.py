"""This GPU's self-measurement (``k3-amd-overlay measure``, self_measure.py) as a file: its name, its
schema, loading it, each bucket's verdict, the gates the server's sites take from it ("never slower"),
and the lines the marker, ``check`` and ``doctor`` show of it. No vLLM; torch and Triton are imported
only for their versions, when a file is checked.

One file per GPU, ``<arch>-<device>.measured.json`` (the device named as in a tuned launch-config
file's name), beside the tuned launch configs: in the directory ``K3_AMD_OVERLAY_KERNEL_CONFIGS``
names (where it names a file: that file's directory), else in the per-user directory
``$XDG_CACHE_HOME/k3-amd-overlay`` (``~/.cache/k3-amd-overlay`` without it). The server reads the
file for its GPU once, when the first K3 MLA layer is built; deleting it restores the behaviour
without it (every fusion at every batch size).

A row is one fusion at one bucket: a bucket of ``tokens`` covers the token counts above the bucket
before it (0 for the first) up to ``tokens``. A fusion runs in a bucket only where its outputs were
exact against the stock sequence's and it measured at least as fast (stock µs / fused µs >=
``MIN_RATIO``); elsewhere, above the largest bucket, and at a shape (heads, W_UK absorption) the file
does not hold, stock runs, with the reason in the marker.

The file records what decides the fused kernels' and stock's speed and bytes (``CONDITIONS``): a
sha256 of the launch configs this GPU's kernels resolved to, the torch and Triton versions, which AITER
(its version and directory, or none: stock's fp8 absorption is AITER's fp8 BMM), the KV-cache dtype and
the fp8 format. The vLLM version is not among them: `measure` runs none of vLLM's code (its stock
sequence is the benchmarks' launches, see self_measure.py). A file that cannot be used (malformed, of
another GPU, of another overlay version, measured under other conditions than this process's, or
written before they were recorded) fails closed: its verdicts are not this process's kernels' and
nothing else says the fused paths are faster here, so every gated fusion runs stock at every batch
size, with an ERROR naming the file and the field and the marker's reason, until ``measure`` runs
again. So does a file of this GPU left in the per-user directory where ``K3_AMD_OVERLAY_KERNEL_CONFIGS``
names another and that one holds none (``measure`` ran without the variable the server has), and a
directory that cannot be looked in. Where this process cannot tell a condition of its own (torch not
importable, launch configs that do not resolve, a broken ``aiter`` entry), the file is not used
either. Only where there is no file at all does every fusion run at every batch size."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files, json_values
from k3_amd_overlay.fp8 import format_for_gcn_arch
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant
from k3_amd_overlay.fusions.states import BucketGate
from k3_amd_overlay.kernels import launch_configs
from k3_amd_overlay.kernels.launch_configs import device_slug
from k3_amd_overlay.package import ABSORB_QK_CACHE, AUTO, FUSIONS, QK_CACHE, QKV_NORM, __version__
from k3_amd_overlay.settings import KERNEL_CONFIGS
from k3_amd_overlay.versions import aiter_identity

SCHEMA = 1
SUFFIX = ".measured.json"
ACTIVATIONS = "bfloat16"  # the activations `measure` times (commands/bench/layer_step.py builds its step in them)
UNUSABLE = "unusable"  # the marker's state of a file for this GPU that cannot be used (every gate refuses)
MIN_RATIO = 1.0  # stock µs / fused µs at which a fusion counts as at least as fast as stock
CACHE_HOME = "XDG_CACHE_HOME"
USER_DIRECTORY = "k3-amd-overlay"  # under $XDG_CACHE_HOME, or ~/.cache
VARIANTS = (AbsorbVariant.BF16.value, AbsorbVariant.FP8.value)  # the W_UK absorptions measured
DECODE_FUSIONS = (QK_CACHE, ABSORB_QK_CACHE)
COMMAND = "k3-amd-overlay measure"
SEEDS = range(2**32)  # inputs' seeds `measure` takes (each bucket's inputs are drawn from seed + a small offset)
KV_CACHE_DTYPE = "fp8"  # the cache the fused decode writes, and the one `measure` times it with
# The fields that decide the fused kernels' speed and bytes: a file measured under others is not used.
CONDITIONS = ("launch_configs", "torch", "triton", "aiter", "kv_cache_dtype", "fp8_format")
# The provider whose launches `measure` times (the overlay's own Triton kernels): a file's verdicts hold
# for that provider alone; a layer of another provider is not measured, so stock runs there.
PROVIDER = "triton"


class MeasuredError(ValueError):
    """A result file that cannot be used; the message names the file and the field."""


def result_name(arch: str, device: str) -> str:
    """The result file's name for ``arch`` and the GPU named ``device``."""
    return f"{arch}-{device_slug(device)}{SUFFIX}"


def is_result_name(name: str) -> bool:
    """Whether a file name is a result file's (a launch-config directory holds both kinds)."""
    return name.endswith(SUFFIX)


def user_dir(environ: Mapping[str, str]) -> Path:
    """The per-user directory, where the result files go without ``K3_AMD_OVERLAY_KERNEL_CONFIGS``."""
    cache = environ.get(CACHE_HOME) or str(Path.home() / ".cache")
    return Path(cache) / USER_DIRECTORY


def result_dir(environ: Mapping[str, str]) -> Path:
    """Where the result files are written and read (see the module's docstring)."""
    configs = environ.get(KERNEL_CONFIGS, "")
    if configs:
        path = Path(configs)  # a directory; a file (of launch configs: any name) beside its result files
        return path if path.is_dir() or (not path.suffix and not path.exists()) else path.parent
    return user_dir(environ)


def result_path(arch: str, device: str, environ: Mapping[str, str]) -> Path:
    return result_dir(environ) / result_name(arch, device)


def shape_words(heads: int | None, variant: str | None) -> str:
    """A row's shape as the reasons name it."""
    return "any heads" if heads is None else f"{heads} heads, {variant} W_UK"


@dataclass(frozen=True)
class Row:
    """One fusion at one bucket: its parity against the stock sequence and, where exact, both
    medians. ``heads`` and ``variant`` are None for qkv_norm, whose launch has no heads."""

    fusion: str
    tokens: int
    heads: int | None
    variant: str | None
    exact: bool
    stock_us: float | None = None
    fused_us: float | None = None
    problems: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        """stock µs / fused µs (above 1: the fusion is faster)."""
        if self.stock_us is None or self.fused_us is None:
            return None
        return self.stock_us / self.fused_us

    @property
    def fused(self) -> bool:
        """Whether the fusion may run in this bucket: exact and at least as fast as stock."""
        return self.exact and self.ratio is not None and self.ratio >= MIN_RATIO

    @property
    def key(self) -> tuple[str, int | None, str | None, int]:
        return self.fusion, self.heads, self.variant, self.tokens

    def verdict(self) -> str:
        """The table's last column: where the server runs this bucket."""
        if not self.exact:
            return "stock: not exact"
        return "fused" if self.fused else f"stock: {ratio_words(self.ratio)} of stock"

    def to_json(self) -> dict[str, Any]:
        return {"fusion": self.fusion, "tokens": self.tokens, "heads": self.heads, "variant": self.variant,
                "stock_us": self.stock_us, "fused_us": self.fused_us, "ratio": self.ratio, "exact": self.exact,
                "problems": list(self.problems)}


def ratio_words(ratio: float | None) -> str:
    """A ratio as the reasons print it: rounded down to two decimals, so a ratio below 1 never
    reads 1.00x."""
    return "unmeasured" if ratio is None else f"{math.floor(round(ratio * 100, 6)) / 100:.2f}x"


@dataclass(frozen=True)
class Measurement:
    """One result file: where and with what it was measured, and its rows."""

    path: str
    arch: str
    device: str
    date: str
    overlay_version: str
    launch_configs: str  # configs_fingerprint's ("" read from a file written before it was recorded)
    torch: str
    triton: str
    aiter: str  # versions.aiter_identity's ("" read from a file written before it was recorded)
    kv_cache_dtype: str
    fp8_format: str
    stock: str  # what the stock sequence was, in words
    seed: int
    rows: tuple[Row, ...]
    provider: str = PROVIDER  # whose fused launches were timed

    def conditions(self) -> dict[str, str]:
        """What it was measured under (``CONDITIONS``; "": not recorded)."""
        return {name: getattr(self, name) for name in CONDITIONS}

    def to_json(self) -> dict[str, Any]:
        heads = sorted({r.heads for r in self.rows if r.heads is not None})
        return {"schema": SCHEMA, "arch": self.arch, "device": self.device, "date": self.date,
                "overlay_version": self.overlay_version, "torch": self.torch, "triton": self.triton,
                "aiter": self.aiter, "launch_configs": self.launch_configs, "stock": self.stock, "seed": self.seed,
                "provider": self.provider,
                "shapes": {"heads": heads, "variants": sorted({r.variant for r in self.rows if r.variant}),
                           "buckets": sorted({r.tokens for r in self.rows}), "kv_cache_dtype": self.kv_cache_dtype,
                           "fp8_format": self.fp8_format},
                "results": [r.to_json() for r in self.rows]}


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                               else (kind,))):
        wanted = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise MeasuredError(f"{where}: field {name!r} is {value!r}, expected {wanted}")
    return value


def _row(data: Any, where: str) -> Row:
    if not isinstance(data, dict):
        raise MeasuredError(f"{where}: {data!r} is not an object")
    fusion = _field(data, "fusion", str, where)
    if fusion not in FUSIONS:
        raise MeasuredError(f"{where}: field 'fusion' is {fusion!r}, expected one of {', '.join(FUSIONS)}")
    tokens = _field(data, "tokens", int, where)
    if tokens < 1:
        raise MeasuredError(f"{where}: field 'tokens' is {tokens}, expected a positive integer")
    if fusion == QKV_NORM:
        heads = variant = None
    else:
        heads = _field(data, "heads", int, where)
        variant = _field(data, "variant", str, where)
        if heads < 1 or variant not in VARIANTS:
            raise MeasuredError(f"{where}: heads {heads!r}, variant {variant!r}: expected a positive heads count "
                                f"and one of {', '.join(VARIANTS)}")
    exact = _field(data, "exact", bool, where)
    problems = data.get("problems", [])
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        raise MeasuredError(f"{where}: field 'problems' is {problems!r}, expected a list of strings")
    problems = tuple(problems)
    if not exact or problems:  # exact, yet listing problems: read as not exact (stock in that bucket only)
        return Row(fusion, tokens, heads, variant, False, problems=problems)
    stock_us, fused_us = (_finite(data, k, where) for k in ("stock_us", "fused_us"))
    if not (stock_us > 0 and fused_us > 0):
        raise MeasuredError(f"{where}: stock_us {stock_us}, fused_us {fused_us}: expected positive times")
    row = Row(fusion, tokens, heads, variant, True, stock_us, fused_us, problems)
    ratio = _finite(data, "ratio", where)
    if row.ratio is None or not math.isclose(ratio, row.ratio, rel_tol=1e-6):
        raise MeasuredError(f"{where}: field 'ratio' is {ratio!r}, but stock_us / fused_us is {row.ratio!r}")
    return row


def _finite(data: Mapping[str, Any], name: str, where: str) -> float:
    """A number field as a finite float (an integer too large for a float is not one)."""
    value = _field(data, name, (int, float), where)
    number = json_values.finite(value)
    if number is None:
        raise MeasuredError(f"{where}: field {name!r} is {value!r}, expected a finite number")
    return number


def _text(data: Mapping[str, Any], name: str, where: str) -> str:
    """An optional text field ("" where a file of an older k3-amd-overlay has none)."""
    return "" if data.get(name) is None else _field(data, name, str, where)


def parse(data: Any, path: str) -> Measurement:
    """The measurement a result file holds; MeasuredError naming the file and the field otherwise."""
    if not isinstance(data, dict):
        raise MeasuredError(f"{path}: not a JSON object ({type(data).__name__})")
    if data.get("schema") != SCHEMA:
        raise MeasuredError(f"{path}: field 'schema' is {data.get('schema')!r}; this k3-amd-overlay reads "
                            f"schema {SCHEMA} (`{COMMAND}` writes it)")
    text = {name: _field(data, name, str, path)
            for name in ("arch", "device", "date", "overlay_version", "provider")}
    shapes = _field(data, "shapes", dict, path)
    results = _field(data, "results", list, path)
    rows = tuple(_row(r, f"{path} results[{i}]") for i, r in enumerate(results))
    seen: set[tuple[str, int | None, str | None, int]] = set()
    for i, row in enumerate(rows):
        if row.key in seen:
            raise MeasuredError(f"{path} results[{i}]: {row.fusion} at {row.tokens} tokens, "
                                f"{shape_words(row.heads, row.variant)} is measured twice")
        seen.add(row.key)
    seed = data.get("seed", 0)
    if json_values.whole(seed) is None or seed not in SEEDS:  # `in range` scans a range for a non-int
        raise MeasuredError(f"{path}: field 'seed' is {seed!r}, expected a whole number {SEEDS[0]}-{SEEDS[-1]}")
    return Measurement(path=path, **text, torch=_text(data, "torch", path), triton=_text(data, "triton", path),
                       aiter=_text(data, "aiter", path),
                       kv_cache_dtype=_text(shapes, "kv_cache_dtype", f"{path} shapes"),
                       fp8_format=_text(shapes, "fp8_format", f"{path} shapes"),
                       stock=_text(data, "stock", path), seed=seed, rows=rows,
                       launch_configs=_text(data, "launch_configs", path))


def load(path: str | Path) -> Measurement:
    try:
        data = json_files.load(path)
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8 JSON, or nested past the parser's limit
        raise MeasuredError(f"cannot read the self-measurement {path}: {exc}") from None
    try:
        return parse(data, str(path))
    except MeasuredError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:  # a field parse() missed: never a crash
        raise MeasuredError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None


def configs_fingerprint(arch: str, device: str | None) -> str | None:
    """A sha256 of the launch configs this process's kernels resolve to on ``arch`` and ``device``
    (every kernel's rules in order, their bounds and configs: what picks each launch's config), or
    None where they do not resolve (a bad shipped file: the fused Triton kernels are refused)."""
    try:
        resolved = launch_configs.resolve(arch, device)
    except launch_configs.LaunchConfigError:
        return None
    rules = {kernel: [[r.tokens, r.heads, dict(r.config)] for r in found] for kernel, (found, _) in resolved.items()}
    return hashlib.sha256(json.dumps(rules, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # not importable here (or broken): this process cannot tell, so no file is trusted
        return None


def conditions(arch: str, device: str | None) -> dict[str, str | None]:
    """This process's ``CONDITIONS`` on ``arch`` and ``device`` (None: it cannot tell). The KV-cache
    dtype is the fused decode's own: it runs only on a plain fp8 cache (fusions/qk_cache.py), so the
    buckets it is gated in were measured right only on that one. The fp8 format is the one vLLM's
    platform and the fused paths use, e4m3fnuz exactly on gfx94x (format_for_gcn_arch, NVIDIA too)."""
    return {"launch_configs": configs_fingerprint(arch, device), "torch": _version("torch"),
            "triton": _version("triton"), "aiter": aiter_identity(), "kv_cache_dtype": KV_CACHE_DTYPE,
            "fp8_format": format_for_gcn_arch(arch).name}


def _stale(path: Path, found: list[tuple[str, str, str]]) -> str:
    """Why a file measured under other conditions is not used: each (field, its value, this
    process's, in words)."""
    absent = "absent (a file of an older k3-amd-overlay)"
    fields = "; ".join(f"field {name!r} is {repr(value) if value else absent}, {here}" for name, value, here in found)
    return f"{path}: {fields}: this process does not run the kernels it timed; run `{COMMAND}` again"


def differences(measurement: Measurement, here: Mapping[str, str | None]) -> list[tuple[str, str, str]]:
    """Each condition ``measurement`` was not measured under ``here``: (field, its value, the words
    for ``here``'s), in ``CONDITIONS`` order; a value not recorded, or one ``here`` cannot tell (None
    or ""), differs."""
    found = []
    for name, value in measurement.conditions().items():
        wanted = here.get(name)
        if not wanted:
            found.append((name, value, "this process cannot tell its own"))
        elif value != wanted:
            found.append((name, value, f"this process's is {wanted!r}"))
    return found


@dataclass(frozen=True)
class Loaded:
    """What the server found for its GPU: the file's path (None: no GPU), the measurement it uses
    (None: none), and why a file there is not used (then every gated fusion runs stock: ``unusable``)."""

    path: str | None
    measurement: Measurement | None = None
    error: str | None = None

    @property
    def unusable(self) -> str | None:
        """Why every gate refuses every batch: a self-measurement for this GPU that cannot be used
        (None: it is used, or there is none)."""
        return f"stock at every batch size: the self-measurement cannot be used ({self.error})" if self.error \
            else None


def load_here(arch: str, device: str | None, environ: Mapping[str, str] | None = None,
              version: str = __version__) -> Loaded:
    """The result file for this GPU, checked: of this arch and device, written by this overlay
    version and measured under this process's ``conditions`` (its kernels are what was measured).
    ``environ`` says only where the file is; the conditions are always this process's own (its
    launch configs resolve from its own environment, as its kernels' do).
    Never raises: a file that cannot be used comes back as ``error`` (the caller logs it and goes on
    without the file)."""
    if device is None:
        return Loaded(None)
    environ = os.environ if environ is None else environ
    try:
        path = result_path(arch, device, environ)
    except (RuntimeError, KeyError):  # no home directory to hold the per-user one (no HOME, no passwd entry)
        return Loaded(None)
    except OSError as exc:  # the configured path cannot be looked at (too long, no access)
        return Loaded(None, error=f"{KERNEL_CONFIGS}={environ.get(KERNEL_CONFIGS, '')}: cannot be looked in "
                                  f"({exc}); no self-measurement is used")
    try:
        here = path.is_file()
    except OSError as exc:  # a directory this user cannot search
        return Loaded(str(path), error=f"{path}: cannot be looked for ({exc}); no self-measurement is used")
    if not here:
        return Loaded(str(path), error=_measured_elsewhere(path, arch, device, environ))
    try:
        found = load(path)
    except MeasuredError as exc:
        return Loaded(str(path), error=str(exc))
    if (found.arch, found.device) != (arch, device):
        return Loaded(str(path), error=f"{path}: fields 'arch', 'device' are {found.arch!r}, {found.device!r}; "
                                       f"this GPU is {arch!r}, {device!r}")
    if found.overlay_version != version:
        return Loaded(str(path), error=_stale(path, [("overlay_version", found.overlay_version,
                                                      f"this is k3-amd-overlay {version}")]))
    stale = differences(found, conditions(arch, device))
    if stale:
        return Loaded(str(path), error=_stale(path, stale))
    return Loaded(str(path), found)


def _measured_elsewhere(path: Path, arch: str, device: str, environ: Mapping[str, str]) -> str | None:
    """Why a file of this GPU in the per-user directory is not read: ``measure`` ran without
    ``K3_AMD_OVERLAY_KERNEL_CONFIGS``, which this process has (None: no such file)."""
    if not environ.get(KERNEL_CONFIGS):
        return None
    try:
        other = user_dir(environ) / result_name(arch, device)
        if other == path or not other.is_file():
            return None
    except (OSError, RuntimeError, KeyError):  # no home directory, or one this user cannot search: nothing to say
        return None
    return (f"{path} not found, but {other} is: this GPU was measured without {KERNEL_CONFIGS}, which here names "
            f"{path.parent}; run `{COMMAND}` with {KERNEL_CONFIGS} set as the server has it (after any `tune`: a "
            "measurement is of the launch configs it ran with)")


def _span(low: int, high: int) -> str:
    return f"{high} token{'s' if high != 1 else ''}" if low == high else f"{low}-{high} tokens"


# What the absorbed launch is weighed against on a layer vLLM 0.32+ fuses itself: there vLLM's own
# fused decode runs every batch the overlay does not take, and it is two launches (the W_UK BMM and one
# fused cache write), as the qk_cache fusion's timed path is; the unfused chain would flatter it.
FUSED_DECODE = "the two-launch fused decode (W_UK BMM + one fused cache write, as vLLM's own fused decode)"


def _reason(run: list[Row], low: int, against: str) -> str:
    span = _span(low, run[-1].tokens)
    if not run[0].exact:
        return f"stock at {span}: not exact on this GPU ({'; '.join(run[0].problems) or 'parity failed'})"
    if run[0].ratio is None:
        return f"stock at {span}: {against} was not timed there on this GPU"
    words = sorted({ratio_words(r.ratio) for r in run}, key=lambda w: float(w[:-1]))
    ratio = words[0] if len(words) == 1 else f"{words[0][:-1]}-{words[-1]}"
    return f"stock at {span}: {ratio} of {against} on this GPU"


# The fusions vLLM runs its own launch for on a layer it fuses itself, and that launch (vLLM 0.30+'s
# AITER dual RMSNorm; 0.32+'s fused decode): `measure` cannot time it (AITER's HIP ops), and for qk_cache
# the FUSED_DECODE stand-in would be the overlay's own launch against itself.
UPSTREAM_UNMEASURED = {QKV_NORM: "vLLM's own fused norm", QK_CACHE: "vLLM's own fused decode"}


def _over_fused_decode(rows: list[Row], measurement: Measurement) -> list[Row]:
    """The absorbed launch's ``rows`` with FUSED_DECODE's time at the same bucket as the stock they
    beat or not (None where it was not timed exact there)."""
    two = {r.tokens: r for r in measurement.rows if r.key[:3] == (QK_CACHE, *rows[0].key[1:3])}
    return [replace(row, stock_us=two[row.tokens].fused_us if row.tokens in two else None) if row.exact else row
            for row in rows]


def gate_for(measurement: Measurement, fusion: str, heads: int | None = None,
             variant: str | None = None, provider: str | None = None, upstream_fuses: bool = False,
             activations: str = ACTIVATIONS) -> BucketGate:
    """Where ``fusion`` may run at this shape (qkv_norm: any shape) with ``provider``'s launch (None:
    the one measured) on ``activations`` (another dtype than measured runs nowhere); with
    ``upstream_fuses`` (a layer vLLM fuses itself) the absorbed launch is weighed against
    FUSED_DECODE, which runs there in its place, not against the unfused chain, and the one-for-one
    fusions (qkv_norm, qk_cache) run nowhere: vLLM's own launch runs there in their place, and
    ``measure`` never timed it. Consecutive buckets refused for the same kind of reason (slower; not
    exact) share one reason, spanning them. Another provider than the one measured runs nowhere: its
    launches were never timed."""
    if upstream_fuses and fusion in UPSTREAM_UNMEASURED:
        return BucketGate((), f"stock ({UPSTREAM_UNMEASURED[fusion]}) at every batch size: {COMMAND} timed the "
                              f"overlay's {fusion} launch against the unfused launches, never against vLLM's own "
                              "fused one that runs on this layer in its place")
    if provider is not None and provider != measurement.provider:
        return BucketGate((), f"stock: {COMMAND} timed the {measurement.provider} provider's launch on this GPU, "
                              f"this layer's is {provider}'s: not measured")
    if activations != ACTIVATIONS:
        return BucketGate((), f"stock: {COMMAND} timed {ACTIVATIONS} activations on this GPU, this layer's are "
                              f"{activations}: not measured")
    if fusion == QKV_NORM:
        heads = variant = None
    rows = sorted((r for r in measurement.rows if (r.fusion, r.heads, r.variant) == (fusion, heads, variant)),
                  key=lambda r: r.tokens)
    if not rows:
        return BucketGate((), f"stock: not measured at {shape_words(heads, variant)} on this GPU")
    against = "stock"
    if upstream_fuses and fusion == ABSORB_QK_CACHE:
        rows, against = _over_fused_decode(rows, measurement), FUSED_DECODE
    runs: list[tuple[int, list[Row]]] = []  # (the run's lowest token count, its rows)
    previous = 0
    for row in rows:
        last = runs[-1][1][-1] if runs else None
        same = (last is not None and not last.fused and not row.fused and last.exact == row.exact
                and (last.ratio is None) == (row.ratio is None))
        if same:
            runs[-1][1].append(row)
        else:
            runs.append((previous + 1, [row]))
        previous = row.tokens
    buckets = tuple((row.tokens, None if row.fused else _reason(run, low, against))
                    for low, run in runs for row in run)
    return BucketGate(buckets, f"stock above {rows[-1].tokens} tokens: not measured on this GPU")


def fused_anywhere(measurement: Measurement, fusion: str) -> bool:
    """Whether ``fusion`` may run in any bucket at any shape ``measurement`` timed it at (its gates', as
    the server reads them, against the unfused chain)."""
    shapes = {(r.heads, r.variant) for r in measurement.rows if r.fusion == fusion}
    return any(why is None for heads, variant in shapes
               for _, why in gate_for(measurement, fusion, heads, variant).buckets)


def _loaded_gate(loaded: Loaded, fusion: str, heads: int | None, variant: str | None, provider: str | None,
                 upstream_fuses: bool, activations: str) -> BucketGate | None:
    """``gate_for`` from what the server found: None without a file (every batch as the decisions
    say); a file that cannot be used refuses every batch."""
    if loaded.unusable:
        return BucketGate((), loaded.unusable)
    if loaded.measurement is None:
        return None
    return gate_for(loaded.measurement, fusion, heads, variant, provider, upstream_fuses, activations)


def decode_gates(loaded: Loaded, heads: int, variant: str, providers: Mapping[str, str | None] | None = None,
                 upstream_fuses: bool = False, activations: str = ACTIVATIONS) -> dict[str, BucketGate] | None:
    """The decode plan's gates for a layer of ``heads`` heads per rank and this W_UK absorption, each
    fusion's for the provider ``providers`` names, on a layer vLLM fuses itself or not (None without
    a file: every batch as the decisions say; a file that cannot be used refuses every batch)."""
    gates = {fusion: _loaded_gate(loaded, fusion, heads, variant, (providers or {}).get(fusion), upstream_fuses,
                                  activations) for fusion in DECODE_FUSIONS}
    return None if any(gate is None for gate in gates.values()) else gates


def norm_gate(loaded: Loaded, provider: str | None = None, upstream_fuses: bool = False,
              activations: str = ACTIVATIONS) -> BucketGate | None:
    """The qkv_norm site's gate for ``provider``'s launch on ``activations``, on a layer vLLM fuses
    itself or not (None without a file; a file that cannot be used refuses every batch)."""
    return _loaded_gate(loaded, QKV_NORM, None, None, provider, upstream_fuses, activations)


def measured_first(missing: Mapping[str, str | None], setting: str,
                   measurement: Measurement | None) -> dict[str, str | None]:
    """``missing`` (each fused provider: None where it can run here, else why not) as ``auto`` should
    choose from it: with a measurement, only the provider it timed, whose verdicts are the only ones
    this GPU has; a provider named by its variable is left to the gate."""
    if measurement is None or setting != AUTO:
        return dict(missing)
    return {name: why if name == measurement.provider else
            (why or f"not the provider {COMMAND} timed on this GPU ({measurement.provider}), so never measured "
                    "against stock") for name, why in missing.items()}


def config_failed_reason(entry: Mapping[str, Any]) -> str:
    """The marker's reason for the batches a failed launch config (a ``launch_configs.degraded`` entry)
    would have run: stock, since only the table's config was measured."""
    return (f"stock where rules {', '.join(entry.get('rules') or [])} pick {entry.get('config')}: it failed on this "
            f"GPU ({entry.get('why')}) and the safe config that runs in its place was never measured")


def marker_entry(loaded: Loaded, gates: Mapping[str, BucketGate | None] | None = None,
                 shape: str | None = None, failed: Mapping[str, list[Mapping[str, Any]]] | None = None
                 ) -> dict[str, Any]:
    """The marker's ``measurement`` field: the file, its date, and per fusion the buckets where its
    fused path may run and every reason stock runs elsewhere (for the layers of ``shape``; ``failed``:
    per fusion, its kernel's launch configs that failed in this process, whose batches run stock)."""
    found = loaded.measurement
    entry: dict[str, Any] = {"file": loaded.path, "state": "used" if found else UNUSABLE if loaded.error else "none"}
    if loaded.error:
        entry["error"] = loaded.error
    if found is None and not loaded.error:
        return entry
    if found is not None:
        entry.update(date=found.date, device=found.device)
    entry["shape"] = shape
    fused, stock = {}, {}
    for fusion, gate in (gates or {}).items():
        if gate is not None:
            fused[fusion] = [tokens for tokens, why in gate.buckets if why is None]
            stock[fusion] = [*gate.reasons(), *(config_failed_reason(e) for e in (failed or {}).get(fusion, []))]
    entry.update(fused_buckets=fused, stock=stock)
    return entry


def summary(entry: Mapping[str, Any]) -> str:
    """One line on a process's measurement (``check`` prints it): used, ignored, or none; never
    raises (a marker written by hand or by another tool gets a line saying it is unreadable)."""
    state = entry.get("state")
    if state == UNUSABLE:
        return (f"self-measurement unusable ({entry.get('error')}): every gated fused path runs stock at every "
                f"batch size until `{COMMAND}` runs again")
    if state != "used":
        where = f" ({entry['file']})" if entry.get("file") else ""
        return (f"no self-measurement for this GPU{where}: every fused path runs at every batch size; `{COMMAND}` "
                "measures them against stock")
    stock, fused = entry.get("stock", {}), entry.get("fused_buckets", {})
    if not (isinstance(stock, Mapping) and isinstance(fused, Mapping)
            and all(isinstance(r, list) and all(isinstance(w, str) for w in r) for r in stock.values())
            and all(isinstance(b, list) for b in fused.values())):
        return (f"unreadable measurement entry ({entry.get('file')}): 'stock' must map each fusion to its reasons "
                f"and 'fused_buckets' each fusion to its buckets; got {json.dumps(dict(entry), default=str)[:200]}")
    parts = []
    for fusion, reasons in stock.items():
        buckets = fused.get(fusion, [])
        parts.append(f"{fusion} fused in {len(buckets)} bucket{'s' if len(buckets) != 1 else ''}"
                     + (f", {'; '.join(reasons)}" if reasons else ""))
    shape = f", {entry['shape']}" if entry.get("shape") else ""
    return (f"self-measurement {entry.get('file')} ({entry.get('date')}{shape}): "
            + ("; ".join(parts) or "no fused path gated in this process"))


def doctor_section(arch: str | None, device: str | None, environ: Mapping[str, str] | None = None,
                   loaded: Loaded | None = None) -> dict[str, Any]:
    """``doctor``'s self-measurement section: the file for this GPU (``loaded``, where the caller has
    read it already), its verdicts per fusion and shape, or why it is not used, and the
    recommendation to measure where there is none."""
    if arch is None or device is None:
        return {"state": "none", "note": "no GPU: nothing to measure"}
    loaded = loaded or load_here(arch, device, environ)
    section: dict[str, Any] = {"file": loaded.path, "state": marker_entry(loaded)["state"]}
    if loaded.error:
        section["error"] = loaded.error
        section["effect"] = loaded.unusable
    found = loaded.measurement
    if found is None:
        section["recommend"] = (f"`{COMMAND} --heads H --variant bf16|fp8` (minutes, safe beside a live server) "
                                "times each fused path against stock on this GPU; the server then runs a fusion only "
                                "in the batch sizes where it measured exact and at least as fast")
        return section
    shapes = sorted({(r.fusion, r.heads, r.variant) for r in found.rows}, key=lambda s: (FUSIONS.index(s[0]),
                                                                                         s[1] or 0, s[2] or ""))
    section["date"] = found.date
    section["verdicts"] = [{"fusion": f, "shape": shape_words(h, v),
                            "fused buckets": [t for t, why in gate_for(found, f, h, v).buckets if why is None],
                            "stock": gate_for(found, f, h, v).reasons()} for f, h, v in shapes]
    return section


def doctor_lines(section: Mapping[str, Any]) -> list[str]:
    """The section for a person."""
    if section.get("note"):
        return [f"  {section['note']}"]
    lines = [f"  file: {section.get('file')} ({section.get('state')})"]
    if section.get("error"):
        lines.append(f"  not used: {section['error']}")
        lines.append(f"  so: {section.get('effect')}")
    if section.get("recommend"):
        lines.append(f"  recommended: {section['recommend']}")
    for verdict in section.get("verdicts", []):
        lines.append(f"  {verdict['fusion']} ({verdict['shape']}): fused in buckets "
                     f"{', '.join(map(str, verdict['fused buckets'])) or 'none'}; " + "; ".join(verdict["stock"]))
    return lines
