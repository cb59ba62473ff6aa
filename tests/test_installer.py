"""The per-layer installer read against plain stand-ins of a K3 layer (no vLLM): which attribute
becomes which predicate input, with vLLM's defaults where an attribute is absent, which site goes
where, what the evidence is told. The real layers of every vLLM are in tests/test_vllm_layer.py."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant, QkCacheInputs, Rotation
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.ops import absorb_qk_cache, aiter_qk_cache, qk_cache, rmsnorm_pair
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import load_settings
from k3_amd_overlay.targets import attend_hook, installer, vllm_env
from k3_amd_overlay.targets.decode import DECODE_SITE
from k3_amd_overlay.targets.norm import QKV_NORM_SITE

NS = types.SimpleNamespace


@pytest.mark.parametrize(("rotary", "kind"), [
    (None, Rotation.NONE), (NS(is_identity=True), Rotation.IDENTITY), (NS(is_identity=1), Rotation.REAL),
    (NS(is_identity=False), Rotation.REAL), (NS(), Rotation.REAL),
])
def test_rotation_kind(rotary, kind):
    assert installer.rotation_kind(rotary) is kind


@pytest.mark.parametrize(("flags", "variant"), [
    ({}, AbsorbVariant.BF16),
    ({"is_aiter_triton_fp8_bmm_enabled": True}, AbsorbVariant.FP8),
    ({"is_aiter_triton_fp4_bmm_enabled": True}, AbsorbVariant.FP4),
    ({"is_aiter_triton_fp4_bmm_enabled": True, "is_aiter_triton_fp8_bmm_enabled": True}, AbsorbVariant.FP4),
    ({"is_amx_bmm_enabled": True}, AbsorbVariant.AMX),
    ({"is_amx_bmm_enabled": True, "is_aiter_triton_fp8_bmm_enabled": True}, AbsorbVariant.FP8),
    ({"is_aiter_triton_fp4_bmm_enabled": False, "is_aiter_triton_fp8_bmm_enabled": False,
      "is_amx_bmm_enabled": False}, AbsorbVariant.BF16),
])
def test_absorb_variant_follows_the_stock_paths_precedence(flags, variant):
    assert installer.absorb_variant(NS(**flags)) is variant


def _norm(eps):
    return NS(weight=torch.ones(4), variance_epsilon=eps)


def _layer(**attn_overrides):
    impl = NS(dcp_world_size=1, supports_quant_query_input=True)
    attn = NS(impl=impl, kv_cache_dtype="fp8", layer_name="model.layers.3.self_attn.attn", qk_nope_head_dim=128,
              kv_lora_rank=512, qk_rope_head_dim=64)
    for name, value in attn_overrides.items():
        setattr(impl if name in ("dcp_world_size", "supports_quant_query_input") else attn, name, value)
    return NS(mla_attn=attn, rotary_emb=NS(is_identity=True), num_heads=8, q_a_layernorm=_norm(1e-6),
              kv_a_layernorm=_norm(1e-5))


@pytest.fixture
def here(monkeypatch):
    """What the provider and vLLM checks say, fixed: every provider can run, AITER follows vLLM."""
    seen: dict[str, tuple] = {}

    def missing(name):
        def check(*args, **kwargs):
            seen[name] = (args, kwargs)
            return {"triton": None, "aiter": None, "reference": None}
        return check

    monkeypatch.setattr(qk_cache, "provider_missing", missing("qk_cache"))
    monkeypatch.setattr(absorb_qk_cache, "provider_missing", missing("absorb"))
    monkeypatch.setattr(rmsnorm_pair, "provider_missing", missing("norm"))
    monkeypatch.setattr(vllm_env, "with_vllm_aiter_switch", lambda m: {**m, "aiter": "vLLM has AITER off"})
    monkeypatch.setattr(vllm_env, "whole_model_compiled", lambda: False)
    monkeypatch.setattr(vllm_env, "model_coverage", lambda: {"architecture": "K3"})
    monkeypatch.setattr(vllm_env, "kv_transfer_hooks", lambda: "hooks")
    monkeypatch.setattr(vllm_env, "vllm_fp8_format", lambda: "fmt")
    monkeypatch.setattr(vllm_env, "padded_query_heads", lambda attn, heads: heads + 8)
    return seen


def _installer(tmp_path, switch="1", **providers):
    env = {"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path)}
    env.update({f"K3_AMD_OVERLAY_{f.upper()}_PROVIDER": p for f, p in providers.items()})
    settings = load_settings(env)
    return installer.LayerInstaller(settings, Evidence(settings))


def test_each_layer_attribute_becomes_its_predicate_input(tmp_path, here):
    layer = _layer()
    inputs = _installer(tmp_path).qk_cache_inputs(layer, upstream_fuses=True)
    assert inputs == QkCacheInputs(
        stock_mode=False, provider_setting="auto",
        provider_missing={"triton": None, "aiter": "vLLM has AITER off", "reference": None},
        kv_cache_dtype="fp8", rotation=Rotation.IDENTITY, dcp_world_size=1, pcp=False, hisparse=False,
        q_pad_num_heads=None, num_heads=8, absorb=AbsorbVariant.BF16, quant_query_input=True,
        upstream_fuses=True, traced_whole=False, activation_dtype="float32")  # the layer's norm weight dtype
    assert here["qk_cache"] == ((torch.device("cpu"),), {})
    layer.kv_a_layernorm.weight = torch.ones(4, dtype=torch.float16)
    assert _installer(tmp_path).qk_cache_inputs(layer, upstream_fuses=True).activation_dtype == "float16"
    odd = _layer(dcp_world_size=4, use_pcp=1, hisparse_cache=object(), q_pad_num_heads=16,
                 supports_quant_query_input=0, is_aiter_triton_fp8_bmm_enabled=True, kv_cache_dtype="auto")
    odd.num_heads, odd.rotary_emb = "4", None
    inputs = _installer(tmp_path, qk_cache="reference").qk_cache_inputs(odd, upstream_fuses=False)
    assert (inputs.dcp_world_size, inputs.pcp, inputs.hisparse, inputs.q_pad_num_heads, inputs.num_heads) == (
        4, True, True, 16, 4)
    assert (inputs.kv_cache_dtype, inputs.rotation, inputs.absorb, inputs.quant_query_input) == (
        "auto", Rotation.NONE, AbsorbVariant.FP8, False)
    assert (inputs.provider_setting, inputs.upstream_fuses) == ("reference", False)
    odd.mla_attn.impl.dcp_world_size = None  # vLLM leaves it unset without DCP
    assert _installer(tmp_path).qk_cache_inputs(odd, upstream_fuses=False).dcp_world_size == 1
    del odd.mla_attn.impl.dcp_world_size, odd.mla_attn.impl.supports_quant_query_input
    bare = _installer(tmp_path).qk_cache_inputs(odd, upstream_fuses=False)
    assert bare.dcp_world_size == 1 and bare.quant_query_input is False


def test_stock_mode_asks_no_provider(tmp_path, here):
    inputs = _installer(tmp_path, switch="stock").qk_cache_inputs(_layer(), upstream_fuses=True)
    assert inputs.stock_mode and inputs.provider_missing == {} and here == {}


def test_whole_model_compilation_reaches_both_decisions(tmp_path, here, monkeypatch):
    monkeypatch.setattr(vllm_env, "whole_model_compiled", lambda: True)
    layer = _layer()
    assert _installer(tmp_path).qk_cache_inputs(layer, upstream_fuses=False).traced_whole
    site = _installer(tmp_path).install_qkv_norm(layer, upstream_fuses=False)
    assert site.decision.state is FusionState.REFUSED and site.q_kv_norm is None


def test_the_norm_site_is_built_from_the_layers_norms(tmp_path, here):
    layer = _layer()
    inst = _installer(tmp_path, qkv_norm="reference")
    site = inst.install_qkv_norm(layer, upstream_fuses=False)
    assert layer.__dict__[QKV_NORM_SITE] is site
    assert (site.decision.state, site.decision.provider) == (FusionState.APPLIED, "reference")
    assert site.q_kv_norm.provider == "reference"
    assert site.q_kv_norm.q_norm is layer.q_a_layernorm and site.q_kv_norm.kv_norm is layer.kv_a_layernorm
    assert here["norm"] == ((torch.device("cpu"), 1e-6, 1e-5), {})
    assert inst.evidence.fusion(QKV_NORM).layers == 1
    assert inst.evidence.record.coverage == {"architecture": "K3"}
    site.on_effective(5)
    assert inst.evidence.fusion(QKV_NORM).effective


def test_a_layer_without_q_norm_or_in_stock_mode_gets_no_callback(tmp_path, here):
    layer = _layer()
    layer.q_a_layernorm = None
    site = _installer(tmp_path).install_qkv_norm(layer, upstream_fuses=False)
    assert site.decision.state is not FusionState.APPLIED and site.q_kv_norm is None and here == {}
    stock = _installer(tmp_path, switch="stock").install_qkv_norm(_layer(), upstream_fuses=True)
    assert stock.decision.state is FusionState.FORCED_STOCK and stock.q_kv_norm is None and here == {}
    upstream = _installer(tmp_path).install_qkv_norm(_layer(), upstream_fuses=True)
    assert upstream.decision.state is FusionState.UPSTREAM and upstream.q_kv_norm is None


def test_coverage_is_recorded_once_per_process(tmp_path, here, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_env, "model_coverage", lambda: calls.append(1) or {})
    inst = _installer(tmp_path)
    inst.install_qkv_norm(_layer(), upstream_fuses=False)
    inst.install_qk_cache(_layer(), upstream_fuses=False)
    assert calls == [1] and inst.coverage_recorded


def test_the_decode_site_carries_the_layers_plan_and_hooks(tmp_path, here):
    layer = _layer()
    inst = _installer(tmp_path, switch="qk_cache,absorb_qk_cache", qk_cache="reference",
                      absorb_qk_cache="reference")
    site = inst.install_qk_cache(layer, upstream_fuses=False)
    assert layer.__dict__[DECODE_SITE] is site
    assert (site.plan.decision.state, site.plan.decision.provider) == (FusionState.APPLIED, "reference")
    assert (site.plan.absorb_decision.state, site.plan.absorb_decision.provider) == (FusionState.APPLIED, "reference")
    assert site.plan.absorb is AbsorbVariant.BF16 and not site.plan.upstream_fuses
    assert (site.kv_transfer, site.query_heads, site.fmt) == ("hooks", 16, "fmt")
    assert site.context is vllm_env.get_attention_context
    assert here["absorb"] == ((torch.device("cpu"), 128, 512, 64), {"fp8_weights": False, "mxfp4_weights": False})
    assert inst.evidence.fusion(QK_CACHE).layers == 1 and inst.evidence.fusion(ABSORB_QK_CACHE).layers == 1
    site.on_effective(3)
    site.on_absorb_effective(3)
    assert inst.evidence.fusion(QK_CACHE).effective and inst.evidence.fusion(ABSORB_QK_CACHE).effective


@pytest.mark.parametrize(("flag", "fp8", "fp4"), [
    ("is_aiter_triton_fp8_bmm_enabled", True, False), ("is_aiter_triton_fp4_bmm_enabled", False, True)])
def test_the_absorb_providers_are_asked_for_the_layers_weight_format(tmp_path, here, flag, fp8, fp4):
    site = _installer(tmp_path, switch="absorb_qk_cache").install_qk_cache(_layer(**{flag: True}),
                                                                           upstream_fuses=False)
    assert here["absorb"][1] == {"fp8_weights": fp8, "mxfp4_weights": fp4}
    assert site.plan.absorb is (AbsorbVariant.FP8 if fp8 else AbsorbVariant.FP4)


def test_a_fusion_not_requested_is_not_decided_nor_noted(tmp_path, here):
    inst = _installer(tmp_path, switch="absorb_qk_cache")
    site = inst.install_qk_cache(_layer(), upstream_fuses=False)
    assert site.plan.decision == installer.NOT_REQUESTED
    assert installer.NOT_REQUESTED.state is FusionState.DISABLED and installer.NOT_REQUESTED.reason == "not requested"
    assert inst.evidence.fusion(QK_CACHE).layers == 0 and inst.evidence.fusion(ABSORB_QK_CACHE).layers == 1
    here.clear()
    inst = _installer(tmp_path, switch="qk_cache")
    site = inst.install_qk_cache(_layer(), upstream_fuses=False)
    assert site.plan.absorb_decision == installer.NOT_REQUESTED and "absorb" not in here
    assert inst.evidence.fusion(ABSORB_QK_CACHE).layers == 0


def test_a_layer_the_overlay_does_not_fuse_gets_no_fp8_format(tmp_path, here):
    site = _installer(tmp_path, switch="stock").install_qk_cache(_layer(), upstream_fuses=True)
    assert not site.plan.overlay_fuses and site.fmt is None and site.context is None


def test_the_aiter_provider_has_its_tables_built_at_install(tmp_path, here, monkeypatch):
    built = []
    monkeypatch.setattr(vllm_env, "with_vllm_aiter_switch", lambda m: m)
    monkeypatch.setattr(vllm_env, "max_batched_tokens", lambda: 8192)
    monkeypatch.setattr(aiter_qk_cache, "reserve_zero_positions", lambda *a: built.append(("positions", *a)))
    monkeypatch.setattr(aiter_qk_cache, "reserve_identity_table", lambda *a: built.append(("identity", *a)))
    _installer(tmp_path, switch="qk_cache", qk_cache="triton").install_qk_cache(_layer(), upstream_fuses=False)
    assert built == []
    _installer(tmp_path, switch="qk_cache", qk_cache="aiter").install_qk_cache(_layer(), upstream_fuses=False)
    assert built == [("positions", torch.device("cpu"), 8192), ("identity", torch.device("cpu"), torch.float32, 64)]
    built.clear()  # issue 19: the absorbed launch's aiter provider reads the same tables
    site = _installer(tmp_path, switch="absorb_qk_cache", absorb_qk_cache="aiter").install_qk_cache(
        _layer(is_aiter_triton_fp8_bmm_enabled=True), upstream_fuses=False)
    assert site.plan.absorb_decision.provider == "aiter"
    assert built == [("positions", torch.device("cpu"), 8192), ("identity", torch.device("cpu"), torch.float32, 64)]


def test_a_zero_positions_buffer_a_graph_may_read_is_never_freed():
    """Issue 19: a larger eager batch after a capture replaces the shared buffer; the old one (whose
    address a graph holds) stays allocated and zero."""
    device = torch.device("cpu")
    aiter_qk_cache._zero_positions.pop(device, None)
    first = aiter_qk_cache.zero_positions(device, 4)
    larger = aiter_qk_cache.zero_positions(device, 64)
    assert larger.numel() == 64 and any(t.data_ptr() == first.data_ptr() for t in aiter_qk_cache._outgrown)


@pytest.mark.parametrize("via_attend_hook", [True, False])
@pytest.mark.parametrize("switch", ["1", "qkv_norm", "qk_cache", "stock"])
def test_install_sites_attaches_what_the_fusions_and_the_shape_need(tmp_path, here, monkeypatch, switch,
                                                                    via_attend_hook):
    hooked = []
    monkeypatch.setattr(attend_hook, "install", lambda attn, site: hooked.append((attn, site)))
    inst = _installer(tmp_path, switch=switch, qk_cache="reference", absorb_qk_cache="reference")
    layer = _layer()
    layer._use_eager_qk_rmsnorm_fusion = True  # vLLM 0.30+'s own dual norm is on for this layer
    installer.install_sites(inst, layer, inst.settings.fusions, via_attend_hook)
    fusions = inst.settings.fusions
    if QKV_NORM in fusions:
        state = layer.__dict__[QKV_NORM_SITE].decision.state
        assert state is (FusionState.FORCED_STOCK if switch == "stock" else FusionState.UPSTREAM)
    else:
        assert QKV_NORM_SITE not in layer.__dict__
    decode = bool(fusions & installer.DECODE_FUSIONS) and via_attend_hook
    assert (DECODE_SITE in layer.__dict__) is decode
    # hooked where the overlay fuses, and in stock mode too (only the census's range around stock's call)
    assert hooked == ([(layer.mla_attn, layer.__dict__[DECODE_SITE])] if decode else [])
    if decode:  # the attention hook serves vLLMs without a fused decode of their own
        assert layer.__dict__[DECODE_SITE].plan.upstream_fuses is False


def test_a_layer_without_vllms_dual_norm_flag_is_not_upstream(tmp_path, here):
    inst = _installer(tmp_path, switch="qkv_norm")
    layer = _layer()
    installer.install_sites(inst, layer, inst.settings.fusions, False)
    assert layer.__dict__[QKV_NORM_SITE].decision.state is FusionState.APPLIED


@pytest.mark.parametrize("arity", [aiter_qk_cache.AITER_BASE_ARITY, aiter_qk_cache.AITER_BASE_ARITY + 1])
def test_the_aiter_ops_arity_is_read_from_its_registered_schema_first(monkeypatch, arity):
    """AITER's wrapper hides the Python signature; a real AITER registers the op under torch.ops.aiter,
    whose schema gives the argument count (14, or 15 with the clamp flag)."""
    arguments = ", ".join(f"Tensor a{i}" for i in range(arity))
    schema = torch._C.parse_schema(f"aiter::{aiter_qk_cache.AITER_OP_NAME}({arguments}) -> ()")
    registered = types.SimpleNamespace(default=types.SimpleNamespace(_schema=schema))
    monkeypatch.setattr(torch.ops, "aiter", types.SimpleNamespace(**{aiter_qk_cache.AITER_OP_NAME: registered}),
                        raising=False)

    def hidden(*args, **kwargs):  # what AITER's compile_ops wrapper shows of the op
        raise AssertionError("not called")

    assert aiter_qk_cache.op_arity(hidden) == arity


def test_without_a_registered_schema_the_aiter_ops_arity_is_its_python_signatures_or_the_base():
    base = aiter_qk_cache.AITER_BASE_ARITY
    fifteen = inspect.Signature([inspect.Parameter(f"a{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(15)])

    def op(*args):
        raise AssertionError("not called")

    assert aiter_qk_cache.op_arity(op) == base  # (*args) says nothing of the arguments
    op.__signature__ = fifteen
    assert aiter_qk_cache.op_arity(op) == 15
    assert aiter_qk_cache.op_arity(print) == base  # no signature to read
