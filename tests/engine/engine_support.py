"""The real-engine tier's helpers: one engine process's environment, its markers, an offline run
in a fresh process, and an OpenAI server through the package's own arm lifecycle."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_args import ENGINE_ENV, REFERENCE_PROVIDERS, server_args

from k3_amd_overlay.commands import arms
from k3_amd_overlay.settings import MARKER_DIR, SWITCH

HERE = Path(__file__).resolve().parent
OFFLINE_TIMEOUT_S = 600  # a hang guard (the tier shares the cores with a release's tests)


def engine_env(switch: str | None, marker_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of one engine process: no inherited overlay variables, the engine's own,
    the reference providers, this switch and marker directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SWITCH) and k != "TRITON_INTERPRET"}
    env.update(ENGINE_ENV)
    env.update(REFERENCE_PROVIDERS)
    env[MARKER_DIR] = str(marker_dir)
    if switch is not None:
        env[SWITCH] = switch
    env.update(extra)
    return env


def read_records(marker_dir: Path) -> list[dict[str, Any]]:
    """Every marker left in the directory, live or not (an offline run has exited)."""
    if not marker_dir.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(marker_dir.glob("*.json"))]


def run_offline(checkpoint: Path, switch: str | None, workdir: Path, **extra: str) -> dict[str, Any]:
    """One offline greedy run in a fresh process: its outputs, markers and log."""
    workdir.mkdir(parents=True, exist_ok=True)
    marker_dir = workdir / "markers"
    marker_dir.mkdir(mode=0o700, exist_ok=True)
    proc = subprocess.run([sys.executable, str(HERE / "generate.py"), str(checkpoint)], cwd=workdir,
                          env=engine_env(switch, marker_dir, **extra), capture_output=True, text=True,
                          timeout=OFFLINE_TIMEOUT_S)
    (workdir / "log.txt").write_text(proc.stdout + proc.stderr)
    outputs = next((json.loads(line.split("=", 1)[1]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT=")), None)
    return {"returncode": proc.returncode, "outputs": outputs, "records": read_records(marker_dir),
            "log": proc.stdout + proc.stderr}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer(arms.Server):
    """The OpenAI server through the package's own arm lifecycle, with the engine's environment:
    ``vllm serve`` (the CLI stand-in, vllm_cli.py) or the server module itself."""

    def __init__(self, checkpoint: Path, switch: str | None, workdir: Path, serve_command: list[str],
                 **extra: str) -> None:
        port = free_port()
        command = [*serve_command, str(checkpoint), "--port", str(port), "--host", "127.0.0.1", *server_args()]
        expect = "stock" if switch == "stock" else "fused"
        super().__init__(command, arms.Arm("X", switch or "0", expect), workdir, port)
        self.checkpoint = checkpoint
        self.extra = extra
        self.switch = switch

    def env(self) -> dict[str, str]:
        return engine_env(self.switch, self.marker_dir, **self.extra)

    def complete(self, prompt: str = "The quick brown fox", max_tokens: int = 8) -> dict[str, Any]:
        import urllib.request

        body = json.dumps({"model": str(self.checkpoint), "prompt": prompt,
                           "max_tokens": max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def check(self, *options: str) -> subprocess.CompletedProcess[str]:
        """``k3-amd-overlay check`` (the installed console script) against this server's markers."""
        script = Path(sys.executable).with_name("k3-amd-overlay")
        return subprocess.run([str(script), "check", "--marker-dir", str(self.marker_dir), *options],
                              capture_output=True, text=True, timeout=OFFLINE_TIMEOUT_S,
                              env=self.env())
