"""Judging marker contents (JSON, as a marker file holds them) the way ``check`` does: read into
the typed record first. For tests that build records by hand or read marker files."""

from __future__ import annotations

from typing import Any

from k3_amd_overlay import markers
from k3_amd_overlay.commands import verdict
from k3_amd_overlay.package import __version__
from k3_amd_overlay.record import MarkerRecord


def judge(records: list[dict[str, Any]], *args: Any, **kwargs: Any) -> verdict.Verdict:
    return verdict.judge([MarkerRecord.from_json(r) for r in records], *args, **kwargs)


SWITCH_OF = {"auto": "1", "stock": "stock", "off": "0"}  # the K3_AMD_OVERLAY value of each mode


def process(mode: str = "auto", state: str = "applied", pid: int = 1, host: str | None = None, role: str = "worker",
            layers: int = 2, served: int = 3, warmup: int = 5, captured: tuple[int, ...] = (), replayed: int = 0,
            **fields: Any) -> dict[str, Any]:
    """One process's marker contents with qkv_norm and qk_cache in ``state`` (``host`` left out when
    None: a reader then takes the record as its own machine's; ``start_ticks``, unless given, that of
    the process running as ``pid`` here, as the plugin records it; this package's version, and the
    switch of ``mode``, unless given)."""
    ran = state in ("applied", "upstream")
    entry = {"state": state, "provider": "triton" if ran else None, "reason": "r", "effective": ran and served > 0,
             "layers": layers, "runs": {"warmup": warmup if ran else 0, "capture": len(captured),
                                        "served": served if ran else 0, "replay": replayed},
             "captured_sizes": list(captured)}
    record = {"pid": pid, "role": role, "vllm_version": "0.33.0", "mode": mode, "overlay_version": __version__,
              "switch": SWITCH_OF[mode],
              "start_ticks": markers.process_start_ticks(pid),
              "fusions": {"qkv_norm": dict(entry), "qk_cache": dict(entry)}, **fields}
    if host is not None:
        record["host"] = host
    return record


def off_process(pid: int = 1, **fields: Any) -> dict[str, Any]:
    """An off record as the plugin leaves it (overlay off, nothing patched)."""
    return process("off", "disabled", pid=pid, layers=0, served=0, warmup=0, **fields)
