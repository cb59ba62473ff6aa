"""mutmut's test command for one mutant (used by scripts/mutants.sh, not by the package).

mutmut 2.5.1 writes a mutant into the module, then runs this. It finds the lines the mutant
changed (``git diff`` against the clone's HEAD), runs first only the tests that executed those
lines (a pytest-cov map with one context per test, built on the unmutated clone; for a line run
only at import, the module's first test file), and, if they all pass, every test of the module:
a mutant is reported alive only after the whole set passed, so the map only saves time, never
decides. pytest's output goes to a log file, never to mutmut's terminal: mutmut reads the
terminal until every process holding it has closed it, and a process left behind by a test
(vLLM starts some) made it wait forever.

    python mutant_runner.py MODULE COVERAGE_FILE LOG -- TEST_FILE...
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", re.MULTILINE)
PR_SET_PDEATHSIG = 1
TESTS_FAILED = 1  # pytest's exit code for failed tests: the only one mutmut 2.5.1 counts as a kill
COLLECTION_FAILED = 2  # pytest's exit code when a test module cannot even be imported


def changed_lines(module: str) -> set[int]:
    diff = subprocess.run(["git", "diff", "-U0", "--", module], capture_output=True, text=True,
                          check=True).stdout
    lines: set[int] = set()
    for start, count in HUNK.findall(diff):
        first, n = int(start), int(count or 1)
        lines.update(range(first, first + max(n, 1)))
    return lines


def covering_tests(coverage_file: str, module: str, lines: set[int], test_files: list[str]) -> list[str]:
    import coverage

    data = coverage.CoverageData(basename=coverage_file)
    data.read()
    by_line = data.contexts_by_lineno(str(Path(module).resolve())) or {}
    wanted = {os.path.relpath(t) for t in test_files}
    ids: set[str] = set()
    for line in lines:
        for context in by_line.get(line, []):
            # a test's parameters are left out: pytest cannot parse every parameter id back
            node = context.rsplit("|", 1)[0].split("[", 1)[0]
            if node and node.split("::", 1)[0] in wanted:
                ids.add(node)
    return sorted(ids)


def _die_with_parent() -> None:
    # mutmut kills this runner (not its children) when a mutant runs past its time limit.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def pytest(args: list[str], log: str) -> int:
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                 *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
        code = proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the tests left running
    except ProcessLookupError:
        pass
    # The mutant crashed the tests (a bad shape can take down Triton's interpreter) or broke an
    # import: the tests caught it, though mutmut 2.5.1 would count it alive.
    return TESTS_FAILED if code < 0 or code == COLLECTION_FAILED else code


def main(argv: list[str]) -> int:
    split = argv.index("--")
    module, coverage_file, log = argv[:split]
    test_files = argv[split + 1:]
    lines = changed_lines(module)
    if lines:
        # a line run only at import has no test context: the module's first test file goes first
        first = covering_tests(coverage_file, module, lines, test_files) or test_files[:1]
        if pytest(first, log) == TESTS_FAILED:
            return TESTS_FAILED
    return pytest(test_files, log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
