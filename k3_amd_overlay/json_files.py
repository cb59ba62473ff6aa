"""Files a command reads that a user or another process wrote (markers, launch-config files, result
files, bench results, model configs): one reader, so each refuses the same things with a reason
the caller puts in its own error: a path that is not a regular file (a FIFO would block the reader
forever), a file that cannot be read or is not UTF-8, text that is not JSON, and JSON nested deeper
than Python's parser can follow (``json`` raises RecursionError there, which no caller expects).
And the one writer of such files that other processes read while they change (markers, the
self-measurement): a temporary file beside the target and one rename."""

from __future__ import annotations

import json
import os
import stat
import tempfile
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


def replace_atomically(path: Path, text: str, prefix: str, durable: bool = False) -> None:
    """``text`` as the file at ``path``, written to a temporary file beside it (``prefix``...``.tmp``)
    and renamed over it: a reader sees the old file or the new, never half of one; ``durable``: flushed
    to disk before the rename (a crash then leaves the old file or the whole new one). The temporary
    file is removed on any failure."""
    fd, temporary = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
