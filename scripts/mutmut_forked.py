"""Every mutant mutmut 2.5.1 makes of one module, each tested in a process forked from one that has
already imported torch and Triton: seconds per mutant where ``scripts/mutants.sh`` (a fresh
interpreter per mutant, through mutmut's runner) took about a minute on 2 shared cores. Mutants
are mutmut's own (its generator, in its venv); the tests run in the test venv, on a clone of the
committed tree (never the working tree). A mutant is killed when the tests fail (pytest exit 1),
cannot be collected (2), crash (a signal) or run past the time limit; it survives when they pass.

    # from the repository root; scripts/mutants.sh builds the mutmut venv
    .venvs/mutmut/bin/python scripts/mutmut_forked.py list k3_amd_overlay/commands/tune.py /tmp/tune.json
    VENV/bin/python scripts/mutmut_forked.py run CLONE k3_amd_overlay/commands/tune.py /tmp/tune.json RESULT.json \
        -- tests/test_tune_choice.py tests/test_launch_configs.py

K3OVL_MUTANTS_PRELOAD (module names, space-separated) imports more of the package once, in the parent;
the run refuses to start where one of them imported the mutated module. K3OVL_MUTANTS_ONLY="ID ..."
tests only those mutants (a survivor of another run, against more tests: a kill by either counts).
K3OVL_MUTANTS_TIME_LIMIT (seconds, default 120) bounds one mutant's tests. K3OVL_MUTANTS_COVERAGE
(a file written by ``cover``) runs each mutant against only the tests that execute its statement:
all of them where the statement runs at import or under no test (a subprocess may run it); a kill
is a kill either way, and a survivor can be tested again against every test. A mutants file ending in
.gz is read gzipped (``scripts/mutmut_shards.py`` carries them so). ``run`` prints one line per
survivor (its line and diff) and "MODULE: killed/total"; RESULT.json keeps every mutant's outcome,
rewritten after each mutant, so a run stopped midway keeps what it tested. The parent never imports
the package: each child imports the mutated module afresh.
"""

from __future__ import annotations

import difflib
import gzip
import json
import os
import signal
import sys
import time

TIME_LIMIT_S = int(os.environ.get("K3OVL_MUTANTS_TIME_LIMIT", "120"))  # seconds per mutant's tests


def list_mutants(path: str, out: str) -> None:
    from mutmut import Context, list_mutations, mutate

    with open(path) as handle:
        source = handle.read()
    lines = source.split("\n")
    mutants = []
    for mutation in list_mutations(Context(source=source, filename=path)):
        mutated, _ = mutate(Context(source=source, mutation_id=mutation, filename=path))
        diff = [line for line in difflib.unified_diff(lines, mutated.split("\n"), lineterm="", n=0)
                if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        mutants.append({"line": mutation.line_number + 1, "diff": diff, "source": mutated})
    with open(out, "w") as handle:
        json.dump({"module": path, "original": source, "mutants": mutants}, handle)
    print(f"{len(mutants)} mutants of {path}")


def cover(clone: str, module: str, out: str, pytest_args: list[str]) -> None:
    """Which tests execute each line of ``module`` (pytest-cov's per-test contexts, read back
    statement by statement): {line: [test ids]} for lines some test executes, "all" for lines only
    import executes; lines no test executes are left out."""
    from coverage import Coverage
    from coverage.parser import PythonParser

    path = os.path.join(clone, module)
    data_file = os.path.join(clone, ".coverage-mutants")
    os.environ["COVERAGE_FILE"] = data_file
    args = [f"--cov={os.path.dirname(path)}", "--cov-context=test", "--cov-report=", *pytest_args]
    code = _test_in_child(clone, args, os.path.join(clone, "cover-pytest.log"), stop_first=False,
                          limit=TIME_LIMIT_S * 10)
    if code != 0:
        raise SystemExit(f"the tests fail on the unmutated clone ({code}); see {clone}/cover-pytest.log")
    measured = Coverage(data_file=data_file)
    measured.load()
    data = measured.get_data()
    contexts = data.contexts_by_lineno(path)
    parser = PythonParser(filename=path)
    parser.parse_source()
    with open(path) as handle:
        count = len(handle.read().split("\n"))
    by_line: dict[int, object] = {}
    for line in range(1, count + 1):
        names = {c.removesuffix("|run").removesuffix("|setup").removesuffix("|teardown")
                 for c in contexts.get(parser.first_line(line), [])}
        tests = sorted(n for n in names if n)
        if tests:
            by_line[line] = tests
        elif names:
            by_line[line] = "all"
    with open(out, "w") as handle:
        json.dump({"module": module, "lines": by_line}, handle)
    print(f"{module}: {sum(v != 'all' for v in by_line.values())} lines with their tests, "
          f"{sum(v == 'all' for v in by_line.values())} executed at import only")


def _selected(coverage: dict | None, line: int, clone: str, pytest_args: list[str]) -> list[str]:
    """The pytest arguments for a mutant on ``line``: its statement's test functions where coverage
    names them (options kept), every test otherwise. Functions, not parametrized ids: a context's
    id can be spelled otherwise than pytest collects it (pytest versions differ on long or quoted
    string parameters), and an id pytest cannot find ends the run with exit 4 before any test,
    which must never pass for a kill."""
    tests = None if coverage is None else coverage.get(str(line))
    if not isinstance(tests, list):
        return pytest_args
    functions = list(dict.fromkeys(t.split("[", 1)[0] for t in tests))
    # In the order the plan lists their files (a module's own fast contract tests first), not
    # alphabetically: with -x a kill then costs seconds, not the slow subprocess tests before it.
    order = {f: i for i, f in enumerate(a for a in pytest_args if not a.startswith("-"))}
    functions.sort(key=lambda f: order.get(f.split("::", 1)[0], len(order)))
    return [a for a in pytest_args if a.startswith("-")] + [os.path.join(clone, t) for t in functions]


def _test_in_child(clone: str, pytest_args: list[str], log: str, stop_first: bool = True,
                   limit: float = TIME_LIMIT_S) -> int:
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setsid()
            os.chdir(clone)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest

            code = int(pytest.main([*(["-x"] if stop_first else []), "-q", "-p", "no:cacheprovider", *pytest_args]))
        finally:
            os._exit(code)
    deadline = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -999
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the tests left running
    except (ProcessLookupError, PermissionError):
        pass
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def run(clone: str, module: str, mutants_file: str, result_file: str, pytest_args: list[str]) -> None:
    sys.path.insert(0, clone)
    os.environ["PYTHONPATH"] = clone + os.pathsep + os.environ.get("PYTHONPATH", "")
    import importlib
    from importlib.metadata import entry_points

    import pytest  # noqa: F401  (the expensive imports, once, before any fork: torch, Triton, pytest's plugins)
    import torch  # noqa: F401
    import triton  # noqa: F401

    for plugin in entry_points(group="pytest11"):
        try:
            importlib.import_module(plugin.module)
        except Exception:  # a plugin that cannot load here fails in the child as it would anyway
            pass

    # K3OVL_MUTANTS_PRELOAD: more modules to import once (none may import the mutated one: checked)
    for name in os.environ.get("K3OVL_MUTANTS_PRELOAD", "").split():
        importlib.import_module(name)
    mutated_name = module.removesuffix(".py").replace("/", ".")
    if mutated_name in sys.modules:
        raise SystemExit(f"{mutated_name} was imported by a preloaded module: the children would not see the mutants")
    with (gzip.open(mutants_file, "rt") if mutants_file.endswith(".gz") else open(mutants_file)) as handle:
        data = json.load(handle)
    only = os.environ.get("K3OVL_MUTANTS_ONLY")  # "ID ID ..." (e.g. a run's survivors): those mutants only
    chosen = [int(i) for i in only.split()] if only else range(len(data["mutants"]))
    path = os.path.join(clone, module)
    with open(path) as handle:
        if handle.read() != data["original"]:
            raise SystemExit(f"{path} is not the file the mutants were made from")
    log = os.path.join(clone, "mutant-pytest.log")
    coverage = None
    if os.environ.get("K3OVL_MUTANTS_COVERAGE"):
        with open(os.environ["K3OVL_MUTANTS_COVERAGE"]) as handle:
            coverage = json.load(handle)["lines"]
    if coverage is None and _test_in_child(clone, pytest_args, log) != 0:  # ``cover`` ran them unmutated
        raise SystemExit(f"the tests fail on the unmutated clone; see {log}")
    results = []
    try:
        for i in chosen:
            mutant = data["mutants"][i]
            with open(path, "w") as handle:
                handle.write(mutant["source"])
            start = time.monotonic()
            code = _test_in_child(clone, _selected(coverage, mutant["line"], clone, pytest_args), log)
            outcome = ("survived" if code == 0 else "timeout" if code == -999
                       else "killed" if code in (1, 2) or code < 0 else f"error {code}")
            results.append({"id": i, "line": mutant["line"], "diff": mutant["diff"], "outcome": outcome,
                            "seconds": round(time.monotonic() - start, 1)})
            with open(result_file, "w") as handle:  # after each mutant: a run stopped midway keeps what it tested
                json.dump(results, handle, indent=1)
            if outcome != "killed":
                print(f"{outcome.upper():9} #{i} line {mutant['line']}: {' | '.join(mutant['diff'])[:400]}", flush=True)
    finally:
        with open(path, "w") as handle:
            handle.write(data["original"])
        with open(result_file, "w") as handle:
            json.dump(results, handle, indent=1)
    killed = sum(r["outcome"] in ("killed", "timeout") for r in results)
    print(f"{module}: {killed}/{len(results)} mutants killed "
          f"({sum(r['outcome'] == 'timeout' for r in results)} by the time limit)")


def main(argv: list[str]) -> None:
    if argv[:1] == ["list"]:
        list_mutants(argv[1], argv[2])
    elif argv[:1] == ["cover"]:
        split = argv.index("--")
        cover(*argv[1:split], argv[split + 1:])
    elif argv[:1] == ["run"]:
        split = argv.index("--")
        run(*argv[1:split], argv[split + 1:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
