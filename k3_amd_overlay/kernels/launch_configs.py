"""Launch configurations of the overlay's Triton kernels, per GPU arch, read from JSON.

The package ships one file per arch (``configs/<arch>.json``: sm90, where the original shapes were
measured, and AMD's gfx942 and gfx950), and one for Triton's CPU interpreter (``cpu.json``: it runs
a launch's programs one after another, so its rules take the fewest); ``k3-amd-overlay tune`` writes
a file for one device, which the variable ``K3_AMD_OVERLAY_KERNEL_CONFIGS`` (a file, or a directory
of tuned files) puts first. In a directory only the file named ``<arch>-<device>.json`` for this GPU
is read (other names are ignored, with a warning naming them). A tuned file for this GPU that cannot
be used (malformed, for another arch or GPU) never stops a worker: one ERROR line names the file and
the problem, the shipped file serves instead, and ``startup_error`` gives ``doctor`` and the marker
the same line; a shipped file that cannot be used refuses the fused Triton kernels (the first launch
raises inside the sites' failure containment).

A config that fails to compile or launch on this GPU is replaced, in every rule of its kernel that
picks it and only there, by the arch's safe config, defined once (``safe_config``): the catch-all
(last) rule of the shipped file the arch uses, the arch's default for any launch no earlier rule
takes. ``degrade`` records it (``degraded``: for the marker); the launch is tried again; only a
safe config that fails too leaves the failure to refuse the fusion (kernel_failures.py).

An arch without a shipped file (gfx908, gfx90a, gfx1100, gfx1201, ...; an NVIDIA GPU other than sm90)
takes the nearest shipped file untuned, with a WARNING and a note in each kernel's source (the marker,
``check`` and ``doctor`` show it): gfx942's for AMD, sm90's for NVIDIA. On RDNA (gfx10-gfx12: 32-wide
waves, WMMA instead of MFMA) gfx942's register and tile reasoning does not hold, which the note says;
``k3-amd-overlay tune`` on that GPU writes its own file.
A file holds, per kernel, rules tried in order: ``{"tokens": T, "heads": H, "config": {...}}``
matches a launch of at most T tokens and at most H query heads (either left out: any), the last
rule of each kernel matching everything. A config sets the kernel's launch constexprs and options;
AMD-only options (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) are dropped on other
backends, whose Triton rejects them."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files, json_values, k3
from k3_amd_overlay.kernels import names
from k3_amd_overlay.settings import KERNEL_CONFIGS

logger = logging.getLogger("vllm.k3_amd_overlay")

CONFIG_DIR = Path(__file__).parent / "configs"
SCHEMA = 1
SHIPPED_ARCHS = ("sm90", "gfx942", "gfx950")
INTERPRETER_ARCH = "cpu"  # Triton's CPU interpreter: its own file, rules for the fewest programs
AMD_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# Those of them where 0 leaves the choice to the compiler, as in Triton (kpack's own default is 1, and
# Triton's AMD matmul pass fails on a kpack of 0)
COMPILER_CHOICE_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim")
LAUNCH_OPTIONS = ("num_warps", "num_stages", *AMD_ONLY_OPTIONS)
# The constexprs each kernel's config must set (num_warps too); tile sizes are powers of two.
KERNEL_PARAMETERS: dict[str, tuple[str, ...]] = {
    names.RMSNORM_PAIR_KERNEL: ("ROWS_Q", "ROWS_KV"),
    names.QK_CACHE_KERNEL: ("HEADS",),
    names.STATIC_QUANT_KERNEL: (),
    names.ABSORB_QK_CACHE_KERNEL: ("BLOCK_N", "BLOCK_T"),
    names.ABSORB_FP8_QK_CACHE_KERNEL: ("BLOCK_N", "BLOCK_T"),
    names.ABSORB_MXFP4_QK_CACHE_KERNEL: ("BLOCK_N", "BLOCK_T"),
}
# The absorb kernels sum the products lane by lane in programs of at most FEW_TOKEN_MOST tokens and take a
# tl.dot in larger ones: of at least DOT_LEAST tokens on AMD, PADDED_DOT_ROWS or more elsewhere
DOT_TILE_KERNELS = (names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL,
                    names.ABSORB_MXFP4_QK_CACHE_KERNEL)
# The constexprs a config may leave out, with the value a launch then takes (a power of two each):
# KV_ROWS, the tokens an absorb kernel's KV program writes (1: one program a token, as before it existed);
# K_STEPS, the slices of the bf16 absorb kernel's dot over P (1: one dot; at most P / 16, tl.dot's least K).
OPTIONAL_PARAMETERS: dict[str, dict[str, int]] = {
    **{kernel: {} for kernel in KERNEL_PARAMETERS},
    **{kernel: {"KV_ROWS": 1, **({"K_STEPS": 1} if kernel == names.ABSORB_QK_CACHE_KERNEL else {})}
       for kernel in DOT_TILE_KERNELS},
}
DOT_LEAST = 16  # tl.dot's least K, and the least rows of a dot on AMD (AMD_MATRIX_SIZES)
# The most tokens a program of an absorb kernel takes without a dot (each product summed in fp32 over a
# [BLOCK_T, P, BLOCK_N] broadcast): on the H200, programs of 8 tokens ran 1.9-3.1x slower than the
# 16-row tile at 8 tokens (docs/benchmarks.md).
FEW_TOKEN_MOST = 4
# Programs of 8 tokens take a dot of 8 rows off AMD: Triton's NVIDIA backend pads a dot's rows onto the
# tensor cores from Triton 3.5 (min_dot_size in the 3.5.0-3.9.0 wheels: (1, 1, 16) for 16-bit operands,
# (1, 1, 32) for 8-bit; 3.4.0's is (16, 16, 16), and there such a config would fail its compile at load
# and its bucket take the safe config). On an H100 they beat the 16-row tile at 4 and 8 tokens, bytes
# identical (docs/benchmarks.md, 2026-12-06). AMD files keep 16 rows at least: Triton's AMD backend computes a
# dot no MFMA instruction fits with FMA, and the AMD tile rules below assume 16 or 32 rows.
PADDED_DOT_ROWS = 8


def least_dot_rows(arch: str) -> int:
    """The fewest tokens a program of an absorb kernel takes a tl.dot with on ``arch`` (programs of at
    most FEW_TOKEN_MOST sum the products without one; the loader refuses the sizes between)."""
    return DOT_LEAST if arch.startswith("gfx") else PADDED_DOT_ROWS


MAX_K_STEPS = k3.QK_NOPE_HEAD_DIM // DOT_LEAST
# The most a config may set each key to (matrix_instr_nonkdim: one of AMD_MATRIX_SIZES), and why: no launch on
# any GPU takes more. The shipped files and tune's candidates stay far below (num_warps 8, tiles 512).
MOST_TILE = 4096
MOST_VALUES: dict[str, tuple[int, str]] = {
    # a workgroup (block) holds at most 1024 threads on AMD and NVIDIA alike, and the narrowest warp is 32 lanes
    # (NVIDIA; RDNA's wave32): 32 warps bounds both (CDNA's 64-wide waves reach only 16; more fails there)
    "num_warps": (32, "1024 threads a workgroup, in warps of at least 32 lanes"),
    "num_stages": (16, "software-pipeline stages, each another copy of a loop's tiles in shared memory"),
    "waves_per_eu": (20, "0: the compiler's choice; LLVM's most waves per SIMD of any AMD target, gfx10's"),
    "kpack": (2, "Triton's AMD kpack: 1 or 2"),
    "K_STEPS": (MAX_K_STEPS, f"slices of the {k3.QK_NOPE_HEAD_DIM} q_nope lanes of at least {DOT_LEAST}, tl.dot's "
                             "least K"),
    **{key: (MOST_TILE, "a tile side no program's registers and shared memory hold more of")
       for key in ("ROWS_Q", "ROWS_KV", "HEADS", "BLOCK_N", "BLOCK_T", "KV_ROWS")},
}
# The part of the dot's result (rows x columns) one warp's matrix instruction computes. AMD (gfx*):
# MFMA v_mfma_f32_<M>x<N>x<K>_<type>, M = N = 16 or 32 for every dtype of these kernels on CDNA3 and
# CDNA4 (AMD's CDNA3/CDNA4 ISA guides; the instruction the compile report reads from each code object,
# e.g. v_mfma_f32_16x16x128_f8f6f4 for gfx950 fp8, v_mfma_f32_32x32x16_fp8_fp8 for a gfx942 64x128
# block); Triton takes matrix_instr_nonkdim's size, and with it unset (0) 32 where both sides of the
# block reach 32, else 16 (the compile report checks this prediction against the code object).
# NVIDIA: mma.sync m16n8 (PTX ISA), and a warp's share of a Hopper wgmma is also 16 rows of 8-column steps.
# The loader holds only AMD files to one warp per tile: on the H200 the sm90 rules with more warps than
# 16x8 tiles measured 1.04-1.17x faster than the same blocks cut to one warp per tile (the extra warps
# share the kernel's loads and cache writes; 2026-12-02, docs/benchmarks.md), so sm90 keeps them.
AMD_MATRIX_SIZES = (16, 32)
NVIDIA_WARP_TILE = (16, 8)


class LaunchConfigError(ValueError):
    """A launch-config file (shipped, tuned, or named by K3_AMD_OVERLAY_KERNEL_CONFIGS) is unusable."""


class ConfigDegraded(Exception):
    """A launch failed on its config, which ``degrade`` has just replaced by the safe config: the
    launch is worth trying again (``kernel_failures.guarded`` and the ahead-of-time compile do)."""


Config = tuple[tuple[str, int], ...]  # one launch config, its (name, value) pairs sorted


@dataclass(frozen=True)
class Rule:
    tokens: int | None
    heads: int | None
    config: Config

    def matches(self, num_tokens: int, num_heads: int) -> bool:
        return (self.tokens is None or num_tokens <= self.tokens) and (self.heads is None or num_heads <= self.heads)


@dataclass(frozen=True)
class ConfigFile:
    """One parsed file: its arch, where it came from, the device it was tuned on (None: untuned) and
    each kernel's rules."""

    path: str
    arch: str
    tuned_on: str | None
    kernels: dict[str, tuple[Rule, ...]]


@dataclass(frozen=True)
class Source:
    """Where one kernel's configs come from in this process (for the marker, doctor and check)."""

    file: str
    arch: str
    tuned_on: str | None
    this_device: bool  # tuned on the device this process runs on
    note: str | None = None  # e.g. the arch has no file of its own

    def to_json(self) -> dict[str, Any]:
        found = {"file": self.file, "arch": self.arch, "tuned_on": self.tuned_on, "tuned_here": self.this_device}
        return {**found, "note": self.note} if self.note else found


def _positive_int(value: Any, where: str) -> int:
    number = json_values.whole(value, 1)
    if number is None:
        raise LaunchConfigError(f"{where}: {value!r} is not a positive integer")
    return number


def matrix_tile(arch: str, config: dict[str, int]) -> tuple[int, int]:
    """(rows, columns) of the dot's result one warp's matrix instruction computes for ``config`` on
    ``arch`` (the sizes and their sources: above ``AMD_MATRIX_SIZES``)."""
    if not arch.startswith("gfx"):
        return NVIDIA_WARP_TILE
    size = config.get("matrix_instr_nonkdim") or (32 if min(config["BLOCK_T"], config["BLOCK_N"]) >= 32 else 16)
    return size, size


def max_dot_warps(arch: str, config: dict[str, int]) -> int:
    """The most warps ``config``'s dot block (BLOCK_T x BLOCK_N) keeps apart on ``arch``: one per
    matrix tile of the block; more and some warps compute a tile another already computes."""
    rows, cols = matrix_tile(arch, config)
    return max(1, config["BLOCK_T"] // rows) * max(1, config["BLOCK_N"] // cols)


def dot_warps_fit(arch: str, kernel: str, config: dict[str, int]) -> bool:
    """Whether ``config`` keeps ``kernel``'s warps on distinct matrix tiles on ``arch`` (what the loader
    demands; ``tune`` can skip the candidates that do not)."""
    if kernel not in DOT_TILE_KERNELS or config["BLOCK_T"] < DOT_LEAST or not arch.startswith("gfx"):
        return True  # on AMD no dot below DOT_LEAST tokens a program (the loader refuses 5-15 there)
    return config["num_warps"] <= max_dot_warps(arch, config)


def amd_adapted(arch: str, kernel: str, config: dict[str, int]) -> dict[str, int]:
    """An NVIDIA (sm90) config as the AMD ``arch`` takes it (scripts/derive_amd_rules.py starts each AMD
    rule here): a dot of fewer than DOT_LEAST rows (sm90's padded 8) on DOT_LEAST; a dot block with both
    sides at least 32 on 16-wide MFMA (``matrix_instr_nonkdim`` 16; Triton's 32x32 there needs more
    registers); its warps at most one per matrix tile."""
    adapted = dict(config)
    if kernel in DOT_TILE_KERNELS and FEW_TOKEN_MOST < adapted["BLOCK_T"] < least_dot_rows(arch):
        adapted["BLOCK_T"] = least_dot_rows(arch)  # a padded dot on NVIDIA: AMD's least tile
    if kernel in DOT_TILE_KERNELS and min(adapted["BLOCK_T"], adapted["BLOCK_N"]) >= 32:
        adapted["matrix_instr_nonkdim"] = AMD_MATRIX_SIZES[0]
    if not dot_warps_fit(arch, kernel, adapted):
        adapted["num_warps"] = max_dot_warps(arch, adapted)
    return adapted


def _check_dot_warps(arch: str, config: dict[str, int], where: str) -> None:
    allowed = max_dot_warps(arch, config)
    if config["num_warps"] > allowed:
        rows, cols = matrix_tile(arch, config)
        raise LaunchConfigError(
            f"{where}: num_warps = {config['num_warps']} on a {config['BLOCK_T']}x{config['BLOCK_N']} block "
            f"(BLOCK_T x BLOCK_N) of {rows}x{cols} matrix tiles on {arch}: at most {allowed} warps (more compute "
            "the same tile over again)")


def _check_most(values: dict[str, int], where: str) -> None:
    """Each value of a config at most its key's bound in MOST_VALUES (LaunchConfigError naming the key, the
    value and the range allowed)."""
    for key, value in values.items():
        if key in MOST_VALUES and value > MOST_VALUES[key][0]:
            most, why = MOST_VALUES[key]
            least = 0 if key in COMPILER_CHOICE_OPTIONS else 1
            raise LaunchConfigError(f"{where}: {key} = {value}: allowed {least}-{most} ({why})")


def _parse_config(kernel: str, config: Any, where: str, arch: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(config, dict):
        raise LaunchConfigError(f"{where}: config must be an object, got {config!r}")
    required = (*KERNEL_PARAMETERS[kernel], "num_warps")
    allowed = (*KERNEL_PARAMETERS[kernel], *OPTIONAL_PARAMETERS[kernel], *LAUNCH_OPTIONS)
    missing = [k for k in required if k not in config]
    unknown = [k for k in config if k not in allowed]
    if missing or unknown:
        raise LaunchConfigError(f"{where}: config {config} lacks {missing} or has unknown keys {unknown} "
                                f"(allowed: {', '.join(allowed)})")
    values = {k: 0 if k in COMPILER_CHOICE_OPTIONS and v == 0 else _positive_int(v, f"{where} {k}")
              for k, v in config.items()}
    if values.get("matrix_instr_nonkdim", 0) not in (0, *AMD_MATRIX_SIZES):
        raise LaunchConfigError(f"{where}: matrix_instr_nonkdim = {values['matrix_instr_nonkdim']}: 0 (Triton's "
                                f"choice) or one of {', '.join(map(str, AMD_MATRIX_SIZES))}")
    _check_most(values, where)
    for key in (*KERNEL_PARAMETERS[kernel], *(k for k in OPTIONAL_PARAMETERS[kernel] if k in values), "num_warps"):
        if values[key] & (values[key] - 1):
            raise LaunchConfigError(f"{where}: {key} = {values[key]} is not a power of two")
    if kernel in DOT_TILE_KERNELS and FEW_TOKEN_MOST < values["BLOCK_T"] < least_dot_rows(arch):
        raise LaunchConfigError(f"{where}: BLOCK_T = {values['BLOCK_T']} on {arch}: at most {FEW_TOKEN_MOST} (no "
                                f"dot: the products summed in fp32) or at least {DOT_LEAST} (AMD's smallest matrix "
                                "tile; Triton computes a smaller dot there with FMA)")
    if values.get("K_STEPS", 1) > 1 and values["BLOCK_T"] < DOT_LEAST:
        raise LaunchConfigError(f"{where}: K_STEPS = {values['K_STEPS']} with BLOCK_T = {values['BLOCK_T']}: the "
                                f"product in slices is for programs of at least {DOT_LEAST} tokens")
    if not dot_warps_fit(arch, kernel, values):
        _check_dot_warps(arch, values, where)
    return tuple(sorted(values.items()))


def _parse_rules(kernel: str, rules: Any, where: str, arch: str) -> tuple[Rule, ...]:
    if not isinstance(rules, list) or not rules:
        raise LaunchConfigError(f"{where}: a non-empty list of rules is needed, got {rules!r}")
    parsed = []
    for i, rule in enumerate(rules):
        here = f"{where} rule {i}"
        if not isinstance(rule, dict) or set(rule) - {"tokens", "heads", "config", "note"} or "config" not in rule:
            raise LaunchConfigError(f"{here}: {rule!r} must be {{tokens?, heads?, config, note?}}")
        bounds = [None if rule.get(k) is None else _positive_int(rule[k], f"{here} {k}") for k in ("tokens", "heads")]
        parsed.append(Rule(bounds[0], bounds[1], _parse_config(kernel, rule["config"], here, arch)))
    if parsed[-1].tokens is not None or parsed[-1].heads is not None:
        raise LaunchConfigError(f"{where}: the last rule must match every launch (no tokens or heads bound)")
    return tuple(parsed)


def parse(data: Any, path: str) -> ConfigFile:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise LaunchConfigError(f"{path}: not a launch-config file of schema {SCHEMA}")
    arch, kernels = data.get("arch"), data.get("kernels")
    if not isinstance(arch, str) or not isinstance(kernels, dict):
        raise LaunchConfigError(f"{path}: needs a string 'arch' and a 'kernels' object")
    unknown = sorted(set(kernels) - set(KERNEL_PARAMETERS))
    if unknown:
        raise LaunchConfigError(f"{path}: unknown kernels {unknown} (known: {', '.join(KERNEL_PARAMETERS)})")
    tuned = data.get("tuned_on")
    device = tuned.get("device") if isinstance(tuned, dict) else None
    return ConfigFile(path, arch, device, {k: _parse_rules(k, v, f"{path} {k}", arch) for k, v in kernels.items()})


def dumps(data: dict[str, Any]) -> str:
    """A launch-config file's text: the header fields, then each kernel's rules one to a line."""
    lines = ["{", *(f" {json.dumps(k)}: {json.dumps(v)}," for k, v in data.items() if k != "kernels"), ' "kernels": {']
    kernels = list(data["kernels"].items())
    for i, (kernel, rules) in enumerate(kernels):
        lines.append(f"  {json.dumps(kernel)}: [")
        lines += [f"   {json.dumps(rule)}" + ("," if j < len(rules) - 1 else "") for j, rule in enumerate(rules)]
        lines.append("  ]" + ("," if i < len(kernels) - 1 else ""))
    return "\n".join([*lines, " }", "}"]) + "\n"


def load(path: str | Path) -> ConfigFile:
    try:
        data = json_files.load(path)
    except (OSError, ValueError) as exc:
        raise LaunchConfigError(f"cannot read launch configs {path}: {exc}") from None
    return parse(data, str(path))


def shipped_arch(arch: str) -> str:
    """The shipped file an arch uses: its own (the CPU interpreter's too), else sm90's for NVIDIA,
    gfx942's for another AMD arch (both untuned there: ``fallback_note``)."""
    if arch in SHIPPED_ARCHS or arch == INTERPRETER_ARCH:
        return arch
    return "gfx942" if arch.startswith("gfx") else "sm90"


RDNA = re.compile(r"gfx1[0-2]\d")


def fallback_note(arch: str) -> str | None:
    """Why ``arch``'s launches use another arch's file (None: it has its own, or it is the CPU)."""
    if shipped_arch(arch) == arch:
        return None
    note = f"no launch-config file for {arch}: {shipped_arch(arch)}'s rules, untuned there"
    if RDNA.match(arch):
        note += " (32-wide waves and WMMA: gfx942's register and tile reasoning does not hold)"
    return note + "; `k3-amd-overlay tune` on this GPU writes its own"


@functools.cache
def _warn_fallback(arch: str) -> None:
    note = fallback_note(arch)
    if note:
        logger.warning("K3 AMD overlay: %s", note)


@functools.cache
def shipped(arch: str) -> ConfigFile:
    table = load(CONFIG_DIR / f"{arch}.json")
    missing = sorted(set(KERNEL_PARAMETERS) - set(table.kernels))
    if missing:
        raise LaunchConfigError(f"{table.path}: the shipped file lacks {missing}")
    return table


def device_slug(name: str) -> str:
    """A GPU's name as it appears in a tuned file's name (``AMD Instinct MI300X``: AMD_Instinct_MI300X)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def tuned_name(arch: str, device_name: str) -> str:
    """The name of the file ``tune`` writes for ``arch`` and the GPU ``device_name``."""
    return f"{arch}-{device_slug(device_name)}.json"


TUNED_NAME = re.compile(r"(sm\d+|gfx[0-9a-f]+)-[A-Za-z0-9_]+\.json")


@functools.cache
def _warn_foreign(directory: str, names: tuple[str, ...]) -> None:
    logger.warning("K3 AMD overlay: %s=%s: ignored %s (only <arch>-<device>.json files, as `k3-amd-overlay "
                   "tune` names them, are read)", KERNEL_CONFIGS, directory, ", ".join(names))


def tuned_file(setting: str, arch: str, device_name: str | None) -> ConfigFile | None:
    """The tuned file ``setting`` names for this arch and device: the file itself (which must be for
    ``arch``), or in a directory the file named for this arch and device (None if there is none; other
    names are ignored with a warning; the file, once there, must be for this arch and device)."""
    path = Path(setting)
    if path.is_dir():
        from k3_amd_overlay.measured import is_result_name  # the self-measurement's files live here too

        foreign = tuple(sorted(p.name for p in path.glob("*.json")
                               if not TUNED_NAME.fullmatch(p.name) and not is_result_name(p.name)))
        if foreign:
            _warn_foreign(str(path), foreign)
        candidate = path / tuned_name(arch, device_name) if device_name else None
        if candidate is None or not candidate.is_file():
            return None
        table = load(candidate)
        if table.arch != arch or table.tuned_on != device_name:
            raise LaunchConfigError(f"{candidate}: named for {arch} on {device_name}, its header says "
                                    f"{table.arch} on {table.tuned_on or 'no GPU (untuned)'}")
        return table
    table = load(path)
    if table.arch != arch:
        raise LaunchConfigError(f"its configs are for {table.arch}, this GPU is {arch}")
    return table


@functools.cache
def _log_unusable(message: str) -> None:
    logger.error("K3 AMD overlay: %s", message)


@functools.cache
def _tuned(setting: str, arch: str, device_name: str | None) -> tuple[ConfigFile | None, str | None]:
    """``tuned_file``, or None and why the file this GPU would read cannot be used, naming the variable
    and its value (logged once: the server's ERROR line, doctor's and the marker's words)."""
    try:
        return tuned_file(setting, arch, device_name), None
    except (LaunchConfigError, OSError) as exc:  # OSError: a path that cannot be looked at (too long, no access)
        message = (f"{KERNEL_CONFIGS}={setting}: {exc}; this GPU's kernels take the shipped {shipped_arch(arch)} "
                   "launch configs instead")
        _log_unusable(message)
        return None, message


def _shipped_for(arch: str) -> ConfigFile:
    """The shipped file ``arch`` uses; a bad one raises with what it means for the fusions (logged once)."""
    try:
        return shipped(shipped_arch(arch))
    except LaunchConfigError as exc:
        message = f"{exc}; the fused Triton kernels are refused (stock runs)"
        _log_unusable(message)
        raise LaunchConfigError(message) from None


@functools.cache
def _resolve(arch: str, device_name: str | None, setting: str) -> dict[str, tuple[tuple[Rule, ...], Source]]:
    base = _shipped_for(arch)
    tuned = _tuned(setting, arch, device_name)[0] if setting else None
    resolved = {}
    for kernel in KERNEL_PARAMETERS:
        table = tuned if tuned is not None and kernel in tuned.kernels else base
        note = fallback_note(arch) if table is base else None
        if note:
            _warn_fallback(arch)
        resolved[kernel] = (table.kernels[kernel], Source(table.path, table.arch, table.tuned_on,
                                                          table.tuned_on is not None and table.tuned_on == device_name,
                                                          note))
    return resolved


def resolve(arch: str, device_name: str | None = None) -> dict[str, tuple[tuple[Rule, ...], Source]]:
    """Each kernel's rules and their source for a GPU of ``arch`` named ``device_name``."""
    return _resolve(arch, device_name, os.environ.get(KERNEL_CONFIGS, ""))


def startup_error(arch: str, device_name: str | None = None) -> str | None:
    """The one line saying which launch-config file for this GPU cannot be used, why, and what runs
    instead (the shipped configs, for a malformed or mismatched file K3_AMD_OVERLAY_KERNEL_CONFIGS
    names; stock, for a bad shipped file), or None: what ``doctor``, the first K3 layer's ERROR line
    and the marker's ``launch_configs.error`` say."""
    try:
        _shipped_for(arch)
    except LaunchConfigError as exc:
        return str(exc)
    setting = os.environ.get(KERNEL_CONFIGS, "")
    return _tuned(setting, arch, device_name)[1] if setting else None


def sources(arch: str, device_name: str | None = None) -> dict[str, dict[str, Any]]:
    return {kernel: source.to_json() for kernel, (_, source) in resolve(arch, device_name).items()}


def rule_for(rules: tuple[Rule, ...], num_tokens: int, num_heads: int) -> Rule:
    return next(rule for rule in rules if rule.matches(num_tokens, num_heads))


def safe_config(kernel: str, arch: str) -> Config:
    """``kernel``'s safe config on ``arch``: the catch-all (last) rule of the shipped file the arch uses."""
    return _shipped_for(arch).kernels[kernel][-1].config


def label(rule: Rule) -> str:
    """A rule as the marker and the logs name it: ``T<=16, H<=any``."""
    return f"T<={rule.tokens or 'any'}, H<={rule.heads or 'any'}"


# (arch, GPU, kernel, failed config) -> what the marker says of it, for this process (a forked child
# inherits it)
_degraded: dict[tuple[str, str | None, str, Config], dict[str, Any]] = {}
_degraded_lock = threading.Lock()


def degrade(kernel: str, arch: str, device_name: str | None, num_tokens: int, num_heads: int, why: str) -> bool:
    """The config of this launch failed (``why``): from now on every rule of ``kernel`` that picks it
    takes the safe config instead (logged at ERROR). False where there is nothing else to try (the
    config was already degraded, or is the safe config itself): the failure stands, and the marker's
    entry says the safe config failed too."""
    rules, _ = resolve(arch, device_name)[kernel]
    failed = rule_for(rules, num_tokens, num_heads).config
    safe = safe_config(kernel, arch)
    key = (arch, device_name, kernel, failed)
    with _degraded_lock:
        entry = _degraded.get(key)
        if entry is None:
            entry = _degraded[key] = {"rules": [label(r) for r in rules if r.config == failed], "config": dict(failed),
                                      "safe": dict(safe), "why": why}
            if failed != safe:
                logger.error("K3 AMD overlay: %s: config %s (rules %s) failed on %s (%s): %s; those rules take the "
                             "safe config %s from now on", kernel, dict(failed), ", ".join(entry["rules"]), arch,
                             device_name or "no GPU name", why, dict(safe))
                return True
        entry.setdefault("safe_failed", why)
    logger.error("K3 AMD overlay: %s: the safe config %s failed too on %s: %s", kernel, dict(safe), arch, why)
    return False


def degraded() -> dict[str, list[dict[str, Any]]]:
    """For the marker: each kernel's configs replaced by the safe config in this process, with the
    rules that picked them and why (``safe_failed``: the safe config failed too)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for (_, _, kernel, _), entry in _degraded.items():
        found.setdefault(kernel, []).append(dict(entry))
    return found


def failed_here(kernel: str, arch: str, device_name: str | None, num_tokens: int, num_heads: int = 1) -> str | None:
    """Why a launch of ``kernel`` at this size would not run its table's config (that config failed
    in this process and the safe config runs in its place), or None where it runs the table's."""
    if not _degraded:  # the common case, asked once per batch: no rule lookup
        return None
    rules, _ = resolve(arch, device_name)[kernel]
    entry = _degraded.get((arch, device_name, kernel, rule_for(rules, num_tokens, num_heads).config))
    if entry is None:
        return None
    return f"{kernel}'s launch config {entry['config']} failed here ({entry['why']}); the safe config runs in its place"


def choose(kernel: str, arch: str, device_name: str | None, num_tokens: int, num_heads: int = 1,
           amd: bool = False) -> dict[str, int]:
    """The config of a launch of ``kernel`` for ``num_tokens`` tokens and ``num_heads`` heads
    (AMD-only options kept where ``amd``; the safe config where this one was degraded)."""
    rules, _ = resolve(arch, device_name)[kernel]
    picked = rule_for(rules, num_tokens, num_heads).config
    config = dict(safe_config(kernel, arch) if (arch, device_name, kernel, picked) in _degraded else picked)
    if not amd:
        for option in AMD_ONLY_OPTIONS:
            config.pop(option, None)
    return config
