"""One launch of each overlay kernel at K3's widths, through the kernel's own launcher, on empty
tensors in vLLM's layouts: what ``kernels --arch`` compiles for an AMD arch on a CPU, and what the
sites compile ahead on the GPU (every config the arch's table can pick for a layer) as each layer
is installed at model load, before vLLM's profile run and any graph capture. A config that fails
to build is degraded to the arch's safe config and that compiled instead (``launch_configs``).
Meant for compile-only sessions (``target.compile_only``): nothing here runs a kernel on data."""

from __future__ import annotations

import logging
from time import perf_counter

import torch

from k3_amd_overlay import k3, mxfp4
from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.kernels import launch_configs, names, target
from k3_amd_overlay.package import ABSORB_MAX_TOKENS

logger = logging.getLogger("vllm.k3_amd_overlay")

# Decode batches and per-rank query heads swept to reach every rule (K3: 96 heads over TP 1..96).
TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
HEADS = tuple(sorted(set(k3.HEADS_PER_RANK.values())))
# The most tokens a batch of these kernels holds when served: the absorbed launch (and the aiter absorb
# providers' query quant after AITER's launch) takes decode batches up to ABSORB_MAX_TOKENS (the decode
# plan, fusions/qk_cache.py); the other kernels any batch.
SERVED_MOST = {kernel: ABSORB_MAX_TOKENS for kernel in (
    names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL, names.ABSORB_MXFP4_QK_CACHE_KERNEL,
    names.STATIC_QUANT_KERNEL)}


def launch_at(kernel: str, device: torch.device, dtype: torch.dtype, tokens: int, heads: int,
              fmt: Fp8Format, block_size: int = 1) -> None:
    """One launch of ``kernel`` for ``tokens`` tokens and ``heads`` heads (fp8 weights in ``fmt``;
    the KV cache in blocks of ``block_size``, AITER MLA's 1 by default)."""
    lora, rope, nope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM

    def empty(*shape: int, like: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=like, device=device)

    q = empty(tokens, heads, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv_c, k_pe = empty(tokens, lora), empty(tokens, rope)
    cache = empty(tokens // block_size + 1, block_size, lora + rope, like=torch.uint8)
    slots = torch.arange(tokens, dtype=torch.int64, device=device)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    q_out = empty(tokens, heads, lora + rope, like=torch.uint8)
    if kernel == names.RMSNORM_PAIR_KERNEL:
        from k3_amd_overlay.kernels.rmsnorm_pair import rmsnorm_pair

        latent = empty(tokens, k3.Q_LORA_RANK + k3.LATENT_ROW)
        q_c, kv = latent[:, : k3.Q_LORA_RANK], latent[:, k3.Q_LORA_RANK: k3.Q_LORA_RANK + lora]
        rmsnorm_pair(q_c, kv, empty(k3.Q_LORA_RANK), empty(lora), 1e-6, 1e-6, empty(tokens, k3.Q_LORA_RANK),
                     empty(tokens, lora))
    elif kernel == names.QK_CACHE_KERNEL:
        from k3_amd_overlay.kernels.qk_cache import qk_cache

        qk_cache(empty(heads, tokens, lora).transpose(0, 1), q_pe, kv_c, k_pe, cache, slots, scale, scale, q_out,
                 fmt)  # ql_nope: vLLM's bmm output, transposed
    elif kernel == names.STATIC_QUANT_KERNEL:
        from k3_amd_overlay.kernels.static_quant import scaled_quant

        scaled_quant(empty(tokens, heads, lora + rope), scale, q_out, fmt)
    elif kernel == names.ABSORB_QK_CACHE_KERNEL:
        from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache

        absorb_qk_cache(q_nope, empty(lora, heads, nope).permute(1, 2, 0), q_pe, kv_c, k_pe, cache, slots, scale,
                        scale, q_out, fmt)  # vLLM's W_UK_T view
    elif kernel == names.ABSORB_FP8_QK_CACHE_KERNEL:
        from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache

        absorb_fp8_qk_cache(q_nope, empty(heads, lora, nope, like=fmt.dtype), scale, q_pe, kv_c, k_pe, cache, slots,
                            scale, scale, q_out, fmt)
    elif kernel == names.ABSORB_MXFP4_QK_CACHE_KERNEL:
        from k3_amd_overlay.kernels.absorb_mxfp4_qk_cache import absorb_mxfp4_qk_cache

        w_k = empty(lora, heads, nope // 2, like=torch.uint8).transpose(0, 1)
        w_k_scale = empty(lora, heads, nope // mxfp4.GROUP, like=torch.uint8).transpose(0, 1)
        absorb_mxfp4_qk_cache(q_nope, w_k, w_k_scale, q_pe, kv_c, k_pe, cache, slots, scale, scale, q_out, fmt)
    else:
        raise ValueError(f"unknown kernel {kernel!r} (known: {', '.join(launch_configs.KERNEL_PARAMETERS)})")


def _specialization(tokens: int) -> int:
    """Triton compiles an int argument apart when it is 1 or a multiple of 16: the class of ``tokens``."""
    return 0 if tokens == 1 else 1 if tokens % 16 == 0 else 2


Config = launch_configs.Config


def reachable(kernel: str, arch: str, heads: tuple[int, ...] = HEADS, device_name: str | None = None,
              every_rule: bool = False) -> list[tuple[Config, list[tuple[int, int]], list[str]]]:
    """Each distinct config the dispatch picks for ``kernel`` on ``arch`` over the decode batches it
    serves (SERVED_MOST; with ``every_rule``, any batch: every rule of the table, as ``kernels --arch``
    compiles them) and these per-rank heads: (config, batches and heads that reach it, one for each
    kind of batch size Triton compiles apart, the rules it serves)."""
    rules, _ = launch_configs.resolve(arch, device_name)[kernel]
    heads_swept = (1,) if kernel == names.RMSNORM_PAIR_KERNEL else heads
    if every_rule and kernel != names.RMSNORM_PAIR_KERNEL:  # each rule's own head bound too (a tuned file's)
        heads_swept = tuple(sorted({*heads_swept, *(r.heads for r in rules if r.heads is not None)}))
    # every batch size up to past the largest bound: each rule's first batch of each kind, in order
    last = max([r.tokens for r in rules if r.tokens is not None] + [max(TOKENS)]) + 32
    if not every_rule:
        last = min(last, SERVED_MOST.get(kernel, last))
    found: dict[Config, tuple[dict[tuple[int, int], tuple[int, int]], list[str]]] = {}
    for rule in rules:
        hits = [(t, h) for h in heads_swept for t in range(1, last + 1) if launch_configs.rule_for(rules, t, h) is rule]
        if not hits:
            continue
        samples, labels = found.setdefault(rule.config, ({}, []))
        labels.append(launch_configs.label(rule))
        for t, h in hits:
            samples.setdefault((_specialization(t), h), (t, h))
    return [(config, list(samples.values()), labels) for config, (samples, labels) in found.items()]


def precompile(kernel: str, device: torch.device, dtype: torch.dtype, heads: int, fmt: Fp8Format,
               block_size: int = 1) -> int:
    """Compile (not run) every config the arch's table can pick for ``kernel`` at ``heads`` heads on
    ``device``, for each kind of batch size Triton compiles apart; returns how many configs. A config
    that fails is degraded to the safe config, which is compiled in its place, for every batch that
    config served (the batches compiled before it failed too: all are compiled again while a pass
    degrades another config); raises what Triton raises for the safe config."""
    where = target.of(device)
    from k3_amd_overlay.kernels.launch import device_name

    configs = reachable(kernel, where.arch, (heads,), device_name(device))
    with target.compile_only(None):
        while True:  # each pass after the first follows newly degraded configs: they end
            failed = _failed_count()
            for _, samples, _ in configs:
                for tokens, config_heads in samples:
                    while True:
                        try:
                            launch_at(kernel, device, dtype, tokens, config_heads, fmt, block_size)
                        except launch_configs.ConfigDegraded:
                            continue
                        break
            if _failed_count() == failed:
                return len(configs)


def _failed_count() -> int:
    return sum(len(entries) for entries in launch_configs.degraded().values())


_precompiled: set[tuple[str, torch.device, torch.dtype, int, str, int]] = set()


def precompile_once(provider: str | None, kernel: str, device: torch.device, dtype: torch.dtype, heads: int,
                    fmt: Fp8Format, block_size: int = 1) -> float | None:
    """``precompile`` for a Triton provider on a GPU, once in the process for this kernel, device,
    dtype, head count, fp8 format and kind of cache block size (Triton compiles 1, multiples of 16
    and the rest apart): the seconds it took (logged), or None where nothing was compiled. The
    installer calls it as each layer is built; a site's fused call calls it too, which compiles
    only where the install could not (vLLM's block size unknown at load, or another kind of it)."""
    if provider != "triton" or not target.of(device).gpu:
        return None
    key = (kernel, device, dtype, heads, fmt.name, _specialization(block_size))
    if key in _precompiled:
        return None
    start = perf_counter()
    count = precompile(kernel, device, dtype, heads, fmt, block_size)
    seconds = perf_counter() - start
    _precompiled.add(key)
    logger.info("K3 AMD overlay: compiled %s configs of %s (%s, %s heads, %s, KV cache blocks of %s) in %.1f s",
                count, kernel, str(dtype).removeprefix("torch."), heads, fmt.name, block_size, seconds)
    return seconds
