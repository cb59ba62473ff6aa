"""The real KimiMLAAttention of the installed vLLM on CPU, stock against overlaid, on fp8 decode
batches (the attention core alone is a torch reference there: see tests/layer_harness.py for what
is real and what is replaced, and why)."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import mxfp4_standin
import pytest
import torch
from machine import HAS_VLLM
from parity import reference_pair, rmsnorm_inputs, rmsnorm_problems
from vllm_support import next_layer_index, overlay, shape_name, with_real_signature

from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.ops import rmsnorm_pair

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_layer_session")]
if HAS_VLLM:
    import layer_harness as harness

    from k3_amd_overlay.targets import vllm_env

SEQ_LENS = [5, 17, 30, 9]


@pytest.fixture
def layer_pair(tmp_path):
    """``layer_pair(spec, switch_env)``: the same layer (same weights) built stock, then with the
    overlay activated by exactly these variables; the overlay is deactivated after the test."""
    with contextlib.ExitStack() as stack:
        def build(spec, switch_env, seed=7):
            stock = harness.build_layer(spec, next_layer_index(), seed=seed)
            activation = stack.enter_context(overlay(tmp_path, **switch_env))
            fused = harness.build_layer(spec, next_layer_index(), seed=seed)
            return stock, fused, activation

        yield build


def written_rows(layer):
    return layer.attn.kv_cache.view(-1, layer.spec.latent).ne(0).any(dim=1)


def decode_site(layer):
    """The layer's decode site (the installer keeps it on the MLA wrapper on every vLLM)."""
    from k3_amd_overlay.targets.decode import DECODE_SITE

    return vars(layer.wrapper)[DECODE_SITE]


def aiter_on(monkeypatch, mla: bool = False) -> None:
    """vLLM's AITER switches as a ROCm server with VLLM_ROCM_USE_AITER=1 (and AITER MLA) sees them."""
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.setattr(rocm_aiter_ops, "is_enabled", classmethod(lambda cls: True))
    if mla:
        monkeypatch.setattr(rocm_aiter_ops, "is_mla_enabled", classmethod(lambda cls: True))


@pytest.mark.parametrize("provider", ["reference", "triton", "aiter"])
def test_qk_cache_decode_matches_stock(provider, tmp_path, monkeypatch, layer_pair, aiter_standin):
    standin = aiter_standin(fmt=harness.fp8_format()) if provider == "aiter" else None
    # the overlay's view of vLLM's AITER switch (vLLM's own AITER norm stays off: its op is not here)
    monkeypatch.setattr(vllm_env, "vllm_aiter_missing", lambda: None)
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": "qk_cache", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": provider})
    batch = harness.decode_batch([stock, fused], SEQ_LENS, padding=2)
    before = fused.attn.kv_cache.clone()
    site = decode_site(fused)
    counted, evidence_hook = [], site.on_effective
    site.on_effective = lambda rows: counted.append(rows) or evidence_hook(rows)
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    n = batch.num_tokens
    assert counted == [n + 2]  # the batch as launched, padding rows included (a graph's captured size)
    entry = activation.evidence.fusion("qk_cache")
    assert (entry.state, entry.provider, entry.effective) == ("applied", provider, True)
    # one fused launch replaced the stock KV write and the stock concat+quant; MQA ran once
    assert (stock.kv_writes, fused.kv_writes) == ([n], [])
    assert (stock.concat_quant_calls, fused.concat_quant_calls) == (1, 0)
    assert fused.mqa_calls == 1
    # every valid slot written exactly once, nothing else touched, padding rows write nothing
    slots = batch.slot_mapping[batch.slot_mapping >= 0]
    changed = (fused.attn.kv_cache != before).any(dim=-1).view(-1)
    assert set(changed.nonzero().flatten().tolist()) == set(slots.tolist())  # each row, nothing else
    assert torch.equal(out_fused[:n], out_stock[:n])
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)
    if standin:
        assert len(standin.calls) == 1 and standin.calls[0]["positions_max"] == 0
        assert torch.equal(standin.calls[0]["slot_mapping"], batch.slot_mapping[:n])


@pytest.mark.parametrize("switch", ["qk_cache", "absorb_qk_cache"])
def test_a_batch_whose_attended_count_holds_its_padding_rows_writes_each_real_row_once(switch, monkeypatch,
                                                                                      layer_pair):
    """vLLM's model runner (0.30-0.33: ``num_actual_tokens=num_tokens_padded``) counts a graph's padding
    rows (slot -1) among the attended tokens: the fused launch is the only KV writer, writes each real
    slot once and no padding row, and gives stock's cache and real rows' output, bit for bit."""
    monkeypatch.setattr(vllm_env, "vllm_aiter_missing", lambda: None)
    stock, fused, _ = layer_pair(harness.LayerSpec(kv_cache_dtype="fp8"), {"K3_AMD_OVERLAY": switch})
    pad = 3
    batch = harness.decode_batch([stock, fused], SEQ_LENS, padding=pad)
    n = batch.num_tokens
    batch.metadata.num_actual_tokens = batch.metadata.num_decode_tokens = n + pad
    decode = batch.metadata.decode
    decode.seq_lens = torch.cat([decode.seq_lens, torch.ones(pad, dtype=decode.seq_lens.dtype)])
    decode.block_table = torch.cat([decode.block_table, decode.block_table[:1].expand(pad, -1)])
    before = fused.attn.kv_cache.clone()
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    assert fused.kv_writes == [] and len(stock.kv_writes) == 1
    changed = (fused.attn.kv_cache != before).any(dim=-1).view(-1)
    assert set(changed.nonzero().flatten().tolist()) == set(batch.slot_mapping[batch.slot_mapping >= 0].tolist())
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)
    assert torch.equal(out_fused[:n], out_stock[:n])


@pytest.mark.parametrize("switch", ["qkv_norm", "qk_cache", "stock"])
def test_layers_built_before_deactivate_prove_neither_arm(tmp_path, monkeypatch, layer_pair, switch):
    """``k3_amd_overlay.deactivate()`` after a layer is built: that layer keeps the overlay's sites and
    their routes (the fused norm or decode still runs there, with stock's bytes or, for the norm, within
    its rounding), and whatever it runs after, every requested fusion stays ``refused`` with the
    deactivation's reason in the record, so ``check`` holds neither arm."""
    import k3_amd_overlay
    from k3_amd_overlay import activation as activation_module
    from k3_amd_overlay.commands.verdict import judge

    monkeypatch.setattr(vllm_env, "vllm_aiter_missing", lambda: None)
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    variables = {"K3_AMD_OVERLAY": switch}
    if switch != "stock":
        variables[f"K3_AMD_OVERLAY_{switch.upper()}_PROVIDER"] = "reference"
    fused_norms, original = [], rmsnorm_pair.run_provider
    monkeypatch.setattr(rmsnorm_pair, "run_provider", lambda *a, **k: fused_norms.append(1) or original(*a, **k))
    stock, layer, activation = layer_pair(spec, variables)
    batch = harness.decode_batch([stock, layer], SEQ_LENS, padding=2)
    harness.run(layer, batch)
    k3_amd_overlay.deactivate()
    for _ in range(2):  # decode batches after the deactivation, as a serving loop would run them
        batch = harness.decode_batch([stock, layer], SEQ_LENS, padding=2)
        n = batch.num_tokens
        out, want = harness.run(layer, batch)[:n], harness.run(stock, batch)[:n]
        if switch == "qkv_norm":  # vLLM rounds to bf16 before the weight multiply; the fused kernel does not
            assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 0.02
        else:
            assert torch.equal(out, want) and torch.equal(layer.attn.kv_cache, stock.attn.kv_cache)
    # the kept routes: the overlay's norm ran on every batch, or its launch wrote the cache on every batch
    assert len(fused_norms) == (3 if switch == "qkv_norm" else 0)
    assert layer.kv_writes == ([] if switch == "qk_cache" else [n] * 3)
    record = activation.evidence.record
    requested = {f: (e.state, e.reason) for f, e in record.fusions.items() if e.state is not FusionState.DISABLED}
    assert requested == {f: (FusionState.REFUSED, activation_module.DEACTIVATED) for f in activation.settings.fusions}
    for expect in ("fused", "stock"):
        verdict = judge([record], expect, None, require_effective=False)
        assert not verdict.holds, (expect, verdict.lines)


def _ranges(profile) -> list[str]:
    from k3_amd_overlay.regions import REGION_PREFIX

    return [e.name.removeprefix(REGION_PREFIX) for e in profile.events() if e.name.startswith(REGION_PREFIX)]


# The census's profiler ranges per layer call in stock mode: the qkv_norm range around both norms
# (0.30+: vLLM's ``_normalize_q_kv``; 0.29: vLLM's forward calls each norm, each in its own range)
# and the decode range around vLLM's attention call.
STOCK_RANGES = {"plain_wrapper": ["qkv_norm", "qkv_norm", "mla_decode"],
                "k3_norm_wrapper": ["qkv_norm", "mla_decode"], "k3_decode_wrapper": ["qkv_norm", "mla_decode"]}


def test_stock_mode_opens_the_census_ranges_of_its_shape_and_runs_stocks_bytes(tmp_path, layer_pair):
    """A census compares a stock baseline with a fused candidate region by region only where both
    arms have the region's ranges: stock mode opens them around vLLM's own calls on every release,
    counts its layers, and changes no byte."""
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, layer, activation = layer_pair(spec, {"K3_AMD_OVERLAY": "stock"})
    batch = harness.decode_batch([stock, layer], SEQ_LENS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = harness.run(layer, batch)
    assert sorted(_ranges(profile)) == sorted(STOCK_RANGES[shape_name()])
    assert torch.equal(out, harness.run(stock, batch)) and torch.equal(layer.attn.kv_cache, stock.attn.kv_cache)
    counted = {f: activation.evidence.fusion(f).layers for f in ("qkv_norm", "qk_cache")}
    assert counted == {"qkv_norm": 1, "qk_cache": 1}, counted
    assert {activation.evidence.fusion(f).state for f in counted} == {FusionState.FORCED_STOCK}


def test_stock_mode_computes_exactly_what_the_overlay_off_layer_does(tmp_path, layer_pair):
    """Stock mode is the A/B baseline: whatever it attaches to a layer (on 0.29 the overlay's K3
    wrapper subclass itself), vLLM's own computation runs, byte for byte: on vLLM's profile run (no
    attention metadata) and on decode batches, with a profiler recording (its ranges opened) and
    without."""
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    off, layer, _ = layer_pair(spec, {"K3_AMD_OVERLAY": "stock"})
    if shape_name() == "plain_wrapper":
        assert type(layer.wrapper).__name__ == "K3OverlayMLAWrapper"
        assert type(layer.wrapper.kv_a_layernorm).__name__ == "K3OverlayRMSNorm"
    assert type(off.wrapper).__name__ != "K3OverlayMLAWrapper"
    hidden = torch.randn(len(SEQ_LENS), spec.hidden, generator=torch.Generator().manual_seed(3)).to(spec.dtype)
    assert torch.equal(harness.run(layer, None, hidden), harness.run(off, None, hidden))
    for profiled in (False, True):
        batch = harness.decode_batch([off, layer], SEQ_LENS, padding=2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiled \
                else contextlib.nullcontext():
            out = harness.run(layer, batch)
        n = batch.num_tokens  # the padding rows' output is never written, by either
        assert torch.equal(out[:n], harness.run(off, batch)[:n]), profiled
        assert torch.equal(layer.attn.kv_cache, off.attn.kv_cache), profiled


# The qkv_norm ranges of one layer call in auto mode, where the overlay's own norm (its front end on
# 0.29) runs it, and where qkv_norm is refused and vLLM's forward runs the two norms.
AUTO_NORM_RANGES = {"plain_wrapper": {"applied": 1, "refused": 2}, "k3_norm_wrapper": {"applied": 1, "refused": 1},
                    "k3_decode_wrapper": {"applied": 1, "refused": 1}}


@pytest.mark.parametrize("state", ["applied", "refused"])
def test_every_layer_with_a_qkv_norm_site_opens_its_range_once_per_norm_work_never_nested(state, monkeypatch,
                                                                                          layer_pair):
    """A candidate arm counts the qkv_norm region only inside its ranges, so a layer whose qkv_norm is
    refused must open them too (its two stock norms would otherwise go uncounted against the
    baseline's), and ranges must never nest (the census refuses nested ones)."""
    from vllm.config.compilation import CompilationMode

    if state == "refused":  # refused at build: the whole model is compiled (the layer itself runs eager here)
        monkeypatch.setattr(harness.vllm_config().compilation_config, "mode", CompilationMode.STOCK_TORCH_COMPILE)
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, layer, activation = layer_pair(spec, {"K3_AMD_OVERLAY": "qkv_norm", "K3_AMD_OVERLAY_QKV_NORM_PROVIDER":
                                                 "reference"})
    assert activation.evidence.fusion("qkv_norm").state == state
    batch = harness.decode_batch([stock, layer], SEQ_LENS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        harness.run(layer, batch)
    assert _ranges(profile).count("qkv_norm") == AUTO_NORM_RANGES[shape_name()][state]
    spans = sorted((e.time_range.start, e.time_range.end) for e in profile.events()
                   if e.name.startswith("k3_amd_overlay::"))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), spans


def test_profile_run_and_bf16_cache_stay_stock(tmp_path, layer_pair):
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": "qk_cache", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "reference"})
    hidden = torch.randn(3, spec.hidden).to(spec.dtype)
    assert torch.equal(harness.run(fused, None, hidden), harness.run(stock, None, hidden))
    assert activation.evidence.fusion("qk_cache").effective is False
    bf16 = harness.build_layer(harness.LayerSpec(kv_cache_dtype="auto"), next_layer_index())
    assert activation.evidence.fusion("qk_cache").reason.startswith("mixed across layers")
    assert "not a plain fp8 cache" in activation.evidence.fusion("qk_cache").reason
    batch = harness.decode_batch([bf16], SEQ_LENS)
    harness.run(bf16, batch)
    assert bf16.kv_writes == [len(SEQ_LENS)]  # the stock write ran: nothing fused


def test_qkv_norm_layer_matches_stock_with_one_fused_call(tmp_path, monkeypatch, layer_pair):
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": "qkv_norm", "K3_AMD_OVERLAY_QKV_NORM_PROVIDER": "triton"})
    calls = {"fused": 0, "q_norm": 0, "kv_norm": 0}
    original = rmsnorm_pair.run_provider

    def counted(*args, **kwargs):
        calls["fused"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(rmsnorm_pair, "run_provider", counted)
    fused.module.q_a_layernorm.register_forward_hook(lambda *a: calls.__setitem__("q_norm", calls["q_norm"] + 1))
    fused.module.kv_a_layernorm.register_forward_hook(lambda *a: calls.__setitem__("kv_norm", calls["kv_norm"] + 1))
    batch = harness.decode_batch([stock, fused], SEQ_LENS, padding=1)
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    n = batch.num_tokens
    assert calls == {"fused": 1, "q_norm": 0, "kv_norm": 0}
    rel = ((out_fused[:n].float() - out_stock[:n].float()).norm() / out_stock[:n].float().norm()).item()
    assert rel < 0.02  # vLLM rounds to bf16 before the weight multiply; the fused kernel does not
    entry = activation.evidence.fusion("qkv_norm")
    assert (entry.state, entry.provider, entry.effective) == ("applied", "triton", True)


def attention_inputs(layer, batch, llama_4_scaling):
    """What the layer's MLA wrapper hands its attention layer for one forward: q, kv_c_normed, k_pe
    (each with its shape) and the keywords. The attention itself is not run."""
    seen = []

    def record(q, kv_c_normed, k_pe, **kwargs):
        seen.append((q.clone(), kv_c_normed.clone(), k_pe.clone(), kwargs))
        return torch.zeros(kwargs["output_shape"], dtype=q.dtype)

    layer.attn.forward = record
    with harness.forward_context(layer, batch):
        layer.wrapper(batch.positions, batch.hidden, llama_4_scaling)
    return seen


def test_the_qkv_norm_front_end_hands_attention_exactly_what_stock_does(layer_pair):
    """With qkv_norm applied (reference provider: it rounds where vLLM's RMSNorm does) the wrapper's
    front end hands the attention layer the same q, kv_c_normed and k_pe, shapes included, as
    stock, with vLLM's llama-4 query scaling too (K3 never passes one; the wrapper's signature takes
    it). On vLLM 0.29 the front end is the overlay's own forward (plain_wrapper.py)."""
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": "qkv_norm", "K3_AMD_OVERLAY_QKV_NORM_PROVIDER": "reference"})
    assert activation.evidence.fusion("qkv_norm").state == "applied"
    batch = harness.decode_batch([stock, fused], SEQ_LENS)
    scaling = 1.0 + torch.rand((batch.hidden.shape[0], 1, 1), generator=torch.Generator().manual_seed(3))
    for llama_4_scaling in (None, scaling.to(spec.dtype)):
        (expected,), (got,) = (attention_inputs(layer, batch, llama_4_scaling) for layer in (stock, fused))
        for want, have in zip(expected[:3], got[:3], strict=True):
            assert have.shape == want.shape and torch.equal(have, want)
        assert got[3] == expected[3]
    assert expected[2].shape == (batch.hidden.shape[0], 1, spec.rope)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [0, 1, 7, 64, 512, 4096])
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_providers_match_two_real_vllm_rmsnorms(dtype, tokens, provider):
    if provider == "triton" and tokens > 64:
        pytest.skip("too slow under the Triton interpreter; the GPU run covers large T")
    from vllm.model_executor.layers.layernorm import RMSNorm

    harness.vllm_config()
    q, kv, _, _ = rmsnorm_inputs(tokens, dtype, "cpu")
    q_mod, kv_mod = RMSNorm(1536, eps=1e-5).to(dtype), RMSNorm(512, eps=1e-3).to(dtype)
    with torch.no_grad():
        q_mod.weight.copy_(1 + 0.3 * torch.randn(1536))
        kv_mod.weight.copy_(1 + 0.3 * torch.randn(512))
        want = (q_mod.forward_native(q), kv_mod.forward_native(kv))
    got = rmsnorm_pair.fused_q_kv_rmsnorm(q, kv, q_mod.weight, kv_mod.weight, 1e-5, 1e-3, provider=provider)
    # vLLM rounds x/rms to the weight dtype before multiplying: up to one more rounding than the op
    assert rmsnorm_problems(got, want, ulps=3.0) == []
    assert rmsnorm_problems(got, reference_pair(q, kv, q_mod.weight, kv_mod.weight, 1e-5, 1e-3)) == []


# --- upstream ownership: vLLM 0.30+ fuses the norms itself when AITER is on -------------------

@pytest.fixture
def aiter_dual_norm_standin(monkeypatch):
    """AITER on (as rocm_aiter_ops sees it) and a stand-in for vLLM's AITER dual-RMSNorm op."""
    from vllm import _aiter_ops
    from vllm._aiter_ops import rocm_aiter_ops

    calls = []
    if not hasattr(aiter_dual_norm_standin, "lib"):
        lib = torch.library.Library("vllm", "FRAGMENT")
        # the schema of this release's own implementation (its argument names and types)
        schema = torch.library.infer_schema(_aiter_ops._fused_mla_dual_rms_norm_impl, mutates_args=())
        lib.define("fused_mla_dual_rms_norm" + schema)

        def impl(x1, w1, x2, w2, e1, e2):
            # AITER's dual RMSNorm is two RMSNorms in one launch: computed here by vLLM's own RMSNorm
            # (forward_native), not by the overlay's reference it is compared with
            from vllm.model_executor.layers.layernorm import RMSNorm

            calls.append(x1.shape[0])
            outs = []
            for x, w, eps in ((x1, w1, e1), (x2, w2, e2)):
                norm = RMSNorm(x.shape[-1], eps=eps, dtype=w.dtype)
                norm.weight.data.copy_(w)
                outs.append(norm.forward_native(x))
            return tuple(outs)

        lib.impl("fused_mla_dual_rms_norm", impl, "CPU")
        aiter_dual_norm_standin.lib = lib  # keep the registration alive
        aiter_dual_norm_standin.calls = calls
    monkeypatch.setattr(rocm_aiter_ops, "is_enabled", classmethod(lambda cls: True))
    yield aiter_dual_norm_standin.calls
    aiter_dual_norm_standin.calls.clear()


@pytest.mark.parametrize("switch,provider,state,upstream_calls,overlay_calls", [
    ("1", "auto", "upstream", 1, 0),
    ("stock", "auto", "forced-stock", 0, 0),
    ("qkv_norm", "triton", "applied", 0, 1),
])
def test_upstream_norm_fusion_owned_forced_stock_or_overridden(switch, provider, state, upstream_calls,
                                                              overlay_calls, aiter_dual_norm_standin,
                                                              tmp_path, monkeypatch):
    if shape_name() == "plain_wrapper":
        pytest.skip("this vLLM has no norm fusion of its own (plain MLA wrapper, <= 0.29)")
    spec = harness.LayerSpec(kv_cache_dtype="auto", gate=False)  # the gate would import AITER's sigmoid-mul
    with overlay(tmp_path, K3_AMD_OVERLAY=switch, K3_AMD_OVERLAY_QKV_NORM_PROVIDER=provider) as activation:
        layer = harness.build_layer(spec, next_layer_index())
        overlay_calls_seen = []
        original = rmsnorm_pair.run_provider
        monkeypatch.setattr(rmsnorm_pair, "run_provider",
                            lambda *a, **k: overlay_calls_seen.append(1) or original(*a, **k))
        aiter_dual_norm_standin.clear()
        harness.run(layer, harness.decode_batch([layer], SEQ_LENS))
        assert activation.evidence.fusion("qkv_norm").state == state
        assert (len(aiter_dual_norm_standin), len(overlay_calls_seen)) == (upstream_calls, overlay_calls)
        assert activation.evidence.fusion("qkv_norm").effective is (state != "forced-stock")


# --- upstream ownership: vLLM 0.32+ fuses the decode itself, refusing fewer than 4 heads --------

K3_LAYER = dict(kv_lora=512, rope=64, nope=128, v=128, hidden=256, q_lora=96, num_blocks=12, gate=False)


def vllm_defects() -> list[str]:
    from k3_amd_overlay.targets import sources
    from k3_amd_overlay.targets.defects import present_defects

    return [d.name for d in present_defects(sources.VllmSources(sources.vllm_root()))]


def skip_where_vllm_cannot_build_a_fused_decode_layer() -> None:
    """vLLM's own fused decode at >= 4 heads with a bf16 W_UK_T needs a vLLM whose check does not
    read W_UK_T before loading (0.32's does: test_vllm_032_defect_is_named_not_worsened)."""
    if shape_name() != "k3_decode_wrapper":
        pytest.skip("this vLLM has no fused decode of its own (< 0.32)")
    if vllm_defects():
        pytest.skip(f"this vLLM cannot build such a layer at all: {', '.join(vllm_defects())}")


@pytest.mark.parametrize("heads,switch,state,provider", [
    (4, "qk_cache", "upstream", "aiter"),  # kv_lora_rank * heads = 2048: vLLM's own fused decode
    (4, "stock", "forced-stock", None),  # the A/B baseline: vLLM's fusion switched off
    (3, "qk_cache", "applied", "aiter"),  # TP32: vLLM refuses, the overlay extends it (zero positions)
])
def test_upstream_decode_fusion_owned_forced_stock_or_extended(heads, switch, state, provider, tmp_path,
                                                              monkeypatch, aiter_dual_norm_standin, aiter_standin):
    if heads >= 4:
        skip_where_vllm_cannot_build_a_fused_decode_layer()
    elif shape_name() != "k3_decode_wrapper":
        pytest.skip("this vLLM has no fused decode of its own (< 0.32)")
    from vllm._aiter_ops import rocm_aiter_ops

    aiter_on(monkeypatch, mla=True)
    standin = aiter_standin(fmt=harness.fp8_format())
    spec = harness.LayerSpec(num_heads=heads, kv_cache_dtype="fp8", **K3_LAYER)
    stock = harness.build_layer(spec, next_layer_index(), seed=5)
    with overlay(tmp_path, K3_AMD_OVERLAY=switch) as activation:
        fused = harness.build_layer(spec, next_layer_index(), seed=5)
        batch = harness.decode_batch([stock, fused], [5, 40], padding=1)
        standin.calls.clear()
        out_fused = harness.run(fused, batch)
        entry = activation.evidence.fusion("qk_cache")
        assert (entry.state, entry.provider) == (state, provider), entry
        assert len(standin.calls) == (0 if state == "forced-stock" else 1)
        assert fused.kv_writes == ([2] if state == "forced-stock" else [])
        if state == "applied":
            assert standin.calls[0]["positions_max"] == 0  # the overlay never relies on a clamp
    monkeypatch.setattr(rocm_aiter_ops, "is_mla_enabled", classmethod(lambda cls: False))
    out_stock = harness.run(stock, batch)
    assert torch.equal(out_fused[:2], out_stock[:2])
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)


def test_deactivate_restores_identical_objects(tmp_path):
    import vllm.models.kimi_k3.amd.linear as linear

    targets = [vars(linear).copy()]
    mla = getattr(linear, "KimiK3MultiHeadLatentAttentionWrapper", None)
    if mla is not None:
        targets.append(dict(vars(mla)))
    with overlay(tmp_path, K3_AMD_OVERLAY="1") as activation:
        assert activation.engine.applied
        changed = [vars(linear)] + ([dict(vars(mla))] if mla is not None else [])
        assert any(any(a.get(k) is not b.get(k) for k in b) for a, b in zip(changed, targets, strict=False))
    after = [vars(linear)] + ([dict(vars(mla))] if mla is not None else [])
    for now, before in zip(after, targets, strict=False):
        assert all(now[k] is before[k] for k in before)
        assert set(now) == set(before)
    states = {f: e.state for f, e in activation.evidence.record.fusions.items()}
    assert states == dict.fromkeys(states, FusionState.REFUSED.value)  # and the evidence says so: no verdict holds


# --- absorb_qk_cache: the W_UK absorption folded into the fused launch -------------------------

@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_absorbed_decode_matches_stock(provider, tmp_path, layer_pair):
    """The absorbed launch rounds ql_nope to bf16 as stock's bmm output is; its fp32 sums run in
    another order than torch's CPU bmm, so a few query codes may sit one step apart: the output is
    compared to a tolerance, the cache exactly."""
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": "absorb_qk_cache", "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER": provider})
    batch = harness.decode_batch([stock, fused], SEQ_LENS, padding=2)
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    n = batch.num_tokens
    entry = activation.evidence.fusion("absorb_qk_cache")
    assert (entry.state, entry.provider, entry.effective) == ("applied", provider, True)
    assert activation.evidence.fusion("qk_cache").state == "disabled"
    assert (fused.kv_writes, fused.concat_quant_calls, fused.mqa_calls) == ([], 0, 1)
    rel = ((out_fused[:n].float() - out_stock[:n].float()).norm() / out_stock[:n].float().norm()).item()
    assert rel < 0.02
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)


def aiter_fp8_bmm(x, wq, w_scale, group_size=128, bias=None, dtype=torch.bfloat16, splitK=None, YQ=None,
                  transpose_bm=False, config=None):
    """Stands in for vLLM's ``rocm_aiter_ops.triton_fp8_bmm`` (AITER's batched GEMM
    ``batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant``, which the CPU
    has not), written here from AITER's kernel semantics, not from the overlay: X [B, M, K] quantised
    per row and group of ``group_size`` lanes to the weight's fp8 (scale = max(max|x|, 1e-10) times
    fp32(1 / fp8 max), codes = fp8(clamp(x * (1 / scale)))), times WQ [B, N, K] transposed, each
    group's product times its scale, summed, times ``w_scale``; out (M, B, N) with ``transpose_bm``.
    vLLM's weight loading pre-compiles with empty inputs for M = 1..1024: no layer here decodes more
    than 64 tokens, so larger M get an empty output of the right shape."""
    batches, rows, k = x.shape
    fmax = torch.finfo(wq.dtype).max
    if rows > 64:
        out = x.new_empty((rows, batches, wq.shape[1]) if transpose_bm else (batches, rows, wq.shape[1]), dtype=dtype)
        return out
    groups = x.float().reshape(batches, rows, k // group_size, group_size)
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-10) * torch.tensor(1 / fmax, dtype=torch.float32)
    codes = (groups * (1.0 / scale)).clamp(-fmax, fmax).to(wq.dtype).float()
    weight = wq.float().reshape(batches, wq.shape[1], k // group_size, group_size)
    y = sum(codes[:, :, g] @ weight[:, :, g].transpose(1, 2) * scale[:, :, g] for g in range(k // group_size))
    y = (y * w_scale.float().reshape(())).to(dtype)
    y = y.transpose(0, 1) if transpose_bm else y
    if YQ is not None:
        YQ.copy_(y.reshape(YQ.shape))
        return YQ
    return y


def fp8_bmm_on(monkeypatch) -> None:
    """vLLM's fp8 W_UK absorption on, AITER's fp8 batched GEMM stood in (behind vLLM's signature)."""
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.setattr(rocm_aiter_ops, "is_fp8bmm_enabled", classmethod(lambda cls: True))
    monkeypatch.setattr(rocm_aiter_ops, "triton_fp8_bmm",
                        staticmethod(with_real_signature(rocm_aiter_ops.triton_fp8_bmm, aiter_fp8_bmm)))


def fp4_bmm_on(monkeypatch) -> None:
    """vLLM's MXFP4 W_UK absorption on: AITER's MXFP4 GEMM and quant stood in (behind vLLM's
    signatures), and AITER's GEMM module importable for the code that imports it directly."""
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.layers.quantization.quark import utils as quark_utils

    monkeypatch.setattr(rocm_aiter_ops, "is_fp4bmm_enabled", classmethod(lambda cls: True))
    monkeypatch.setattr(rocm_aiter_ops, "batched_gemm_a16wfp4",
                        staticmethod(with_real_signature(rocm_aiter_ops.batched_gemm_a16wfp4, vllm_fp4_bmm)))
    monkeypatch.setattr(quark_utils, "quark_quantize_weight_to_mxfp4",
                        with_real_signature(quark_utils.quark_quantize_weight_to_mxfp4, quark_mxfp4))
    mxfp4_standin.install_gemm_module(monkeypatch)


@pytest.mark.parametrize("fusion", ["absorb_qk_cache", "qk_cache"])  # qk_cache: vLLM's GEMM, then one launch
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_fp8_bmm_layer_absorbed_decode_matches_stock(fusion, provider, tmp_path, layer_pair, monkeypatch):
    """vLLM's fp8 W_UK absorption (VLLM_ROCM_USE_AITER_FP8BMM): the real layer quantises its own
    W_K / W_V at load; stock decodes through ``triton_fp8_bmm`` (stood in above), the overlay folds it
    into its one launch from the same W_K / W_K_scale: same output bytes and cache bytes."""
    fp8_bmm_on(monkeypatch)
    spec = harness.LayerSpec(kv_cache_dtype="fp8", **K3_LAYER)
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": fusion, f"K3_AMD_OVERLAY_{fusion.upper()}_PROVIDER": provider})
    assert fused.attn.is_aiter_triton_fp8_bmm_enabled and fused.attn.W_K.dtype == harness.fp8_format().dtype
    batch = harness.decode_batch([stock, fused], [5, 17, 30], padding=1)
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    n = batch.num_tokens
    entry = activation.evidence.fusion(fusion)
    assert (entry.state, entry.provider, entry.effective) == ("applied", provider, True), entry
    assert ("fp8 W_UK" in entry.reason) is (fusion == "absorb_qk_cache")
    assert (fused.kv_writes, fused.concat_quant_calls, fused.mqa_calls) == ([], 0, 1)
    assert torch.equal(out_fused[:n], out_stock[:n])
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)



def vllm_fp4_bmm(X, W, w_scale, Y=None, transpose_bm=False, prequant=False, y_scale=None):
    """Stands in for vLLM's ``rocm_aiter_ops.batched_gemm_a16wfp4`` (vLLM's signature; AITER's MXFP4
    GEMM, which the CPU has not), through ``tests/mxfp4_standin.py`` (AITER's bit procedure)."""
    return mxfp4_standin.batched_gemm_a16wfp4(X, W, w_scale, y=Y, transpose_bm=transpose_bm, prequant=prequant,
                                              y_scale=y_scale)


def quark_mxfp4(w):
    """Stands in for vLLM's ``quark_quantize_weight_to_mxfp4`` (which calls AITER's
    ``dynamic_mxfp4_quant``): the same reshape around the stand-in's quant."""
    *dims, d = w.shape
    packed, scales = mxfp4_standin.dynamic_mxfp4_quant(w.reshape(-1, d))
    return packed.view(*dims, d // 2), scales.view(*dims, d // mxfp4_standin.GROUP)


@pytest.mark.parametrize("fusion", ["absorb_qk_cache", "qk_cache"])  # qk_cache: vLLM's GEMM, then one launch
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_fp4_bmm_layer_absorbed_decode_matches_stock(fusion, provider, tmp_path, layer_pair, monkeypatch):
    """vLLM's MXFP4 W_UK absorption (VLLM_ROCM_USE_AITER_FP4BMM): the real layer quantises its own
    W_K / W_V at load (their transposed views kept); stock decodes through ``batched_gemm_a16wfp4``
    with ``y_scale = q_scale`` (stood in above), the overlay folds it into its one launch from the
    same W_K / W_K_scale: same output bytes and cache bytes (at the harness's q_scale, 1.37)."""
    fp4_bmm_on(monkeypatch)
    spec = harness.LayerSpec(kv_cache_dtype="fp8", **K3_LAYER)
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": fusion, f"K3_AMD_OVERLAY_{fusion.upper()}_PROVIDER": provider})
    assert fused.attn.is_aiter_triton_fp4_bmm_enabled and fused.attn.W_K.dtype == torch.uint8
    assert not fused.attn.W_K.is_contiguous()  # vLLM's [N, L, P/2] view of the [L, N, P/2] quant
    batch = harness.decode_batch([stock, fused], [5, 17, 30], padding=1)
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    n = batch.num_tokens
    entry = activation.evidence.fusion(fusion)
    assert (entry.state, entry.provider, entry.effective) == ("applied", provider, True), entry
    assert ("fp4 W_UK" in entry.reason) is (fusion == "absorb_qk_cache")
    assert (fused.kv_writes, fused.concat_quant_calls, fused.mqa_calls) == ([], 0, 1)
    assert torch.equal(out_fused[:n], out_stock[:n])
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)


@pytest.mark.parametrize("plant", ["fp8", "fp4"])
def test_the_bmm_layer_parity_catches_a_planted_scale_fault(plant, tmp_path, layer_pair, monkeypatch):
    """The two tests above, once each with a fault planted in the fused layer after load (so their
    equality could fail): its fp8 W_K_scale 1% high; one of its MXFP4 W_K_scale exponents one step
    high (that group's weights doubled)."""
    (fp8_bmm_on if plant == "fp8" else fp4_bmm_on)(monkeypatch)
    spec = harness.LayerSpec(kv_cache_dtype="fp8", **K3_LAYER)
    stock, fused, _ = layer_pair(spec, {"K3_AMD_OVERLAY": "absorb_qk_cache",
                                        "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER": "reference"})
    scale = fused.attn.W_K_scale
    with torch.no_grad():
        if plant == "fp8":
            scale.mul_(1.01)
        else:
            scale[(0,) * scale.dim()] += 1
    batch = harness.decode_batch([stock, fused], [5, 17, 30], padding=1)
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    n = batch.num_tokens
    assert not torch.equal(out_fused[:n], out_stock[:n])
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)  # the fault is in the query, not the KV write


def test_large_decode_batches_take_the_qk_cache_path(tmp_path, layer_pair):
    """Above ABSORB_MAX_TOKENS the absorbed launch is not the faster one: the same layer runs the
    stock absorption and the qk_cache launch instead, bit-identical to stock."""
    from k3_amd_overlay.package import ABSORB_MAX_TOKENS

    spec = harness.LayerSpec(kv_cache_dtype="fp8", num_blocks=2 * (ABSORB_MAX_TOKENS + 2))
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": "qk_cache,absorb_qk_cache", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "reference",
               "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER": "reference"})
    batch = harness.decode_batch([stock, fused], [2] * (ABSORB_MAX_TOKENS + 1))
    out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    assert torch.equal(out_fused[: batch.num_tokens], out_stock[: batch.num_tokens])
    assert activation.evidence.fusion("qk_cache").effective is True
    assert activation.evidence.fusion("absorb_qk_cache").effective is False


def test_named_absorb_provider_overrides_vllms_own_decode(tmp_path, monkeypatch, aiter_standin):
    """Where vLLM owns the decode (0.32+, AITER MLA on, 4 heads) auto mode defers the absorbed
    path; naming its provider overrides, and the absorbed path is the one that runs."""
    skip_where_vllm_cannot_build_a_fused_decode_layer()
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.setattr(rocm_aiter_ops, "is_mla_enabled", classmethod(lambda cls: True))
    standin = aiter_standin(fmt=harness.fp8_format())
    spec = harness.LayerSpec(num_heads=4, kv_cache_dtype="fp8", **K3_LAYER)
    for provider, absorb_state, aiter_calls in (("auto", "disabled", 1), ("reference", "applied", 0)):
        with overlay(tmp_path / provider, K3_AMD_OVERLAY="qk_cache,absorb_qk_cache",
                     K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER=provider) as activation:
            layer = harness.build_layer(spec, next_layer_index(), seed=5)
            standin.calls.clear()
            harness.run(layer, harness.decode_batch([layer], [5, 40]))
            entry = activation.evidence.fusion("absorb_qk_cache")
            assert (entry.state, entry.effective) == (absorb_state, absorb_state == "applied")
            assert activation.evidence.fusion("qk_cache").state == "upstream"
            assert len(standin.calls) == aiter_calls and layer.kv_writes == []


def test_absorb_alone_leaves_vllms_own_fused_decode_what_it_does_not_take(tmp_path, monkeypatch, aiter_standin):
    """K3_AMD_OVERLAY=absorb_qk_cache on a layer vLLM fuses itself (0.32+, AITER MLA on, 4 heads):
    batches the absorbed launch takes (<= ABSORB_MAX_TOKENS) are the overlay's; a larger decode
    batch runs vLLM's own fused decode, as without the overlay, never the stock attention call."""
    skip_where_vllm_cannot_build_a_fused_decode_layer()
    from vllm._aiter_ops import rocm_aiter_ops

    from k3_amd_overlay.package import ABSORB_MAX_TOKENS

    monkeypatch.setattr(rocm_aiter_ops, "is_mla_enabled", classmethod(lambda cls: True))
    standin = aiter_standin(fmt=harness.fp8_format())
    spec = harness.LayerSpec(num_heads=4, kv_cache_dtype="fp8",
                             **{**K3_LAYER, "num_blocks": 2 * (ABSORB_MAX_TOKENS + 2)})
    with overlay(tmp_path, K3_AMD_OVERLAY="absorb_qk_cache",
                 K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER="reference") as activation:
        layer = harness.build_layer(spec, next_layer_index(), seed=5)
        assert layer.wrapper._fused_qk_prep is True
        standin.calls.clear()
        harness.run(layer, harness.decode_batch([layer], [2] * (ABSORB_MAX_TOKENS + 1)))
        assert len(standin.calls) == 1 and layer.kv_writes == []  # vLLM's own fused decode
        assert activation.evidence.fusion("absorb_qk_cache").effective is False
        harness.run(layer, harness.decode_batch([layer], [5, 40]))
        assert len(standin.calls) == 1 and layer.kv_writes == []  # the absorbed launch
        assert activation.evidence.fusion("absorb_qk_cache").effective is True
        assert activation.evidence.fusion("qk_cache").state == "disabled"
        assert activation.evidence.fusion("qk_cache").effective is False


def test_aiter_providers_follow_vllms_aiter_switch(tmp_path, monkeypatch, aiter_standin):
    """vLLM registers its AITER ops whenever AITER is installed; with VLLM_ROCM_USE_AITER off the
    overlay's aiter providers (qk_cache's and qkv_norm's, through the same gate) are unavailable,
    and say why."""
    from vllm._aiter_ops import rocm_aiter_ops

    from k3_amd_overlay.targets.vllm_env import with_vllm_aiter_switch

    aiter_standin(fmt=harness.fp8_format())
    spec = harness.LayerSpec(kv_cache_dtype="fp8", gate=False)
    for enabled, state in ((False, "refused"), (True, "applied")):
        monkeypatch.setattr(rocm_aiter_ops, "is_enabled", classmethod(lambda cls, on=enabled: on))
        with overlay(tmp_path / str(enabled), K3_AMD_OVERLAY="qk_cache",
                     K3_AMD_OVERLAY_QK_CACHE_PROVIDER="aiter") as activation:
            harness.build_layer(spec, next_layer_index())
            entry = activation.evidence.fusion("qk_cache")
            assert entry.state == state, entry
            assert ("vLLM has AITER switched off" in entry.reason) is not enabled, entry
        norm = with_vllm_aiter_switch({"aiter": None, "triton": None})
        assert norm == {"aiter": None if enabled else vllm_env.AITER_SWITCHED_OFF, "triton": None}


def test_known_vllm_defects_are_recognised_in_the_releases_that_have_them():
    from k3_amd_overlay.versions import installed_vllm_version

    version = installed_vllm_version()
    expected = (["vllm-k3-fused-qk-prep-reads-W_UK_T-before-load"] if version.startswith("0.32") else []) + (
        ["vllm-k3-fused-decode-passes-real-positions"] if version.startswith(("0.32", "0.33")) else [])
    assert vllm_defects() == expected


@pytest.mark.parametrize("switch", [None, "1", "stock", "qkv_norm"])
def test_vllm_032_defect_is_named_not_worsened(switch, tmp_path, monkeypatch, aiter_dual_norm_standin):
    """vLLM 0.32 with AITER MLA on and the fp8 BMM off cannot build a 4-head K3 layer: it reads
    W_UK_T before the weights exist. The overlay leaves that failure exactly as it is (same
    exception, in every mode), names the defect on it, and records it in the marker."""
    if "vllm-k3-fused-qk-prep-reads-W_UK_T-before-load" not in vllm_defects():
        pytest.skip("this vLLM does not have the defect")
    from vllm._aiter_ops import rocm_aiter_ops

    aiter_on(monkeypatch, mla=True)
    monkeypatch.setattr(rocm_aiter_ops, "is_fp8bmm_enabled", classmethod(lambda cls: False))
    monkeypatch.setattr(rocm_aiter_ops, "is_fp4bmm_enabled", classmethod(lambda cls: False))
    for name, value in (("VLLM_ROCM_USE_AITER", "1"), ("VLLM_ROCM_USE_AITER_FP8BMM", "0"),
                        ("VLLM_ROCM_USE_AITER_FP4BMM", "0")):
        monkeypatch.setenv(name, value)
    spec = harness.LayerSpec(num_heads=4, kv_cache_dtype="fp8", **K3_LAYER)
    if switch is None:
        with pytest.raises(AttributeError, match="W_UK_T"):
            harness.build_layer(spec, next_layer_index())
        return
    with overlay(tmp_path, K3_AMD_OVERLAY=switch) as activation:
        with pytest.raises(AttributeError, match="W_UK_T") as failure:
            harness.build_layer(spec, next_layer_index())
        defects = activation.evidence.record.upstream_defects
    decode_patched = switch != "qkv_norm"  # qkv_norm alone leaves vLLM's decode check unwrapped
    # before any layer the environment says "may fire"; the wrapped check records that it did
    assert [(d["name"], d["triggered"]) for d in defects] == [("vllm-k3-fused-qk-prep-reads-W_UK_T-before-load",
                                                               True if decode_patched else None),
                                                              ("vllm-k3-fused-decode-passes-real-positions", None)]
    assert any("a known vLLM defect" in note for note in getattr(failure.value, "__notes__", [])) is decode_patched


# --- torch.compile: vLLM's STOCK_TORCH_COMPILE mode traces the whole model with fullgraph=True ----

def test_whole_model_compilation_runs_exactly_vllms_code(tmp_path, monkeypatch, layer_pair):
    """vLLM's STOCK_TORCH_COMPILE mode compiles the whole model with fullgraph=True. Dynamo does not
    trace into wrapt's wrappers (it calls the wrapped vLLM method itself), so the decision is made
    when the layer is built: every fusion is refused with the reason, vLLM's own fused-decode
    check keeps vLLM's answer, and the compiled layer traces without a graph break and computes
    exactly what the stock layer does; no fused path runs or is recorded."""
    from vllm.config.compilation import CompilationMode

    monkeypatch.setattr(harness.vllm_config().compilation_config, "mode", CompilationMode.STOCK_TORCH_COMPILE)
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    stock, fused, activation = layer_pair(
        spec, {"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_QKV_NORM_PROVIDER": "reference",
               "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "reference", "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER": "reference"})
    try:
        for fusion in ("qkv_norm", "qk_cache", "absorb_qk_cache"):
            entry = activation.evidence.fusion(fusion)
            assert entry.state == "refused" and "STOCK_TORCH_COMPILE" in entry.reason, (fusion, entry)
        if hasattr(fused.wrapper, "_fused_qk_prep"):
            assert fused.wrapper._fused_qk_prep is stock.wrapper._fused_qk_prep
        torch._dynamo.reset()
        for layer in (stock, fused):
            layer.module.forward = torch.compile(layer.module.forward, fullgraph=True, backend="eager")
        batch = harness.decode_batch([stock, fused], SEQ_LENS, padding=2)
        out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
        n = batch.num_tokens
        assert torch.equal(out_fused[:n], out_stock[:n])
        assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)
        for fusion in ("qkv_norm", "qk_cache", "absorb_qk_cache"):
            assert activation.evidence.fusion(fusion).effective is False, fusion
    finally:
        torch._dynamo.reset()


def test_a_layer_on_the_aiter_provider_builds_its_tables_when_built(tmp_path, monkeypatch, aiter_standin):
    from k3_amd_overlay.ops import aiter_qk_cache

    monkeypatch.setattr(vllm_env, "vllm_aiter_missing", lambda: None)
    monkeypatch.setattr(aiter_qk_cache, "_identity_tables", {})
    aiter_standin(fmt=harness.fp8_format())
    spec = harness.LayerSpec(kv_cache_dtype="fp8")
    with overlay(tmp_path, K3_AMD_OVERLAY="qk_cache", K3_AMD_OVERLAY_QK_CACHE_PROVIDER="aiter"):
        harness.build_layer(spec, next_layer_index())
        assert list(aiter_qk_cache._identity_tables) == [(torch.device("cpu"), spec.dtype, spec.rope)]


@pytest.mark.parametrize("heads", [1, 3, 4, 12, 16])
def test_query_heads_follow_the_aiter_backends_own_padding(heads):
    """The padded head count comes from vLLM's own AiterMLAHelper, and is used only where that
    vLLM's backend takes a padded view without copying (0.33: head counts that do not divide 16)."""
    from types import SimpleNamespace

    from k3_amd_overlay.versions import installed_vllm_version

    aiter_impl = type("AiterMLAImpl", (), {"__module__": vllm_env.AITER_MLA_MODULE})()
    other_impl = type("CPUMLAImpl", (), {"__module__": "vllm.v1.attention.backends.mla.cpu_mla"})()
    zero_copy = installed_vllm_version().startswith("0.33") and 16 % heads != 0
    assert vllm_env.padded_query_heads(SimpleNamespace(impl=aiter_impl), heads) == (16 if zero_copy else heads)
    assert vllm_env.padded_query_heads(SimpleNamespace(impl=other_impl), heads) == heads


def test_the_aiter_mla_module_is_where_this_vllm_defines_its_backend():
    import ast
    import importlib.util

    spec = importlib.util.find_spec(vllm_env.AITER_MLA_MODULE)
    tree = ast.parse(Path(spec.origin).read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert {"AiterMLAImpl", "AiterMLAHelper"} <= classes


def test_the_aiter_padding_is_asked_once_per_head_count(monkeypatch):
    import importlib
    import sys
    from types import SimpleNamespace

    real = importlib.import_module(vllm_env.AITER_MLA_MODULE).AiterMLAHelper  # imports on CPU in 0.29-0.33
    asked = []

    def get_actual_mla_num_heads(heads):
        asked.append(heads)
        return 16

    helper = SimpleNamespace(
        get_actual_mla_num_heads=with_real_signature(real.get_actual_mla_num_heads, get_actual_mla_num_heads),
        get_mla_padded_q=with_real_signature(real.get_mla_padded_q, lambda num_heads, q, target_heads: q))
    monkeypatch.setitem(sys.modules, vllm_env.AITER_MLA_MODULE, SimpleNamespace(AiterMLAHelper=helper))
    vllm_env._aiter_zero_copy_heads.cache_clear()
    try:
        assert [vllm_env._aiter_zero_copy_heads(h) for h in (12, 12, 3, 12)] == [16, 16, 16, 16]
        assert asked == [12, 3]
    finally:
        vllm_env._aiter_zero_copy_heads.cache_clear()


def test_without_a_vllm_config_in_context_each_answer_falls_back(monkeypatch):
    """Outside a vLLM config (the ops' own tests, ``doctor``): no batch-size hint (the buffers grow
    on demand), nothing compiled whole, no coverage to record."""
    from types import SimpleNamespace

    import vllm.config
    from vllm.config.compilation import CompilationMode

    def no_config():
        raise RuntimeError("no vLLM config in context")

    real = vllm.config.get_current_vllm_config
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", with_real_signature(real, no_config))
    assert (vllm_env.max_batched_tokens(), vllm_env.whole_model_compiled(), vllm_env.model_coverage()) == (0, False, {})
    for mode, whole in ((CompilationMode.STOCK_TORCH_COMPILE, True), (CompilationMode.NONE, False)):
        config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
                                 compilation_config=SimpleNamespace(mode=mode))
        monkeypatch.setattr(vllm.config, "get_current_vllm_config", with_real_signature(real, lambda c=config: c))
        assert (vllm_env.max_batched_tokens(), vllm_env.whole_model_compiled()) == (8192, whole)


def test_the_aiter_switch_refusal_word_for_word():
    assert vllm_env.AITER_SWITCHED_OFF == (
        "vLLM has AITER switched off (rocm_aiter_ops.is_enabled() is False: VLLM_ROCM_USE_AITER is unset or 0, "
        "or this is not a supported ROCm GPU)")


@pytest.mark.parametrize("method,gaps", [(None, 0), ("mtp", 0), ("dspark", 1)])
def test_coverage_names_the_model_and_what_is_not_covered(method, gaps, monkeypatch):
    from types import SimpleNamespace

    import vllm.config

    hf_config = SimpleNamespace(architectures=["KimiLinearForCausalLM"])
    model_config = SimpleNamespace(hf_config=hf_config, architecture="KimiK3ForConditionalGeneration")
    config = SimpleNamespace(model_config=model_config, speculative_config=method and SimpleNamespace(method=method))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config",
                        with_real_signature(vllm.config.get_current_vllm_config, lambda: config))
    coverage = vllm_env.model_coverage()
    assert coverage["architecture"] == "KimiK3ForConditionalGeneration" and coverage["speculative_method"] == method
    assert coverage["text_model"] == ["KimiLinearForCausalLM"]
    assert coverage["not_covered"] == [vllm_env.DSPARK_NOT_COVERED] * gaps
    assert vllm_env.DSPARK_NOT_COVERED == (
        "the DSpark drafter (speculative method 'dspark', K3DSparkModel) builds vLLM's NVIDIA MLA, not the K3 "
        "AMD layers the overlay patches: its decode runs stock")
    # a ModelConfig without ``architecture``: the first of the checkpoint's architectures is served
    config.model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["KimiLinearForCausalLM", "X"]))
    assert vllm_env.model_coverage()["architecture"] == "KimiLinearForCausalLM"


def test_the_kv_connector_hooks_are_made_once_per_process():
    assert vllm_env.kv_transfer_hooks() is vllm_env.kv_transfer_hooks()


def test_a_batch_the_overlay_leaves_on_a_layer_vllm_does_not_fuse_runs_the_stock_call(tmp_path, monkeypatch,
                                                                                     aiter_dual_norm_standin):
    """0.32+: at 3 heads per rank vLLM does not fuse the decode; absorb_qk_cache alone turns vLLM's
    fused-decode branch on, and a decode batch over its token limit is then neither the overlay's
    nor vLLM's: the stock attention call runs it (KV write and all), exactly as stock."""
    if shape_name() != "k3_decode_wrapper":
        pytest.skip("this vLLM has no fused decode of its own (< 0.32)")
    from k3_amd_overlay.package import ABSORB_MAX_TOKENS

    aiter_on(monkeypatch, mla=True)
    blocks = 2 * (ABSORB_MAX_TOKENS + 2)
    spec = harness.LayerSpec(num_heads=3, kv_cache_dtype="fp8", **{**K3_LAYER, "num_blocks": blocks})
    stock = harness.build_layer(spec, next_layer_index(), seed=5)
    with overlay(tmp_path, K3_AMD_OVERLAY="absorb_qk_cache", K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER="reference"):
        fused = harness.build_layer(spec, next_layer_index(), seed=5)
        assert fused.wrapper._fused_qk_prep is True and stock.wrapper._fused_qk_prep is False
        batch = harness.decode_batch([stock, fused], [2] * (ABSORB_MAX_TOKENS + 1))
        out_stock, out_fused = harness.run(stock, batch), harness.run(fused, batch)
    n = batch.num_tokens
    assert fused.kv_writes == [n] and torch.equal(out_fused[:n], out_stock[:n])
    assert torch.equal(fused.attn.kv_cache, stock.attn.kv_cache)
