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

# `vllm` CLI commands that only talk to a server or print: they never build a model, so they
# leave no evidence (a client would otherwise be counted by `check` as a vLLM process).
CLI_CLIENT_COMMANDS = (("bench", "serve"), ("chat",), ("complete",), ("collect-env",), ("--version",),
                       ("-v",), ("--help",), ("-h",))
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
CLI_CLIENT = "cli-client"  # the role of a `vllm` command that only talks to a server: it runs no model


def _vllm_command(argv: list[str]) -> list[str] | None:
    """The arguments after ``vllm`` when this process is the ``vllm`` CLI (its script, or its module
    run as ``python -m vllm.entrypoints.cli.main``), else None."""
    is_cli = bool(argv) and (os.path.basename(argv[0]) == "vllm" or argv[0].endswith(CLI_MODULE_FILE))
    return argv[1:] if is_cli else None


def is_cli_client(argv: list[str] | None = None) -> bool:
    command = _vllm_command(sys.argv if argv is None else argv)
    return command is not None and any(tuple(command[:len(c)]) == c for c in CLI_CLIENT_COMMANDS)


def is_model_inspection(argv: list[str] | None = None) -> bool:
    """Whether this process is vLLM's model-inspection child (run as a module: argv[0] is its file)."""
    argv = sys.argv if argv is None else argv
    return bool(argv) and argv[0].endswith(MODEL_INSPECTION_MODULE_FILE)


def process_role(argv: list[str] | None = None, name: str | None = None) -> str:
    """engine-core, worker (a vLLM worker process or a Ray actor), api-server (``vllm serve`` or
    the OpenAI server module), cli-client, or main (an offline engine: ``LLM``, ``vllm bench throughput``, a script)."""
    argv = sys.argv if argv is None else argv
    name = multiprocessing.current_process().name if name is None else name
    for needle, role in PROCESS_NAME_ROLES:
        if needle in name:
            return role
    if is_cli_client(argv):
        return CLI_CLIENT
    command = _vllm_command(argv)
    if (command and command[0] == "serve") or (argv and argv[0].endswith(API_SERVER_MODULE_FILE)):
        return "api-server"
    if argv and argv[0].endswith(RAY_WORKER_SCRIPT):
        return "worker"
    return "main" if name == "MainProcess" else name
