"""A/B arms for serving and accuracy runs: each arm is a vLLM server started with identical
arguments except ``K3_AMD_OVERLAY``, proved (``k3-amd-overlay check``) to run the path it claims
before anything is measured and again after the measurement, while it still serves (a fused kernel
that fails mid-run leaves the rest of that process stock: kernel_failures.py), then stopped
cleanly. Shared by ``k3-amd-overlay ab-serve`` and ``gsm8k-ab`` (their statistics: ab_stats.py).
Each proof is ``check --json``: kept whole (CHECK_JSON, CHECK_AFTER_JSON), as ``check`` would print
it (CHECK_FILE, CHECK_AFTER_FILE), and read back by ``proved_fusions`` for what each fusion ran as
(applied: the overlay's; upstream: vLLM's own; forced-stock; ...), so a summary credits each
fusion to the code that ran it."""

from __future__ import annotations

import contextlib
import http.client
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
from typing import Any

from k3_amd_overlay import json_files
from k3_amd_overlay.commands.usage import UsageError, check_baselines, check_executables, check_switches, split_command
from k3_amd_overlay.commands.verdict import report_lines
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.process_identity import CLI_CLIENT
from k3_amd_overlay.settings import MARKER_DIR, SWITCH, Mode, SettingsError, load_settings

CHECK_FILE = "check.txt"  # in each arm's folder: the check before its measurement
CHECK_AFTER_FILE = "check-after.txt"  # ... and the check after it, with its server still up
CHECK_JSON = "check.json"  # each as `check --json` gave it
CHECK_AFTER_JSON = "check-after.json"


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


def _check_object(stdout: str) -> dict[str, Any] | None:
    """``check --json``'s object, or None where its output is none (it crashed before printing one)."""
    try:
        result = json.loads(stdout)
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def check_text(result: dict[str, Any]) -> str:
    """A ``check --json`` object as ``check`` prints it without ``--json`` (verdict.report_lines)."""
    return "\n".join(report_lines(result.get("notes") or [], result.get("lines") or [], result.get("holds") is True,
                                  result.get("expect"), len(result.get("records") or []))) + "\n"


class ProofUnreadable(ValueError):
    """A saved proof (check.json / check-after.json) that is not what ``check --json`` writes."""


def _states(record: dict[str, Any]) -> dict[str, tuple[str, int]] | None:
    """Each fusion's (state, layers) in a record as ``check --json`` gives it; None where its
    "fusions" is not an object of such entries."""
    fusions = record.get("fusions") or {}
    if not isinstance(fusions, dict):
        return None
    states = {}
    for name, entry in fusions.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("state"), str)):
            return None
        layers = entry.get("layers", 0)
        states[str(name)] = (entry["state"], layers if isinstance(layers, int) else 0)
    return states


# The fused paths whose batches a measurement must show ran: the norm pair, and the decode, where the
# absorbed launch takes the batches qk_cache's would (verdict.DOES_THE_WORK_OF), so the two count as one.
PATHS = {QKV_NORM: QKV_NORM, QK_CACHE: "decode", ABSORB_QK_CACHE: "decode"}


def batches_run(result: dict[str, Any]) -> dict[str, int]:
    """Per fused path (PATHS), the served and replayed batches its fused launches ran in, as a held
    ``check --json`` object counts them over its records (a CLI client's aside; a malformed entry
    counts nothing)."""
    counted: dict[str, int] = {}
    for record in result.get("records") or []:
        if not isinstance(record, dict) or record.get("role") == CLI_CLIENT:
            continue
        fusions = record.get("fusions")
        for name, entry in (fusions.items() if isinstance(fusions, dict) else ()):
            runs = entry.get("runs") if isinstance(entry, dict) else None
            if name in PATHS and isinstance(runs, dict):
                served = sum(n for phase, n in runs.items() if phase in ("served", "replay") and type(n) is int)
                counted[PATHS[name]] = counted.get(PATHS[name], 0) + served
    return counted


def applied_paths(result: dict[str, Any]) -> set[str]:
    """The fused paths (PATHS) some record of a held ``check --json`` object has the overlay's own
    (state ``applied``)."""
    found = set()
    for record in result.get("records") or []:
        states = _states(record) if isinstance(record, dict) else None
        found.update(PATHS[n] for n, (state, _) in (states or {}).items() if n in PATHS and state == "applied")
    return found


def unrun_paths(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The overlay's fused paths of the proof ``before`` a measurement that ran in no further served or
    replayed batch by the proof ``after`` it, each with its two counts."""
    ran_before, ran_after = batches_run(before), batches_run(after)
    return [f"{path} ({ran_before.get(path, 0)} batches before it, {ran_after.get(path, 0)} after)"
            for path in sorted(applied_paths(before)) if ran_after.get(path, 0) <= ran_before.get(path, 0)]


def proved_fusions(path: Path) -> dict[str, Any] | None:
    """What the proof saved at ``path`` (a held ``check --json``) shows the arm ran: {"mode": the
    overlay's mode, "fusions": {fusion: [each state it had]}} over the processes that built K3 MLA
    layers (every process where none did); None where no proof was saved there. ProofUnreadable
    names the file and what is wrong where one was saved but is not such a proof."""
    try:
        result = json_files.load(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ProofUnreadable(f"{path} is no saved check: {exc}") from None
    records = result.get("records") if isinstance(result, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ProofUnreadable(f"{path} is no saved check: its \"records\" is not a list of records")
    read = []
    for record in records:
        states = _states(record)
        if states is None:
            raise ProofUnreadable(f"{path} is no saved check: a record's \"fusions\" is not an object of fusion "
                                  "states")
        if record.get("role") != CLI_CLIENT:  # as check judges: a CLI client runs no model
            read.append((record, states))
    judged = [(r, s) for r, s in read if any(layers > 0 for _, layers in s.values())] or read
    modes = sorted({str(r.get("mode")) for r, _ in judged})
    fusions: dict[str, set[str]] = {}
    for _, states in judged:
        for name, (state, _) in states.items():
            fusions.setdefault(name, set()).add(state)
    return {"mode": "/".join(modes) or "none", "fusions": {n: sorted(s) for n, s in sorted(fusions.items())}}


def merge_proved(proofs: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One arm's proofs over its repeats as one: each fusion's states in any of them; None where any
    repeat saved none (what ran there is not known)."""
    mode: set[str] = set()
    fusions: dict[str, set[str]] = {}
    seen = False
    for proof in proofs:
        if proof is None:
            return None
        seen = True
        mode.update(proof["mode"].split("/"))
        for name, states in proof["fusions"].items():
            fusions.setdefault(name, set()).update(states)
    if not seen:
        return None
    return {"mode": "/".join(sorted(mode)), "fusions": {n: sorted(s) for n, s in sorted(fusions.items())}}


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
        self.first_proof: dict[str, Any] | None = None  # the held check --json before the measurement

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
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, dropped, timed out
            raise ArmFailed(f"arm {self.arm.label}: the probe completion for model {model!r} got no answer "
                            f"({type(exc).__name__}: {exc}); log: {self.log_path}") from None

    def prove(self, after: bool = False) -> str:
        """Run the check (``--json``) against this server's own markers; raise ArmFailed unless it
        holds. The proof before the measurement is kept in CHECK_FILE and CHECK_JSON, the one
        ``after`` it in CHECK_AFTER_FILE and CHECK_AFTER_JSON. Its text, as ``check`` prints it."""
        proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay", "check", "--expect", self.arm.expect,
                               "--marker-dir", str(self.marker_dir), "--json"], capture_output=True, text=True)
        result = _check_object(proc.stdout)
        text = check_text(result) if result is not None else proc.stdout + proc.stderr
        (self.workdir / (CHECK_AFTER_FILE if after else CHECK_FILE)).write_text(text)
        if result is not None:
            (self.workdir / (CHECK_AFTER_JSON if after else CHECK_JSON)).write_text(proc.stdout)
        if proc.returncode != 0 or result is None or result.get("holds") is not True:
            state = "no longer" if after else "not"
            when = " after its measurement (its results are not used)" if after else ""
            raise ArmFailed(f"arm {self.arm.label} ({SWITCH}={self.arm.switch}) is {state} {self.arm.expect}{when}:\n"
                            f"{text.strip()}\nlogs: {self.workdir}")
        if not after:
            self.first_proof = result
        elif self.arm.expect == "fused":
            self.check_measured_fused(result)
        return text

    def check_measured_fused(self, after: dict[str, Any]) -> None:
        """ArmFailed unless each of the overlay's fused paths the first proof found ran in some batch of
        the measurement: a proof holds on batches run before it (the probe request), so a path a
        self-measurement gate sent to stock at every batch size the measurement used would still hold."""
        if self.first_proof is None:
            raise ArmFailed(f"arm {self.arm.label}: proved after its measurement with no proof before it; logs: "
                            f"{self.workdir}")
        unrun = unrun_paths(self.first_proof, after)
        if unrun:
            raise ArmFailed(f"arm {self.arm.label} ({SWITCH}={self.arm.switch}) ran the overlay's fused path in no "
                            f"batch of its measurement (its results are not used): {'; '.join(unrun)}; the marker says "
                            f"where stock runs and why (a self-measurement may send these batch sizes to stock)\n"
                            f"logs: {self.workdir}")

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
