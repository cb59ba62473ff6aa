"""The command line's one style and its usage errors: the parser every command and tool builds
(plain one-paragraph description, each option's default said once, the exit codes referenced,
``--json`` usage errors as one JSON object on stdout), the one usage exception (exit 2, as
argparse's own), and the argument checks the A/B tools share, run before any server starts."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import PurePath
from typing import Any, NoReturn

from k3_amd_overlay.settings import KERNEL_CONFIGS, SWITCH, SettingsError, load_settings, parse_path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2  # the table: docs/cli.md
EPILOG = ("Exit status: 0 ok; 1 a verdict, health check or run failed (no GPU, torch or triton missing "
          "included); 2 a usage error. --json: one JSON object on stdout on every path, usage errors "
          "included. The table: docs/cli.md.")


IMAGE_MODULES = ("torch", "triton")  # what a tool may need that vLLM's image has and a slim Python lacks


def missing_image_module(exc: ModuleNotFoundError) -> str | None:
    """torch or triton where ``exc`` is their absence (or a part of them missing), else None."""
    root = (exc.name or "").split(".")[0]
    return root if root in IMAGE_MODULES else None


class UsageError(ValueError):
    """A command line that asks for something impossible; the message names the value and why."""


def describe(doc: str | None) -> str:
    """A module docstring's first paragraph as a help description: plain text (reST literals and
    backquotes unquoted, a leading ``k3-amd-overlay NAME:`` dropped, as the usage line says it), one
    paragraph, ending in a full stop."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    text = re.sub(r"`+([^`]*)`+", r"\1", text)
    text = re.sub(r"^k3-amd-overlay[\w .-]*?: ", "", text)
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text.rstrip(":;,") + "."


def wants_json(argv: Iterable[str]) -> bool:
    """Whether ``argv`` asks for --json (or an abbreviation argparse accepts), read before parsing
    so that a usage error can be JSON too: ``--json=VALUE`` asks for it as well (and is that usage
    error, a flag taking no value)."""
    for arg in argv:
        if arg == "--":
            return False
        name = arg.split("=", 1)[0]
        if name.startswith("--j") and "--json".startswith(name):
            return True
    return False


FLAG_GIVEN_A_VALUE = re.compile(r"argument (--[\w-]+): ignored explicit argument (.*)")  # argparse's words


def said_plainly(message: str) -> str:
    """argparse's usage error in the words of the other usage errors: a flag given ``=VALUE``
    ("ignored explicit argument") is said to take no value; any other message as it is."""
    found = FLAG_GIVEN_A_VALUE.fullmatch(message)
    if found is None:
        return message
    flag, value = found.groups()
    return f"{flag} takes no value (given {value}); give {flag} alone"


def said_default(action: argparse.Action) -> str | None:
    """An option's default as its help should say it, or None where there is none worth saying."""
    default = action.default
    if (not action.option_strings or action.required or default in (None, False, "", [], ())
            or default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction | argparse._VersionAction)):
        return None
    return " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with each option's default appended once, where its help does not say
    a default already and there is one to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = said_default(action)
        if default is None or "default" in text:
            return text
        return f"{text} (default: {default.replace('%', '%%')})"


def json_usage_error(command: str, message: str) -> dict[str, Any]:
    """The JSON object of a usage error (``--json``): the same keys for every command."""
    return {"command": command, "ok": False, "exit_status": EXIT_USAGE, "usage_error": message, "error": message}


def _shown(value: Any) -> str:
    """An option's value as the user typed it, near enough (a path as its text)."""
    return repr(str(value)) if isinstance(value, PurePath) else repr(value)


class _StoreOnce(argparse._StoreAction):
    """argparse's ``store``, refusing an option given twice: with argparse's own the last would win
    without a word (``check --expect fused ... --expect stock`` would judge stock)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = getattr(parser, "given_options", None)
        if given is not None and option_string is not None:
            if self.dest in given:
                parser.error(f"{option_string} given twice ({_shown(given[self.dest])}, then {_shown(values)}); "
                             "give it once")
            given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """The parser of every command and tool: the one help style, the exit-status epilog, and with
    --json a usage error is one JSON object on stdout too (``json_error`` builds it; usage and
    message still go to stderr, exit 2). ``own_extras``: a subcommand's unknown argument is its
    own usage error (argparse would report it with the top-level usage)."""

    def __init__(self, *args: Any, json_error: Callable[[str], dict[str, Any]] | None = None,
                 own_extras: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("epilog", EPILOG)
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.given_options: dict[str, Any] = {}
        command = self.prog.removeprefix("k3-amd-overlay").strip()
        self.json_error = json_error or (lambda message: json_usage_error(command, message))
        self.own_extras = own_extras
        self.json_wanted = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = sys.argv[1:] if args is None else list(args)
        self.json_wanted = wants_json(args)
        self.raw_args = args
        self.given_options = {}
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.own_extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        """argparse's conversion of one value, refusing a path given empty or blank (an unset
        ``"$VAR"``): ``Path("")`` is the current directory, which no option means by an empty value
        (the one home of this check, for every option typed ``Path``)."""
        if isinstance(action.type, type) and issubclass(action.type, PurePath) and not arg_string.strip():
            default = ("" if action.required or not action.option_strings else ", or leave the option out"
                       + (" for its default" if "default" in (action.help or "") else ""))
            raise argparse.ArgumentError(action, f"{arg_string!r} names no path (an empty value: an unset "
                                                 f"variable?); give the path{default}")
        return super()._get_value(action, arg_string)

    def unknown_options(self) -> list[str]:
        """The options given that this parser does not know (nor abbreviate): a misspelt one would
        otherwise hide behind "the following arguments are required"."""
        known = self._option_string_actions
        unknown: list[str] = []
        takes_value = False  # the argument before was an option that takes a value: this one is it
        for arg in getattr(self, "raw_args", []):
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            matches = [option for option in known if option.startswith(name)] if name.startswith("-") else []
            if takes_value or not name.startswith("--") or any(c.isspace() for c in name):
                takes_value = False
                continue
            if not matches:
                unknown.append(name)
            action = known.get(name) or (known[matches[0]] if len(matches) == 1 else None)
            takes_value = "=" not in arg and action is not None and action.nargs != 0
        return unknown

    def error(self, message: str) -> NoReturn:
        message = said_plainly(message)
        unknown = self.unknown_options() if message.startswith("the following arguments are required") else []
        if unknown:
            message += f"; and unrecognized: {' '.join(unknown)}"
        if self.json_wanted:
            print(json.dumps(self.json_error(message), indent=1))
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def usage_error(self, exc: UsageError, json_wanted: bool | None = None) -> int:
        """Report a UsageError raised after parsing as this parser's own usage error; 2."""
        if self.json_wanted if json_wanted is None else json_wanted:
            print(json.dumps(self.json_error(str(exc)), indent=1))
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def checked_args(tool: Any, argv: list[str] | None) -> argparse.Namespace | int:
    """A tool's ``argv`` parsed by its ``parser()`` (after its ``legacy_argv``, where it has one) and
    checked by its ``check_args``, where it has one: the checks that need nothing from the image. An
    int where they refuse: the usage error's exit status, said on stderr (and stdout with --json).
    The one parse of a tool's run, whether the CLI or the tool's own main calls it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = tool.parser()
    args = p.parse_args(getattr(tool, "legacy_argv", list)(argv))
    try:
        getattr(tool, "check_args", lambda _args: None)(args)
    except UsageError as exc:
        return p.usage_error(exc)
    return args


def tool_main(tool: Any, argv: list[str] | None) -> int:
    """A tool's own ``main``: ``checked_args``, then the tool's ``checked_main`` (the CLI calls the
    same two, looking for torch and triton between them)."""
    args = checked_args(tool, argv)
    return args if isinstance(args, int) else tool.checked_main(args)


def json_result(command: str, ok: bool, **fields: Any) -> str:
    """The JSON object a command prints on stdout with --json (``ok`` and ``exit_status`` always)."""
    return json.dumps({"command": command, "ok": ok, "exit_status": EXIT_OK if ok else EXIT_FAILED, **fields},
                      indent=1, default=str)


def kernel_configs_setting() -> str | None:
    """K3_AMD_OVERLAY_KERNEL_CONFIGS as the server reads it (None: unset or empty); a value the server
    would stop on is a UsageError naming it."""
    try:
        return parse_path(KERNEL_CONFIGS, os.environ.get(KERNEL_CONFIGS))
    except SettingsError as exc:
        raise UsageError(str(exc)) from None


def check_switches(named: Iterable[tuple[str, str]]) -> None:
    """Each (option, K3_AMD_OVERLAY value) is a valid switch value."""
    for name, value in named:
        try:
            load_settings({SWITCH: value})
        except SettingsError as exc:
            raise UsageError(f"{name}: {exc}") from None


def split_command(name: str, command: str) -> list[str]:
    """``command`` split as a shell would (``shlex``); a UsageError naming the option where it cannot be."""
    try:
        return shlex.split(command)
    except ValueError as exc:
        raise UsageError(f"{name} {command!r}: {exc} (quote it as a shell would)") from None


def check_command_lines(named: Iterable[tuple[str, str]]) -> None:
    """Each (option, command line or arguments) splits as a shell would split it."""
    for name, command in named:
        split_command(name, command)


def check_not_owned(option: str, given: str, words: Iterable[str], owned: Mapping[str, str]) -> None:
    """A UsageError where ``words`` (split from ``option``'s value ``given``) set something the tool
    sets itself (``owned``: each such option or key and what to give instead): passed on, one of the
    two would be dropped without a word (vLLM's parser keeps the last ``--port``)."""
    for word in words:
        name = word.split("=", 1)[0].strip()
        if name.startswith("--"):  # vLLM's parser reads --num_prompts as --num-prompts
            name = name.replace("_", "-")
        if name in owned:
            raise UsageError(f"{option} {given!r}: {name} is set by the tool itself; {owned[name]}")


def check_executables(named: Iterable[tuple[str, str]]) -> None:
    """Each (option, command line) starts with an executable on PATH."""
    for name, command in named:
        words = split_command(name, command)
        if not words or shutil.which(words[0]) is None:
            raise UsageError(f"{name} {command!r}: {words[0] if words else 'nothing'} is not an executable on PATH")


def add_arm_server_arguments(parser: argparse.ArgumentParser, arm_a_help: str) -> None:
    """The arguments every A/B tool takes for its arms' servers, with their defaults (one home)."""
    from k3_amd_overlay.commands.baseline_hazard import ACCEPT_FLAG

    parser.add_argument("--model", required=True, help="the checkpoint the server loads")
    parser.add_argument("--served-model-name", help="the name the server answers to (default: the --model value)")
    parser.add_argument("--serve-args", default="", help="server arguments, identical for every arm")
    parser.add_argument("--arm-a", default="0", help=arm_a_help)
    parser.add_argument("--arm-b", default="1", help="K3_AMD_OVERLAY of the candidate arm")
    parser.add_argument(ACCEPT_FLAG, action="store_true",
                        help="run even where an arm is no valid baseline on this vLLM (breakable CUDA graphs record "
                             "vLLM's own fused decode into the graph; see baseline_hazard.py): the summary says so")
    parser.add_argument("--port", type=int, default=8010, help="the port each arm's server listens on")
    parser.add_argument("--serve-cmd", default="vllm serve", help="the command that starts a server")
    parser.add_argument("--health-timeout", type=float, default=3600.0,
                        help="seconds for a server to become healthy")


def check_input_file(option: str, given: str | os.PathLike[str]) -> None:
    """A UsageError where ``given`` is no file an option can read, saying what it is instead: missing,
    a directory, or another kind of entry (a FIFO would block the reader)."""
    path = os.fspath(given)
    if os.path.isfile(path):
        return
    what = ("a directory, not a file" if os.path.isdir(path) else
            "not a regular file (a FIFO, a socket or a device)" if os.path.exists(path) else "no such file")
    raise UsageError(f"{option} {path}: {what}")


def check_seconds(option: str, value: float) -> None:
    """A time an option gives: more than 0 and finite (NaN fails both comparisons)."""
    if not 0 < value < float("inf"):
        raise UsageError(f"{option} {value}: must be a positive, finite number of seconds")


def check_given(option: str, value: str | None, default: str | None = None) -> None:
    """A string option given empty or blank (an unset ``"$VAR"``) is a UsageError naming it, before
    any server starts: the server, bench or lm-eval would be given nothing, or quietly the default."""
    if value is not None and not value.strip():
        leave = f", or leave it out for its default ({default})" if default else ""
        raise UsageError(f"{option} {value!r} names nothing (an empty value: an unset variable?); give a value{leave}")


# What an A/B tool puts on each server's command line itself (arms.proved_server), and what to give instead.
SERVE_OWNED = {"--port": "give the tool's --port (the server it polls for health is on that port)",
               "--uds": "the tool polls each server over TCP on its --port"}


def check_arm_server_arguments(args: argparse.Namespace) -> None:
    """The values of add_arm_server_arguments' options a server could not start with (whether
    --serve-cmd is on PATH: check_executables)."""
    check_given("--model", args.model)
    check_given("--served-model-name", args.served_model_name, "the --model value")
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be 1-65535")
    check_seconds("--health-timeout", args.health_timeout)
    check_not_owned("--serve-args", args.serve_args, split_command("--serve-args", args.serve_args), SERVE_OWNED)


def check_baselines(named: Iterable[tuple[str, str]], serve_args: str, accept: bool) -> list[str]:
    """Each (arm, K3_AMD_OVERLAY value) against baseline_hazard, in the environment the servers
    inherit: UsageError naming every hazardous arm unless ``accept`` (--accept-baseline-hazard),
    then the reasons, for the run's warnings and its summary."""
    from k3_amd_overlay.commands.baseline_hazard import ACCEPT_FLAG, baseline_hazard, facts_here

    facts = facts_here()
    reasons = [f"{name}: {why}" for name, value in named
               if (why := baseline_hazard(facts, dict(os.environ), serve_args, value))]
    if reasons and not accept:
        raise UsageError("; ".join(reasons) + f" (to measure it anyway, pass {ACCEPT_FLAG}: the summary says so)")
    return reasons
