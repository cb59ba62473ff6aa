"""Judging evidence records against an expectation (``fused`` or ``stock``): the logic of
``k3-amd-overlay check``, kept apart from reading files so it is tested on records directly."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from k3_amd_overlay.fusions.states import FUSED_STATES, FusionState
from k3_amd_overlay.settings import Mode

FUSED_STATE_VALUES = frozenset(s.value for s in FUSED_STATES)


@dataclass
class Verdict:
    holds: bool = True
    lines: list[str] = field(default_factory=list)

    def fail(self, line: str) -> None:
        self.holds = False
        self.lines.append(f"FAIL {line}")

    def ok(self, line: str) -> None:
        self.lines.append(f"ok   {line}")


def judge(records: Iterable[dict[str, Any]], expect: str, fusions: Iterable[str] | None,
          require_effective: bool) -> Verdict:
    """``fused`` holds where every process has each fusion applied (the overlay's) or upstream
    (this vLLM's own), and, with ``require_effective``, some process has actually run it.
    ``stock`` holds only where every process runs the overlay in stock mode, each fusion forced
    stock and none ever effective. A process with the overlay off proves neither. ``fusions``
    None: each process's requested ones (those not ``disabled``)."""
    verdict = Verdict()
    records = list(records)
    named = list(fusions) if fusions is not None else None
    if not records:
        verdict.fail("no live vLLM process has left overlay evidence (is the server up, the plugin "
                     "installed, K3_AMD_OVERLAY set, the marker directory the same?)")
        return verdict
    effective: dict[str, list[int]] = {}
    for record in records:
        who = f"pid {record['pid']} ({record.get('role')}, vLLM {record.get('vllm_version')})"
        mode = record.get("mode")
        entries = record.get("fusions", {})
        if mode == Mode.OFF.value:
            verdict.fail(f"{who}: overlay off: proves neither fused nor stock")
            continue
        wanted = named if named is not None else [
            f for f, e in entries.items() if e.get("state") != FusionState.DISABLED.value]
        for fusion in wanted:
            effective.setdefault(fusion, [])
            entry = entries.get(fusion, {})
            state, provider, reason = entry.get("state"), entry.get("provider"), entry.get("reason")
            if entry.get("effective"):
                effective[fusion].append(record["pid"])
            described = f"{who}: {fusion}={state}" + (f" provider={provider}" if provider else "") + f" ({reason})"
            if expect == "fused":
                good = mode == Mode.AUTO.value and state in FUSED_STATE_VALUES
            else:
                good = (mode == Mode.STOCK.value and state == FusionState.FORCED_STOCK.value
                        and not entry.get("effective"))
            (verdict.ok if good else verdict.fail)(described)
    if expect == "fused" and require_effective:
        for fusion, pids in effective.items():
            if pids:
                verdict.ok(f"{fusion}: fused path ran in pid(s) {', '.join(map(str, pids))}")
            else:
                verdict.fail(f"{fusion}: no process has run its fused path yet (send a decode request "
                             "first, or pass --no-effective)")
    return verdict
