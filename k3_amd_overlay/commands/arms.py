"""A/B arms for serving and accuracy runs: each arm is a vLLM server started with identical
arguments except ``K3_AMD_OVERLAY``, proved (``k3-amd-overlay check``) to run the path it claims
before anything is measured and again after the measurement, while it still serves (a fused kernel
that fails mid-run leaves the rest of that process stock: kernel_failures.py), then stopped
cleanly. Shared by ``k3-amd-overlay ab-serve`` and ``gsm8k-ab`` (their statistics: ab_stats.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3_amd_overlay.commands.usage import UsageError, check_baselines, check_executables, check_switches, split_command
from k3_amd_overlay.settings import MARKER_DIR, SWITCH, Mode, SettingsError, load_settings

CHECK_FILE = "check.txt"  # in each arm's folder: the check before its measurement
CHECK_AFTER_FILE = "check-after.txt"  # ... and the check after it, with its server still up


ARM_LABELS = ("arm A", "arm B", "arm C")  # each arm's name in what the tools say, in the order given


@dataclass(frozen=True)
class Arm:
    label: str  # "A" (baseline), "B" (candidate), "C" (the optional stock arm)
    switch: str  # the K3_AMD_OVERLAY value
    expect: str  # what `check` must prove: "off", "stock" or "fused"


def expectation(switch: str) -> str:
    """What ``check`` must prove of an arm started with this K3_AMD_OVERLAY value (already valid)."""
    mode = load_settings({SWITCH: switch}).mode
    return {Mode.OFF: "off", Mode.STOCK: "stock"}.get(mode, "fused")


def setting(switch: str) -> tuple[Mode, frozenset[str]]:
    """What an arm started with this K3_AMD_OVERLAY value (already valid) runs: the mode and the
    fusions as the overlay parses them, so ``" 1"``, ``1`` and every fusion named are one setting."""
    parsed = load_settings({SWITCH: switch})
    return parsed.mode, parsed.fusions


def _said(mode: Mode, fusions: frozenset[str]) -> str:
    return f"{mode.value}: {', '.join(sorted(fusions))}" if mode is Mode.AUTO else mode.value


def check_distinct(named: Sequence[tuple[str, str]]) -> None:
    """Each (option, K3_AMD_OVERLAY value, already valid) is a setting no other arm has; a
    UsageError names the first two that are the same (an A/B of an arm against itself)."""
    seen: dict[tuple[Mode, frozenset[str]], tuple[str, str]] = {}
    for name, value in named:
        parsed = setting(value)
        if parsed in seen:
            first, first_value = seen[parsed]
            raise UsageError(f"the arms must differ: {first} {first_value!r} and {name} {value!r} are the same "
                             f"setting ({_said(*parsed)}), an A/B of an arm against itself")
        seen[parsed] = (name, value)


def environment(switch: str, marker_dir: str) -> dict[str, str]:
    """The environment an arm's server is started with: this process's, with the arm's switch and
    its own marker folder."""
    env = {k: v for k, v in os.environ.items() if k != SWITCH}
    env.update({SWITCH: switch, MARKER_DIR: marker_dir})
    return env


def check_environments(named: Iterable[tuple[str, str]]) -> None:
    """Each (arm, K3_AMD_OVERLAY value, already valid): every K3_AMD_OVERLAY* variable its server
    would inherit, parsed by the overlay's own loader as the plugin parses them when the server
    starts (a bad K3_AMD_OVERLAY_STRICT, a provider, a misspelt name while the arm is not off); a
    UsageError in the loader's words naming the first arm whose server would stop on one, before any
    server starts (and a model loads)."""
    for name, switch in named:
        try:
            load_settings(environment(switch, "markers"))  # the arm's own marker folder: never blank
        except SettingsError as exc:
            raise UsageError(f"{name} ({SWITCH}={switch!r}) would stop its server at start on the environment it "
                             f"inherits: {exc}") from None


def check_arms(switches: Sequence[tuple[str, str]], commands: Iterable[tuple[str, str]], serve_args: str,
               accept: bool) -> list[str]:
    """An A/B run's arms (each (option, K3_AMD_OVERLAY value)) and the commands it runs (each (option,
    command line)), before any server starts: a valid switch, no two arms alike, an environment each
    arm's server would start with, each command on PATH, then (reading the installed vLLM) a valid
    baseline unless ``accept``. The baseline hazards accepted (for the summary)."""
    check_switches(switches)
    check_distinct(switches)
    labels = list(zip(ARM_LABELS, (value for _, value in switches), strict=False))
    check_environments(labels)
    check_executables(commands)
    return check_baselines(labels, serve_args, accept)


def default_arms(switch_a: str = "0", switch_b: str = "1") -> tuple[Arm, Arm]:
    """The operator's question: vLLM as it is (overlay off) against the overlay on."""
    return Arm("A", switch_a, expectation(switch_a)), Arm("B", switch_b, expectation(switch_b))


def abba(arms: Sequence[Arm], repeats: int) -> list[tuple[int, Arm]]:
    """(repeat, arm) in alternating order: AB, BA, AB, ... (ABC, CBA, ...) so no arm always runs first."""
    order = []
    for r in range(repeats):
        pair = arms if r % 2 == 0 else arms[::-1]
        order += [(r, arm) for arm in pair]
    return order


class ArmFailed(RuntimeError):
    """An arm could not be started or proved; the message says where its logs are."""


def reason(exc: Exception) -> str:
    """Why a run aborted in one line, as a summary's ``aborted`` and --json's ``error`` say it: the
    first line of the failure's message (the rest, a check's output and where the logs are, goes to
    stderr)."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class Server:
    """One ``vllm serve`` (or stand-in) for one arm, in its own process group."""

    def __init__(self, command: Sequence[str], arm: Arm, workdir: Path, port: int) -> None:
        self.command = list(command)
        self.arm = arm
        self.port = port
        self.workdir = workdir
        self.marker_dir = workdir / "markers"
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return environment(self.arm.switch, str(self.marker_dir))

    def start(self, health_timeout: float) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.marker_dir.mkdir(mode=0o700, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=True)
        deadline = time.monotonic() + health_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise ArmFailed(f"arm {self.arm.label}: server exited with {code}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ArmFailed(f"arm {self.arm.label}: not healthy after {health_timeout:.0f} s; log: {self.log_path}")

    def request(self, model: str) -> None:
        """One short completion, so the decode path has run (and marked itself effective)."""
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            hint = "; the server serves another name: pass --served-model-name" if exc.code == 404 else ""
            raise ArmFailed(f"arm {self.arm.label}: the probe completion for model {model!r} got HTTP {exc.code}: "
                            f"{detail}{hint}; log: {self.log_path}") from None

    def prove(self, after: bool = False) -> str:
        """Run the check against this server's own markers; raise ArmFailed unless it holds. The
        proof before the measurement is kept in CHECK_FILE, the one ``after`` it in CHECK_AFTER_FILE."""
        proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay", "check", "--expect", self.arm.expect,
                               "--marker-dir", str(self.marker_dir)], capture_output=True, text=True)
        (self.workdir / (CHECK_AFTER_FILE if after else CHECK_FILE)).write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            state = "no longer" if after else "not"
            when = " after its measurement (its results are not used)" if after else ""
            raise ArmFailed(f"arm {self.arm.label} ({SWITCH}={self.arm.switch}) is {state} {self.arm.expect}{when}:\n"
                            f"{proc.stdout.strip()}\nlogs: {self.workdir}")
        return proc.stdout

    def stop(self, grace: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def serve_command(serve_cmd: str, model: str, port: int, serve_args: str) -> list[str]:
    """One arm's server command line: ``serve_cmd MODEL --port PORT SERVE_ARGS`` (what it sets itself,
    usage.SERVE_OWNED, a --serve-args may not repeat)."""
    return [*split_command("--serve-cmd", serve_cmd), model, "--port", str(port),
            *split_command("--serve-args", serve_args)]


@contextlib.contextmanager
def proved_server(arm: Arm, serve_cmd: str, model: str, serve_args: str, port: int, workdir: Path,
                  health_timeout: float, served_name: str | None = None) -> Iterator[Server]:
    """One arm's whole lifecycle: start ``serve_cmd MODEL --port PORT SERVE_ARGS`` with only this
    arm's switch differing, wait for health, send one request, prove the arm's path with ``check``;
    once the block (the measurement) ends without an error, prove it again with the server still up;
    the server is stopped however the block ends. ArmFailed says which step failed and where the
    logs are; a measurement counts only where the block is left without one."""
    server = Server(serve_command(serve_cmd, model, port, serve_args), arm, workdir, port)
    try:
        server.start(health_timeout)
        server.request(served_name or model)
        server.prove()
        yield server
        server.prove(after=True)  # again: a fused kernel that fails during the measurement leaves the arm stock
    finally:
        server.stop()
