"""One A/B run owns its ``--out`` directory: ``ab-serve`` and ``gsm8k-ab`` refuse a directory that
already holds anything, claim it with ``run.json`` (a fresh run id, written exclusively, so two
runs racing for one directory cannot both claim it), stamp each arm's folder with that id, and read
back only folders that carry it. A folder of another run (or of a version that wrote no id) is
never summarised: the summary, and ``ab-serve report DIR``, refuse the directory and name it.

Why refuse rather than make a fresh run directory per invocation: the operator names ``--out`` and
then points ``ab-serve report`` and the census at it; a directory made behind their back would
leave the old results where they looked and the new ones elsewhere."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterable
from pathlib import Path

from k3_amd_overlay.commands.usage import UsageError

RUN_FILE = "run.json"  # in --out: {"run_id", "tool", "started"}
RUN_ID_FILE = "run-id"  # in each arm's folder: the run id of the run that made it


class ForeignResults(ValueError):
    """The directory holds results this run did not write (another run's, or a run without an id)."""


def check_unused(out: Path) -> None:
    """``out`` may be written by a new run: absent, or an empty directory (checked before any server starts)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise UsageError(f"--out {out} is not empty ({shown}): a run reads back only what it wrote, so it "
                             "needs a new or empty directory (re-summarise an earlier run with its own report)")


def claim(out: Path, tool: str) -> str:
    """Make ``out`` this run's: it must still be unused; ``run.json`` is created exclusively. The run id."""
    check_unused(out)
    out.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex
    record = {"run_id": run_id, "tool": tool,
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        with open(out / RUN_FILE, "x") as handle:
            json.dump(record, handle)
    except FileExistsError:
        raise UsageError(f"--out {out}: another run claimed it first ({out / RUN_FILE})") from None
    return run_id


def stamp(workdir: Path, run_id: str) -> None:
    """Create an arm's folder for this run (it must not exist yet) and write the run id into it."""
    workdir.mkdir(parents=True)
    (workdir / RUN_ID_FILE).write_text(run_id + "\n")


def run_id_of(out: Path, tool: str) -> str:
    """The run id in ``out/run.json``, written by ``tool``; ForeignResults where there is none."""
    path = out / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ForeignResults(f"{path} not found: {out} is not one {tool} run (a run of this version writes it), "
                             "so its results cannot be told apart from another run's") from None
    except (OSError, ValueError) as exc:
        raise ForeignResults(f"{path} is unreadable ({exc})") from None
    if not isinstance(record, dict) or record.get("tool") != tool or not isinstance(record.get("run_id"), str):
        raise ForeignResults(f"{path} is not a {tool} run record: {record!r}")
    return record["run_id"]


def check_owned(folders: Iterable[Path], run_id: str) -> None:
    """Every folder carries ``run_id``; ForeignResults names those that do not."""
    foreign = []
    for folder in folders:
        try:
            found = (folder / RUN_ID_FILE).read_text().strip()
        except OSError:
            found = None
        if found != run_id:
            foreign.append(f"{folder.name} ({'no run id' if found is None else 'run ' + found})")
    if foreign:
        raise ForeignResults(f"results not written by run {run_id}: {', '.join(foreign)}; a summary never mixes "
                             "runs: move them out, or give each run its own --out")
