"""One launch of each overlay kernel at K3's widths, through the kernel's own launcher, on empty
tensors in vLLM's layouts: what ``kernels --arch`` compiles for an AMD arch on a CPU, and what the
sites compile ahead on the GPU (every config the arch's table can pick for a layer) in vLLM's
warm-up, before any graph capture. Meant for compile-only sessions (``target.compile_only``):
nothing here runs a kernel on data."""

from __future__ import annotations

import torch

from k3_amd_overlay import k3, mxfp4
from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.kernels import launch_configs, names, target

# Decode batches and per-rank query heads swept to reach every rule (K3: 96 heads over TP 1..96).
TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
HEADS = tuple(sorted(set(k3.HEADS_PER_RANK.values())))
ABSORB_WEIGHTS = {names.ABSORB_QK_CACHE_KERNEL: "query dtype", names.ABSORB_FP8_QK_CACHE_KERNEL: "fp8",
                  names.ABSORB_MXFP4_QK_CACHE_KERNEL: "mxfp4"}


def launch_at(kernel: str, device: torch.device, dtype: torch.dtype, tokens: int, heads: int,
              fmt: Fp8Format) -> None:
    """One launch of ``kernel`` for ``tokens`` tokens and ``heads`` heads (fp8 weights in ``fmt``)."""
    lora, rope, nope = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM

    def empty(*shape: int, like: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=like, device=device)

    q = empty(tokens, heads, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv_c, k_pe = empty(tokens, lora), empty(tokens, rope)
    cache = empty(tokens + 1, 1, lora + rope, like=torch.uint8)  # AITER MLA's block size 1
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


def reachable(kernel: str, arch: str, heads: tuple[int, ...] = HEADS,
              device_name: str | None = None) -> list[tuple[tuple[tuple[str, int], ...], int, int, list[str]]]:
    """Each distinct config the dispatch picks for ``kernel`` on ``arch`` over vLLM's decode batches
    and these per-rank heads: (config, a batch and heads that reach it, the rules it serves)."""
    rules, _ = launch_configs.resolve(arch, device_name)[kernel]
    heads_swept = (1,) if kernel == names.RMSNORM_PAIR_KERNEL else heads
    found: dict[tuple[tuple[str, int], ...], tuple[int, int, list[str]]] = {}
    for rule in rules:
        hit = next(((t, h) for t in TOKENS for h in heads_swept if launch_configs.rule_for(rules, t, h) is rule), None)
        if hit is None:
            continue
        label = f"T<={rule.tokens or 'any'}, H<={rule.heads or 'any'}"
        if rule.config in found:
            found[rule.config][2].append(label)
        else:
            found[rule.config] = (hit[0], hit[1], [label])
    return [(config, t, h, labels) for config, (t, h, labels) in found.items()]


def precompile(kernel: str, device: torch.device, dtype: torch.dtype, heads: int, fmt: Fp8Format) -> int:
    """Compile (not run) every config the arch's table can pick for ``kernel`` at ``heads`` heads on
    ``device``; returns how many. Raises what Triton raises."""
    where = target.of(device)
    from k3_amd_overlay.kernels.launch import device_name

    configs = reachable(kernel, where.arch, (heads,), device_name(device))
    with target.compile_only(None):
        for _, tokens, config_heads, _ in configs:
            launch_at(kernel, device, dtype, tokens, config_heads, fmt)
    return len(configs)


_precompiled: set[tuple[str, torch.device, torch.dtype, int, str]] = set()


def precompile_once(provider: str | None, kernel: str, device: torch.device, dtype: torch.dtype, heads: int,
                    fmt: Fp8Format) -> None:
    """``precompile`` at the first fused call of a Triton provider on a GPU for this kernel, device,
    dtype and head count in the process (a site's first call is in vLLM's warm-up run)."""
    key = (kernel, device, dtype, heads, fmt.name)
    if provider != "triton" or key in _precompiled or not target.of(device).gpu:
        return
    precompile(kernel, device, dtype, heads, fmt)
    _precompiled.add(key)
