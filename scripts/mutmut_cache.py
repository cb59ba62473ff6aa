"""What scripts/mutants.sh reads from and writes to mutmut 2.5.1's cache (``.mutmut-cache``, SQLite,
in the current directory), in one place instead of inline snippets.

    python mutmut_cache.py untested            how many mutants are untested
    python mutmut_cache.py first-untested      the id of the first of them
    python mutmut_cache.py retest-survivors    mark every survivor untested (a resumed run tests it again)
    python mutmut_cache.py skip ID             leave a mutant out (mutmut stalled on it twice)
    python mutmut_cache.py report MODULE       "total tested survived ids" over the module's lines as they are now
"""

from __future__ import annotations

import sqlite3
import sys

SURVIVED = ("bad_survived", "bad_timeout")


def main(argv: list[str]) -> str:
    db = sqlite3.connect(".mutmut-cache")
    command, *args = argv
    if command == "untested":
        return str(db.execute("select count(*) from Mutant where status = 'untested'").fetchone()[0])
    if command == "first-untested":
        return str(db.execute("select min(id) from Mutant where status = 'untested'").fetchone()[0])
    if command == "retest-survivors":
        db.execute("update Mutant set status = 'untested' where status like 'bad%'")
    elif command == "skip":
        db.execute("update Mutant set status = 'skipped' where id = ?", (int(args[0]),))
    elif command == "report":
        with open(args[0]) as handle:
            current = handle.read().split("\n")
        # a kept cache also holds mutants of lines since changed or moved (mutmut numbers lines from 0)
        rows = [(i, status) for i, status, number, text in db.execute(
            "select Mutant.id, status, line_number, Line.line from Mutant join Line on Mutant.line = Line.id")
            if number < len(current) and current[number] == text]
        tested = [i for i, status in rows if status == "ok_killed" or status in SURVIVED]
        bad = [str(i) for i, status in rows if status in SURVIVED]
        return f"{len(rows)} {len(tested)} {len(bad)} {','.join(bad) or '-'}"
    else:
        raise SystemExit(f"unknown command {command!r}; see {__file__}'s docstring")
    db.commit()
    return ""


if __name__ == "__main__":
    print(main(sys.argv[1:]))
