"""Build and run a real vLLM Kimi-K3 MLA layer (``vllm.models.kimi_k3.amd.linear.
KimiMLAAttention``) on a CPU machine, stock or with the overlay, and compare the two.

What is real: vLLM's layer classes, its K3 wrapper and MLAAttention, the weight post-processing,
the front end (projections, norms), the W_UK absorption, vLLM's own static fp8 query quant, the
V up-projection, the forward context and the overlay's patches. What is replaced, because CUDA
wheels on CPU cannot run it (they ship no CPU ``_C.mla_decode_kvcache``): the *attention core*
only, i.e.
the decode kernel ``impl.forward_mqa`` (a torch reference that dequantises with the layer's
scales) and, for an fp8 cache, the KV-cache write ``impl.do_kv_cache_update`` (a torch reference
of ``concat_and_cache_mla``: x / k_scale, saturated) with ``supports_quant_query_input`` on, as
the ROCm AITER backend has it. vLLM 0.33 refuses an fp8 cache for CPU MLA when the backend is
chosen; the harness hides the fp8 dtype from that one check (the layer still holds "fp8").

Needs ``VLLM_TARGET_DEVICE=cpu`` in the environment before vLLM is imported, and ``session()`` open
(every change it makes to vLLM is undone when it closes). Test scaffolding: never shipped."""

from __future__ import annotations

import contextlib
import inspect
import math
import socket
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from k3_amd_overlay.fp8 import Fp8Format, format_of

_STATE: dict[str, Any] = {}


@dataclass(frozen=True)
class LayerSpec:
    num_heads: int = 4
    hidden: int = 256
    q_lora: int = 96
    kv_lora: int = 64
    rope: int = 16
    nope: int = 32
    v: int = 32
    eps: float = 1e-5
    gate: bool = True
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    num_blocks: int = 24
    k_scale: float = 0.5
    q_scale: float = 1.37

    @property
    def latent(self) -> int:
        return self.kv_lora + self.rope


def vllm_config() -> Any:
    """The VllmConfig of the open ``session()``."""
    if "config" not in _STATE:
        raise RuntimeError("layer_harness.session() is not open (the vllm_layer_session fixture opens it)")
    return _STATE["config"]


@contextlib.contextmanager
def session() -> Iterator[Any]:
    """One VllmConfig in context, a world-size-1 gloo group, and the CPU attention core set up for
    an fp8 cache (``_cpu_attention_core_for_fp8``); every change to vLLM undone on exit."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    config = VllmConfig()
    with contextlib.ExitStack() as undo, set_current_vllm_config(config):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        undo.callback(destroy_distributed_environment)
        undo.callback(destroy_model_parallel)
        _STATE["config"] = config
        undo.callback(_STATE.clear)
        _cpu_attention_core_for_fp8(undo)
        yield config


def _cpu_attention_core_for_fp8(undo: contextlib.ExitStack) -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    original_backend = CpuPlatform.__dict__["get_attn_backend_cls"]
    original_init = CPUMLAImpl.__dict__["__init__"]

    def hide(value: Any) -> Any:
        if hasattr(value, "_replace") and str(getattr(value, "kv_cache_dtype", "")).startswith("fp8"):
            return value._replace(kv_cache_dtype="auto")
        return value

    def get_attn_backend_cls(cls: Any, *args: Any, **kwargs: Any) -> str:
        return original_backend.__func__(cls, *map(hide, args), **{k: hide(v) for k, v in kwargs.items()})

    # The ROCm AITER backend takes an fp8 query; the CPU one says it does not. Part of the
    # attention core the harness replaces, so set before the layer (and the overlay) decide.
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if str(_STATE["config"].cache_config.cache_dtype).startswith("fp8"):
            self.supports_quant_query_input = True

    # On a CPU with AMX tiles vLLM prefers its AMX MLA backend (and its AMX W_UK BMM, whose weight
    # packing needs vLLM's compiled CPU ops, absent from these wheels): the harness's core is CPU MLA.
    original_amx = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: False
    undo.callback(setattr, torch.cpu, "_is_amx_tile_supported", original_amx)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CPUMLAImpl.__init__ = __init__
    undo.callback(setattr, CpuPlatform, "get_attn_backend_cls", original_backend)
    undo.callback(setattr, CPUMLAImpl, "__init__", original_init)


def fp8_format() -> Fp8Format:
    from vllm.platforms import current_platform

    return format_of(current_platform.fp8_dtype())


@dataclass
class Layer:
    """A built layer and what the harness counts on it."""

    module: Any
    spec: LayerSpec
    prefix: str
    kv_writes: list[int] = field(default_factory=list)  # tokens written per stock KV-cache write
    mqa_calls: int = 0
    concat_quant_calls: int = 0

    @property
    def wrapper(self) -> Any:
        return self.module.mla_attn

    @property
    def attn(self) -> Any:
        return self.module.mla_attn.mla_attn


def _init_params(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, param in module.named_parameters():
            if param.dim() == 1:
                values = 1.0 + 0.2 * torch.randn(param.shape, generator=gen)
            else:
                values = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1])
            param.copy_(values.to(param.dtype))


def build_layer(spec: LayerSpec, layer_index: int, seed: int = 0) -> Layer:
    """A KimiMLAAttention with deterministic random weights (same seed, same weights), post-load
    processed, with a zeroed KV cache and the attention core replaced as the module says."""
    config = vllm_config()
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.models.kimi_k3.amd.linear import KimiMLAAttention
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    config.cache_config.cache_dtype = spec.kv_cache_dtype
    prefix = f"model.layers.{layer_index}.self_attn"
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(spec.dtype)
    try:
        module = KimiMLAAttention(
            KimiLinearConfig(mla_use_nope=True, rms_norm_eps=spec.eps, mla_use_output_gate=spec.gate),
            hidden_size=spec.hidden, num_heads=spec.num_heads, qk_nope_head_dim=spec.nope,
            qk_rope_head_dim=spec.rope, v_head_dim=spec.v, q_lora_rank=spec.q_lora,
            kv_lora_rank=spec.kv_lora, use_nope=True, cache_config=config.cache_config, prefix=prefix,
        )
    finally:
        torch.set_default_dtype(default_dtype)
    _init_params(module, seed)
    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(sub)
    layer = Layer(module, spec, prefix)
    attn = layer.attn
    attn.process_weights_after_loading(spec.dtype)
    attn._chunked_prefill_workspace_size = 1024
    fp8 = spec.kv_cache_dtype.startswith("fp8")
    attn.kv_cache = torch.zeros((spec.num_blocks, spec.block_size, spec.latent),
                                dtype=torch.uint8 if fp8 else spec.dtype)
    with torch.no_grad():
        attn._k_scale.fill_(spec.k_scale if fp8 else 1.0)
        attn._q_scale.fill_(spec.q_scale if fp8 else 1.0)
    for name, value in (("_k_scale_float", spec.k_scale), ("_q_scale_float", spec.q_scale)):
        if hasattr(attn, name):  # vLLM keeps a float copy beside each scale (0.33 skips a scale of 1.0 by it)
            setattr(attn, name, value if fp8 else 1.0)
    _replace_attention_core(layer, fp8)
    return layer


def _replace_attention_core(layer: Layer, fp8: bool) -> None:
    attn = layer.attn
    impl = attn.impl
    spec = layer.spec
    fmt = fp8_format() if fp8 else None

    mqa_signature = inspect.signature(impl.forward_mqa)

    def forward_mqa(self: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        # bound against this release's own signature, as do_kv_cache_update below
        given = mqa_signature.bind(*args, **kwargs).arguments
        q, cache, attn_metadata = given["q"], given["kv_c_and_k_pe_cache"], given["attn_metadata"]
        layer.mqa_calls += 1
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        q_f = q.float() * (attn._q_scale.float() if q.dtype == getattr(fmt, "dtype", None) else 1.0)
        rows_f = cache.view(fmt.dtype).float() * attn._k_scale.float() if fmt else cache.float()
        decode = attn_metadata.decode
        # rows past the decode tokens (CUDA-graph padding that vLLM's own fused decode passes in)
        # are left zero, as the metadata-driven kernels leave them unread
        out = torch.zeros((q.shape[0], q.shape[1], spec.kv_lora), dtype=spec.dtype)
        for i in range(attn_metadata.num_decode_tokens):
            seq_len = int(decode.seq_lens[i])
            blocks = decode.block_table[i].long()
            rows = rows_f[blocks].reshape(-1, spec.latent)[:seq_len]
            weights = torch.softmax((q_f[i] @ rows.T) * self.scale, dim=-1)
            out[i] = (weights @ rows[:, : spec.kv_lora]).to(spec.dtype)
        return out, None

    impl.forward_mqa = types.MethodType(forward_mqa, impl)

    original_update = impl.do_kv_cache_update
    update_signature = inspect.signature(original_update)

    def do_kv_cache_update(self: Any, *args: Any, **kwargs: Any) -> None:
        # bound against this release's own signature: a call the real method would refuse fails here too
        given = update_signature.bind(*args, **kwargs).arguments
        kv_c_normed, k_pe, kv_cache, slot_mapping = (given[name] for name in
                                                     ("kv_c_normed", "k_pe", "kv_cache", "slot_mapping"))
        layer.kv_writes.append(int((slot_mapping >= 0).sum()))
        if fmt is None:
            return original_update(*args, **kwargs)
        k_scale = given["k_scale"].float()
        # 0.33 skips the scale when the layer's float copy of it is 1.0: the same bytes, if the two agree
        assert not given.get("skip_scale") or bool((k_scale == 1.0).all()), f"skip_scale with k_scale {k_scale}"
        rows = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1).float()
        valid = (slot_mapping >= 0).nonzero().squeeze(1)
        slots = slot_mapping[valid]
        cache = kv_cache.view(fmt.dtype)
        block = cache.shape[1]
        cache[slots // block, slots % block] = (rows[valid] / k_scale).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)
        return None

    impl.do_kv_cache_update = types.MethodType(do_kv_cache_update, impl)
    if fp8:
        impl.supports_quant_query_input = True
    op = attn._decode_concat_quant_fp8_op
    original_forward = op.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        layer.concat_quant_calls += 1
        return original_forward(*args, **kwargs)

    op.forward = counted


@dataclass
class DecodeBatch:
    metadata: Any
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    num_tokens: int


def fill_context(layers: list[Layer], seq_lens: list[int], block_table: torch.Tensor, seed: int) -> None:
    """Give every request seq_len - 1 earlier tokens in the cache: the same bytes in each layer."""
    spec = layers[0].spec
    gen = torch.Generator().manual_seed(seed)
    fp8 = spec.kv_cache_dtype.startswith("fp8")
    fmt = fp8_format() if fp8 else None
    rows = torch.randn((spec.num_blocks, spec.block_size, spec.latent), generator=gen)
    data = (rows / spec.k_scale).to(fmt.dtype).view(torch.uint8) if fmt else rows.to(spec.dtype)
    for layer in layers:
        cache = layer.attn.kv_cache
        for i, seq_len in enumerate(seq_lens):
            for pos in range(seq_len - 1):
                block = int(block_table[i, pos // spec.block_size])
                cache[block, pos % spec.block_size] = data[block, pos % spec.block_size]


def decode_batch(layers: list[Layer], seq_lens: list[int], padding: int = 0, seed: int = 1) -> DecodeBatch:
    """A decode-only batch, one new token per request, plus ``padding`` CUDA-graph padding rows
    (slot -1), with the requests' earlier tokens already in every layer's cache."""
    from vllm.model_executor.layers.attention import mla_attention as mla

    spec = layers[0].spec
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    per_request = -(-max(seq_lens) // spec.block_size)
    assert batch * per_request <= spec.num_blocks, "not enough cache blocks for this batch"
    block_table = torch.randperm(spec.num_blocks, generator=gen)[: batch * per_request].view(batch, per_request).int()
    fill_context(layers, seq_lens, block_table, seed)
    slots = [int(block_table[i, (s - 1) // spec.block_size]) * spec.block_size + (s - 1) % spec.block_size
             for i, s in enumerate(seq_lens)]
    slot_mapping = torch.tensor(slots + [-1] * padding, dtype=torch.int64)
    fields = dict(num_reqs=batch, max_query_len=1, max_seq_len=max(seq_lens), num_actual_tokens=batch,
                  query_start_loc=torch.arange(batch + 1, dtype=torch.int32), slot_mapping=slot_mapping,
                  num_decodes=batch, num_decode_tokens=batch, num_prefills=0, prefill=None,
                  decode=mla.MLACommonDecodeMetadata(block_table=block_table,
                                                     seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                                     dcp_tot_seq_lens=None))
    metadata = mla.MLACommonMetadata(**fields)
    tokens = batch + padding
    hidden = torch.randn((tokens, spec.hidden), generator=gen).to(spec.dtype)
    positions = torch.tensor([s - 1 for s in seq_lens] + [0] * padding, dtype=torch.int64)
    return DecodeBatch(metadata, slot_mapping, positions, hidden, batch)


@contextlib.contextmanager
def forward_context(layer: Layer, batch: DecodeBatch | None) -> Iterator[None]:
    """vLLM's forward context for one forward of ``layer`` on ``batch`` (``None``: a profile run)."""
    from vllm.forward_context import set_forward_context

    name = layer.attn.layer_name
    metadata = {name: batch.metadata} if batch else None
    slots = {name: batch.slot_mapping} if batch else {}
    with torch.no_grad(), set_forward_context(metadata, vllm_config(), slot_mapping=slots):
        yield


def run(layer: Layer, batch: DecodeBatch | None, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of the layer under a forward context; ``batch=None`` is a profile run."""
    x = batch.hidden if batch else hidden
    positions = batch.positions if batch else torch.zeros(x.shape[0], dtype=torch.int64)
    with forward_context(layer, batch):
        if "output" in inspect.signature(layer.module.forward).parameters:
            out = torch.empty_like(x)
            layer.module(positions, x, out)
            return out
        return layer.module(positions, x)
