"""``k3-amd-overlay``: ``doctor`` (what this machine and vLLM give, what the overlay would do and
why, each reachable provider against its reference), ``check`` (whether the live vLLM processes,
or a fresh one with ``--static``, or several nodes' with ``--merge``, are fused, stock or off as an
A/B arm expects), ``census`` (kernel launches in profiler traces, before and after a fusion), and the
tools ``ab-serve``, ``gsm8k-ab``, ``bench``, ``kernels`` (the AMD compile report), ``tune`` (launch
configs for this GPU) and ``measure`` (each fusion against stock per batch bucket on this GPU)."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3_amd_overlay import json_values, k3, markers
from k3_amd_overlay.commands.usage import (
    EXIT_FAILED,
    Parser,
    UsageError,
    check_command_lines,
    check_switches,
    checked_args,
    json_usage_error,
    missing_image_module,
    wants_json,
)
from k3_amd_overlay.commands.verdict import (
    MERGE_MAX_AGE_S,
    NodeEvidence,
    Verdict,
    distinct_processes,
    judge,
    judge_doctor,
    judge_merge,
    report_lines,
)
from k3_amd_overlay.package import FUSIONS, __version__
from k3_amd_overlay.record import MarkerRecord, RecordError
from k3_amd_overlay.settings import MARKER_DIR

# Where vLLM sends its log lines (vllm/envs.py, 0.29-0.33; stdout unless set).
VLLM_LOGGING_STREAM = "VLLM_LOGGING_STREAM"

STATIC_PROBE = """
import json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm.models.kimi_k3.amd.linear  # noqa: F401  (fires the overlay's post-import hooks)
from k3_amd_overlay import off_record
from k3_amd_overlay.activation import active
activation = active()
record = activation.evidence.record if activation else off_record.current()
print("K3_AMD_OVERLAY_RECORD=" + json.dumps(record.to_json() if record else None))
"""


def _fusions(value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [v.strip() for v in value.split(",")]
    if not any(names):
        raise UsageError(f"--fusions {value!r} names no fusion; allowed: {', '.join(FUSIONS)} (comma separated)")
    if "" in names:
        raise UsageError(f"--fusions {value!r}: an empty name (a stray comma?); allowed: {', '.join(FUSIONS)} "
                         "(comma separated)")
    bad = [n for n in names if n not in FUSIONS]
    if bad:
        raise UsageError(f"--fusions: unknown {', '.join(bad)}; allowed: {', '.join(FUSIONS)}")
    return names


def _why_no_plugin_ran() -> str:
    """Why the static probe's vLLM ran no overlay plugin: VLLM_PLUGINS leaving it out, else not installed."""
    from k3_amd_overlay.commands.doctor import plugin_exclusion

    return plugin_exclusion(os.environ) or (
        "vLLM's plugin loading never ran k3-amd-overlay's plugin in this Python (is k3-amd-overlay installed in "
        "it, under the vllm.general_plugins entry point?)")


def static_record(timeout: float = 600.0) -> tuple[MarkerRecord | None, str]:
    """Load vLLM's general plugins and import the K3 AMD code in a fresh subprocess with the
    current environment (markers to a throwaway directory); return its evidence record (the
    overlay's, or the plugin's off record), else None and a one-line reason (never a traceback)."""
    with tempfile.TemporaryDirectory(prefix="k3ovl-static-") as tmp:
        os.chmod(tmp, 0o700)
        env = {**os.environ, MARKER_DIR: tmp}
        try:
            proc = subprocess.run([sys.executable, "-c", STATIC_PROBE], env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"the probe took over {timeout:.0f} s (vLLM plugin loading + the K3 AMD import)"
    for line in proc.stdout.splitlines():
        if line.startswith("K3_AMD_OVERLAY_RECORD="):
            try:
                data = json.loads(line.split("=", 1)[1])
                if data is None:
                    return None, _why_no_plugin_ran()
                return MarkerRecord.from_json(data), ""
            except (ValueError, RecordError) as exc:
                return None, f"unreadable record from the static probe: {exc}"
    said = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return None, (f"vLLM plugin loading or the K3 AMD import failed: {said[-1] if said else f'exit {proc.returncode}'}"
                  " (`k3-amd-overlay doctor` says more)")


def merged_records(paths: list[str]) -> tuple[list[NodeEvidence], list[str]]:
    """Each node's ``check --json`` output (``-``: standard input), to judge a deployment across
    nodes (multi-node tensor, pipeline or data parallelism) as one: what each node proved, and a
    note per file. A record without a host is that node's (an older overlay wrote it)."""
    nodes, notes = [], []
    for path in paths:
        try:
            if path == "-":
                data = json.load(sys.stdin)
            else:
                with open(path) as handle:
                    data = json.load(handle)
            if not isinstance(data, dict) or not isinstance(data.get("records"), list):
                raise ValueError(f"its JSON is {json_values.kind(data)}, not an object holding a list of records"
                                 if not isinstance(data, dict) else f"its records are {data.get('records')!r}, "
                                 "not a list")
            host = data.get("host")
            if host is not None and not isinstance(host, str):
                raise ValueError(f"its host is {host!r}, not a host name")
            records = []
            for index, raw in enumerate(data["records"]):
                try:
                    record = MarkerRecord.from_json(raw)
                except RecordError as exc:
                    raise RecordError(f"records[{index}]: {exc}") from None
                record.host = raw.get("host") or host or ""
                records.append(record)
            checked_at = data.get("checked_at")
            if checked_at is not None and json_values.finite(checked_at) is None:
                raise ValueError(f"its checked_at is {checked_at!r}, not a time")
            node = NodeEvidence(path, host, data.get("expect"), data.get("holds"),
                                data.get("marker_dir") is not None and data.get("source", "markers") == "markers",
                                records, node_lines(data), checked_at)
        except RecursionError:  # json.load of arrays nested thousands deep
            raise UsageError(f"--merge: {path} is not the output of `k3-amd-overlay check --json`: its JSON is "
                             "nested too deeply to read") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecordError) as exc:
            detail = f"it has no {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
            raise UsageError(f"--merge: {path} is not the output of `k3-amd-overlay check --json`: {detail}") from None
        nodes.append(node)
        count = len(distinct_processes(records))
        notes.append(f"note {path}: {count} process{'es' if count != 1 else ''} from host {host or 'unknown'}")
    return nodes, notes


def node_lines(data: dict[str, object]) -> list[str]:
    """A node file's ``lines`` (its check's lines; none where it has no such key); ValueError naming
    the value where they are no list of strings (a string would be read a character a line; `check`
    writes no other item, so a file holding one is not its output)."""
    lines = data.get("lines", [])
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise ValueError(f"its lines are {lines!r}, not a list of strings")
    return lines


def read_marker_dir(directory: Path) -> list[markers.MarkerFile]:
    """The markers in ``directory`` (none where it is no directory); a UsageError naming it where it
    cannot be listed (markers.MarkerDirError): no listing is no evidence of no process."""
    try:
        return markers.read_markers(directory) if directory.is_dir() else []
    except markers.MarkerDirError as exc:
        raise UsageError(f"--marker-dir: {exc}") from None


def live_records(directory: Path, prune: bool,
                 found: list[markers.MarkerFile] | None = None) -> tuple[list[MarkerRecord], list[str]]:
    """The records of live processes in ``directory`` (``found``: its markers, read here if None), and a
    note per file set aside (or removed)."""
    found = read_marker_dir(directory) if found is None else found
    host = socket.gethostname()
    foreign = [m for m in found if m.record and m.foreign]
    elsewhere = [m for m in found if m.record and not m.foreign and m.record.host != host]
    records = [m.record for m in found if m.live and m.record and not m.foreign and m.record.host == host]
    stale = [m for m in found if m.record and not m.live and not m.foreign and m.record.host == host]
    notes = [f"markers read from {directory}: {len(records)} live, {len(stale)} stale, "
             f"{sum(1 for m in found if m.error)} unreadable" + (f", {len(foreign)} foreign" if foreign else "")
             + (f", {len(elsewhere)} of other hosts" if elsewhere else "")
             + ("" if directory.is_dir() else " (it is a file, not a directory)" if directory.exists()
                else " (no such directory)")]
    for m in found:
        if m.error:
            notes.append(f"note {m.path}: {m.error}")
        elif m.foreign:
            notes.append(f"note {m.path}: {m.foreign}; it proves nothing (left in place)")
        elif m in elsewhere:
            assert m.record is not None
            notes.append(f"note {m.path}: host {m.record.host} pid {m.record.pid} was written on another host, whose "
                         f"processes cannot be checked from {host}; ignored (a marker directory shared between nodes? "
                         "give each node its own and judge them with --merge)")
        elif not m.live:
            assert m.record is not None
            why = "is gone" if prune else "is gone (or its pid was reused)"
            if markers.of_another_boot(m.record):
                why = "was written before this host last booted"
            elif m.record.start_ticks is None and markers.is_running(m.record.pid):
                why = "runs, but the record has no start time to tell it from an earlier process with that pid"
            if prune:
                m.path.unlink(missing_ok=True)
                notes.append(f"note {m.path}: host {host} pid {m.record.pid} {why}; stale marker removed (--prune)")
            else:
                notes.append(f"note {m.path}: host {host} pid {m.record.pid} {why}; stale, "
                             "ignored (--prune removes such files)")
    return records, notes


def cmd_check(args: argparse.Namespace) -> int:
    """0: holds; 1: does not hold; 2: a usage error. With ``--json`` one JSON object on every path."""
    from k3_amd_overlay.settings import SWITCH, Mode, SettingsError, load_settings, parse_path

    source = "merge" if args.merge else "static" if args.static else "markers"
    marker_dir: str | None = None
    records: list[MarkerRecord] = []
    notes: list[str] = []
    wanted = _fusions(args.fusions)  # a UsageError: main() says it (as JSON too with --json)
    if args.marker_dir and Path(args.marker_dir).exists() and not Path(args.marker_dir).is_dir():
        raise UsageError(f"--marker-dir {args.marker_dir}: a file, not a directory of markers")
    if sum(map(bool, (args.merge, args.static))) > 1 or (args.prune and (args.merge or args.static)):
        raise UsageError("--merge, --static and --prune each judge other processes: give at most one")
    if args.marker_dir and (args.merge or args.static):
        raise UsageError(f"--marker-dir {args.marker_dir} names the markers a live check reads; "
                         f"{'--merge' if args.merge else '--static'} reads none: give one of the two")
    if args.max_age is not None and not args.merge:
        raise UsageError("--max-age applies to --merge only (a live check reads markers as they are now)")
    check_fused_options(args)
    max_age = MERGE_MAX_AGE_S if args.max_age is None else args.max_age
    if not (0 < max_age < math.inf):  # not "<= 0": NaN compares false both ways
        raise UsageError(f"--max-age {max_age:g}: seconds, more than 0 and finite")
    if args.merge:
        nodes, notes = merged_records(args.merge)
        records = distinct_processes(r for node in nodes for r in node.records)
        verdict = judge_merge(nodes, args.expect, wanted, not args.no_effective, allow_mixed=args.allow_mixed,
                              max_age_s=max_age, now=time.time())
    elif args.static:
        verdict = Verdict()
        try:
            settings = load_settings()
        except SettingsError as exc:
            verdict.fail(str(exc))
        else:
            if settings.mode is Mode.OFF and args.expect != "off":
                verdict.fail(f"the overlay is off in this environment ({SWITCH} unset or 0): a vLLM process started "
                             f"here patches nothing, so it cannot be {args.expect}; set {SWITCH}="
                             + ("1 (or a list of fusions)" if args.expect == "fused" else "stock"))
            else:
                from k3_amd_overlay.commands.doctor import run_doctor

                report, _ = run_doctor()
                record, reason = static_record()
                if record is None:
                    verdict.fail(f"the static probe did not complete: {reason}")
                else:
                    records = [record]
                    verdict = judge(records, args.expect, wanted, False, static=True, allow_mixed=args.allow_mixed)
                judge_doctor(report, args.expect, wanted, verdict)
    else:
        try:
            setting = None if args.marker_dir else parse_path(MARKER_DIR, os.environ.get(MARKER_DIR))
        except SettingsError as exc:
            raise UsageError(str(exc)) from None
        directory = Path(args.marker_dir or setting or markers.default_marker_dir())
        marker_dir = str(directory)
        found = read_marker_dir(directory)
        records, notes = live_records(directory, args.prune, found)
        verdict = judge(records, args.expect, wanted, not args.no_effective, allow_mixed=args.allow_mixed)
        forgeable = markers.forgeable(directory)
        if forgeable:
            verdict.fail(f"{forgeable}: no vLLM process of this overlay run by this user writes its marker there, "
                         "and another user could have written any of it: nothing read there is evidence")
        for marker, pid in markers.unreadable_of_live_processes(found):
            verdict.fail(f"{marker.path}: pid {pid} runs on this host, but its marker is unreadable ({marker.error}): "
                         "what it ran is unknown (another overlay version's marker? restart it with this one; "
                         "remove the file if that process is no vLLM)")
        for marker, pid in markers.foreign_of_live_processes(found, socket.gethostname()):
            verdict.fail(f"{marker.path}: names pid {pid}, which runs on this host, but it is not that process's "
                         f"marker ({marker.foreign}): what it ran is unknown (remove the file if it is a copy or "
                         "not yours)")
    if args.json:
        print(json.dumps({"command": "check", "ok": verdict.holds, "exit_status": 0 if verdict.holds else EXIT_FAILED,
                          "expect": args.expect, "holds": verdict.holds, "lines": verdict.lines, "notes": notes,
                          "host": socket.gethostname(), "source": source, "marker_dir": marker_dir,
                          "checked_at": time.time(), "overlay_version": __version__,
                          "records": [r.to_json() for r in records],
                          **({} if verdict.holds else {"error": _check_error(args.expect, verdict.lines)})},
                         indent=1))
    else:
        for line in report_lines(notes, verdict.lines, verdict.holds, args.expect, len(records)):
            print(line)
    return 0 if verdict.holds else 1


# The options that judge a fused arm only, and why each means nothing for another expectation.
FUSED_ONLY = (("allow_mixed", "--allow-mixed", "it accepts a partly fused process"),
              ("no_effective", "--no-effective", "it drops the need for served traffic on a fused path"))


def check_fused_options(args: argparse.Namespace) -> None:
    """A UsageError for an option given with an expectation that ignores it: --allow-mixed and
    --no-effective judge a fused arm only; --fusions names fusions to judge, which an off process has not."""
    for dest, option, what in FUSED_ONLY:
        if getattr(args, dest) and args.expect != "fused":
            raise UsageError(f"{option} applies to --expect fused only ({what}), not --expect {args.expect}")
    if args.fusions is not None and args.expect == "off":
        raise UsageError("--fusions applies to --expect fused or stock only (an off process runs no fusion to judge), "
                         "not --expect off")


def _check_error(expect: str, lines: list[str]) -> str:
    """A failed check's one line for --json: its first FAIL line and how many there are."""
    fails = [line.removeprefix("FAIL ") for line in lines if line.startswith("FAIL ")]
    more = f" (and {len(fails) - 1} more FAIL line{'s' if len(fails) > 2 else ''})" if len(fails) > 1 else ""
    return f"does not hold: expect {expect}: " + (fails[0] + more if fails else "no FAIL line (see lines)")


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.switch is not None:
        check_switches([("--switch", args.switch)])
    if args.serve_args is not None:
        check_command_lines([("--serve-args", args.serve_args)])
    # after the arguments are checked: the doctor needs torch, and a usage error does not
    from k3_amd_overlay.commands.doctor import json_report, render, run_doctor

    report, healthy = run_doctor(switch=args.switch, serve_args=args.serve_args)
    if args.json:
        print(json.dumps({"command": "doctor", "ok": healthy, "exit_status": 0 if healthy else EXIT_FAILED,
                          **json_report(report), "healthy": healthy,
                          **({} if healthy else {"error": report.get("verdict") or "not ready (see the report)"})},
                         indent=1, default=str))
    else:
        print(render(report))
    return 0 if healthy else 1


def cmd_census(args: argparse.Namespace) -> int:
    from k3_amd_overlay.commands import census

    for option, value in (("--layers", args.layers), ("--steps", args.steps)):
        if value is not None and not 1 <= value <= census.MOST_STEPS:
            raise UsageError(f"{option} {value}: from 1 to {census.MOST_STEPS} (--layers: the model's MLA layers; "
                             "--steps: decode steps in the profiled window)")
    census.check_steps(args.steps, args.baseline, args.layers)
    try:
        expectations = census.parse_expectations(args.expect or [])
        candidate = census.read_census(args.traces)
        baseline = census.read_census(args.baseline) if args.baseline else None
    except (census.TraceError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if not expectations and baseline is None:  # a table, no verdict: say what it sums all the same
        for problem in census.rank_problems(candidate):
            print(f"warning: {problem}", file=sys.stderr)
    judged = census.judge_expectations(candidate, expectations)
    layers = k3.MLA_LAYERS if args.layers is None else args.layers
    comparison = census.compare(baseline, candidate, args.steps, layers) if baseline is not None else None
    holds = all(j.holds for j in judged) and (comparison is None or comparison.holds)
    if args.json:
        out = {"command": "census", "ok": holds, "exit_status": 0 if holds else EXIT_FAILED, **candidate.to_json()}
        if baseline is not None:
            out["baseline"] = baseline.to_json()
            out["comparison"] = comparison.to_json()
        out["expect"] = {"problems": [p for j in judged for p in j.problems], "holds": all(j.holds for j in judged),
                         "items": [j.to_json() for j in judged]}
        if not holds:
            problems = out["expect"]["problems"] + (comparison.problems if comparison is not None else [])
            out["error"] = ("does not hold: " + "; ".join(problems) if problems
                            else "does not hold: no comparable section (see comparison)")
        print(json.dumps(out, indent=1))
    else:
        print(census.render(candidate))
        if comparison is not None:
            print(comparison.render())
        for expectation in judged:
            print(expectation.line())
            for problem in expectation.problems:
                print(f"FAIL {problem}")
    return 0 if holds else EXIT_FAILED


DESCRIPTION = (
    "Prove, inspect and measure k3-amd-overlay, the Kimi-K3 AMD fusions for vLLM: doctor says what this machine "
    "and vLLM give and what the overlay would do here and why; check proves whether vLLM processes are fused, "
    "stock or off (an A/B arm); census counts kernel launches in profiler traces; ab-serve and gsm8k-ab run "
    "serving and accuracy A/B tests against proved arms; bench, kernels and tune benchmark, compile and tune "
    "the overlay's kernels; measure times each fusion against stock on this GPU, for the server to fuse only "
    "where it measured at least as fast.")
CHECK = ("Prove an A/B arm: judge whether the live vLLM processes of this node (their markers), a fresh process "
         "(--static) or several nodes' check --json outputs (--merge) are fused, stock or off, as --expect says. "
         "Exit 0 when it holds, 1 when it does not.")
CENSUS = ("Count the GPU kernel launches in profiler traces (one per rank); with --baseline, the before/after "
          "table of each fusion (the launches its kernel replaced, per step and per layer); with --expect "
          "NAME=COUNT, fail unless a kernel ran exactly so often on every rank.")
DOCTOR = ("Say what this machine and vLLM give (versions, GPU, vLLM's K3 AMD code), what the overlay would do "
          "with the current switch (or --switch) and why, and run each reachable provider against its reference "
          "at K3 shapes. Exit 0 when ready or off, 1 when not.")

# The operator's tools, each its own module with a ``parser()`` (a usage.Parser) and ``main(argv)``,
# run with its own options (``k3-amd-overlay NAME --help``). A new tool is one line here (and the
# modules it needs from the image in TOOL_NEEDS); its module imports torch and triton only inside
# the functions that run, so that its --help and usage errors work without them.
TOOLS = {
    "ab-serve": ("k3_amd_overlay.commands.ab_serve",
                 "serving A/B: each arm a proved server, ABBA repeats, vllm bench serve; "
                 "`ab-serve report OUT` re-summarises"),
    "gsm8k-ab": ("k3_amd_overlay.commands.gsm8k_ab", "accuracy A/B: lm-eval GSM8K against each proved arm, paired"),
    "bench": ("k3_amd_overlay.commands.bench.kernels",
              "kernel benchmarks at K3 shapes against the unfused path (GPU); `bench plot BENCH.json` draws them"),
    "kernels": ("k3_amd_overlay.commands.compile_report",
                "compile every kernel for gfx942/gfx950 (no GPU needed): registers, LDS, spills, waves per SIMD"),
    "tune": ("k3_amd_overlay.commands.tune",
             "time each kernel's candidate launch configs on this GPU; write its config file"),
    "measure": ("k3_amd_overlay.commands.self_measure",
                "time each fused path against stock per batch bucket on this GPU; the server then fuses only "
                "where it measured exact and at least as fast"),
}
# Sub-subcommands with modules of their own (``bench plot`` needs matplotlib, not torch).
SUBTOOLS = {("bench", "plot"): "k3_amd_overlay.commands.bench.plot"}
# What each tool needs from the image, looked for after its arguments are parsed and before it runs
# (``kernels`` compiles in a child process, whose missing import would otherwise reach the user as
# the child's traceback), unless the tool's ``needs_image(args)`` says this run needs none.
TOOL_NEEDS: dict[str, tuple[str, ...]] = {"bench": ("torch", "triton"), "kernels": ("torch", "triton"),
                                          "tune": ("torch", "triton"), "measure": ("torch", "triton")}


def _check_unjudged(common: dict[str, object], line: str, expect: str | None = None) -> dict[str, object]:
    """check's --json object where it judged nothing: its own keys, as on every other path (``holds``
    false; ``expect`` where the arguments were read), and the ``common`` ones."""
    return {**common, "expect": expect, "holds": False, "lines": [f"FAIL {line}"], "notes": [],
            "host": socket.gethostname(), "source": None, "marker_dir": None, "checked_at": time.time(),
            "overlay_version": __version__, "records": []}


def _check_json_error(message: str) -> dict[str, object]:
    """check's --json usage error."""
    return _check_unjudged(json_usage_error("check", message), f"usage: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="k3-amd-overlay", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"k3-amd-overlay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = sub.add_parser("check", help="prove an A/B arm: are the live vLLM processes fused or stock?",
                           description=CHECK, own_extras=True, json_error=_check_json_error)
    check.add_argument("--expect", choices=("fused", "stock", "off"), required=True,
                       help="fused: the overlay's (or vLLM's own) fused paths took served traffic; stock: "
                            "K3_AMD_OVERLAY=stock, nothing fused, vLLM's own fusions off too; off: the overlay off")
    check.add_argument("--fusions", help=f"comma list of {','.join(FUSIONS)} (default: those each process "
                                         "requested, i.e. not 'disabled')")
    check.add_argument("--static", action="store_true",
                       help="judge a fresh process (vLLM plugin loading + K3 AMD import) instead of live markers")
    check.add_argument("--no-effective", action="store_true",
                       help="for --expect fused: do not require that a fused path has run yet")
    check.add_argument("--allow-mixed", action="store_true",
                       help="for --expect fused: accept a process where only some layers took a fusion")
    check.add_argument("--marker-dir", type=Path,
                       help=f"where the markers are (default: ${MARKER_DIR} or the per-user directory)")
    check.add_argument("--merge", nargs="+", metavar="FILE",
                       help="judge the processes of several nodes as one deployment: each FILE is one node's "
                            "`check --json` output (- for standard input); this node's markers are not read")
    check.add_argument("--max-age", type=float, metavar="SECONDS",
                       help=f"with --merge: each node's file must have been written by `check` at most this long "
                            f"ago (default {MERGE_MAX_AGE_S}; larger to judge an archived run)")
    check.add_argument("--prune", action="store_true",
                       help="remove the markers of processes that are gone (stale files pile up otherwise)")
    check.add_argument("--json", action="store_true", help="one JSON object on stdout on every path")
    check.set_defaults(func=cmd_check)
    census = sub.add_parser("census", help="kernel census of profiler traces, before/after a fusion",
                            description=CENSUS, own_extras=True)
    census.add_argument("traces", nargs="+", help="trace files (.json, .json.gz) or folders; one per rank")
    census.add_argument("--baseline", nargs="+", metavar="TRACE",
                        help="the unfused arm's traces: the before/after table of each fusion whose own launch ran "
                             "in the candidate; exit 1 where no such comparison can be made, saying why")
    census.add_argument("--expect", action="append", metavar="NAME=COUNT",
                        help="fail unless kernels matching NAME ran exactly COUNT times on every rank (a kernel the "
                             "census's table names more exactly is not NAME's: absorb_qk_cache_kernel is not a "
                             "qk_cache_kernel); each judged on its own; an empty trace satisfies none")
    census.add_argument("--steps", type=int,
                        help="decode steps in the window: per-step and per-layer figures of the comparison "
                             "(with --baseline only)")
    census.add_argument("--layers", type=int,
                        help=f"MLA layers of the model, with --steps: the per-layer figures (default: K3's, "
                             f"{k3.MLA_LAYERS})")
    census.add_argument("--json", action="store_true", help="one JSON object on stdout on every path")
    census.set_defaults(func=cmd_census)
    doctor = sub.add_parser("doctor", help="versions, GPU, what each fusion would do here and why, self-tests",
                            description=DOCTOR, own_extras=True)
    doctor.add_argument("--switch", help="judge this K3_AMD_OVERLAY value instead of the environment's")
    doctor.add_argument("--json", action="store_true",
                        help="one JSON object on stdout on every path (keys: identifiers; the text keeps its labels)")
    doctor.add_argument("--serve-args", help="the vllm serve arguments an A/B will use: judged with the environment "
                                             "for an arm vLLM itself gets wrong (see 'A/B baseline')")
    doctor.set_defaults(func=cmd_doctor)
    for name, (_, summary) in TOOLS.items():  # listed here; run by main() with their own parsers
        sub.add_parser(name, help=summary, add_help=False)
    return parser


# What some commands need from the image and the overlay never installs (it must not move the
# torch or triton vLLM was built with): without them a command says so and exits 1, never a traceback.
def _missing_message(command: str, missing: str, exc: ModuleNotFoundError) -> str:
    return (f"k3-amd-overlay{' ' + command if command else ''}: needs {missing}, which this Python "
            f"({sys.executable}) cannot import ({exc}). Run k3-amd-overlay with the Python vLLM is installed in "
            f"(install k3-amd-overlay there), or install {missing} into this one (pip install {missing}; on ROCm, "
            "the ROCm build of torch, which brings triton)")


def _run_tool(command: str, argv: list[str]) -> int:
    """A tool: a tool that needs something from the image has its arguments parsed and checked once
    (help and usage errors need nothing from the image: ``usage.checked_args``), then what it needs
    looked for, then its ``checked_main(args)`` runs; any other tool's ``main(argv)`` runs."""
    import importlib
    import importlib.util

    sub = tuple(argv[:1])
    if (command, *sub) in SUBTOOLS:
        return int(importlib.import_module(SUBTOOLS[(command, *sub)]).main(argv[1:]))
    module = importlib.import_module(TOOLS[command][0])
    if not TOOL_NEEDS.get(command):
        return int(module.main(argv))
    args = checked_args(module, argv)  # --help and usage errors exit here, before the image is looked at
    if isinstance(args, int):
        return args
    for needed in TOOL_NEEDS[command] if getattr(module, "needs_image", lambda _args: True)(args) else ():
        if importlib.util.find_spec(needed) is None:
            raise ModuleNotFoundError(f"No module named {needed!r}", name=needed)
    return int(module.checked_main(args))


def _subcommand_parser(parser: argparse.ArgumentParser, command: str) -> Parser:
    """The parser of ``command`` (its usage for its usage errors), else the top-level parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    """0: holds / healthy; 1: does not hold / not healthy, no GPU, or torch or triton missing where a
    command needs them; 2: a usage error (argparse's code). The table: docs/cli.md. With --json one
    JSON object on stdout on every path; never a traceback for a missing torch or triton."""
    argv = sys.argv[1:] if argv is None else argv
    if not wants_json(argv):
        return _main(argv)
    # vLLM, imported by doctor or the static probe, would put its log lines before the one JSON object.
    before = os.environ.get(VLLM_LOGGING_STREAM)
    os.environ[VLLM_LOGGING_STREAM] = "ext://sys.stderr"
    try:
        return _main(argv)
    finally:  # main() is also called in-process (tests, scripts): the setting is this command's only
        if before is None:
            os.environ.pop(VLLM_LOGGING_STREAM, None)
        else:
            os.environ[VLLM_LOGGING_STREAM] = before


def _main(argv: list[str]) -> int:
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    args = None
    try:
        if command in TOOLS:
            return _run_tool(command, argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        try:
            return int(args.func(args))
        except UsageError as exc:
            return _subcommand_parser(parser, args.command).usage_error(exc, args.json)
    except ModuleNotFoundError as exc:
        missing = missing_image_module(exc)
        if missing is None:
            raise
        message = _missing_message(command, missing, exc)
        if wants_json(argv):
            data: dict[str, object] = {"command": command, "ok": False, "exit_status": EXIT_FAILED, "missing": missing,
                                       "error": message}
            if command == "check":
                data = _check_unjudged(data, f"missing {missing}: {message}", getattr(args, "expect", None))
            print(json.dumps(data, indent=1))
        print(message, file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
