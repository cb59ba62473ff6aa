"""Many modules' mutants at once, on a machine with many cores: each module's mutant list (made by
``scripts/mutmut_forked.py list``, gzipped) cut into shards, each shard one ``mutmut_forked.py run``
on a private copy of the tree, WORKERS of them at a time, all stopped at a deadline (the mutants a
shard tested by then are kept). Merges the shards' outcomes into one file per module and prints
each module's kill count and survivors.

    python3 scripts/mutmut_shards.py PLAN.json OUT_DIR --workers 15 --deadline 520

PLAN.json: [{"module": "k3_amd_overlay/commands/verdict.py", "mutants": "PATH.json.gz",
"tests": ["tests/test_evidence.py", ...], "only": [ids] (optional), "shard": 25 (optional)}].
The tree copied is the current directory (the repository root). With --coverage each module's tests
first run once under pytest-cov (``mutmut_forked.py cover``, the modules side by side), and each
mutant then runs only the tests that execute its statement.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

SKIP = {".git", ".venvs", ".gpu-tmp", ".mutants", "__pycache__"}


def copy_tree(root: str, into: str) -> str:
    shutil.copytree(root, into, ignore=lambda _d, names: [n for n in names if n in SKIP])
    return into


def short_name(module: str) -> str:
    """A module's name in result files: ``k3_amd_overlay/commands/cli.py`` -> ``commands-cli``."""
    return module.removeprefix("k3_amd_overlay/").removesuffix(".py").replace("/", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan")
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--deadline", type=float, default=520.0, help="seconds from start for every shard")
    parser.add_argument("--coverage", action="store_true", help="each mutant against the tests that run its line")
    args = parser.parse_args()
    start = time.monotonic()
    plan = json.load(open(args.plan))
    os.makedirs(args.out, exist_ok=True)
    root = os.getcwd()
    tasks: queue.Queue = queue.Queue()
    shards: list[tuple[str, str]] = []
    totals: dict[str, int] = {}
    for entry in plan:
        with gzip.open(entry["mutants"], "rt") as handle:
            count = len(json.load(handle)["mutants"])
        ids = entry.get("only") or list(range(count))
        size = entry.get("shard", 25)
        name = short_name(entry["module"])
        totals[name] = len(ids)
        for n, first in enumerate(range(0, len(ids), size)):
            result = os.path.join(args.out, f"{name}.shard{n}.json")
            shards.append((name, result))
            tasks.put((entry, ids[first:first + size], result))
    scratch = tempfile.mkdtemp()
    python = sys.executable
    coverage_files: dict[str, str] = {}
    if args.coverage:
        covering: list[subprocess.Popen] = []
        for entry in plan:  # at most --workers at once: each imports torch (and vLLM where installed)
            while sum(proc.poll() is None for proc in covering) >= args.workers:
                time.sleep(0.5)
            name = short_name(entry["module"])
            clone = copy_tree(root, os.path.join(scratch, f"cover-{name}"))
            coverage_files[entry["module"]] = os.path.join(args.out, f"{name}.coverage.json")
            command = [python, os.path.join(clone, "scripts/mutmut_forked.py"), "cover", clone, entry["module"],
                       os.path.abspath(coverage_files[entry["module"]]), "--",
                       *[t if t.startswith("-") else os.path.join(clone, t) for t in entry["tests"]]]
            covering.append(subprocess.Popen(command, env={**os.environ, "PYTHONPATH": clone}))
        failed = [entry for entry, proc in zip(plan, covering, strict=True) if proc.wait() != 0]
        for entry in failed:  # reported, and left out: the other modules go on
            name = short_name(entry["module"])
            with open(os.path.join(scratch, f"cover-{name}", "cover-pytest.log")) as handle:
                print(f"--- {entry['module']}: its tests fail unmutated, not run\n{handle.read()[-4000:]}", flush=True)
        if failed:
            left_out = {entry["module"] for entry in failed}
            left_out_names = {short_name(module) for module in left_out}
            kept = []
            while not tasks.empty():
                task = tasks.get_nowait()
                if task[0]["module"] not in left_out:
                    kept.append(task)
            for task in kept:
                tasks.put(task)
            shards[:] = [(name, result) for name, result in shards if name not in left_out_names]
    log_lock = threading.Lock()

    def worker(k: int) -> None:
        clone = copy_tree(root, os.path.join(scratch, f"clone{k}"))
        while time.monotonic() - start < args.deadline:
            try:
                entry, ids, result = tasks.get_nowait()
            except queue.Empty:
                return
            env = {**os.environ, "K3OVL_MUTANTS_ONLY": " ".join(map(str, ids)), "PYTHONPATH": clone}
            if entry["module"] in coverage_files:
                env["K3OVL_MUTANTS_COVERAGE"] = os.path.abspath(coverage_files[entry["module"]])
            command = [python, os.path.join(clone, "scripts/mutmut_forked.py"), "run", clone, entry["module"],
                       os.path.abspath(entry["mutants"]), os.path.abspath(result), "--",
                       *[t if t.startswith("-") else os.path.join(clone, t) for t in entry["tests"]]]
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=max(1.0, args.deadline - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate()
                out += "\n(stopped at the deadline)"
            with log_lock:
                print(f"--- {entry['module']} ids {ids[0]}-{ids[-1]} (worker {k})\n{out.strip()[-1500:]}", flush=True)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    merged: dict[str, list] = {}
    for name, result in shards:
        merged.setdefault(name, [])
        if os.path.exists(result):
            merged[name] += json.load(open(result))
            os.remove(result)  # one file per module comes back
    print(f"\n{time.monotonic() - start:.0f} s, {args.workers} workers")
    for name, results in merged.items():
        with open(os.path.join(args.out, f"{name}.json"), "w") as handle:
            json.dump(results, handle, indent=1)
        killed = sum(r["outcome"] in ("killed", "timeout") for r in results)
        print(f"{name}: {killed}/{len(results)} killed ({totals[name] - len(results)} of {totals[name]} not tested)")
        for r in results:
            if r["outcome"] not in ("killed", "timeout"):
                print(f"  {r['outcome']} #{r['id']} line {r['line']}: {' | '.join(r['diff'])[:300]}")


if __name__ == "__main__":
    main()
