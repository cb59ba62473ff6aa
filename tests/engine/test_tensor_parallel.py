"""Tensor parallelism on the real engine: the tiny K3 (4 heads) at ``tensor_parallel_size=2``, two
worker processes with 2 heads each, every fusion on (reference providers): greedy tokens and
logprobs bit-identical to the overlay off at the same size, and ``check``'s judgement sees each rank
as its own process that built its layers and ran the fused paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import run_offline
from records import judge

# One core per rank: vLLM's CPU workers otherwise bind their threads per NUMA node, and this
# machine has one.
TP_ENV = {"K3ENGINE_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
FUSIONS = ["qkv_norm", "qk_cache", "absorb_qk_cache"]


@pytest.fixture(scope="module")
def tp(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp2")
    out = {name: run_offline(checkpoint, switch, root / name, **TP_ENV) for name, switch in (("off", None),
                                                                                             ("all", "1"))}
    for result in out.values():
        assert result["returncode"] == 0 and result["outputs"], result["log"][-4000:]
    return out


def test_tp2_every_fusion_is_bit_identical_to_off(tp):
    assert tp["all"]["outputs"] == tp["off"]["outputs"]
    off = tp["off"]["records"]  # the plugin's off records, one per process: nothing of the overlay's
    assert off and all(r["mode"] == "off" for r in off), off
    assert sum(r["role"] == "worker" for r in off) == 2 and judge(off, "off", None, require_effective=False).holds


def test_tp2_each_rank_built_its_layers_with_its_heads_and_ran_the_fused_paths(tp):
    records = tp["all"]["records"]
    ranks = [r for r in records if any(e["layers"] for e in r["fusions"].values())]
    assert len(ranks) == 2 and len({r["pid"] for r in ranks}) == 2, [(r["role"], r["pid"]) for r in records]
    for rank in ranks:
        assert rank["role"] == "worker", rank["role"]
        for fusion in FUSIONS:
            entry = rank["fusions"][fusion]
            assert entry["state"] == "applied" and entry["layers"] == 2, entry
        assert "2 heads" in rank["fusions"]["qk_cache"]["reason"], rank["fusions"]["qk_cache"]
        assert rank["fusions"]["absorb_qk_cache"]["runs"]["served"] > 0
    verdict = judge(records, "fused", None, require_effective=True)
    assert verdict.holds, verdict.lines
    assert sum(": qk_cache=applied provider=reference on 2 layers" in line for line in verdict.lines) == 2
    # each rank names its place in vLLM's world: without one rank's record, the other's proves nothing of it
    assert sorted((r["rank"], r["world_size"], r["nodes"]) for r in ranks) == [(0, 2, 1), (1, 2, 1)]
    assert "info ranks 0-1 of a world of 2 ranks over 1 node: each left a live record" in verdict.lines
    for lost in ranks:
        without = judge([r for r in records if r is not lost], "fused", None, require_effective=True)
        assert not without.holds and (f"FAIL rank {lost['rank']} of a world of 2 ranks over 1 node left no live "
                                      "record") in " ".join(without.lines), without.lines
