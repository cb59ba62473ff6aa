"""One command-line style for every command and sub-subcommand: a one-paragraph plain-text
description ending in a full stop, help for every option with its default said once, the exit
codes referenced, parents listing their sub-subcommands; ``--json`` is a flag everywhere meaning
one JSON object on stdout, usage errors included (exit 2, the command's own usage on stderr);
'no GPU' is a health failure (1), not a usage error. (Doctor's JSON keys: ``test_vllm_plugin.py``.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3_amd_overlay.commands import ab_serve
from k3_amd_overlay.commands.cli import main

COMMANDS = [[], ["check"], ["census"], ["doctor"], ["ab-serve"], ["ab-serve", "report"], ["gsm8k-ab"], ["bench"],
            ["bench", "plot"], ["kernels"], ["tune"], ["measure"]]
JSON_COMMANDS = [c for c in COMMANDS if c]
INVOCATION = re.compile(r"^  (?=\S)(.*?)(?:\s{2,}(\S.*))?$")


def test_every_command_is_checked_here():
    from k3_amd_overlay.commands import cli

    listed = {c[0] for c in JSON_COMMANDS}
    sub = next(a for a in cli.build_parser()._actions if a.choices and "check" in a.choices)
    assert listed == set(sub.choices) and {tuple(c) for c in COMMANDS} >= set(cli.SUBTOOLS), listed


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def sections(text: str) -> tuple[str, list[str]]:
    """The description (between the usage block and the first argument section) and each option's
    block of lines (its invocation line and the help lines under it)."""
    blocks = text.split("\n\n")
    heading = re.compile(r"^(options|positional arguments):")
    first = next(i for i, block in enumerate(blocks) if heading.match(block))
    description = " ".join(blocks[1:first])
    options: list[list[str]] = []
    for block in blocks:
        if not heading.match(block):
            continue
        for line in block.splitlines()[1:]:
            if INVOCATION.match(line):
                options.append([line])
            elif options:
                options[-1].append(line)
    return " ".join(description.split()), ["\n".join(o) for o in options]


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "top" for c in COMMANDS])
def test_every_help_is_plain_complete_and_says_defaults_once(command, capsys):
    code, out, _ = run([*command, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: k3-amd-overlay{' ' if command else ''}{' '.join(command)}"), out[:200]
    description, options = sections(out)
    assert description.endswith(".") and len(description) > 40, description
    assert "``" not in out and ":: " not in out, out
    assert "docs/cli.md" in out  # the exit-code table, in one place
    for option in options:
        first = option.splitlines()[0]
        has_help = INVOCATION.match(first).group(2) or len(option.splitlines()) > 1
        assert has_help, f"no help: {first.strip()}"
        assert option.count("(default") <= 1, option
        assert not re.search(r"\(default: (None|False|)\)", " ".join(option.split())), option


def test_parents_list_their_subcommands(capsys):
    assert "ab-serve report" in run(["ab-serve", "--help"], capsys)[1]
    assert "bench plot" in run(["bench", "--help"], capsys)[1]
    gsm8k = " ".join(run(["gsm8k-ab", "--help"], capsys)[1].split())
    assert "(default: 5)" in gsm8k and "(default: 32)" in gsm8k  # 5-shot, 32 concurrent: visible


@pytest.mark.parametrize("command", JSON_COMMANDS, ids=[" ".join(c) for c in JSON_COMMANDS])
def test_json_usage_errors_are_one_object_and_the_commands_own_usage(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run([*command, "--json", "--no-such-option"], capsys)
    data = json.loads(out)  # one object, nothing else on stdout
    assert code == 2 and data["ok"] is False and data["usage_error"], (code, out)
    assert err.startswith(f"usage: k3-amd-overlay {' '.join(command)} "), err
    code, out, err = run([*command, "--no-such-option"], capsys)  # without --json: text on stderr only
    assert code == 2 and out == "" and err.startswith(f"usage: k3-amd-overlay {' '.join(command)} "), err


def test_no_gpu_is_a_health_failure_not_a_usage_error(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    for command in (["bench"], ["tune"]):
        code, out, err = run([*command, "--json"], capsys)
        data = json.loads(out)
        assert code == 1 and data["ok"] is False and "no GPU" in data["error"] and "no GPU" in err, (command, out)


def test_bench_json_is_a_flag_and_the_old_file_form_still_writes_the_file(capsys, tmp_path):
    from k3_amd_overlay.commands.bench import kernels

    args = kernels.parser().parse_args(["--json-out", str(tmp_path / "b.json"), "--json"])
    assert args.json is True and args.json_out == tmp_path / "b.json"
    assert kernels.legacy_argv(["--json", str(tmp_path / "b.json"), "--quick"]) == [
        "--json-out", str(tmp_path / "b.json"), "--quick"]
    note = "k3-amd-overlay bench: --json FILE is --json-out FILE now (--json: one JSON object on stdout)\n"
    assert capsys.readouterr().err == note  # said once, where it converted
    assert kernels.legacy_argv(["--json", "--quick"]) == ["--json", "--quick"]
    assert capsys.readouterr().err == ""


def _git(cwd: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *argv], capture_output=True, text=True, check=True).stdout.strip()


def test_overlay_git_sha_only_from_the_overlays_own_checkout(tmp_path):
    import secrets

    def repo(name: str, project: str) -> Path:
        root = tmp_path / name
        (root / "k3_amd_overlay").mkdir(parents=True)
        (root / "pyproject.toml").write_text(f'[project]\nname = "{project}"\n')
        (root / "k3_amd_overlay" / "x.py").write_text(secrets.token_hex(8))
        _git(root, "init", "-q")
        _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
        _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
        return root

    own = repo("own", "k3-amd-overlay")
    assert ab_serve.overlay_git_sha(own / "k3_amd_overlay") == _git(own, "rev-parse", "HEAD")
    venv = repo("venv", "some-app")  # a venv inside another project's checkout
    assert ab_serve.overlay_git_sha(venv / "k3_amd_overlay") is None
    nested = venv / "lib" / "site-packages" / "k3_amd_overlay"
    nested.mkdir(parents=True)
    assert ab_serve.overlay_git_sha(nested) is None


def test_the_run_records_the_sha_of_the_package_directory_itself():
    """What a run records is looked up from the package's own directory (``k3_amd_overlay/``), whose
    parent is the checkout's top level; from ``commands/`` the sha was never found."""
    import inspect

    import k3_amd_overlay

    default = inspect.signature(ab_serve.overlay_git_sha).parameters["package_dir"].default
    assert default == Path(k3_amd_overlay.__file__).resolve().parent


def test_check_names_a_file_as_a_file_and_a_missing_key_in_words(capsys, tmp_path):
    not_a_dir = tmp_path / "markers"
    not_a_dir.write_text("x")
    code, _, err = run(["check", "--expect", "fused", "--marker-dir", str(not_a_dir)], capsys)
    assert code == 2 and f"--marker-dir {not_a_dir}: a file, not a directory of markers" in err, err
    merged = tmp_path / "node.json"
    merged.write_text(json.dumps({"host": "n1", "holds": True}))
    code, _, err = run(["check", "--expect", "fused", "--merge", str(merged)], capsys)
    assert code == 2 and "its records are None, not a list" in err and ": 'records'" not in err, err


STANDINS = Path(__file__).parent / "standins"


def _tool(command: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The tool run through the command line against the loopback stand-ins of tests/standins."""
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    return subprocess.run([sys.executable, "-m", "k3_amd_overlay", command, "--model", "k3", "--out", str(tmp_path),
                           "--port", str(port), "--health-timeout", "60", "--serve-cmd",
                           f"{sys.executable} {STANDINS / 'fake_serve.py'}", "--json", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_the_ab_tools_json_is_their_summary_alone_on_stdout(tmp_path):
    proc = _tool("ab-serve", tmp_path / "serve", "--bench-cmd", f"{sys.executable} "
                 f"{STANDINS / 'fake_bench.py'}", "--concurrency", "1", "--repeats", "1")
    data = json.loads(proc.stdout)  # progress and the table went to stderr
    assert proc.returncode == 0 and data["ok"] is True and data["aborted"] is None, proc.stderr[-2000:]
    assert data["run_id"] and {r["metric"] for r in data["rows"]["B_vs_A"]} >= {"TPOT p50 (ms)"}
    assert "arm B proved fused" in proc.stderr
    proc = _tool("gsm8k-ab", tmp_path / "gsm8k", "--lm-eval-cmd",
                 f"{sys.executable} {STANDINS / 'fake_lm_eval.py'}")
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and data["ok"] is True, proc.stderr[-2000:]
    assert data["arms"]["A"]["accuracy"] == 0.9 and data["arms"]["B"]["questions"] == 40
    assert (data["paired"]["only_a"], data["paired"]["only_b"]) == (1, 0) and "| A | 0 | 0.9000 | 40 |" in proc.stderr


@pytest.mark.parametrize("argv,said", [
    (["check", "--expcet", "fused"], "the following arguments are required: --expect; and unrecognized: --expcet"),
    (["check", "--expcet=fused", "--jsn"], "required: --expect; and unrecognized: --expcet --jsn"),
    (["census", "x.json", "--expet", "k=1", "--layers"], "expected one argument"),  # not a missing required one
])
def test_a_misspelt_option_is_named_beside_the_required_one_it_hides(argv, said, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and said in err, err


@pytest.mark.parametrize("argv", [
    ["ab-serve", "--serve-args", "--tensor-parallel-size 8", "--out", "x"],  # an option's value, spaces and all
    ["ab-serve", "--serve-args=--enforce-eager", "--out", "x"],
    ["gsm8k-ab", "--lm-eval-cmd", "lm_eval --nonsense", "--out", "x"],
])
def test_an_options_value_is_never_named_as_an_unrecognized_option(argv, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and err.splitlines()[-1].endswith("the following arguments are required: --model"), err


def test_doctor_refuses_a_bad_switch_or_unsplittable_serve_args_before_any_work(capsys, monkeypatch):
    """A usage error (2) naming the option, not a 'not ready' verdict (1) about the environment, nor a
    traceback after the doctor's half minute of work."""
    from k3_amd_overlay.commands import doctor

    monkeypatch.setattr(doctor, "run_doctor", lambda **kwargs: pytest.fail("the doctor ran"))
    code, _, err = run(["doctor", "--switch", "yes"], capsys)
    assert code == 2 and "error: --switch: K3_AMD_OVERLAY='yes' is not valid (unknown: 'yes'); allowed:" in err, err
    code, out, err = run(["doctor", "--serve-args", '"unbalanced', "--json"], capsys)
    assert code == 2 and "error: --serve-args '\"unbalanced': No closing quotation" in err, err
    assert json.loads(out)["usage_error"].startswith("--serve-args")


def test_with_json_vllms_log_lines_go_to_stderr(capsys, monkeypatch):
    """vLLM logs to stdout by default; imported by doctor or the static probe its lines came before the
    one JSON object (seen with vLLM 0.29's doctor --json)."""
    import os

    from k3_amd_overlay.commands import cli

    seen = []
    monkeypatch.setattr(cli, "_fusions", lambda value: seen.append(os.environ.get("VLLM_LOGGING_STREAM")))
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")
    run(["check", "--expect", "off", "--marker-dir", "/nonexistent", "--json"], capsys)
    run(["check", "--expect", "off", "--marker-dir", "/nonexistent"], capsys)
    assert seen == ["ext://sys.stderr", "ext://sys.stdout"]  # with --json only, and for that command only
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stdout"


@pytest.mark.parametrize("argv,twice", [
    (["check", "--expect", "fused", "--expect", "stock"], "--expect given twice ('fused', then 'stock')"),
    (["check", "--expect=fused", "--exp", "stock", "--json"], "--expect given twice ('fused', then 'stock')"),
    (["check", "--expect", "off", "--marker-dir", "a", "--marker-dir", "b"],
     "--marker-dir given twice ('a', then 'b')"),
    (["census", "x.json", "--layers", "3", "--layers", "4"], "--layers given twice (3, then 4)"),
    (["doctor", "--switch", "1", "--switch", "stock"], "--switch given twice ('1', then 'stock')"),
    (["ab-serve", "--model", "m", "--out", "a", "--out", "b"], "--out given twice ('a', then 'b')"),
    (["gsm8k-ab", "--model", "m", "--model", "n", "--out", "a"], "--model given twice ('m', then 'n')"),
    (["bench", "--only", "qk_cache", "--only", "layer_step"], "--only given twice ('qk_cache', then 'layer_step')"),
    (["bench", "plot", "b.json", "--mode", "graph", "--mode", "eager"], "--mode given twice ('graph', then 'eager')"),
    (["kernels", "--arch", "gfx942", "--arch", "gfx950"], "--arch given twice ('gfx942', then 'gfx950')"),
    (["tune", "--heads", "3", "--heads", "4"], "--heads given twice ([3], then [4])"),
    (["measure", "--heads", "12", "--heads", "16"], "--heads given twice ([12], then [16])"),
])
def test_an_option_given_twice_is_a_usage_error_not_the_last_one_silently(argv, twice, capsys):
    """argparse alone keeps the last value: ``check --expect fused ... --expect stock`` judged stock."""
    code, out, err = run(argv, capsys)
    said = err.strip().splitlines()[-1]
    assert code == 2 and said.endswith(f"error: {twice}; give it once"), err
    assert out == "" if "--json" not in argv else json.loads(out)["usage_error"] == f"{twice}; give it once", out
