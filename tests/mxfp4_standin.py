"""Stand-ins for AITER's MXFP4 ops that vLLM's fp4 W_UK absorption calls, for machines without
them (no ROCm, no gfx950): ``aiter.ops.triton.quant.dynamic_mxfp4_quant`` (vLLM quantises W_K / W_V
with it at load) and ``batched_gemm_a16wfp4`` (the decode BMM, ``prequant=True``). Written from AITER's
kernel procedure on the fp32 bits (``_mxfp4_quant_op``: max rounded up by adding 2**21 to the bits
and keeping the exponent, subnormal codes by adding 2**22 and subtracting its bits, normal codes by
adding a rounding bias and shifting), not from the overlay's reference, which rounds by ranges:
the two agreeing is a check of each. Test scaffolding: never shipped."""

from __future__ import annotations

import importlib.machinery
import itertools
import sys
import types

import pytest
import torch

GROUP = 32


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (packed e2m1 [M, K / 2] uint8, e8m0 scales [M, K / 32] uint8), AITER's bit procedure."""
    rows, k = x.shape
    g = x.float().reshape(rows, k // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True).view(torch.int32)
    amax = ((amax + 0x200000) & 0x7F800000).view(torch.float32)
    e = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scale_bytes = (e + 127).to(torch.uint8)  # correct for every e in [-127, 127] (AITER's sm90 defect is not modelled)
    qx = (g * torch.exp2(-e)).view(torch.int32)
    sign = qx & -0x80000000
    mag_bits = qx ^ sign
    mag = mag_bits.view(torch.float32)
    denormal = ((mag + 2.0 ** 22).view(torch.int32) - (149 << 23)) & 0xFF
    mant_odd = (mag_bits >> 22) & 1
    normal = ((mag_bits + ((1 - 127) << 23) + (1 << 21) - 1 + mant_odd) >> 22) & 0xFF
    code = torch.where(mag >= 6, 7, torch.where(mag < 1, denormal, normal))
    code = (code | ((sign >> 28) & 8)).to(torch.uint8).reshape(rows, k)
    return code[:, 0::2] | (code[:, 1::2] << 4), scale_bytes.reshape(rows, k // GROUP)


def dequantize(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """[M, K / 2] packed codes and [M, K / 32] scales -> fp32 [M, K]."""
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1).long()
    e, m = (codes >> 1) & 3, codes & 1
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e.float() - 1))
    value = torch.where(codes >= 8, -mag, mag)
    return value * torch.exp2(scale_bytes.float() - 127).repeat_interleave(GROUP, -1)


def dynamic_mxfp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER's ``dynamic_mxfp4_quant(x [M, K])`` -> (packed [M, K / 2], scales [M, K / 32])."""
    return quantize(x)


def batched_gemm_a16wfp4(x, w, w_scales, dtype=torch.bfloat16, y=None, config=None, transpose_bm=False,
                         prequant=True, y_scale=None):
    """AITER's ``batched_gemm_a16wfp4``: X [B, M, K] bf16 quantised per row and 32 lanes, W [B, N, K / 2]
    packed with scales [B, N, K / 32]; exact products summed in fp32 (float64 here, then rounded: the
    same wherever the fp32 sum is exact), times fp32(1 / y_scale), cast to ``dtype``; out (M, B, N) with
    ``transpose_bm``. vLLM pre-compiles with large empty inputs: more than 64 rows get an empty output."""
    assert prequant, "AITER supports prequant=True only"
    batches, rows, _ = x.shape
    n = w.shape[1]
    shape = (rows, batches, n) if transpose_bm else (batches, rows, n)
    if rows > 64:
        return y if y is not None else x.new_empty(shape, dtype=dtype)
    out = []
    for b in range(batches):
        packed, scales = quantize(x[b])
        xv = dequantize(packed, scales).double()
        wv = dequantize(w[b], w_scales[b]).double()
        acc = (xv @ wv.T).float()
        if y_scale is not None:
            acc = acc * (1.0 / y_scale.float().reshape(()))
        out.append(acc.to(dtype))
    result = torch.stack(out)
    result = result.transpose(0, 1) if transpose_bm else result
    if y is not None:
        y.copy_(result)
        return y
    return result


def install_gemm_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put ``aiter.ops.triton.batched_gemm_a16wfp4`` (with the stand-in GEMM) into sys.modules: vLLM
    0.29-0.30's MLA decode path and 0.32-0.33's own K3 fused decode (``models/kimi_k3/amd/mla.py``)
    import AITER's GEMM from there instead of calling ``rocm_aiter_ops``; ``monkeypatch`` undoes it."""
    names = ("aiter", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.batched_gemm_a16wfp4")
    modules = [types.ModuleType(name) for name in names]
    for parent, child in itertools.pairwise(modules):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    modules[-1].batched_gemm_a16wfp4 = batched_gemm_a16wfp4  # type: ignore[attr-defined]
    for module in modules:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        monkeypatch.setitem(sys.modules, module.__name__, module)
