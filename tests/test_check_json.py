"""``check --json`` gives one JSON object on every path, usage errors included (exit 2): a script
reading it never gets argparse's text or a traceback instead."""

from __future__ import annotations

import json

import pytest

from k3_amd_overlay.commands.cli import main


def check(argv: list[str]) -> int:
    try:
        return main(["check", *argv])
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


@pytest.mark.parametrize("argv,message", [
    (["--json"], "the following arguments are required: --expect"),
    (["--json", "--expect", "fast"], "argument --expect: invalid choice: 'fast'"),
    (["--expect", "fused", "--json", "--bogus"], "unrecognized arguments: --bogus"),
    (["--expect", "fused", "--js", "--fusions", "fast"], "--fusions: unknown fast; allowed: qkv_norm, qk_cache"),
    (["--expect", "fused", "--json", "--fusions", "fast, qk_cache,slow"],
     "--fusions: unknown fast, slow; allowed: qkv_norm, qk_cache, absorb_qk_cache"),
    (["--expect", "fused", "--json", "--static", "--merge", "x.json"], "--merge, --static and --prune each judge"),
    (["--expect", "fused", "--json", "--static", "--prune"], "--merge, --static and --prune each judge"),
    (["--expect", "fused", "--json", "--merge", "missing.json"], "--merge: missing.json is not the output of"),
])
def test_usage_errors_are_one_json_object_with_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = check(argv)
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert code == 2 and data["holds"] is False and data["usage_error"].startswith(message), captured
    assert data["lines"] == [f"FAIL usage: {data['usage_error']}"] and data["records"] == []
    assert message in captured.err  # and the person at a terminal still reads it
    # without --json the same error stays text, on stderr only
    code = check([a for a in argv if a not in ("--json", "--js")])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and message in captured.err
