"""The operator tools' optional parts, in the venv that has the `tools` extra (matplotlib, lm-eval):
`k3-amd-overlay bench plot` draws a real H200 benchmark run (the committed JSON of 2026-11-29)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH_JSON = Path(__file__).resolve().parents[2] / "docs" / "bench-raw" / "2026-11-29-h200-session4-bench.json"
CLI = Path(sys.executable).parent / "k3-amd-overlay"


def test_bench_plot_draws_every_op_of_a_real_run(tmp_path):
    out = tmp_path / "bench.png"
    proc = subprocess.run([str(CLI), "bench", "plot", str(BENCH_JSON), "--out", str(out)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{out}: 5 panels" and out.stat().st_size > 20_000


def test_bench_plot_says_what_is_wrong_with_its_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = subprocess.run([str(CLI), "bench", "plot", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "bad.json" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_plot_writes_exactly_the_png_it_reports(tmp_path):
    """A suffixless --out is written as named (matplotlib would append .png); a directory gets BENCH.png."""
    named = tmp_path / "noext"
    proc = subprocess.run([str(CLI), "bench", "plot", str(BENCH_JSON), "--out", str(named), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["png"] == str(named) and named.read_bytes().startswith(b"\x89PNG")
    proc = subprocess.run([str(CLI), "bench", "plot", str(BENCH_JSON), "--out", str(tmp_path)], capture_output=True,
                          text=True)
    inside = tmp_path / BENCH_JSON.with_suffix(".png").name
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{inside}: 5 panels\n" and inside.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["noext", inside.name])
