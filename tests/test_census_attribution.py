"""Issue 27, item 5: the census credits each kernel to exactly one fusion, the one whose launch
replaced it, and a fusion only where its own launch ran in the candidate; each ``--expect`` is
judged on its own; ``--json`` carries the comparison; and no ratio comes from empty, partial or
foreign evidence (one arm with a region's ranges and one without, nested ranges, different rank
sets, two traces of one rank, fewer ranks than the world size, arms on different GPUs, an empty
trace, a baseline that ran the fused launch). On the committed H200 traces in tests/data and on
small Kineto-shaped traces built here."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from kineto_traces import ATTENTION, kernel_trace, ranged_events, with_kernels

from k3_amd_overlay.commands import census
from k3_amd_overlay.commands.cli import main

DATA = Path(__file__).parent / "data"
GRAPH_BASE, GRAPH_FUSED = DATA / "trace-baseline-rank0.json.gz", DATA / "trace-fused-rank0.json.gz"
REGION_STOCK, REGION_FUSED = DATA / "region-stock-rank0.json.gz", DATA / "region-fused-rank0.json.gz"
DECODE, NORM = "k3_amd_overlay::mla_decode", "k3_amd_overlay::qkv_norm"
GEMM = "Cijk_Ailk_Bljk_BBS_BH_MT64x64x64_MI16x16x16x1"
DECODES = {  # one decode range per layer; each ends with the attention kernel and the W_UV GEMM
    "stock": ["concat_and_cache_mla_kernel", GEMM, "CatArrayBatchedCopy",
              "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_0"],
    "qk_cache": [GEMM, "qk_cache_kernel"],  # the W_UK GEMM stays; the KV write, concat and quant are one launch
    "absorb": ["absorb_qk_cache_kernel"],
}


def _trace(path: Path, layers: list[str], ranges: bool = True, nest: bool = False) -> Path:
    """A Kineto-shaped trace: per layer a model GEMM outside the ranges, then a decode range of the
    given kind (kernels linked to their launches by correlation id). ``nest`` opens a second decode
    range inside the first one."""
    steps = [[(None, [GEMM]), (DECODE, [*DECODES[kind], "mla_decode_stage1_kernel", GEMM])] for kind in layers]
    events = ranged_events(steps, ranges)
    if nest:
        outer = next(e for e in events if e["name"] == DECODE)
        events.append({**outer, "ts": outer["ts"] + 4, "dur": outer["dur"] - 8})
    path.write_text(json.dumps({"traceEvents": events, "traceName": str(path)}))  # as each rank's own names it
    return path


def _read(*paths: Path) -> census.Census:
    return census.read_census(list(paths))


def _rerun(path: Path) -> census.Census:
    """The trace at ``path`` as another run of the same work writes it (its own name in it, so not a
    byte-for-byte copy: the census refuses one trace standing for both arms)."""
    again = path.with_name(f"again_{path.name}")
    again.write_text(json.dumps({**json.loads(path.read_text()), "traceName": str(again)}))
    return _read(again)


def _graph_window(tmp_path: Path) -> tuple[census.Census, census.Census]:
    """The committed graph traces (the region alone), each given the attention kernel of its 4 steps x
    3 layers, which a serving window holds: the kernel no fusion touches that shows the windows match."""
    base, fused = (_read(with_kernels(trace, tmp_path / f"{arm}-rank0.json", {ATTENTION: 12}))
                   for arm, trace in (("base", GRAPH_BASE), ("fused", GRAPH_FUSED)))
    return base, fused


def test_the_shipped_graph_traces_credit_only_the_launch_that_ran(tmp_path):
    """Only qk_cache_kernel ran: qk_cache's section and ratio, and none for absorb_qk_cache (the old
    census printed "absorb_qk_cache region: 57.7 µs -> 15.1 µs (3.83x)")."""
    base, fused = _graph_window(tmp_path)
    text = census.render_comparison(base, fused, steps=4, layers=3)
    assert "absorb_qk_cache region" not in text and "absorb_qk_cache (summed" not in text
    assert "qk_cache region: 57.7 µs -> 15.1 µs (3.83x)" in text
    assert text.count("| concat_and_cache_mla |") == 1
    comparison = census.compare(base, fused, steps=4, layers=3)
    assert [s.fusions for s in comparison.sections] == [("qk_cache",)] and comparison.holds
    assert comparison.not_run["absorb_qk_cache"].startswith(
        "absorb_qk_cache: its own launch (absorb_qk_cache_kernel, ") and "no section, no ratio" in text


def test_the_region_traces_count_each_removed_kernel_once_in_the_absorbed_launch():
    """The absorbed launch ran: its removed kernels are its own, listed once; qk_cache gets no section
    (the old census printed "qk_cache ... 2.74 µs -> 0.00 µs" over the same kernels)."""
    text = census.render_comparison(_read(REGION_STOCK), _read(REGION_FUSED), steps=3, layers=4)
    assert "\nqk_cache (summed" not in text and "-> 0.00 µs" not in text
    for row in ("| concat_and_cache_mla |", "| triton_poi_fused__to_copy_cat_clamp_mul_reciprocal |", "| nvjet |"):
        assert text.count(row) == 1, row
    assert "absorb_qk_cache region: 65.1 µs -> 33.8 µs (1.93x)" in text
    assert "absorb_qk_cache region launches: 36 -> 12 (-24)" in text
    comparison = census.compare(_read(REGION_STOCK), _read(REGION_FUSED), steps=3, layers=4)
    assert [s.fusions for s in comparison.sections] == [("absorb_qk_cache",), ("qkv_norm",)]
    assert comparison.not_run["qk_cache"].endswith(
        "; the absorb_qk_cache launch did its work, and the kernels that launch removed are counted once, in "
        "absorb_qk_cache's section")


def test_where_both_launches_ran_each_stock_kernel_counts_once(tmp_path):
    """Half the layers took the absorbed launch, half qk_cache's: the baseline's stock kernels cannot
    be split by the launch that replaced them, so one section holds both, each kernel once."""
    base = _read(_trace(tmp_path / "b_rank0.json", ["stock"] * 8))
    cand = _read(_trace(tmp_path / "c_rank0.json", ["qk_cache", "absorb"] * 4))
    text = census.render_comparison(base, cand, steps=2, layers=4)
    assert text.count("| concat_and_cache_mla | 8 × 2.00 = 16.0 | 0 × 0.00 = 0.0 |") == 1
    assert "| Cijk_ | 8 × 2.00 = 16.0 | 4 × 2.00 = 8.0 |" in text  # the W_UK GEMM stays where qk_cache ran
    assert "qk_cache + absorb_qk_cache region: 64.0 µs -> 24.0 µs (2.67x)" in text
    comparison = census.compare(base, cand, steps=2, layers=4)
    assert [s.fusions for s in comparison.sections] == [("qk_cache", "absorb_qk_cache")]
    assert comparison.sections[0].launched == {"qk_cache": 4, "absorb_qk_cache": 4}
    assert "qk_cache region:" not in text.replace("qk_cache + absorb_qk_cache region:", "")


def test_each_expect_is_judged_on_its_own(tmp_path, capsys):
    args = ["census", str(REGION_FUSED), "--expect", "absorb_qk_cache_kernel=12", "--expect", "rmsnorm_pair_kernel=13",
            "--expect", "qk_cache_kernel=12"]
    assert main(args) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("expect ", "FAIL "))]
    assert lines == [
        "expect absorb_qk_cache_kernel=12 per rank: ok (rank 0: 12)",
        "expect rmsnorm_pair_kernel=13 per rank: FAILED (rank 0: 12)",
        "FAIL rank 0: kernels matching 'rmsnorm_pair_kernel' ran 12 times, expected 13",
        # the absorbed kernel's name contains "qk_cache_kernel": it is not a qk_cache launch
        "expect qk_cache_kernel=12 per rank: FAILED (rank 0: 0)",
        "FAIL rank 0: kernels matching 'qk_cache_kernel' ran 0 times, expected 12"]
    assert main(["census", str(REGION_FUSED), "--expect", "absorb_qk_cache_kernel=12"]) == 0


def test_expect_counts_a_kernel_under_its_own_name_only(tmp_path):
    trace = tmp_path / "t_rank0.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": n, "dur": 1.0} for n in (
            "void vllm::concat_and_cache_mla_kernel<bf16>",
            "void aiter::fuse_qk_rope_concat_and_cache_mla_kernel<bf16>", "absorb_fp8_qk_cache_kernel",
            "qk_cache_kernel")]}))
    assert census.check_expectations(_read(trace), [("concat_and_cache_mla_kernel", 1), ("qk_cache_kernel", 1)]) == []
    judged = census.judge_expectations(_read(trace), [("concat_and_cache_mla_kernel", 1), ("qk_cache_kernel", 1),
                                                      ("qk_cache", 1), ("absorb", 1)])
    assert [(j.name, j.ranks, j.kernels, j.holds) for j in judged] == [
        ("concat_and_cache_mla_kernel", {"0": 1}, ["void vllm::concat_and_cache_mla_kernel<bf16>"], True),
        ("qk_cache_kernel", {"0": 1}, ["qk_cache_kernel"], True),
        # a NAME that holds no pattern of the table is a plain substring
        ("qk_cache", {"0": 2}, ["absorb_fp8_qk_cache_kernel", "qk_cache_kernel"], False),
        ("absorb", {"0": 1}, ["absorb_fp8_qk_cache_kernel"], True)]


def test_json_carries_the_comparison(capsys):
    assert main(["census", str(REGION_FUSED), "--baseline", str(REGION_STOCK), "--steps", "3", "--layers", "4",
                 "--expect", "absorb_qk_cache_kernel=12", "--expect", "rmsnorm_pair_kernel=13", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    comparison = data["comparison"]
    assert comparison["holds"] is True and comparison["problems"] == []
    absorb, norm = comparison["sections"]
    assert absorb["fusions"] == ["absorb_qk_cache"] and absorb["region"] == DECODE
    assert absorb["counted"] == "inside ranges" and absorb["launched"] == {"absorb_qk_cache": 12}
    rows = {row["kernel"]: (row["kind"], row["baseline"]["count"], row["candidate"]["count"])
            for row in absorb["kernels"]}
    assert rows == {"concat_and_cache_mla": ("removes", 12, 0),
                    "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal": ("removes", 12, 0),
                    "nvjet": ("removes", 12, 0), "absorb_qk_cache_kernel": ("adds", 0, 12)}
    assert (absorb["baseline"]["count"], absorb["candidate"]["count"], absorb["launch_change"]) == (36, 12, -24)
    assert absorb["ratio"] == pytest.approx(absorb["baseline"]["total_us"] / absorb["candidate"]["total_us"], abs=1e-3)
    assert round(absorb["ratio"], 2) == 1.93
    assert absorb["per_layer_step_us"]["layers"] == 4 and absorb["per_layer_step_us"]["candidate"] == pytest.approx(
        absorb["candidate"]["total_us"] / 12, abs=1e-3)
    assert norm["fusions"] == ["qkv_norm"] and norm["launch_change"] == -12
    assert set(comparison["not_run"]) == {"qk_cache"}
    assert comparison["launches"] == {"unit": "per rank per step", "baseline": pytest.approx(103, abs=0.5),
                                      "candidate": pytest.approx(91, abs=0.5), "change": -12.0,
                                      "percent": pytest.approx(-11.65, abs=0.01)}
    assert [(i["name"], i["holds"], i["ranks"]) for i in data["expect"]["items"]] == [
        ("absorb_qk_cache_kernel", True, {"0": 12}), ("rmsnorm_pair_kernel", False, {"0": 12})]
    assert data["expect"]["holds"] is False


@pytest.mark.parametrize("base_ranges,cand_ranges", [(False, True), (True, False)])
def test_one_arm_with_the_ranges_and_one_without_gives_no_ratio(tmp_path, capsys, base_ranges, cand_ranges):
    base = _trace(tmp_path / "b_rank0.json", ["stock"] * 4, ranges=base_ranges)
    cand = _trace(tmp_path / "c_rank0.json", ["absorb"] * 4, ranges=cand_ranges)
    assert main(["census", str(cand), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "region:" not in out and f"NO COMPARISON: {DECODE}: only some traces have its ranges" in out
    comparison = census.compare(_read(base), _read(cand), steps=1, layers=4)
    assert not comparison.holds and not comparison.sections
    assert comparison.problems == [
        f"{DECODE}: only some traces have its ranges (the baseline: {'every rank' if base_ranges else 'none'}; the "
        f"candidate: {'every rank' if cand_ranges else 'none'}): one arm counted by range and the other by name would "
        "credit kernels outside the region; " + census.PROFILE_ALIKE]


def test_some_ranks_with_the_ranges_and_others_without_give_no_ratio(tmp_path):
    base = [_trace(tmp_path / f"b_rank{r}.json", ["stock"] * 2) for r in range(2)]
    cand = [_trace(tmp_path / f"c_rank{r}.json", ["absorb"] * 2, ranges=r == 0) for r in range(2)]
    assert "region:" not in census.render_comparison(_read(*base), _read(*cand), steps=None, layers=2)
    comparison = census.compare(_read(*base), _read(*cand), steps=None, layers=2)
    assert not comparison.sections and not comparison.holds
    assert comparison.problems[0].startswith(f"{DECODE}: only some traces have its ranges (the baseline: every rank; "
                                             "the candidate: ranks 0)")


def test_nested_ranges_give_no_ratio(tmp_path):
    base = _read(_trace(tmp_path / "b_rank0.json", ["stock"] * 4))
    cand = _read(_trace(tmp_path / "c_rank0.json", ["absorb"] * 4, nest=True))
    assert "region:" not in census.render_comparison(base, cand, steps=None, layers=4)
    assert cand.nested == {"0": [(DECODE, DECODE)]}
    comparison = census.compare(base, cand, steps=None, layers=4)
    assert not comparison.sections and not comparison.holds
    assert comparison.problems == [
        f"{DECODE}: the candidate has 1 overlay range(s) opened inside another (rank 0: {DECODE} inside {DECODE}); "
        "the overlay never nests them (a site patched twice, or another tool's ranges under its name?), so its "
        "kernels cannot be attributed"]
    assert census.compare(cand, base, steps=None, layers=4).problems[0].startswith(f"{DECODE}: the baseline has 1 ")


def test_different_rank_sets_give_no_ratio(tmp_path, capsys):
    paths = [_trace(tmp_path / f"{arm}_rank{r}.json", [kind]) for arm, kind, ranks in (
        ("b", "stock", (0, 1)), ("c", "absorb", (2, 3))) for r in ranks]
    assert main(["census", *map(str, paths[2:]), "--baseline", *map(str, paths[:2])]) == 1
    assert "region:" not in capsys.readouterr().out
    base, cand = _read(*paths[:2]), _read(*paths[2:])
    comparison = census.compare(base, cand, steps=None, layers=1)
    assert not comparison.sections and comparison.launches is None and not comparison.holds
    assert comparison.problems == ["the baseline has 2 rank trace(s) (ranks 0, 1), the candidate 2 (ranks 2, 3): "
                                   "different deployments; profile both arms with the same parallelism, one trace "
                                   "per rank"]


def test_an_empty_trace_proves_nothing(tmp_path, capsys):
    empty = tmp_path / "e_rank0.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    cand = _trace(tmp_path / "c_rank0.json", ["absorb"])
    assert main(["census", str(empty), "--expect", "qk_cache_kernel=0"]) == 1
    assert "expect qk_cache_kernel=0 per rank: FAILED (rank 0: 0)" in capsys.readouterr().out
    for base, arm in ((empty, "baseline"), (cand, "candidate")):
        other = cand if base == empty else empty
        comparison = census.compare(_read(base), _read(other), steps=None, layers=1)
        assert comparison.problems == [f"the {arm}'s " + census.EMPTY.format(rank="0")] and not comparison.holds
        assert comparison.launches is None
    assert census.compare(census.Census(), _read(cand), steps=None, layers=1).problems == ["the baseline has no trace"]


def test_a_baseline_that_ran_the_fused_launch_is_no_baseline(tmp_path):
    path = _trace(tmp_path / "c_rank0.json", ["absorb"] * 2)
    fused, again = _read(path), _rerun(path)
    assert "region:" not in census.render_comparison(again, fused, steps=None, layers=2)
    comparison = census.compare(again, fused, steps=None, layers=2)
    assert not comparison.sections and not comparison.holds
    assert comparison.problems == [f"absorb_qk_cache: the baseline ran the fused launch too (absorb_qk_cache_kernel 2 "
                                   f"inside its {DECODE} ranges): not an unfused baseline; profile it with "
                                   "K3_AMD_OVERLAY=stock"]


def test_a_candidate_where_no_fused_launch_ran_gives_no_ratio(tmp_path, capsys):
    stock = _trace(tmp_path / "s_rank0.json", ["stock"] * 2)
    assert main(["census", str(stock), "--baseline", str(stock)]) == 1
    assert "region:" not in capsys.readouterr().out
    comparison = census.compare(_rerun(stock), _read(stock), steps=None, layers=2)
    assert not comparison.sections and not comparison.holds
    assert comparison.problems == ["no fusion's own launch ran in the candidate: nothing to compare"]


def test_a_baseline_without_the_removed_kernels_gives_no_ratio(tmp_path):
    gemm_only = tmp_path / "b_rank0.json"
    gemm_only.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "other", "dur": 1.0}]}))
    assert "region:" not in census.render_comparison(_read(gemm_only), _read(GRAPH_FUSED), steps=None, layers=1)
    comparison = census.compare(_read(gemm_only), _read(GRAPH_FUSED), steps=None, layers=1)
    assert not comparison.sections and not comparison.holds
    assert comparison.problems[0].startswith("qk_cache: the baseline has none of the kernels its launch replaces (")


def test_kernels_without_durations_give_no_ratio(tmp_path):
    base = _read(_trace(tmp_path / "b_rank0.json", ["stock"] * 2))
    path = _trace(tmp_path / "c_rank0.json", ["absorb"] * 2)
    data = json.loads(path.read_text())
    for event in data["traceEvents"]:
        if event["cat"] == "kernel":
            event["dur"] = 0.0
    path.write_text(json.dumps(data))
    comparison = census.compare(base, _read(path), steps=None, layers=2)
    assert not comparison.holds and not comparison.sections  # before, a section without a ratio held
    assert comparison.problems == [f"absorb_qk_cache: the candidate's kernels inside its {DECODE} ranges carry no "
                                   "duration (every dur 0): no ratio to give"]
    assert "region:" not in census.render_comparison(base, _read(path), steps=None, layers=2)


ONE_SESSION = "keep one profiler session per directory, one trace per rank"


def _verdict_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("expect ", "FAIL "))]


def test_two_traces_of_one_rank_are_refused(tmp_path, capsys):
    """Two profiler sessions in one directory, an older fused one and the newest stock: summed, rank 0
    "ran" qk_cache_kernel 12 times where the newest ran it 0 times. Refused, both files named, as
    the candidate of ``--expect`` and as either arm of a comparison."""
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    older, newest = (sessions / f"host_1.rank0.{stamp}.pt.trace.json.gz" for stamp in (1733000000, 1733999999))
    shutil.copy(GRAPH_FUSED, older)
    shutil.copy(GRAPH_BASE, newest)
    assert main(["census", str(newest), "--expect", "qk_cache_kernel=12"]) == 1
    capsys.readouterr()
    assert main(["census", str(sessions), "--expect", "qk_cache_kernel=12"]) == 1
    two = f"rank 0: 2 traces ({older}, {newest}) would be summed as one; {ONE_SESSION}"
    assert _verdict_lines(capsys.readouterr().out) == [
        "expect qk_cache_kernel=12 per rank: FAILED (rank 0: 12)", f"FAIL {two}"]
    assert main(["census", str(sessions), "--baseline", str(GRAPH_BASE)]) == 1
    out = capsys.readouterr().out
    assert f"NO COMPARISON: the candidate's {two}" in out and "region:" not in out
    assert census.compare(_read(sessions), _read(GRAPH_FUSED), steps=None, layers=1).problems == [
        f"the baseline's {two}", f"{older} (baseline) and {GRAPH_FUSED} (candidate): the same trace byte for byte, so "
        "one run's kernels would stand for both arms; profile each arm in its own run"]
    assert census.compare(*_graph_window(tmp_path), steps=None, layers=1).holds  # one session a side
    assert main(["census", str(sessions)]) == 0  # a table, no verdict: it says what it summed
    assert capsys.readouterr().err == f"warning: {two}\n"


def _rank_trace(path: Path, kernels: dict[str, int], rank: int, world_size: object) -> Path:
    return kernel_trace(path, kernels, distributedInfo={"backend": "nccl", "rank": rank, "world_size": world_size})


def test_fewer_ranks_than_the_world_size_are_refused(tmp_path, capsys):
    """One trace of rank 0 of 8 does not pass "every rank"; all 8 do. Both arms missing a rank give no
    ratio, each named."""
    every = [_rank_trace(tmp_path / f"c_rank{r}.json", {"qk_cache_kernel": 12}, r, 8) for r in range(8)]
    assert main(["census", str(every[0]), "--expect", "qk_cache_kernel=12"]) == 1
    assert _verdict_lines(capsys.readouterr().out) == [
        "expect qk_cache_kernel=12 per rank: FAILED (rank 0: 12)",
        "FAIL ranks 1, 2, 3, 4, 5, 6, 7: no trace, though distributedInfo gives world size 8: a verdict would rest "
        "on 1 of its 8 ranks; profile every rank, one trace per rank"]
    assert main(["census", *map(str, every), "--expect", "qk_cache_kernel=12"]) == 0
    base = _rank_trace(tmp_path / "b_rank0.json", {"concat_and_cache_mla_kernel": 4}, 0, 2)
    cand = _rank_trace(tmp_path / "f_rank0.json", {"qk_cache_kernel": 4}, 0, 2)
    missing = ("rank 1: no trace, though distributedInfo gives world size 2: a verdict would rest on 1 of its 2 "
               "ranks; profile every rank, one trace per rank")
    assert census.compare(_read(base), _read(cand), steps=None, layers=1).problems == [
        f"the baseline's {missing}", f"the candidate's {missing}"]
    assert main(["census", str(cand), "--baseline", str(base)]) == 1
    assert "region:" not in capsys.readouterr().out


def test_traces_disagreeing_on_the_world_size_or_without_a_valid_one(tmp_path, capsys):
    """Ranks of two deployments (world sizes 2 and 4) are refused; a world size that is no number of
    ranks is a clear error naming the file and the value."""
    mixed = [_rank_trace(tmp_path / f"rank{r}.json", {"qk_cache_kernel": 1}, r, 2 * (r + 1)) for r in range(2)]
    assert census.check_expectations(_read(*mixed), [("qk_cache_kernel", 1)]) == [
        f"traces disagree on the world size (distributedInfo): 2 in {mixed[0]}, 4 in {mixed[1]}; {ONE_SESSION}"]
    for bad in ("8", 0, True):
        trace = _rank_trace(tmp_path / "bad_rank0.json", {"qk_cache_kernel": 1}, 0, bad)
        assert main(["census", str(trace)]) == 2
        err = capsys.readouterr().err
        assert (f"{trace}: distributedInfo world_size {bad!r} is not a number of ranks (a whole number, 1 or more)"
                in err and "Traceback" not in err)


def test_arms_on_different_gpus_give_no_ratio(tmp_path, capsys):
    """The committed H200 region traces with the baseline's GPU named an MI300X: no 1.93x; the same
    baseline without deviceProperties still compares (the check holds only where both arms name one)."""
    data = json.loads(gzip.decompress(REGION_STOCK.read_bytes()))
    data["deviceProperties"] = [{**data["deviceProperties"][0], "name": "AMD Instinct MI300X"}]
    mi300x = tmp_path / "mi300x_rank0.json"
    mi300x.write_text(json.dumps(data))
    assert main(["census", str(REGION_FUSED), "--baseline", str(mi300x), "--steps", "3", "--layers", "4"]) == 1
    out = capsys.readouterr().out
    assert "absorb_qk_cache region:" not in out and "kernel launches per rank" not in out
    assert census.compare(_read(mi300x), _read(REGION_FUSED), steps=3, layers=4).problems == [
        "the baseline ran on AMD Instinct MI300X, the candidate on NVIDIA H200 (deviceProperties): kernel times of "
        "different GPUs say nothing of a fusion; profile both arms on the same GPU"]
    del data["deviceProperties"]
    unnamed = tmp_path / "unnamed_rank0.json"
    unnamed.write_text(json.dumps(data))
    assert census.compare(_read(unnamed), _read(REGION_FUSED), steps=3, layers=4).holds
