"""A fused kernel that fails on this GPU never takes the server down. A config that fails (Triton
cannot build it for this arch, or the device refuses its launch) is first replaced, in the rules
that pick it, by the arch's safe config and the launch tried again (``launch_configs.degrade``; the
marker's ``launch_configs.degraded`` says which); only a failure that remains (the safe config fails
too, a provider that raises) refuses that fusion for the rest of the process. The batch at hand and
every later one run vLLM's stock path; the compiler's message goes to the log (error) and into the
marker as the fusion's reason, so ``check`` reports it. The sites compile every config a layer can
pick when the layer is installed (``kernels.probe.precompile``, at model load, before the profile
run and any graph capture), so a failure to build shows there, not in served traffic.

A failed Triton launch writes nothing itself: Triton compiles, loads and checks a launch before
the kernel starts, and each Triton provider writes the KV cache and the query in that one launch.
What ran before it stands: on the qk_cache path vLLM's W_UK product and the query buffer; in the
aiter providers of the fp8 and MXFP4 absorptions, AITER's launch, which has written the KV cache
before the overlay's query quant runs; the retry, or the stock path, then writes the same rows
again, and the cache ends as that last writer leaves it. Outside a CUDA graph capture the earlier
work is thrown away; inside one it stays recorded in the graph, before the retry's or the stock
path's own calls, and is replayed with them on every replay: extra work, not a different result."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from k3_amd_overlay.kernels.launch_configs import ConfigDegraded

logger = logging.getLogger("vllm.k3_amd_overlay")
T = TypeVar("T")

_lock = threading.Lock()
_failed: dict[str, str] = {}  # fusion -> why, for this process (a forked child inherits it)


def summary(cause: BaseException) -> str:
    """``cause`` in one line: its type and the last line of its message (the compiler's verdict)."""
    last_line = (str(cause).strip().splitlines() or [""])[-1]
    return f"{type(cause).__name__}: {last_line}" if last_line else type(cause).__name__


class KernelFailed(Exception):
    """A fused launch of ``fusion`` raised ``cause``; the site runs stock instead."""

    def __init__(self, fusion: str, cause: BaseException) -> None:
        self.fusion = fusion
        self.why = summary(cause)
        super().__init__(f"{fusion}: {self.why}")


def failed() -> frozenset[str]:
    """The fusions refused in this process because their kernel failed."""
    return frozenset(_failed)


def reason(fusion: str) -> str | None:
    return _failed.get(fusion)


def guarded(fusion: str, launch: Callable[[], T], on_degraded: Callable[[], None] | None = None) -> T:
    """``launch()``, tried again each time a failed config was degraded to the safe one (then
    ``on_degraded()``: the marker records it); any other exception it raises turned into
    ``KernelFailed`` for ``fusion``. Each retry has degraded another config, so the retries end."""
    while True:
        try:
            return launch()
        except KernelFailed:
            raise
        except ConfigDegraded:
            if on_degraded is not None:
                on_degraded()
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
