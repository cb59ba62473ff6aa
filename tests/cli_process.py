"""The overlay's command line in a fresh process, with doctor's self-test run or left out. On CPU
the self-test runs every fused kernel under the Triton interpreter (4 s with its own launch configs,
cpu.json; 24 s before them); the tests that judge something else (verdict lines, ``check --static``)
leave it out, and the test of the main job (``doctor --json`` with the overlay on) runs it for real,
on every release. And argument lists of defaults that a test's own options replace (an option given
twice is a usage error)."""

from __future__ import annotations

import sys

# `python -c` with doctor.selftest replaced by an empty self-test, then the real entry point
_WITHOUT_SELF_TEST = ("import sys\nfrom k3_amd_overlay.commands import doctor\ndoctor.selftest = lambda device: []\n"
                      "from k3_amd_overlay.commands.cli import main\nraise SystemExit(main(sys.argv[1:]))")


def cli_command(*args: str, self_test: bool = True) -> list[str]:
    """``k3-amd-overlay ARGS`` in this interpreter; ``self_test=False``: doctor's self-test left out."""
    entry = ["-m", "k3_amd_overlay"] if self_test else ["-c", _WITHOUT_SELF_TEST]
    return [sys.executable, *entry, *args]


def with_defaults(defaults: dict[str, str], args: tuple[str, ...] | list[str]) -> list[str]:
    """``defaults`` (option -> value) less those ``args`` give, then ``args``."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    return [*(x for option, value in defaults.items() if option not in given for x in (option, value)), *args]
