"""Compile times drawn for tests that compare the overlay's one-decimal print of a time with their own:
a value never ending in x.x5, so a float sum or a clock difference and the value print the same."""

from __future__ import annotations

import random


def seconds_between(low: float, high: float) -> float:
    """A random time of the form x.x3: a tenth from ``low`` to ``high`` (both included), plus 0.03."""
    return round(random.randint(round(low * 10), round(high * 10)) / 10 + 0.03, 3)
