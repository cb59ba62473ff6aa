"""``scripts/measure_planted_slow.py``, issue 28's "never slower" proof on a GPU, run here through its own
``main`` with the GPU and the timing faked (a fake H200; each launch timed as planted; no kernel runs):
everything after the timing is the package's own (the result file written, read back as the server
reads it, the decode plan built from it, the marker entry). It must say PASS where the plan leaves the
slowed launch in the planted bucket and FAIL where it does not. The script once called the package
with what an earlier API took and failed on the GPU with an AttributeError after a whole measurement."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from pathlib import Path

import pytest
import torch
from test_self_measure import FakeTimer, fake_pair

from k3_amd_overlay import fp8, measured
from k3_amd_overlay.commands import self_measure
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import launch, target
from k3_amd_overlay.package import ABSORB_MAX_TOKENS, ABSORB_QK_CACHE, QK_CACHE, QKV_NORM

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "measure_planted_slow.py"
BUCKETS = (1, 8, 64, 256, 512)


def _script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("measure_planted_slow", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def planted_gpu(monkeypatch):
    """A fake H200 whose pairs are every fusion's at BUCKETS (the absorbed launch up to its limit), stock 8
    µs, fused 4 µs (the absorbed launch 3 µs), the spun fused launch 20 µs; ``broken.gate`` set makes the
    plan ignore every measured refusal (the fault the script must catch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(target, "of", lambda device: types.SimpleNamespace(arch="sm90"))
    monkeypatch.setattr(launch, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(fp8, "device_format", lambda device: E4M3FN)
    pairs = [fake_pair(fusion, tokens) for tokens in BUCKETS for fusion in (QKV_NORM, QK_CACHE, ABSORB_QK_CACHE)
             if fusion != ABSORB_QK_CACHE or tokens <= ABSORB_MAX_TOKENS]
    monkeypatch.setattr(self_measure, "pairs", lambda *given, **kw: pairs)
    times = {f"{p.fusion}{p.tokens}-{n}": [8.0] for p in pairs for n in ("stock-a", "stock-b")}
    times |= {f"{p.fusion}{p.tokens}-fused": [3.0 if p.fusion == ABSORB_QK_CACHE else 4.0] for p in pairs}
    times["fused_then_spin"] = [20.0]
    monkeypatch.setattr(self_measure, "graph_timer", lambda: FakeTimer(times))
    broken = types.SimpleNamespace(gate=False)
    real_gate = measured.gate_for

    def gate_for(*args, **kwargs):
        gate = real_gate(*args, **kwargs)
        return dataclasses.replace(gate, buckets=tuple((t, None) for t, _ in gate.buckets)) if broken.gate else gate

    monkeypatch.setattr(measured, "gate_for", gate_for)
    return broken


@pytest.mark.parametrize("slow", [(QK_CACHE, 512), (ABSORB_QK_CACHE, 256), (QK_CACHE, 256)])
def test_the_script_passes_where_the_plan_leaves_the_slowed_launch(slow, tmp_path, capsys, planted_gpu):
    argv = ["--heads", "12", "--buckets", *map(str, BUCKETS), "--slow", slow[0], str(slow[1]), "--out", str(tmp_path)]
    assert _script().main(argv) == 0, capsys.readouterr().out[-3000:]
    out = capsys.readouterr().out
    assert "planted-slow gate check: PASS" in out
    if slow == (QK_CACHE, 512):  # above the absorbed launch's limit: stock runs there, saying why
        assert "| 512 | stock | qk_cache: stock at 257-512 tokens: 0.40x of stock on this GPU |" in out


def test_the_script_fails_where_the_plan_ignores_the_measurement(tmp_path, capsys, planted_gpu):
    planted_gpu.gate = True
    argv = ["--heads", "12", "--buckets", *map(str, BUCKETS), "--slow", QK_CACHE, "512", "--out", str(tmp_path)]
    assert _script().main(argv) == 1
    assert "planted-slow gate check: FAIL" in capsys.readouterr().out
