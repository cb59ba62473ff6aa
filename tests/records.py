"""Judging marker contents (JSON, as a marker file holds them) the way ``check`` does: read into
the typed record first. For tests that build records by hand or read marker files."""

from __future__ import annotations

from typing import Any

from k3_amd_overlay import verdict
from k3_amd_overlay.record import MarkerRecord


def judge(records: list[dict[str, Any]], *args: Any, **kwargs: Any) -> verdict.Verdict:
    return verdict.judge([MarkerRecord.from_json(r) for r in records], *args, **kwargs)
