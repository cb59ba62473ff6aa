"""The A/B harnesses against real servers, run from the installed CLI: `k3-amd-overlay ab-serve`
with vLLM's real `vllm bench serve` (tiny lengths, one concurrency, two repeats, the plot written),
and `k3-amd-overlay gsm8k-ab` with the real lm-eval on a local GSM8K-format file. These prove the
harnesses (arms started, proved by `check`, measured, stopped), not the speed or the accuracy of a
2-layer model with made-up weights."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from engine_args import server_args
from engine_support import engine_env, free_port

CLI = Path(sys.executable).parent / "k3-amd-overlay"  # the installed wheel's console script
HARNESS_TIMEOUT_S = 1800  # hang guards, with room for a shared machine (see conftest.py)
HEALTH_TIMEOUT = "600"
BENCH_ARGS = ("--backend openai --endpoint /v1/completions --dataset-name random --random-input-len 16 "
              "--random-output-len 8 --random-range-ratio 0 --ignore-eos --seed 42 "
              "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99")
GSM8K_ROWS = [
    ("Tom has 3 apples and buys 2 more. How many apples does he have?", "3 + 2 = 5\n#### 5"),
    ("A box holds 4 pens. How many pens are in 2 boxes?", "4 * 2 = 8\n#### 8"),
    ("Sara had 10 coins and spent 4. How many coins are left?", "10 - 4 = 6\n#### 6"),
    ("One plus one is what?", "1 + 1 = 2\n#### 2"),
    ("Two plus two is what?", "2 + 2 = 4\n#### 4"),
    ("Three times three is what?", "3 * 3 = 9\n#### 9"),
]


def harness_env(vllm_bin: Path, tmp_path: Path) -> dict[str, str]:
    env = engine_env(None, tmp_path / "unused-markers", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env["PATH"] = f"{vllm_bin}{os.pathsep}{env['PATH']}"
    return env


def run(tool: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), tool, *args], env=env, capture_output=True, text=True, timeout=HARNESS_TIMEOUT_S)


def test_ab_serve_against_real_servers(checkpoint, vllm_bin, tmp_path):
    out = tmp_path / "ab"
    proc = run("ab-serve", "--model", str(checkpoint), "--concurrency", "1", "--repeats", "2", "--num-prompts", "1",
               "--out", str(out), "--port", str(free_port()), "--health-timeout", HEALTH_TIMEOUT,
               "--serve-cmd", "vllm serve", "--serve-args", shlex.join(server_args()), "--bench-args", BENCH_ARGS,
               env=harness_env(vllm_bin, tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 1 | out tok/s |" in proc.stdout and "| 1 | TTFT p50 (ms) |" in proc.stdout
    for repeat in (0, 1):
        off = (out / f"repeat{repeat}-armA" / "check.txt").read_text()
        fused = (out / f"repeat{repeat}-armB" / "check.txt").read_text()
        assert "HOLDS: expect off" in off and "(api-server, vLLM 0.32.0): overlay off" in off  # its off record
        assert "HOLDS: expect fused" in fused and "served traffic took the fused path" in fused
        after = (out / f"repeat{repeat}-armB" / "check-after.txt").read_text()  # proved again, after its bench
        assert "HOLDS: expect fused" in after and "served traffic took the fused path" in after
        assert "HOLDS: expect off" in (out / f"repeat{repeat}-armA" / "check-after.txt").read_text()
        for arm in ("A", "B"):
            result = json.loads((out / f"repeat{repeat}-arm{arm}" / "bench-c1.json").read_text())
            assert result["completed"] == 1 and result["total_output_tokens"] == 8, result
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rows"]["B_vs_A"]
    assert {r["metric"] for r in rows} >= {"TTFT p50 (ms)", "TTFT p99 (ms)", "out tok/s"}
    assert all(r["median_a"] > 0 and r["median_b"] > 0 and r["repeats"] == 2 for r in rows)
    assert summary["environment"]["vllm_versions"] == ["0.32.0"] and summary["aborted"] is None
    assert (out / "summary.png").stat().st_size > 10_000, proc.stdout[-2000:]  # matplotlib: the plot extra


def test_gsm8k_ab_against_real_servers_on_a_local_file(checkpoint, vllm_bin, tmp_path):
    data = tmp_path / "gsm8k-local.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_ROWS))
    out = tmp_path / "gsm8k"
    proc = run("gsm8k-ab", "--arm-a", "stock", "--model", str(checkpoint), "--out", str(out),
               "--port", str(free_port()), "--health-timeout", HEALTH_TIMEOUT,
               "--serve-cmd", "vllm serve", "--serve-args", shlex.join(server_args()),
               "--data-file", str(data), "--num-fewshot", "1", "--limit", "3", "--num-concurrent", "1",
               "--lm-eval-cmd", f"{sys.executable} -m lm_eval",
               "--extra-model-args", f"max_gen_toks=16,max_length=256,tokenizer={checkpoint}",
               env=harness_env(vllm_bin, tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| A | stock |" in proc.stdout and "| B | 1 |" in proc.stdout and "| 3 |" in proc.stdout
    assert "paired over 3 questions" in proc.stdout and "verdict: " in proc.stdout  # lm-eval's --log_samples
    assert "HOLDS: expect fused" in (out / "armB" / "check.txt").read_text()
    assert "HOLDS: expect stock" in (out / "armA" / "check.txt").read_text()
    assert "HOLDS: expect fused" in (out / "armB" / "check-after.txt").read_text()  # proved again after lm-eval
    assert "HOLDS: expect stock" in (out / "armA" / "check-after.txt").read_text()
    assert (out / "tasks" / "gsm8k_local.yaml").is_file()
