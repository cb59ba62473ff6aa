"""Files a command reads that a user or another process wrote (markers, launch-config files, result
files, bench results, model configs): one reader, so each refuses the same things with a reason
the caller puts in its own error: a path that is not a regular file (a FIFO would block the reader
forever), a file that cannot be read or is not UTF-8, text that is not JSON, and JSON nested deeper
than Python's parser can follow (``json`` raises RecursionError there, which no caller expects)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

NOT_REGULAR = "not a regular file (a FIFO, socket, device or folder): not read"


def read_regular(path: str | os.PathLike[str]) -> str:
    """The text of ``path`` where it is a regular file; OSError (NOT_REGULAR) where it is not, and
    UnicodeDecodeError (a ValueError) where it is not UTF-8. Opened without blocking and checked
    before any read: a FIFO named like a result file never hangs the reader."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(NOT_REGULAR)
    with os.fdopen(fd, "rb") as handle:
        return handle.read().decode()


def parse(text: str) -> object:
    """``text`` as JSON; ValueError where it is not, or is nested past the parser's recursion limit."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None


def load(path: str | os.PathLike[str]) -> object:
    """The JSON value in the file at ``path``: OSError where it cannot be read (NOT_REGULAR where it is
    not a regular file), ValueError where it is not UTF-8 JSON a parser can follow."""
    return parse(read_regular(Path(path)))
