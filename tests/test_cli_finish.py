"""The command line without torch or triton (the wrong interpreter, a slim container): each command
says what to install and exits non-zero (1; 2 stays a usage error), ``--help`` works, no traceback.
And a subcommand's usage error shows that subcommand's usage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import k3_amd_overlay

# The package under test (the working tree, or whatever PYTHONPATH puts first), for child Pythons.
PACKAGE_ROOT = str(Path(k3_amd_overlay.__file__).resolve().parent.parent)

# In every Python started with this on its path (the CLI's children too), torch and triton cannot
# be imported, as in a Python that never had them.
BLOCKER = '''
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
'''

# (argv, exit code, what stdout starts with or stderr says)
WITHOUT_TORCH = [
    (["doctor"], 1, "needs torch"),
    (["kernels", "--arch", "gfx942"], 1, "needs torch"),
    (["kernels"], 1, "needs torch"),
    (["tune"], 1, "needs torch"),
    (["bench"], 1, "needs torch"),
    (["check", "--expect", "fused", "--static"], 1, "needs torch"),
    (["tune", "--out", "/no/such/dir/x.json"], 2, "the directory /no/such/dir does not exist"),
    (["tune", "--jobs", "0"], 2, "--jobs 0: give a positive number"),
    (["bench", "--absorb-block-n", "0"], 2, "--absorb-block-n 0: a power of two from 1 to 512"),
    (["bench", "--json-out", ""], 2, "'' names no path"),
    (["bench", "--json-out", "/no/such/dir/x.json"], 2, "the directory /no/such/dir does not exist"),
    (["bench", "--only", "qkv_norm", "--sweep-fp8"], 2, "--sweep-fp8 replaces the absorb_fp8 section"),
    (["ab-serve", "--model", "", "--out", "/tmp/x"], 2, "--model '' names nothing"),
    (["gsm8k-ab", "--model", "m", "--out", "/tmp/x", "--task", ""], 2, "--task '' names nothing"),
    (["kernels", "--device", ""], 2, "--device '': a GPU name as k3-amd-overlay tune records it is needed"),
    (["measure", "--heads", "0"], 2, "--heads 0: every value must be a positive integer"),
    (["measure", "--model", ""], 2, "--model '' names no model"),
    (["measure", "--heads", "12", "--out", "/dev/null/x"], 2, "lies under /dev/null, which is a file"),
    (["tune", "--compare", "x.json", "--out", "d"], 2, "--out d and --compare: --compare writes no file"),
    (["tune", "--compare", "/no/such.json"], 2, "--compare /no/such.json: no such file"),
    (["doctor", "--switch", "bogus"], 2, "--switch: K3_AMD_OVERLAY='bogus' is not valid"),
    (["doctor", "--serve-args", "'x"], 2, "No closing quotation (quote it as a shell would)"),
    (["check", "--expect", "off", "--allow-mixed"], 2, "--allow-mixed applies to --expect fused only"),
    (["census", "t.json", "--steps", "5"], 2, "--steps 5 without --baseline"),
    (["census", "t.json", "--layers", "30"], 2, "--layers 30 without --steps"),
    (["census"], 2, "the following arguments are required: traces"),
    (["check"], 2, "the following arguments are required: --expect"),
]
HELP = [["doctor"], ["check"], ["census"], ["kernels"], ["tune"], ["bench"], ["bench", "plot"], ["ab-serve"],
        ["ab-serve", "report"], ["gsm8k-ab"]]
# In one child Python: each command's --help (full option list, no traceback) and a --json run of
# each command that needs torch (one JSON object saying what to install, exit 1).
BATCH = """
import contextlib, io, json, sys
from k3_amd_overlay.commands.cli import main
out = {}
for argv in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    out[" ".join(argv)] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


def _run(python: str, argv: list[str], pythonpath: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")]),
           "K3_AMD_OVERLAY": "1"}
    return subprocess.run([python, "-m", "k3_amd_overlay", *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=Path(PACKAGE_ROOT).parent)


@pytest.fixture(scope="module")
def blocked(tmp_path_factory) -> list[str]:
    """A PYTHONPATH entry whose sitecustomize makes torch and triton unimportable."""
    directory = tmp_path_factory.mktemp("no-torch")
    (directory / "sitecustomize.py").write_text(BLOCKER)
    probe = _run(sys.executable, ["--version"], [str(directory)])
    assert probe.returncode == 0, probe.stderr
    check = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(directory)})
    assert "No module named 'torch'" in check.stderr, "the blocker did not take"
    return [str(directory)]


def _assert_said(proc: subprocess.CompletedProcess[str], code: int, said: str) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert said in proc.stderr, proc.stderr
    if said == "needs torch":  # what to install, and where it is normally found
        assert "pip install torch" in proc.stderr and "the Python vLLM is installed in" in proc.stderr


@pytest.mark.parametrize("argv,code,said", WITHOUT_TORCH, ids=[" ".join(a) for a, _, _ in WITHOUT_TORCH])
def test_without_torch_each_command_says_what_to_install(blocked, argv, code, said):
    _assert_said(_run(sys.executable, argv, blocked), code, said)


def test_without_torch_every_help_is_whole_and_every_json_run_one_object(blocked):
    """Each command's and sub-subcommand's --help with its full option list (the tools import
    torch only where they run), and each command that needs torch, with --json: one object saying
    what to install, exit 1; all in one child Python."""
    runs = [[*c, "--json"] for c in (["doctor"], ["bench"], ["tune"], ["kernels", "--arch", "gfx942"])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*blocked, PACKAGE_ROOT])}
    proc = subprocess.run([sys.executable, "-c", BATCH, json.dumps([[*c, "--help"] for c in HELP] + runs)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=Path(PACKAGE_ROOT).parent)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    for command in HELP:
        code, out, err = results[" ".join([*command, "--help"])]
        assert code == 0 and "Traceback" not in err, (command, err)
        assert out.startswith(f"usage: k3-amd-overlay {' '.join(command)}") and "--json" in out, (command, out[:300])
        assert "options:" in out and "needs torch" not in out, (command, out)
    for argv in runs:
        code, out, err = results[" ".join(argv)]
        data = json.loads(out)
        assert code == 1 and data["ok"] is False and data["missing"] == "torch", (argv, out)
        assert "pip install torch" in data["error"] and "Traceback" not in err, (argv, err)


def test_without_torch_json_is_one_object_saying_what_is_missing(blocked):
    proc = _run(sys.executable, ["doctor", "--json"], blocked)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] is False and out["missing"] == "torch" and "pip install torch" in out["error"]


def test_without_torch_check_json_still_gives_its_verdict_keys(blocked):
    """A script reading ``holds`` from ``check --json`` finds it on this path too, false, as on a usage
    error; without the fix the object had only the common keys."""
    proc = _run(sys.executable, ["check", "--expect", "fused", "--static", "--json"], blocked)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert out["missing"] == "torch" and out["holds"] is False and out["records"] == []
    assert out["expect"] == "fused"  # the arguments were read: what was asked is said (was null)
    assert out["lines"] == [f"FAIL missing torch: {out['error']}"]
    assert out["overlay_version"] == k3_amd_overlay.__version__


def test_without_torch_tune_plan_for_a_named_arch_counts(blocked):
    """``tune --plan --arch`` needs no GPU, torch or triton: it counts (before, the CLI asked for torch)."""
    proc = _run(sys.executable, ["tune", "--plan", "--arch", "gfx942", "--heads", "12", "--json"], blocked)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["plan"]["candidates"] == 1978
    assert _run(sys.executable, ["tune", "--plan", "--heads", "12"], blocked).returncode == 1  # this GPU's arch: torch


def test_a_missing_triton_alone_is_named(tmp_path):
    """torch present (as in CI's CPU venvs), triton absent: the tools that compile say triton."""
    pytest.importorskip("torch")
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.replace('("torch", "triton")', '("triton",)'))
    proc = _run(sys.executable, ["kernels", "--arch", "gfx942"], [str(tmp_path)])
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr
    assert "needs triton" in proc.stderr and "pip install triton" in proc.stderr


def _python_without_torch() -> str | None:
    """A Python on this machine (K3OVL_NO_TORCH_PYTHON, python3, python3.11...) that lacks torch and
    can import the overlay's command line from the tree under test."""
    names = [os.environ.get("K3OVL_NO_TORCH_PYTHON", ""), "python3", "python3.10", "python3.11", "python3.12"]
    for name in filter(None, names):
        python = shutil.which(name)
        if python is None:
            continue
        probe = subprocess.run([python, "-c", "import importlib.util, sys, k3_amd_overlay.commands.cli; "
                                "sys.exit(importlib.util.find_spec('torch') is not None)"],
                               capture_output=True, env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
        if probe.returncode == 0:
            return python
    return None


@pytest.mark.parametrize("argv,code,said", [*WITHOUT_TORCH[:4], (["bench", "--help"], 0, ""),
                                             (["bench", "--json"], 1, "needs torch")],
                         ids=["doctor", "kernels-arch", "kernels", "tune", "bench-help", "bench-json"])
def test_a_real_python_without_torch(argv, code, said):
    python = _python_without_torch()
    if python is None:
        pytest.skip("no Python without torch that can import the overlay (wrapt, packaging) on PATH; "
                    "set K3OVL_NO_TORCH_PYTHON to one")
    _assert_said(_run(python, argv, []), code, said)


@pytest.mark.parametrize("argv,command", [
    (["census", "--layers", "0", "trace.json"], "census"),
    (["check", "--expect", "fused", "--fusions", "fast"], "check"),
    (["check", "--expect", "fused", "--static", "--prune"], "check"),
])
def test_a_subcommands_usage_error_shows_its_own_usage(argv, command, capsys):
    from k3_amd_overlay.commands.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: k3-amd-overlay {command} "), err
    assert "error: " in err.splitlines()[-1]
