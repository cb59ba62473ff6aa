"""A stand-in for AITER's ``fused_qk_rope_concat_and_cache_mla`` (``aiter.ops.cache``), for
machines without ROCm. It records each call, checks every argument against AITER's contract
(dtypes, shapes, strides, which decode kernel the shape selects and
whether that kernel, in the AITER version modelled, clamps positions) and computes the result
with AITER's semantics: nope lanes clamped, rope lanes rotated and cast without a clamp, rows
with a negative slot leave q_out and the cache untouched. Test scaffolding: never shipped."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from k3_amd_overlay.fp8 import Fp8Format, format_of

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ContractViolation(AssertionError):
    """An argument AITER's kernel would mishandle."""


@dataclass
class AiterStandIn:
    """``version``: the AITER release modelled, a fourth number for a post release ((0, 1, 19, 1):
    v0.1.19.post1, where the position clamp and the 15th argument came, #4342; strided q_nope in
    0.1.17). ``fmt``: the device's fp8 format (dtypes.fp8)."""

    version: tuple[int, ...] = (0, 1, 20)
    fmt: Fp8Format = field(default_factory=lambda: format_of("e4m3fn"))
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def has_clamp(self) -> bool:
        return self.version >= (0, 1, 19, 1)

    def kernel_for(self, lora: int, heads: int, rot_dim: int, block_size: int, tokens: int,
                   is_nope_first: bool) -> str:
        if is_nope_first and lora <= 512 and block_size == 1 and rot_dim == 64 and tokens < 256:
            return "per_head"
        if rot_dim == 64 and lora * heads >= 2048 and lora == 512:
            return "opt"
        return "general"

    def op(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
           kv_cache: torch.Tensor, q_out: torch.Tensor, slot_mapping: torch.Tensor,
           k_scale: torch.Tensor, q_scale: torch.Tensor, positions: torch.Tensor,
           cos_cache: torch.Tensor, sin_cache: torch.Tensor, is_neox: bool, is_nope_first: bool,
           *rest: Any) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ContractViolation(f"fused_qk_rope_concat_and_cache_mla: {what}")

        extra = list(rest)
        need(len(extra) <= (1 if self.has_clamp else 0),
             f"{14 + len(extra)} arguments; AITER {self.version} takes {15 if self.has_clamp else 14}")
        compute_all_q_rope = bool(extra[0]) if extra else False
        need(q_nope.dim() == 3 and q_nope.dtype in FLOAT_DTYPES, f"q_nope {q_nope.dtype} {tuple(q_nope.shape)}")
        tokens, heads, lora = q_nope.shape
        need(q_nope.stride(-1) == 1, "q_nope inner stride must be 1")
        if self.version < (0, 1, 17):
            need(q_nope.is_contiguous(), "q_nope must be dense before AITER 0.1.17")
        need(q_pe.dim() == 3 and tuple(q_pe.shape[:2]) == (tokens, heads), f"q_pe shape {tuple(q_pe.shape)}")
        need(q_pe.dtype == q_nope.dtype, f"q_pe dtype {q_pe.dtype} != q_nope {q_nope.dtype}")
        rope = q_pe.shape[2]
        kv2 = kv_c.squeeze(1) if kv_c.dim() == 3 else kv_c
        pe2 = k_pe.squeeze(1) if k_pe.dim() == 3 else k_pe
        need(kv2.dim() == 2 and kv2.shape[1] == lora, f"kv_c shape {tuple(kv_c.shape)}; kv_lora_rank must be {lora}")
        need(pe2.dim() == 2 and pe2.shape[1] == rope, f"k_pe shape {tuple(k_pe.shape)}")
        need(kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1, "kv_c / k_pe inner stride must be 1")
        need(kv_c.dtype == q_nope.dtype and k_pe.dtype == q_nope.dtype, "kv_c / k_pe dtype must match q_nope")
        need(kv_cache.dtype != torch.uint8, "kv cache data type is not supported (uint8: view it as fp8)")
        need(kv_cache.dtype in (*FP8_DTYPES, *FLOAT_DTYPES), f"kv_cache dtype {kv_cache.dtype}")
        if kv_cache.dtype in FP8_DTYPES:
            need(kv_cache.dtype == self.fmt.dtype, f"kv_cache {kv_cache.dtype} is not this arch's fp8 {self.fmt.dtype}")
        need(kv_cache.dim() == 3 and kv_cache.shape[2] == lora + rope, f"kv_cache shape {tuple(kv_cache.shape)}")
        need(q_out.dim() == 3 and tuple(q_out.shape) == (tokens, heads, lora + rope),
             f"q_out shape {tuple(q_out.shape)}")
        need(q_out.dtype not in FP8_DTYPES or kv_cache.dtype in FP8_DTYPES, "fp8 q_out needs an fp8 kv cache")
        need(heads == 1 or q_out.stride(1) == lora + rope,
             f"q_out heads {q_out.stride(1)} apart; the kernels store each token's within heads x {lora + rope}")
        need(slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}")
        need(slot_mapping.dim() == 1 and slot_mapping.shape[0] == tokens,
             f"slot_mapping has {slot_mapping.shape[0]} entries; the grid reads q rows 0..{tokens - 1}")
        need(tokens <= 1 or slot_mapping.stride(0) == 1, "slot_mapping must be dense (read by pointer)")
        for name, s in (("k_scale", k_scale), ("q_scale", q_scale)):
            need(s.dtype == torch.float32 and s.numel() >= 1, f"{name} must be fp32, got {s.dtype}")
        need(positions.dtype == torch.int64 and positions.dim() == 1 and positions.shape[0] >= tokens,
             f"positions must be int64 [T], got {positions.dtype} {tuple(positions.shape)}")
        need(positions.is_contiguous(), "positions must be dense")
        need(cos_cache.dtype == q_nope.dtype and sin_cache.dtype == q_nope.dtype,
             f"cos/sin dtype {cos_cache.dtype} must be the query dtype {q_nope.dtype}")
        need(cos_cache.dim() == 2 and tuple(sin_cache.shape) == tuple(cos_cache.shape),
             "cos/sin must be [max_pos, rot/2]")
        rot_dim = 2 * cos_cache.shape[-1]
        need(rot_dim == rope, f"rot_dim {rot_dim} != rope dim {rope}")
        kernel = self.kernel_for(lora, heads, rot_dim, kv_cache.shape[1], tokens, is_nope_first)
        if kernel == "per_head":
            need(is_nope_first, "the per-head kernel needs is_nope_first")
        clamps = self.has_clamp and kernel in ("per_head", "opt")
        max_pos = cos_cache.shape[0]
        if tokens and not clamps:
            need(int(positions[:tokens].min()) >= 0 and int(positions[:tokens].max()) < max_pos,
                 f"{kernel} kernel of AITER {self.version} does not clamp positions: "
                 f"positions up to {int(positions[:tokens].max())} read past a {max_pos}-row cos/sin table")
        self.calls.append({
            "tokens": tokens, "heads": heads, "kernel": kernel, "clamps": clamps,
            "identity": bool((cos_cache == 1).all() and (sin_cache == 0).all()),
            "positions_max": int(positions[:tokens].max()) if tokens else None,
            "arity": 14 + len(extra), "slot_mapping": slot_mapping.clone(),
        })
        self._compute(q_nope, q_pe, kv2, pe2, kv_cache, q_out, slot_mapping, k_scale, q_scale,
                      positions, cos_cache, sin_cache, is_neox, compute_all_q_rope, clamps, is_nope_first)

    def _compute(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                 k_pe: torch.Tensor, kv_cache: torch.Tensor, q_out: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor,
                 positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                 is_neox: bool, compute_all_q_rope: bool, clamps: bool, is_nope_first: bool = True) -> None:
        tokens = q_nope.shape[0]
        pos = positions[:tokens]
        if clamps:
            pos = pos.clamp(0, cos_cache.shape[0] - 1)
        cos = cos_cache[pos].float()
        sin = sin_cache[pos].float()

        def rotate(x: torch.Tensor) -> torch.Tensor:  # x [..., T?, R] in fp32, tables [T, R/2]
            half = x.shape[-1] // 2
            c, s = (cos, sin) if x.dim() == 2 else (cos[:, None], sin[:, None])
            if is_neox:
                a, b = x[..., :half], x[..., half:]
                return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

        fp8 = kv_cache.dtype in FP8_DTYPES
        fmax = self.fmt.fmax

        def nope_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            if not fp8:
                return x.to(dtype)
            return (x.float() * (1.0 / scale.float().reshape(-1)[0])).clamp(-fmax, fmax).to(dtype)

        def rope_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            if not fp8:
                return x.to(dtype)
            # no clamp: a value past the format's range has no code (e4m3fn has no inf), where torch's own
            # conversion would saturate it; modelled as NaN, the cast's result without saturation
            scaled = x * (1.0 / scale.float().reshape(-1)[0])
            return scaled.masked_fill(scaled.abs() > fmax, float("nan")).to(dtype)

        def ordered(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
            # AITER's layout switch: [nope | rope] when is_nope_first, else [rope | nope]
            return torch.cat([nope, rope] if is_nope_first else [rope, nope], dim=-1)

        rows = (slot_mapping >= 0) | compute_all_q_rope
        q_vals = ordered(nope_cast(q_nope, q_scale, q_out.dtype), rope_cast(rotate(q_pe.float()), q_scale, q_out.dtype))
        q_out[rows] = q_vals[rows]
        valid = (slot_mapping >= 0).nonzero().squeeze(1)
        slots = slot_mapping[valid]
        block_size = kv_cache.shape[1]
        kv_vals = ordered(nope_cast(kv_c, k_scale, kv_cache.dtype), rope_cast(rotate(k_pe.float()), k_scale,
                                                                             kv_cache.dtype))
        kv_cache[slots // block_size, slots % block_size] = kv_vals[valid]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> AiterStandIn:
        """Put ``aiter`` / ``aiter.ops`` / ``aiter.ops.cache`` into sys.modules with this op, let the
        overlay's AITER provider take CPU tensors, and forget its cached op; ``monkeypatch`` undoes
        all of it."""
        from k3_amd_overlay.ops import aiter_qk_cache

        standin = self

        if self.has_clamp:
            def fused_qk_rope_concat_and_cache_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out,
                                                   slot_mapping, k_scale, q_scale, positions,
                                                   cos_cache, sin_cache, is_neox, is_nope_first,
                                                   compute_all_q_rope=False):
                return standin.op(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale,
                                  q_scale, positions, cos_cache, sin_cache, is_neox, is_nope_first,
                                  compute_all_q_rope)
        else:
            def fused_qk_rope_concat_and_cache_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out,  # type: ignore[misc]
                                                   slot_mapping, k_scale, q_scale, positions,
                                                   cos_cache, sin_cache, is_neox, is_nope_first):
                return standin.op(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale,
                                  q_scale, positions, cos_cache, sin_cache, is_neox, is_nope_first)

        aiter = types.ModuleType("aiter")
        ops = types.ModuleType("aiter.ops")
        cache = types.ModuleType("aiter.ops.cache")
        for module in (aiter, ops, cache):
            module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        cache.fused_qk_rope_concat_and_cache_mla = fused_qk_rope_concat_and_cache_mla  # type: ignore[attr-defined]
        aiter.ops = ops  # type: ignore[attr-defined]
        ops.cache = cache  # type: ignore[attr-defined]
        aiter.__version__ = ".".join(map(str, self.version))  # type: ignore[attr-defined]
        for module in (aiter, ops, cache):
            monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(aiter_qk_cache, "_op", None)
        monkeypatch.setattr(aiter_qk_cache, "device_missing", lambda device: None)  # the stand-in runs on CPU
        return self
