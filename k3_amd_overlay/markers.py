"""Per-process evidence markers on disk: the directory (per user, 0700, no symlinks, owned by
this user), atomic writes, reading them back, and telling live processes from stale files and
from foreign ones (a file that is not the marker its writer would have left: another name than
``<pid>.json``, or another owner than the process it names)."""

from __future__ import annotations

import functools
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from k3_amd_overlay import json_files
from k3_amd_overlay.record import MarkerRecord, RecordError, is_pid

MARKER_SUFFIX = ".json"


class MarkerDirError(RuntimeError):
    """The marker directory is unsafe to use (a symlink, foreign-owned, group/world writable)."""


def default_marker_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "k3-amd-overlay"
    return Path(tempfile.gettempdir()) / f"k3-amd-overlay-{os.getuid()}"


def ensure_marker_dir(path: str | os.PathLike[str] | None) -> Path:
    """Create (0700) or validate the marker directory; raise MarkerDirError naming the problem."""
    directory = Path(path) if path else default_marker_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # something that is no directory: _refusal says what
    except OSError as exc:
        raise MarkerDirError(f"cannot create marker directory {directory}: {exc}") from exc
    refusal = _refusal(directory, os.lstat(directory))
    if refusal:
        raise MarkerDirError(refusal)
    return directory


def marker_dir_refusal(path: str | os.PathLike[str] | None) -> str | None:
    """Why ``ensure_marker_dir(path)`` would refuse the directory, so that a vLLM process writes no marker
    there; None where it is usable, or missing and would be created so. Creates nothing."""
    directory = Path(path) if path else default_marker_dir()
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return _uncreatable(directory)
    except OSError as exc:  # a part of the path is no directory, or cannot be searched
        return f"cannot create marker directory {directory}: {exc.strerror or exc}"
    return _refusal(directory, info)


def _uncreatable(directory: Path) -> str | None:
    """Why the missing ``directory`` could not be made (with its missing parents), or None."""
    parent = directory.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not os.path.isdir(parent):
        return f"cannot create marker directory {directory}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create marker directory {directory}: {parent} is not writable by this user"
    return None


def forgeable(directory: Path) -> str | None:
    """Why markers read from ``directory`` could have been written by someone else than a process of
    this overlay run by this user: it is a symlink, writable by group or others, or (for a checker that
    is not root) owned by another user, so ``ensure_marker_dir`` refuses it for this user's processes
    and another user could have put anything there; None otherwise, and where it does not exist.
    Root may read another owner's directory (it checks the markers of the user vLLM runs as): each
    marker's own owner is then checked against its process's (``read_markers``)."""
    try:
        info = os.lstat(directory)
    except OSError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return _a_symlink(directory)
    if not stat.S_ISDIR(info.st_mode):
        return None
    if info.st_mode & 0o022:  # the reason that decided it, whoever owns it
        return _writable(directory, info)
    if os.getuid() != 0 and info.st_uid != os.getuid():
        return _owned_by_another(directory, info)
    return None


def _a_symlink(directory: Path) -> str:
    return f"marker directory {directory} is a symlink; refusing to follow it"


def _writable(directory: Path, info: os.stat_result) -> str:
    return (f"marker directory {directory} is writable by group or others "
            f"(mode {stat.S_IMODE(info.st_mode):o}); chmod 700 it")


def _owned_by_another(directory: Path, info: os.stat_result) -> str:
    return (f"marker directory {directory} is owned by uid {info.st_uid}, not this user "
            f"({os.getuid()}); set K3_AMD_OVERLAY_MARKER_DIR to a directory you own")


def _refusal(directory: Path, info: os.stat_result) -> str | None:
    """Why the existing ``directory`` (``info``: its lstat) is unsafe as the marker directory, or None."""
    if stat.S_ISLNK(info.st_mode):
        return _a_symlink(directory)
    if not stat.S_ISDIR(info.st_mode):
        return f"marker directory {directory} is not a directory"
    if info.st_uid != os.getuid():
        return _owned_by_another(directory, info)
    if info.st_mode & 0o022:
        return _writable(directory, info)
    return None


def marker_path(directory: Path, pid: int) -> Path:
    """The one name the marker of ``pid`` has (``<pid>.json``): the writer gives no other, and a reader
    trusts no other."""
    return directory / f"{pid}{MARKER_SUFFIX}"


def write_marker(directory: Path, pid: int, record: dict[str, Any]) -> Path:
    """Atomically replace ``<pid>.json``: readers see the old record or the new, never half."""
    target = marker_path(directory, pid)
    json_files.replace_atomically(target, json.dumps(record, sort_keys=True), f".{pid}.")
    return target


def void_marker(directory: Path, pid: int) -> str:
    """After a failed write of the marker of ``pid``: make its last contents unreadable, so that no
    reader trusts a record the process has moved on from; say what became of it. Emptied in place
    where it can be (truncating frees its blocks, so it works on a full disk, and an empty marker of a
    live process fails ``check``), else removed (``check`` then no longer sees the process)."""
    path = marker_path(directory, pid)
    try:
        os.truncate(path, 0)
        return f"its last marker {path} emptied, so `check` fails on this process until a write succeeds"
    except FileNotFoundError:
        return "it had no marker yet"
    except OSError:
        pass
    try:
        path.unlink()
        return f"its last marker {path} removed, so `check` no longer sees this process"
    except FileNotFoundError:
        return "it had no marker yet"
    except OSError as exc:
        return f"its last marker {path} could be neither emptied nor removed ({exc.strerror or exc}): it is stale"


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(fields: list[str] | None) -> int | None:
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (Linux), to tell pid reuse apart."""
    return _start_ticks(_proc_stat(pid))


# A zombie (exited, not yet reaped: under a PID 1 that never reaps, for ever) or a dead task still
# answers ``kill(pid, 0)`` and keeps its start time, but runs nothing.
DEAD_STATES = ("Z", "X", "x")


def is_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether ``pid`` is the running process that wrote a record with ``start_ticks``. Where this host
    shows the start time of ``pid``, a record without one proves nothing about which process it was
    (the pid may have been reused since) and is not alive; ``is_running`` asks only about the pid."""
    fields = _running_stat(pid)
    if fields is False:
        return False
    # The same read of /proc gives the state and the start time, so they agree.
    return _start_ticks(fields) == start_ticks if fields else start_ticks is None


def is_running(pid: int) -> bool:
    """Whether some process runs as ``pid`` now (whatever its start time)."""
    return _running_stat(pid) is not False


def _running_stat(pid: int) -> list[str] | Literal[False] | None:
    """False where no process runs as ``pid``; else its /proc stat fields, or None where there are none."""
    if pid < 1:  # kill() takes 0 and negative ids as process groups, which always answer
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields and fields[0] in DEAD_STATES:
        return False
    return fields


BOOT_ID = "/proc/sys/kernel/random/boot_id"  # Linux: a fresh id at each boot, one per host (not per container)


@functools.cache
def boot_id() -> str | None:
    """This host's boot id, or None where it cannot be read (read once: a process lives in one boot)."""
    try:
        with open(BOOT_ID) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def of_another_boot(record: MarkerRecord) -> bool:
    """Whether ``record`` was written before this host last booted: its pid and start time then named
    a process of that boot, not of this one. A record or a host without a boot id cannot tell."""
    now = boot_id()
    return record.boot_id is not None and now is not None and record.boot_id != now


def process_uid(pid: int) -> int | None:
    """The uid owning ``/proc/<pid>`` (the user the process runs as), or None where it cannot be read."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class MarkerFile:
    path: Path
    record: MarkerRecord | None
    error: str | None
    live: bool
    foreign: str | None = None  # why the file is not the marker of the process it names: it proves nothing


def _named_pid(path: Path) -> int | None:
    """The pid a marker's file name gives (``<pid>.json``), or None."""
    stem = path.stem
    return int(stem) if stem.isascii() and stem.isdigit() and is_pid(int(stem)) else None


def unreadable_of_live_processes(found: list[MarkerFile]) -> list[tuple[MarkerFile, int]]:
    """The unreadable markers named for a process running here (``<pid>.json``), with that pid: what such a
    process ran is unknown, so no verdict on this machine's processes can hold beside it."""
    named = [(m, _named_pid(m.path)) for m in found if m.error]
    return [(m, pid) for m, pid in named if pid is not None and is_running(pid)]


def foreign_of_live_processes(found: list[MarkerFile], host: str) -> list[tuple[MarkerFile, int]]:
    """The foreign markers that name a process running on ``host`` (this one), by their record or by their
    file name, with that pid: a file no writer of that process left sits where its evidence is read."""
    hits = []
    for marker in found:
        if not marker.foreign or marker.record is None or marker.record.host != host:
            continue
        pids = dict.fromkeys(p for p in (marker.record.pid, _named_pid(marker.path)) if p is not None)
        hits += [(marker, pid) for pid in pids if is_running(pid)]
    return hits


def marker_paths(directory: Path) -> list[Path]:
    """The entries of ``directory`` named as markers (``*.json``), sorted (none where it is gone);
    MarkerDirError naming the directory where it cannot be listed (``Path.glob`` would list nothing,
    and a check would read that as no process at all)."""
    try:
        with os.scandir(directory) as entries:
            names = [e.name for e in entries if e.name.endswith(MARKER_SUFFIX)]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise MarkerDirError(f"cannot read marker directory {directory}: {exc.strerror or exc}") from None
    return sorted(directory / name for name in names)


def _foreign(path: Path, record: MarkerRecord, live: bool) -> str | None:
    """Why the file at ``path`` holding ``record`` is not the marker of the process it names (None where
    it may be): another name than its writer gives it (a copy would count that process twice), or, where
    that process runs, another owner than the user it runs as (another user wrote it)."""
    expected = marker_path(path.parent, record.pid).name
    if path.name != expected:
        return (f"named {path.name}, but the marker of pid {record.pid} is named {expected}: a copy or a file "
                "written by hand, not that process's marker")
    if not live:
        return None  # stale: ignored as such, and its process cannot be asked
    try:
        owner = os.stat(path).st_uid
    except OSError as exc:
        return f"its owner cannot be read ({exc.strerror or exc})"
    runs_as = process_uid(record.pid)
    if runs_as is None:
        return f"the user pid {record.pid} runs as cannot be read from /proc/{record.pid}"
    if owner != runs_as:
        return f"owned by uid {owner}, but pid {record.pid} runs as uid {runs_as}: another user wrote it"
    return None


def _unreadable(path: Path, exc: Exception) -> str:
    if isinstance(exc, ValueError) and _is_empty(path):
        return ("unreadable marker: empty (its process emptied it when a write failed: a full disk? its "
                "warning says why)")
    return f"unreadable marker: {exc}"


def _is_empty(path: Path) -> bool:
    try:
        return os.stat(path).st_size == 0
    except OSError:
        return False


def read_markers(directory: Path) -> list[MarkerFile]:
    """Every marker in ``directory``, read: those that cannot be (not JSON, not a record, not a
    regular file) with their error, and those that are not the marker of the process they name
    (``_foreign``) with why. MarkerDirError where the directory cannot be listed."""
    found = []
    for path in marker_paths(directory):
        try:
            record = MarkerRecord.from_json(json_files.load(path))
        except (OSError, ValueError, RecordError) as exc:
            found.append(MarkerFile(path, None, _unreadable(path, exc), False))
            continue
        live = is_alive(record.pid, record.start_ticks) and not of_another_boot(record)
        found.append(MarkerFile(path, record, None, live, _foreign(path, record, live)))
    return found
