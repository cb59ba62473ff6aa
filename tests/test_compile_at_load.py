"""Compile before serving: installing a layer's sites on a GPU compiles every config its Triton
kernels can pick (for the layer's device, activation dtype, heads, fp8 format and vLLM's KV cache
block size), so a later fused call compiles nothing; the seconds go to the log and the marker; a
CPU compiles nothing; a kernel whose safe config fails to build is refused at load. On a CPU, the
GPU faked (``target.of``) and the compile recorded (``probe.precompile``)."""

from __future__ import annotations

import logging
import random
import types

import pytest
import torch
from drawn_seconds import seconds_between

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ
from k3_amd_overlay.fusions.qk_cache import DecodePath
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.kernels import names, probe, target
from k3_amd_overlay.ops import absorb_qk_cache, qk_cache, rmsnorm_pair
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import load_settings
from k3_amd_overlay.targets import decode, installer, vllm_env

NS = types.SimpleNamespace
LOGGER = "vllm.k3_amd_overlay"
HEADS, BLOCK, LORA, ROPE, NOPE = 8, 16, 512, 64, 128
DTYPE = torch.bfloat16


def _norm(eps):
    return NS(weight=torch.ones(4, dtype=DTYPE), variance_epsilon=eps)


def _layer():
    attn = NS(impl=NS(dcp_world_size=1, supports_quant_query_input=True), kv_cache_dtype="fp8",
              layer_name="model.layers.3.self_attn.attn", qk_nope_head_dim=NOPE, kv_lora_rank=LORA,
              qk_rope_head_dim=ROPE)
    return NS(mla_attn=attn, rotary_emb=NS(is_identity=True), num_heads=HEADS, q_a_layernorm=_norm(1e-6),
              kv_a_layernorm=_norm(1e-5))


@pytest.fixture
def load(monkeypatch, tmp_path):
    """A fake GPU (or the CPU, with ``where.gpu = False``) whose providers all run; every compile
    recorded, each taking a fresh random number of seconds on the probe's clock."""
    saved = set(probe._precompiled)
    probe._precompiled.clear()
    monkeypatch.setattr(kernel_failures, "_failed", {})
    where = NS(gpu=True, compiled=[], seconds=[], fails=set())
    for op in (qk_cache, absorb_qk_cache, rmsnorm_pair):
        monkeypatch.setattr(op, "provider_missing", lambda *a, **k: {"triton": None, "aiter": "off", "reference": None})
    monkeypatch.setattr(vllm_env, "with_vllm_aiter_switch", lambda missing: missing)
    monkeypatch.setattr(vllm_env, "whole_model_compiled", lambda: False)
    monkeypatch.setattr(vllm_env, "model_coverage", lambda: {})
    monkeypatch.setattr(vllm_env, "kv_transfer_hooks", lambda: None)
    monkeypatch.setattr(vllm_env, "vllm_fp8_format", lambda: E4M3FNUZ)
    monkeypatch.setattr(vllm_env, "padded_query_heads", lambda attn, heads: heads)
    monkeypatch.setattr(vllm_env, "kv_cache_block_size", lambda: BLOCK)
    monkeypatch.setattr(installer, "eager_step", lambda: None)
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, "gfx942") if where.gpu
                        else target.Target(target.INTERPRETER, "cpu"))
    clock = {"now": 100.0}
    monkeypatch.setattr(probe, "perf_counter", lambda: clock["now"])

    def precompile(kernel, device, dtype, heads, fmt, block_size=1):
        if kernel in where.fails:
            raise RuntimeError(f"PassManager::run failed\nno {kernel} on this GPU")
        seconds = seconds_between(0.5, 30.0)
        clock["now"] += seconds
        where.compiled.append((kernel, device, dtype, heads, fmt, block_size))
        where.seconds.append(seconds)
        return 3

    monkeypatch.setattr(probe, "precompile", precompile)
    yield where
    probe._precompiled.clear()
    probe._precompiled.update(saved)


def _installer(tmp_path, switch="qkv_norm,qk_cache,absorb_qk_cache"):
    env = {"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path),
           **{f"K3_AMD_OVERLAY_{f.upper()}_PROVIDER": "triton" for f in (QKV_NORM, QK_CACHE, ABSORB_QK_CACHE)}}
    settings = load_settings(env)
    return installer.LayerInstaller(settings, Evidence(settings))


def _install(inst, layer):
    """Both sites of one layer, as vLLM's K3 wrapper installs them."""
    inst.install_qkv_norm(layer, upstream_fuses=False)
    inst.install_qk_cache(layer, upstream_fuses=False)


CPU = torch.device("cpu")
NORM_KEY = (names.RMSNORM_PAIR_KERNEL, CPU, DTYPE, 1, E4M3FN, 1)
QK_KEY = (names.QK_CACHE_KERNEL, CPU, DTYPE, HEADS, E4M3FNUZ, BLOCK)
ABSORB_KEY = (names.ABSORB_QK_CACHE_KERNEL, CPU, DTYPE, HEADS, E4M3FNUZ, BLOCK)


def test_installing_compiles_every_kernel_the_layer_fuses_and_records_the_seconds(tmp_path, load, caplog):
    inst = _installer(tmp_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _install(inst, _layer())
        _install(inst, _layer())
    assert load.compiled == [NORM_KEY, ABSORB_KEY, QK_KEY]  # once per process, not per layer
    seconds = dict(zip([k[0] for k in load.compiled], load.seconds, strict=True))
    assert inst.evidence.record.launch_configs["compile_seconds"] == pytest.approx(seconds)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "compiled" in r.getMessage()]
    assert len(logged) == 3
    for kernel, took in seconds.items():
        assert any(kernel in line and f"{took:.1f} s" in line for line in logged), (kernel, logged)
    for fusion in (QKV_NORM, QK_CACHE, ABSORB_QK_CACHE):
        assert inst.evidence.fusion(fusion).state is FusionState.APPLIED


def test_a_fused_call_after_install_compiles_nothing_new(tmp_path, load, monkeypatch):
    layer = _layer()
    inst = _installer(tmp_path)
    _install(inst, layer)
    installed = list(load.compiled)
    ran = []
    monkeypatch.setattr(rmsnorm_pair, "run_provider", lambda *args: ran.append("norm") or args[1:3])
    monkeypatch.setattr(qk_cache, "run_provider", lambda *args: ran.append("qk_cache"))
    monkeypatch.setattr(absorb_qk_cache, "run_provider", lambda *args: ran.append("absorb"))
    norm_site = layer.__dict__[installer.QKV_NORM_SITE]
    tokens = random.randint(2, 40)
    norm_site.q_kv_norm(torch.randn(tokens, 1536, dtype=DTYPE), torch.randn(tokens, LORA, dtype=DTYPE))
    site = layer.__dict__[decode.DECODE_SITE]
    attn = layer.mla_attn
    attn.W_UK_T = torch.randn(HEADS, NOPE, LORA, dtype=DTYPE)
    attn._k_scale = attn._q_scale = torch.ones(1)
    attn.impl.forward_mqa = lambda q_out, cache, meta, layer: (torch.randn(tokens, HEADS, LORA, dtype=DTYPE), None)
    attn._v_up_proj = lambda attn_out, out: None
    cache = torch.empty(tokens // BLOCK + 2, BLOCK, LORA + ROPE, dtype=torch.uint8)
    meta = NS(num_actual_tokens=tokens, num_decode_tokens=tokens)
    for path in (DecodePath.ABSORB, DecodePath.QK_CACHE):
        site.fused_decode(path, attn, torch.randn(tokens, HEADS, NOPE + ROPE, dtype=DTYPE),
                          torch.randn(tokens, LORA, dtype=DTYPE), torch.randn(tokens, 1, ROPE, dtype=DTYPE),
                          (tokens, HEADS * 128), meta, cache, torch.arange(tokens))
    assert ran == ["norm", "absorb", "qk_cache"]
    assert load.compiled == installed  # the served calls found every compile done


@pytest.mark.parametrize("flag", ["is_aiter_triton_fp8_bmm_enabled", "is_aiter_triton_fp4_bmm_enabled"])
def test_the_aiter_absorptions_query_quant_compiles_at_install_too(tmp_path, load, monkeypatch, flag):
    for op in (qk_cache, absorb_qk_cache, rmsnorm_pair):
        monkeypatch.setattr(op, "provider_missing", lambda *a, **k: {"triton": None, "aiter": None, "reference": None})
    monkeypatch.setattr(installer.aiter_qk_cache, "reserve_zero_positions", lambda *args: None)
    monkeypatch.setattr(installer.aiter_qk_cache, "reserve_identity_table", lambda *args: None)
    env = {"K3_AMD_OVERLAY": "absorb_qk_cache", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path),
           "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER": "aiter"}
    settings = load_settings(env)
    inst = installer.LayerInstaller(settings, Evidence(settings))
    layer = _layer()
    setattr(layer.mla_attn, flag, True)
    site = inst.install_qk_cache(layer, upstream_fuses=False)
    assert (site.plan.absorb_decision.state, site.plan.absorb_decision.provider) == (FusionState.APPLIED, "aiter")
    assert load.compiled == [(names.STATIC_QUANT_KERNEL, CPU, DTYPE, HEADS, E4M3FNUZ, BLOCK)]  # AITER's own: not ours
    assert set(inst.evidence.record.launch_configs["compile_seconds"]) == {names.STATIC_QUANT_KERNEL}


def test_a_cpu_compiles_nothing_at_install(tmp_path, load):
    load.gpu = False
    inst = _installer(tmp_path)
    _install(inst, _layer())
    assert load.compiled == [] and "compile_seconds" not in inst.evidence.record.launch_configs


def test_a_kernel_that_cannot_build_at_load_is_refused_there_and_not_tried_again(tmp_path, load, caplog):
    load.fails.add(names.ABSORB_QK_CACHE_KERNEL)
    inst = _installer(tmp_path)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        for _ in range(3):
            _install(inst, _layer())
    assert kernel_failures.failed() == frozenset({ABSORB_QK_CACHE})
    absorb = inst.evidence.fusion(ABSORB_QK_CACHE)
    assert absorb.state is FusionState.REFUSED and f"no {names.ABSORB_QK_CACHE_KERNEL} on this GPU" in absorb.reason
    assert inst.evidence.fusion(QK_CACHE).state is FusionState.APPLIED
    assert [k[0] for k in load.compiled] == [names.RMSNORM_PAIR_KERNEL, names.QK_CACHE_KERNEL]
    assert sum("absorb_qk_cache refused" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.vllm
def test_vllms_kv_cache_block_size_is_read_from_its_config_in_context(monkeypatch):
    import vllm.config.vllm
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    # none in context, said here: a vLLM layer built by an earlier test (test_vllm_layer.py, run first)
    # can leave vLLM's global config set
    monkeypatch.setattr(vllm.config.vllm, "_current_vllm_config", None)
    assert vllm_env.kv_cache_block_size() is None
    size = random.choice([1, 16, 32, 64, 128])
    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(block_size=size))):
        assert vllm_env.kv_cache_block_size() == size
