"""``k3-amd-overlay ab-serve``: a serving A/B that cannot A/B against itself. For each repeat, in
ABBA order, start the server for one arm (identical arguments, only K3_AMD_OVERLAY differs), wait
for health, send one request, prove the arm with ``k3-amd-overlay check`` (abort if it does not
hold), run ``vllm bench serve`` at each concurrency, prove the arm again (where it no longer holds,
the run aborts and that repeat is not compared), stop the server. Every raw result stays under
--out, which must be new or empty: the run claims it with a run id and reads back only the folders
stamped with that id and marked measured (ab_run.py), so no earlier run, and no arm whose proof
lapsed, is ever mixed in. An arm vLLM itself gets wrong (baseline_hazard.py) is refused before any
server starts. The table (ab_stats.py) gives per concurrency and metric each arm's median, the
geometric mean of the paired ratios over the repeats with its 95% bootstrap interval, an exact
test's p (Holm-adjusted across every row but the primary metric, TPOT p50, judged alone at each
concurrency) and the verdict: "faster" or "slower" only where that p is below 0.05, the interval
lies on the ratio's side of 1x and the effect is at least 1%; else "no difference detected at this
n", "no verdict: ..." saying which of those failed, or "no verdict possible" where n pairs cannot
reach p < 0.05 (fewer than 6 for the primary metric, 10 for the other 24 rows at 3 concurrencies).
Each arm's fusions are named as its check proved them (applied: the overlay's; upstream: vLLM's
own; forced-stock), and each comparison is headed by what its arms ran, so vLLM's own fusions are
never credited to the overlay; summary.json adds what ran where, summary.png plots it.

    k3-amd-overlay ab-serve --model /models/Kimi-K3 --concurrency 1 8 32 --repeats 6 \\
        --serve-args "--tensor-parallel-size 8 --kv-cache-dtype fp8 --trust-remote-code" --out ab-out
    k3-amd-overlay ab-serve report ab-out      # re-summarise saved runs
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files, markers
from k3_amd_overlay.commands import ab_run, ab_stats, arms
from k3_amd_overlay.commands.baseline_hazard import ACCEPT_FLAG
from k3_amd_overlay.commands.bench.plot import matplotlib_missing
from k3_amd_overlay.commands.usage import (
    EPILOG,
    EXIT_FAILED,
    Parser,
    UsageError,
    add_arm_server_arguments,
    check_arm_server_arguments,
    check_given,
    check_not_owned,
    check_seconds,
    describe,
    json_result,
    split_command,
)
from k3_amd_overlay.package import __version__
from k3_amd_overlay.settings import SWITCH

BENCH_DEFAULTS = ("--backend openai-chat --endpoint /v1/chat/completions --dataset-name random "
                  "--random-input-len 1024 --random-output-len 8192 --random-range-ratio 0 --ignore-eos "
                  "--seed 42 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99")
PROMPTS_PER_CONCURRENCY = 4  # default --num-prompts: this many requests per concurrent slot
RUN_DIR = re.compile(r"repeat(\d+)-arm([ABC])")
BENCH_FILE = re.compile(r"bench-c([1-9]\d*)\.json")  # as bench() names it: bench-c8.json at concurrency 8


JSON_HELP = "one JSON object on stdout on every path (the summary; progress goes to stderr)"


def parser() -> Parser:
    p = Parser(prog="k3-amd-overlay ab-serve", description=describe(__doc__),
               epilog="k3-amd-overlay ab-serve report OUT re-summarises the runs saved under OUT (its own --help). "
                      + EPILOG)
    add_arm_server_arguments(p, "K3_AMD_OVERLAY of the baseline arm (0: vLLM as it is)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="bench concurrencies, each run")
    p.add_argument("--num-prompts", type=int,
                   help=f"requests per bench run (default: {PROMPTS_PER_CONCURRENCY} x the concurrency)")
    p.add_argument("--repeats", type=int, default=ab_stats.pairs_for_a_verdict(),
                   help=f"ABBA repeats; the exact test can call a difference (p < {ab_stats.SIGNIFICANCE}) on the "
                        f"primary metric ({ab_stats.PRIMARY_METRIC}) only from {ab_stats.pairs_for_a_verdict()} on, on "
                        "the other rows (Holm-corrected together) only from more")
    p.add_argument("--with-stock", action="store_true",
                   help="a third arm C with K3_AMD_OVERLAY=stock: the unfused path, vLLM's own fusions off too "
                        "(on vLLM 0.30+ that also turns off what vLLM fuses by itself), compared with A as well")
    p.add_argument("--out", type=Path, required=True,
                   help="a new or empty directory for every raw result and the summary (a used one is refused)")
    p.add_argument("--bench-cmd", default="vllm bench serve", help="the command that runs one bench")
    p.add_argument("--bench-args", default=BENCH_DEFAULTS, help="vllm bench serve arguments (the vLLM K3 PR's)")
    p.add_argument("--tokenizer", help="passed to the bench (default: the model)")
    p.add_argument("--profile-window", type=float, metavar="SECONDS",
                   help="per arm: /start_profile this long after the bench starts, /stop_profile after "
                        "(the server needs --profiler-config in --serve-args)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    return p


def validate(args: argparse.Namespace) -> None:
    """Every argument checked before the first server starts (a run can take hours)."""
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: at least 1")
    if min(args.concurrency) < 1:
        raise UsageError(f"--concurrency {args.concurrency}: each at least 1")
    repeated = sorted({c for c in args.concurrency if args.concurrency.count(c) > 1})
    if repeated:
        raise UsageError(f"--concurrency {args.concurrency}: {', '.join(map(str, repeated))} given more than once; "
                         "each concurrency at most once (a second bench would overwrite the first's result)")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UsageError(f"--num-prompts {args.num_prompts}: at least 1")
    if args.profile_window is not None:
        check_seconds("--profile-window", args.profile_window)
    check_arm_server_arguments(args)
    check_given("--tokenizer", args.tokenizer, "the model")
    check_given("--bench-args", args.bench_args, "the vLLM K3 PR's workload")
    check_not_owned("--bench-args", args.bench_args, split_command("--bench-args", args.bench_args), BENCH_OWNED)
    ab_run.check_unused(args.out, "ab-serve")
    switches = [("--arm-a", args.arm_a), ("--arm-b", args.arm_b)]
    if args.with_stock:
        switches.append(("the stock arm", "stock"))
    commands = (("--serve-cmd", args.serve_cmd), ("--bench-cmd", args.bench_cmd))
    args.baseline_hazards = arms.check_arms(switches, commands, args.serve_args, args.accept_baseline_hazard)


# What bench_command sets itself, and what to give instead (a --bench-args repeating one is refused:
# with it, one of the two would be dropped without a word). --host and --port: the bench takes --base-url.
BENCH_OWNED = {
    "--model": "give ab-serve's --served-model-name where the server answers to another name",
    "--tokenizer": "give ab-serve's --tokenizer",
    "--base-url": "ab-serve points the bench at each arm's proved server",
    "--host": "ab-serve points the bench at each arm's proved server (--base-url)",
    "--port": "give ab-serve's --port",
    "--num-prompts": "give ab-serve's --num-prompts",
    "--max-concurrency": "give ab-serve's --concurrency",
    "--save-result": "ab-serve saves every result under --out",
    "--result-dir": "ab-serve saves every result under --out",
    "--result-filename": "ab-serve names each result by its repeat, arm and concurrency",
}


def bench_command(args: argparse.Namespace, url: str, concurrency: int, result: Path) -> list[str]:
    """The bench's command line at one concurrency against the server at ``url``."""
    prompts = args.num_prompts or PROMPTS_PER_CONCURRENCY * concurrency
    return [*split_command("--bench-cmd", args.bench_cmd), "--model", args.served_model_name or args.model,
            "--tokenizer", args.tokenizer or args.model, "--base-url", url,
            *split_command("--bench-args", args.bench_args), "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


class ProfileWindow:
    """The profiler of the server at ``url`` on for ``seconds``, from ``seconds`` into a bench: started
    only while the bench runs, and stopped at the latest when it ends (``close``), so no request of the
    window reaches a later bench or another arm's server on the same port."""

    def __init__(self, url: str, seconds: float) -> None:
        self.url, self.seconds = url, seconds
        self.ended = threading.Event()
        self.started = False
        self.failure: str | None = None
        self.thread = threading.Thread(target=self._run, name="k3-amd-overlay (profile window)", daemon=True)
        self.thread.start()

    def _post(self, what: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{what}", method="POST"), timeout=60).read()

    def _run(self) -> None:
        try:
            if self.ended.wait(self.seconds):
                return
            self._post("start_profile")
            self.started = True
            self.ended.wait(self.seconds)
            self._post("stop_profile")
        except (OSError, ValueError) as exc:  # refused, dropped, an HTTP error
            self.failure = f"{type(exc).__name__}: {exc}"

    def close(self) -> str | None:
        """The bench ended: stop a window still open, and say what went wrong (None: the window ran)."""
        self.ended.set()
        self.thread.join()
        if self.failure is not None:
            return f"the profile window failed ({self.failure})"
        if not self.started:
            return (f"it ended before its profile window began ({self.seconds:g} s in): no trace; give a shorter "
                    "--profile-window or more prompts")
        return None


def bench(args: argparse.Namespace, server: arms.Server, concurrency: int, result: Path) -> dict:
    command = bench_command(args, server.url, concurrency, result)
    log = result.with_suffix(".log")
    with open(log, "w") as handle:
        window = ProfileWindow(server.url, args.profile_window) if args.profile_window else None
        try:
            code = subprocess.run(command, stdout=handle, stderr=handle).returncode
        finally:
            problem = window.close() if window is not None else None
    if problem is not None:
        raise arms.ArmFailed(f"arm {server.arm.label}: bench at concurrency {concurrency}: {problem}; log: {log}")
    if code != 0 or not result.exists():
        raise arms.ArmFailed(f"arm {server.arm.label}: bench at concurrency {concurrency} failed; log: {log}")
    try:
        record = json_files.load(result)
    except OSError as exc:
        raise arms.ArmFailed(f"arm {server.arm.label}: bench at concurrency {concurrency} wrote {result}, which "
                             f"cannot be read ({exc}); log: {log}") from None
    except ValueError as exc:
        raise arms.ArmFailed(f"arm {server.arm.label}: bench at concurrency {concurrency} wrote {result}, which is "
                             f"not JSON ({exc}); log: {log}") from None
    why = ab_stats.unusable_metric(record)
    if why:  # caught here, the arm fails now; saved, the summary would refuse the whole run's results
        raise arms.ArmFailed(f"arm {server.arm.label}: bench at concurrency {concurrency} wrote {result}, which "
                             f"the table cannot read: {why}; log: {log}")
    return record


def arm_folders(out: Path, run_id: str) -> tuple[list[tuple[str, Path]], list[str]]:
    """The (arm label, folder) of every folder run ``run_id`` marked measured under ``out``, in
    repeat order, and the names of its folders left out (not so marked); ab_run.ForeignResults where
    any repeat folder there is not this run's."""
    runs = sorted((int(m.group(1)), m.group(2), d) for d in out.iterdir() if (m := RUN_DIR.fullmatch(d.name)))
    ab_run.check_owned((d for _, _, d in runs), run_id)
    measured, left_out = [], []
    for _, label, directory in runs:
        if ab_run.measured(directory, run_id):
            measured.append((label, directory))
        else:
            left_out.append(directory.name)
    return measured, left_out


# results[arm label][concurrency][repeat] = the bench result that repeat of the arm saved
Results = dict[str, dict[int, dict[int, dict[str, Any]]]]


def load_results(out: Path, run_id: str) -> tuple[Results, list[str]]:
    """Every bench result run ``run_id`` saved under ``out`` in the folders it marked measured, by
    arm, concurrency and repeat, and the names of its folders left out (not so marked);
    ab_run.ForeignResults where any repeat folder there is not this run's."""
    folders, left_out = arm_folders(out, run_id)
    results: Results = {}
    for label, directory in folders:
        repeat = int(RUN_DIR.fullmatch(directory.name).group(1))  # type: ignore[union-attr]  # arm_folders matched it
        for path in sorted(directory.glob("bench-c*.json")):
            results.setdefault(label, {}).setdefault(bench_concurrency(path), {})[repeat] = read_bench(path)
    return results, left_out


def in_pairs(results: Results, candidate: str, baseline: str = "A") -> dict[str, dict[int, list[dict[str, Any]]]]:
    """``candidate``'s and ``baseline``'s results per concurrency over the repeats both saved one for,
    in repeat order: the i-th of each list is one repeat's, as ab_stats.serving_rows pairs them (a
    repeat one arm lacks is left out, never paired with another repeat)."""
    paired: dict[str, dict[int, list[dict[str, Any]]]] = {baseline: {}, candidate: {}}
    for concurrency, base in results.get(baseline, {}).items():
        other = results.get(candidate, {}).get(concurrency, {})
        both = sorted(set(base) & set(other))
        paired[baseline][concurrency] = [base[r] for r in both]
        paired[candidate][concurrency] = [other[r] for r in both]
    return paired


def proved_arms(out: Path, run_id: str, arm_list: list[arms.Arm]) -> dict[str, dict[str, Any] | None]:
    """Per arm, what the checks that held after its measurements proved it ran (arms.proved_fusions,
    over its measured folders); None for an arm with a folder that saved no such check, or none
    measured. ab_run.ForeignResults naming a saved check that cannot be read."""
    folders, _ = arm_folders(out, run_id)
    try:
        return {arm.label: arms.merge_proved(arms.proved_fusions(d / arms.CHECK_AFTER_JSON)
                                             for label, d in folders if label == arm.label) for arm in arm_list}
    except arms.ProofUnreadable as exc:
        raise ab_run.ForeignResults(str(exc)) from None


def bench_concurrency(path: Path) -> int:
    """The concurrency a bench result's name gives; ForeignResults where bench() wrote no such name."""
    found = BENCH_FILE.fullmatch(path.name)
    if found is None:
        raise ab_run.ForeignResults(f"{path}: the concurrency in its name, {path.stem.removeprefix('bench-c')!r}, is "
                                    "not a positive whole number (bench-c8.json: concurrency 8), so no bench of this "
                                    "run wrote it: move it out")
    return int(found.group(1))


def read_bench(path: Path) -> dict[str, Any]:
    """A bench result the table can read; ForeignResults naming the file and the field where not."""
    record = ab_run.read_json(path)
    why = ab_stats.unusable_metric(record)
    if why:
        raise ab_run.ForeignResults(f"{path} is no bench result the table can read: {why}")
    return record


def _first_line(command: list[str]) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # k3_amd_overlay/, this module being in its commands/


def overlay_git_sha(package_dir: Path = PACKAGE_DIR) -> str | None:
    """The commit of the overlay's own checkout that ``package_dir`` is in: its parent is the top
    level of a git work tree whose pyproject.toml names k3-amd-overlay; else None (an installed
    copy inside some other repository, a venv in a project's checkout, says nothing of the overlay)."""
    root = package_dir.parent
    top = _first_line(["git", "-C", str(root), "rev-parse", "--show-toplevel"])
    if top is None or Path(top).resolve() != root.resolve():
        return None
    try:
        named = re.search(r'^name\s*=\s*"k3-amd-overlay"', (root / "pyproject.toml").read_text(), re.MULTILINE)
    except OSError:
        return None
    return _first_line(["git", "-C", str(root), "rev-parse", "HEAD"]) if named else None


def _markers_in(directory: Path) -> list[markers.MarkerFile]:
    """An arm's markers for the summary's versions (none where the folder cannot be listed: the arm's
    proof read them already, and a summary must not stop on them)."""
    try:
        return markers.read_markers(directory)
    except markers.MarkerDirError:
        return []


def environment(args: argparse.Namespace, arm_list: list[arms.Arm]) -> dict[str, Any]:
    """What ran where, for summary.json: versions (vLLM as the proved arms' markers record it), the
    GPU, the arguments, the overlay's source revision where it is a git checkout."""
    vllm_versions = sorted({m.record.vllm_version for d in args.out.glob("repeat*-arm*/markers") if d.is_dir()
                            for m in _markers_in(d) if m.record and m.record.vllm_version})
    return {
        "overlay_version": __version__,
        "overlay_git_sha": overlay_git_sha(),
        "vllm_versions": vllm_versions,
        "gpu": _first_line(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
        or _first_line(["amd-smi", "static", "--asic", "--csv"]) or _first_line(["rocm-smi", "--showproductname"]),
        "model": args.model, "served_model_name": args.served_model_name or args.model,
        "serve_args": args.serve_args, "bench_args": args.bench_args, "concurrency": args.concurrency,
        "num_prompts": args.num_prompts or f"{PROMPTS_PER_CONCURRENCY} x concurrency",
        "repeats": args.repeats, "baseline_hazards": getattr(args, "baseline_hazards", []),
        "arms": {a.label: {"switch": a.switch, "expect": a.expect} for a in arm_list},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def arm_runs(proved: dict[str, Any] | None) -> str:
    """What an arm ran, in a few words, as its proofs show it (arms.proved_fusions)."""
    if proved is None:
        return "fusions not recorded"
    if proved["mode"] in ("off", "stock"):
        return {"off": "vLLM as shipped", "stock": "all unfused"}[proved["mode"]]
    states = {state for found in proved["fusions"].values() for state in found}
    overlay, own = "applied" in states, "upstream" in states
    return {(True, True): "the overlay's + vLLM's own fusions", (True, False): "the overlay's fusions",
            (False, True): "vLLM's own fusions only", (False, False): "no fusion"}[(overlay, own)]


def upstream_note(label: str, candidate: dict[str, Any] | None, baseline: dict[str, Any] | None) -> str | None:
    """Where the candidate ran fusions of vLLM's own (upstream), whose they are and what the
    comparison therefore measures; None where it ran none (or its fusions are not recorded)."""
    upstream = sorted(f for f, states in (candidate or {}).get("fusions", {}).items() if "upstream" in states)
    if not upstream:
        return None
    own = f"{label}'s upstream fusions ({', '.join(upstream)}) are vLLM's own code, not the overlay's"
    if baseline is not None and baseline["mode"] == "off":
        return f"{own}; A (vLLM as shipped) runs them too, so the difference is the overlay's applied fusions"
    return (f"{own}; vLLM as shipped runs them too, but A ({arm_runs(baseline)}) does not: this table measures them "
            f"together with the overlay's, and a {label} better than A is not the overlay's alone (for the overlay "
            f"alone, compare with {SWITCH}=0 where it is a sound baseline)")


def fusion_lines(arm_list: list[arms.Arm], proved: dict[str, dict[str, Any] | None]) -> list[str]:
    """Each arm's fusions as its checks proved them, one line an arm."""
    lines = []
    for arm in arm_list:
        found = proved.get(arm.label)
        if found is None:
            said = "not recorded (no saved check for every measured repeat)"
        elif found["mode"] == "off":
            said = "overlay off (vLLM as shipped, its own fusions where it has them)"
        else:
            said = "; ".join(f"{name} {'/'.join(states)}" for name, states in found["fusions"].items()) or "none"
        lines.append(f"- {arm.label} ({SWITCH}={arm.switch}): {said}")
    return lines


def comparison(candidate: arms.Arm, baseline: arms.Arm, rows: list[ab_stats.MetricRow],
               proved: dict[str, dict[str, Any] | None]) -> str:
    """One comparison's section: headed by what each arm ran, the upstream note, the table."""
    ran_c, ran_a = proved.get(candidate.label), proved.get(baseline.label)
    title = (f"### {candidate.label} ({SWITCH}={candidate.switch}) vs A ({SWITCH}={baseline.switch}): "
             f"{arm_runs(ran_c)} vs {arm_runs(ran_a)}; {candidate.label} vs A > 1: {candidate.label} is better")
    note = upstream_note(candidate.label, ran_c, ran_a)
    table = ab_stats.render_serving(rows, candidate.label) if rows else \
        "no repeat completed by both arms: nothing to compare"
    return "\n\n".join([title, *([f"note: {note}"] if note else []), table])


def summarise(out: Path, run_id: str, arm_list: list[arms.Arm], env: dict[str, Any],
              aborted: str | None = None) -> str:
    """Write summary.md, summary.json and summary.png from the results run ``run_id`` saved under
    ``out``; return the text (what an abort leaves is summarised too, over the repeats both arms
    completed). ab_run.ForeignResults where ``out`` holds another run's folder."""
    results, left_out = load_results(out, run_id)
    proved = proved_arms(out, run_id, arm_list)
    sections, rows_json = [], {}
    for candidate in [a for a in arm_list if a.label != "A"]:
        rows = ab_stats.serving_rows(in_pairs(results, candidate.label, "A"), candidate.label, "A")
        sections.append(comparison(candidate, arm_list[0], rows, proved))
        rows_json[f"{candidate.label}_vs_A"] = [r.to_json() for r in rows]
    fusions = ("Fusions as each arm's check proved them after its measurement (applied: the overlay's; upstream: "
               "vLLM's own; forced-stock: off in stock mode):\n" + "\n".join(fusion_lines(arm_list, proved)))
    text = "\n\n".join(sections) + "\n\n" + fusions + "\n\n" + ab_stats.METHOD
    if left_out:
        text = (f"not compared: {', '.join(left_out)} (the arm did not finish its benches with its check still "
                f"holding)\n\n{text}")
    if aborted:
        text = f"ABORTED ({aborted}); the table covers the repeats both arms completed\n\n{text}"
    for hazard in env.get("baseline_hazards") or []:
        text = f"WARNING, measured with {ACCEPT_FLAG}: {hazard}\n\n{text}"
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"run_id": run_id, "environment": env, "aborted": aborted,
                                                  "fusions": proved, "rows": rows_json},
                                                 indent=1, default=str))
    plotted = plot_serving(results, arm_list, out / "summary.png")
    return text + ("\n\nplot: " + str(out / "summary.png") if plotted else f"\n\nplot skipped: {plot_missing()}")


plot_missing = matplotlib_missing  # the one install hint (commands/bench/plot.py)


PLOTTED = (("TPOT p50 (ms)", "median_tpot_ms"), ("TTFT p50 (ms)", "median_ttft_ms"), ("out tok/s", "output_throughput"))


def plot_serving(results: Results, arm_list: list[arms.Arm], path: Path) -> bool:
    """Latency and throughput per concurrency and arm: the median over the repeats, bars from the
    lowest to the highest repeat."""
    if plot_missing():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(5 * len(PLOTTED), 4))
    for axis, (label, key) in zip(axes, PLOTTED, strict=True):
        for arm in arm_list:
            by_c = {c: [r[key] for r in runs.values() if key in r] for c, runs in results.get(arm.label, {}).items()}
            points = sorted((c, v) for c, v in by_c.items() if v)
            if not points:
                continue
            xs = [c for c, _ in points]
            mid = [statistics.median(v) for _, v in points]
            low = [m - min(v) for m, (_, v) in zip(mid, points, strict=True)]
            high = [max(v) - m for m, (_, v) in zip(mid, points, strict=True)]
            axis.errorbar(xs, mid, yerr=[low, high], marker="o", capsize=3,
                          label=f"{arm.label}: K3_AMD_OVERLAY={arm.switch}")
        concurrencies = sorted({c for runs in results.values() for c in runs})
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrency")
        axis.set_title(label)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def report_parser() -> Parser:
    p = Parser(prog="k3-amd-overlay ab-serve report",
               description="Re-summarise the runs saved under an ab-serve --out directory: summary.md, summary.json "
                           "and summary.png written again from the raw results of the run that claimed it.")
    p.add_argument("out", type=Path, help="the --out directory of an ab-serve run")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout on every path (the summary)")
    return p


def report(argv: list[str]) -> int:
    p = report_parser()
    args = p.parse_args(argv)
    summary = args.out / "summary.json"
    try:
        run_id = ab_run.run_id_of(args.out, "ab-serve")
        if not summary.is_file():
            raise ab_run.ForeignResults(f"{summary} not found: run {run_id} wrote no summary")
        previous = ab_run.read_json(summary)
        if not isinstance(previous, dict):
            raise ab_run.ForeignResults(f"{summary} is no ab-serve summary: {previous!r}")
        if previous.get("run_id") != run_id:
            raise ab_run.ForeignResults(f"{summary} is run {previous.get('run_id')}'s, {args.out / ab_run.RUN_FILE} "
                                        f"says run {run_id}")
        env = saved_environment(summary, previous)
        try:
            arm_list = [arms.Arm(label, a["switch"], a["expect"]) for label, a in sorted(env.get("arms", {}).items())]
        except (AttributeError, KeyError, TypeError) as exc:
            raise ab_run.ForeignResults(f"{summary} is no ab-serve summary: its arms are unreadable "
                                        f"({exc!r})") from None
        text = summarise(args.out, run_id, arm_list, env, previous.get("aborted"))
    except ab_run.ForeignResults as exc:
        return p.usage_error(UsageError(str(exc)))
    data = json_files.load(summary)  # as summarise wrote it just now
    error = unanswered(data)
    if args.json:
        print(json_result("ab-serve report", error is None, **data, error=error))
    else:
        print(text)
    return EXIT_FAILED if error else 0


def saved_environment(summary: Path, previous: dict[str, Any]) -> dict[str, Any]:
    """summary.json's "environment", where summarise can read it again; ForeignResults naming the
    field where not."""
    env = previous.get("environment", {})
    if not isinstance(env, dict):
        raise ab_run.ForeignResults(f'{summary} is no ab-serve summary: its "environment" is {env!r}, not an object')
    hazards = env.get("baseline_hazards")
    if hazards is not None and not (isinstance(hazards, list) and all(isinstance(h, str) for h in hazards)):
        raise ab_run.ForeignResults(f'{summary} is no ab-serve summary: its "baseline_hazards" is {hazards!r}, not '
                                    "a list of strings")
    return env


def unanswered(summary: dict[str, Any]) -> str | None:
    """Why the run a summary records did not measure what it set out to: why it was aborted, that a
    comparison has no row, or that a row's numbers are unusable (no ratio a verdict could read); None
    where it did (its exit status and --json's ``error``)."""
    if summary.get("aborted"):
        return str(summary["aborted"])
    rows = summary.get("rows") or {}
    empty = [name for name, found in rows.items() if not found]
    if empty or not rows:
        return "no repeat completed by both arms: nothing to compare" + (f" ({', '.join(empty)})" if empty else "")
    unusable = [f"{name} {row.get('metric')} at concurrency {row.get('concurrency')}: {row['verdict']}"
                for name, found in rows.items() for row in found
                if isinstance(row, dict) and str(row.get("verdict", "")).startswith(ab_stats.UNUSABLE)]
    if unusable:
        return f"{len(unusable)} row{'s' if len(unusable) != 1 else ''} without a usable ratio: " + "; ".join(
            unusable[:3]) + ("; ..." if len(unusable) > 3 else "")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return report(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    try:
        validate(args)
    except UsageError as exc:
        return p.usage_error(exc)
    try:
        if not args.json:
            return run(args)
        with contextlib.redirect_stdout(sys.stderr):  # progress and the table to stderr; stdout: the one object
            code = run(args)
    except UsageError as exc:  # --out cannot be created, or another run claimed it meanwhile
        return p.usage_error(exc)
    except ab_run.ForeignResults as exc:  # no summary written: another run's results among this run's
        print(f"k3-amd-overlay ab-serve: {exc}", file=sys.stderr)
        if args.json:
            print(json_result("ab-serve", False, error=arms.reason(exc)))
        return EXIT_FAILED
    data = json_files.load(args.out / "summary.json")
    print(json_result("ab-serve", code == 0, **data, error=unanswered(data)))
    return code


def run(args: argparse.Namespace) -> int:
    """The run of validated arguments: 0, or 1 where an arm failed, nothing could be compared or no
    summary could be written; UsageError where --out cannot be created or another run claimed it
    meanwhile (before any server starts)."""
    run_id = ab_run.claim(args.out, "ab-serve")
    for hazard in args.baseline_hazards:
        print(f"k3-amd-overlay ab-serve: warning ({ACCEPT_FLAG}): {hazard}", file=sys.stderr, flush=True)
    no_verdict = ab_stats.no_verdict_reason(args.repeats)
    if no_verdict:
        print(f"k3-amd-overlay ab-serve: warning: --repeats {args.repeats}: {no_verdict}", file=sys.stderr, flush=True)
    arm_list = list(arms.default_arms(args.arm_a, args.arm_b))
    if args.with_stock:
        arm_list.append(arms.Arm("C", "stock", arms.expectation("stock")))
    order = arms.abba(arm_list, args.repeats)
    aborted = None
    for step, (repeat, arm) in enumerate(order, start=1):
        workdir = args.out / f"repeat{repeat}-arm{arm.label}"
        print(f"[{step}/{len(order)}] repeat {repeat}, arm {arm.label} (K3_AMD_OVERLAY={arm.switch}): starting",
              flush=True)
        try:
            ab_run.stamp(workdir, run_id)
            with arms.proved_server(arm, args.serve_cmd, args.model, args.serve_args, args.port, workdir,
                                    args.health_timeout, served_name=args.served_model_name) as server:
                print(f"[{step}/{len(order)}] arm {arm.label} proved {arm.expect}", flush=True)
                for concurrency in args.concurrency:
                    print(f"[{step}/{len(order)}] arm {arm.label}: bench at concurrency {concurrency}", flush=True)
                    bench(args, server, concurrency, workdir / f"bench-c{concurrency}.json")
            ab_run.mark_measured(workdir, run_id)
        except arms.ArmFailed as exc:
            print(f"ABORTED: {exc}", file=sys.stderr, flush=True)
            aborted = arms.reason(exc)
            break
    print("\n" + summarise(args.out, run_id, arm_list, environment(args, arm_list), aborted))
    return EXIT_FAILED if unanswered(json_files.load(args.out / "summary.json")) else 0
