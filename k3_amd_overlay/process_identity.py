"""Which kind of process this is (engine core, worker, API server, a ``vllm`` CLI client, vLLM's
model-inspection child, or an offline engine's main process), read from ``sys.argv`` and the
multiprocessing process name. Cheap and import-free of vLLM: the plugin reads it before deciding
anything."""

from __future__ import annotations

import multiprocessing
import os
import sys

API_SERVER_MODULE_FILE = os.path.join("entrypoints", "openai", "api_server.py")
CLI_MODULE_FILE = os.path.join("vllm", "entrypoints", "cli", "main.py")  # the `vllm` script's module
# A Ray actor's process (vLLM's Ray executor runs its workers as Ray actors) runs this script.
RAY_WORKER_SCRIPT = os.path.join("ray", "_private", "workers", "default_worker.py")

# The `vllm` CLI commands, deny by default: `serve` is the API server; the commands below build the
# model's engine in their own process (vLLM 0.29-0.33: each builds an `LLM` or, run-batch, the
# engine client itself; `bench startup` builds it in children that keep its command line; `bench
# forward` is 0.33's). Every other command (`bench serve`, `bench sweep`, `chat`, `complete`,
# `collect-env`, `launch render`, `preload`, `snapshot`, `download-kernels`, `--version`, `--help`, an
# unknown one) drives or talks to servers, or prints: it runs no model, so it leaves no evidence (it
# would otherwise be counted by `check` as a vLLM process).
SERVER_COMMANDS = (("serve",),)
ENGINE_COMMANDS = (("bench", "latency"), ("bench", "throughput"), ("bench", "startup"), ("bench", "forward"),
                   ("bench", "mm-processor"), ("run-batch",))
# vLLM's model registry reads a model class's facts in a child it starts as `python -m
# vllm.model_executor.models.registry` (``_run_in_subprocess``, vLLM 0.29-0.33): the child loads the
# general plugins, reads the facts and exits; it builds no model. Its evidence would only ever be a
# stale marker beside a server's (one on each start with an empty model-info cache).
MODEL_INSPECTION_MODULE_FILE = os.path.join("vllm", "model_executor", "models", "registry.py")
PROCESS_NAME_ROLES = (("EngineCore", "engine-core"), ("Worker", "worker"), ("ApiServer", "api-server"),
                      ("APIServer", "api-server"))
# The roles of processes that build (or, offline, are) the engine that runs the model: evidence of what
# ran comes from them. An API server only tokenises and forwards requests.
MODEL_ROLES = ("engine-core", "worker", "main")
CLI_CLIENT = "cli-client"  # the role of a `vllm` command that runs no model
MAIN_PROCESS = "MainProcess"  # multiprocessing's name of a process it did not start


def _vllm_command(argv: list[str]) -> list[str] | None:
    """The arguments after ``vllm`` when this process is the ``vllm`` CLI (its script, or its module
    run as ``python -m vllm.entrypoints.cli.main``), else None."""
    is_cli = bool(argv) and (os.path.basename(argv[0]) == "vllm" or argv[0].endswith(CLI_MODULE_FILE))
    return argv[1:] if is_cli else None


def _starts_with(command: list[str], known: tuple[tuple[str, ...], ...]) -> bool:
    return any(tuple(command[:len(words)]) == words for words in known)


def _cli_role(command: list[str], name: str) -> str:
    """The role of a ``vllm`` CLI process running ``command``: a client unless it is known to serve or
    to build the engine."""
    if _starts_with(command, SERVER_COMMANDS):
        return "api-server"
    if _starts_with(command, ENGINE_COMMANDS):
        return "main" if name == MAIN_PROCESS else name
    return CLI_CLIENT


def is_cli_client(argv: list[str] | None = None, name: str | None = None) -> bool:
    """Whether this process is a ``vllm`` CLI command that runs no model (``process_role``'s cli-client)."""
    return process_role(argv, name) == CLI_CLIENT


def is_model_inspection(argv: list[str] | None = None) -> bool:
    """Whether this process is vLLM's model-inspection child (run as a module: argv[0] is its file)."""
    argv = sys.argv if argv is None else argv
    return bool(argv) and argv[0].endswith(MODEL_INSPECTION_MODULE_FILE)


def process_role(argv: list[str] | None = None, name: str | None = None) -> str:
    """engine-core, worker (a vLLM worker process or a Ray actor), api-server (``vllm serve`` or the
    OpenAI server module), cli-client (any other ``vllm`` command but those that build the engine:
    ``ENGINE_COMMANDS``), or main (an offline engine: ``LLM``, ``vllm bench throughput``, a script).
    A process named by vLLM as an engine core, worker or API server is that, whatever its command line."""
    argv = sys.argv if argv is None else argv
    name = multiprocessing.current_process().name if name is None else name
    for needle, role in PROCESS_NAME_ROLES:
        if needle in name:
            return role
    command = _vllm_command(argv)
    if command is not None:
        return _cli_role(command, name)
    if argv and argv[0].endswith(API_SERVER_MODULE_FILE):
        return "api-server"
    if argv and argv[0].endswith(RAY_WORKER_SCRIPT):
        return "worker"
    return "main" if name == MAIN_PROCESS else name
