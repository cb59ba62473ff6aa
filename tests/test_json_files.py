"""json_files: the one reader of JSON files others wrote refuses a FIFO without blocking, and reads
JSON nested past the parser's limit as a ValueError, as it does text that is not JSON."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from k3_amd_overlay import json_files


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    """The value of a well-formed file comes back as written."""
    path = tmp_path / "r.json"
    path.write_text('{"a": [1, 2.5, "x"]}')
    assert json_files.load(path) == {"a": [1, 2.5, "x"]}


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_what_is_not_a_regular_file_is_refused_at_once(kind: str, tmp_path: Path) -> None:
    """A FIFO (which would block a plain read until a writer came) or a folder: OSError(NOT_REGULAR)."""
    path = tmp_path / "x.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    started = time.monotonic()
    with pytest.raises(OSError, match="not a regular file"):
        json_files.load(path)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(("text", "reason"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    ("{not json", "Expecting"),
])
def test_json_a_parser_cannot_follow_is_a_value_error(text: str, reason: str, tmp_path: Path) -> None:
    """Nesting past the recursion limit (json's RecursionError) and malformed text: both ValueError."""
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=reason):
        json_files.load(path)


def test_bytes_that_are_not_utf8_are_a_value_error(tmp_path: Path) -> None:
    """A file that is not UTF-8: ValueError (UnicodeDecodeError), which callers already catch."""
    path = tmp_path / "latin.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError):
        json_files.load(path)
