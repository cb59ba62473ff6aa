"""The evidence record of one vLLM process, typed: what ``evidence.py`` keeps and writes as the
marker file, and what ``verdict.py`` and the ``check`` command read back. The marker's JSON keys
are these field names (schema 2)."""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass, field, fields
from typing import Any

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
    def from_json(cls, data: dict[str, Any]) -> FusionEntry:
        try:
            return cls(
                state=FusionState(data["state"]),
                provider=data.get("provider"),
                reason=str(data.get("reason", "")),
                layers=int(data.get("layers", 0)),
                layer_states={FusionState(s): LayerTally(int(t["layers"]), str(t.get("reason", "")))
                              for s, t in (data.get("layer_states") or {}).items()},
                effective=bool(data.get("effective", False)),
                effective_layers=int(data.get("effective_layers", 0)),
                runs={**_no_runs(), **{Phase(p): int(n) for p, n in (data.get("runs") or {}).items()}},
                captured_sizes=[int(n) for n in data.get("captured_sizes", [])],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(f"fusion entry {data!r}: {exc}") from None


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
            raise RecordError(f"not a JSON object: {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        if data.get("schema", SCHEMA) != SCHEMA:
            raise RecordError(f"marker schema {data['schema']!r}; this k3-amd-overlay reads schema {SCHEMA} "
                              "(another version of the overlay wrote it)")
        for name, kinds in _FIELD_KINDS.items():
            if name in data and not isinstance(data[name], kinds):
                raise RecordError(f"marker field {name!r} is {data[name]!r}, expected "
                                  + " or ".join(_KIND_WORDS[k] for k in kinds))
        try:
            values = {k: v for k, v in data.items() if k in known}
            values["pid"] = int(data["pid"])
            values["mode"] = Mode(data["mode"])
            values["fusions"] = {str(n): FusionEntry.from_json(e) for n, e in (data.get("fusions") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, RecordError):
                raise
            raise RecordError(f"marker field {exc}") from None
        return cls(**values)


# The JSON kind of each record field read as it is (bool is an int in Python: strict is checked
# as a bool, and no count field takes one).
_FIELD_KINDS: dict[str, tuple[type, ...]] = {
    "start_ticks": (int, type(None)), "role": (str,), "process_name": (str,), "host": (str,),
    "overlay_version": (str,), "vllm_version": (str, type(None)), "switch": (str,), "strict": (bool,),
    "vllm_shape": (str, type(None)), "patches": (list,), "upstream_defects": (list,), "coverage": (dict,),
    "launch_configs": (dict,), "measurement": (dict,), "updated": (int, float), "fusions": (dict, type(None)),
}
_KIND_WORDS = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "an object",
               float: "a number", type(None): "null"}
