"""Triton kernel for the K3 decode step after the W_UK absorption, in one launch: the fp8 KV-cache
write of ``[kv_c | k_pe]`` (tokens with a slot >= 0 only), the ``[ql_nope | q_pe]`` concat and
its static fp8 quant. No rotation at all: K3's MLA is NoPE. Both fp8 formats, ROCm and CUDA."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ, Fp8Format
from k3_amd_overlay.kernels import target
from k3_amd_overlay.kernels.launch import CACHE_ALIGNMENT, check_cache_alignment, config_for, launch
from k3_amd_overlay.kernels.names import QK_CACHE_KERNEL

# How the kernel produces fp8 bits (a constexpr, chosen once per call from format and platform).
FP8_NATIVE_FN = 0  # tl.float8e4nv: OCP e4m3fn (NVIDIA, MI355X)
FP8_NATIVE_FNUZ = 1  # tl.float8e4b8: e4m3fnuz, AMD only (MI300X)
FP8_FNUZ_BY_INT = 2  # e4m3fnuz by integer rounding where the native type is missing (CUDA, CPU)
FP8_FN_BY_INT = 3  # e4m3fn by integer rounding under the CPU interpreter, whose native cast drops a
# mantissa carry into the exponent (124.3 -> 64, not 128; Triton 3.x)


def fp8_mode(fmt: Fp8Format, device: torch.device) -> int:
    where = target.of(device)
    if fmt is E4M3FN:
        return FP8_NATIVE_FN if where.gpu else FP8_FN_BY_INT
    if fmt is E4M3FNUZ and where.backend == target.HIP:
        return FP8_NATIVE_FNUZ
    return FP8_FNUZ_BY_INT


# The kernels that write the KV cache take its pointer unspecialized. Triton's AMD backend specializes a
# tensor argument on whether its storage is at most 2 GiB (buffer ops); vLLM's cache is a view of one
# buffer of many GiB (0.32+: all layers'), so the compile at model load (a small cache) and the served
# launch built two binaries and the first served batch compiled (Triton 3.9, gfx942). Unspecialized, the
# pointer also loses the 16-byte alignment Triton infers (byte stores): ``write_kv_row(s)`` state it.
CACHE_POINTER = ["cache_ptr"]
CACHE_ALIGN = tl.constexpr(CACHE_ALIGNMENT)


@triton.jit
def _e4m3_magnitude(a, BIAS: tl.constexpr, SUBNORMAL_STEPS: tl.constexpr):
    """The 7 magnitude bits of |y| = ``a`` in e4m3 with exponent bias ``BIAS`` (7: fn, 8: fnuz; its
    subnormals are multiples of 1 / ``SUBNORMAL_STEPS`` = 2**-(BIAS + 2)), by
    integer rounding of the fp32 pattern, no fp8 type involved: exact on any backend and under the
    interpreter. (Emulations through fp8 casts were wrong there: an e4m3fn cast miscompiled for 2-D
    tiles on an H200, Triton 3.6; the CPU interpreter's cast drops a mantissa carry, 124.3 -> 64.)"""
    pattern = a.to(tl.int32, bitcast=True)
    exponent = (pattern >> 23) - 127
    fraction = pattern & 0x7FFFFF
    kept = fraction >> 20
    rest = fraction & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((kept & 1) == 1))
    normal = ((exponent + BIAS) << 3) + kept + up.to(tl.int32)  # a mantissa carry bumps the exponent
    subnormal = ((a * SUBNORMAL_STEPS + 12582912.0) - 12582912.0).to(tl.int32)  # RNE by the fp32 adder
    return tl.where(exponent < 1 - BIAS, subnormal, normal)


@triton.jit
def _fp8_bits(x, inv_scale, fmax, FP8_MODE: tl.constexpr):
    """fp8(clamp(x * inv_scale, -fmax, fmax)) as raw bits; NaN stays NaN, RNE."""
    v = x * inv_scale
    y = tl.minimum(tl.maximum(v, -fmax), fmax)
    y = tl.where(v != v, v, y)  # min/max drop NaN; the spec keeps it
    if FP8_MODE == 0:
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif FP8_MODE == 1:
        bits = y.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
    elif FP8_MODE == 3:  # e4m3fn: -0 kept, NaN = 0x7f with its sign
        magnitude = tl.where(y != y, 0x7F, _e4m3_magnitude(tl.abs(y), 7, 512.0))
        bits = tl.where(y.to(tl.int32, bitcast=True) < 0, magnitude | 0x80, magnitude).to(tl.uint8)
    else:  # e4m3fnuz: no -0, NaN = 0x80
        magnitude = _e4m3_magnitude(tl.abs(y), 8, 1024.0)
        bits = tl.where((y < 0) & (magnitude != 0), magnitude | 0x80, magnitude)
        bits = tl.where(y != y, 0x80, bits).to(tl.uint8)
    return bits


@triton.jit
def write_kv_row(t, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row,
                 block_size, fmax, L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr,
                 BLOCK_R: tl.constexpr, FP8_MODE: tl.constexpr):
    """Token t's latent row [kv_c | k_pe] into the cache at its slot, when the slot is >= 0. The slot,
    the scale and the row are loaded together (no dependent round trip before the store); a
    negative slot masks the store off, so padding rows write nothing. The row starts on a
    CACHE_ALIGNMENT-byte boundary (the ops check it): said here, since the kernels do not let Triton
    specialize ``cache_ptr`` (``CACHE_POINTER``)."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t)
    scale = tl.load(k_scale_ptr)
    kv = tl.load(kv_c_ptr + t * s_kv_t + offs_l, mask=offs_l < L)
    kpe = tl.load(k_pe_ptr + t * s_kpe_t + offs_r, mask=offs_r < R)
    inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
    # the slot test is broadcast to a vector mask (the interpreter rejects scalar & vector)
    write_l = (offs_l < L) & ((offs_l * 0).to(tl.int64) + slot >= 0)
    write_r = (offs_r < R) & ((offs_r * 0).to(tl.int64) + slot >= 0)
    slot = tl.maximum(slot, 0)
    row = cache_ptr + (slot // block_size) * s_c_blk + (slot % block_size) * s_c_row
    latent, rope = tl.multiple_of(row + offs_l, [CACHE_ALIGN]), tl.multiple_of(row + L + offs_r, [CACHE_ALIGN])
    tl.store(latent, _fp8_bits(kv.to(tl.float32), inv, fmax, FP8_MODE), mask=write_l)
    tl.store(rope, _fp8_bits(kpe.to(tl.float32), inv, fmax, FP8_MODE), mask=write_r)


@triton.jit
def write_kv_rows(first, num_tokens, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t,
                  s_c_blk, s_c_row, block_size, fmax, L: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr,
                  FP8_MODE: tl.constexpr):
    """Tokens first .. first + ROWS - 1 (those < num_tokens) as one [ROWS, L | R] tile: each row into
    the cache at its slot when the slot is >= 0, as ``write_kv_row`` does one. L and R powers of two."""
    t = first + tl.arange(0, ROWS).to(tl.int64)
    live = t < num_tokens
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    slot = tl.load(slot_ptr + t, mask=live, other=-1)
    scale = tl.load(k_scale_ptr)
    kv = tl.load(kv_c_ptr + t[:, None] * s_kv_t + offs_l[None, :], mask=live[:, None], other=0.0)
    kpe = tl.load(k_pe_ptr + t[:, None] * s_kpe_t + offs_r[None, :], mask=live[:, None], other=0.0)
    inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
    write = (slot >= 0)[:, None]
    slot = tl.maximum(slot, 0)
    row = (cache_ptr + (slot // block_size) * s_c_blk + (slot % block_size) * s_c_row)[:, None]
    latent = tl.multiple_of(row + offs_l[None, :], [CACHE_ALIGN, CACHE_ALIGN])
    rope = tl.multiple_of(row + L + offs_r[None, :], [CACHE_ALIGN, CACHE_ALIGN])
    tl.store(latent, _fp8_bits(kv.to(tl.float32), inv, fmax, FP8_MODE), mask=write)
    tl.store(rope, _fp8_bits(kpe.to(tl.float32), inv, fmax, FP8_MODE), mask=write)


@triton.jit(do_not_specialize=CACHE_POINTER)
def qk_cache_kernel(
    ql_nope_ptr, q_pe_ptr, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, q_scale_ptr,
    q_out_ptr,
    s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_kv_t, s_kpe_t, s_c_blk, s_c_row, s_qo_t, s_qo_h,
    num_heads, block_size, fmax,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    HEADS: tl.constexpr, FP8_MODE: tl.constexpr,
):
    # grid = (T, cdiv(H, HEADS) + 1): programs (t, g) quantise query heads g*HEADS.. of token t
    # into q_out; the last program of each token writes its latent row when its slot is >= 0.
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_l = offs_l < L
    mask_r = offs_r < R
    if group < tl.cdiv(num_heads, HEADS):
        heads = group * HEADS + tl.arange(0, HEADS)
        live = (heads < num_heads)[:, None]
        scale = tl.load(q_scale_ptr)
        nope = tl.load(ql_nope_ptr + t * s_qn_t + heads[:, None] * s_qn_h + offs_l[None, :],
                       mask=live & mask_l[None, :])
        pe = tl.load(q_pe_ptr + t * s_qp_t + heads[:, None] * s_qp_h + offs_r[None, :],
                     mask=live & mask_r[None, :])
        inv = tl.fdiv(scale * 0.0 + 1.0, scale, ieee_rounding=True)
        out = q_out_ptr + t * s_qo_t + heads[:, None] * s_qo_h
        tl.store(out + offs_l[None, :], _fp8_bits(nope.to(tl.float32), inv, fmax, FP8_MODE),
                 mask=live & mask_l[None, :])
        tl.store(out + L + offs_r[None, :], _fp8_bits(pe.to(tl.float32), inv, fmax, FP8_MODE),
                 mask=live & mask_r[None, :])
    else:
        write_kv_row(t, kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, k_scale_ptr, s_kv_t, s_kpe_t, s_c_blk, s_c_row,
                     block_size, fmax, L, R, BLOCK_L, BLOCK_R, FP8_MODE)


def qk_cache(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
             cache_bytes: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
             q_scale: torch.Tensor, q_out_bytes: torch.Tensor, fmt: Fp8Format) -> None:
    """Launch on validated inputs; k_pe is 2-D, cache_bytes and q_out_bytes are uint8 views. The
    launch config (heads a program, warps) is the arch's (``launch_configs``)."""
    num_tokens, num_heads, lora = ql_nope.shape
    rope = q_pe.shape[-1]
    config = config_for(QK_CACHE_KERNEL, ql_nope.device, num_tokens, num_heads)
    check_cache_alignment(QK_CACHE_KERNEL, cache_bytes)
    launch(
        qk_cache_kernel, (num_tokens, triton.cdiv(num_heads, config["HEADS"]) + 1),
        ql_nope, q_pe, kv_c, k_pe, cache_bytes, slot_mapping, k_scale, q_scale, q_out_bytes,
        ql_nope.stride(0), ql_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_c.stride(0), k_pe.stride(0), cache_bytes.stride(0), cache_bytes.stride(1),
        q_out_bytes.stride(0), q_out_bytes.stride(1),
        num_heads, cache_bytes.shape[1], fmt.fmax,
        L=lora, R=rope, BLOCK_L=triton.next_power_of_2(lora), BLOCK_R=triton.next_power_of_2(rope),
        FP8_MODE=fp8_mode(fmt, ql_nope.device), **config,
    )
