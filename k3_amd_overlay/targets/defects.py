"""Known defects of vLLM's own K3 AMD code that a deployment can hit with or without the overlay:
recognised by probing the source (as the shapes are), recorded in the marker, shown by the doctor,
and named on the exception when one fires. The overlay does not work around them: it must not
make them worse, and it says whose code failed."""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from k3_amd_overlay.targets import sources as src

K3_WRAPPER = src.K3_WRAPPER


@dataclass(frozen=True)
class UpstreamDefect:
    name: str
    present: Callable[[src.VllmSources], bool]  # this vLLM's source has it
    # From the environment alone: False where it rules the defect out, None where it may fire (the
    # rest of the trigger is per layer: vLLM evaluates it when it builds the layer, and the overlay
    # records what happened then), True where the environment alone makes it fire.
    triggered: Callable[[Mapping[str, str]], bool | None]
    when: str  # the trigger, in words
    what: str  # what fails, and the way out

    def describe(self) -> str:
        return f"{self.name}: {self.what} (fires when {self.when})"


def _fused_qk_prep_reads_w_uk_t(s: src.VllmSources) -> bool:
    wrapper = src.find_class(s.tree(src.K3_MLA), K3_WRAPPER)
    method = src.find_method(wrapper, "_fused_qk_prep_supported")
    return src.mentions(method, "W_UK_T") and src.calls(src.find_method(wrapper, "__init__"),
                                                        "self._fused_qk_prep_supported")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    return env.get(name, "1" if default else "0").strip().lower() in ("1", "true")


def _aiter_mla_on(env: Mapping[str, str]) -> bool:
    """AITER on (off by default) with its MLA on (on by default): vLLM's fused decode can run at all."""
    return _flag(env, "VLLM_ROCM_USE_AITER", False) and _flag(env, "VLLM_ROCM_USE_AITER_MLA", True)


def _w_uk_t_possible(env: Mapping[str, str]) -> bool | None:
    """vLLM 0.32's ``_fused_qk_prep_supported`` reads ``W_UK_T`` (before load) only with AITER MLA on
    and its fp8 BMM off; whether it gets there is decided per layer (fp8 KV cache, kv_lora_rank x heads
    >= 2048, no DCP/PCP/HiSparse/padded heads, and its fp4 BMM off: that needs
    VLLM_ROCM_USE_AITER_FP4BMM, on by default, a CDNA 4 (gfx950) GPU and a bf16 kv_b_proj)."""
    on = _aiter_mla_on(env) and not _flag(env, "VLLM_ROCM_USE_AITER_FP8BMM", True)
    return None if on else False


W_UK_T_BEFORE_LOAD = UpstreamDefect(
    name="vllm-k3-fused-qk-prep-reads-W_UK_T-before-load",
    present=_fused_qk_prep_reads_w_uk_t,
    triggered=_w_uk_t_possible,
    when="VLLM_ROCM_USE_AITER=1 with AITER MLA on and VLLM_ROCM_USE_AITER_FP8BMM=0, on a layer with an fp8 KV "
         "cache and >= 4 heads per rank where vLLM's fp4 BMM is off (it is on only on a gfx950 GPU, with a bf16 "
         "kv_b_proj and VLLM_ROCM_USE_AITER_FP4BMM, on by default: every MI300X takes the defect)",
    what=(f"vLLM's {K3_WRAPPER}.__init__ calls _fused_qk_prep_supported(), which reads attn.W_UK_T before the "
          "weights are loaded (W_UK_T does not exist yet): building the model fails with AttributeError, with "
          "or without this overlay; keep VLLM_ROCM_USE_AITER_FP8BMM on (vLLM then never fuses the decode itself) "
          "or use a vLLM whose check does not read W_UK_T (0.33)"),
)


FUSED_WRITE_OP = "fused_qk_rope_concat_and_cache_mla"  # AITER's op vLLM's fused decode calls


def _fused_decode_passes_positions(s: src.VllmSources) -> bool:
    """vLLM 0.32-0.33's ``_fused_decode`` hands AITER's fused write each token's real ``positions``
    beside a one-row cos/sin cache; 0.34 hands it zeros."""
    method = src.find_method(src.find_class(s.tree(src.K3_MLA), K3_WRAPPER), "_fused_decode")
    return any(isinstance(n, ast.Call) and ast.unparse(n.func).rsplit(".", 1)[-1] == FUSED_WRITE_OP
               and any(isinstance(a, ast.Name) and a.id == "positions" for a in n.args)
               for n in ast.walk(method or ast.Module(body=[], type_ignores=[])))


def _fused_decode_possible(env: Mapping[str, str]) -> bool | None:
    """vLLM's fused decode runs only with AITER and its MLA on, and with its fp4 BMM on (taken on
    gfx950 only) or its fp8 BMM off; the rest is decided per layer (the GPU, the KV cache, heads)."""
    on = _aiter_mla_on(env) and (_flag(env, "VLLM_ROCM_USE_AITER_FP4BMM", True)
                                 or not _flag(env, "VLLM_ROCM_USE_AITER_FP8BMM", True))
    return None if on else False


REAL_POSITIONS_IN_FUSED_DECODE = UpstreamDefect(
    name="vllm-k3-fused-decode-passes-real-positions",
    present=_fused_decode_passes_positions,
    triggered=_fused_decode_possible,
    when="VLLM_ROCM_USE_AITER=1 with AITER MLA on and the fp4 BMM on (gfx950) or the fp8 BMM off, on a layer "
         "vLLM's own fused decode takes (K3_AMD_OVERLAY unset, or auto deferring to vLLM), with an AITER whose "
         "fused write does not clamp positions",
    what=(f"vLLM's {K3_WRAPPER}._fused_decode passes each token's real position to AITER's {FUSED_WRITE_OP} "
          "with a one-row cos/sin cache, relying on the kernel clamping it; vLLM 0.34's amd/mla.py records that "
          "AITER v0.1.26's head-grouped kernel does not (cos = sin = 0 past the cache: q_pe and the cached k_pe "
          "zeroed at one head per block, a fault at more), and passes zeros (its account: this overlay has not "
          "reproduced it); naming the overlay's decode provider (K3_AMD_OVERLAY_QK_CACHE_PROVIDER=triton or aiter) "
          "takes from vLLM the batches the overlay fuses (triton passes no positions, aiter zeros; a batch a "
          "self-measurement sends to stock stays vLLM's), and K3_AMD_OVERLAY=stock turns vLLM's fused decode "
          "off"),
)


def trigger_words(triggered: bool | None) -> str:
    """How the doctor and the log say a defect's state."""
    if triggered is None:
        return "may fire here: decided per layer when vLLM builds it"
    return "TRIGGERED here" if triggered else "not triggered here"


UPSTREAM_DEFECTS: tuple[UpstreamDefect, ...] = (W_UK_T_BEFORE_LOAD, REAL_POSITIONS_IN_FUSED_DECODE)


def present_defects(sources: src.VllmSources) -> list[UpstreamDefect]:
    return [d for d in UPSTREAM_DEFECTS if d.present(sources)]

