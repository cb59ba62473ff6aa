"""GSM8K accuracy A/B: for each arm (only K3_AMD_OVERLAY differs) start the server, prove the arm
with `k3-amd-overlay check`, run lm-eval gsm8k (5-shot, all 1319 questions by default) against it,
prove the arm again (where it no longer holds, the run aborts), stop it; print each arm's accuracy
and, since both arms answer the same questions, the paired comparison (lm-eval's --log_samples
gives each question's outcome): how many questions only one arm got right, McNemar's exact test on
them, and the verdict ("no verdict possible" where so few questions differ that p < 0.05 cannot be
reached). --out must be new or empty: the run claims it with a run id and reads back only the arm
folders stamped with it (ab_run.py).

    k3-amd-overlay gsm8k-ab --model /models/Kimi-K3 --serve-args "--tensor-parallel-size 8 ..." --out gsm8k-out

Air-gapped: ``--data-file gsm8k-test.jsonl`` (GSM8K's own format: one ``{"question", "answer"}`` per
line) evaluates lm-eval's own gsm8k task on that file, few-shot examples drawn from it too; nothing
is downloaded (with HF_DATASETS_OFFLINE=1 set).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files, json_values
from k3_amd_overlay.commands import ab_run, ab_stats, arms
from k3_amd_overlay.commands.baseline_hazard import ACCEPT_FLAG
from k3_amd_overlay.commands.usage import (
    EXIT_FAILED,
    Parser,
    UsageError,
    add_arm_server_arguments,
    check_arm_server_arguments,
    check_given,
    check_input_file,
    check_not_owned,
    describe,
    json_result,
    split_command,
)

METRIC = re.compile(r"[^,\s]+,[^,\s]+")  # how lm-eval names a result: METRIC,FILTER


def parser() -> Parser:
    p = Parser(prog="k3-amd-overlay gsm8k-ab", description=describe(__doc__))
    add_arm_server_arguments(p, "K3_AMD_OVERLAY of the baseline arm (0: vLLM as it is; stock: the unfused path, "
                                "vLLM's own fusions off too)")
    p.add_argument("--out", type=Path, required=True,
                   help="a new or empty directory for the arms' results and the summary (a used one is refused)")
    p.add_argument("--lm-eval-cmd", default="lm_eval", help="the lm-eval command (lm-eval[api] installed)")
    p.add_argument("--task", default="gsm8k", help="the lm-eval task")
    p.add_argument("--num-fewshot", type=int, default=5, help="few-shot examples in each prompt")
    p.add_argument("--limit", type=int, help="questions per arm (default: all)")
    p.add_argument("--num-concurrent", type=int, default=32, help="lm-eval's concurrent requests to the server")
    p.add_argument("--metric", default="exact_match,strict-match", help="the lm-eval metric and filter compared")
    p.add_argument("--extra-model-args", default="",
                   help="appended to lm-eval's --model_args, e.g. max_gen_toks=256,max_length=4096")
    p.add_argument("--data-file", type=Path, help="a local GSM8K-format JSONL instead of the hub data set")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout on every path (the result; progress goes to stderr)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def task_file(task: str) -> Path:
    """lm-eval's own file of ``task``, in the lm-eval this Python imports (what --data-file builds
    on); UsageError where there is none."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("--data-file needs lm-eval importable by this Python (pip install 'lm-eval[api]')")
    base = Path(next(iter(spec.submodule_search_locations))) / "tasks" / task / f"{task}.yaml"
    if not base.is_file():
        raise UsageError(f"--task {task!r} with --data-file: lm-eval has no task file {base}")
    return base


def local_task(task: str, data_file: Path, tasks_dir: Path) -> str:
    """Write an lm-eval task that is lm-eval's own ``task`` (its prompt, filters and metric, read
    from the installed lm-eval) over a local JSONL; return the new task's name."""
    base = task_file(task)
    data = str(data_file.resolve())
    name = f"{task}_local"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    (tasks_dir / f"{name}.yaml").write_text("\n".join([
        f"include: {json.dumps(str(base))}", f"task: {name}", "tag: []", "dataset_path: json", "dataset_name: null",
        "dataset_kwargs:", "  data_files:", f"    train: {json.dumps(data)}", f"    test: {json.dumps(data)}",
        "training_split: train", "fewshot_split: train", "test_split: test", ""]))
    return name


def read_text(path: Path) -> str:
    """An lm-eval output file's text; ArmFailed where it cannot be read (a FIFO or a folder is not
    read: json_files)."""
    try:
        return json_files.read_regular(path)
    except (OSError, ValueError) as exc:
        raise arms.ArmFailed(f"{path} cannot be read: {exc}") from None


def read_json(path: Path) -> Any:
    """An lm-eval output file's JSON; ArmFailed where it cannot be read or is not JSON."""
    try:
        return json_files.parse(read_text(path))
    except ValueError as exc:
        raise arms.ArmFailed(f"{path} is not JSON: {exc}") from None


def checked_accuracy(path: Path, task: str, metric: str, value: Any) -> float:
    """lm-eval's ``metric`` of ``task`` read from ``path`` as an accuracy: a finite number from 0 to 1;
    ArmFailed naming the file and the field where it is not (NaN would pass for a score, and the
    summary would hold it)."""
    number = json_values.finite(value)
    if number is None or not 0 <= number <= 1:
        raise arms.ArmFailed(f"{path}: results.{task}.{metric} (--metric) is {value!r}, not an accuracy (a finite "
                             "number from 0 to 1)")
    return number


def accuracy(output_dir: Path, task: str, metric: str) -> tuple[float, int]:
    """``task``'s ``metric`` and the questions it scored, from the newest results file; ArmFailed
    where lm-eval gave no such number (naming the metrics it did give) or one that is no accuracy."""
    files = sorted(output_dir.rglob("results*.json"))
    if not files:
        raise arms.ArmFailed(f"no lm-eval results*.json under {output_dir}")
    data = read_json(files[-1])
    results = data.get("results") if isinstance(data, dict) else None
    scores = results.get(task) if isinstance(results, dict) else None
    if not isinstance(scores, dict):
        raise arms.ArmFailed(f"{files[-1]} holds no results of task {task!r}")
    if not isinstance(scores.get(metric), (int, float)):
        given = sorted(repr(k) for k, v in scores.items() if isinstance(v, (int, float)))
        raise arms.ArmFailed(f"lm-eval gave task {task!r} no metric {metric!r} (--metric); it gave: "
                             f"{', '.join(given) or 'none'} (in {files[-1]})")
    score = checked_accuracy(files[-1], task, metric, scores[metric])
    try:
        samples = data.get("n-samples", {}).get(task, {})
        return score, int(samples.get("effective", samples.get("original", 0)))
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of an infinity
        raise arms.ArmFailed(f"{files[-1]}: n-samples of task {task!r} is no question count ({exc})") from None


def outcomes(output_dir: Path, task: str, metric: str) -> dict[int, bool]:
    """Each question's outcome (``doc_id`` -> right) under ``metric`` ("name,filter"), from the
    samples file lm-eval writes with --log_samples."""
    name, _, filter_key = metric.partition(",")
    files = sorted(output_dir.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise arms.ArmFailed(f"no lm-eval samples_{task}_*.jsonl under {output_dir} (was --log_samples passed?)")
    found = {}
    for number, line in enumerate(read_text(files[-1]).splitlines(), start=1):
        try:
            row = json_files.parse(line)
            if not filter_key or row.get("filter") == filter_key:
                found[int(row["doc_id"])] = float(row[name]) > 0
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise arms.ArmFailed(f"{files[-1]} line {number} gives no {metric!r} outcome of a question "
                                 f"({type(exc).__name__}: {exc})") from None
    if not found:
        raise arms.ArmFailed(f"{files[-1]} has no {metric} outcome")
    return found


# The keys of lm-eval's --model_args the tool sets itself, and what to give instead (an
# --extra-model-args repeating one is refused: lm-eval would take one of the two without a word).
MODEL_ARGS_OWNED = {
    "model": "give gsm8k-ab's --served-model-name where the server answers to another name",
    "base_url": "gsm8k-ab points lm-eval at each arm's proved server",
    "num_concurrent": "give gsm8k-ab's --num-concurrent",
    "tokenized_requests": "gsm8k-ab sends text requests (the server's tokenizer applies)",
}


def lm_eval_model_args(args: argparse.Namespace, name: str, url: str) -> str:
    """lm-eval's --model_args for the server at ``url`` answering to ``name``."""
    extra = f",{args.extra_model_args}" if args.extra_model_args else ""
    return (f"model={name},base_url={url}/v1/completions,num_concurrent={args.num_concurrent},"
            f"tokenized_requests=False{extra}")


def validate(args: argparse.Namespace) -> None:
    """Every argument checked before the first server starts."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: at least 1")
    if args.num_fewshot < 0:
        raise UsageError(f"--num-fewshot {args.num_fewshot}: at least 0")
    if args.num_concurrent < 1:
        raise UsageError(f"--num-concurrent {args.num_concurrent}: at least 1")
    check_given("--task", args.task, "gsm8k")
    check_not_owned("--extra-model-args", args.extra_model_args, args.extra_model_args.split(","), MODEL_ARGS_OWNED)
    if not METRIC.fullmatch(args.metric):
        raise UsageError(f"--metric {args.metric!r}: lm-eval names each result METRIC,FILTER, e.g. "
                         "exact_match,strict-match (acc,none where the task has no filter)")
    check_arm_server_arguments(args)
    ab_run.check_unused(args.out, "gsm8k-ab")
    if args.data_file is not None:
        check_input_file("--data-file", args.data_file)
        task_file(args.task)
    args.baseline_hazards = arms.check_arms((("--arm-a", args.arm_a), ("--arm-b", args.arm_b)),
                                            (("--serve-cmd", args.serve_cmd), ("--lm-eval-cmd", args.lm_eval_cmd)),
                                            args.serve_args, args.accept_baseline_hazard)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        validate(args)
        # with --json, progress and the table go to stderr; stdout: the one object
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = run(args)
    except UsageError as exc:
        return p.usage_error(exc)
    except (arms.ArmFailed, ab_run.ForeignResults) as exc:
        print(f"ABORTED: {exc}", file=sys.stderr, flush=True)
        if args.json:
            print(json_result("gsm8k-ab", False, error=arms.reason(exc)))
        return EXIT_FAILED
    if args.json:
        print(json_result("gsm8k-ab", True, **summary))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The run of validated arguments: the summary it wrote (summary.md, summary.json); ArmFailed (or
    ForeignResults) where an arm failed, UsageError where --out cannot be created or another run
    claimed it meanwhile (before any server starts)."""
    run_id = ab_run.claim(args.out, "gsm8k-ab")
    for hazard in args.baseline_hazards:
        print(f"k3-amd-overlay gsm8k-ab: warning ({ACCEPT_FLAG}): {hazard}", file=sys.stderr, flush=True)
    if args.limit is not None and ab_stats.no_verdict_reason(args.limit):
        print(f"k3-amd-overlay gsm8k-ab: warning: --limit {args.limit}: at most {args.limit} questions can differ "
              f"between the arms; {ab_stats.no_verdict_reason(args.limit)}", file=sys.stderr, flush=True)
    name = args.served_model_name or args.model
    scores: dict[str, tuple[float, int]] = {}
    per_question: dict[str, dict[int, bool]] = {}
    task, include = args.task, []
    if args.data_file:
        task = local_task(args.task, args.data_file, args.out / "tasks")
        include = ["--include_path", str(args.out / "tasks")]
    for arm in arms.default_arms(args.arm_a, args.arm_b):
        workdir = args.out / f"arm{arm.label}"
        print(f"arm {arm.label} (K3_AMD_OVERLAY={arm.switch}): starting", flush=True)
        ab_run.stamp(workdir, run_id)
        with arms.proved_server(arm, args.serve_cmd, args.model, args.serve_args, args.port, workdir,
                                args.health_timeout, served_name=name) as server:
            print(f"arm {arm.label} proved {arm.expect}; running {task}", flush=True)
            model_args = lm_eval_model_args(args, name, server.url)
            command = [*split_command("--lm-eval-cmd", args.lm_eval_cmd), "--model", "local-completions",
                       "--model_args", model_args, "--tasks", task, "--num_fewshot", str(args.num_fewshot),
                       "--output_path", str(workdir / "lm_eval"), "--log_samples", *include]
            if args.limit:
                command += ["--limit", str(args.limit)]
            with open(workdir / "lm_eval.log", "w") as log:
                if subprocess.run(command, stdout=log, stderr=log).returncode != 0:
                    raise arms.ArmFailed(f"arm {arm.label}: lm-eval failed; log: {workdir / 'lm_eval.log'}")
            ab_run.check_owned([workdir], run_id)
            scores[arm.label] = accuracy(workdir / "lm_eval", task, args.metric)
            per_question[arm.label] = outcomes(workdir / "lm_eval", task, args.metric)
    (acc_a, n_a), (acc_b, n_b) = scores["A"], scores["B"]
    try:
        paired = ab_stats.PairedAccuracy.from_outcomes(per_question["A"], per_question["B"])
    except ValueError as exc:
        raise arms.ArmFailed(f"{exc} (arm A: {len(per_question['A'])} questions, arm B: "
                             f"{len(per_question['B'])}; see each arm's lm_eval folder under {args.out})") from None
    lines = [
        f"| arm | K3_AMD_OVERLAY | {task} {args.metric} | questions |", "|---|---|---|---|",
        f"| A | {args.arm_a} | {acc_a:.4f} | {n_a} |", f"| B | {args.arm_b} | {acc_b:.4f} | {n_b} |",
        "",
        f"paired over {paired.questions} questions: delta (B - A) {100 * paired.delta:+.2f} pp; right only with A: "
        f"{paired.only_a}, only with B: {paired.only_b}",
        f"verdict: {paired.verdict()}",
        "", f"run {run_id}",
        *(f"WARNING, measured with {ACCEPT_FLAG}: {hazard}" for hazard in args.baseline_hazards),
    ]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    summary = {
        "run_id": run_id, "task": task, "metric": args.metric,
        "arms": {"A": {"switch": args.arm_a, "accuracy": acc_a, "questions": n_a},
                 "B": {"switch": args.arm_b, "accuracy": acc_b, "questions": n_b}},
        "paired": {"questions": paired.questions, "delta": paired.delta, "only_a": paired.only_a,
                   "only_b": paired.only_b, "verdict": paired.verdict()},
        "baseline_hazards": args.baseline_hazards}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    return summary

