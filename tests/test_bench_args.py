"""``bench``'s argument checks, on any Python: each is a usage error (exit 2) naming the value, made
before the CLI looks for torch (``check_args``, which bench's own main() runs too), so a Python
without torch says what was wrong with the command line, not what to install; an option that
replaces a section's benchmark runs only in that section."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from k3_amd_overlay.commands import cli
from k3_amd_overlay.commands.bench import kernels
from k3_amd_overlay.commands.usage import UsageError


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python where torch and triton cannot be found (as the CLI looks for them)."""
    find_spec = importlib.util.find_spec

    def find(name: str, *args: Any) -> Any:
        return None if name.split(".")[0] in ("torch", "triton") else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find)


def _exit(argv: list[str]) -> int:
    """The CLI's exit code for ``argv`` (argparse's own errors exit by SystemExit)."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize("argv,said", [
    (["--absorb-block-n", "0"], "--absorb-block-n 0: a power of two from 1 to 512"),
    (["--json-out", ""], "argument --json-out: '' names no path (an empty value: an unset variable?)"),
    (["--json-out", "/no/such/dir/x.json"], "--json-out /no/such/dir/x.json: the directory /no/such/dir does not "
                                            "exist (bench creates none)"),
    (["--only", "qkv_norm", "--sweep-fp8"], "--only qkv_norm with --sweep-fp8: --sweep-fp8 replaces the absorb_fp8 "
                                            "section, which --only qkv_norm leaves out"),
], ids=["block-n", "empty-json-out", "json-out-dir", "only-and-sweep"])
def test_a_usage_error_is_said_before_torch_is_looked_for(no_torch: None, capsys: pytest.CaptureFixture[str],
                                                          argv: list[str], said: str) -> None:
    """Before, a Python without torch answered each of these with "needs torch", exit 1."""
    assert _exit(["bench", *argv, "--json"]) == 2
    printed = capsys.readouterr()
    data = json.loads(printed.out)
    assert data["exit_status"] == 2 and said in data["usage_error"] and "missing" not in data
    assert "needs torch" not in printed.err and said in printed.err.splitlines()[-1]


def test_an_empty_json_out_names_no_path_like_every_path_option(capsys: pytest.CaptureFixture[str]) -> None:
    """Before, ``--json-out ''`` was read as the current directory: "--json-out : a directory"."""
    with pytest.raises(SystemExit) as exited:
        kernels.main(["--json-out", " "])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exited.value.code == 2 and err == ("k3-amd-overlay bench: error: argument --json-out: ' ' names no path (an "
                                              "empty value: an unset variable?); give the path, or leave the option "
                                              "out")  # no default: left out, no file is written


@pytest.mark.parametrize("option,values,section", [
    ("--absorb-block-n", ["64"], "absorb_qk_cache"),
    ("--sweep-fp8", [], "absorb_fp8"),
    ("--sweep-mxfp4", [], "absorb_mxfp4"),
])
def test_an_option_that_replaces_a_section_runs_only_in_that_section(option: str, values: list[str],
                                                                     section: str) -> None:
    """With --only another section it would have run besides the one asked for (``--only qkv_norm
    --sweep-fp8`` timed the fp8 sweep too); with its own section, or every section, it is taken."""
    def check(*argv: str) -> None:
        kernels.check_args(kernels.parser().parse_args([option, *values, *argv]))

    check()
    check("--only", section)
    for other in (s for s in kernels.SECTIONS if s != section):
        with pytest.raises(UsageError) as refused:
            check("--only", other)
        assert str(refused.value) == (f"--only {other} with {option}: {option} replaces the {section} section, which "
                                      f"--only {other} leaves out; give --only {section}, or leave --only out (every "
                                      "section)")


def test_bench_main_runs_the_same_checks(capsys: pytest.CaptureFixture[str]) -> None:
    """One home for each check: bench's own main() refuses what the CLI refuses, before any benchmark
    (which would import torch and look for a GPU)."""
    assert kernels.main(["--only", "layer_step", "--sweep-mxfp4", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["usage_error"].startswith("--only layer_step with --sweep-mxfp4: ")
