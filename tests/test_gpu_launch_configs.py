"""On a GPU: the sites' ahead-of-time compile (every config the arch's table can pick for a layer)
leaves nothing for a served batch to compile, and a launch Triton cannot build raises before the
kernel writes anything (what lets a site refuse the fusion and run stock on the same batch)."""

from __future__ import annotations

import importlib

import pytest
import torch

from k3_amd_overlay.fp8 import device_format
from k3_amd_overlay.kernels import launch, names, probe, target

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]
KERNELS = [names.RMSNORM_PAIR_KERNEL, names.QK_CACHE_KERNEL, names.ABSORB_QK_CACHE_KERNEL,
           names.ABSORB_FP8_QK_CACHE_KERNEL, names.ABSORB_MXFP4_QK_CACHE_KERNEL]


def _jit(kernel: str):
    """The Triton function named ``kernel`` (each lives in the module named after it)."""
    return getattr(importlib.import_module(f"k3_amd_overlay.kernels.{kernel.removesuffix('_kernel')}"), kernel)


def _compiled_variants(jit) -> int | None:
    caches = getattr(jit, "device_caches", None)  # Triton 3.x: device -> (kernel cache, ...)
    if caches is None:
        return None
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads", [3, 16])
def test_precompile_leaves_nothing_to_compile_for_any_batch(kernel, heads):
    device = torch.device("cuda")
    fmt = device_format(device)
    count = probe.precompile(kernel, device, torch.bfloat16, heads, fmt)
    configs = probe.reachable(kernel, target.of(device).arch, (heads,), launch.device_name(device))
    assert count == len(configs) > 0
    jit = _jit(kernel)
    before = _compiled_variants(jit)
    if before is None:
        pytest.skip("this Triton keeps its JIT cache elsewhere")
    served = probe.SERVED_MOST.get(kernel, max(probe.TOKENS))  # the absorbed launch takes up to 256 tokens
    for tokens in sorted(t for t in {*probe.TOKENS, 3, 17, 33, 100, 200, 255} if t <= served):  # launched for real
        probe.launch_at(kernel, device, torch.bfloat16, tokens, heads, fmt)
    torch.cuda.synchronize()
    assert _compiled_variants(jit) == before


def test_a_launch_triton_cannot_build_raises_before_writing_anything():
    from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache

    device = torch.device("cuda")
    fmt = device_format(device)
    tokens, heads, lora, rope, nope = 8, 3, 512, 64, 128
    q = torch.randn(tokens, heads, nope + rope, dtype=torch.bfloat16, device=device)
    w_k = (torch.randn(heads, lora, nope, device=device) * 40).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)
    kv_c = torch.randn(tokens, lora, dtype=torch.bfloat16, device=device)
    k_pe = torch.randn(tokens, rope, dtype=torch.bfloat16, device=device)
    cache = torch.full((4, 16, lora + rope), 0xA5, dtype=torch.uint8, device=device)
    q_out = torch.full((tokens, heads, lora + rope), 0xA5, dtype=torch.uint8, device=device)
    scale = torch.tensor([1.0], device=device)
    slots = torch.arange(tokens, device=device)
    with launch.forced({"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 3}), pytest.raises(Exception) as failure:
        absorb_fp8_qk_cache(q[..., :nope], w_k, scale, q[..., nope:], kv_c, k_pe, cache, slots, scale, scale, q_out,
                            fmt)  # 3 warps: no Triton backend builds it
    torch.cuda.synchronize()
    assert "warps" in str(failure.value), failure.value
    assert bool((cache == 0xA5).all()) and bool((q_out == 0xA5).all())
