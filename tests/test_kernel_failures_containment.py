"""Failure containment (``k3_amd_overlay.kernel_failures``) against the exceptions a fused launch
really raises: Triton's compile error and out-of-resources launch error, a device-side
``RuntimeError`` subclass (torch's out-of-memory), an ``OSError`` from the compiler's cache, a
message-less error; each becomes one ``KernelFailed`` naming the last line of the compiler's text,
is refused once per fusion, logged under vLLM's logger with its traceback, and recorded."""

from __future__ import annotations

import ast
import logging

import pytest
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from k3_amd_overlay import kernel_failures

LOGGER = "vllm.k3_amd_overlay"
PREFIX = "its kernel failed on this GPU, so the stock path runs for the rest of this process: "


@pytest.fixture(autouse=True)
def _fresh():
    """The process's own record, emptied for the test and restored after (not a replacement dict:
    the module's initial record is what a server process starts with)."""
    saved = dict(kernel_failures._failed)
    kernel_failures._failed.clear()
    yield
    kernel_failures._failed.clear()
    kernel_failures._failed.update(saved)


def _raise(exc: BaseException):
    def launch():
        raise exc
    return launch


# (exception as the launch raises it, the reason it must leave)
CASES = [
    pytest.param(CompilationError("def k(x):\n    tl.dot(a, b)\n", ast.parse("x").body[0],
                                  "tl.dot: shapes mismatch"), "CompilationError", id="triton-compile"),
    pytest.param(OutOfResources(70000, 65536, "shared memory"),
                 "OutOfResources: out of resource: shared memory, Required: 70000, Hardware limit: 65536. "
                 "Reducing block sizes or `num_stages` may help.", id="triton-launch"),
    pytest.param(torch.OutOfMemoryError("HIP out of memory.\nTried to allocate 2.00 GiB"),
                 "OutOfMemoryError: Tried to allocate 2.00 GiB", id="runtime-subclass"),
    pytest.param(OSError(28, "No space left on device"), "OSError: [Errno 28] No space left on device", id="oserror"),
    pytest.param(RuntimeError("PassManager::run failed\n  \nerror: LDS 70000 > 65536\n"),
                 "RuntimeError: error: LDS 70000 > 65536", id="multi-line"),
    pytest.param(RuntimeError(), "RuntimeError", id="no-message"),
    pytest.param(ValueError("  \n  "), "ValueError", id="blank-message"),
]


@pytest.mark.parametrize(("exc", "why"), CASES)
def test_every_kind_of_launch_failure_becomes_one_refusal_with_the_compilers_last_line(exc, why, caplog):
    if isinstance(exc, CompilationError):  # its text is the source excerpt, then the message last
        why = f"CompilationError: {str(exc).strip().splitlines()[-1]}"
    recorded = []
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        for fusion in ("absorb_qk_cache", "absorb_qk_cache", "qkv_norm"):
            with pytest.raises(kernel_failures.KernelFailed) as failure:
                kernel_failures.guarded(fusion, _raise(exc))
            assert failure.value.fusion == fusion and failure.value.why == why
            assert str(failure.value) == f"{fusion}: {why}"
            assert failure.value.__cause__ is exc
            kernel_failures.refuse(failure.value, lambda f, w: recorded.append((f, w)))
    assert recorded == [("absorb_qk_cache", PREFIX + why), ("qkv_norm", PREFIX + why)]
    assert kernel_failures.failed() == frozenset({"absorb_qk_cache", "qkv_norm"})
    assert kernel_failures.reason("absorb_qk_cache") == PREFIX + why
    assert kernel_failures.reason("qk_cache") is None
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (LOGGER, logging.ERROR, f"k3-amd-overlay: absorb_qk_cache refused: {PREFIX}{why}"),
        (LOGGER, logging.ERROR, f"k3-amd-overlay: qkv_norm refused: {PREFIX}{why}")]
    assert all(r.exc_info and r.exc_info[1] is exc for r in caplog.records)  # the compiler's traceback


def test_a_launch_that_succeeds_returns_its_value_and_refuses_nothing():
    assert kernel_failures.guarded("qk_cache", lambda: ("out", 3)) == ("out", 3)
    assert kernel_failures.failed() == frozenset() and kernel_failures.reason("qk_cache") is None


def test_a_failure_already_named_for_a_fusion_keeps_its_fusion_through_an_outer_guard():
    inner = kernel_failures.KernelFailed("absorb_qk_cache", OutOfResources(1, 0, "registers"))
    with pytest.raises(kernel_failures.KernelFailed) as failure:
        kernel_failures.guarded("qk_cache", _raise(inner))
    assert failure.value is inner and failure.value.fusion == "absorb_qk_cache"


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)], ids=["interrupt", "exit"])
def test_an_interrupt_is_never_taken_for_a_kernel_failure(exc):
    with pytest.raises(type(exc)):
        kernel_failures.guarded("qk_cache", _raise(exc))
    assert kernel_failures.failed() == frozenset()


def test_the_process_wide_record_is_per_fusion_and_a_second_failure_keeps_the_first_reason():
    first = kernel_failures.KernelFailed("qk_cache", RuntimeError("first"))
    second = kernel_failures.KernelFailed("qk_cache", RuntimeError("second"))
    recorded = []
    kernel_failures.refuse(first, lambda f, w: recorded.append(w))
    kernel_failures.refuse(second, lambda f, w: recorded.append(w))
    assert recorded == [PREFIX + "RuntimeError: first"] and kernel_failures.reason("qk_cache") == recorded[0]
    assert isinstance(kernel_failures.failed(), frozenset)


def test_a_launch_whose_config_was_degraded_is_tried_again_and_a_later_failure_still_refuses():
    from k3_amd_overlay.kernels.launch_configs import ConfigDegraded

    tries, degraded = [], []

    def launch():
        tries.append(1)
        if len(tries) < 3:
            raise ConfigDegraded(f"qk_cache_kernel: config {len(tries)} failed")
        raise OutOfResources(70000, 65536, "shared memory")

    with pytest.raises(kernel_failures.KernelFailed) as failure:
        kernel_failures.guarded("qk_cache", launch, on_degraded=lambda: degraded.append(len(tries)))
    assert tries == [1, 1, 1] and degraded == [1, 2]
    assert failure.value.why.startswith("OutOfResources: out of resource: shared memory")
    assert kernel_failures.guarded("qk_cache", lambda: "ran") == "ran"  # no degrade: one try, no callback
    assert degraded == [1, 2]
