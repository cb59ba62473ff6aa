"""On a GPU: installing a K3 layer's sites (the Triton providers) compiles every config their
kernels can pick, so the first fused decode batch served after load, and the ones after it, compile
nothing: Triton's compiled-variant count of each kernel holds still across those calls. A stand-in
layer (no vLLM on the GPU machine) carries the attributes the installer and the decode site read;
vLLM's fp8 format and KV cache block size are the device's format and vLLM's default block of 16."""

from __future__ import annotations

import importlib
import random
import types

import pytest
import torch

from k3_amd_overlay import k3, kernel_failures
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fp8 import device_format
from k3_amd_overlay.fusions.qk_cache import DecodePath
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.kernels import names, probe
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import load_settings
from k3_amd_overlay.targets import installer, vllm_env
from k3_amd_overlay.targets.decode import DECODE_SITE
from k3_amd_overlay.targets.norm import QKV_NORM_SITE

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]
NS = types.SimpleNamespace
HEADS, BLOCK, DTYPE = 16, 16, torch.bfloat16
LORA, ROPE, NOPE, QL = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM, k3.Q_LORA_RANK
KERNELS = (names.RMSNORM_PAIR_KERNEL, names.QK_CACHE_KERNEL, names.ABSORB_QK_CACHE_KERNEL)


def _jit(kernel: str):
    return getattr(importlib.import_module(f"k3_amd_overlay.kernels.{kernel.removesuffix('_kernel')}"), kernel)


def _compiled_variants(kernel: str) -> int | None:
    caches = getattr(_jit(kernel), "device_caches", None)  # Triton 3.x: device -> (kernel cache, ...)
    return None if caches is None else sum(len(entry[0]) for entry in caches.values())


def _layer(device):
    def norm(width, eps):
        return NS(weight=torch.rand(width, dtype=DTYPE, device=device) + 0.5, variance_epsilon=eps)

    attn = NS(impl=NS(dcp_world_size=1, supports_quant_query_input=True), kv_cache_dtype="fp8",
              layer_name="model.layers.0.self_attn.attn", qk_nope_head_dim=NOPE, kv_lora_rank=LORA,
              qk_rope_head_dim=ROPE)
    return NS(mla_attn=attn, rotary_emb=NS(is_identity=True), num_heads=HEADS, q_a_layernorm=norm(QL, 1e-6),
              kv_a_layernorm=norm(LORA, 1e-6))


def test_the_first_fused_decode_after_install_compiles_nothing(tmp_path, monkeypatch):
    device = torch.device("cuda")
    fmt = device_format(device)
    monkeypatch.setattr(kernel_failures, "_failed", {})
    monkeypatch.setattr(probe, "_precompiled", set())  # this test's install compiles, whatever ran before
    monkeypatch.setattr(vllm_env, "vllm_fp8_format", lambda: fmt)
    monkeypatch.setattr(vllm_env, "kv_cache_block_size", lambda: BLOCK)
    env = {"K3_AMD_OVERLAY": "qkv_norm,qk_cache,absorb_qk_cache", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path),
           **{f"K3_AMD_OVERLAY_{f.upper()}_PROVIDER": "triton" for f in (QKV_NORM, QK_CACHE, ABSORB_QK_CACHE)}}
    settings = load_settings(env)
    inst = installer.LayerInstaller(settings, Evidence(settings))
    layer = _layer(device)
    inst.install_qkv_norm(layer, upstream_fuses=False)
    site = inst.install_qk_cache(layer, upstream_fuses=False)
    for fusion in (QKV_NORM, QK_CACHE, ABSORB_QK_CACHE):
        assert inst.evidence.fusion(fusion).state is FusionState.APPLIED, inst.evidence.fusion(fusion).reason
    assert set(inst.evidence.record.launch_configs["compile_seconds"]) == set(KERNELS)
    before = {kernel: _compiled_variants(kernel) for kernel in KERNELS}
    if None in before.values():
        pytest.skip("this Triton keeps its JIT cache elsewhere")

    attn = layer.mla_attn
    attn.W_UK_T = torch.randn(LORA, HEADS, NOPE, dtype=DTYPE, device=device).permute(1, 2, 0)  # vLLM's view
    attn._k_scale = attn._q_scale = torch.ones(1, device=device)
    norm_site, seen = layer.__dict__[QKV_NORM_SITE], []
    for tokens in (random.randint(2, 15), 1, random.randint(17, 200)):  # the first served batches, any size
        attn.impl.forward_mqa = lambda q_out, cache, meta, layer, t=tokens: (
            torch.zeros(t, HEADS, LORA, dtype=DTYPE, device=device), None)
        attn._v_up_proj = lambda attn_out, out: seen.append(attn_out.shape[0])
        latent = torch.randn(tokens, QL + LORA + ROPE, dtype=DTYPE, device=device)
        norm_site.q_kv_norm(latent[:, :QL], latent[:, QL:QL + LORA])
        cache = torch.zeros(tokens // BLOCK + 2, BLOCK, LORA + ROPE, dtype=torch.uint8, device=device)
        meta = NS(num_actual_tokens=tokens, num_decode_tokens=tokens)
        q = torch.randn(tokens, HEADS, NOPE + ROPE, dtype=DTYPE, device=device)
        kv_c = torch.randn(tokens, LORA, dtype=DTYPE, device=device)
        k_pe = torch.randn(tokens, 1, ROPE, dtype=DTYPE, device=device)
        for path in (DecodePath.ABSORB, DecodePath.QK_CACHE):
            layer.__dict__[DECODE_SITE].fused_decode(path, attn, q, kv_c, k_pe, (tokens, HEADS * NOPE), meta, cache,
                                                     torch.randperm(cache.shape[0] * BLOCK, device=device)[:tokens])
        torch.cuda.synchronize()
        assert {kernel: _compiled_variants(kernel) for kernel in KERNELS} == before, tokens
        assert bool(cache.any())  # the fused launches ran and wrote the cache
    assert site is layer.__dict__[DECODE_SITE] and len(seen) == 6 and kernel_failures.failed() == frozenset()
