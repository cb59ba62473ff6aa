#!/usr/bin/env python3
"""A/B serving run that cannot A/B against itself: for each repeat, in ABBA order, start the
server for one arm (identical arguments, only K3_AMD_OVERLAY differs), wait for health, send one
request, prove the arm with `k3-amd-overlay check` (abort if it does not hold), run
`vllm bench serve` at each concurrency, stop the server. Writes every raw result under --out and
prints per concurrency and metric: baseline, fused, ratio, each arm's spread over repeats (±rng,
max-min as % of the mean), marking ratios inside that spread as noise.

    scripts/ab_serve.py --model /models/Kimi-K3 --concurrency 1 8 32 --repeats 3 \\
        --serve-args "--tensor-parallel-size 8 --kv-cache-dtype fp8 --trust-remote-code" --out ab-out
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from k3_amd_overlay import arms

BENCH_DEFAULTS = ("--backend openai-chat --endpoint /v1/chat/completions --dataset-name random "
                  "--random-input-len 1024 --random-output-len 8192 --random-range-ratio 0 --ignore-eos "
                  "--seed 42 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--serve-args", default="", help="identical for both arms")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arm-a", default="stock", help="K3_AMD_OVERLAY of the baseline arm")
    p.add_argument("--arm-b", default="1", help="K3_AMD_OVERLAY of the candidate arm")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--serve-cmd", default="vllm serve")
    p.add_argument("--bench-cmd", default="vllm bench serve")
    p.add_argument("--bench-args", default=BENCH_DEFAULTS)
    p.add_argument("--tokenizer", help="passed to the bench (default: the model)")
    p.add_argument("--health-timeout", type=float, default=3600.0)
    p.add_argument("--profile-window", type=float, metavar="SECONDS",
                   help="per arm: /start_profile this long after the bench starts, /stop_profile after, then census "
                        "(the server needs --profiler-config in --serve-args)")
    return p.parse_args(argv)


def bench(args: argparse.Namespace, server: arms.Server, concurrency: int, result: Path) -> dict:
    command = [*arms.split_command(args.bench_cmd), "--model", args.model, "--tokenizer", args.tokenizer or args.model,
               "--base-url", server.url, *arms.split_command(args.bench_args), "--num-prompts", str(concurrency),
               "--max-concurrency", str(concurrency), "--save-result", "--result-dir", str(result.parent),
               "--result-filename", result.name]
    log = result.with_suffix(".log")
    with open(log, "w") as handle:
        if args.profile_window:
            def window() -> None:
                time.sleep(args.profile_window)
                urllib.request.urlopen(urllib.request.Request(f"{server.url}/start_profile", method="POST")).read()
                time.sleep(args.profile_window)
                urllib.request.urlopen(urllib.request.Request(f"{server.url}/stop_profile", method="POST")).read()

            threading.Thread(target=window, daemon=True).start()
        code = subprocess.run(command, stdout=handle, stderr=handle).returncode
    if code != 0 or not result.exists():
        raise arms.ArmFailed(f"arm {server.arm.label}: bench at concurrency {concurrency} failed; log: {log}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arm_pair = arms.default_arms(args.arm_a, args.arm_b)
    results: dict[str, dict[int, list[dict]]] = {"A": {}, "B": {}}
    order = arms.abba(arm_pair, args.repeats)
    for step, (repeat, arm) in enumerate(order, start=1):
        workdir = args.out / f"repeat{repeat}-arm{arm.label}"
        print(f"[{step}/{len(order)}] repeat {repeat}, arm {arm.label} (K3_AMD_OVERLAY={arm.switch}): starting",
              flush=True)
        try:
            with arms.proved_server(arm, args.serve_cmd, args.model, args.serve_args, args.port, workdir,
                                    args.health_timeout) as server:
                print(f"[{step}/{len(order)}] arm {arm.label} proved {arm.expect}", flush=True)
                for concurrency in args.concurrency:
                    print(f"[{step}/{len(order)}] arm {arm.label}: bench at concurrency {concurrency}", flush=True)
                    data = bench(args, server, concurrency, workdir / f"bench-c{concurrency}.json")
                    results[arm.label].setdefault(concurrency, []).append(data)
        except arms.ArmFailed as exc:
            print(f"ABORTED: {exc}", file=sys.stderr, flush=True)
            return 1
    rows = arms.serving_rows(results)
    table = arms.render_serving(rows)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "summary.json").write_text(json.dumps([r.__dict__ | {"inside_noise": r.inside_noise} for r in rows],
                                                      indent=1))
    print(f"\nA = K3_AMD_OVERLAY={arm_pair[0].switch}, B = K3_AMD_OVERLAY={arm_pair[1].switch}; {args.repeats} repeats "
          f"in ABBA order; ratio > 1: the fused arm is better; ±rng: max-min over repeats as % of the mean\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
