"""The layer-step benchmark (k3_amd_overlay/commands/bench/layer_step.py): the overlay's chain matches the stock
sequence on fresh inputs (bf16 and fp8 W_UK, absorbed and above the absorbed path's token limit),
planted faults (a skipped norm, a doubled cache write, an unscaled query) are caught, a shape that
fails is not timed and fails the run, and the table, JSON and the issue's goal verdict are built
from the timings (a counting timer on the CPU; the real ones are CUDA-graph medians on the GPU)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from machine import DEVICE, HAS_GPU
from vllm_support import with_real_signature

from k3_amd_overlay import k3, package
from k3_amd_overlay.commands.bench import aiter_peers, kernels, layer_step
from k3_amd_overlay.fp8 import format_of
from k3_amd_overlay.kernels.rmsnorm_pair import rmsnorm
from k3_amd_overlay.ops import reference

pytestmark = pytest.mark.kernels  # scripts/gpu_check.sh runs these on the GPU

TP8_HEADS = k3.HEADS_PER_RANK[layer_step.TARGET_TP]


@pytest.fixture
def one_head_goal(monkeypatch: pytest.MonkeyPatch) -> int:
    """The goal's heads per rank made 1 (TP = all heads), so that the interpreter runs one head."""
    monkeypatch.setattr(layer_step, "TARGET_TP", k3.NUM_HEADS)
    return 1


@pytest.fixture
def fp8_bmm_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stock fp8 absorption (AITER's fp8 BMM, not importable here) as the overlay's reference of its
    arithmetic: the same wrapper's arguments, the reference's result."""
    def fp8_bmm(q_nope: torch.Tensor, w_k: torch.Tensor, w_k_scale: torch.Tensor) -> torch.Tensor:
        return reference.absorb_w_k_fp8_reference(q_nope, w_k, w_k_scale, format_of(w_k.dtype))

    monkeypatch.setattr(aiter_peers, "fp8_bmm", with_real_signature(aiter_peers.fp8_bmm, fp8_bmm))


def step(tokens: int = 4, heads: int = 3, variant: str = layer_step.BF16) -> layer_step.Step:
    return layer_step.make_step(tokens, heads, variant, DEVICE, seed=tokens + heads, padding=True)


@pytest.mark.parametrize(("tokens", "heads"), [(1, 1), (4, 3)])
def test_overlay_chain_matches_the_stock_sequence_bf16(tokens, heads):
    s = step(tokens, heads)
    assert s.slots.lt(0).any() == (tokens > 1)  # a padding slot whenever there are two tokens
    assert layer_step.parity_problems(s) == []


def test_overlay_chain_matches_above_the_absorbed_token_limit(monkeypatch):
    monkeypatch.setattr(package, "ABSORB_MAX_TOKENS", 2)  # 4 tokens: norm pair, bmm, qk_cache
    s = step(4)
    assert not layer_step.absorbed(s)
    assert layer_step.parity_problems(s) == []


@pytest.mark.parametrize("limit", [64, 2], ids=["absorbed", "fp8-bmm-then-qk_cache"])
def test_overlay_chain_matches_the_stock_sequence_fp8(fp8_bmm_reference, monkeypatch, limit):
    monkeypatch.setattr(package, "ABSORB_MAX_TOKENS", limit)
    assert layer_step.parity_problems(step(4, heads=2, variant=layer_step.FP8)) == []


def skipped_kv_norm(q_c, kv_c, q_w, kv_w, q_eps, kv_eps, q_out, kv_out) -> None:
    """``rmsnorm_pair`` that never runs the kv_a norm."""
    rmsnorm(q_c, q_w, q_eps, q_out)


def test_planted_faults_are_caught(monkeypatch):
    real_absorb = layer_step.absorb_qk_cache

    def doubled_write(q_nope, w, q_pe, kv_c, k_pe, cache, slots, *rest):
        real_absorb(q_nope, w, q_pe, kv_c, k_pe, cache, slots, *rest)
        real_absorb(q_nope, w, q_pe, kv_c, k_pe, cache, torch.where(slots >= 0, slots + 1, slots), *rest)

    s = step(4, heads=1)
    monkeypatch.setattr(layer_step, "rmsnorm_pair", skipped_kv_norm)
    found = layer_step.parity_problems(s)
    print("skipped kv_a norm:", found)
    assert any(p.startswith("kv_norm: ") and "bytes not written" in p for p in found)
    assert any(p.startswith("cache: ") and "codes differ" in p for p in found)
    monkeypatch.undo()

    monkeypatch.setattr(layer_step, "absorb_qk_cache", doubled_write)
    found = layer_step.parity_problems(s)
    print("doubled cache write:", found)
    assert found and found[0].startswith("cache: ") and "written outside the valid slots' rows" in found[0]
    monkeypatch.undo()

    unscaled = s.q_scale.clone().fill_(1.0)
    monkeypatch.setattr(layer_step, "absorb_qk_cache", lambda *a: real_absorb(*a[:8], unscaled, *a[9:]))
    found = layer_step.parity_problems(s)
    print("query quantised at scale 1:", found)
    assert len(found) == 1 and found[0].startswith("q_out: ") and "by more than one step" in found[0]


def counting_timer(values: list[float]):
    """Runs the first chain it is given (so a timed chain must launch; the interpreter is slow) and
    answers the next of ``values``."""
    answers = itertools.cycle(values)
    calls = []

    def timer(fn):
        if not calls:
            fn()
        calls.append(fn)
        return next(answers)

    timer.calls = calls
    return timer


def stock_then_overlay(stock_us: float, overlay_us: float) -> list[float]:
    """A shape's timer answers: one per single-norm config and concat-quant (eager, then compiled), the
    minimum, stock's, last (the last config, compiled); then the overlay."""
    stocks = 2 * len(kernels.SINGLE_NORM_CONFIGS)
    return [stock_us + stocks - i for i in range(stocks - 1)] + [stock_us, overlay_us]


def test_table_json_and_goal_met(one_head_goal, capsys):
    timer = counting_timer(stock_then_overlay(6.0, 2.0))
    results = layer_step.bench([one_head_goal], [1, 2], peers=False, device=DEVICE, timer=timer)
    out = capsys.readouterr()
    print(out.out)
    assert "| heads | batch | stock µs | overlay µs | ratio | overlay path | parity |" in out.out
    assert "| 1 | 1 | 6.00 | 2.00 | 3.00 | norm pair + absorbed | ok |" in out.out
    assert "| 1 | 2 | 6.00 | 2.00 | 3.00 | norm pair + absorbed | ok |" in out.out
    assert "goal (1 heads (TP 96), B <= 64, >= 3x over stock): met: lowest 3.00x at B 1 (B 1-2 measured)" in out.out
    assert "fp8 W_K: not measured" in out.err
    shapes, verdict = results[:-1], results[-1]
    last = kernels.SINGLE_NORM_CONFIGS[-1]
    assert shapes[0]["stock_norm_config"] == dict(rows=last[0], warps=last[1])
    stocks = 2 * len(kernels.SINGLE_NORM_CONFIGS)
    assert shapes[0]["stock_concat_quant"] == "compiled" and shapes[0]["stock_compiled_us"] == 6.0
    assert shapes[0]["stock_eager_us"] == 6.0 + 2  # the eager timings answered stocks, ..., 8: every other one
    assert stocks >= 2
    assert [(r["heads"], r["tokens"], r["stock_us"], r["overlay_us"], r["ratio"], r["parity"]) for r in shapes] == [
        (1, 1, 6.0, 2.0, 3.0, "ok"), (1, 2, 6.0, 2.0, 3.0, "ok")]
    assert verdict["met"] is True and verdict["min_ratio"] == 3.0 and "met: lowest 3.00x" in verdict["why"]
    assert len(timer.calls) == 2 * (2 * len(kernels.SINGLE_NORM_CONFIGS) + 1)
    json.dumps(results)  # the bench writes these into its JSON
    assert not layer_step.failed(results)


def test_goal_not_met_or_not_measured_is_said_plainly(one_head_goal, capsys):
    results = layer_step.bench_layer_step([one_head_goal], [1], device=DEVICE,
                                          timer=counting_timer(stock_then_overlay(5.0, 2.0)))
    assert results[-1]["met"] is False and "not met: lowest 2.50x at B 1" in results[-1]["why"]
    results = layer_step.bench_layer_step([2], [1], device=DEVICE, timer=counting_timer([1.0]))
    assert results[-1]["met"] is False and results[-1]["why"].startswith("not measured")
    assert "goal (1 heads (TP 96), B <= 64, >= 3x over stock): not measured" in capsys.readouterr().out


def test_a_shape_failing_parity_is_not_timed_and_fails_the_run(one_head_goal, monkeypatch, capsys):
    monkeypatch.setattr(layer_step, "rmsnorm_pair", skipped_kv_norm)
    timer = counting_timer([1.0])
    results = layer_step.bench_layer_step([one_head_goal], [1], device=DEVICE, timer=timer)
    assert timer.calls == []
    assert results[0]["parity"] != "ok" and "stock_us" not in results[0]
    assert "| - | - | - | norm pair + absorbed | FAILED: kv_norm: " in capsys.readouterr().out
    assert results[-1]["met"] is False and "parity failed at B [1]" in results[-1]["why"]
    assert layer_step.failed(results)


def test_bench_cli_takes_the_layer_step_section(capsys):
    if HAS_GPU:
        pytest.skip("on a GPU this would run the benchmark")
    assert kernels.main(["--only", "layer_step"]) == 1  # parsed, then: no GPU (a failure, not a usage error)
    assert "no GPU" in capsys.readouterr().err


def test_unknown_variant_is_refused_by_name():
    with pytest.raises(ValueError, match=r"layer-step variant 'fp4': expected one of 'bf16', 'fp8'"):
        layer_step.make_step(1, 1, "fp4", DEVICE, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 65, 256])
@pytest.mark.parametrize("heads", [3, 12, 16])
def test_overlay_chain_matches_stock_at_k3_shapes_on_the_gpu(heads, tokens):
    assert layer_step.parity_problems(step(tokens, heads)) == []


@pytest.mark.gpu
def test_layer_step_times_under_graph_replay():
    results = layer_step.bench_layer_step([TP8_HEADS], [1, 64], device=DEVICE)
    assert all(r["parity"] == "ok" and r["stock_us"] > 0 and r["overlay_us"] > 0 for r in results[:-1])
