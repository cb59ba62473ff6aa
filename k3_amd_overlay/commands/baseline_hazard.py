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

Whether vLLM fuses the decode at all (``_fused_qk_prep_supported`` in its K3 AMD mla.py) turns on
its AITER BMM switches: it fuses where the FP4 BMM is taken, or the FP8 BMM is off. Their defaults
differ by release (BMM_DEFAULTS), and the FP4 BMM is taken only on gfx950 (``is_fp4bmm_enabled``:
CDNA 4) with a bf16 kv_b_proj (a checkpoint fact no launcher reads: assumed possible).

The overlay's arms are safe where it owns ``_fused_decode`` (``1`` or a list with qk_cache or
absorb_qk_cache: the site is an eager break deciding per replayed batch) and in ``stock`` (vLLM's
fused decode off). The first advice is to rule the configuration out, so that vLLM as shipped
(``0``) stays the baseline: against ``stock`` the candidate arm also runs vLLM's own fusions (in
exactly this configuration vLLM fuses the layer itself), so such a table measures those together
with the overlay's, and ab-serve's summary says so."""

from __future__ import annotations

import json
import re
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
ADVICE = (f"rule the configuration out, so that vLLM as shipped ({SWITCH}=0) stays a sound baseline: set {BREAKABLE}=0 "
          "or leave it unset (on ROCm vLLM 0.30-0.33 do not turn breakable graphs on for K3 by themselves), or "
          f"{MODEL_RUNNER_V2}=0, --enforce-eager or a cudagraph_mode without PIECEWISE; else use {SWITCH}=stock as the "
          "baseline (--arm-a stock: every fusion off, vLLM's own too), knowing that the candidate arm then runs vLLM's "
          "own fusions as well (the A/B summary names each arm's fusions)")
FP8_BMM, FP4_BMM = "VLLM_ROCM_USE_AITER_FP8BMM", "VLLM_ROCM_USE_AITER_FP4BMM"
# Each release's default (the switch unset) of (FP8_BMM, FP4_BMM), as its vllm/envs.py reads them:
# os.getenv(name, DEFAULT).lower() in ("true", "1"), read in each release's x.y.0 wheel.
BMM_DEFAULTS: dict[str, tuple[bool, bool]] = {
    "0.29": (True, True),  # vllm/envs.py:1312 and :1317, default "True"
    "0.30": (True, True),  # vllm/envs.py:1308 and :1313, default "True"
    "0.31": (True, True),  # vllm/envs.py:1355 and :1360, default "True"
    "0.32": (True, True),  # vllm/envs.py:1377 and :1382, default "True"
    "0.33": (False, False),  # vllm/envs.py:1370 and :1375, default "False"
    "0.34": (False, False),  # vllm/envs.py:1445 and :1450, default "False"
}
FP4_BMM_ARCH = "gfx950"  # vllm/_aiter_ops.py is_fp4bmm_enabled: get_cdna_version() == 4, gfx950 (0.29-0.33)
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")  # the ROCm driver's agents: each GPU's gfx_target_version


@dataclass(frozen=True)
class VllmFacts:
    """What the launcher knows of the vLLM its servers run."""

    version: str | None  # None: no vLLM here
    fused_decode_of_its_own: bool | None  # its K3 AMD code has _fused_decode (0.32-0.33); None: unknown
    arch: str | None = None  # the GPU arch the servers run on (gfx942, gfx950); None: unknown


def _reads_on(raw: str) -> bool:
    """vLLM's reading of its AITER switches (vllm/envs.py): "1" or "true", any case, nothing around it."""
    return raw.lower() in ("1", "true")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An AITER switch as vLLM reads it, ``default`` where it is unset."""
    return _reads_on(env.get(name, "1" if default else "0"))


def _minor(version: str | None) -> str | None:
    """The release a version names, "0.33" for 0.33.0, 0.33.1rc1 or 0.33.0+rocm; None where none."""
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{found.group(1)}.{found.group(2)}" if found else None


def bmm_switch(env: Mapping[str, str], name: str, facts: VllmFacts) -> tuple[bool | None, str]:
    """A BMM switch (FP8_BMM or FP4_BMM) as this vLLM reads it, and where that comes from: the
    environment, else the release's default (BMM_DEFAULTS); None where neither is known."""
    if name in env:
        return _reads_on(env[name]), f"{name}={env[name]}"
    defaults = BMM_DEFAULTS.get(_minor(facts.version) or "")
    if defaults is None:
        return None, f"{name} unset, the default of vLLM {facts.version or '(none here)'} not known here"
    on = defaults[(FP8_BMM, FP4_BMM).index(name)]
    return on, f"{name} unset: {'on' if on else 'off'} by vLLM {_minor(facts.version)}'s default"


def fp4_bmm_not_taken(env: Mapping[str, str], facts: VllmFacts) -> str | None:
    """Why vLLM's MLA never takes the FP4 BMM here, or None where it may (its switch on or unknown,
    on gfx950 or a GPU not known; whether kv_b_proj is bf16 is the checkpoint's, not read here)."""
    on, said = bmm_switch(env, FP4_BMM, facts)
    if on is False:
        return said
    if facts.arch is not None and facts.arch != FP4_BMM_ARCH:
        return f"a {facts.arch} GPU; vLLM takes it only on {FP4_BMM_ARCH}"
    return None


def _vllm_never_fuses_by_bmm(env: Mapping[str, str], facts: VllmFacts) -> str | None:
    """Why vLLM's K3 code keeps its fused decode off for its W_UK variant (it fuses only where the
    FP4 BMM is taken or the FP8 BMM is off: _fused_qk_prep_supported), or None where it may fuse."""
    fp8, fp8_said = bmm_switch(env, FP8_BMM, facts)
    fp4_not_taken = fp4_bmm_not_taken(env, facts)
    if fp8 is True and fp4_not_taken:
        return f"{fp8_said}, and the FP4 BMM is not taken ({fp4_not_taken}): vLLM never fuses the decode"
    return None


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


def ruled_out(env: Mapping[str, str], serve_args: Sequence[str], facts: VllmFacts) -> str | None:
    """What in the environment, the serve arguments or this vLLM (``facts``: its release's defaults,
    the GPU) keeps vLLM's fused decode out of a breakable PIECEWISE segment (None: nothing does)."""
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
    bmm = _vllm_never_fuses_by_bmm(env, facts)
    if bmm:
        return bmm
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
    if ruled_out(env, args, facts):
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
            f"of a captured size replays the decode-only path; {ADVICE}")


def facts_of(vllm_root: Path | None, version: str | None, arch: str | None = None) -> VllmFacts:
    """The facts of the vLLM whose ``vllm`` package directory is ``vllm_root`` (None: none here),
    read from its source without importing it, on a GPU of ``arch`` (None: unknown)."""
    if vllm_root is None:
        return VllmFacts(version, None, arch)
    from k3_amd_overlay.targets import sources
    from k3_amd_overlay.targets.shapes import recognise

    try:
        shape = recognise(sources.VllmSources(vllm_root)).shape
    except (OSError, SyntaxError, ValueError):  # an unreadable vLLM source tree: unknown, reported as such
        return VllmFacts(version, None, arch)
    return VllmFacts(version, None if shape is None else bool(shape.upstream.get(QK_CACHE)), arch)


def gfx_arch(target_version: int) -> str:
    """The gfx name of a KFD gfx_target_version (major * 10000 + minor * 100 + stepping, the last
    two written in hex): 90402 -> gfx942, 90500 -> gfx950, 90010 -> gfx90a."""
    major, minor, stepping = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def gpu_arch(nodes: Path = KFD_NODES) -> str | None:
    """The one gfx arch of this host's AMD GPUs, read from the ROCm driver's topology (no GPU
    library loaded); None where there is none, it cannot be read, or the GPUs differ."""
    found = set()
    try:
        for properties in sorted(nodes.glob("*/properties")):
            for line in properties.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "gfx_target_version" and value.strip().isdigit() and int(value) > 0:  # 0: a CPU node
                    found.add(gfx_arch(int(value)))
    except OSError:
        return None
    return found.pop() if len(found) == 1 else None


def facts_here() -> VllmFacts:
    """The installed vLLM's facts, on this host's GPU."""
    from k3_amd_overlay.targets import sources
    from k3_amd_overlay.versions import installed_vllm_version

    return facts_of(sources.vllm_root(), installed_vllm_version(), gpu_arch())
