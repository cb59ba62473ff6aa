"""A fused kernel that fails on the GPU never takes the server down (real engine, CPU): with every
fusion on and the qkv_norm and absorb_qk_cache kernels failing at their first call (planted by the
test kit as a Triton compile error), the engine serves every prompt, bit-identical to the overlay
off; the two fusions are refused for the process with the compiler's message in the log and the
marker, and qk_cache, whose kernel works, takes the decode batches the absorbed launch took."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import run_offline

PLANTED = "qkv_norm,absorb_qk_cache"
MESSAGE = "planted: LLVM ERROR"


@pytest.fixture(scope="module")
def runs(checkpoint: Path, offline_off: dict[str, Any],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("kernel-failure")
    failing = run_offline(checkpoint, "1", root / "failing", K3ENGINE_PLANT_KERNEL_FAILURE=PLANTED)
    assert failing["returncode"] == 0 and failing["outputs"], failing["log"][-4000:]
    return {"off": offline_off, "failing": failing}  # off: the session's one off run (conftest.py)


def test_the_engine_serves_every_prompt_as_with_the_overlay_off(runs):
    assert runs["failing"]["outputs"] == runs["off"]["outputs"]


def test_the_failing_fusions_are_refused_with_the_compilers_message(runs):
    worker = next(r for r in runs["failing"]["records"] if any(e.get("layers") for e in r["fusions"].values()))
    for fusion in PLANTED.split(","):
        entry = worker["fusions"][fusion]
        assert entry["state"] == "refused" and entry["provider"] is None, entry
        assert "its kernel failed on this GPU" in entry["reason"] and MESSAGE in entry["reason"], entry
    qk_cache = worker["fusions"]["qk_cache"]
    assert qk_cache["state"] == "applied" and qk_cache["runs"]["served"] > 0, qk_cache
    assert worker["launch_configs"]["arch"] == "cpu"
    assert worker["launch_configs"]["kernels"]["qk_cache_kernel"]["file"].endswith("cpu.json")
    log = runs["failing"]["log"]
    for fusion in PLANTED.split(","):
        assert log.count(f"k3-amd-overlay: {fusion} refused: its kernel failed on this GPU") == 1, log[-4000:]
    assert "PlantedCompilationError" in log
