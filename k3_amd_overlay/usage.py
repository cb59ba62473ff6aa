"""Usage errors of the command line and its tools: the one exception (exit 2, as argparse's own),
and the argument checks the A/B tools share, run before any server starts."""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Iterable

from k3_amd_overlay.settings import SWITCH, SettingsError, load_settings


class UsageError(ValueError):
    """A command line that asks for something impossible; the message names the value and why."""


def check_switches(named: Iterable[tuple[str, str]]) -> None:
    """Each (option, K3_AMD_OVERLAY value) is a valid switch value."""
    for name, value in named:
        try:
            load_settings({SWITCH: value})
        except SettingsError as exc:
            raise UsageError(f"{name}: {exc}") from None


def check_executables(named: Iterable[tuple[str, str]]) -> None:
    """Each (option, command line) starts with an executable on PATH."""
    for name, command in named:
        words = shlex.split(command)
        if not words or shutil.which(words[0]) is None:
            raise UsageError(f"{name} {command!r}: {words[0] if words else 'nothing'} is not an executable on PATH")


def check_baselines(named: Iterable[tuple[str, str]], serve_args: str, accept: bool) -> list[str]:
    """Each (arm, K3_AMD_OVERLAY value) against baseline_hazard, in the environment the servers
    inherit: UsageError naming every hazardous arm unless ``accept`` (--accept-baseline-hazard),
    then the reasons, for the run's warnings and its summary."""
    from k3_amd_overlay.baseline_hazard import ACCEPT_FLAG, baseline_hazard, facts_here

    facts = facts_here()
    reasons = [f"{name}: {why}" for name, value in named
               if (why := baseline_hazard(facts, dict(os.environ), serve_args, value))]
    if reasons and not accept:
        raise UsageError("; ".join(reasons) + f" (to measure it anyway, pass {ACCEPT_FLAG}: the summary says so)")
    return reasons
