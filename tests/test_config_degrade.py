"""A launch config that cannot serve never stops a worker: a malformed or foreign tuned file for
this GPU is one ERROR line and the marker's ``error`` (the shipped configs run); a bad shipped file
refuses the fusions, not the worker; a config that fails to compile (the ahead-of-time compile) or
to launch is replaced, in the rules that pick it only, by the arch's safe config and tried again,
and the fusion is refused only when the safe config fails too; the marker says which. Through a
fake Triton kernel that fails the configs a test plants (tests/fakes_gpu.py)."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch
from fakes_gpu import FakeCuda, FakeJit

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fp8 import E4M3FNUZ
from k3_amd_overlay.kernels import launch, launch_configs, names, probe, target
from k3_amd_overlay.kernels import qk_cache as qk_cache_kernel_module
from k3_amd_overlay.settings import KERNEL_CONFIGS, load_settings

LOGGER = "vllm.k3_amd_overlay"
GPU = "AMD Instinct MI300X"
QK = names.QK_CACHE_KERNEL
PLANTED = {"HEADS": 8, "num_warps": 8}  # the T<=16 bucket's config, which this GPU's Triton cannot build
ONE, REST = {"HEADS": 1, "num_warps": 1}, {"HEADS": 2, "num_warps": 2}
SAFE = dict(launch_configs.shipped("gfx942").kernels[QK][-1].config)  # the shipped file's catch-all rule
TUNED = {"schema": 1, "arch": "gfx942", "tuned_on": {"device": GPU}, "kernels": {QK: [
    {"tokens": 1, "config": ONE}, {"tokens": 16, "config": PLANTED}, {"config": REST}]}}


def _heads_warps(options):
    return {"HEADS": options["HEADS"], "num_warps": options["num_warps"]}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """No tuned file, no degraded config, no refused fusion; the process's own records restored after."""
    monkeypatch.delenv(KERNEL_CONFIGS, raising=False)
    monkeypatch.setattr(kernel_failures, "_failed", {})
    monkeypatch.setattr(launch_configs, "_degraded", {})
    for cached in (launch_configs._resolve, launch_configs._tuned, launch_configs._log_unusable,
                   launch_configs.shipped, launch._device_name):
        cached.cache_clear()
    yield
    for cached in (launch_configs._resolve, launch_configs._tuned, launch_configs._log_unusable,
                   launch_configs.shipped, launch._device_name):
        cached.cache_clear()


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake MI300X (gfx942) with a tuned file for it whose T<=16 config fails to build (``failing``
    names every config that fails: add the safe one to fail it too); the qk_cache kernel is a fake."""
    path = tmp_path / launch_configs.tuned_name("gfx942", GPU)
    path.write_text(json.dumps(TUNED))
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, "gfx942"))
    monkeypatch.setattr(launch, "device_name", lambda device: GPU)
    failing = [PLANTED]
    jit = FakeJit(QK, fails=lambda options: RuntimeError(f"PassManager::run failed\nLDS {options['HEADS']} KiB > 64")
                  if _heads_warps(options) in failing else None)
    monkeypatch.setattr(qk_cache_kernel_module, "qk_cache_kernel", jit)
    return types.SimpleNamespace(jit=jit, failing=failing, path=path)


def _launch_qk_cache(tokens, heads=12):
    """One real ``qk_cache`` launch (the fake kernel behind it) for ``tokens`` tokens."""
    probe.launch_at(QK, torch.device("cpu"), torch.bfloat16, tokens, heads, E4M3FNUZ, 16)


def _why(heads):
    return f"RuntimeError: LDS {heads} KiB > 64"


# ---- per config: degrade the bucket, keep the others, refuse only when the safe config fails ------

def test_a_config_that_fails_to_compile_ahead_degrades_its_bucket_only(gpu, caplog):
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        probe.precompile(QK, torch.device("cpu"), torch.bfloat16, 12, E4M3FNUZ, 16)
    compiled = [_heads_warps(options) for _, options in gpu.jit.warmups]
    assert gpu.jit.refused and all(_heads_warps(o) == PLANTED for o in gpu.jit.refused)
    assert PLANTED not in compiled and {json.dumps(c) for c in compiled} == {json.dumps(c) for c in (ONE, SAFE, REST)}
    # the failing bucket takes the safe config from now on; the other buckets keep theirs
    assert launch_configs.choose(QK, "gfx942", GPU, 8, 12, amd=True) == SAFE
    assert launch_configs.choose(QK, "gfx942", GPU, 1, 12, amd=True) == ONE
    assert launch_configs.choose(QK, "gfx942", GPU, 100, 12, amd=True) == REST
    assert launch_configs.degraded() == {QK: [{"rules": ["T<=16, H<=any"], "config": PLANTED, "safe": SAFE,
                                               "why": _why(8)}]}
    assert kernel_failures.failed() == frozenset()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and QK in errors[0] and "T<=16, H<=any" in errors[0] and _why(8) in errors[0]


def test_a_config_that_fails_at_launch_is_retried_once_with_the_safe_config(gpu):
    degraded = []
    kernel_failures.guarded("qk_cache", lambda: _launch_qk_cache(8), on_degraded=lambda: degraded.append(1))
    assert [_heads_warps(o) for o in gpu.jit.refused] == [PLANTED]
    assert [_heads_warps(options) for _, _, options in gpu.jit.runs] == [SAFE]  # the batch ran, on the safe config
    assert degraded == [1] and kernel_failures.failed() == frozenset()
    for tokens, config in ((12, SAFE), (1, ONE), (40, REST)):  # the next batches: no failure, no retry
        kernel_failures.guarded("qk_cache", lambda t=tokens: _launch_qk_cache(t),
                                on_degraded=lambda: degraded.append(1))
        assert _heads_warps(gpu.jit.runs[-1][2]) == config
    assert len(gpu.jit.refused) == 1 and degraded == [1]
    assert launch_configs.degraded()[QK][0]["rules"] == ["T<=16, H<=any"]


def test_a_config_the_device_refuses_to_load_degrades_in_the_ahead_of_time_compile(gpu, monkeypatch):
    from triton.runtime.errors import OutOfResources

    gpu.failing.clear()  # every config builds; the T<=16 one needs more shared memory than the GPU has
    jit = FakeJit(QK, load_fails=lambda options: OutOfResources(98304, 65536, "shared memory")
                  if _heads_warps(options) == PLANTED else None)
    monkeypatch.setattr(qk_cache_kernel_module, "qk_cache_kernel", jit)
    with target.compile_only(None) as session:
        _launch_qk_cache(100)
    assert [compiled.loads for _, _, compiled in session.compiled] == [1]  # loaded, as its first launch would
    probe.precompile(QK, torch.device("cpu"), torch.bfloat16, 12, E4M3FNUZ, 16)
    assert launch_configs.choose(QK, "gfx942", GPU, 8, 12, amd=True) == SAFE
    (entry,) = launch_configs.degraded()[QK]
    assert entry["config"] == PLANTED and entry["why"].startswith("OutOfResources: out of resource: shared memory")
    with target.compile_only("gfx950") as session:  # another arch's compile is never loaded here
        _launch_qk_cache(8)
    assert [compiled.loads for _, _, compiled in session.compiled] == [0]


def test_a_safe_config_that_fails_too_refuses_the_fusion_and_the_marker_says_which(gpu):
    gpu.failing.append(SAFE)
    with pytest.raises(RuntimeError, match=r"LDS 4 KiB"):
        probe.precompile(QK, torch.device("cpu"), torch.bfloat16, 12, E4M3FNUZ, 16)
    with pytest.raises(kernel_failures.KernelFailed) as failure:
        kernel_failures.guarded("qk_cache", lambda: _launch_qk_cache(8))
    assert failure.value.why == _why(4)  # the safe config's own failure
    recorded = []
    kernel_failures.refuse(failure.value, lambda fusion, why: recorded.append((fusion, why)))
    assert kernel_failures.failed() == frozenset({"qk_cache"}) and recorded[0][0] == "qk_cache"
    assert launch_configs.degraded() == {QK: [{"rules": ["T<=16, H<=any"], "config": PLANTED, "safe": SAFE,
                                               "why": _why(8), "safe_failed": _why(4)}]}


def test_a_catch_all_that_is_the_safe_config_has_nothing_to_fall_back_to(gpu, monkeypatch):
    monkeypatch.delenv(KERNEL_CONFIGS)  # the shipped table: one rule, the safe config itself
    gpu.failing[:] = [SAFE]
    with pytest.raises(kernel_failures.KernelFailed):
        kernel_failures.guarded("qk_cache", lambda: _launch_qk_cache(8))
    assert len(gpu.jit.refused) == 1 and gpu.jit.runs == []
    assert launch_configs.degraded() == {QK: [{"rules": ["T<=any, H<=any"], "config": SAFE, "safe": SAFE,
                                               "why": _why(4), "safe_failed": _why(4)}]}


def test_a_forced_or_foreign_arch_launch_is_never_degraded(gpu):
    with launch.forced(PLANTED), pytest.raises(RuntimeError, match="LDS 8"):
        _launch_qk_cache(8)  # tune times a candidate: its failure is the candidate's
    gpu.failing.append({"HEADS": 4, "num_warps": 4})
    with target.compile_only("gfx950"), pytest.raises(RuntimeError):
        _launch_qk_cache(8)  # kernels --arch: the compile report wants the failure
    assert launch_configs.degraded() == {}
    assert launch_configs.choose(QK, "gfx942", GPU, 8, 12, amd=True) == PLANTED


# ---- a file that cannot be used -------------------------------------------------------------------

@pytest.mark.parametrize(("text", "problem"), [
    ("{broken", "cannot read launch configs"),
    (json.dumps({**TUNED, "tuned_on": {"device": "AMD Instinct MI325X"}}), "its header says gfx942 on AMD Instinct "
                                                                            "MI325X"),
], ids=["malformed", "foreign"])
def test_an_unusable_tuned_file_for_this_gpu_is_one_error_line_and_the_shipped_configs_run(tmp_path, monkeypatch,
                                                                                           caplog, text, problem):
    path = tmp_path / launch_configs.tuned_name("gfx942", GPU)
    path.write_text(text)
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            assert launch_configs.choose(QK, "gfx942", GPU, 8, 12, amd=True) == SAFE
        sources = launch_configs.sources("gfx942", GPU)
    error = launch_configs.startup_error("gfx942", GPU)
    assert error is not None and str(path) in error and problem in error and "\n" not in error
    assert error.endswith("; this GPU's kernels take the shipped gfx942 launch configs instead")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.ERROR, f"K3 AMD overlay: {error}")]
    assert all(s["file"].endswith("configs/gfx942.json") for s in sources.values())
    assert launch_configs.startup_error("gfx942", "AMD Instinct MI325X") is None


def test_a_tuned_file_for_another_arch_is_an_error_line_not_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(TUNED))
    monkeypatch.setenv(KERNEL_CONFIGS, str(path))
    assert launch_configs.choose(QK, "gfx950", "AMD Instinct MI355X", 8, 12, amd=True) == \
        dict(launch_configs.shipped("gfx950").kernels[QK][-1].config)
    assert "its configs are for gfx942, this GPU is gfx950" in launch_configs.startup_error("gfx950", "x")


def test_a_bad_shipped_file_refuses_the_fusions_not_the_worker(tmp_path, monkeypatch, caplog):
    (tmp_path / "gfx942.json").write_text('{"schema": 1, "arch": "gfx942", "kernels": {"qk_cache_kernel": []}}')
    monkeypatch.setattr(launch_configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, "gfx942"))
    cuda = FakeCuda({0: GPU})
    monkeypatch.setattr(torch.cuda, "get_device_name", cuda.get_device_name)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        described = launch.describe(torch.device("cuda", 0))
        launch.describe(torch.device("cuda", 0))
    assert described["arch"] == "gfx942" and described["kernels"] == {}
    assert "a non-empty list of rules" in described["error"] and described["error"].endswith(
        "; the fused Triton kernels are refused (stock runs)")
    assert launch_configs.startup_error("gfx942", GPU) == described["error"]
    assert [r.getMessage() for r in caplog.records] == [f"K3 AMD overlay: {described['error']}"]
    with pytest.raises(kernel_failures.KernelFailed, match="non-empty list"):
        kernel_failures.guarded("qk_cache", lambda: launch.config_for(QK, torch.device("cuda", 0), 8, 12))


def test_the_first_layer_records_an_unusable_file_in_the_marker_and_goes_on(tmp_path, monkeypatch, caplog):
    from k3_amd_overlay.targets import installer, vllm_env

    path = tmp_path / "mine.json"
    path.write_text(json.dumps(TUNED))  # gfx942's, on this CPU (the interpreter's own table)
    monkeypatch.setenv(KERNEL_CONFIGS, str(path))
    monkeypatch.setattr(vllm_env, "model_coverage", lambda: {})
    settings = load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path)})
    inst = installer.LayerInstaller(settings, Evidence(settings))
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        inst.record_coverage(types.SimpleNamespace(kv_a_layernorm=types.SimpleNamespace(weight=torch.ones(2))))
    recorded = inst.evidence.record.launch_configs
    assert "its configs are for gfx942, this GPU is cpu" in recorded["error"]
    assert recorded["kernels"][QK]["file"].endswith("configs/cpu.json")
    assert [r.getMessage() for r in caplog.records] == [f"K3 AMD overlay: {recorded['error']}"]
