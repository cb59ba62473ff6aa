"""Test session setup (tests/machine.py decides GPU or interpreter, vLLM or not), which tests depend
on the vLLM release (``--release-independent``: scripts/run_tests.sh runs those once), and the
fixtures shared across test files: the AITER stand-in and the real-vLLM layer session."""

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiter_standin import AiterStandIn
from machine import HAS_GPU, HAS_VLLM

# Test modules none of whose tests reads or runs the installed vLLM, directly or through the package
# (no vLLM import, no vLLM source read, no vLLM process): each runs the same in every release's venv.
# A test in one of them that does need the installed vLLM is marked `vllm`, and runs on every release.
# Checked by reading each module, and by running it with `import vllm` refused (no attempt made).
# Not here, because they read the installed release: the A/B harness tests (test_ab, test_ab_runs:
# the baseline-hazard check reads the installed vLLM's K3 code), shapes, activation, the installer,
# sites, predicates, field faults (vllm_env), the vLLM plugin, layer and call tests.
RELEASE_INDEPENDENT_MODULES = frozenset({
    "test_ab_attribution.py",
    "test_ab_bad_input.py",
    "test_ab_serve_contract.py",
    "test_ab_verdict_evidence.py",
    "test_amd_rules_derived.py",
    "test_bench_args.py",
    "test_bench_json_out.py",
    "test_bench_layer_step.py",
    "test_census.py",
    "test_census_attribution.py",
    "test_census_provenance.py",
    "test_check_merge.py",
    "test_check_off.py",
    "test_cli_contract.py",
    "test_cli_help_text.py",
    "test_compile_report.py",
    "test_engine.py",
    "test_evidence.py",
    "test_gsm8k_ab_contract.py",
    "test_json_files.py",
    "test_json_values.py",
    "test_kernel_failures_containment.py",
    "test_launch_configs.py",
    "test_launch_dispatch.py",
    "test_package.py",
    "test_probe_sampling.py",
    "test_settings.py",
    "test_tune_choice.py",
})
RELEASE_CHOICES = ("all", "only", "skip")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--release-independent", choices=RELEASE_CHOICES, default="all",
                     help="the tests that do not depend on the vLLM release (the kernel tests and "
                          "RELEASE_INDEPENDENT_MODULES, less those marked vllm; and those marked any_release): "
                          "run them with the rest (all, the default), alone (only) or not at all (skip); "
                          "scripts/run_tests.sh runs them once (only) and each release's venv with skip")


def release_independent(item: pytest.Item) -> bool:
    """Whether ``item`` runs the same whichever vLLM release is installed: marked ``any_release``
    (it needs a vLLM, any one), or a kernel test or in RELEASE_INDEPENDENT_MODULES and not marked
    ``vllm``."""
    if item.get_closest_marker("any_release") is not None:
        return True
    if item.get_closest_marker("vllm") is not None:
        return False
    return item.get_closest_marker("kernels") is not None or item.path.name in RELEASE_INDEPENDENT_MODULES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU: run scripts/gpu_check.sh on the GPU machine")
    skip_vllm = pytest.mark.skip(reason="needs a real vLLM: run through scripts/run_tests.sh (one venv per vLLM)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not HAS_VLLM:
            item.add_marker(skip_vllm)
    choice = config.getoption("--release-independent")
    if choice != "all":
        wanted = {id(item): release_independent(item) == (choice == "only") for item in items}
        config.hook.pytest_deselected(items=[item for item in items if not wanted[id(item)]])
        items[:] = [item for item in items if wanted[id(item)]]


@pytest.fixture(autouse=True)
def no_exit_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Evidence made by a test registers its marker's exit flush; by the interpreter's exit the
    test's directory is gone, so the flush would only print failures. Tests see the registration
    through this stand-in registration instead."""
    from k3_amd_overlay import process_hooks

    monkeypatch.setattr(process_hooks, "register_exit_flush", lambda function: None)


# Variables a test may not leave changed behind it: the rest of the run (the interpreter, the
# overlay's switch, vLLM's log stream) reads them; a test changes them through monkeypatch only.
GUARDED_VARIABLES = ("TRITON_INTERPRET", "VLLM_TARGET_DEVICE", "VLLM_LOGGING_STREAM", "K3_AMD_OVERLAY",
                     "K3_AMD_OVERLAY_KERNEL_CONFIGS", "K3_AMD_OVERLAY_MARKER_DIR")


@pytest.fixture(autouse=True)
def environment_left_as_found() -> Any:
    """Fails the test that changed a guarded variable and left it so (a test's compile_arch once
    dropped TRITON_INTERPRET from the whole run, and every later interpreter test failed)."""
    before = {name: os.environ.get(name) for name in GUARDED_VARIABLES}
    yield
    after = {name: os.environ.get(name) for name in GUARDED_VARIABLES}
    changed = {name: (before[name], after[name]) for name in GUARDED_VARIABLES if before[name] != after[name]}
    for name, (value, _) in changed.items():  # put back, so one leak fails one test, not the run
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    assert not changed, f"the test left environment variables changed (before, after): {changed}"


TORCH_FACTORIES = ("randn", "empty", "zeros", "randperm", "tensor", "randint")


@pytest.fixture
def cpu_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's factories told ``device="cuda"`` make CPU tensors, seeded 0 as ``tune`` seeds: a
    GPU-only command's inputs built on this CPU."""
    import functools

    import torch

    def on_cpu(factory: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(factory)
        def make(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return make

    for name in TORCH_FACTORIES:
        monkeypatch.setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.manual_seed(0)


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """What the overlay reports as its own lines (log_lines.emit: through the vllm logger or stderr,
    whichever is live), as (level, line) pairs."""
    from k3_amd_overlay import log_lines

    lines: list[tuple[int, str]] = []
    monkeypatch.setattr(log_lines, "emit", lambda level, line: lines.append((level, line)))
    return lines


@pytest.fixture
def aiter_triton(monkeypatch: pytest.MonkeyPatch) -> Any:
    """AMD's AITER Triton kernels, callable here (``k3_amd_overlay.commands.bench.aiter_peers``), with the
    overlay's AITER providers let onto this GPU; skips with the reason where they are not."""
    from k3_amd_overlay.commands.bench import aiter_peers
    from k3_amd_overlay.ops import aiter_absorb

    if not HAS_GPU:
        pytest.skip("AITER's Triton kernels need a GPU")
    why = aiter_peers.enable()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(aiter_absorb, "device_missing", lambda device: None)  # on ROCm it is None anyway
    return aiter_peers


@pytest.fixture
def aiter_standin(monkeypatch: pytest.MonkeyPatch) -> Callable[..., AiterStandIn]:
    """``aiter_standin(version=..., fmt=...)``: AITER's op replaced by the stand-in
    (tests/aiter_standin.py) for this test; everything it changed is undone after it."""

    def install(**kwargs: Any) -> AiterStandIn:
        return AiterStandIn(**kwargs).install(monkeypatch)

    return install


@pytest.fixture(scope="session")
def vllm_layer_session() -> Iterator[None]:
    """The vLLM config, process group and CPU attention core that tests/layer_harness.py builds
    layers in, opened once per session and closed (every change undone) at its end."""
    if not HAS_VLLM:
        yield
        return
    import layer_harness

    with layer_harness.session():
        yield
