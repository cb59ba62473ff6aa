"""One A/B run owns its ``--out`` directory: ``ab-serve`` and ``gsm8k-ab`` refuse a directory that
already holds anything, claim it with ``run.json`` (a fresh run id, written exclusively, so two
runs racing for one directory cannot both claim it), stamp each arm's folder with that id, and read
back only folders that carry it. A folder of another run (or of a version that wrote no id) is
never summarised: the summary, and ``ab-serve report DIR``, refuse the directory and name it.
``ab-serve`` compares only the arm folders it also marked measured (the run id again, written once
the arm's check still held after its benches), so an arm whose proof lapsed mid-run, or that never
finished, is left out, and the summary names it.

Why refuse rather than make a fresh run directory per invocation: the operator names ``--out`` and
then points ``ab-serve report`` and the census at it; a directory made behind their back would
leave the old results where they looked and the new ones elsewhere."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from k3_amd_overlay import json_files
from k3_amd_overlay.commands.usage import UsageError

RUN_FILE = "run.json"  # in --out: {"run_id", "tool", "started"}
RUN_ID_FILE = "run-id"  # in each arm's folder: the run id of the run that made it
MEASURED_FILE = "measured"  # in an ab-serve arm's folder: the run id, once the arm held its proof to the end


class ForeignResults(ValueError):
    """The directory holds results this run did not write (another run's, or a run without an id)."""


# What each A/B tool offers for an earlier run's directory, in the refusal of a used --out.
EARLIER_RUN = {"ab-serve": "re-summarise an earlier run with `k3-amd-overlay ab-serve report DIR`",
               "gsm8k-ab": "an earlier run's summary stays in its summary.md and summary.json"}


def check_unused(out: Path, tool: str) -> None:
    """``out`` may be written by a new run of ``tool``: absent, or an empty directory (checked before
    any server starts)."""
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file, not a directory")
        entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    except OSError as exc:
        raise UsageError(f"--out {out} cannot be read: {exc.strerror or exc}") from None
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UsageError(f"--out {out} is not empty ({shown}): a run reads back only what it wrote, so it "
                         f"needs a new or empty directory ({EARLIER_RUN[tool]})")


def claim(out: Path, tool: str) -> str:
    """Make ``out`` this run's: it must still be unused; ``run.json`` is created exclusively. The run
    id; UsageError where ``out`` is used or cannot be created (before any server starts)."""
    check_unused(out, tool)
    run_id = uuid.uuid4().hex
    record = {"run_id": run_id, "tool": tool,
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / RUN_FILE, "x") as handle:
            json.dump(record, handle)
    except FileExistsError:
        raise UsageError(f"--out {out}: another run claimed it first ({out / RUN_FILE})") from None
    except OSError as exc:
        raise UsageError(f"--out {out} cannot be created: {exc.strerror or exc}") from None
    return run_id


def stamp(workdir: Path, run_id: str) -> None:
    """Create an arm's folder for this run (it must not exist yet) and write the run id into it."""
    workdir.mkdir(parents=True)
    (workdir / RUN_ID_FILE).write_text(run_id + "\n")


def mark_measured(workdir: Path, run_id: str) -> None:
    """The arm in ``workdir`` finished its measurement and its check still held after it."""
    (workdir / MEASURED_FILE).write_text(run_id + "\n")


def measured(folder: Path, run_id: str) -> bool:
    """Whether ``folder`` is marked measured by run ``run_id``."""
    return _id_in(folder / MEASURED_FILE) == run_id


def _id_in(path: Path) -> str | None:
    """The run id written in ``path``; None where it is not a regular UTF-8 file (never blocks on a FIFO)."""
    try:
        return json_files.read_regular(path).strip()
    except (OSError, ValueError):
        return None


def read_json(path: Path) -> Any:
    """A record a run wrote: ``path``'s JSON; FileNotFoundError where there is no such file,
    ForeignResults where it cannot be read as JSON (a FIFO or a folder is not read: json_files)."""
    try:
        return json_files.load(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise ForeignResults(f"{path} is unreadable ({exc})") from None


def run_id_of(out: Path, tool: str) -> str:
    """The run id in ``out/run.json``, written by ``tool``; ForeignResults where there is none."""
    path = out / RUN_FILE
    try:
        record = read_json(path)
    except FileNotFoundError:
        raise ForeignResults(f"{path} not found: {out} is not one {tool} run (a run of this version writes it), "
                             "so its results cannot be told apart from another run's") from None
    if not isinstance(record, dict) or record.get("tool") != tool or not isinstance(record.get("run_id"), str):
        raise ForeignResults(f"{path} is not a {tool} run record: {record!r}")
    return record["run_id"]


def check_owned(folders: Iterable[Path], run_id: str) -> None:
    """Every folder carries ``run_id``; ForeignResults names those that do not."""
    foreign = []
    for folder in folders:
        found = _id_in(folder / RUN_ID_FILE)
        if found != run_id:
            foreign.append(f"{folder.name} ({'no run id' if found is None else 'run ' + found})")
    if foreign:
        raise ForeignResults(f"results not written by run {run_id}: {', '.join(foreign)}; a summary never mixes "
                             "runs: move them out, or give each run its own --out")
