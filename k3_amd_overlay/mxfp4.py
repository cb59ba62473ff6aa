"""The OCP MXFP4 format as vLLM's fp4 W_UK absorption stores it (ROCm's
``VLLM_ROCM_USE_AITER_FP4BMM``): e2m1 codes packed two per byte along the reduced dimension (the
even lane in the low nibble), one e8m0 power-of-two scale per group of 32 lanes. The one home for
every MXFP4 constant."""

from __future__ import annotations

GROUP = 32  # lanes sharing one e8m0 scale
E8M0_BIAS = 127  # scale = 2 ** (byte - 127)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by the code's low three bits; bit 3 is the sign
E2M1_MAX = 6.0
# The dynamic activation quant of AITER's MXFP4 GEMMs (``_mxfp4_quant_op`` in AITER's
# ``ops/triton/_triton_kernels/quant/quant.py``) rounds a group's max|x| up to the next power of two
# when its fp32 mantissa is at least 1.75 (it adds this to the bits, then keeps sign and exponent),
# and takes the scale exponent as that power's exponent minus this.
AMAX_ROUND_BITS = 0x200000
SCALE_EXPONENT_OFFSET = 2
