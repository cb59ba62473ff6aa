"""Layer-step benchmark: the pre-attention decode chain of one Kimi-K3 MLA layer, per heads per rank
and decode batch, the stock sequence against the overlay, CUDA-graph replay medians, side by side in
one run (``k3-amd-overlay bench --only layer_step``).

The chain starts at the fused q_a/kv_a projection's output and ends at the fp8 query the attention
reads; the GEMMs around it (q_a/kv_a, q_b) are the same on both sides and not in it.

- stock: the q_a and kv_a RMSNorms (two single-norm launches, the best of the kernel bench's configs),
  the W_UK absorption (``torch.bmm`` for bf16 W_UK_T; AITER's fp8 BMM for vLLM's fp8 W_K, as the
  kernel bench's unfused fp8 baseline), the fp8 KV-cache write, the ``[ql_nope | q_pe]`` concat and
  the static fp8 query quant, the last two as vLLM runs them either way: two launches (eager, as with
  ``--enforce-eager``) or one torch.compile'd kernel (its default serving: baselines.compiled_concat_quant);
  the faster of the two counts (``stock_us``; both are in the JSON).
- overlay: the fused RMSNorm pair, then the absorbed launch up to ``package.ABSORB_MAX_TOKENS``
  tokens, above it the W_UK absorption and the qk_cache launch.
- AITER (``--peers aiter``): the two stock norms, then AITER's fused Triton kernel for the rest (bf16:
  the bmm, then ``fused_qk_rope_cat_and_cache_mla`` with an identity rotation and no query scale;
  fp8: the overlay's ``aiter`` provider, AITER's fused fp8 kernel plus the static query quant).

Before a shape is timed, the overlay's outputs are checked against the stock sequence's on fresh
random inputs (a padding slot among them), every output poisoned twice: the written bytes must be
exactly the norms' rows, the valid slots' cache rows and the valid tokens' queries; norms within two
bf16 steps (the fused pair and the single-norm launches sum a row in another order, and round twice:
the normalised value, then its product with the weight); cache and query codes equal but one fp8 step
apart on a few (fp32 sums in another order).
A shape that fails is reported with its problems and not timed, and the run exits non-zero.

Needs a GPU for timing (``graph_us``); the parity check runs wherever the kernels run (the Triton
interpreter included), which is how the tests drive it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from k3_amd_overlay import k3, measured, package
from k3_amd_overlay.commands.bench import aiter_peers
from k3_amd_overlay.commands.bench.baselines import compiled_concat_quant, concat_and_cache_mla_like_kernel
from k3_amd_overlay.commands.bench.kernels import SINGLE_NORM_CONFIGS, row
from k3_amd_overlay.commands.bench.timing import graph_us
from k3_amd_overlay.fp8 import E4M3FN, Fp8Format
from k3_amd_overlay.kernels.absorb_fp8_qk_cache import absorb_fp8_qk_cache
from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache
from k3_amd_overlay.kernels.qk_cache import fp8_mode, qk_cache
from k3_amd_overlay.kernels.rmsnorm_pair import rmsnorm, rmsnorm_pair
from k3_amd_overlay.kernels.static_quant import scaled_quant
from k3_amd_overlay.ops import aiter_absorb, reference

ACTIVATIONS = getattr(torch, measured.ACTIVATIONS)  # the step's activations: those `measure` times
BF16, FP8 = "bf16", "fp8"  # the W_UK variants: vLLM's bf16 W_UK_T, its fp8 W_K (VLLM_ROCM_USE_AITER_FP8BMM)
BLOCK_SIZE = 1536  # KV-cache block, as the kernel bench's decode-step inputs
POISONS = (0xA5, 0x5A)
# Query codes one fp8 step from stock allowed on at most this share (as the kernel tests' parity bounds);
# norm values at most this many bf16 steps from stock (as the kernel tests' RMSNorm bound).
MAX_DIFFERING = {BF16: 0.002, FP8: 0.01}
NORM_STEPS = 2
NORM_SHARE = 0.001  # and at most this share of them apart at all (a correct pair: about 2e-5 on a GPU)
# Issue 28's goal: at K3's TP 8 heads per rank, decode batches up to 64 tokens, >= 3x over stock.
TARGET_TP, TARGET_MAX_TOKENS, TARGET_RATIO = 8, 64, 3.0

Timer = Callable[[Callable[[], None]], float]


@dataclass
class Step:
    """One decode step of one K3 MLA layer: inputs laid out as vLLM hands them over (q_c, kv_c and
    k_pe column slices of the fused q_a/kv_a output, q_nope and q_pe of the q_b output) and the
    outputs the chain writes (both norms, the KV cache, the fp8 query)."""

    q_c: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    q_w: torch.Tensor
    kv_w: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    w: torch.Tensor  # bf16 W_UK_T [H, P, L] (a permuted view), or fp8 W_K [H, L, P]
    w_scale: torch.Tensor | None
    slots: torch.Tensor
    k_scale: torch.Tensor
    q_scale: torch.Tensor
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    cache: torch.Tensor  # uint8 [blocks, BLOCK_SIZE, LATENT_ROW]
    q_out: torch.Tensor  # uint8 [T, H, LATENT_ROW]
    cat: torch.Tensor  # stock's bf16 [ql_nope | q_pe]
    variant: str
    fmt: Fp8Format
    compiled_q: torch.Tensor | None = None  # the compiled stock's fp8 query (a new tensor, as vLLM's op returns)

    @property
    def tokens(self) -> int:
        return self.q_nope.shape[0]

    def outputs(self) -> dict[str, torch.Tensor]:
        return {"q_norm": self.q_norm, "kv_norm": self.kv_norm, "cache": self.cache, "q_out": self.q_out}


def make_step(tokens: int, heads: int, variant: str, device: torch.device | str, seed: int,
              padding: bool = False, fmt: Fp8Format = E4M3FN) -> Step:
    """Fresh random inputs (seeded on the CPU, so the same on any device); ``padding``: every third
    token from the second on has slot -1, as a padded graph batch has."""
    if variant not in (BF16, FP8):
        raise ValueError(f"layer-step variant {variant!r}: expected one of {BF16!r}, {FP8!r}")
    lora, rope, nope, q_lora = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM, k3.Q_LORA_RANK
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = ACTIVATIONS) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    latent = randn(tokens, q_lora + lora + rope, scale=2.0)
    q = randn(tokens, heads, nope + rope, scale=2.0)
    if variant == BF16:
        w, w_scale = randn(lora, heads, nope, scale=1 / 8).permute(1, 2, 0), None  # vLLM's W_UK_T layout
    else:  # as the kernel bench's fp8 W_K
        w = (torch.randn(heads, lora, nope, generator=gen) * 40).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype).to(device)
        w_scale = torch.tensor(0.003, device=device)
    blocks = max(2, -(-tokens // BLOCK_SIZE) * 2)
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=gen)[:tokens]
    if padding:
        slots[1::3] = -1
    return Step(
        q_c=latent[:, :q_lora], kv_c=latent[:, q_lora: q_lora + lora], k_pe=latent[:, q_lora + lora:],
        q_w=1 + randn(q_lora, scale=0.3), kv_w=1 + randn(lora, scale=0.3),
        q_nope=q[..., :nope], q_pe=q[..., nope:], w=w, w_scale=w_scale,
        slots=slots.to(torch.int64).to(device),
        k_scale=torch.tensor([1.1], device=device), q_scale=torch.tensor([0.9], device=device),
        q_norm=torch.empty(tokens, q_lora, dtype=ACTIVATIONS, device=device),
        kv_norm=torch.empty(tokens, lora, dtype=ACTIVATIONS, device=device),
        cache=torch.zeros(blocks, BLOCK_SIZE, lora + rope, dtype=torch.uint8, device=device),
        q_out=torch.empty(tokens, heads, lora + rope, dtype=torch.uint8, device=device),
        cat=torch.empty(tokens, heads, lora + rope, dtype=ACTIVATIONS, device=device),
        variant=variant, fmt=fmt,
    )


def w_uk(s: Step) -> torch.Tensor:
    """The stock W_UK absorption: ql_nope [T, H, L] in bf16."""
    if s.variant == BF16:
        return reference.absorb_w_uk_reference(s.q_nope, s.w)  # vLLM's torch.bmm call
    return aiter_peers.fp8_bmm(s.q_nope, s.w, s.w_scale)


# The chain's segments: stock's and the overlay's norms, and what follows them in each (the
# self-measurement times them one fusion at a time).
def stock_norms(s: Step, config: tuple[int, int] = SINGLE_NORM_CONFIGS[0]) -> None:
    """The two single-norm launches (``config``: their rows, warps)."""
    rows, warps = config
    rmsnorm(s.q_c, s.q_w, k3.RMS_NORM_EPS, s.q_norm, rows, warps)
    rmsnorm(s.kv_c, s.kv_w, k3.RMS_NORM_EPS, s.kv_norm, rows, warps)


def stock_tail(s: Step, compiled: bool = False) -> None:
    """After the norms, stock: the W_UK absorption, the KV-cache write, then the concat and the query
    quant: two launches as vLLM runs them eager (``--enforce-eager``), or with ``compiled`` one, as its
    default serving compiles them (baselines.compiled_concat_quant)."""
    ql_nope = w_uk(s)
    concat_and_cache_mla_like_kernel[(s.tokens,)](
        s.kv_norm, s.k_pe, s.cache, s.slots, s.k_scale, s.kv_norm.stride(0), s.k_pe.stride(0), s.cache.stride(0),
        s.cache.stride(1), s.cache.shape[1], s.fmt.fmax, L=k3.KV_LORA_RANK, R=k3.QK_ROPE_HEAD_DIM,
        FP8_MODE=fp8_mode(s.fmt, s.cache.device), num_warps=4)
    if compiled:  # timed as vLLM runs it: the codes in a tensor of their own (stock_compiled copies them out)
        s.compiled_q = compiled_concat_quant(s.q_out.device.type, s.fmt.fmax, s.fmt.dtype)(ql_nope, s.q_pe,
                                                                                            s.q_scale)
        return
    torch.cat([ql_nope, s.q_pe], dim=-1, out=s.cat)
    scaled_quant(s.cat, s.q_scale, s.q_out, s.fmt)


def stock_tail_compiled(s: Step) -> None:
    """``stock_tail`` with the concat and quant compiled into one kernel, as vLLM's default serving runs them."""
    stock_tail(s, compiled=True)


def stock(s: Step, config: tuple[int, int] = SINGLE_NORM_CONFIGS[0], compiled: bool = False) -> None:
    """The unfused chain, one launch per step but the concat and quant, which ``compiled`` fuses as
    vLLM's default serving does (``config``: the single-norm launches' rows, warps)."""
    stock_norms(s, config)
    stock_tail(s, compiled)


def stock_compiled(s: Step, config: tuple[int, int] = SINGLE_NORM_CONFIGS[0]) -> None:
    """The compiled stock chain with its query codes copied into ``q_out`` (for the bytes check; the
    timed chain leaves them in their own tensor, as vLLM does)."""
    stock(s, config, compiled=True)
    assert s.compiled_q is not None
    s.q_out.view(s.fmt.dtype).copy_(s.compiled_q)


def absorbed(s: Step) -> bool:
    return s.tokens <= package.ABSORB_MAX_TOKENS


def norm_pair(s: Step) -> None:
    """The overlay's one launch for both norms."""
    rmsnorm_pair(s.q_c, s.kv_c, s.q_w, s.kv_w, k3.RMS_NORM_EPS, k3.RMS_NORM_EPS, s.q_norm, s.kv_norm)


def _tail_args(s: Step) -> tuple[Any, ...]:
    return s.q_pe, s.kv_norm, s.k_pe, s.cache, s.slots, s.k_scale, s.q_scale, s.q_out, s.fmt


def qk_cache_tail(s: Step) -> None:
    """After the norms, the overlay above the absorbed path's token limit: W_UK, then the qk_cache launch."""
    qk_cache(w_uk(s), *_tail_args(s))


def absorbed_tail(s: Step) -> None:
    """After the norms, the overlay up to its token limit: the one absorbed launch."""
    if s.variant == BF16:
        absorb_qk_cache(s.q_nope, s.w, *_tail_args(s))
    else:
        absorb_fp8_qk_cache(s.q_nope, s.w, s.w_scale, *_tail_args(s))


def overlay(s: Step) -> None:
    """What the overlay runs: the norm pair, then the absorbed launch, or above its token limit the
    W_UK absorption and the qk_cache launch."""
    norm_pair(s)
    (absorbed_tail if absorbed(s) else qk_cache_tail)(s)


def aiter(s: Step, config: tuple[int, int] = SINGLE_NORM_CONFIGS[0]) -> None:
    """The stock norms, then AITER's fused Triton kernel for the rest (importable AITER only)."""
    stock_norms(s, config)
    cache = s.cache.view(s.fmt.dtype)
    if s.variant == BF16:
        aiter_peers.qk_cache(w_uk(s), s.q_pe, s.kv_norm, s.k_pe, cache, s.slots, s.k_scale)
    else:
        aiter_absorb.run(s.q_nope, s.w, s.w_scale, s.q_pe, s.kv_norm, s.k_pe, cache, s.slots, s.k_scale, s.q_scale,
                         s.q_out.view(s.fmt.dtype), s.fmt)


def _poisoned_run(s: Step, chain: Callable[[Step], None], poison: int) -> dict[str, torch.Tensor]:
    for out in s.outputs().values():
        out.view(torch.uint8).fill_(poison)
    chain(s)
    return {name: out.clone() for name, out in s.outputs().items()}


def _fp8_steps(got: torch.Tensor, want: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """How many representable values apart each pair of fp8 codes is (NaN codes: 0 if both NaN)."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = values[~values.isnan()].unique().to(got.device)
    g, w = got.view(fmt.dtype).float(), want.view(fmt.dtype).float()
    steps = (torch.searchsorted(grid, g) - torch.searchsorted(grid, w)).abs()
    both_nan = g.isnan() & w.isnan()
    return torch.where(both_nan, 0, torch.where(g.isnan() | w.isnan(), 255, steps))


def parity_problems(s: Step, chain: Callable[[Step], None] = overlay,
                    want_chain: Callable[[Step], None] = stock, exact_codes: bool = False) -> list[str]:
    """``chain``'s outputs against ``want_chain``'s on the same inputs (see the module's docstring);
    empty when they match. ``exact_codes``: every cache and query code equal (chains whose sums are
    the same: qk_cache's launch after stock's bmm, the compiled stock), no share one step apart."""
    want = _poisoned_run(s, want_chain, POISONS[0])
    got_a, got_b = (_poisoned_run(s, chain, poison) for poison in POISONS)
    written = {name: (got_a[name].view(torch.uint8) == got_b[name].view(torch.uint8)) for name in got_a}
    valid = s.slots >= 0
    rows = torch.zeros(s.cache.shape[:2], dtype=torch.bool, device=s.cache.device)
    rows[s.slots[valid] // BLOCK_SIZE, s.slots[valid] % BLOCK_SIZE] = True
    found = []
    for name in ("q_norm", "kv_norm"):
        if not written[name].all():
            found.append(f"{name}: {int((~written[name]).sum())} bytes not written")
        g, w = got_a[name].float(), want[name].float()
        off = (g - w).abs() > NORM_STEPS * torch.finfo(ACTIVATIONS).eps * w.abs() + 1e-6
        if g.isnan().any() or off.any():
            found.append(f"{name}: {int(off.sum())} of {g.numel()} values more than {NORM_STEPS} bf16 steps "
                         "from stock")
        elif (g != w).float().mean() > NORM_SHARE:
            found.append(f"{name}: {int((g != w).sum())} of {g.numel()} values differ from stock (at most "
                         f"{NORM_SHARE:.1%} may, each within {NORM_STEPS} bf16 steps)")
    if not torch.equal(written["cache"], rows.unsqueeze(-1).expand_as(written["cache"])):
        extra = int((written["cache"] & ~rows.unsqueeze(-1)).sum())
        missing = int((~written["cache"] & rows.unsqueeze(-1)).sum())
        found.append(f"cache: {extra} bytes written outside the valid slots' rows, {missing} of theirs not written")
    if not written["q_out"][valid].all():
        found.append(f"q_out: {int((~written['q_out'][valid]).sum())} bytes of valid tokens not written")
    for name, got, ref in (("cache", got_a["cache"][rows], want["cache"][rows]),
                           ("q_out", got_a["q_out"][valid], want["q_out"][valid])):
        steps = _fp8_steps(got, ref, s.fmt)
        differ = steps > 0
        if (steps > 1).any() or differ.float().mean() > (0.0 if exact_codes else MAX_DIFFERING[s.variant]):
            found.append(f"{name}: {int(differ.sum())} of {got.numel()} codes differ from stock "
                         f"({int((steps > 1).sum())} by more than one step)")
    return found


def _verdict(results: list[dict], variant: str) -> dict:
    heads = k3.HEADS_PER_RANK[TARGET_TP]
    rows = [r for r in results if r["variant"] == variant and r["heads"] == heads
            and r["tokens"] <= TARGET_MAX_TOKENS]
    goal = f"{heads} heads (TP {TARGET_TP}), B <= {TARGET_MAX_TOKENS}, >= {TARGET_RATIO:g}x over stock"
    verdict = dict(op="layer_step_target", variant=variant, goal=goal, met=False)
    failed = [r for r in rows if r["parity"] != "ok"]
    if not rows:
        verdict["why"] = f"not measured: no {variant} row at {heads} heads and B <= {TARGET_MAX_TOKENS} in this run"
    elif failed:
        verdict["why"] = f"parity failed at B {[r['tokens'] for r in failed]}: no ratio counts"
    else:
        worst = min(rows, key=lambda r: r["ratio"])
        verdict.update(met=worst["ratio"] >= TARGET_RATIO, min_ratio=worst["ratio"], at_tokens=worst["tokens"],
                       ratios={r["tokens"]: r["ratio"] for r in rows})
        verdict["why"] = (f"{'met' if verdict['met'] else 'not met'}: lowest {worst['ratio']:.2f}x at "
                          f"B {worst['tokens']} (B {min(verdict['ratios'])}-{max(verdict['ratios'])} measured)")
    return verdict


def bench_layer_step(heads_list: list[int], tokens_list: list[int], variant: str = BF16, peers: bool = False,
                     device: torch.device | str = "cuda", timer: Timer = graph_us,
                     fmt: Fp8Format = E4M3FN) -> list[dict]:
    """Check parity, then time the stock chain (the best single-norm config), the overlay and, with
    ``peers``, AITER's, per heads and batch; print the table and the goal's verdict; the results
    (one per shape, then the verdict) are the JSON's."""
    results: list[dict] = []
    print(f"\n### layer step ({variant} W_UK): pre-attention decode chain of one K3 MLA layer, stock vs overlay "
          f"({fmt.name} cache, block {BLOCK_SIZE}; graph replay medians)")
    print("| heads | batch | stock µs | overlay µs | ratio | overlay path | parity |"
          + (" AITER µs | AITER / overlay |" if peers else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if peers else ""))
    for heads in heads_list:
        for tokens in tokens_list:
            path = "norm pair + absorbed" if tokens <= package.ABSORB_MAX_TOKENS else "norm pair + W_UK + qk_cache"
            result: dict = dict(op="layer_step", variant=variant, heads=heads, tokens=tokens, mode="graph",
                                overlay_path=path)
            checked = make_step(tokens, heads, variant, device, seed=tokens * 131 + heads, padding=True, fmt=fmt)
            problems = parity_problems(checked)
            # the compiled stock's bytes too (torch's own conversion, where the eager stock's quant shares the
            # overlay kernels' fp8 helper: a fault in that helper shows here)
            problems += [f"compiled stock: {p}"
                         for p in parity_problems(checked, stock_compiled, stock, exact_codes=True)]
            result["parity"] = problems or "ok"
            if problems:
                print("| " + row(heads, tokens, "-", "-", "-", path, "FAILED: " + "; ".join(problems)) + " |")
                results.append(result)
                continue
            s = make_step(tokens, heads, variant, device, seed=tokens * 7 + heads, fmt=fmt)
            stock_times = {(config, compiled): timer(partial(stock, s, config, compiled))
                           for config in SINGLE_NORM_CONFIGS for compiled in (False, True)}
            (config, compiled), stock_us = min(stock_times.items(), key=lambda item: item[1])
            result.update(stock_us=stock_us, stock_norm_config=dict(rows=config[0], warps=config[1]),
                          stock_concat_quant="compiled" if compiled else "eager",
                          stock_eager_us=min(t for (_, c), t in stock_times.items() if not c),
                          stock_compiled_us=min(t for (_, c), t in stock_times.items() if c),
                          overlay_us=timer(partial(overlay, s)))
            result["ratio"] = result["stock_us"] / result["overlay_us"]
            cells = [heads, tokens, result["stock_us"], result["overlay_us"], result["ratio"], path, "ok"]
            if peers:
                result["aiter_us"] = timer(partial(aiter, s, config))
                result["aiter_ratio"] = result["aiter_us"] / result["overlay_us"]
                cells += [result["aiter_us"], result["aiter_ratio"]]
            print("| " + row(*cells) + " |")
            results.append(result)
    verdict = _verdict(results, variant)
    print(f"goal ({verdict['goal']}): {verdict['why']}")
    return [*results, verdict]


def bench(heads_list: list[int], tokens_list: list[int], peers: bool, device: torch.device | str = "cuda",
          timer: Timer = graph_us) -> list[dict]:
    """Both variants: bf16 always; fp8 only where AITER's fp8 BMM (the stock fp8 absorption) runs."""
    results = bench_layer_step(heads_list, tokens_list, BF16, peers, device, timer)
    if peers:
        results += bench_layer_step(heads_list, tokens_list, FP8, peers, device, timer)
    else:
        print("layer step, fp8 W_K: not measured: its stock absorption is AITER's fp8 BMM; run with --peers aiter",
              file=sys.stderr)
    return results


def failed(results: list[dict]) -> bool:
    """Whether any shape's parity check failed (the run then exits non-zero)."""
    return any(r.get("op") == "layer_step" and r["parity"] != "ok" for r in results)
