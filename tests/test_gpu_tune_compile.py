"""On a GPU: ``tune``'s spawned compile workers leave each candidate compiled in Triton's on-disk
cache, so that the tuning process's first launch of it compiles nothing new (Triton makes a cache
directory for every kernel key it looks up: none appears while the tuning process checks the
candidates' bytes), and the bytes are what the reference wants."""

from __future__ import annotations

import pytest
import torch

from k3_amd_overlay.commands import tune, tune_compile
from k3_amd_overlay.fp8 import device_format
from k3_amd_overlay.kernels import names

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]


@pytest.mark.parametrize(("kernel", "tokens"), [(names.QK_CACHE_KERNEL, 8), (names.ABSORB_QK_CACHE_KERNEL, 64),
                                                (names.ABSORB_FP8_QK_CACHE_KERNEL, 4)])
def test_the_workers_compile_what_the_tuning_process_then_launches(kernel, tokens, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # empty: each compile shows as a new directory
    heads = 16
    configs = tune.candidates(kernel, tokens, amd=torch.version.hip is not None)[::5][:6]
    with tune_compile.Compiler(3, torch.cuda.current_device()) as compiler:
        assert compiler.compile(kernel, tokens, heads, configs) == len(configs)
    compiled = {p.name for p in tmp_path.iterdir()}
    assert len(compiled) >= len(configs)
    torch.manual_seed(0)
    case = tune.Case(kernel, tokens, heads, device_format(torch.device("cuda")))
    for config in configs:
        assert case.mismatches(config)[1] == 0, config
    new = {p.name: sorted(f.name for f in p.iterdir()) for p in tmp_path.iterdir() if p.name not in compiled}
    assert new == {}, new  # each entry's files say what compiled: a kernel's, a launcher, a driver module
