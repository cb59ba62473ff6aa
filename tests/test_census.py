"""The kernel census on real traces: a GPU trace from an H200 kept in tests/data (graph-replayed
kernels, known counts), several ranks, gzip and plain, a trace made here by torch.profiler, and
clear errors for truncated or foreign files."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

from k3_amd_overlay import census
from k3_amd_overlay.cli import main
from k3_amd_overlay.kernels.names import STATIC_QUANT_KERNEL

DATA = Path(__file__).parent / "data"
FUSED, BASELINE = DATA / "trace-fused-rank0.json.gz", DATA / "trace-baseline-rank0.json.gz"


def test_graph_replayed_gpu_kernels_are_counted():
    fused, base = census.read_census([FUSED]), census.read_census([BASELINE])
    assert fused.matching("qk_cache_kernel").count == 12 and fused.launches() == 12
    assert base.launches() == 36
    for name in ("concat_and_cache_mla", "CatArrayBatchedCopy", "scaled_quant"):
        assert base.matching(name).count == 12
        assert base.matching(name).total_us > 0


def test_ranks_from_names_plain_and_gzip(tmp_path):
    for rank in (0, 1, 2):
        target = tmp_path / f"profiler_out_rank{rank}.pt.trace.json"
        target.write_bytes(gzip.decompress(FUSED.read_bytes()))
    shutil.copy(FUSED, tmp_path / "extra_rank3.pt.trace.json.gz")
    result = census.read_census([tmp_path])
    assert sorted(result.ranks) == ["0", "1", "2", "3"]
    assert result.total()["qk_cache_kernel"].count == 48
    assert census.check_expectations(result, [("qk_cache_kernel", 12)]) == []
    problems = census.check_expectations(result, [("qk_cache_kernel", 24)])
    assert len(problems) == 4 and "ran 12 times, expected 24" in problems[0]


def test_cli_table_json_and_expect(tmp_path, capsys):
    assert main(["census", str(FUSED), "--baseline", str(BASELINE), "--steps", "4", "--layers", "3",
                 "--expect", "qk_cache_kernel=12"]) == 0
    out = capsys.readouterr().out
    assert "kernel launches per rank per step: 9 -> 3 (-6, -66.7%)" in out
    assert "per MLA layer per decode step and rank (3 layers x 4 steps)" in out
    assert main(["census", str(FUSED), "--expect", "qk_cache_kernel=11"]) == 1
    capsys.readouterr()
    assert main(["census", str(FUSED), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"]["0"][0]["name"] == "qk_cache_kernel" and data["ranks"]["0"][0]["count"] == 12
    assert data["total"][0]["count"] == 12 and set(data["ranks"]["0"][0]) == {"name", "count", "total_us", "mean_us"}


def test_a_trace_made_here_by_torch_profiler(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "cpu_rank0.json"
    prof.export_chrome_trace(str(path))
    result = census.read_census([path])
    assert list(result.ranks) == ["0"] and result.launches() == 0  # CPU ops are not GPU kernels
    assert census.check_expectations(result, [("qk_cache_kernel", 0)]) == []
    # the same real export with one op re-labelled a GPU kernel: exactly that one is counted, so
    # the zero above is the reader telling CPU ops apart, not a reader that counts nothing
    data = json.loads(path.read_text())
    op = next(e for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    op["cat"] = "kernel"
    relabelled = tmp_path / "gpu_rank0.json"
    relabelled.write_text(json.dumps(data))
    counted = census.read_census([relabelled])
    assert counted.launches() == 1 and counted.matching(op["name"]).count == 1


@pytest.mark.parametrize("content,message", [
    (gzip.compress(b'{"traceEvents": [{"ph": "X"')[:-9], "truncated or not gzip"),
    (b'{"traceEvents": [{"ph": "X", "cat"', "not JSON"),
    (b'{"events": []}', "without a traceEvents list"),
])
def test_bad_files_get_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / ("bad.json.gz" if content[:2] == b"\x1f\x8b" else "bad.json")
    path.write_bytes(content)
    with pytest.raises(census.TraceError, match=message):
        census.read_census([path])
    assert main(["census", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


def test_bad_expect_and_missing_paths():
    with pytest.raises(ValueError, match="write NAME=COUNT"):
        census.parse_expectations(["qk_cache_kernel"])
    with pytest.raises(census.TraceError, match="no such file"):
        census.read_census(["/nonexistent/trace.json"])


def test_census_names_are_the_kernels_own_names():
    """Each of the overlay's census names is the name its Triton kernel launches under."""
    pytest.importorskip("triton")
    from k3_amd_overlay.kernels import (
        absorb_fp8_qk_cache,
        absorb_mxfp4_qk_cache,
        absorb_qk_cache,
        names,
        qk_cache,
        rmsnorm_pair,
        static_quant,
    )

    assert qk_cache.qk_cache_kernel.fn.__name__ == names.QK_CACHE_KERNEL
    assert absorb_qk_cache.absorb_qk_cache_kernel.fn.__name__ == names.ABSORB_QK_CACHE_KERNEL
    assert absorb_fp8_qk_cache.absorb_fp8_qk_cache_kernel.fn.__name__ == names.ABSORB_FP8_QK_CACHE_KERNEL
    assert absorb_mxfp4_qk_cache.absorb_mxfp4_qk_cache_kernel.fn.__name__ == names.ABSORB_MXFP4_QK_CACHE_KERNEL
    assert rmsnorm_pair.rmsnorm_pair_kernel.fn.__name__ == names.RMSNORM_PAIR_KERNEL
    assert static_quant.query_fp8_quant_kernel.fn.__name__ == names.STATIC_QUANT_KERNEL
    tables = {kernel for kinds in census.FUSION_KERNELS.values() for kernel in kinds["adds"]}
    assert {names.QK_CACHE_KERNEL, names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL,
            names.ABSORB_MXFP4_QK_CACHE_KERNEL, names.STATIC_QUANT_KERNEL, names.RMSNORM_PAIR_KERNEL} <= tables
    removed = census.FUSION_KERNELS["qk_cache"]["removes"] + census.FUSION_KERNELS["absorb_qk_cache"]["removes"]
    assert not any(name in names.STATIC_QUANT_KERNEL for name in removed)  # never taken for a stock quant


def _trace(path: Path, kernels: dict[str, int]) -> Path:
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": i, "dur": 2.0}
              for name, count in kernels.items() for i in range(count)]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_kernel_matching_a_removed_and_an_added_pattern_is_counted_once(tmp_path):
    """AITER's fused fp8 / fp4 BMM kernels contain "bmm" (a removed pattern): each fused launch is
    counted once, as added, and the region's time is not doubled."""
    base = census.read_census([_trace(tmp_path / "base_rank0.json", {
        "_batched_gemm_a16wfp4_kernel": 4, "vllm::concat_and_cache_mla_kernel": 4, "triton_poi_fused__to_copy_cat_"
        "clamp_mul_reciprocal_0": 4})])
    fused = census.read_census([_trace(tmp_path / "fused_rank0.json", {
        "_fused_fp4_bmm_rope_cat_and_cache_mla_kernel": 4, STATIC_QUANT_KERNEL: 4})])
    out = census.render_comparison(base, fused, steps=None, layers=1)
    section = out.split("absorb_qk_cache (summed")[1]
    assert "absorb_qk_cache region: 24.0 µs -> 16.0 µs (1.50x)" in section
    assert "| bmm |" not in section
    assert "| fused_fp4_bmm_rope_cat_and_cache_mla | 0 × 0.00 = 0.0 | 4 × 2.00 = 8.0 |" in section
    assert "| batched_gemm_a16wfp4 | 4 × 2.00 = 8.0 | 0 × 0.00 = 0.0 |" in section  # by its own name
    assert "| gemm |" not in section
    assert "| query_fp8_quant_kernel | 0 × 0.00 = 0.0 | 4 × 2.00 = 8.0 |" in section
