"""A fused kernel that fails on this GPU never takes the server down: Triton that cannot build a
kernel for this arch (an older ROCm Triton, an unexpected GPU), a launch the device refuses, or a
provider that raises refuses that fusion for the rest of the process. The batch at hand and every
later one run vLLM's stock path; the compiler's message goes to the log (error) and into the
marker as the fusion's reason, so ``check`` reports it. The sites compile every config a layer can
pick at its first fused call (``kernels.probe.precompile``), which vLLM makes in its warm-up runs,
before capturing any graph, so a failure shows there, not in served traffic.

A failure raised inside the fused launch leaves nothing written: Triton compiles and checks a
launch before the kernel starts, and the overlay's providers write the KV cache and the query only
in that one launch."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("vllm.k3_amd_overlay")
T = TypeVar("T")

_lock = threading.Lock()
_failed: dict[str, str] = {}  # fusion -> why, for this process (a forked child inherits it)


class KernelFailed(Exception):
    """A fused launch of ``fusion`` raised ``cause``; the site runs stock instead."""

    def __init__(self, fusion: str, cause: BaseException) -> None:
        first_line = (str(cause).strip().splitlines() or [""])[-1]
        self.fusion = fusion
        self.why = f"{type(cause).__name__}: {first_line}" if first_line else type(cause).__name__
        super().__init__(f"{fusion}: {self.why}")


def failed() -> frozenset[str]:
    """The fusions refused in this process because their kernel failed."""
    return frozenset(_failed)


def reason(fusion: str) -> str | None:
    return _failed.get(fusion)


def guarded(fusion: str, launch: Callable[[], T]) -> T:
    """``launch()``, any exception it raises turned into ``KernelFailed`` for ``fusion``."""
    try:
        return launch()
    except KernelFailed:
        raise
    except Exception as exc:
        raise KernelFailed(fusion, exc) from exc


def refuse(failure: KernelFailed, record: Callable[[str, str], None]) -> None:
    """Refuse ``failure.fusion`` for this process (once): log it and ``record(fusion, reason)``."""
    with _lock:
        if failure.fusion in _failed:
            return
        why = (f"its kernel failed on this GPU, so the stock path runs for the rest of this process: "
               f"{failure.why}")
        _failed[failure.fusion] = why
    logger.error("k3-amd-overlay: %s refused: %s", failure.fusion, why, exc_info=failure.__cause__)
    record(failure.fusion, why)
