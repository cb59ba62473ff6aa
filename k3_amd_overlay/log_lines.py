"""Where the overlay's own report lines go: through the ``vllm`` logger hierarchy once vLLM has
configured it, to stderr before, so that no line is lost to an unconfigured logger."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("vllm.k3_amd_overlay")


def emit(level: int, line: str) -> None:
    """``line`` at ``level``: through the vllm logger once vLLM has configured it; stderr before."""
    if logging.getLogger("vllm").handlers:
        logger.log(level, line)
    else:
        print(line, file=sys.stderr, flush=True)
