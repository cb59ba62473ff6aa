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
from kineto_traces import ATTENTION, kernel_trace, ranged_events, with_kernels

from k3_amd_overlay.commands import census
from k3_amd_overlay.commands.cli import main
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
    for rank in (0, 1, 2):  # each rank's trace names itself, as the profiler writes it
        target = tmp_path / f"profiler_out_rank{rank}.pt.trace.json"
        target.write_text(json.dumps({**json.loads(gzip.decompress(FUSED.read_bytes())), "traceName": str(target)}))
    shutil.copy(FUSED, tmp_path / "extra_rank3.pt.trace.json.gz")
    result = census.read_census([tmp_path])
    assert sorted(result.ranks) == ["0", "1", "2", "3"]
    assert result.total()["qk_cache_kernel"].count == 48
    assert census.check_expectations(result, [("qk_cache_kernel", 12)]) == []
    problems = census.check_expectations(result, [("qk_cache_kernel", 24)])
    assert len(problems) == 4 and "ran 12 times, expected 24" in problems[0]


def test_cli_table_json_and_expect(tmp_path, capsys):
    # the graph traces hold the region alone: each arm given the attention kernel of its 4 steps x 3 layers
    fused, base = (with_kernels(trace, tmp_path / f"{arm}-rank0.json", {ATTENTION: 12})
                   for arm, trace in (("fused", FUSED), ("base", BASELINE)))
    assert main(["census", str(fused), "--baseline", str(base), "--steps", "4", "--layers", "3",
                 "--expect", "qk_cache_kernel=12"]) == 0
    out = capsys.readouterr().out
    assert "kernel launches per rank per step: 12 -> 6 (-6, -50.0%)" in out
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
    # no GPU kernel at all proves nothing, not even that a kernel did not run
    assert census.check_expectations(result, [("qk_cache_kernel", 0)]) == [census.EMPTY.format(rank="0")]
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


def test_a_kernel_matching_a_removed_and_an_added_pattern_is_counted_once(tmp_path):
    """AITER's fused fp8 / fp4 BMM kernels contain "bmm" (a removed pattern): each fused launch is
    counted once, as added, and the region's time is not doubled."""
    base = census.read_census([kernel_trace(tmp_path / "base_rank0.json", {
        "_batched_gemm_a16wfp4_kernel": 4, "vllm::concat_and_cache_mla_kernel": 4, "triton_poi_fused__to_copy_cat_"
        "clamp_mul_reciprocal_0": 4, ATTENTION: 4})])
    fused = census.read_census([kernel_trace(tmp_path / "fused_rank0.json", {
        "_fused_fp4_bmm_rope_cat_and_cache_mla_kernel": 4, STATIC_QUANT_KERNEL: 4, ATTENTION: 4})])
    out = census.render_comparison(base, fused, steps=None, layers=1)
    section = out.split("absorb_qk_cache (summed")[1]
    assert "absorb_qk_cache region: 24.0 µs -> 16.0 µs (1.50x)" in section
    assert "| bmm |" not in section
    assert "| fused_fp4_bmm_rope_cat_and_cache_mla | 0 × 0.00 = 0.0 | 4 × 2.00 = 8.0 |" in section
    assert "| batched_gemm_a16wfp4 | 4 × 2.00 = 8.0 | 0 × 0.00 = 0.0 |" in section  # by its own name
    assert "| gemm |" not in section
    assert "| query_fp8_quant_kernel | 0 × 0.00 = 0.0 | 4 × 2.00 = 8.0 |" in section


# Kernel names as profilers show them (PyTorch's CUDA cat; vLLM's CUDA/HIP ops; AITER's Triton
# functions, by their names in AITER's source; hipBLASLt's Tensile kernels; the overlay's own), each
# with the table pattern that must claim it, in its fusion.
NAMED_KERNELS = [
    ("qk_cache", "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>",
     "concat_and_cache_mla"),
    ("qk_cache", "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
                 "OpaqueType<2u>, unsigned int, 3, 64, 64>", "CatArrayBatchedCopy"),
    ("qk_cache", "scaled_quant_like_kernel", "scaled_quant"),
    ("qk_cache", "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_0",
     "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal"),
    ("qk_cache", "void aiter::fuse_qk_rope_concat_and_cache_mla_kernel<__hip_bfloat16>",
     "fuse_qk_rope_concat_and_cache_mla"),
    ("qk_cache", "qk_cache_kernel", "qk_cache_kernel"),
    ("absorb_qk_cache", "_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel",
     "batched_gemm_a8w8"),
    ("absorb_qk_cache", "_batched_gemm_a16wfp4_kernel", "batched_gemm_a16wfp4"),
    ("absorb_qk_cache", "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816bmm_64x64_32x6_tn_align8>", "bmm"),
    ("absorb_qk_cache", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
    ("absorb_qk_cache", "Cijk_Alik_Bljk_BBS_BH_MT64x64x64_MI16x16x16x1_SN", "Cijk_"),
    ("absorb_qk_cache", "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_NNT", "nvjet"),  # cuBLASLt on the H200
    ("absorb_qk_cache", "absorb_qk_cache_kernel", "absorb_qk_cache_kernel"),
    ("absorb_qk_cache", "absorb_fp8_qk_cache_kernel", "absorb_fp8_qk_cache_kernel"),
    ("absorb_qk_cache", "absorb_mxfp4_qk_cache_kernel", "absorb_mxfp4_qk_cache_kernel"),
    ("absorb_qk_cache", "_fused_fp8_bmm_rope_cat_and_cache_mla_kernel", "fused_fp8_bmm_rope_cat_and_cache_mla"),
    ("absorb_qk_cache", "_fused_fp4_bmm_rope_cat_and_cache_mla_kernel", "fused_fp4_bmm_rope_cat_and_cache_mla"),
    ("absorb_qk_cache", "query_fp8_quant_kernel", "query_fp8_quant_kernel"),
    ("qkv_norm", "void vllm::rms_norm_kernel<c10::BFloat16, 8, 3>", "rms_norm_kernel"),
    ("qkv_norm", "_rmsnorm_kernel", "rmsnorm_kernel"),
    ("qkv_norm", "void aiter::fused_qk_rmsnorm_kernel<__hip_bfloat16, 8>", "fused_qk_rmsnorm"),
    ("qkv_norm", "void vllm::FusedQKVRMSNormKernel<c10::BFloat16>", "FusedQKVRMSNormKernel"),
    ("qkv_norm", "rmsnorm_pair_kernel", "rmsnorm_pair_kernel"),
]


def test_every_table_pattern_claims_the_kernel_it_names(tmp_path):
    """Each pattern of the table claims a kernel name as profilers report it, once, in its fusion's
    section; every pattern of the table is exercised here."""
    trace = census.read_census([kernel_trace(tmp_path / "base_rank0.json", {name: 1 for _, name, _ in NAMED_KERNELS})])
    claimed = {fusion: census.name_claims(trace, (*kinds["removes"], *kinds["adds"]))
               for fusion, kinds in census.FUSION_KERNELS.items()}
    for fusion, _, pattern in NAMED_KERNELS:
        assert claimed[fusion][pattern] == census.KernelStats(1, 2.0), (fusion, pattern)
    # each kernel once per fusion's table; the absorbed launch also removes qk_cache's four stock kernels, its
    # launch and vLLM's own fused decode (AITER's fused write after vLLM's W_UK GEMM)
    assert sum(s.count for table in claimed.values() for s in table.values()) == len(NAMED_KERNELS) + 6
    assert claimed["absorb_qk_cache"]["qk_cache_kernel"] == census.KernelStats(1, 2.0)
    assert census.TABLE_PATTERNS == {p for _, _, p in NAMED_KERNELS}  # every pattern has its kernel here


def test_counts_and_times_sum_over_kernels_and_ranks(tmp_path):
    one = kernel_trace(tmp_path / "a_rank0.json", {"qk_cache_kernel": 2, "absorb_qk_cache_kernel": 3})
    two = kernel_trace(tmp_path / "b_rank1.json", {"qk_cache_kernel": 5})
    result = census.read_census([one, two])
    total = result.total()
    assert (total["qk_cache_kernel"].count, total["qk_cache_kernel"].total_us) == (7, 14.0)
    both = result.matching("qk_cache_kernel")  # matches both names
    assert (both.count, both.total_us) == (10, 20.0)
    assert (result.matching("qk_cache_kernel", "1").count, result.launches("0"), result.launches()) == (5, 5, 10)
    assert result.to_json()["total"] == [
        {"name": "qk_cache_kernel", "count": 7, "total_us": 14.0, "mean_us": 2.0},
        {"name": "absorb_qk_cache_kernel", "count": 3, "total_us": 6.0, "mean_us": 2.0}]


def test_json_rounds_to_a_thousandth_of_a_microsecond(tmp_path):
    path = tmp_path / "t_rank0.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 1.23456},
                                                {"ph": "X", "cat": "kernel", "name": "k", "dur": 1.0}]}))
    assert census.read_census([path]).to_json()["ranks"]["0"] == [
        {"name": "k", "count": 2, "total_us": 2.235, "mean_us": 1.117}]


def test_trace_errors_word_for_word(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(census.TraceError) as raised:
        census.trace_files([missing])
    assert str(raised.value) == f"{missing}: no such file or directory"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(census.TraceError) as raised:
        census.trace_files([tmp_path / "empty"])
    assert str(raised.value) == f"no .json or .json.gz trace found in {tmp_path / 'empty'}"
    bad_gzip = tmp_path / "t.json.gz"
    bad_gzip.write_bytes(b"not gzip")
    with pytest.raises(census.TraceError) as raised:
        census.load_trace(bad_gzip)
    assert str(raised.value).startswith(f"{bad_gzip}: cannot read (BadGzipFile: ")
    assert str(raised.value).endswith("); truncated or not gzip?")
    truncated = tmp_path / "t.json"
    truncated.write_text('{"traceEvents": [')
    with pytest.raises(census.TraceError) as raised:
        census.load_trace(truncated)
    assert str(raised.value).startswith(f"{truncated}: not JSON (") and str(raised.value).endswith(
        "); a truncated trace?")
    truncated.write_text('{"events": []}')
    with pytest.raises(census.TraceError) as raised:
        census.load_trace(truncated)
    assert str(raised.value) == f"{truncated}: JSON without a traceEvents list: not a PyTorch profiler trace"


@pytest.mark.parametrize("name,data,rank", [
    ("x.json", {"distributedInfo": {"rank": 3}}, "3"),  # the profiler's own record wins over the name
    ("trace_rank5.json", {"distributedInfo": {"rank": 3}}, "3"),
    ("trace_rank5.json", {"distributedInfo": {"world_size": 8}}, "5"),
    ("trace_rank5.json", {"distributedInfo": "rank 2"}, "5"),
    ("host_12.pt.trace.json", {}, "12"),
    ("worker-rank-7.json", {}, "7"),
    ("plain.json", {}, "4"),  # nothing says: the file's position
])
def test_the_rank_of_a_trace(name, data, rank):
    assert census.rank_of(Path(name), data, 4) == rank


def test_the_census_text_word_for_word(tmp_path):
    """`k3-amd-overlay census` without --json: per rank, the top kernels by time; with several ranks,
    their sum (census.py's rendering mutants survived)."""
    one = kernel_trace(tmp_path / "a_rank0.json", {"qk_cache_kernel": 3, "rmsnorm_pair_kernel": 1, "other": 2})
    two = kernel_trace(tmp_path / "b_rank1.json", {"qk_cache_kernel": 1})
    text = census.render(census.read_census([one, two]), top=2)
    assert text == "\n".join([
        "", "rank 0: 6 kernel launches, 12.0 µs",
        "| kernel | count | mean µs | total µs |", "|---|---|---|---|",
        "| qk_cache_kernel | 3 | 2.00 | 6.0 |", "| other | 2 | 2.00 | 4.0 |",
        "", "rank 1: 1 kernel launches, 2.0 µs",
        "| kernel | count | mean µs | total µs |", "|---|---|---|---|",
        "| qk_cache_kernel | 1 | 2.00 | 2.0 |",
        "", "all 2 ranks: 7 kernel launches",
        "| kernel | count | mean µs | total µs |", "|---|---|---|---|",
        "| qk_cache_kernel | 4 | 2.00 | 8.0 |", "| other | 2 | 2.00 | 4.0 |"])
    assert "all 1 ranks" not in census.render(census.read_census([one]))
    assert census.render(census.read_census([one])).count("| rmsnorm_pair_kernel | 1 | 2.00 | 2.0 |") == 1


def test_events_that_are_kernels_and_kernels_claimed_together(tmp_path):
    path = tmp_path / "t_rank0.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "Kernel", "name": "qk_cache_kernel", "dur": 2.0},  # the category in any case
        {"ph": "X", "cat": "gpu_op", "name": "qk_cache_kernel", "dur": 0},  # a launch, 0 µs
        {"ph": "X", "cat": "cpu_op", "name": "qk_cache_kernel", "dur": 9.0},
        {"ph": "B", "cat": "kernel", "name": "qk_cache_kernel", "dur": 9.0},
        {"ph": "X", "cat": "kernel", "name": "void vllm::concat_and_cache_mla_kernel<a>", "dur": 1.0},
        {"ph": "X", "cat": "kernel", "name": "void vllm::concat_and_cache_mla_kernel<b>", "dur": 3.0}]}))
    result = census.read_census([path])
    stats = result.total()["qk_cache_kernel"]
    assert (stats.count, stats.total_us) == (2, 2.0)
    assert census.name_claims(result, ("concat_and_cache_mla",)) == {  # two names, one pattern
        "concat_and_cache_mla": census.KernelStats(2, 4.0)}
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.pt.trace.json.gz").write_bytes(gzip.compress(path.read_bytes()))
    (tmp_path / "sub" / "x.json.bak").write_text("{}")
    assert census.trace_files([tmp_path / "sub"]) == [tmp_path / "sub" / "x.pt.trace.json.gz"]
    with pytest.raises(census.TraceError) as raised:
        census.trace_files([tmp_path / "sub" / "x.json.bak", tmp_path / "empty_dir_missing"])
    assert str(raised.value) == f"{tmp_path / 'empty_dir_missing'}: no such file or directory"
    (tmp_path / "e1").mkdir()
    (tmp_path / "e2").mkdir()
    with pytest.raises(census.TraceError) as raised:
        census.trace_files([tmp_path / "e1", tmp_path / "e2"])
    assert str(raised.value) == f"no .json or .json.gz trace found in {tmp_path / 'e1'}, {tmp_path / 'e2'}"


def test_expectations_parse_and_fail_word_for_word(tmp_path):
    assert census.parse_expectations(["qk_cache_kernel=12", "a=b=3"]) == [("qk_cache_kernel", 12), ("a=b", 3)]
    for bad in ("qk_cache_kernel", "=3", "x=", "x=-1", "x=1.5"):
        with pytest.raises(ValueError) as raised:
            census.parse_expectations([bad])
        assert str(raised.value) == (f"--expect {bad!r}: write NAME=COUNT (a kernel-name substring and a count "
                                     "per rank: 0 or more, in at most 18 ASCII digits)")
    result = census.read_census([kernel_trace(tmp_path / "t_rank0.json", {"qk_cache_kernel": 2})])
    assert census.check_expectations(result, [("qk_cache_kernel", 3)]) == [
        "rank 0: kernels matching 'qk_cache_kernel' ran 2 times, expected 3"]
    assert census.KernelStats().mean_us == 0.0 and census.KernelStats(2, 5.0) == census.KernelStats(2, 5.0)


@pytest.mark.parametrize("bad", ["k=\u00b2", "k=\u0663", "k=1\u00b9", "k=" + "9" * 5000])
def test_an_expect_count_of_other_than_ascii_digits_is_a_usage_error_naming_it(bad, tmp_path, capsys):
    """str.isdigit takes superscripts and other scripts' digits, which int() refuses (or reads as
    another number); a count is ASCII digits, and not so many that int() refuses them either."""
    with pytest.raises(ValueError) as raised:
        census.parse_expectations([bad])
    said = (f"--expect {bad!r}: write NAME=COUNT (a kernel-name substring and a count per rank: 0 or more, in at "
            "most 18 ASCII digits)")
    assert str(raised.value) == said
    trace = kernel_trace(tmp_path / "t_rank0.json", {"qk_cache_kernel": 2})
    assert main(["census", str(trace), "--expect", bad, "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["usage_error"] == said and said in err and "Traceback" not in err


def test_traces_from_several_directories_are_all_read(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"d{rank}").mkdir()
        kernel_trace(tmp_path / f"d{rank}" / f"t_rank{rank}.json", {"qk_cache_kernel": 1})
    assert sorted(census.read_census([tmp_path / "d0", tmp_path / "d1"]).ranks) == ["0", "1"]


def test_the_comparison_text_word_for_word(tmp_path):
    """`census --baseline`: a section per fusion with kernels in either trace (qk_cache's absent here,
    so the later sections must still come), its region and its per-layer, per-step time."""
    base = census.read_census([kernel_trace(tmp_path / "b_rank0.json", {"void vllm::rms_norm_kernel<x>": 8,
                                                                        ATTENTION: 4})])
    fused = census.read_census([kernel_trace(tmp_path / "f_rank0.json", {"rmsnorm_pair_kernel": 2, ATTENTION: 4})])
    assert census.render_comparison(base, fused, steps=2, layers=2) == "\n".join([
        "", "qkv_norm (summed over ranks; count × mean µs = total µs; counted by kernel name alone: the baseline "
            "and candidate traces have no k3_amd_overlay::qkv_norm ranges (the overlay off, or kernels replayed "
            "from CUDA graphs), so every matching kernel counts, in or out of the region (every GEMM, every "
            "RMSNorm); profile eager (--enforce-eager) with the overlay on, K3_AMD_OVERLAY=stock for the baseline, "
            "for the region's own kernels)",
        "| kernel | baseline | candidate |", "|---|---|---|",
        "| rms_norm_kernel | 8 × 2.00 = 16.0 | 0 × 0.00 = 0.0 |",
        "| rmsnorm_pair_kernel | 0 × 0.00 = 0.0 | 2 × 2.00 = 4.0 |",
        "qkv_norm region: 16.0 µs -> 4.0 µs (4.00x)",
        "qkv_norm region launches: 8 -> 2 (-6)",
        "per MLA layer per decode step and rank (2 layers x 2 steps): 4.00 µs -> 1.00 µs",
        "", "qk_cache: its own launch (qk_cache_kernel) did not run in the candidate (counted by kernel name): no "
            "section, no ratio",
        "", "absorb_qk_cache: its own launch (absorb_qk_cache_kernel, absorb_fp8_qk_cache_kernel, "
            "absorb_mxfp4_qk_cache_kernel, query_fp8_quant_kernel) did not run in the candidate (counted by kernel "
            "name): no section, no ratio",
        "", "kernel launches per rank per step: 6 -> 3 (-3, -50.0%)"])
    many = census.read_census([kernel_trace(tmp_path / "m_rank0.json", {f"k{i:02d}": 1 for i in range(30)})])
    assert census.render(many).count("| k") == 1 + 25  # the header, then the top 25 by default


def test_launches_are_compared_per_rank_of_each_side(tmp_path):
    """Two ranks a side, without steps (launches per rank: each side's sum over its ranks); a baseline
    with no kernel is no baseline: no launch change, no ratio."""
    base = census.read_census([kernel_trace(tmp_path / f"b_rank{r}.json", {
        "void vllm::rms_norm_kernel<x>": 4 + 2 * r, ATTENTION: 2}) for r in range(2)])
    fused = census.read_census([kernel_trace(tmp_path / f"f_rank{r}.json", {"rmsnorm_pair_kernel": 1, ATTENTION: 2},
                                             traceName=f"f_rank{r}.json") for r in range(2)])
    text = census.render_comparison(base, fused, steps=None, layers=2)
    assert "per MLA layer" not in text and "NO COMPARISON" not in text
    assert text.endswith("\nkernel launches per rank: 7 -> 3 (-4, -57.1%)")
    empty = census.read_census([kernel_trace(tmp_path / "e_rank0.json", {})])
    text = census.render_comparison(empty, census.read_census([tmp_path / "f_rank0.json"]), steps=None, layers=2)
    assert "kernel launches" not in text and "region" not in text
    assert "NO COMPARISON: the baseline's rank 0: the trace has no GPU kernel at all" in text


@pytest.mark.parametrize("argv,message", [
    (["--layers", "0"], "--layers 0: from 1 to 1000000000"),
    (["--steps", "-3"], "--steps -3: from 1 to 1000000000"),
    (["--steps", "1" + "0" * 400], "--steps 1" + "0" * 400 + ": from 1 to 1000000000"),  # overflowed a float before
    (["--layers", "1000000001"], "--layers 1000000001: from 1 to 1000000000"),
])
def test_census_nonsense_arguments_are_usage_errors(tmp_path, capsys, argv, message):
    trace = kernel_trace(tmp_path / "rank0.json", {"qk_cache_kernel": 2})
    assert main(["census", str(trace), *argv]) == 2
    assert message in capsys.readouterr().err


def test_census_refuses_an_empty_path_instead_of_scanning_the_current_directory(capsys):
    assert main(["census", ""]) == 2
    assert "an empty path was given" in capsys.readouterr().err


def test_census_flags_traces_of_a_different_rank_count(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    base = [kernel_trace(tmp_path / "b" / f"rank{r}.json", {"concat_and_cache_mla_kernel": 4}) for r in range(2)]
    cand = kernel_trace(tmp_path / "c" / "rank0.json", {"qk_cache_kernel": 4})
    assert main(["census", str(cand), "--baseline", *map(str, base)]) == 1
    out = capsys.readouterr().out
    assert ("NO COMPARISON: the baseline has 2 rank trace(s) (ranks 0, 1), the candidate 1 (ranks 0): different "
            "deployments") in out
    assert "region" not in out and "kernel launches per rank" not in out


def test_census_into_a_closed_pipe_stops_without_a_traceback(tmp_path):
    import subprocess
    import sys

    trace = kernel_trace(tmp_path / "rank0.json", {f"kernel_{i}": 1 for i in range(5000)})
    proc = subprocess.run(f"{sys.executable} -m k3_amd_overlay census {trace} | head -n 1", shell=True,
                          capture_output=True, text=True)
    assert proc.stdout.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def _ranged_trace(path: Path, steps: list[list[tuple[str | None, list[str]]]], ranges: bool = True) -> Path:
    """A Kineto-shaped trace file of ``steps`` (tests/kineto_traces.py)."""
    path.write_text(json.dumps({"traceEvents": ranged_events(steps, ranges)}))
    return path


GEMM = "Cijk_Ailk_Bljk_BBS_BH_MT64x64x64_MI16x16x16x1"  # hipBLASLt names every GEMM alike


def _layer(stock: bool) -> list[tuple[str | None, list[str]]]:
    """One K3 decoder layer of a decode step as vLLM runs it on ROCm: the model's own GEMMs and norms
    outside the overlay's ranges, the replaced regions inside them (stock: W_UK GEMM first)."""
    norms = ["void vllm::rms_norm_kernel<x>"] * 2 if stock else ["rmsnorm_pair_kernel"]
    decode = (["concat_and_cache_mla_kernel", GEMM, "CatArrayBatchedCopy",
               "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_0"] if stock else ["absorb_qk_cache_kernel"])
    return [(None, ["void vllm::fused_add_rms_norm_kernel<x>", GEMM]),  # input norm, q_a/kv_a projection
            ("k3_amd_overlay::qkv_norm", norms),
            (None, [GEMM]),  # q_b_proj
            ("k3_amd_overlay::mla_decode", [*decode, "mla_decode_stage1_kernel", GEMM]),  # ... MQA, then W_UV
            (None, [GEMM, "void vllm::fused_add_rms_norm_kernel<x>", GEMM, GEMM])]  # o_proj, norm, MoE


def test_the_census_counts_only_the_region_each_fusion_replaces(tmp_path):
    """Issue 21: by name, absorb_qk_cache's "Cijk_" claims every GEMM of the model and qkv_norm's
    "rms_norm_kernel" every RMSNorm; inside the overlay's ranges only the W_UK GEMM (before the
    region's own work, not W_UV after the attention kernel) and the q_a/kv_a norms count."""
    steps, layers = 3, 4

    def window(stock: bool, name: str, ranges: bool = True) -> census.Census:
        step = [block for _ in range(layers) for block in _layer(stock)]
        return census.read_census([_ranged_trace(tmp_path / name, [step] * steps, ranges)])

    base, fused = window(True, "b_rank0.json"), window(False, "f_rank0.json")
    n = steps * layers
    assert len(base.regions["0"]) == 2 * n and len(fused.regions["0"]) == 2 * n
    absorb = census.region_claims(base, "absorb_qk_cache", ("Cijk_", "absorb_qk_cache_kernel"))
    assert absorb["Cijk_"].count == n  # the W_UK GEMM only: not W_UV, q_b_proj, o_proj, MoE
    assert census.region_claims(fused, "absorb_qk_cache", ("Cijk_",))["Cijk_"].count == 0  # W_UV stays
    text = census.render_comparison(base, fused, steps=steps, layers=layers)
    assert f"| Cijk_ | {n} × 2.00 = {2.0 * n:.1f} | 0 × 0.00 = 0.0 |" in text
    assert f"| rms_norm_kernel | {2 * n} × 2.00 = {4.0 * n:.1f} | 0 × 0.00 = 0.0 |" in text
    assert "qkv_norm (summed over ranks; count × mean µs = total µs; counted inside the overlay's " \
           "k3_amd_overlay::qkv_norm ranges)" in text
    assert f"absorb_qk_cache region: {8.0 * n:.1f} µs -> {2.0 * n:.1f} µs (4.00x)" in text
    named = census.render_comparison(window(True, "bn_rank0.json", False), window(False, "fn_rank0.json", False),
                                     steps=steps, layers=layers)
    # the planted fault the ranges fix: by name, 7 GEMMs per layer in the baseline, 6 in the fused arm,
    # and the region's 4.00x reads 1.43x
    assert f"| Cijk_ | {7 * n} × 2.00 = {14.0 * n:.1f} | {6 * n} × 2.00 = {12.0 * n:.1f} |" in named
    assert "counted by kernel name alone" in named and "absorb_qk_cache region: 240.0 µs -> 168.0 µs (1.43x)" in named


REGION_TRACES = Path(__file__).parent / "data"


def test_real_h200_traces_counted_by_region_not_by_name():
    """Real profiler traces (torch 2.11, NVIDIA H200; scripts/make_region_traces.py): 3 decode steps
    x 4 decoder layers through the overlay's own sites, stock and fused, amid the model's other GEMMs
    (cuBLASLt's nvjet kernels: q_a, q_b, W_UK, W_UV, o_proj, a MoE batch) and norms
    (``fused_add_rms_norm_kernel`` around each layer). Inside the ranges: exactly the 12 W_UK GEMMs,
    the 24 q_a/kv_a norms; by name the same traces claim 72 GEMMs and 48 norms."""
    stock = census.read_census([REGION_TRACES / "region-stock-rank0.json.gz"])
    fused = census.read_census([REGION_TRACES / "region-fused-rank0.json.gz"])
    absorb = ("nvjet", "concat_and_cache_mla", "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal",
              "absorb_qk_cache_kernel")
    counts = {side: {p: s.count for p, s in census.region_claims(c, "absorb_qk_cache", absorb).items()}
              for side, c in (("stock", stock), ("fused", fused))}
    assert counts == {"stock": {"nvjet": 12, "concat_and_cache_mla": 12,
                                "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal": 12, "absorb_qk_cache_kernel": 0},
                      "fused": {"nvjet": 0, "concat_and_cache_mla": 0,
                                "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal": 0, "absorb_qk_cache_kernel": 12}}
    norms = ("rms_norm_kernel", "rmsnorm_pair_kernel")
    assert {p: s.count for p, s in census.region_claims(stock, "qkv_norm", norms).items()} == {
        "rms_norm_kernel": 24, "rmsnorm_pair_kernel": 0}
    assert {p: s.count for p, s in census.region_claims(fused, "qkv_norm", norms).items()} == {
        "rms_norm_kernel": 0, "rmsnorm_pair_kernel": 12}
    assert (stock.matching("nvjet").count, fused.matching("nvjet").count) == (72, 60)  # what names alone see
    assert stock.matching("rms_norm_kernel").count == 48
    text = census.render_comparison(stock, fused, steps=3, layers=4)
    assert "| nvjet | 12 × " in text and "counted inside the overlay's k3_amd_overlay::mla_decode ranges" in text


def test_an_aiter_on_stock_trace_counts_vllms_fp8_w_uk_gemm_and_its_own_fused_decode(tmp_path):
    """vLLM 0.32+ with AITER on runs its own fused decode in stock traces too (K3_AMD_OVERLAY=stock
    turns it off; auto defers to it): the fp8 W_UK GEMM (AITER's batched_gemm_a8w8, also used for
    W_UV after the attention kernel) then AITER's fused write. Inside the decode range only the first
    GEMM is the absorption; against the overlay's absorbed launch the region is W_UK + AITER's launch."""
    w_gemm = "_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel"
    aiter_on = [(None, [w_gemm]),  # q_b_proj through the same AITER GEMM family: outside the range
                ("k3_amd_overlay::mla_decode", [w_gemm, "void aiter::fuse_qk_rope_concat_and_cache_mla_kernel<bf16>",
                                                "mla_a8w8_decode_kernel", w_gemm])]
    fused = [(None, [w_gemm]), ("k3_amd_overlay::mla_decode", ["absorb_fp8_qk_cache_kernel", "mla_a8w8_decode_kernel",
                                                               w_gemm])]
    base = census.read_census([_ranged_trace(tmp_path / "b_rank0.json", [aiter_on * 24] * 2)])
    cand = census.read_census([_ranged_trace(tmp_path / "f_rank0.json", [fused * 24] * 2)])
    patterns = ("batched_gemm_a8w8", "fuse_qk_rope_concat_and_cache_mla", "absorb_fp8_qk_cache_kernel")
    assert {p: s.count for p, s in census.region_claims(base, "absorb_qk_cache", patterns).items()} == {
        "batched_gemm_a8w8": 48, "fuse_qk_rope_concat_and_cache_mla": 48, "absorb_fp8_qk_cache_kernel": 0}
    assert {p: s.count for p, s in census.region_claims(cand, "absorb_qk_cache", patterns).items()} == {
        "batched_gemm_a8w8": 0, "fuse_qk_rope_concat_and_cache_mla": 0, "absorb_fp8_qk_cache_kernel": 48}
    assert base.matching("batched_gemm_a8w8").count == 144  # by name: q_b_proj, W_UK and W_UV alike
