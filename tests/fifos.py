"""FIFOs where a command reads a file: a reader that opens one blocks until a writer comes, so each
test that gives one to the code under test sends a writer after a while (``rescued``): code that
blocks then reads nothing and fails the test, rather than hanging the suite."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

RESCUE_S = 5.0


def fifo_at(path: Path) -> Path:
    """``path``, replaced by a FIFO."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


@contextlib.contextmanager
def rescued(fifo: Path, seconds: float = RESCUE_S) -> Iterator[Path]:
    """The block must end before a writer opens and closes ``fifo`` (where it is one by then), after
    ``seconds``: code that blocks reading it then reads nothing and fails the test, rather than hangs it."""
    def unblock() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO where no reader waits: nothing to do
        except OSError:
            pass

    rescue = threading.Timer(seconds, unblock)
    rescue.start()
    started = time.monotonic()
    try:
        yield fifo
    finally:
        rescue.cancel()
    assert time.monotonic() - started < seconds
