"""What this process proves about itself: one record per process (versions, mode, vLLM shape,
per-fusion state, provider, reason, and whether a fused path has actually run), published as
one log line through the ``vllm`` logger hierarchy and as a JSON marker file."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from k3_amd_overlay import markers
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.package import FUSIONS, __version__
from k3_amd_overlay.settings import Mode, OverlaySettings

SCHEMA = 1
logger = logging.getLogger("vllm.k3_amd_overlay")


def vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def process_role() -> str:
    name = multiprocessing.current_process().name
    title = " ".join(sys.argv[:1])
    for needle, role in (("EngineCore", "engine-core"), ("Worker", "worker"), ("APIServer", "api-server")):
        if needle in name or needle in title:
            return role
    return "main" if name == "MainProcess" else name


class Evidence:
    """The record of one process. Thread-safe; every change is written out atomically."""

    def __init__(self, settings: OverlaySettings, shape: str | None = None) -> None:
        self._lock = threading.Lock()
        self.marker_path: Path | None = None
        self.marker_error: str | None = None
        self._directory: Path | None = None
        self._effective_layers: dict[str, set[str]] = {f: set() for f in FUSIONS}
        pid = os.getpid()
        self.record: dict[str, Any] = {
            "schema": SCHEMA,
            "pid": pid,
            "start_ticks": markers.process_start_ticks(pid),
            "role": process_role(),
            "process_name": multiprocessing.current_process().name,
            "overlay_version": __version__,
            "vllm_version": vllm_version(),
            "mode": settings.mode.value,
            "switch": settings.raw,
            "strict": settings.strict,
            "vllm_shape": shape,
            "patches": [],
            "fusions": {
                f: {"state": self._initial_state(settings, f).value, "provider": None,
                    "reason": self._initial_reason(settings, f), "layers": 0,
                    "effective": False, "effective_layers": 0}
                for f in FUSIONS
            },
        }
        try:
            self._directory = markers.ensure_marker_dir(settings.marker_dir)
        except markers.MarkerDirError as exc:
            self.marker_error = str(exc)

    @staticmethod
    def _initial_state(settings: OverlaySettings, fusion: str) -> FusionState:
        if not settings.requested(fusion):
            return FusionState.DISABLED
        return FusionState.FORCED_STOCK if settings.mode is Mode.STOCK else FusionState.APPLIED

    @staticmethod
    def _initial_reason(settings: OverlaySettings, fusion: str) -> str:
        if not settings.requested(fusion):
            return f"not requested by K3_AMD_OVERLAY={settings.raw!r}"
        if settings.mode is Mode.STOCK:
            return "stock mode"
        return "patched; decided per layer when K3 MLA layers are built"

    def fusion(self, name: str) -> dict[str, Any]:
        return self.record["fusions"][name]

    def set_shape(self, shape: str | None, patches: list[str]) -> None:
        with self._lock:
            self.record["vllm_shape"] = shape
            self.record["patches"] = patches
            self._write()

    def set_fusion(self, name: str, state: FusionState, reason: str, provider: str | None = None) -> None:
        with self._lock:
            entry = self.fusion(name)
            entry.update(state=state.value, reason=reason, provider=provider)
            self._write()

    def note_layer(self, name: str, decision: LayerDecision) -> None:
        """A K3 MLA layer was built and decided; the first decision sets the fusion's state, a
        later layer that decides differently is recorded as mixed."""
        with self._lock:
            entry = self.fusion(name)
            summary = (decision.state.value, decision.provider, decision.reason)
            if entry["layers"] == 0:
                entry.update(state=decision.state.value, provider=decision.provider, reason=decision.reason)
            elif summary != (entry["state"], entry["provider"], entry["reason"]):
                entry["reason"] = f"mixed across layers; latest: {decision.state.value} ({decision.reason})"
            entry["layers"] += 1
            self._write()

    def effective_hook(self, fusion: str, layer: str) -> Callable[[], None]:
        """A callable for one layer's fused site: the first call records that the fused path ran
        (no device work, safe under graph capture); later calls cost one attribute test."""
        done = False

        def mark() -> None:
            nonlocal done
            if done:
                return
            done = True
            with self._lock:
                layers = self._effective_layers[fusion]
                layers.add(layer)
                entry = self.fusion(fusion)
                entry.update(effective=True, effective_layers=len(layers))
                self._write()

        return mark

    def _write(self) -> None:
        self.record["updated"] = time.time()
        if self._directory is None:
            return
        try:
            self.marker_path = markers.write_marker(self._directory, self.record["pid"], self.record)
        except OSError as exc:  # serving must never fail over evidence
            if self.marker_error is None:
                self.marker_error = f"marker write failed in {self._directory}: {exc}"
                _emit(logging.WARNING, f"k3-amd-overlay: {self.marker_error}")

    def publish(self) -> None:
        with self._lock:
            self._write()
        _emit(logging.WARNING if self.marker_error else logging.INFO, self.summary_line())

    def summary_line(self) -> str:
        r = self.record
        parts = [
            f"k3-amd-overlay {r['overlay_version']}: pid={r['pid']} role={r['role']}",
            f"vllm={r['vllm_version']} mode={r['mode']} shape={r['vllm_shape']}",
        ]
        for name, entry in r["fusions"].items():
            provider = f" provider={entry['provider']}" if entry["provider"] else ""
            parts.append(f"{name}={entry['state']}{provider} ({entry['reason']})")
        parts.append(f"marker={self.marker_path}" if self.marker_path else f"marker-error={self.marker_error}")
        return " | ".join(parts)


def _emit(level: int, line: str) -> None:
    """Through the vllm logger once vLLM has configured it; stderr before, so no line is lost."""
    if logging.getLogger("vllm").handlers:
        logger.log(level, line)
    else:
        print(line, file=sys.stderr, flush=True)
