"""AMD's own AITER Triton kernels as peers (benchmarks) and oracles (GPU tests): located, imported and
called here, never copied. On ROCm AITER is installed with vLLM; elsewhere (an NVIDIA GPU) point
``K3OVL_AITER_TRITON`` at a directory holding an importable ``aiter`` package with its Triton kernels.
The fused fp8 and fp4 absorb peers are the overlay's own aiter providers (``ops/aiter_absorb.py``).
Off ROCm, AITER's GEMM launches pass two AMD-only launch options (``waves_per_eu``,
``matrix_instr_nonkdim``) that Triton's NVIDIA backend rejects; ``enable`` drops them from every
launch in this process (they change no arithmetic). Imported by benchmarks and tests only."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from k3_amd_overlay.commands.bench import AITER_TREE
from k3_amd_overlay.ops import aiter_absorb, aiter_qk_cache

AMD_ONLY_LAUNCH_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim")
QK_CACHE_PEER = ("aiter.ops.triton.fusions.fused_kv_cache", "fused_qk_rope_cat_and_cache_mla")
FP8_BMM = ("aiter.ops.triton.gemm.batched.batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant",
           "batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant")
FP4_BMM = ("aiter.ops.triton.gemm.batched.batched_gemm_a16wfp4", "batched_gemm_a16wfp4")


@functools.cache
def enable() -> str | None:
    """Make AITER's Triton kernels importable and launchable here; None, or why they are not."""
    tree = os.environ.get(AITER_TREE)
    if tree and tree not in sys.path:
        sys.path.insert(0, tree)
    try:
        for module, name in (QK_CACHE_PEER, (aiter_absorb.AITER_MODULE, aiter_absorb.AITER_FP8_NAME), FP8_BMM):
            getattr(__import__(module, fromlist=[name]), name)
    except Exception as exc:  # any import failure means: no peer here
        return f"AITER's Triton kernels are not importable ({type(exc).__name__}: {exc}); set {AITER_TREE}"
    if torch.version.hip is None:
        _drop_amd_only_launch_options()
    return None


def fp4_missing() -> str | None:
    """Why AITER's MXFP4 kernels (the standalone GEMM vLLM calls, the fused one) are not callable here."""
    why = enable()
    if why:
        return why
    try:
        for module, name in (FP4_BMM, (aiter_absorb.AITER_MODULE, aiter_absorb.AITER_FP4_NAME)):
            getattr(__import__(module, fromlist=[name]), name)
    except Exception as exc:
        return f"AITER's MXFP4 Triton kernels are not importable ({type(exc).__name__}: {exc})"
    return None


def _drop_amd_only_launch_options() -> None:
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def run_without_amd_options(self: Any, *args: Any, **kwargs: Any) -> Any:
        for option in AMD_ONLY_LAUNCH_OPTIONS:
            kwargs.pop(option, None)
        return run(self, *args, **kwargs)

    JITFunction.run = run_without_amd_options


def peer(which: tuple[str, str]) -> Callable[..., Any]:
    module, name = which
    return getattr(__import__(module, fromlist=[name]), name)


def qk_cache(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
             cache: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """AITER's ``fused_qk_rope_cat_and_cache_mla`` with an identity rotation: the fp8 query (no query
    scale: compare at q_scale 1) and the cache ([blocks, block_size, L + R], fp8) written in place."""
    tokens, lora, rope = ql_nope.shape[0], kv_c.shape[-1], k_pe.shape[-1]
    cos, sin = aiter_qk_cache.identity_rope_table(ql_nope.device, ql_nope.dtype, rope)
    out = peer(QK_CACHE_PEER)(ql_nope, q_pe, kv_c.view(tokens, 1, lora), k_pe.view(tokens, 1, rope),
                              cache.view(-1, 1, lora + rope), slots,
                              aiter_qk_cache.zero_positions(ql_nope.device, tokens), cos, sin, k_scale, False,
                              q_out_dtype=cache.dtype)
    return out[0]


def fp8_bmm(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor) -> torch.Tensor:
    """What vLLM's ``rocm_aiter_ops.triton_fp8_bmm(q_nope.transpose(0, 1), W_K, W_K_scale,
    group_size=128, transpose_bm=True)`` returns: ql_nope [T, H, L] in bf16."""
    return peer(FP8_BMM)(q_nope.transpose(0, 1), w_k, w_k_scale.reshape(1), group_size=128, transpose_bm=True)


def fp4_bmm(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor,
            y_scale: torch.Tensor | None) -> torch.Tensor:
    """What vLLM's ``rocm_aiter_ops.batched_gemm_a16wfp4(q_nope.transpose(0, 1), W_K, W_K_scale,
    transpose_bm=True, prequant=True, y_scale=...)`` returns: ql_nope [T, H, L] in bf16. AITER's
    activation quant mis-scales on sm90 any group whose scale exponent is negative (max|x| below
    about 3.5): compare there only on groups above that."""
    return peer(FP4_BMM)(q_nope.transpose(0, 1), w_k, w_k_scale, transpose_bm=True, prequant=True, y_scale=y_scale)
