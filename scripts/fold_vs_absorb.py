"""Experiment: vLLM 0.34's decode fold against the overlay's absorbed launch, from the output of the q_a
RMSNorm to the fp8 query and KV-cache row.

vLLM 0.34.0 (``vllm/models/kimi_k3/amd/mla.py``, ``_fold_qb_uk``) folds ``W_UK`` into ``q_b_proj`` at
load, where ``q_b_proj`` is unquantized: one weight ``[H*L + H*R, Lq]`` (each head's ``W_UK`` times its
nope rows of ``q_b_proj``, then the rope rows), one GEMM on decode-only batches giving
``[ql_nope | q_pe]``, then AITER's fused cache write, concat and query quant. The overlay (on 0.32-0.33)
keeps ``q_b_proj`` (``[H*(P+R), Lq]``) and folds ``W_UK`` into the write's launch. At K3's shapes the
folded weight is ``H*576*Lq`` against ``H*192*Lq + H*P*L`` (2.45x the bytes, and as many more FLOPs),
so the fold reads more in as many launches (two: a GEMM, then the write). This times, per heads and
decode batch, side by side:

- ``fold``: ``torch.mm`` with the folded weight, then the overlay's qk_cache launch (on this GPU the
  stand-in for AITER's HIP fused write, which does the same work in one launch);
- ``absorbed``: ``torch.mm`` with ``q_b_proj``, then the overlay's absorbed launch (up to its token
  limit);
- ``unfused``: ``torch.mm`` with ``q_b_proj``, vLLM's ``torch.bmm`` with ``W_UK_T``, the qk_cache launch
  (0.33's own fused decode, for scale).

Two weight states under CUDA-graph replay (medians): ``cold``, COPIES layers' weights taken in turn
(more than the L2, as a server meets them layer after layer), and ``warm``, one layer's weights every
time. Before timing, the three sequences run on the same fresh random inputs with every output poisoned
twice: each must write every query and cache byte and no other cache byte, the cache rows must be
equal, the absorbed queries equal unfused's, and the fold's within MAX_Q_REL_RMS of them (it rounds
``W_UK @ W_qb`` to bf16 once, where the others round the product's factors).

    PYTHONPATH=$PWD python scripts/fold_vs_absorb.py OUT.json        (a GPU, torch, Triton)

Every GEMM here is cuBLAS (``torch.mm``); on ROCm 0.34 runs the fold through AITER's ``gemm_a16w16`` and
``q_b_proj`` through vLLM's ROCm unquantized GEMM dispatch.
Results in docs/benchmarks.md."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from k3_amd_overlay import k3, package
from k3_amd_overlay.commands.bench.timing import graph_us
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels.absorb_qk_cache import absorb_qk_cache
from k3_amd_overlay.kernels.qk_cache import qk_cache

HEADS = (6, 12, 16)  # heads per rank at TP 16, 8 and 6: each has kv_lora_rank * heads >= 2048, so 0.34 folds
TOKENS = (1, 8, 32, 64, 256)
COPIES = 16  # 16 layers' weights: folded 170-453 MB, q_b_proj + W_UK 69-184 MB at 6-16 heads (the L2: 50 MB)
BLOCK = 64
POISONS = (0xA5, 0x5A)
# The fold's queries against unfused's, relative RMS: one fp8 step on a few percent of codes gives about
# 0.01; a head whose W_UK factor is lost gives over 0.3.
MAX_Q_REL_RMS = 0.03
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the parity check also runs on the Triton interpreter
P, L, R, LQ = k3.QK_NOPE_HEAD_DIM, k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.Q_LORA_RANK


def folded(w_qb: torch.Tensor, w_uk: torch.Tensor, heads: int) -> torch.Tensor:
    """The folded weight: for each head its W_UK [L, P] times its nope rows of q_b_proj [P, Lq] (in
    fp32), all heads' [L, Lq] blocks, then all heads' rope rows; rounded to bf16 once."""
    rows = w_qb.view(heads, P + R, LQ).float()
    nope = torch.einsum("lhp,hpk->hlk", w_uk.float(), rows[:, :P])
    return torch.cat([nope.reshape(heads * L, LQ), rows[:, P:].reshape(heads * R, LQ)]).to(torch.bfloat16)


def build(heads: int, tokens: int, copies: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)

    layers = []
    for _ in range(copies):
        w_qb = randn(heads * (P + R), LQ, scale=LQ ** -0.5)
        w_uk = randn(L, heads, P, scale=1 / 8)  # vLLM's W_UK [L, H, P]; W_UK_T is its permuted view
        layers.append({"w_qb": w_qb, "w_uk_t": w_uk.permute(1, 2, 0), "w_fold": folded(w_qb, w_uk, heads)})
    blocks = -(-tokens // BLOCK) * 2
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:tokens].to(torch.int64).to(DEVICE)
    return {
        "layers": layers, "heads": heads, "tokens": tokens, "slots": slots,
        "q_c": randn(tokens, LQ, scale=1.0), "kv_c": randn(tokens, L, scale=1.0), "k_pe": randn(tokens, R, scale=1.0),
        "k_scale": torch.tensor([1.1], device=DEVICE), "q_scale": torch.tensor([0.9], device=DEVICE),
        "y": torch.empty(tokens, heads * (L + R), dtype=torch.bfloat16, device=DEVICE),
        "qb": torch.empty(tokens, heads * (P + R), dtype=torch.bfloat16, device=DEVICE),
        "ql": torch.empty(tokens, heads, L, dtype=torch.bfloat16, device=DEVICE),
        "cache": torch.empty(blocks, BLOCK, L + R, dtype=torch.uint8, device=DEVICE),
        "q_out": torch.empty(tokens, heads, L + R, dtype=torch.uint8, device=DEVICE),
    }


def _tail(s: dict) -> tuple:
    return s["kv_c"], s["k_pe"], s["cache"], s["slots"], s["k_scale"], s["q_scale"], s["q_out"], E4M3FN


def fold(s: dict, layer: dict) -> None:
    h, t = s["heads"], s["tokens"]
    torch.mm(s["q_c"], layer["w_fold"].t(), out=s["y"])
    qk_cache(s["y"][:, : h * L].view(t, h, L), s["y"][:, h * L:].view(t, h, R), *_tail(s))


def _q_b(s: dict, layer: dict) -> tuple[torch.Tensor, torch.Tensor]:
    torch.mm(s["q_c"], layer["w_qb"].t(), out=s["qb"])
    q = s["qb"].view(s["tokens"], s["heads"], P + R)
    return q[..., :P], q[..., P:]


def absorbed(s: dict, layer: dict) -> None:
    q_nope, q_pe = _q_b(s, layer)
    absorb_qk_cache(q_nope, layer["w_uk_t"], q_pe, *_tail(s))


def unfused(s: dict, layer: dict) -> None:
    q_nope, q_pe = _q_b(s, layer)
    torch.bmm(q_nope.transpose(0, 1), layer["w_uk_t"], out=s["ql"].transpose(0, 1))
    qk_cache(s["ql"], q_pe, *_tail(s))


SEQUENCES: dict[str, Callable[[dict, dict], None]] = {"fold": fold, "absorbed": absorbed, "unfused": unfused}


def sequences_for(s: dict) -> list[str]:
    """The sequences this shape runs: the absorbed launch only up to its token limit."""
    return [n for n in SEQUENCES if n != "absorbed" or s["tokens"] <= package.ABSORB_MAX_TOKENS]


def outputs(s: dict, sequence: Callable[[dict, dict], None]) -> dict[str, torch.Tensor] | str:
    """The sequence's cache rows and queries, or what it left unwritten."""
    runs = []
    for poison in POISONS:
        s["cache"].fill_(poison)
        s["q_out"].fill_(poison)
        sequence(s, s["layers"][0])
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        runs.append((s["cache"][s["slots"] // BLOCK, s["slots"] % BLOCK].clone(), s["q_out"].clone()))
    (cache_a, q_a), (cache_b, q_b) = runs
    if not torch.equal(q_a, q_b) or not torch.equal(cache_a, cache_b):
        return "bytes left unwritten (they differ between the two poisons)"
    untouched = s["cache"].clone()
    untouched[s["slots"] // BLOCK, s["slots"] % BLOCK] = POISONS[1]
    if not bool((untouched == POISONS[1]).all()):
        return "cache bytes written outside the tokens' slots"
    return {"cache": cache_a, "q_out": q_a}


def parity(s: dict) -> dict:
    got = {name: outputs(s, SEQUENCES[name]) for name in sequences_for(s)}
    problems = [f"{name}: {v}" for name, v in got.items() if isinstance(v, str)]
    if problems:
        return {"ok": False, "problems": problems}
    base = got["unfused"]
    report: dict = {"ok": True, "problems": []}
    for name, out in got.items():
        if name == "unfused":
            continue
        if not torch.equal(out["cache"], base["cache"]):
            report["problems"].append(f"{name}: cache rows differ from unfused")
        a = out["q_out"].view(E4M3FN.dtype).float()
        b = base["q_out"].view(E4M3FN.dtype).float()
        report[f"{name}_q_equal_share"] = float((out["q_out"] == base["q_out"]).float().mean())
        rms = float((a - b).norm() / b.norm())
        report[f"{name}_q_rel_rms"] = round(rms, 5)
        if name == "absorbed" and not torch.equal(out["q_out"], base["q_out"]):
            report["problems"].append("absorbed: queries differ from unfused")
        if not rms <= MAX_Q_REL_RMS:  # NaN codes fail too
            report["problems"].append(f"{name}: queries {rms:.4f} from unfused (relative RMS), above {MAX_Q_REL_RMS}")
    report["ok"] = not report["problems"]
    return report


def time_shape(s: dict) -> dict:
    names = sequences_for(s)
    result: dict = {}
    for state in ("cold", "warm"):
        layers = s["layers"] if state == "cold" else s["layers"][:1] * len(s["layers"])
        for name in names + names[::-1]:  # each timed twice, in turn, in both orders
            sequence = SEQUENCES[name]

            def every_layer(sequence: Callable[[dict, dict], None] = sequence) -> None:
                for layer in layers:
                    sequence(s, layer)

            us = graph_us(every_layer, per_graph=4) / len(layers)
            result.setdefault(f"{state}_{name}_us", []).append(round(us, 3))
    for state in ("cold", "warm"):
        best = {n: min(result[f"{state}_{n}_us"]) for n in names}
        if "absorbed" in best:
            result[f"{state}_fold_over_absorbed"] = round(best["fold"] / best["absorbed"], 3)
        result[f"{state}_fold_over_unfused"] = round(best["fold"] / best["unfused"], 3)
    return result


def main(out_path: str) -> int:
    rows = []
    for heads in HEADS:
        for tokens in TOKENS:
            s = build(heads, tokens, COPIES, seed=1000 * heads + tokens)
            row = {"heads": heads, "tokens": tokens,
                   "fold_weight_mb": round(heads * (L + R) * LQ * 2 / 1e6, 2),
                   "q_b_and_w_uk_mb": round((heads * (P + R) * LQ + heads * P * L) * 2 / 1e6, 2),
                   "parity": parity(s)}
            if row["parity"]["ok"]:
                row.update(time_shape(s))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del s
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if all(r["parity"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
