"""``k3_amd_overlay.kernels.launch`` on a CPU through a fake CUDA runtime and a fake Triton kernel:
the config a launch takes (a forced one while ``tune`` times it, AMD-only options kept off NVIDIA,
the device's own name unless compiling for a named arch), the GPU name asked once per index, and a
launch that runs, or only compiles under a compile-only session, and one that fails on the table's
config (degraded: ``ConfigDegraded`` naming the kernel and why; nothing left to try: the failure itself)."""

from __future__ import annotations

import random

import pytest
import torch
from fakes_gpu import FakeCuda, FakeJit

from k3_amd_overlay.kernels import launch, launch_configs, names, target

HIP = target.Target(target.HIP, "gfx942")
CUDA = target.Target(target.CUDA, "sm90")
AMD_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "matrix_instr_nonkdim": 16, "waves_per_eu": 2, "kpack": 2}


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda({0: "AMD Instinct MI300X", 1: "AMD Instinct MI325X", 3: "NVIDIA H200"}, current=3)
    monkeypatch.setattr(torch.cuda, "get_device_name", fake.get_device_name)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    launch._device_name.cache_clear()
    yield fake
    launch._device_name.cache_clear()


@pytest.fixture
def chosen(monkeypatch):
    """launch_configs.choose replaced by a recorder: what the dispatch asked for."""
    asked = []

    def choose(kernel, arch, device_name, num_tokens, num_heads=1, amd=False):
        asked.append((kernel, arch, device_name, num_tokens, num_heads, amd))
        return {"num_warps": 8}

    monkeypatch.setattr(launch_configs, "choose", choose)
    return asked


def test_the_gpu_name_is_the_devices_own_asked_once_per_index_and_none_off_gpu(cuda):
    assert launch.device_name(torch.device("cpu")) is None
    assert launch.device_name(torch.device("meta")) is None
    assert launch.device_name(torch.device("cuda", 1)) == "AMD Instinct MI325X"
    assert launch.device_name(torch.device("cuda", 0)) == "AMD Instinct MI300X"
    assert launch.device_name(torch.device("cuda")) == "NVIDIA H200"  # no index: the current device
    for _ in range(3):
        assert launch.device_name(torch.device("cuda", 1)) == "AMD Instinct MI325X"
    assert cuda.asked == [1, 0, 3]  # each index asked once, however many launches


def test_a_forced_config_is_taken_by_every_launch_within_and_only_within(cuda, chosen, monkeypatch):
    monkeypatch.setattr(target, "of", lambda device: HIP)
    device = torch.device("cuda", 0)
    config = dict(AMD_CONFIG)
    with launch.forced(config):
        config["num_warps"] = 1  # the caller's dict changed afterwards: the forced one is a copy
        assert launch.config_for(names.QK_CACHE_KERNEL, device, 7, 3) == AMD_CONFIG
        with launch.forced({"num_warps": 2}):
            assert launch.config_for(names.QK_CACHE_KERNEL, device, 7, 3) == {"num_warps": 2}
        assert launch.config_for(names.QK_CACHE_KERNEL, device, 7, 3) == AMD_CONFIG  # the outer again
    assert chosen == []
    assert launch.config_for(names.QK_CACHE_KERNEL, device, 7, 3) == {"num_warps": 8}  # the table's again
    with pytest.raises(RuntimeError), launch.forced({"num_warps": 2}):
        raise RuntimeError("a candidate that fails to launch")
    assert launch.config_for(names.QK_CACHE_KERNEL, device, 7, 3) == {"num_warps": 8}  # reset after a failure
    assert launch._forced.get() is None


def test_a_forced_config_keeps_amd_only_options_off_nvidia(cuda, chosen, monkeypatch):
    monkeypatch.setattr(target, "of", lambda device: CUDA)
    with launch.forced(AMD_CONFIG):
        got = launch.config_for(names.ABSORB_QK_CACHE_KERNEL, torch.device("cuda", 3), 16, 8)
    assert got == {"BLOCK_N": 32, "num_warps": 4}
    assert set(launch_configs.AMD_ONLY_OPTIONS) == {"matrix_instr_nonkdim", "waves_per_eu", "kpack"}


@pytest.mark.parametrize(("where", "amd"), [(HIP, True), (CUDA, False)], ids=["hip", "cuda"])
def test_the_table_is_asked_with_the_arch_the_gpu_and_the_batch(cuda, chosen, monkeypatch, where, amd):
    monkeypatch.setattr(target, "of", lambda device: where)
    assert launch.config_for(names.RMSNORM_PAIR_KERNEL, torch.device("cuda", 1), 24) == {"num_warps": 8}
    launch.config_for(names.QK_CACHE_KERNEL, torch.device("cuda", 1), 5, 12)
    assert chosen == [(names.RMSNORM_PAIR_KERNEL, where.arch, "AMD Instinct MI325X", 24, 1, amd),
                      (names.QK_CACHE_KERNEL, where.arch, "AMD Instinct MI325X", 5, 12, amd)]


def test_compiling_for_a_named_arch_never_takes_this_gpus_tuned_file(cuda, chosen, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")  # the real target.of, on a fake MI325X
    monkeypatch.setattr(target, "arch_of", lambda device: "gfx942")
    device = torch.device("cuda", 1)
    with target.compile_only("gfx950"):  # kernels --arch gfx950: the arch's shipped table only
        launch.config_for(names.QK_CACHE_KERNEL, device, 4, 2)
    with target.compile_only(None):  # a site's ahead-of-time compile: this GPU, its tuned file
        launch.config_for(names.QK_CACHE_KERNEL, device, 4, 2)
    assert chosen[0] == (names.QK_CACHE_KERNEL, "gfx950", None, 4, 2, True)
    launch.config_for(names.QK_CACHE_KERNEL, device, 4, 2)
    assert chosen[1] == chosen[2] == (names.QK_CACHE_KERNEL, "gfx942", "AMD Instinct MI325X", 4, 2, True)


def test_describe_names_the_arch_the_gpu_and_each_kernels_source(cuda, monkeypatch):
    monkeypatch.setattr(target, "of", lambda device: HIP)
    monkeypatch.setattr(launch_configs, "sources", lambda arch, name: {"asked": [arch, name]})
    assert launch.describe(torch.device("cuda", 0)) == {"arch": "gfx942", "device": "AMD Instinct MI300X",
                                                         "kernels": {"asked": ["gfx942", "AMD Instinct MI300X"]}}


def test_a_launch_runs_the_kernel_or_only_compiles_it_in_a_compile_only_session():
    kernel = FakeJit("_qk_cache_kernel")
    launch.launch(kernel, (4, 2), "a", 7, num_warps=4, BLOCK=16)
    assert kernel.runs == [((4, 2), ("a", 7), {"num_warps": 4, "BLOCK": 16})] and kernel.warmups == []
    with target.compile_only("gfx942") as session:
        launch.launch(kernel, (8,), "b", num_warps=2)
    assert kernel.runs == [((4, 2), ("a", 7), {"num_warps": 4, "BLOCK": 16})]  # nothing more ran
    assert kernel.warmups == [(("b",), {"grid": (8,), "num_warps": 2})]
    assert session.compiled == [("_qk_cache_kernel", {"num_warps": 2}, "compiled-1")]


def test_a_failed_launch_on_the_tables_config_degrades_it_and_says_which_kernel_failed_and_why(
        cuda, chosen, monkeypatch):
    monkeypatch.setattr(target, "of", lambda device: HIP)
    degraded = []
    answers = iter((True, False))

    def degrade(kernel, arch, device_name, num_tokens, num_heads, why):
        degraded.append((kernel, arch, device_name, num_tokens, num_heads, why))
        return next(answers)

    monkeypatch.setattr(launch_configs, "degrade", degrade)
    lds = random.randrange(65_537, 200_000)
    error = RuntimeError(f"triton compile of the kernel\nout of resource: shared memory, {lds} > 65536")
    kernel = FakeJit(names.QK_CACHE_KERNEL, fails=lambda options: error)
    why = f"RuntimeError: out of resource: shared memory, {lds} > 65536"
    launch.config_for(names.QK_CACHE_KERNEL, torch.device("cuda", 1), 9, 6)
    with pytest.raises(launch_configs.ConfigDegraded) as caught:
        launch.launch(kernel, (2,), num_warps=8)
    assert str(caught.value) == f"{names.QK_CACHE_KERNEL}: {why}" and caught.value.__cause__ is error
    launch.config_for(names.QK_CACHE_KERNEL, torch.device("cuda", 1), 9, 6)
    with pytest.raises(RuntimeError) as caught:  # nothing left to try: the failure itself
        launch.launch(kernel, (2,), num_warps=8)
    assert caught.value is error
    assert degraded == [(names.QK_CACHE_KERNEL, "gfx942", "AMD Instinct MI325X", 9, 6, why)] * 2
