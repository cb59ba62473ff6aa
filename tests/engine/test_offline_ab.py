"""Offline greedy A/B on the real engine: every arm generates the same prompts in a fresh process.
Every fusion with the reference providers (qkv_norm, qk_cache, absorb_qk_cache, all three) and
stock are bit-identical to the overlay switched off, tokens and logprobs: the references round
where vLLM's stock path rounds (the norm before its weight multiply, ql_nope to the activation
dtype before the fp8 quant). Each arm's markers say what ran, where and how often. (The Triton
providers' rounding is held to the same references on a GPU: tests/test_kernels.py and
tests/test_absorb_kernel.py.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from engine_support import run_offline
from records import judge

from k3_amd_overlay.targets.vllm_env import BREAKABLE_EAGER_BREAK

ARMS = {"off": None, "stock": "stock", "qkv_norm": "qkv_norm", "qk_cache": "qk_cache",
        "absorb": "absorb_qk_cache", "all": "1"}
BIT_IDENTICAL = ("stock", "qkv_norm", "qk_cache", "absorb", "all")


@pytest.fixture(scope="module")
def results(checkpoint: Path, offline_off: dict[str, Any],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("offline-ab")
    # off: the session's one off run (conftest.py), shared with the kernel-failure test
    out = {name: offline_off if name == "off" else run_arm(checkpoint, name, root / name) for name in ARMS}
    rerun_differing_arms_once(out, checkpoint, root)
    return out


def run_arm(checkpoint: Path, name: str, workdir: Path) -> dict[str, Any]:
    result = run_offline(checkpoint, ARMS[name], workdir)
    assert result["returncode"] == 0 and result["outputs"], result["log"][-4000:]
    return result


def rerun_differing_arms_once(out: dict[str, dict[str, Any]], checkpoint: Path, root: Path) -> None:
    """One CI run saw the off arm's last logprob of one prompt differ in the last bits from all five
    other arms, which agreed with each other and with every other run of the same code; no cause
    was found (not the batch schedule: see generate.py). A difference the overlay causes is
    deterministic, so where an arm differs from off, off and that arm run once more and the tests
    judge the second runs; the first runs' difference is reported as a warning."""
    differing = [name for name in BIT_IDENTICAL if out[name]["outputs"] != out["off"]["outputs"]]
    if not differing:
        return
    warnings.warn(f"offline A/B: {', '.join(differing)} differed from off on the first run; "
                  "running off and those arms once more", stacklevel=1)
    for name in ("off", *differing):
        out[name] = run_arm(checkpoint, name, root / f"{name}-again")


def layer_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if any(e.get("layers") for e in r["fusions"].values())]


@pytest.mark.parametrize("arm", BIT_IDENTICAL)
def test_bit_identical_to_off(results, arm):
    assert results[arm]["outputs"] == results["off"]["outputs"]


def test_off_is_deterministic_and_not_trivial(results):
    tokens = [o["tokens"] for o in results["off"]["outputs"]]
    assert len({tuple(t) for t in tokens}) == len(tokens), "prompts must not all continue alike"
    assert all(len(set(t)) > 2 for t in tokens), tokens


def test_off_leaves_only_off_records(results):
    """Off (plugin installed, switch unset): each process vLLM starts leaves the plugin's off record,
    the positive evidence ``check --expect off`` needs, and nothing of the overlay's."""
    records = results["off"]["records"]
    assert records and all(r["mode"] == "off" for r in records), records
    assert {"main", "worker"} <= {r["role"] for r in records} and layer_records(records) == [], records
    assert judge(records, "off", None, require_effective=False).holds
    for expect in ("fused", "stock"):
        assert not judge(records, expect, None, require_effective=True).holds


@pytest.mark.parametrize("arm,fusions", [("qkv_norm", ["qkv_norm"]), ("qk_cache", ["qk_cache"]),
                                         ("absorb", ["absorb_qk_cache"]),
                                         ("all", ["qkv_norm", "qk_cache", "absorb_qk_cache"])])
def test_fused_arm_evidence(results, arm, fusions):
    records = results[arm]["records"]
    roles = sorted(r["role"] for r in records)
    assert "main" in roles and len(layer_records(records)) == 1, roles
    worker = layer_records(records)[0]
    assert worker["vllm_version"].startswith("0.32.0")
    assert worker["coverage"] == {"architecture": "KimiK3ForConditionalGeneration",
                                  "text_model": ["KimiLinearForCausalLM"], "speculative_method": None,
                                  "not_covered": [], "breakable_cudagraph": BREAKABLE_EAGER_BREAK}
    # vLLM 0.30-0.33 turn breakable graphs on for K3 on every platform but ROCm (config/vllm.py): the
    # site is installed as an eager break here; in eager mode (no capture) it is a plain call
    for fusion in fusions:
        entry = worker["fusions"][fusion]
        assert entry["state"] == "applied" and entry["provider"] == "reference", entry
        assert entry["layers"] == 2 and entry["runs"]["capture"] == 0, entry
        if not (arm == "all" and fusion == "qk_cache"):  # see the next test
            assert entry["effective_layers"] == 2 and entry["runs"]["served"] > 0, entry
    verdict = judge(records, "fused", fusions, require_effective=True)
    assert verdict.holds, verdict.lines
    assert not judge(records, "stock", fusions, require_effective=True).holds


def test_all_arm_decodes_through_the_absorbed_launch(results):
    records = results["all"]["records"]
    worker = layer_records(records)[0]
    # batches of <= 64 decode tokens take the absorbed launch; qk_cache is applied but, with 4
    # sequences at most, never gets a batch of its own: the absorbed launch does its work
    assert worker["fusions"]["absorb_qk_cache"]["runs"]["served"] > 0
    assert worker["fusions"]["qk_cache"]["runs"]["served"] == 0
    line = next(x for x in judge(records, "fused", ["qk_cache"], require_effective=True).lines
                if x.startswith("ok   qk_cache: served"))
    assert "in the absorb_qk_cache launch" in line


def test_stock_arm_evidence(results):
    records = results["stock"]["records"]
    assert records and all(r["mode"] == "stock" for r in records)
    verdict = judge(records, "stock", None, require_effective=True)
    assert verdict.holds, verdict.lines
    assert not judge(records, "fused", None, require_effective=True).holds


def test_worker_logs_layer_outcomes(results):
    log = results["qk_cache"]["log"]
    assert "layers built: qk_cache=applied on 2/2 layers" in log, log[-3000:]


def test_kv_connector_sees_every_layer_step_on_the_fused_path(checkpoint, tmp_path):
    """A configured KV connector (vLLM's real kv_transfer_config loading the test kit's recording
    connector) gets, in every step that runs attention, one wait_for_layer_load and one
    save_kv_layer per layer, with the decode fusions on as with the overlay off: a disaggregated
    decode instance never reads KV that has not arrived. (Step counts are compared within a run:
    two runs may schedule a step more or less.) And the outputs stay the same tokens."""
    runs = {}
    for name, switch in (("off", None), ("fused", "qk_cache,absorb_qk_cache")):
        log = tmp_path / f"{name}-connector.jsonl"
        runs[name] = run_offline(checkpoint, switch, tmp_path / name, K3ENGINE_KV_CONNECTOR="1",
                                 K3ENGINE_CONNECTOR_LOG=str(log))
        assert runs[name]["returncode"] == 0, runs[name]["log"][-4000:]
        events = [json.loads(line) for line in log.read_text().splitlines()]
        hooks = [(e["event"], e["layer"]) for e in events if e["event"] not in ("step", "dummy_step")]
        layers = sorted({layer for _, layer in hooks})
        one_forward = [(event, layer) for layer in layers for event in ("wait_for_layer_load", "save_kv_layer")]
        forwards, rest = divmod(len(hooks), len(one_forward))
        # the hooks come in whole forwards: each layer waited for, then saved, in layer order
        assert len(layers) == 2 and rest == 0 and hooks == one_forward * forwards, (name, hooks[:12])
        steps = sum(e["event"] == "step" for e in events)  # steps the connector was started for
        # every step but vLLM's last (no attention left to run) gave its hooks: the fused path too
        assert forwards >= max(steps - 1, 5), (name, forwards, steps)
        runs[name]["forwards"] = forwards
    # With a connector the two runs may batch the prompts differently (the step counts above vary),
    # and the CPU kernels round a differently batched matmul differently: the same tokens, logprobs
    # within a bf16 rounding's reach (the fused path itself is bit-exact on the same batch: the
    # connector-free A/B tests above compare bytes).
    fused, off = runs["fused"]["outputs"], runs["off"]["outputs"]
    assert [o["tokens"] for o in fused] == [o["tokens"] for o in off]
    worst = max(abs(a - b) for f, o in zip(fused, off, strict=True)
                for a, b in zip(f["logprobs"], o["logprobs"], strict=True))
    assert worst < 0.05, worst
    worker = layer_records(runs["fused"]["records"])[0]
    assert worker["fusions"]["absorb_qk_cache"]["runs"]["served"] > 0


def test_kimi_linear_is_in_scope_and_recorded(tmp_path_factory):
    """Kimi-Linear (KimiLinearForCausalLM) builds the same amd/linear.py MLA layers as Kimi-K3: it is
    deliberately in scope, takes the same fusions, bit-identical to off, and the marker names it."""
    from tiny_k3 import write_checkpoint

    root = tmp_path_factory.mktemp("kimi-linear")
    checkpoint = write_checkpoint(root / "checkpoint", architecture="KimiLinearForCausalLM")
    off = run_offline(checkpoint, None, root / "off")
    fused = run_offline(checkpoint, "qk_cache,qkv_norm", root / "fused")
    assert off["returncode"] == 0 and fused["returncode"] == 0, fused["log"][-4000:]
    assert fused["outputs"] == off["outputs"]
    worker = layer_records(fused["records"])[0]
    assert worker["coverage"]["architecture"] == "KimiLinearForCausalLM"
    assert worker["fusions"]["qk_cache"]["state"] == "applied" and worker["fusions"]["qk_cache"]["layers"] == 2
    assert worker["fusions"]["qk_cache"]["runs"]["served"] > 0
