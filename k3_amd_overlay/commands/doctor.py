"""``k3-amd-overlay doctor``: what this machine and this vLLM give, what the overlay does with the
current switch and why (each predicate input), and every reachable provider run against its
reference at K3 shapes. It builds no model layer: that a real K3 layer and a real server take the
fused path is what ``k3-amd-overlay check`` proves against running vLLM processes."""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Callable, Mapping
from typing import Any

import torch

from k3_amd_overlay import k3, kernel_failures, markers, measured
from k3_amd_overlay.commands.baseline_hazard import FP4_BMM, FP8_BMM, VllmFacts, bmm_switch, fp4_bmm_not_taken
from k3_amd_overlay.fp8 import FP8_FORMATS, device_format
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.package import (
    ABSORB_QK_CACHE,
    FUSIONS,
    PLUGIN_NAME,
    QK_CACHE,
    QKV_NORM,
    SUPPORTED_VLLM,
    __version__,
)
from k3_amd_overlay.settings import MARKER_DIR, SWITCH, SettingsError, load_settings
from k3_amd_overlay.versions import first_installed, installed_aiter_version, installed_vllm_version

K3_ABSORB_WIDTHS = (k3.QK_NOPE_HEAD_DIM, k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM)  # P, L, R of the absorbed op
BF16, FP8, FP4 = AbsorbVariant.BF16.value, AbsorbVariant.FP8.value, AbsorbVariant.FP4.value
# Each W_UK format vLLM may hold a K3 layer's absorption in: its "providers here" row and its words.
W_UK_ROWS = {BF16: ABSORB_QK_CACHE, FP8: f"{ABSORB_QK_CACHE} (fp8 W_K)", FP4: f"{ABSORB_QK_CACHE} (MXFP4 W_K)"}
W_UK_WORDS = {BF16: "bf16 W_UK_T", FP8: "fp8 W_K", FP4: "MXFP4 W_K"}
STOCK_MODE = "stock mode (the unfused A/B baseline)"
VLLM_PLUGINS = "VLLM_PLUGINS"  # vLLM 0.29-0.33: unset loads every plugin; else only those it names


def versions() -> dict[str, Any]:
    return {
        "k3-amd-overlay": __version__, "python": platform.python_version(),
        "vllm": installed_vllm_version(), "torch": torch.__version__,
        "triton": first_installed("triton", "pytorch-triton-rocm"),
        "aiter": installed_aiter_version(), "supported vllm": SUPPORTED_VLLM,
    }


def gpu() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": "cpu", "fp8 format": None, "note": "no GPU: fused providers limited to the "
                "reference and (under TRITON_INTERPRET=1) the Triton interpreter"}
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "hip": torch.version.hip, "cuda": torch.version.cuda,
            "arch": getattr(props, "gcnArchName", f"sm_{props.major}{props.minor}"),
            "fp8 format": device_format().name}


def launch_configs_here(device: torch.device) -> dict[str, Any]:
    """Where each kernel's launch configs come from on this machine's GPU (a bad
    K3_AMD_OVERLAY_KERNEL_CONFIGS is an error here) and, on an AMD GPU, this arch's compile report."""
    from k3_amd_overlay.kernels import launch
    from k3_amd_overlay.kernels.launch_configs import LaunchConfigError

    try:
        found = launch.describe(device)
    except LaunchConfigError as exc:
        return {"error": str(exc)}
    if torch.version.hip is not None and device.type == "cuda":
        from k3_amd_overlay.commands import compile_report

        try:
            report = compile_report.run_worker(found["arch"], found.get("device"))
            entries = report["kernels"]
        except (RuntimeError, KeyError) as exc:  # covered: an arch the report checks, so its failure is no pass
            found["compile report"] = {"error": str(exc), "covered": found["arch"] in compile_report.AMD_ARCHS}
        else:  # the configs this GPU's server would use, its tuned file's among them
            found["compile report"] = {"configurations": len(entries),
                                       "falling short": [f"{e['kernel']} {e['config']}: {'; '.join(e['problems'])}"
                                                         for e in entries if e["problems"]]
                                       + list(report.get("unchecked", []))
                                       + [f"{kernel}: no configuration in the report, not checked"
                                          for kernel in compile_report.missing_kernels(report, found["arch"])]}
    return found


def marker_dir_here(marker_dir: str | None) -> dict[str, Any]:
    """Where a vLLM process started here writes its marker (``marker_dir``: the setting, None for the
    per-user default) and, as ``error``, why it would write none there, by the rule the process itself
    applies (markers.marker_dir_refusal): then no ``check`` could see it."""
    section: dict[str, Any] = {"path": str(marker_dir or markers.default_marker_dir()),
                               "set by": MARKER_DIR if marker_dir else "default"}
    refusal = markers.marker_dir_refusal(marker_dir)
    if refusal:
        named = f"{MARKER_DIR}={marker_dir}" if marker_dir else f"the per-user marker directory ({MARKER_DIR} unset)"
        section["error"] = (f"{named}: a vLLM process would write no marker there, so `check` could prove "
                            f"nothing: {refusal}")
    return section


def qk_cache_by_tp(shape_upstream: str) -> list[dict[str, Any]]:
    from k3_amd_overlay.targets.shapes import UPSTREAM_DECODE_MIN_LATENT_HEADS

    rows = []
    for tp, heads in k3.HEADS_PER_RANK.items():
        if tp > 32:
            continue
        upstream = bool(shape_upstream) and k3.KV_LORA_RANK * heads >= UPSTREAM_DECODE_MIN_LATENT_HEADS
        rows.append({"tp": tp, "heads per rank": heads, "kv_lora_rank*heads": k3.KV_LORA_RANK * heads,
                     "upstream fuses (AITER MLA on, no fp8 BMM)": upstream,
                     "overlay": "upstream's" if upstream else "overlay's provider"})
    return rows


def _raised(op: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """``op(*args, **kwargs)``, or None and what it raised in one line: a provider that raises fails
    its own self-test row, and the doctor goes on to the others."""
    try:
        return op(*args, **kwargs), None
    except Exception as exc:  # any failure of a provider's kernel (compiler, driver, dtype) is its row's
        return None, kernel_failures.summary(exc)


def selftest(device: torch.device) -> list[dict[str, Any]]:
    """Every provider this device can run, against the reference, on fresh random K3 inputs; a
    provider that raises fails its row with what it raised."""
    from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
    from k3_amd_overlay.ops import qk_cache as qk_op
    from k3_amd_overlay.ops import reference, rmsnorm_pair

    results = []
    latent = torch.randn(64, k3.Q_LORA_RANK + k3.LATENT_ROW, device=device).to(torch.bfloat16)
    q, kv = latent[:, : k3.Q_LORA_RANK], latent[:, k3.Q_LORA_RANK: k3.Q_LORA_RANK + k3.KV_LORA_RANK]
    q_w = (1 + 0.2 * torch.randn(k3.Q_LORA_RANK, device=device)).to(torch.bfloat16)
    kv_w = (1 + 0.2 * torch.randn(k3.KV_LORA_RANK, device=device)).to(torch.bfloat16)
    ref = reference.rmsnorm_pair_reference(q, kv, q_w, kv_w, k3.RMS_NORM_EPS, k3.RMS_NORM_EPS)
    for name, missing in rmsnorm_pair.provider_missing(device, k3.RMS_NORM_EPS, k3.RMS_NORM_EPS).items():
        if missing:
            results.append({"op": QKV_NORM, "provider": name, "ran": False, "why not": missing})
            continue
        got, raised = _raised(rmsnorm_pair.fused_q_kv_rmsnorm, q, kv, q_w, kv_w, k3.RMS_NORM_EPS,
                              k3.RMS_NORM_EPS, provider=name)
        if raised:
            results.append({"op": QKV_NORM, "provider": name, "ran": True, "raised": raised, "pass": False})
            continue
        # in units in the last place of the reference (bf16): 0 where the provider rounds as vLLM's
        # RMSNorm does; the Triton interpreter's bf16 casts may be one or two off
        ulp = torch.finfo(torch.bfloat16).eps
        diff = max(((g.float() - r.float()).abs() / (r.float().abs() * ulp).clamp_min(1e-30)).max().item()
                   for g, r in zip(got, ref, strict=True))
        identical = all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))
        results.append({"op": QKV_NORM, "provider": name, "ran": True, "max ulp diff": diff,
                        "bit-identical": identical, "pass": diff <= 2.0})
    tokens, heads = 7, k3.HEADS_PER_RANK[8]
    for fmt in FP8_FORMATS.values():
        ql = (torch.randn(tokens, heads, k3.KV_LORA_RANK, device=device) * 3).to(torch.bfloat16)
        q_pe = (torch.randn(tokens, heads, k3.QK_ROPE_HEAD_DIM, device=device) * 3).to(torch.bfloat16)
        kv_c = (torch.randn(tokens, k3.KV_LORA_RANK, device=device) * 3).to(torch.bfloat16)
        k_pe = (torch.randn(tokens, 1, k3.QK_ROPE_HEAD_DIM, device=device) * 3).to(torch.bfloat16)
        slots = torch.tensor([5, -1, 17, 40, 3, -1, 60], dtype=torch.int64, device=device)
        scales = [torch.tensor([s], dtype=torch.float32, device=device) for s in (1.31, 0.71)]
        outs = {}
        for name, missing in qk_op.provider_missing(device).items():
            if missing:
                results.append({"op": QK_CACHE, "format": fmt.name, "provider": name, "ran": False, "why not": missing})
                continue
            cache = torch.zeros(8, 16, k3.LATENT_ROW, dtype=torch.uint8, device=device)
            q_out, raised = _raised(qk_op.fused_qk_cache, ql, q_pe, kv_c, k_pe, cache, slots, *scales,
                                    provider=name, kv_format=fmt.name)
            if raised:
                results.append({"op": QK_CACHE, "format": fmt.name, "provider": name, "ran": True, "raised": raised,
                                "pass": False})
                continue
            outs[name] = (cache, q_out.view(torch.uint8)[slots >= 0])
        w_uk = torch.randn(k3.KV_LORA_RANK, heads, k3.QK_NOPE_HEAD_DIM, device=device) / 8
        q_nope = (torch.randn(tokens, heads, k3.QK_NOPE_HEAD_DIM, device=device) * 2).to(torch.bfloat16)
        w_k_scale = (w_uk.abs().max() / fmt.fmax).float()
        codes, e8m0 = reference.mxfp4_quantize_reference(w_uk.to(torch.bfloat16))
        weights = {  # W_UK_T as vLLM holds it in bf16; W_K and W_K_scale as its fp8 and MXFP4 BMMs hold them
            "bf16": (w_uk.to(torch.bfloat16).permute(1, 2, 0),),
            "fp8": ((w_uk.transpose(0, 1) / w_k_scale).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype), w_k_scale),
            "fp4": (reference.pack_e2m1(codes).transpose(0, 1), e8m0.transpose(0, 1)),
        }
        ops = {"bf16": absorb_op.fused_absorb_qk_cache, "fp8": absorb_op.fused_absorb_fp8_qk_cache,
               "fp4": absorb_op.fused_absorb_mxfp4_qk_cache}
        for variant, weight in weights.items():
            absorb_outs = {}
            op = ops[variant]
            for name, missing in absorb_op.provider_missing(device, *K3_ABSORB_WIDTHS, fp8_weights=variant == "fp8",
                                                            mxfp4_weights=variant == "fp4").items():
                if missing:
                    results.append({"op": ABSORB_QK_CACHE, "W_UK": variant, "format": fmt.name, "provider": name,
                                    "ran": False, "why not": missing})
                    continue
                cache = torch.zeros(8, 16, k3.LATENT_ROW, dtype=torch.uint8, device=device)
                q_out, raised = _raised(op, q_nope, *weight, q_pe, kv_c, k_pe, cache, slots, *scales,
                                        provider=name, kv_format=fmt.name)
                if raised:
                    results.append({"op": ABSORB_QK_CACHE, "W_UK": variant, "format": fmt.name, "provider": name,
                                    "ran": True, "raised": raised, "pass": False})
                    continue
                absorb_outs[name] = q_out.view(torch.uint8)[slots >= 0]
            for name, q_bits in absorb_outs.items():
                # codes one step apart where two fp32 sums in another order straddle a rounding boundary
                same = (q_bits == absorb_outs["reference"]).float().mean().item()
                results.append({"op": ABSORB_QK_CACHE, "W_UK": variant, "format": fmt.name, "provider": name,
                                "ran": True, "identical query bytes": round(same, 5), "pass": same >= 0.99})
        for name, (cache, q_bits) in outs.items():
            same = (cache == outs["reference"][0]).float().mean().item() * 0.5 + \
                (q_bits == outs["reference"][1]).float().mean().item() * 0.5
            results.append({"op": QK_CACHE, "format": fmt.name, "provider": name, "ran": True,
                            "identical bytes": round(same, 5),
                            "pass": same == 1.0})
    return results


# The --json key of each prose label of the report (the text keeps the labels); any other key (a
# fusion, provider or kernel name) is already an identifier and stays as it is.
JSON_KEYS = {
    "k3-amd-overlay": "k3_amd_overlay", "supported vllm": "supported_vllm", "fp8 format": "fp8_format",
    "vllm shape": "vllm_shape", "recognised": "recognised", "this vLLM fuses by itself": "fuses_by_itself",
    "anchors missing per fusion": "anchors_missing", "shapes not matched": "shapes_not_matched",
    "known vLLM defects in this release": "known_defects", "K3_AMD_OVERLAY": "k3_amd_overlay",
    "qk_cache by tensor-parallel size (K3, 96 heads)": "qk_cache_by_tp", "heads per rank": "heads_per_rank",
    "kv_lora_rank*heads": "kv_lora_rank_heads", "upstream fuses (AITER MLA on, no fp8 BMM)": "upstream_fuses",
    "providers here": "providers_here", f"{ABSORB_QK_CACHE} (fp8 W_K)": "absorb_qk_cache_fp8",
    f"{ABSORB_QK_CACHE} (MXFP4 W_K)": "absorb_qk_cache_mxfp4", "launch configs": "launch_configs",
    "compile report": "compile_report", "falling short": "falling_short", "self-test": "self_test",
    "why not": "why_not", "max ulp diff": "max_ulp_diff", "identical query bytes": "identical_query_bytes",
    "identical bytes": "identical_bytes", "a/b baseline": "ab_baseline", "activation error": "activation_error",
    "self-measurement": "self_measurement", "fused buckets": "fused_buckets",
}


def _snake(name: str) -> str:
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def json_report(value: Any) -> Any:
    """The report with stable identifier keys (JSON_KEYS; any other key snake_cased), the --json form."""
    if isinstance(value, dict):
        return {JSON_KEYS.get(str(k)) or _snake(str(k)): json_report(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_report(v) for v in value]
    return value


def absorb_weights(env: Mapping[str, str], facts: VllmFacts, aiter_off: str | None) -> dict[str, str]:
    """Each W_UK format (AbsorbVariant's value) vLLM may hold a K3 layer's absorption in here, in its
    precedence (MXFP4, fp8, bf16), and why: its BMM switches as this vLLM reads them (baseline_hazard),
    both off where vLLM has AITER off (``aiter_off``: why, None where it is on or not known). More than
    one where a switch is not known here, or where the MXFP4 BMM may be taken: vLLM takes it only for
    a bf16 kv_b_proj, which is the checkpoint's."""
    if aiter_off:
        return {BF16: "vLLM has AITER off, so neither AITER BMM"}
    weights = {}
    if fp4_bmm_not_taken(env, facts) is None:
        fp4_said = bmm_switch(env, FP4_BMM, facts)[1]
        weights[FP4] = (f"{fp4_said}, on {facts.arch or 'a GPU not known here'}, where the checkpoint's kv_b_proj "
                        "is bf16")
    fp8, fp8_said = bmm_switch(env, FP8_BMM, facts)
    if fp8 is not False:
        weights[FP8] = fp8_said
    if fp8 is not True:
        weights[BF16] = fp8_said
    return weights


def fusion_outlook(settings: Any, providers_here: dict[str, dict[str, str | None]],
                   loaded: measured.Loaded | None = None,
                   weights: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Per fusion, what a K3 layer built here would get from the overlay (before the layer's own
    conditions: fp8 KV cache, heads, vLLM's own fusions, which the marker reports per layer): under
    ``auto`` with this GPU's self-measurement (``loaded``), the provider it timed, as the server
    chooses, and the buckets where stock runs (``stock at``); with a file that cannot be used, stock.
    absorb_qk_cache is judged on the providers of each W_UK format in ``weights`` (absorb_weights;
    default vLLM's bf16 W_UK_T), and with more than one, on each (``by W_UK``)."""
    from k3_amd_overlay.settings import Mode

    weights = dict(weights or {BF16: ""})
    outlook = {}
    for fusion in FUSIONS:
        if settings.mode is Mode.OFF or not settings.requested(fusion):
            outlook[fusion] = {"state": "off", "provider": None, "why": "not requested"}
        elif settings.mode is Mode.STOCK:
            outlook[fusion] = {"state": "stock", "provider": None, "why": STOCK_MODE}
        elif fusion == ABSORB_QK_CACHE:
            outlook[fusion] = _by_weight({w: _judged(settings, fusion, providers_here[W_UK_ROWS[w]], loaded, (w,))
                                          for w in weights}, weights)
        else:
            outlook[fusion] = _judged(settings, fusion, providers_here[fusion], loaded, tuple(weights))
    return outlook


def _judged(settings: Any, fusion: str, missing: dict[str, str | None], loaded: measured.Loaded | None,
            variants: tuple[str, ...]) -> dict[str, Any]:
    """One fusion's outlook from its providers' ``missing`` and the self-measurement at the W_UK
    formats ``variants`` (qkv_norm's launch has none), as the server's gates read it."""
    from k3_amd_overlay.fusions.states import choose_provider
    from k3_amd_overlay.package import FUSED_PROVIDERS

    measurement = loaded.measurement if loaded else None
    setting = settings.provider(fusion)
    decision = choose_provider(FUSED_PROVIDERS[fusion], setting, measured.measured_first(missing, setting, measurement))
    stock = {"state": "stock", "provider": decision.provider}
    if decision.state is not FusionState.APPLIED:
        return {**stock, "why": decision.reason}
    if loaded is not None and loaded.unusable:
        return {**stock, "why": loaded.unusable}
    fused = {"state": "fused", "provider": decision.provider, "why": decision.reason}
    if measurement is None:
        return fused
    if decision.provider != measurement.provider:
        return {**stock, "why": measured.gate_for(measurement, fusion, provider=decision.provider).unmeasured}
    somewhere, stock_at = _measured_buckets(measurement, fusion, variants)
    if somewhere:
        return {**fused, "stock at": stock_at}
    return {**stock, "why": f"the self-measurement found {fusion} exact and at least as fast as stock in no bucket on "
                            f"this GPU{_at_variants(fusion, variants)}: stock runs at every batch size"}


def _at_variants(fusion: str, variants: tuple[str, ...]) -> str:
    return "" if fusion == QKV_NORM else f" with a {' or '.join(variants)} W_UK"


def _measured_buckets(measurement: measured.Measurement, fusion: str,
                      variants: tuple[str, ...]) -> tuple[bool, list[str]]:
    """Whether ``fusion`` may run in any bucket at a shape the measurement timed it at with one of
    ``variants`` (its gates', as the server reads them), and every reason stock runs, per shape."""
    shapes = sorted({(r.heads, r.variant) for r in measurement.rows
                     if r.fusion == fusion and (fusion == QKV_NORM or r.variant in variants)},
                    key=lambda shape: (shape[0] or 0, shape[1] or ""))
    somewhere, stock_at = False, []
    for heads, variant in shapes:
        gate = measured.gate_for(measurement, fusion, heads, variant)
        somewhere = somewhere or any(why is None for _, why in gate.buckets)
        where = "" if heads is None else f"{measured.shape_words(heads, variant)}: "
        stock_at += [where + why for why in gate.reasons()]
    if fusion != QKV_NORM:
        stock_at += [f"stock at every batch size with a {v} W_UK: not measured with it on this GPU"
                     for v in variants if all(shape[1] != v for shape in shapes)]
    return somewhere, stock_at


def _by_weight(judged: dict[str, dict[str, Any]], weights: Mapping[str, str]) -> dict[str, Any]:
    """absorb_qk_cache's outlook from its outlook per W_UK format (``judged``): with one format, that
    one, saying which; with more, fused where any is, and where one is not, said as stock."""
    if len(judged) == 1:
        (weight, only), = judged.items()
        return {**only, "why": f"{only['why']} (vLLM's {W_UK_WORDS[weight]}: {weights[weight]})"} if weights[weight] \
            else only
    said = {w: f"vLLM's {W_UK_WORDS[w]} ({weights[w]})" for w in judged}
    fused = {w: o for w, o in judged.items() if o["state"] == "fused"}
    providers = sorted({o["provider"] for o in (fused or judged).values() if o["provider"]})
    entry = {"state": "fused" if fused else "stock", "provider": " or ".join(providers) or None,
             "why": "; ".join(f"{said[w]}: {o['why']}" for w, o in judged.items())}
    if fused:
        entry["stock at"] = [f"{W_UK_WORDS[w]}: {why}" for w, o in fused.items() for why in o.get("stock at", [])] + [
            f"with {said[w]}: {o['why']}" for w, o in judged.items() if w not in fused]
    return {**entry, "by W_UK": judged}


def plugin_exclusion(env: Mapping[str, str]) -> str | None:
    """Why no vLLM process started with ``env`` loads the overlay's plugin, read as vLLM 0.29-0.33 read
    VLLM_PLUGINS (vllm/envs.py: split at commas; vllm/plugins: a plugin loads where its entry-point
    name is one of the pieces, exactly); None where it loads (the variable unset, or naming it)."""
    raw = env.get(VLLM_PLUGINS)
    if raw is None or PLUGIN_NAME in raw.split(","):
        return None
    return (f"{VLLM_PLUGINS}={raw!r} does not name {PLUGIN_NAME}: vLLM loads only the general plugins it names (split "
            "at commas, each name exactly), so no vLLM process started with this environment loads the overlay "
            f"and {SWITCH}={env.get(SWITCH, '')!r} is ignored; add {PLUGIN_NAME} to it ({with_overlay_plugin(raw)}) "
            "or unset it")


def with_overlay_plugin(raw: str) -> str:
    """VLLM_PLUGINS=... naming the plugins ``raw`` names (spaces around a name dropped) and the overlay's."""
    names = [n.strip() for n in raw.split(",") if n.strip() and n.strip() != PLUGIN_NAME]
    return f"{VLLM_PLUGINS}={','.join([*names, PLUGIN_NAME])}"


def plugins_here(env: Mapping[str, str], enabled: bool) -> dict[str, Any]:
    """The "vllm plugins" section (only where VLLM_PLUGINS is set): whether it lets vLLM load the
    overlay and, where the switch turns the overlay on (``enabled``) and it does not, why as ``error``."""
    excluded = plugin_exclusion(env)
    section: dict[str, Any] = {VLLM_PLUGINS: env[VLLM_PLUGINS], "loads the overlay": excluded is None}
    if excluded and enabled:
        section["error"] = excluded
    return section


def verdict_line(report: dict[str, Any]) -> tuple[str, bool]:
    """The doctor's last line and whether it is healthy: ready where every requested fusion has a
    provider that runs here and passed its self-test and would run fused in some batch, on a vLLM
    whose K3 AMD code is recognised and which loads the overlay; where a fusion runs stock in part
    (buckets the self-measurement found slower, a W_UK format without a provider), it says where."""
    problems = []
    if "error" in report.get("switch", {}):
        problems.append(report["switch"]["error"])
    if report.get("vllm plugins", {}).get("error"):
        problems.append(report["vllm plugins"]["error"])
    if report.get("marker dir", {}).get("error"):
        problems.append(report["marker dir"]["error"])
    shape = report.get("vllm shape")  # absent: not looked at, which is no reason of its own
    if shape is not None and shape.get("recognised") is None and shape.get("note") is None:
        problems.append("this vLLM's K3 AMD code is not recognised (see vllm shape)")
    if report.get("activation error"):
        problems.append(report["activation error"])
    launch_configs = report.get("launch configs", {})
    if "error" in launch_configs:
        problems.append(launch_configs["error"])
    gate = launch_configs.get("compile report", {})
    short = gate.get("falling short")
    if short:
        problems.append(f"{len(short)} kernel configurations fall short on this GPU (see launch configs)")
    if gate.get("error") and gate.get("covered"):
        problems.append(f"the compile report of this GPU's kernels failed: {gate['error']}")
    failed = [f"{r['op']} {r['provider']}" for r in report.get("self-test", []) if r.get("ran") and not r.get("pass")]
    if failed:
        problems.append(f"self-test failed: {', '.join(failed)}")
    outlook = report.get("fusions", {})
    problems += [_never_fuses(f, o) for f, o in outlook.items() if o["state"] == "stock" and o["why"] != STOCK_MODE]
    if problems:
        return "not ready: " + "; ".join(problems), False
    mode = report.get("switch", {}).get("mode")
    if mode == "off":
        return "off: K3_AMD_OVERLAY is unset or 0, nothing is patched (vLLM runs as it is)", True
    if mode == "stock":
        return ("ready (stock): every fusion forced to the unfused path, vLLM's own fusions off too (the A/B "
                "baseline)"), True
    by_provider: dict[str, list[str]] = {}
    for fusion, o in outlook.items():
        if o["state"] == "fused":
            by_provider.setdefault(o["provider"], []).append(fusion)
    off = [f for f, o in outlook.items() if o["state"] == "off"]
    if not by_provider:  # none of the fusions judged fuses, or none is judged: never an empty "ready"
        return f"not ready: {', '.join(off) + ' not requested' if off else 'no fusion in this report to judge'}", False
    parts = [f"{', '.join(fs)} fuse{'s' if len(fs) == 1 else ''} here via {p}" for p, fs in by_provider.items()]
    parts += [f"{f} runs stock in part: {'; '.join(o['stock at'])}" for f, o in outlook.items()
              if o["state"] == "fused" and o.get("stock at")]
    if off:
        parts.append(f"{', '.join(off)} not requested")
    return "ready: " + "; ".join(parts), True


def _never_fuses(fusion: str, outlook: dict[str, Any]) -> str:
    """The reason a fusion the server would run stock at every batch size gives the verdict."""
    if outlook["provider"] is None:
        return f"{fusion} cannot fuse here: {outlook['why']}"
    return f"{fusion} would run stock at every batch size here ({outlook['provider']} can run, but: {outlook['why']})"


def run_doctor(switch: str | None = None, serve_args: str | None = None) -> tuple[dict[str, Any], bool]:
    """The report and whether it is healthy. vLLM's K3 AMD code is looked at whatever the switch
    holds, so a bad variable gives its own reason and, only where it is so, "not recognised".
    ``serve_args`` (those an A/B will use, where known) sharpen the A/B baseline warnings."""
    report: dict[str, Any] = {"versions": versions(), "gpu": gpu()}
    env = dict(os.environ)
    if switch is not None:
        env[SWITCH] = switch
    has_vllm = importlib.util.find_spec("vllm") is not None
    shape = None
    if has_vllm:
        report["vllm shape"], shape = _vllm_shape(env)
    else:
        report["vllm shape"] = {"recognised": None, "note": "vLLM is not installed here"}
    try:
        settings = load_settings(env)
    except SettingsError as exc:
        report["switch"] = {"error": str(exc)}
        report["verdict"], healthy = verdict_line(report)
        return report, healthy
    report["switch"] = {"K3_AMD_OVERLAY": settings.raw, "mode": settings.mode.value,
                        "fusions": sorted(settings.fusions), "strict": settings.strict,
                        "providers": dict(settings.providers)}
    if VLLM_PLUGINS in env:
        report["vllm plugins"] = plugins_here(env, settings.enabled)
    report["marker dir"] = marker_dir_here(settings.marker_dir)
    if has_vllm:
        report["qk_cache by tensor-parallel size (K3, 96 heads)"] = qk_cache_by_tp(shape.upstream[QK_CACHE]
                                                                                  if shape else "")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
    from k3_amd_overlay.ops import qk_cache as qk_op
    from k3_amd_overlay.ops import rmsnorm_pair

    report["providers here"] = {
        QKV_NORM: rmsnorm_pair.provider_missing(device, k3.RMS_NORM_EPS, k3.RMS_NORM_EPS),
        QK_CACHE: qk_op.provider_missing(device),
        ABSORB_QK_CACHE: absorb_op.provider_missing(device, *K3_ABSORB_WIDTHS),
        f"{ABSORB_QK_CACHE} (fp8 W_K)": absorb_op.provider_missing(device, *K3_ABSORB_WIDTHS, fp8_weights=True),
        f"{ABSORB_QK_CACHE} (MXFP4 W_K)": absorb_op.provider_missing(device, *K3_ABSORB_WIDTHS, mxfp4_weights=True),
    }
    aiter_off = None
    if has_vllm:  # in a vLLM process AITER follows vLLM's switch
        from k3_amd_overlay.targets import vllm_env

        aiter_off = vllm_env.vllm_aiter_missing()
        report["providers here"] = {f: vllm_env.with_vllm_aiter_switch(m) for f, m in report["providers here"].items()}
    report["launch configs"] = launch_configs_here(device)
    arch, device_name = report["launch configs"].get("arch"), report["launch configs"].get("device")
    loaded = measured.load_here(arch, device_name) if arch and device_name else None  # read once, used twice
    report["self-measurement"] = measured.doctor_section(arch, device_name, loaded=loaded)
    report["self-test"] = selftest(device)
    if settings.enabled and has_vllm and plugin_exclusion(env) is None:  # else vLLM would patch nothing
        report.update(_activate_here(env))
        report["versions"] = versions()  # vLLM is imported now: name the version the verdict judged
    weights = absorb_weights(env, VllmFacts(installed_vllm_version(), None, arch), aiter_off)
    report["fusions"] = fusion_outlook(settings, report["providers here"], loaded, weights)
    report["a/b baseline"] = ab_baseline(env, shape, serve_args)
    report["verdict"], healthy = verdict_line(report)
    return report, healthy


AB_DEFAULT_BASELINE = "0"  # ab-serve's and gsm8k-ab's default arm A


def ab_baseline(env: dict[str, str], shape: Any, serve_args: str | None = None) -> list[str]:
    """Warnings for an A/B on this machine: the default baseline (overlay off) and this switch, as
    baseline_hazard judges them with this environment and ``serve_args`` (None: not known here).
    A warning, not a "not ready": serving itself is what the rest of the report judges."""
    from k3_amd_overlay.commands.baseline_hazard import VllmFacts, baseline_hazard

    facts = VllmFacts(installed_vllm_version(), None if shape is None else bool(shape.upstream.get(QK_CACHE)))
    switches = dict.fromkeys([AB_DEFAULT_BASELINE, env.get(SWITCH, "") or AB_DEFAULT_BASELINE])
    unknown = "" if serve_args is not None else (
        " (serve arguments not given: --enforce-eager, a cudagraph_mode without PIECEWISE or a non-fp8 KV cache "
        "rule it out; doctor --serve-args judges them)")
    return [why + unknown for switch in switches if (why := baseline_hazard(facts, env, serve_args or "", switch))]


def _vllm_shape(env: dict[str, str]) -> tuple[dict[str, Any], Any]:
    """The "vllm shape" section, and the recognised VllmShape (None where none is)."""
    from k3_amd_overlay.targets import sources
    from k3_amd_overlay.targets.defects import present_defects, trigger_words
    from k3_amd_overlay.targets.shapes import recognise

    vllm_sources = sources.VllmSources(sources.vllm_root())
    found = recognise(vllm_sources)
    shape = found.shape
    return {
        "recognised": shape.name if shape else None,
        "releases": shape.releases if shape else None,
        "this vLLM fuses by itself": {f: w for f, w in (shape.upstream if shape else {}).items() if w},
        "anchors missing per fusion": {f: m for f, m in found.missing_for_fusion.items() if m},
        "shapes not matched": found.missing_identity if not shape else {},
        "known vLLM defects in this release": [
            f"{d.describe()}; {trigger_words(d.triggered(env))}"
            for d in present_defects(vllm_sources)],
    }, shape


def _import_vllm() -> None:
    import vllm  # noqa: F401


def _activate_here(env: dict[str, str]) -> dict[str, Any]:
    """Activate in this process as vLLM would (the K3 AMD import fires the hooks), with markers in a
    directory removed afterwards: the doctor is no vLLM process and leaves no marker behind."""
    import tempfile

    from k3_amd_overlay import activation

    with tempfile.TemporaryDirectory(prefix="k3ovl-doctor-") as markers:
        os.chmod(markers, 0o700)
        try:
            _import_vllm()  # first, as in a vLLM process: the activation's range check reads its version
            active = activation.activate(load_settings({**env, MARKER_DIR: markers}))
            import vllm.models.kimi_k3.amd.linear  # noqa: F401  (fires the post-import hooks)
        except activation.OverlayActivationError as exc:
            return {"activation error": str(exc)}
        if active is None:
            return {}
        refused = {f: active.evidence.fusion(f).reason for f in active.settings.fusions
                   if active.evidence.fusion(f).state is FusionState.REFUSED}
        out: dict[str, Any] = {
            "patched": [{"key": a.spec.key, "target": a.spec.target, "fusions": list(a.spec.fusions)}
                        for a in active.engine.applied],
            "evidence": active.evidence.summary_line(),
        }
        if refused:
            out["activation error"] = "; ".join(f"{f} refused: {why}" for f, why in sorted(refused.items()))
        active.evidence.stop_writing()  # nothing more is written into the directory being removed
        return out


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[str("" if c is None else c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return [line(cells[0]), "  " + "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])]


def render(report: dict[str, Any]) -> str:
    """The report for a person: sentences and tables, the verdict last."""
    lines = [f"k3-amd-overlay doctor ({', '.join(FUSIONS)})"]
    v = report["versions"]
    lines.append("\n== versions\n  " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in v))
    g = report["gpu"]
    lines.append("\n== GPU\n  " + (f"{g['device']} ({g['arch']}, fp8 {g['fp8 format']})" if g["device"] != "cpu"
                                     else f"none: {g['note']}"))
    switch = report["switch"]
    lines.append("\n== switch\n  " + (switch["error"] if "error" in switch else
                 f"K3_AMD_OVERLAY={switch['K3_AMD_OVERLAY']!r}: mode {switch['mode']}, fusions "
                 f"{', '.join(switch['fusions']) or 'none'}, strict {switch['strict']}, providers "
                 + ", ".join(f"{f}={p}" for f, p in switch["providers"].items())))
    if report.get("vllm plugins"):
        lines.append(f"\n== vLLM plugins\n  {_plugins_line(report['vllm plugins'])}")
    marker_dir = report.get("marker dir")
    if marker_dir:
        lines.append(f"\n== marker directory\n  {marker_dir['path']} ("
                     + (f"{MARKER_DIR})" if marker_dir["set by"] == MARKER_DIR else "the per-user default)"))
        if marker_dir.get("error"):
            lines.append(f"  UNUSABLE: {marker_dir['error']}")
    shape = report.get("vllm shape")
    if shape is None:
        lines.append(f"\n{report['verdict']}")
        return "\n".join(lines)
    lines.append("\n== vLLM's K3 AMD code")
    if shape.get("note"):
        lines.append(f"  {shape['note']}")
    elif shape.get("recognised"):
        lines.append(f"  recognised: {shape['recognised']} (vLLM {shape['releases']})")
        for fusion, what in shape["this vLLM fuses by itself"].items():
            lines.append(f"  vLLM fuses {fusion} by itself: {what}")
        for fusion, missing in shape["anchors missing per fusion"].items():
            lines.append(f"  {fusion} cannot install: missing {', '.join(missing)}")
        for defect in shape["known vLLM defects in this release"]:
            lines.append(f"  known vLLM defect: {defect}")
    else:
        lines.append("  NOT recognised: " + "; ".join(f"{n}: missing {', '.join(m)}"
                                                      for n, m in shape.get("shapes not matched", {}).items()))
    if "providers here" not in report:  # a bad variable stops the report after vLLM is looked at
        lines.append(f"\n{report['verdict']}")
        return "\n".join(lines)
    if report.get("qk_cache by tensor-parallel size (K3, 96 heads)"):
        lines.append("\n== qk_cache by tensor-parallel size (K3, 96 heads)")
        lines += _table(["TP", "heads/rank", "who fuses the decode (AITER MLA on, no fp8 BMM)"],
                        [[r["tp"], r["heads per rank"], r["overlay"]]
                         for r in report["qk_cache by tensor-parallel size (K3, 96 heads)"]])
    lines.append("\n== providers here")
    lines += _table(["fusion", "provider", "runs here"],
                    [[f, p, "yes" if why is None else f"no: {why}"]
                     for f, m in report["providers here"].items() for p, why in m.items()])
    configs = report.get("launch configs", {})
    lines.append("\n== launch configs (" + (f"{configs['arch']}, {configs['device'] or 'no GPU'})" if "arch" in configs
                                            else "unusable)"))
    if "error" in configs:
        lines.append(f"  {configs['error']}")
    else:
        lines += _table(["kernel", "config file", "tuned"],
                        [[k, s["file"], f"on this GPU ({s['tuned_on']})" if s["tuned_here"] else
                          f"on {s['tuned_on']}, not this GPU" if s["tuned_on"] else "no"]
                         for k, s in configs["kernels"].items()])
        report_here = configs.get("compile report")
        if report_here:
            if "error" in report_here:
                lines.append(f"  compile report: {report_here['error']}")
            else:
                short = report_here["falling short"]
                lines.append(f"  compile report: {report_here['configurations']} configurations, {len(short)} falling "
                             "short")
                lines += [f"    {line}" for line in short]
    if report.get("self-measurement"):
        lines.append("\n== self-measurement (never slower: `k3-amd-overlay measure`)")
        lines += measured.doctor_lines(report["self-measurement"])
    lines.append("\n== self-test against the reference at K3 shapes")
    lines += _table(["op", "W_UK", "fp8", "provider", "result"],
                    [[r["op"], r.get("W_UK", ""), r.get("format", ""), r["provider"],
                      ("pass" if r["pass"] else "FAIL") + _measure(r) if r.get("ran") else f"not run: {r['why not']}"]
                     for r in report["self-test"]])
    if report.get("patched"):
        lines.append("\n== patched in this process\n" + "\n".join(f"  {p['key']}: {p['target']}"
                                                                for p in report["patched"]))
    if report.get("activation error"):
        lines.append(f"\n== activation\n  {report['activation error']}")
    if report.get("a/b baseline"):
        lines.append("\n== A/B baseline\n" + "\n".join(f"  warning: {w}" for w in report["a/b baseline"]))
    if report.get("fusions"):
        lines.append("\n== what a K3 layer built here would get (before its own conditions: fp8 KV cache, heads)")
        lines += _table(["fusion", "outcome", "provider", "why"],
                        [[f, o["state"], o["provider"], o["why"] + "".join(f"; {why}" for why in o.get("stock at", []))]
                         for f, o in report["fusions"].items()])
    lines.append(f"\n{report['verdict']}")
    return "\n".join(lines)


def _plugins_line(section: dict[str, Any]) -> str:
    if section.get("error"):
        return f"UNUSABLE: {section['error']}"
    if section["loads the overlay"]:
        return f"{VLLM_PLUGINS}={section[VLLM_PLUGINS]!r}: names the overlay's plugin"
    return (f"{VLLM_PLUGINS}={section[VLLM_PLUGINS]!r}: does not name {PLUGIN_NAME}: vLLM loads no overlay (off, it "
            "runs as it is, but leaves no off record: `check --expect off` cannot hold)")


def _measure(row: dict[str, Any]) -> str:
    for key in ("raised", "max ulp diff", "identical bytes", "identical query bytes"):
        if key in row:
            return f" ({key} {row[key]})"
    return ""
