"""An A/B arm whose numbers vLLM itself gets wrong: ``baseline_hazard`` says, from what a launcher
can read before any server starts (the installed vLLM's K3 code, the environment the servers
inherit, the serve arguments, the arm's switch), whether that arm records vLLM's own K3 fused
decode into a breakable CUDA-graph segment. ``doctor``, ``ab-serve`` and ``gsm8k-ab`` all ask it.

Read from vLLM 0.32-0.33 (vllm/models/kimi_k3/amd/mla.py, vllm/v1/worker/gpu/cudagraph_utils.py
and model_runner.py, vllm/compilation/breakable_cudagraph.py): the K3 wrapper's ``forward``
chooses in Python between its own ``_fused_decode`` (plain launches, no eager break) and the MLA
attention op (an eager break) from the batch's attention metadata (all tokens decode tokens). Model
Runner V2 captures each PIECEWISE size with a dummy batch of one token per request (up to
max_num_seqs requests), built with attention metadata: a decode-only batch, so ``_fused_decode``
is recorded inside the segment. Replay is keyed by a BatchDescriptor of the token count (and
LoRA) only, so a mixed batch of a captured size replays the decode-only path. The V1 runner
captures PIECEWISE sizes without attention metadata (the eager break is taken): not affected.
vLLM 0.29-0.31's K3 code has no fused decode of its own: not affected. Breakable graphs on ROCm
come only from VLLM_USE_BREAKABLE_CUDAGRAPH=1 on 0.30-0.33 (0.29 turns them on for K3 by itself;
batch-invariant mode turns them on only on CUDA, where the K3 AMD code is not built).

The overlay's arms are safe where it owns ``_fused_decode`` (``1`` or a list with qk_cache or
absorb_qk_cache: the site is an eager break deciding per replayed batch) and in ``stock`` (vLLM's
fused decode off): ``stock`` is the baseline to use."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3_amd_overlay.commands.usage import split_command
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE
from k3_amd_overlay.settings import SWITCH, Mode, SettingsError, load_settings

BREAKABLE = "VLLM_USE_BREAKABLE_CUDAGRAPH"  # vLLM 0.30-0.33 read it as on only when it is exactly "1"
MODEL_RUNNER_V2 = "VLLM_USE_V2_MODEL_RUNNER"  # unset: V2 where it supports the config; else int(value)
ACCEPT_FLAG = "--accept-baseline-hazard"
GRAPHS_WITHOUT_PIECEWISE = ("NONE", "FULL", "FULL_DECODE_ONLY")
STOCK_ADVICE = (f"use {SWITCH}=stock as the baseline (vLLM's own fused decode off, e.g. --arm-a stock), or rule "
                f"the configuration out ({BREAKABLE}=0, {MODEL_RUNNER_V2}=0, --enforce-eager or a cudagraph_mode "
                "without PIECEWISE)")


@dataclass(frozen=True)
class VllmFacts:
    """What the launcher knows of the vLLM its servers run."""

    version: str | None  # None: no vLLM here
    fused_decode_of_its_own: bool | None  # its K3 AMD code has _fused_decode (0.32-0.33); None: unknown


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """vLLM's reading of its AITER switches: "1" or "true", any case."""
    return env.get(name, "1" if default else "0").strip().lower() in ("1", "true")


def _model_runner_v2_ruled_out(env: Mapping[str, str]) -> bool:
    raw = env.get(MODEL_RUNNER_V2)
    try:
        return raw is not None and not int(raw)
    except ValueError:
        return False  # vLLM refuses such a value itself


def _option(args: Sequence[str], *names: str) -> str | None:
    """The last value of ``--name VALUE`` or ``--name=VALUE`` among ``args``."""
    found = None
    for i, word in enumerate(args):
        for name in names:
            if word == name and i + 1 < len(args):
                found = args[i + 1]
            elif word.startswith(name + "="):
                found = word[len(name) + 1:]
    return found


def _cudagraph_mode(args: Sequence[str]) -> str | None:
    """The cudagraph_mode the serve arguments set (dotted or JSON compilation config), if any."""
    dotted = _option(args, "-cc.cudagraph_mode", "--compilation-config.cudagraph_mode")
    if dotted is not None:
        return dotted.upper()
    config = _option(args, "-cc", "--compilation-config", "-O")
    if config is not None and config.lstrip().startswith("{"):
        try:
            mode = json.loads(config).get("cudagraph_mode")
        except (ValueError, AttributeError):
            return None
        return str(mode).upper() if mode is not None else None
    return None


def _keeps_vllm_fused_decode(switch: str) -> bool:
    """The arm leaves vLLM's ``_fused_decode`` as vLLM wrote it: off, or no decode fusion asked for."""
    try:
        settings = load_settings({SWITCH: switch})
    except SettingsError:
        return False  # refused as a bad switch elsewhere
    if settings.mode is Mode.OFF:
        return True
    return settings.mode is Mode.AUTO and not (settings.requested(QK_CACHE) or settings.requested(ABSORB_QK_CACHE))


def ruled_out(env: Mapping[str, str], serve_args: Sequence[str]) -> str | None:
    """What in the environment or the serve arguments keeps vLLM's fused decode out of a breakable
    PIECEWISE segment (None: nothing does)."""
    if env.get(BREAKABLE) != "1":
        return f"{BREAKABLE} is not 1 (no breakable CUDA graphs)"
    if _model_runner_v2_ruled_out(env):
        return f"{MODEL_RUNNER_V2}={env[MODEL_RUNNER_V2]} (the V1 runner captures PIECEWISE sizes without metadata)"
    if "--enforce-eager" in serve_args:
        return "--enforce-eager (no CUDA graphs)"
    mode = _cudagraph_mode(serve_args)
    if mode in GRAPHS_WITHOUT_PIECEWISE:
        return f"cudagraph_mode {mode} (no PIECEWISE graphs)"
    if not (_flag(env, "VLLM_ROCM_USE_AITER", False) and _flag(env, "VLLM_ROCM_USE_AITER_MLA", True)):
        return "AITER MLA is off (VLLM_ROCM_USE_AITER / VLLM_ROCM_USE_AITER_MLA): vLLM never fuses the decode"
    if _flag(env, "VLLM_ROCM_USE_AITER_FP8BMM", True) and not _flag(env, "VLLM_ROCM_USE_AITER_FP4BMM", True):
        return "VLLM_ROCM_USE_AITER_FP8BMM on and VLLM_ROCM_USE_AITER_FP4BMM off: vLLM never fuses the decode"
    kv_dtype = _option(serve_args, "--kv-cache-dtype")
    if kv_dtype is not None and kv_dtype != "auto" and not kv_dtype.startswith("fp8"):
        return f"--kv-cache-dtype {kv_dtype} (vLLM fuses the decode only with an fp8 KV cache)"
    dcp = _option(serve_args, "--decode-context-parallel-size", "-dcp")
    if dcp is not None and dcp.isdigit() and int(dcp) > 1:
        return f"--decode-context-parallel-size {dcp} (vLLM does not fuse the decode under DCP)"
    return None


def baseline_hazard(facts: VllmFacts, env: Mapping[str, str], serve_args: Sequence[str] | str,
                    switch: str) -> str | None:
    """Why an arm started with ``K3_AMD_OVERLAY=switch`` (in ``env``, with ``serve_args``) on this
    vLLM measures a path vLLM itself gets wrong, or None where it does not. Where a fact cannot be
    read (no vLLM here) the hazard is reported, not assumed away."""
    args = split_command("--serve-args", serve_args) if isinstance(serve_args, str) else list(serve_args)
    if facts.fused_decode_of_its_own is False or not _keeps_vllm_fused_decode(switch):
        return None
    if ruled_out(env, args):
        return None
    which = f"vLLM {facts.version}" if facts.version else "this vLLM"
    if facts.fused_decode_of_its_own is None:
        known = (f"{which}'s K3 AMD code could not be read here, so whether it has a fused decode of its own "
                 "(0.32-0.33 do) is unknown; if it does, ")
    else:
        known = f"{which}'s own K3 fused decode (_fused_decode) stays live in this arm, and "
    return (f"{SWITCH}={switch!r} is no valid baseline: {known}with breakable CUDA graphs ({BREAKABLE}=1) under "
            "Model Runner V2 the PIECEWISE capture runs a decode-only dummy batch, so that fused decode (no eager "
            "break) is recorded into the graph segment, and segments are keyed by token count only: a mixed batch "
            f"of a captured size replays the decode-only path; {STOCK_ADVICE}")


def facts_of(vllm_root: Path | None, version: str | None) -> VllmFacts:
    """The facts of the vLLM whose ``vllm`` package directory is ``vllm_root`` (None: none here),
    read from its source without importing it."""
    if vllm_root is None:
        return VllmFacts(version, None)
    from k3_amd_overlay.targets import sources
    from k3_amd_overlay.targets.shapes import recognise

    try:
        shape = recognise(sources.VllmSources(vllm_root)).shape
    except (OSError, SyntaxError, ValueError):  # an unreadable vLLM source tree: unknown, reported as such
        return VllmFacts(version, None)
    return VllmFacts(version, None if shape is None else bool(shape.upstream.get(QK_CACHE)))


def facts_here() -> VllmFacts:
    """The installed vLLM's facts."""
    from k3_amd_overlay.targets import sources
    from k3_amd_overlay.versions import installed_vllm_version

    return facts_of(sources.vllm_root(), installed_vllm_version())
