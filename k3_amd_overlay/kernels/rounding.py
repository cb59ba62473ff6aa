"""Round-to-nearest-even casts that hold on every Triton backend. GPUs round fp32 -> bf16 to nearest
even natively; Triton's CPU interpreter truncates instead (measured: about half of random values
differ from torch's cast), so there the bf16 rounding is done on the bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_amd_overlay.kernels import target


def emulate_bf16(device: torch.device) -> bool:
    """Whether kernels launched for ``device`` must round bf16 on the bits (not a CUDA/HIP GPU)."""
    return not target.of(device).gpu


@triton.jit
def to_dtype_rne(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``x`` (fp32) cast to ``DTYPE``, rounding to nearest even."""
    if EMULATE_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        # the low half is zero now, so the interpreter's truncating cast is exact; NaN stays NaN
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True)).to(DTYPE)
    else:
        return x.to(DTYPE)
