"""The mutants mutmut 2.5.1 leaves untested, applied one at a time: its cache keys a mutant by the
text of its line, so a mutant on a line whose text repeats in the file (a lone ``)``, a decorator)
can stay "untested" after a complete run. Each such mutant (mutmut's own generator) is written to
the file, COMMAND runs, the file is restored; exit status other than 0 is a kill.
Run with mutmut's venv (scripts/mutants.sh builds it), from the repository root:

    .venvs/mutmut/bin/python scripts/mutmut_repeated_lines.py k3_amd_overlay/MODULE.py "COMMAND"
"""

from __future__ import annotations

import difflib
import subprocess
import sys

from mutmut import Context, list_mutations, mutate


def main() -> None:
    path, command = sys.argv[1], sys.argv[2]
    with open(path) as handle:
        source = handle.read()
    lines = source.split("\n")
    repeated = [m for m in list_mutations(Context(source=source, filename=path)) if lines.count(m.line) > 1]
    print(f"{len(repeated)} mutants on repeated lines of {path}")
    killed = 0
    for mutation in repeated:
        mutated, _ = mutate(Context(source=source, mutation_id=mutation, filename=path))
        diff = [line for line in difflib.unified_diff(lines, mutated.split("\n"), lineterm="", n=0)
                if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        try:
            with open(path, "w") as handle:
                handle.write(mutated)
            returncode = subprocess.run(command, shell=True, capture_output=True).returncode
        finally:
            with open(path, "w") as handle:
                handle.write(source)
        killed += returncode != 0
        print("killed  " if returncode != 0 else "SURVIVED", mutation.line_number, " | ".join(diff)[:300])
    print(f"{killed}/{len(repeated)} killed")


if __name__ == "__main__":
    main()
