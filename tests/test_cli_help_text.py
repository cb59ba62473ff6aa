"""The help text of the commands ``commands/cli.py`` builds itself (the top level, ``check``,
``census``, ``doctor``), compared whole against ``tests/golden/help-*.txt``: a changed word, option,
metavar or default is a deliberate change (regenerate with ``K3OVL_UPDATE_GOLDEN=1``), never a
side effect. The tools' own help is pinned by their contract tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3_amd_overlay.commands.cli import main

GOLDEN = Path(__file__).parent / "golden"
COMMANDS = {"top": [], "check": ["check"], "census": ["census"], "doctor": ["doctor"]}


@pytest.mark.parametrize("name", COMMANDS)
def test_the_help_is_the_golden_text(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps at the terminal's width
    with pytest.raises(SystemExit) as exited:
        main([*COMMANDS[name], "--help"])
    out = capsys.readouterr().out
    path = GOLDEN / f"help-{name}.txt"
    if os.environ.get("K3OVL_UPDATE_GOLDEN") == "1":
        path.write_text(out)
    assert exited.value.code == 0 and out == path.read_text()
