"""``k3-amd-overlay doctor``: what this machine and this vLLM give, what the overlay does with the
current switch and why (each predicate input), and every reachable provider run against its
reference at K3 shapes; on a CPU machine with vLLM, also a real K3 MLA layer built stock and
overlaid, run on a decode batch and compared."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
from importlib import metadata
from typing import Any

import torch

from k3_amd_overlay import k3
from k3_amd_overlay.fp8 import FP8_FORMATS, device_format
from k3_amd_overlay.package import (
    ABSORB_MAX_TOKENS,
    ABSORB_QK_CACHE,
    FUSIONS,
    QK_CACHE,
    QKV_NORM,
    SUPPORTED_VLLM,
    __version__,
)
from k3_amd_overlay.settings import SWITCH, SettingsError, load_settings

UPSTREAM_MIN_LATENT_HEADS = 2048  # vLLM 0.32+ fuses qk_cache only when kv_lora_rank * heads >= this
K3_ABSORB_WIDTHS = (k3.QK_NOPE_HEAD_DIM, k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM)  # P, L, R of the absorbed op


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    return {
        "k3-amd-overlay": __version__, "python": platform.python_version(), "vllm": _version("vllm"),
        "torch": torch.__version__, "triton": _version("triton") or _version("pytorch-triton-rocm"),
        "aiter": _version("amd-aiter") or _version("aiter"), "supported vllm": SUPPORTED_VLLM,
    }


def gpu() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": "cpu", "fp8 format": None, "note": "no GPU: fused providers limited to the "
                "reference and (under TRITON_INTERPRET=1) the Triton interpreter"}
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "hip": torch.version.hip, "cuda": torch.version.cuda,
            "arch": getattr(props, "gcnArchName", f"sm_{props.major}{props.minor}"),
            "fp8 format": device_format().name}


def qk_cache_by_tp(shape_upstream: str) -> list[dict[str, Any]]:
    rows = []
    for tp, heads in k3.HEADS_PER_RANK.items():
        if tp > 32:
            continue
        upstream = bool(shape_upstream) and k3.KV_LORA_RANK * heads >= UPSTREAM_MIN_LATENT_HEADS
        rows.append({"tp": tp, "heads per rank": heads, "kv_lora_rank*heads": k3.KV_LORA_RANK * heads,
                     "upstream fuses (AITER MLA on, no fp8 BMM)": upstream,
                     "overlay": "upstream's" if upstream else "overlay's provider"})
    return rows


def selftest(device: torch.device) -> list[dict[str, Any]]:
    """Every provider this device can run, against the reference, on fresh random K3 inputs."""
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
        got = rmsnorm_pair.fused_q_kv_rmsnorm(q, kv, q_w, kv_w, k3.RMS_NORM_EPS, k3.RMS_NORM_EPS, provider=name)
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
            q_out = qk_op.fused_qk_cache(ql, q_pe, kv_c, k_pe, cache, slots, *scales, provider=name, kv_format=fmt.name)
            outs[name] = (cache, q_out.view(torch.uint8)[slots >= 0])
        absorb_outs = {}
        w_uk_t = (torch.randn(k3.KV_LORA_RANK, heads, k3.QK_NOPE_HEAD_DIM, device=device) / 8).to(torch.bfloat16)
        q_nope = (torch.randn(tokens, heads, k3.QK_NOPE_HEAD_DIM, device=device) * 2).to(torch.bfloat16)
        for name, missing in absorb_op.provider_missing(device, *K3_ABSORB_WIDTHS).items():
            if missing:
                results.append({"op": ABSORB_QK_CACHE, "format": fmt.name, "provider": name, "ran": False,
                                "why not": missing})
                continue
            cache = torch.zeros(8, 16, k3.LATENT_ROW, dtype=torch.uint8, device=device)
            q_out = absorb_op.fused_absorb_qk_cache(q_nope, w_uk_t.permute(1, 2, 0), q_pe, kv_c, k_pe, cache, slots,
                                                    *scales, provider=name, kv_format=fmt.name)
            absorb_outs[name] = q_out.view(torch.uint8)[slots >= 0]
        for name, q_bits in absorb_outs.items():
            same = (q_bits == absorb_outs["reference"]).float().mean().item()
            results.append({"op": ABSORB_QK_CACHE, "format": fmt.name, "provider": name, "ran": True,
                            "identical query bytes": round(same, 5),
                            "pass": same > (0.9 if device.type == "cpu" else 0.99)})
        for name, (cache, q_bits) in outs.items():
            same = (cache == outs["reference"][0]).float().mean().item() * 0.5 + \
                (q_bits == outs["reference"][1]).float().mean().item() * 0.5
            results.append({"op": QK_CACHE, "format": fmt.name, "provider": name, "ran": True,
                            "identical bytes": round(same, 5),
                            "pass": same == 1.0 or (device.type == "cpu" and same > 0.9),
                            **({"note": "Triton interpreter fp8 rounding (bit equality is checked on a GPU)"}
                               if device.type == "cpu" and name == "triton" else {})})
    return results


def layer_check(settings: Any) -> dict[str, Any]:
    """A real K3 MLA layer of the installed vLLM built stock, then with the overlay, on one fp8
    decode batch (attention core replaced by a torch reference on CPU: see testing/layer_harness)."""
    from k3_amd_overlay import activation
    from k3_amd_overlay.testing import layer_harness as harness

    # The Triton interpreter mis-rounds fp8 casts (Triton 3.x's numpy-based casts): on CPU the layer
    # check runs the decode fusions through their reference providers; the self-test above and the
    # GPU tests check the Triton kernels' bytes.
    overridden = [f for f in (QK_CACHE, ABSORB_QK_CACHE) if settings.provider(f) == "auto"]
    settings = dataclasses.replace(settings, providers={**settings.providers, **dict.fromkeys(overridden, "reference")})
    note = f"{', '.join(overridden)} provider set to 'reference' for this CPU layer check" if overridden else None
    spec = harness.LayerSpec(kv_cache_dtype="fp8", num_blocks=2 * (ABSORB_MAX_TOKENS + 2))
    stock = harness.build_layer(spec, 0, seed=3)
    active = activation.activate(settings)
    fused = harness.build_layer(spec, 1, seed=3)
    # a small decode batch (the absorbed launch where absorb_qk_cache applies, else qk_cache's) and
    # one over the absorbed path's limit (qk_cache's launch): every decode path this switch has
    batches = [harness.decode_batch([stock, fused], [5, 17, 30, 9], padding=2),
               harness.decode_batch([stock, fused], [2] * (ABSORB_MAX_TOKENS + 1), seed=2)]
    rel, same_cache = 0.0, True
    for batch in batches:
        n = batch.num_tokens
        out_stock, out_fused = harness.run(stock, batch)[:n], harness.run(fused, batch)[:n]
        rel = max(rel, ((out_fused.float() - out_stock.float()).norm() / out_stock.float().norm()).item())
        same_cache &= bool(torch.equal(stock.attn.kv_cache, fused.attn.kv_cache))
    record = active.evidence.record["fusions"] if active else {}
    not_run = [f for f in settings.fusions
               if record.get(f, {}).get("state") == "applied" and not record[f].get("effective")]
    return {
        "layer": f"{type(fused.module).__module__}.{type(fused.module).__name__}",
        "wrapper": type(fused.wrapper).__name__, "attention": type(fused.attn).__name__,
        "decode batches (tokens)": [b.num_tokens for b in batches],
        "relative output difference (max)": rel, "identical cache bytes": same_cache,
        "stock KV writes (stock layer / overlay layer)": [len(stock.kv_writes), len(fused.kv_writes)],
        "stock concat+quant launches (stock / overlay)": [stock.concat_quant_calls, fused.concat_quant_calls],
        "fusions": {f: {k: record[f][k] for k in ("state", "provider", "reason", "effective")} for f in record},
        "applied but never ran": not_run,
        "pass": (rel < 0.02 and same_cache and not fused.kv_writes and fused.concat_quant_calls == 0
                 and not not_run),
        **({"note": note} if note else {}),
    }


def run_doctor(switch: str | None = None, layer_check_wanted: bool = True) -> tuple[dict[str, Any], bool]:
    report: dict[str, Any] = {"versions": versions(), "gpu": gpu()}
    env = dict(os.environ)
    if switch is not None:
        env[SWITCH] = switch
    try:
        settings = load_settings(env)
    except SettingsError as exc:
        report["switch"] = {"error": str(exc)}
        return report, False
    report["switch"] = {"K3_AMD_OVERLAY": settings.raw, "mode": settings.mode.value,
                        "fusions": sorted(settings.fusions), "strict": settings.strict,
                        "providers": dict(settings.providers)}
    healthy = True
    if importlib.util.find_spec("vllm") is not None:
        from k3_amd_overlay.targets import sources
        from k3_amd_overlay.targets.defects import present_defects
        from k3_amd_overlay.targets.shapes import recognise

        vllm_sources = sources.VllmSources(sources.vllm_root())
        found = recognise(vllm_sources)
        shape = found.shape
        report["vllm shape"] = {
            "recognised": shape.name if shape else None,
            "releases": shape.releases if shape else None,
            "this vLLM fuses by itself": shape.upstream if shape else {},
            "anchors missing per fusion": found.missing_for_fusion,
            "shapes not matched": found.missing_identity,
            "known vLLM defects in this release": [
                f"{d.describe()}; {'TRIGGERED by this environment' if d.triggered(env) else 'not triggered here'}"
                for d in present_defects(vllm_sources)] or "none known",
        }
        by_tp = qk_cache_by_tp(shape.upstream[QK_CACHE] if shape else "")
        report["qk_cache by tensor-parallel size (K3, 96 heads)"] = by_tp
        healthy &= shape is not None
    else:
        report["vllm shape"] = {"recognised": None, "note": "vLLM is not installed here"}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
    from k3_amd_overlay.ops import qk_cache as qk_op
    from k3_amd_overlay.ops import rmsnorm_pair

    report["providers here"] = {
        QKV_NORM: rmsnorm_pair.provider_missing(device, k3.RMS_NORM_EPS, k3.RMS_NORM_EPS),
        QK_CACHE: qk_op.provider_missing(device),
        ABSORB_QK_CACHE: absorb_op.provider_missing(device, *K3_ABSORB_WIDTHS),
    }
    if importlib.util.find_spec("vllm") is not None:  # in a vLLM process AITER follows vLLM's switch
        from k3_amd_overlay.targets.layer_state import with_vllm_aiter_switch

        report["providers here"] = {f: with_vllm_aiter_switch(m) for f, m in report["providers here"].items()}
    report["self-test"] = selftest(device)
    healthy &= all(r.get("pass", True) for r in report["self-test"])
    if settings.enabled and importlib.util.find_spec("vllm") is not None:
        if layer_check_wanted and device.type == "cpu":
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
            report["layer check"] = layer_check(settings)
            healthy &= report["layer check"]["pass"]
        from k3_amd_overlay import activation

        active = activation.activate(settings)
        import vllm.models.kimi_k3.amd.linear  # noqa: F401  (fires the post-import hooks)

        if active is not None:
            report["patched"] = [{"key": a.spec.key, "target": a.spec.target, "fusions": list(a.spec.fusions)}
                                 for a in active.engine.applied]
            report["evidence"] = active.evidence.summary_line()
            healthy &= all(active.evidence.fusion(f)["state"] != "refused" for f in settings.fusions)
    return report, bool(healthy)


def render(report: dict[str, Any]) -> str:
    lines = [f"k3-amd-overlay doctor ({', '.join(FUSIONS)})"]
    for section, body in report.items():
        lines.append(f"\n== {section}")
        if isinstance(body, dict):
            for key, value in body.items():
                lines.append(f"  {key}: {value}")
        elif isinstance(body, list):
            for item in body:
                lines.append(f"  - {item}")
        else:
            lines.append(f"  {body}")
    return "\n".join(lines)
