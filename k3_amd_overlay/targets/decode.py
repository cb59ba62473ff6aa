"""The fused decode step of one K3 MLA layer: the site acting on the layer's decode plan
(fusions/qk_cache.py). For a batch the plan takes, it runs one fused launch in place of the KV
write, the query concat and its fp8 quant (after vLLM's own W_UK absorption) or of all four (the
absorption bf16, fp8 or MXFP4, as the layer's stock path runs it), then vLLM's own MQA kernel and V
up-projection; any other batch runs vLLM's stock attention call. A fused launch that fails on its
config is tried again on the arch's safe config; one that still fails (a kernel this GPU's Triton
cannot build) refuses its fusion for the process and the batch runs stock (kernel_failures.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.fp8 import Fp8Format, format_of
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant, BatchFacts, DecodePath, DecodePlan
from k3_amd_overlay.fusions.states import FusionState
from k3_amd_overlay.kernels import names
from k3_amd_overlay.kernels.probe import precompile_once
from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
from k3_amd_overlay.ops import qk_cache as qk_cache_op
from k3_amd_overlay.ops.reference import absorb_w_uk_reference
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE
from k3_amd_overlay.regions import DECODE_REGION, region
from k3_amd_overlay.targets import vllm_env

DECODE_SITE = "_k3_overlay_qk_cache"  # the attribute a layer (wrapper or MLAAttention) holds its site under
ContextGetter = Callable[[str], tuple[Any, Any, torch.Tensor, torch.Tensor | None]]
# Runs one layer's attention step between the KV connector's hooks (wait_for_layer_load before,
# save_kv_layer after), as vLLM runs its stock attention call: (layer name, the step) -> its output.
KvTransfer = Callable[[str, Callable[[], torch.Tensor]], torch.Tensor]
# A route of the site: (..., output=None) -> the step's output, written into ``output`` where given.
Route = Callable[..., torch.Tensor]
EagerStep = Callable[..., None]  # into_output, made an eager break by vLLM's eager_break_during_capture
ABSORB_KERNELS = {AbsorbVariant.FP4: names.ABSORB_MXFP4_QK_CACHE_KERNEL, AbsorbVariant.FP8:
                  names.ABSORB_FP8_QK_CACHE_KERNEL}  # the Triton kernel of each absorbed variant


def triton_absorb_kernel(variant: AbsorbVariant) -> str:
    """The Triton kernel of an absorbed variant (bf16 W_UK_T: the plain absorb kernel)."""
    return ABSORB_KERNELS.get(variant, names.ABSORB_QK_CACHE_KERNEL)


def into_output(route: Route, output: torch.Tensor, *args: Any) -> None:
    """Run one route with its result left in ``output`` (a buffer allocated before the step). Under
    vLLM's breakable CUDA-graph capture this runs as an eager break: it is replayed as a Python call,
    so the route decides fused or stock from each replayed batch's own attention metadata."""
    result = route(*args, output=output)
    if result.data_ptr() != output.data_ptr():
        output.copy_(result)


def batch_facts(attn_metadata: Any, slot_mapping: torch.Tensor | None, kv_cache: torch.Tensor,
                q_dcp_replicated: torch.Tensor | None) -> BatchFacts | None:
    """What the per-batch predicate reads, from vLLM's attention metadata (None in profile runs)."""
    if attn_metadata is None:
        return None
    return BatchFacts(num_actual_tokens=int(attn_metadata.num_actual_tokens),
                      num_decode_tokens=int(attn_metadata.num_decode_tokens),
                      has_cache=slot_mapping is not None and kv_cache.numel() > 0,
                      dcp_replicated=q_dcp_replicated is not None)


def absorb_w_uk(attn: Any, variant: AbsorbVariant, q_nope_t: torch.Tensor) -> torch.Tensor:
    """ql_nope [B, N, L] from q_nope (N, B, P): the same calls, in the same precedence, as the
    stock decode path, so the fused path starts from bit-identical ql_nope."""
    if variant is AbsorbVariant.FP4:
        from vllm._aiter_ops import rocm_aiter_ops

        fp8_attention = attn.kv_cache_dtype.startswith("fp8")
        # Y (the output) is required on vLLM 0.29-0.30 and optional from 0.31; AITER allocates it when None.
        return rocm_aiter_ops.batched_gemm_a16wfp4(
            q_nope_t, attn.W_K, attn.W_K_scale, None, transpose_bm=True, prequant=True,
            y_scale=attn._q_scale if fp8_attention else None,
        )
    if variant is AbsorbVariant.FP8:
        from vllm._aiter_ops import rocm_aiter_ops

        return rocm_aiter_ops.triton_fp8_bmm(
            q_nope_t, attn.W_K, attn.W_K_scale, group_size=128, transpose_bm=True
        )
    return absorb_w_uk_reference(q_nope_t.transpose(0, 1), attn.W_UK_T)


@dataclass
class DecodeSite:
    """One layer's decode plan and what its fused paths need at run time."""

    plan: DecodePlan
    on_effective: Callable[[int], None]  # qk_cache ran, given the batch's (padded) token count
    on_absorb_effective: Callable[[int], None]  # absorb_qk_cache ran
    fmt: Fp8Format | None = None  # the KV cache's fp8 format, where the overlay fuses
    context: ContextGetter | None = None  # vLLM's per-layer attention context, where the overlay fuses
    kv_transfer: KvTransfer | None = None  # vLLM's KV-connector hooks (disaggregation, offloading)
    query_heads: int = 0  # heads the fp8 query buffer is allocated with (> the layer's: backend padding)
    eager_step: EagerStep | None = None  # ``into_output`` as an eager break of vLLM's breakable capture
    on_failure: Callable[[str, str], None] | None = None  # records a fusion refused for a failed kernel
    on_degraded: Callable[[], None] | None = None  # records a config degraded to the safe one

    @property
    def absorb_kernel(self) -> str:
        """The Triton kernel of the layer's absorbed variant."""
        return triton_absorb_kernel(self.plan.absorb)

    def kernels(self, only: str | None = None) -> list[tuple[str, str]]:
        """(fusion, kernel) for each of the overlay's Triton kernels the plan's fused launches run
        (absorb first; ``only``: that fusion's): a Triton provider's own kernel, and the query quant
        after AITER's launch in the aiter providers of the fp8 and MXFP4 absorptions."""
        plan, found = self.plan, []
        absorb = plan.absorb_decision
        if absorb.state is FusionState.APPLIED and absorb.provider == "triton":
            found.append((ABSORB_QK_CACHE, self.absorb_kernel))
        elif absorb.state is FusionState.APPLIED and absorb.provider == "aiter" and plan.absorb in ABSORB_KERNELS:
            found.append((ABSORB_QK_CACHE, names.STATIC_QUANT_KERNEL))
        if plan.decision.state is FusionState.APPLIED and plan.decision.provider == "triton":
            found.append((QK_CACHE, names.QK_CACHE_KERNEL))
        return [(fusion, kernel) for fusion, kernel in found if only in (None, fusion)]

    def compile_ahead(self, kernel: str, device: torch.device, dtype: torch.dtype, heads: int,
                      block_size: int) -> float | None:
        """Triton ``kernel``'s compile for this layer's launches (``probe.precompile_once``, once a
        process): the seconds, or None where nothing compiled. The installer calls it at load; a
        fused call finds it done, unless the cache's blocks are of another kind than ``block_size``."""
        assert self.fmt is not None
        return precompile_once("triton", kernel, device, dtype, heads, self.fmt, block_size)

    def path_for(self, attn_metadata: Any, slot_mapping: torch.Tensor | None, kv_cache: torch.Tensor,
                 q_dcp_replicated: torch.Tensor | None) -> DecodePath | None:
        return self.plan.path_for(batch_facts(attn_metadata, slot_mapping, kv_cache, q_dcp_replicated),
                                  kernel_failures.failed())

    def try_fused_decode(self, path: DecodePath, attn: Any, q: torch.Tensor, kv_c_normed: torch.Tensor,
                         k_pe: torch.Tensor, output_shape: Any, attn_metadata: Any, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor | None:
        """``fused_decode``, or None where its fused launch failed: the fusion is refused for the
        process from now on, and the caller routes this batch as if the plan had not taken it."""
        try:
            return self.fused_decode(path, attn, q, kv_c_normed, k_pe, output_shape, attn_metadata, kv_cache,
                                     slot_mapping, output)
        except kernel_failures.KernelFailed as failure:
            kernel_failures.refuse(failure, self.on_failure or (lambda fusion, why: None))
            return None

    def through_break(self, route: Route, q: torch.Tensor, output_shape: Any, *args: Any) -> torch.Tensor:
        """``route(*args)``, or, while vLLM's breakable CUDA-graph capture records this layer, the
        route as an eager break writing into a buffer allocated inside the capture (stable across
        replays): work decided per batch must not be recorded with the capture's dummy batch."""
        if self.eager_step is None or not vllm_env.breakable_capture_active():
            return route(*args, output=None)
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        self.eager_step(route, output, *args)
        return output

    def fused_decode(self, path: DecodePath, attn: Any, q: torch.Tensor, kv_c_normed: torch.Tensor,
                     k_pe: torch.Tensor, output_shape: Any, attn_metadata: Any,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     output: torch.Tensor | None = None) -> torch.Tensor:
        """The decode-only MLA step with the fused launch ``path`` names; the MQA kernel and the V
        up-projection are stock's. A configured KV connector's per-layer hooks run around it, as
        around vLLM's stock attention call."""

        def step() -> torch.Tensor:
            return self._fused_step(path, attn, q, kv_c_normed, k_pe, output_shape, attn_metadata, kv_cache,
                                    slot_mapping, output)

        return self.kv_transfer(attn.layer_name, step) if self.kv_transfer is not None else step()

    def _fused_step(self, path: DecodePath, attn: Any, q: torch.Tensor, kv_c_normed: torch.Tensor,
                    k_pe: torch.Tensor, output_shape: Any, attn_metadata: Any,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    output: torch.Tensor | None) -> torch.Tensor:
        assert self.fmt is not None
        plan = self.plan
        batch_rows = q.shape[0]  # with CUDA-graph padding: the captured graph's size
        num_tokens = attn_metadata.num_actual_tokens  # CUDA-graph padding rows are not attended
        q = q[:num_tokens]
        q_nope, q_pe = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        cache = kv_cache if kv_cache.dtype == self.fmt.dtype else kv_cache.view(self.fmt.dtype)
        # Where the backend pads the query heads (AITER MLA), the query is a view of a buffer that wide,
        # which the backend takes without copying.
        heads = q.shape[1]
        q_out = torch.empty((num_tokens, max(self.query_heads, heads), attn.kv_lora_rank + attn.qk_rope_head_dim),
                            dtype=self.fmt.dtype, device=q.device)[:, :heads]
        kv_c, k_pe, slots = kv_c_normed[:num_tokens], k_pe[:num_tokens].reshape(num_tokens, -1), \
            slot_mapping.flatten()[:num_tokens]
        if path is DecodePath.ABSORB:
            provider = plan.absorb_decision.provider
            weight = attn.W_K if plan.absorb in ABSORB_KERNELS else attn.W_UK_T

            def launch() -> None:
                for _, kernel in self.kernels(ABSORB_QK_CACHE):
                    self.compile_ahead(kernel, q.device, q.dtype, heads, cache.shape[1])
                if plan.absorb is AbsorbVariant.FP4:
                    absorb_op.run_mxfp4_provider(provider, q_nope, weight, attn.W_K_scale, q_pe, kv_c, k_pe, cache,
                                                 slots, attn._k_scale, attn._q_scale, q_out, self.fmt)
                elif plan.absorb is AbsorbVariant.FP8:
                    absorb_op.run_fp8_provider(provider, q_nope, weight, attn.W_K_scale, q_pe, kv_c, k_pe, cache,
                                               slots, attn._k_scale, attn._q_scale, q_out, self.fmt,
                                               format_of(weight.dtype))
                else:
                    absorb_op.run_provider(provider, q_nope, weight, q_pe, kv_c, k_pe, cache, slots, attn._k_scale,
                                           attn._q_scale, q_out, self.fmt)

            kernel_failures.guarded(ABSORB_QK_CACHE, launch, self.on_degraded)
            self.on_absorb_effective(batch_rows)
        else:
            ql_nope = absorb_w_uk(attn, plan.absorb, q_nope.transpose(0, 1))

            def launch() -> None:
                for _, kernel in self.kernels(QK_CACHE):
                    self.compile_ahead(kernel, q.device, q.dtype, heads, cache.shape[1])
                qk_cache_op.run_provider(plan.decision.provider, ql_nope, q_pe, kv_c, k_pe, cache, slots,
                                         attn._k_scale, attn._q_scale, q_out, self.fmt)

            kernel_failures.guarded(QK_CACHE, launch, self.on_degraded)
            self.on_effective(batch_rows)
        attn_out, _ = attn.impl.forward_mqa(q_out, cache, attn_metadata, attn)
        if output is None:
            output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        attn._v_up_proj(attn_out, out=output[:num_tokens])
        return output

    def attend(self, attn: Any, stock: Callable[..., torch.Tensor], q: torch.Tensor,
               kv_c_normed: torch.Tensor, k_pe: torch.Tensor, output_shape: Any = None,
               q_dcp_replicated: torch.Tensor | None = None) -> torch.Tensor:
        """The site for an MLAAttention call, inside the census's profiler range: a fused decode when
        the plan takes this batch, else stock (a layer the overlay does not fuse, in stock mode, only
        opens the range). Under torch.compile tracing it stands down to the stock call (no evidence
        hook, no range)."""
        if torch.compiler.is_compiling():
            return stock(q, kv_c_normed, k_pe, output_shape=output_shape, q_dcp_replicated=q_dcp_replicated)
        with region(DECODE_REGION):
            if self.context is not None:
                return self.through_break(self.route_attention, q, output_shape, attn, stock, q, kv_c_normed, k_pe,
                                          output_shape, q_dcp_replicated)
            return stock(q, kv_c_normed, k_pe, output_shape=output_shape, q_dcp_replicated=q_dcp_replicated)

    def route_attention(self, attn: Any, stock: Callable[..., torch.Tensor], q: torch.Tensor,
                        kv_c_normed: torch.Tensor, k_pe: torch.Tensor, output_shape: Any,
                        q_dcp_replicated: torch.Tensor | None, output: torch.Tensor | None = None) -> torch.Tensor:
        """One batch of an MLAAttention call, decided from this batch's attention context."""
        assert self.context is not None
        attn_metadata, _, kv_cache, slot_mapping = self.context(attn.layer_name)
        path = self.path_for(attn_metadata, slot_mapping, kv_cache, q_dcp_replicated)
        if path is not None:
            fused = self.try_fused_decode(path, attn, q, kv_c_normed, k_pe, output_shape, attn_metadata,
                                          kv_cache, slot_mapping, output)
            if fused is not None:
                return fused
        return stock(q, kv_c_normed, k_pe, output_shape=output_shape, q_dcp_replicated=q_dcp_replicated)
