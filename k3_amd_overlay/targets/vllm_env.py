"""What the running vLLM process says about itself, read the way vLLM reads it: its fp8 dtype, its
config in context (batch size, KV cache block size, compilation mode, served model), its AITER
switch and MLA backend padding, its KV-connector hooks and attention context. Every vLLM import of
the per-layer code is here, each lazy, each falling back where no vLLM config is in context (the
ops' own tests)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from k3_amd_overlay import json_values
from k3_amd_overlay.fp8 import Fp8Format, format_of
from k3_amd_overlay.record import RecordError, check_world


def vllm_fp8_format() -> Fp8Format:
    from vllm.platforms import current_platform

    return format_of(current_platform.fp8_dtype())


def max_batched_tokens() -> int:
    try:
        from vllm.config import get_current_vllm_config

        return int(get_current_vllm_config().scheduler_config.max_num_batched_tokens)
    except Exception:  # no config in context (tests, doctor): the buffer grows on demand
        return 0


def kv_cache_block_size() -> int | None:
    """The KV cache's block size (tokens a block) from vLLM's config in context
    (``cache_config.block_size``, vLLM 0.29-0.33: 16 unless set, and AITER MLA keeps 16), or None
    where no config is in context or the size is not set. vLLM settles it for the attention backends
    (``update_block_size_for_backend``) before the workers load the model under the multiprocess
    executor but after under the single-process one, where a hybrid model's alignment can still
    change it: a decode site then compiles at its first fused call (``probe.precompile_once``)."""
    try:
        from vllm.config import get_current_vllm_config

        size = get_current_vllm_config().cache_config.block_size
    except Exception:  # no config in context (tests, doctor)
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


AITER_SWITCHED_OFF = ("vLLM has AITER switched off (rocm_aiter_ops.is_enabled() is False: VLLM_ROCM_USE_AITER "
                      "is unset or 0, or this is not a supported ROCm GPU)")


def vllm_aiter_missing() -> str | None:
    """AITER providers follow vLLM's own master switch: vLLM registers its AITER ops whenever AITER
    is installed, whatever VLLM_ROCM_USE_AITER says, so an op being present proves nothing."""
    try:
        from vllm._aiter_ops import rocm_aiter_ops
    except ImportError:  # the ops used without vLLM: no switch to follow
        return None
    return None if rocm_aiter_ops.is_enabled() else AITER_SWITCHED_OFF


def with_vllm_aiter_switch(missing: dict[str, str | None]) -> dict[str, str | None]:
    """``missing`` with the aiter provider also refused while vLLM has AITER off."""
    if missing.get("aiter", "absent") is None:
        return {**missing, "aiter": vllm_aiter_missing()}
    return missing


def whole_model_compiled() -> bool:
    """vLLM's STOCK_TORCH_COMPILE mode: the whole model goes through ``torch.compile(fullgraph=True)``
    (vLLM 0.29-0.33's model runner), so every site of the overlay is traced once, and stands down."""
    try:
        from vllm.config import get_current_vllm_config
        from vllm.config.compilation import CompilationMode

        return get_current_vllm_config().compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE
    except Exception:  # no config in context (tests, doctor): nothing is compiled
        return False


AITER_MLA_MODULE = "vllm.v1.attention.backends.mla.rocm_aiter_mla"


def padded_query_heads(attn: Any, num_heads: int) -> int:
    """How many query heads to allocate the fp8 query with: the attention backend's own padded
    count where the backend pads (AITER MLA: ``AiterMLAHelper.get_actual_mla_num_heads``) and takes
    a view of a buffer that wide without copying (vLLM 0.33's ``get_mla_padded_q``, asked with a
    one-token probe); else the layer's own head count (the backend copies whatever it is given)."""
    if type(attn.impl).__module__ != AITER_MLA_MODULE:
        return num_heads
    return _aiter_zero_copy_heads(num_heads)


@functools.cache
def _aiter_zero_copy_heads(num_heads: int) -> int:
    """The AITER MLA backend's padded head count for ``num_heads`` where it takes a padded view
    without copying, else ``num_heads`` (asked once per head count, not per layer)."""
    try:
        from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLAHelper
    except ImportError:
        return num_heads
    padded = int(AiterMLAHelper.get_actual_mla_num_heads(num_heads))
    if padded == num_heads:
        return num_heads
    probe = torch.empty(1, padded, 1)[:, :num_heads]
    zero_copy = AiterMLAHelper.get_mla_padded_q(num_heads, probe).data_ptr() == probe.data_ptr()
    return padded if zero_copy else num_heads


@functools.cache
def kv_transfer_hooks() -> Any:
    """vLLM's own KV-connector decorator (``maybe_transfer_kv_layer``, which wraps the stock MLA
    attention op) around a one-argument step: the fused decode runs between the same
    ``wait_for_layer_load`` and ``save_kv_layer`` calls, and is a plain call without a connector.
    Made once per process and shared by every layer."""
    try:
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
    except ImportError:  # no vLLM (the ops' own tests): no connector either
        return None

    def _k3_overlay_fused_attention(layer_name: str, step: Any) -> Any:
        return step()

    return maybe_transfer_kv_layer(_k3_overlay_fused_attention)


def world_position() -> tuple[int, int, int | None] | None:
    """This process's place in vLLM's distributed world once it has joined it (a process building
    layers has): its global rank, the world's size (every TP/PP/DP rank) and the node count vLLM
    detected, from ``vllm.distributed.parallel_state`` (``get_world_group``, ``get_node_count``; vLLM
    0.29-0.33). None where the process has not joined one (the ops' own tests, doctor)."""
    try:
        from vllm.distributed import parallel_state

        group = parallel_state.get_world_group()
        rank, size = group.rank, group.world_size
    except Exception:  # not joined: get_world_group asserts
        return None
    try:
        nodes = json_values.whole(parallel_state.get_node_count(), 1)
    except Exception:
        nodes = None
    try:
        check_world(rank, size, nodes)  # as check reads it back: a place it would refuse is not recorded
    except RecordError:
        return None
    return rank, size, nodes


DSPARK_NOT_COVERED = ("the DSpark drafter (speculative method 'dspark', K3DSparkModel) builds vLLM's NVIDIA MLA, "
                      "not the K3 AMD layers the overlay patches: its decode runs stock")


def model_coverage() -> dict[str, Any]:
    """What this process serves, for the marker: the served architecture (Kimi-K3, or Kimi-Linear,
    whose MLA layers are the same ``amd/linear.py`` class and take the same fusions), the text model
    that builds the layers, the speculative method (MTP draft layers are K3 AMD layers and are
    covered) and what is not covered."""
    try:
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        model_config = config.model_config
        # the text model's config while its layers are built (a copy made for the language model);
        # ``architecture`` is what vLLM serves, the top-level class (ModelConfig keeps it in the copy)
        text = list(getattr(model_config.hf_config, "architectures", None) or [])
        served = getattr(model_config, "architecture", None) or (text[0] if text else None)
        method = getattr(config.speculative_config, "method", None) if config.speculative_config else None
    except Exception:  # no model config in context (tests, doctor)
        return {}
    return {"architecture": served, "text_model": text, "speculative_method": method,
            "not_covered": [DSPARK_NOT_COVERED] if method == "dspark" else [],
            "breakable_cudagraph": BREAKABLE_EAGER_BREAK if breakable_enabled() else None}


BREAKABLE_MODULE = "vllm.compilation.breakable_cudagraph"  # vLLM 0.29-0.33
BREAKABLE_EAGER_BREAK = ("breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1): the fused decode site runs as an "
                         "eager break, deciding fused or stock for each replayed batch from its own metadata")


def breakable_enabled() -> bool:
    """This process captures breakable CUDA graphs (vLLM 0.29 turns them on by default for K3 and
    Kimi-Linear; 0.30-0.33 when VLLM_USE_BREAKABLE_CUDAGRAPH=1)."""
    try:
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    except ImportError:
        return False
    return bool(is_breakable_cudagraph_enabled())


def breakable_eager_break(fn: Callable[..., None]) -> Callable[..., None] | None:
    """``fn`` made an eager break by vLLM's own ``eager_break_during_capture`` (the decorator vLLM's
    NVIDIA K3 MLA and its unified MLA attention op wear): inside a breakable capture it ends the
    graph segment, runs eagerly, and is replayed as a Python call; elsewhere (and under a FULL
    graph) a plain call. None where this process does not capture breakable graphs."""
    if not breakable_enabled():
        return None
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    return eager_break_during_capture(fn)


def breakable_capture_active() -> bool:
    """vLLM's breakable capture is recording on this thread (read per call: no import on the hot path)."""
    module = sys.modules.get(BREAKABLE_MODULE)
    return module is not None and module.BreakableCUDAGraphCapture.current() is not None


def get_attention_context(layer_name: str) -> tuple[Any, Any, torch.Tensor, torch.Tensor | None]:
    from vllm.model_executor.layers.attention.attention import get_attention_context as vllm_ctx

    return vllm_ctx(layer_name)
