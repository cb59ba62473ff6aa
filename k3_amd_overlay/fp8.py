"""The two fp8 formats the overlay writes (OCP e4m3fn on MI355X and NVIDIA, e4m3fnuz on
MI300X), their limits, and how a dtype, a name or a platform maps to one. The one home for
every fp8 constant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Fp8Format:
    """One fp8 storage format: its name, the torch dtype name and its largest finite value."""

    name: str
    torch_dtype_name: str
    fmax: float
    # vLLM's own static quant (QuantFP8) clamps here instead of fmax for this format; the fused
    # paths clamp at fmax as the spec says, so stock and fused differ for |x/s| in (this, fmax].
    vllm_quant_fmax: float

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_dtype_name)


E4M3FN = Fp8Format("e4m3fn", "float8_e4m3fn", 448.0, 448.0)
E4M3FNUZ = Fp8Format("e4m3fnuz", "float8_e4m3fnuz", 240.0, 224.0)
FP8_FORMATS: dict[str, Fp8Format] = {f.name: f for f in (E4M3FN, E4M3FNUZ)}

# A KV-cache dtype string vLLM accepts that the fused paths can write (a plain per-tensor fp8
# cache). fp8_ds_mla / nvfp4_ds_mla are opaque per-token byte formats and never qualify.
FUSABLE_KV_CACHE_DTYPES = frozenset({"fp8", "fp8_e4m3"})


def format_of(dtype_or_name: object) -> Fp8Format:
    """The fp8 format of a torch dtype or a format name; raises ValueError naming what is allowed."""
    if isinstance(dtype_or_name, str):
        key = dtype_or_name.removeprefix("float8_")
        if key in FP8_FORMATS:
            return FP8_FORMATS[key]
    else:
        for fmt in FP8_FORMATS.values():
            if str(dtype_or_name) == f"torch.{fmt.torch_dtype_name}":
                return fmt
    allowed = ", ".join(f"torch.{f.torch_dtype_name} / {f.name!r}" for f in FP8_FORMATS.values())
    raise ValueError(f"fp8 format {dtype_or_name!r} is not supported; allowed: {allowed}")


def format_for_gcn_arch(gcn_arch_name: str) -> Fp8Format:
    """The format a ROCm GPU stores fp8 in: fnuz on gfx94x (MI300 family), OCP fn elsewhere."""
    return E4M3FNUZ if "gfx94" in gcn_arch_name else E4M3FN


def device_format(device: torch.device | None = None) -> Fp8Format:
    """The fp8 format native to the current (or given) GPU; e4m3fn when there is none."""
    import torch

    if torch.cuda.is_available() and torch.version.hip is not None:
        props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
        return format_for_gcn_arch(getattr(props, "gcnArchName", ""))
    return E4M3FN
