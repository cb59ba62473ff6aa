"""Numbers read back from JSON that this process did not just write (markers, node files, result
files, bench results): in Python a JSON number may be a bool, an integer too large for a float, or
not finite (``json`` reads ``Infinity``, ``NaN`` and ``1e400``). These say what a value is, never
raising, so that each reader names the field in its own error; ``kind`` says it in JSON's words."""

from __future__ import annotations

import math


def as_float(value: object) -> float | None:
    """``value`` as a float (an integer too large for one: an infinity); None for a bool or a
    non-number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def finite(value: object) -> float | None:
    """``value`` as a finite float; None for anything else (NaN, an infinity, a bool, a non-number)."""
    number = as_float(value)
    return number if number is not None and math.isfinite(number) else None


def whole(value: object, least: int = 0) -> int | None:
    """``value`` as a whole number of at least ``least``; None for anything else (a bool, a float, a
    string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        return None
    return value


_KINDS = ((bool, "true or false"), (dict, "an object"), (list, "a list"), (str, "a string"), (int | float, "a number"),
          (type(None), "null"))


def kind(value: object) -> str:
    """What a JSON value is, in JSON's words (``an object``, ``a list``), not Python's type names: the
    one wording of every reader's error about a value of the wrong kind."""
    return next((words for python, words in _KINDS if isinstance(value, python)), type(value).__name__)
