"""The evidence record of one vLLM process, typed: what ``evidence.py`` keeps and writes as the
marker file, and what ``verdict.py`` and the ``check`` command read back. The marker's JSON keys
are these field names (schema 2)."""

from __future__ import annotations

import enum
import reprlib
import socket
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from k3_amd_overlay import json_values
from k3_amd_overlay.fusions.states import FUSED_STATES, FusionState
from k3_amd_overlay.phases import Phase
from k3_amd_overlay.settings import Mode

SCHEMA = 2


class RecordError(ValueError):
    """A marker whose content is not an evidence record; the message says which field is wrong."""


@dataclass
class LayerTally:
    """How many K3 MLA layers decided one way, with the latest such layer's reason."""

    layers: int = 0
    reason: str = ""


def _no_runs() -> dict[Phase, int]:
    return dict.fromkeys(Phase, 0)


@dataclass
class FusionEntry:
    """One fusion in one process: its state, provider and reason, how its layers were decided, and
    where its fused path ran (batches by phase, the CUDA/HIP-graph sizes it was captured in)."""

    state: FusionState
    provider: str | None = None
    reason: str = ""
    layers: int = 0
    layer_states: dict[FusionState, LayerTally] = field(default_factory=dict)
    effective: bool = False
    effective_layers: int = 0
    runs: dict[Phase, int] = field(default_factory=_no_runs)
    captured_sizes: list[int] = field(default_factory=list)

    @property
    def fused(self) -> bool:
        return self.state in FUSED_STATES

    @property
    def ran(self) -> bool:
        """Whether its fused path has run at all in this process (any phase)."""
        return self.effective or any(self.runs.values())

    def mixed(self) -> str | None:
        """How its layers split, where some took the fused path and some did not (else None)."""
        fused = [s for s in self.layer_states if s in FUSED_STATES]
        if not fused or len(fused) == len(self.layer_states):
            return None
        total = sum(t.layers for t in self.layer_states.values())
        return ", ".join(f"{s.value} on {t.layers}/{total} ({t.reason})" for s, t in self.layer_states.items())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        data["layer_states"] = {s.value: asdict(t) for s, t in self.layer_states.items()}
        data["runs"] = {p.value: n for p, n in self.runs.items()}
        return data

    @classmethod
    def from_json(cls, data: Any, name: str = "?") -> FusionEntry:
        """The entry a marker holds for the fusion ``name``; RecordError naming the fusion, the field and
        what it holds (or that it is missing) and what is allowed, where a field is not of its kind (a
        state that is none, a count that is not a whole number >= 0, a flag that is not true or false):
        such evidence proves nothing."""
        if not isinstance(data, dict):
            raise RecordError(f"fusion {name!r} is {json_values.kind(data)}, expected an object (state, provider, "
                              "reason, ...)")
        try:
            provider, reason = data.get("provider"), data.get("reason", "")
            if not isinstance(provider, (str, type(None))) or not isinstance(reason, str):
                raise RecordError(f"'provider' {_said(provider)} and 'reason' {_said(reason)}: expected a string "
                                  "(provider: or null)")
            effective = data.get("effective", False)
            if not isinstance(effective, bool):
                raise RecordError(f"'effective' is {_said(effective)}, expected true or false")
            sizes = data.get("captured_sizes", [])
            if not isinstance(sizes, list):
                raise RecordError(f"'captured_sizes' is {_said(sizes)}, expected a list of graph sizes")
            tallies = _mapping(data, "layer_states", "state: {layers, reason}")
            return cls(
                state=_member(FusionState, data.get("state", MISSING), "state"),
                provider=provider,
                reason=reason,
                layers=_count(data.get("layers", 0), "layers"),
                layer_states={_member(FusionState, s, "layer_states", key=True): _tally(t, f"layer_states.{s}")
                              for s, t in tallies.items()},
                effective=effective,
                effective_layers=_count(data.get("effective_layers", 0), "effective_layers"),
                runs={**_no_runs(), **{_member(Phase, p, "runs", key=True): _count(n, f"runs.{p}")
                                       for p, n in _mapping(data, "runs", "phase: count").items()}},
                captured_sizes=[_count(n, "captured_sizes") for n in sizes],
            )
        except RecordError as exc:
            raise RecordError(f"fusion {name!r}: {exc}") from None


MISSING: Any = object()  # a field the JSON object does not hold


def _said(value: Any) -> str:
    """A value read from a marker as an error names it: ``missing``, or its repr cut short (a marker
    written by hand may hold anything, at any length)."""
    return "missing" if value is MISSING else reprlib.repr(value)


def _member(kind: type[enum.Enum], value: Any, field_name: str, key: bool = False) -> Any:
    """``value`` as a member of the enum ``kind`` (a state, a phase, a mode); RecordError naming the field,
    the value (as a key of that field's object where ``key``) and the values allowed."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        said = f"has a key {_said(value)}" if key else f"is {_said(value)}"
        raise RecordError(f"{field_name!r} {said}; allowed: {allowed}") from None


def _mapping(data: dict[str, Any], field_name: str, shape: str) -> dict[str, Any]:
    """The object ``data[field_name]`` holds (missing or null: empty); RecordError saying its shape otherwise."""
    value = data.get(field_name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RecordError(f"{field_name!r} is {_said(value)}, expected an object of {shape}")
    return value


def _tally(value: Any, field_name: str) -> LayerTally:
    """One ``layer_states`` entry: an object of ``layers`` (a whole number >= 0) and ``reason``."""
    if not isinstance(value, dict):
        raise RecordError(f"{field_name!r} is {_said(value)}, expected an object of layers and reason")
    return LayerTally(_count(value.get("layers", MISSING), f"{field_name}.layers"), str(value.get("reason", "")))


def _count(value: Any, name: str, least: int = 0) -> int:
    """A whole number >= ``least`` as the marker holds it (not a bool, a float or a string)."""
    number = json_values.whole(value, least)
    if number is None:
        raise RecordError(f"{name!r} is {_said(value)}, expected a whole number >= {least}")
    return number


@dataclass
class MarkerRecord:
    """What one process proves about itself."""

    pid: int
    mode: Mode
    fusions: dict[str, FusionEntry]
    schema: int = SCHEMA
    start_ticks: int | None = None
    role: str = "main"
    process_name: str = ""
    # The machine the process runs on: its pid and start time mean something only there. A record
    # without one (an older writer) is read as this machine's.
    host: str = field(default_factory=socket.gethostname)
    # This host's boot (the kernel's boot id): a pid and start time name a process only within one boot.
    boot_id: str | None = None
    # Where a process that built layers sits in vLLM's distributed world (vllm_env.world_position): its
    # global rank, the world's size (TP x PP x DP) and vLLM's node count, so that a check misses no rank.
    rank: int | None = None
    world_size: int | None = None
    nodes: int | None = None
    overlay_version: str = ""
    vllm_version: str | None = None
    switch: str = ""
    strict: bool = True
    vllm_shape: str | None = None
    patches: list[str] = field(default_factory=list)
    upstream_defects: list[dict[str, Any]] = field(default_factory=list)
    coverage: dict[str, Any] = field(default_factory=dict)
    launch_configs: dict[str, Any] = field(default_factory=dict)  # arch, device, each kernel's config file
    # This GPU's self-measurement (measured.marker_entry): its file and state (used, ignored with the error,
    # none), date, and per fusion the buckets it may run in and every reason stock runs elsewhere.
    measurement: dict[str, Any] = field(default_factory=dict)
    updated: float = 0.0

    def builds_layers(self) -> bool:
        """Whether this process built any K3 MLA layer (an API server never does)."""
        return any(e.layers > 0 for e in self.fusions.values())

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["mode"] = self.mode.value
        data["fusions"] = {name: entry.to_json() for name, entry in self.fusions.items()}
        return data

    @classmethod
    def from_json(cls, data: Any) -> MarkerRecord:
        """The record a marker file holds; RecordError naming what is missing or wrong."""
        if not isinstance(data, dict):
            raise RecordError(f"a record is a JSON object (pid, mode, fusions, ...), not {json_values.kind(data)}")
        known = {f.name for f in fields(cls)}
        if data.get("schema", SCHEMA) != SCHEMA:
            raise RecordError(f"marker schema {data['schema']!r}; this k3-amd-overlay reads schema {SCHEMA} "
                              "(another version of the overlay wrote it)")
        for name, kinds in _FIELD_KINDS.items():
            if name in data and not isinstance(data[name], kinds):
                raise RecordError(f"marker field {name!r} is {data[name]!r}, expected "
                                  + " or ".join(_KIND_WORDS[k] for k in kinds))
        ticks, updated = data.get("start_ticks"), data.get("updated", 0.0)
        if ticks is not None:
            _count(ticks, "start_ticks")
        check_world(data.get("rank", MISSING), data.get("world_size", MISSING), data.get("nodes"))
        if json_values.finite(updated) is None:
            raise RecordError(f"marker field 'updated' is {updated!r}, expected a finite time in seconds")
        values = {k: v for k, v in data.items() if k in known}
        values["pid"] = _pid(data.get("pid", MISSING))
        try:
            values["mode"] = _member(Mode, data.get("mode", MISSING), "mode")
        except RecordError as exc:
            raise RecordError(f"marker field {exc}") from None
        values["fusions"] = {str(n): FusionEntry.from_json(e, str(n)) for n, e in (data.get("fusions") or {}).items()}
        return cls(**values)


def check_world(rank: Any, size: Any, nodes: Any) -> None:
    """RecordError unless the world fields are all null, or a rank within a world of 1 or more
    (and a node count of 1 or more, or null)."""
    absent = (None, MISSING)
    if rank in absent and size in absent and nodes is None:
        return
    if rank in absent or size in absent:
        said = ["null" if v is None else _said(v) for v in (rank, size)]
        raise RecordError(f"marker fields 'rank' ({said[0]}) and 'world_size' ({said[1]}): both null, or a rank 0 "
                          "to world_size - 1 of a world of 1 or more")
    if _count(size, "world_size", 1) > MAX_WORLD:
        raise RecordError(f"marker field 'world_size' is {size!r}, expected at most {MAX_WORLD}")
    if _count(rank, "rank") >= size:
        raise RecordError(f"marker field 'rank' is {rank!r}, expected 0 to world_size - 1 ({size - 1})")
    if nodes is not None:
        _count(nodes, "nodes", 1)


def is_pid(value: object) -> bool:
    """Whether ``value`` is a process id as the kernel gives one: 0 and negative ids name process groups
    to ``kill``, and pid_t holds no more than ``MAX_PID``."""
    number = json_values.whole(value, 1)
    return number is not None and number <= MAX_PID


def _pid(value: Any) -> int:
    if not is_pid(value):
        raise RecordError(f"marker field 'pid' is {_said(value)}, expected a process id (1-{MAX_PID})")
    return value


MAX_PID = 2**31 - 1  # pid_t's largest
MAX_WORLD = 2**20  # more ranks than any deployment has: a check lists the ranks of a world one by one
# The JSON kind of each record field read as it is (bool is an int in Python: strict is checked
# as a bool, and no count field takes one); rank, world_size and nodes are check_world's.
_FIELD_KINDS: dict[str, tuple[type, ...]] = {
    "start_ticks": (int, type(None)), "boot_id": (str, type(None)), "role": (str,), "process_name": (str,),
    "host": (str,),
    "overlay_version": (str,), "vllm_version": (str, type(None)), "switch": (str,), "strict": (bool,),
    "vllm_shape": (str, type(None)), "patches": (list,), "upstream_defects": (list,), "coverage": (dict,),
    "launch_configs": (dict,), "measurement": (dict,), "updated": (int, float), "fusions": (dict, type(None)),
}
_KIND_WORDS = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "an object",
               float: "a number", type(None): "null"}
