"""The census's contract, pinned exactly (issue 27 item 9): the JSON of a comparison, of an
expectation and of an empty comparison (every key, values rounded to a thousandth from durations
with more digits); every message word for word; which kernel a range gets at its boundaries
(launched exactly at a range's start or end, ranges touching, a zero-length range, events without
``cat``/``name``); an event whose ``ts``, ``dur`` or ``correlation`` the census reads and cannot
(missing, null, text, not finite, a negative duration) refused by name, on the CLI too; a kernel
without a launch that must not stop the ones after it; every GEMM pattern as profilers name it; one
region's problem leaving the other regions judged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kineto_traces import ranged_events

from k3_amd_overlay.commands import census
from k3_amd_overlay.commands.cli import main
from k3_amd_overlay.commands.verdict import DOES_THE_WORK_OF

DECODE, NORM = "k3_amd_overlay::mla_decode", "k3_amd_overlay::qkv_norm"
GEMM = "Cijk_Ailk_Bljk_BBS_BH_MT64x64x64_MI16x16x16x1"
ROPE = "void vllm::rotary_embedding_kernel<bf16>"  # claimed by no fusion: must not stop the count after it
RMS = "void vllm::rms_norm_kernel<bf16>"
TRITON = "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_0"
DURATIONS = {RMS: 1.23456, "concat_and_cache_mla_kernel": 2.34567, "CatArrayBatchedCopy": 3.45678, TRITON: 4.56789,
             GEMM: 5.67891, "mla_decode_stage1_kernel": 6.78912, "rmsnorm_pair_kernel": 1.98765,
             "absorb_qk_cache_kernel": 7.12345, ROPE: 0.98765, "qk_cache_kernel": 3.21987}
NORMS = {"stock": [RMS, RMS], "fused": ["rmsnorm_pair_kernel"]}
DECODES = {"stock": [ROPE, GEMM, "concat_and_cache_mla_kernel", "CatArrayBatchedCopy", TRITON],
           "qk_cache": [GEMM, "qk_cache_kernel"], "absorb": ["absorb_qk_cache_kernel"]}


def _arm(path: Path, layers: list[tuple[str, str]], steps: int = 1, extra: int = 0, drop: tuple[str, ...] = (),
         nest: str | None = None) -> census.Census:
    """One rank's trace: per step and layer (norm kind, decode kind) a model GEMM outside the ranges,
    the qkv_norm range, the decode range (ending with the attention kernel and the W_UV GEMM); then
    ``extra`` kernels outside any range. ``drop`` leaves out those regions' ranges; ``nest`` opens a
    second range of that region inside its first one."""
    step = [block for norm, decode in layers for block in (
        (None, [GEMM]), (NORM, NORMS[norm]), (DECODE, [*DECODES[decode], "mla_decode_stage1_kernel", GEMM]))]
    events = ranged_events([step] * steps + [[(None, ["sampler_kernel"] * extra)]], durations=DURATIONS)
    events = [e for e in events if e["name"] not in drop]
    if nest:
        outer = next(e for e in events if e["name"] == nest)
        events.append({**outer, "ts": outer["ts"] + 1, "dur": outer["dur"] - 2})
    path.write_text(json.dumps({"traceEvents": events, "traceName": str(path)}))  # as each rank's own names it
    return census.read_census([path])


def _stats(count: int, total_us: float, mean_us: float) -> dict[str, Any]:
    return {"count": count, "total_us": total_us, "mean_us": mean_us}


NONE = _stats(0, 0.0, 0.0)


def test_the_comparison_json_exactly(tmp_path):
    """Every key and value of a comparison that holds: 3 steps x 2 layers, durations with five
    decimals, launch counts that are not multiples of the steps; the same traces without ranges are
    counted by name."""
    layers = [("stock", "stock")] * 2
    base = _arm(tmp_path / "b_rank0.json", layers, steps=3, extra=2)
    cand = _arm(tmp_path / "c_rank0.json", [("fused", "absorb")] * 2, steps=3, extra=4)
    assert census.compare(base, cand, steps=3, layers=2).to_json() == {
        "holds": True, "problems": [],
        "sections": [
            {"fusions": ["absorb_qk_cache"], "region": DECODE, "counted": "inside ranges",
             "kernels": [
                 {"kernel": "concat_and_cache_mla", "kind": "removes", "baseline": _stats(6, 14.074, 2.346),
                  "candidate": NONE},
                 {"kernel": "CatArrayBatchedCopy", "kind": "removes", "baseline": _stats(6, 20.741, 3.457),
                  "candidate": NONE},
                 {"kernel": "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal", "kind": "removes",
                  "baseline": _stats(6, 27.407, 4.568), "candidate": NONE},
                 {"kernel": "Cijk_", "kind": "removes", "baseline": _stats(6, 34.073, 5.679), "candidate": NONE},
                 {"kernel": "absorb_qk_cache_kernel", "kind": "adds", "baseline": NONE,
                  "candidate": _stats(6, 42.741, 7.123)}],
             "baseline": _stats(24, 96.296, 4.012), "candidate": _stats(6, 42.741, 7.123), "ratio": 2.253,
             "launch_change": -18, "launched": {"absorb_qk_cache": 6},
             "per_layer_step_us": {"layers": 2, "steps": 3, "baseline": 16.049, "candidate": 7.123}},
            {"fusions": ["qkv_norm"], "region": NORM, "counted": "inside ranges",
             "kernels": [
                 {"kernel": "rms_norm_kernel", "kind": "removes", "baseline": _stats(12, 14.815, 1.235),
                  "candidate": NONE},
                 {"kernel": "rmsnorm_pair_kernel", "kind": "adds", "baseline": NONE,
                  "candidate": _stats(6, 11.926, 1.988)}],
             "baseline": _stats(12, 14.815, 1.235), "candidate": _stats(6, 11.926, 1.988), "ratio": 1.242,
             "launch_change": -6, "launched": {"qkv_norm": 6},
             "per_layer_step_us": {"layers": 2, "steps": 3, "baseline": 2.469, "candidate": 1.988}}],
        "not_run": {"qk_cache": "qk_cache: its own launch (qk_cache_kernel) did not run in the candidate (counted "
                                "inside its k3_amd_overlay::mla_decode ranges); the absorb_qk_cache launch did its "
                                "work, and the kernels that launch removed are counted once, in absorb_qk_cache's "
                                "section"},
        "launches": {"unit": "per rank per step", "baseline": 20.667, "candidate": 11.333, "change": -9.333,
                     "percent": -45.161}}
    named = census.compare(_arm(tmp_path / "bn_rank0.json", layers, drop=(DECODE,)), _arm(
        tmp_path / "cn_rank0.json", [("fused", "absorb")] * 2, drop=(DECODE,)), None, 2).to_json()
    assert [(s["fusions"], s["counted"]) for s in named["sections"]] == [
        (["absorb_qk_cache"], "by name"), (["qkv_norm"], "inside ranges")]
    assert named["sections"][0]["per_layer_step_us"] is None and named["launches"]["unit"] == "per rank"


def test_a_comparison_without_evidence_json_and_text():
    """The defaults: nothing compared, no launches (null, not an empty string), no text."""
    empty = census.Comparison()
    assert empty.to_json() == {"holds": False, "problems": [], "sections": [], "not_run": {}, "launches": None}
    assert empty.render() == ""
    refused = census.Comparison(problems=["first reason", "second reason"])
    assert refused.render() == "\nNO COMPARISON: first reason\n\nNO COMPARISON: second reason"
    assert refused.to_json()["launches"] is None and refused.to_json()["holds"] is False


def test_expectations_json_and_lines_exactly():
    two = census.Census(ranks={"0": {"qk_cache_kernel": census.KernelStats(2, 6.4321),
                                     "absorb_qk_cache_kernel": census.KernelStats(5, 1.5)},
                               "1": {"qk_cache_kernel": census.KernelStats(1, 3.2109)}})
    (judged,) = census.judge_expectations(two, [("qk_cache_kernel", 2)])
    assert judged.to_json() == {"name": "qk_cache_kernel", "count": 2, "holds": False, "ranks": {"0": 2, "1": 1},
                                "kernels": ["qk_cache_kernel"],
                                "problems": ["rank 1: kernels matching 'qk_cache_kernel' ran 1 times, expected 2"]}
    assert judged.line() == "expect qk_cache_kernel=2 per rank: FAILED (rank 0: 2, rank 1: 1)"
    (nothing,) = census.judge_expectations(census.Census(), [("qk_cache_kernel", 0)])
    assert nothing.to_json() == {"name": "qk_cache_kernel", "count": 0, "holds": False, "ranks": {}, "kernels": [],
                                 "problems": ["no trace was read"]}
    assert nothing.line() == "expect qk_cache_kernel=0 per rank: FAILED (no rank)"
    blank = census.Census(ranks={"3": {}})
    assert census.check_expectations(blank, [("qk_cache_kernel", 0)]) == [
        "rank 3: the trace has no GPU kernel at all, so it proves nothing (profiled without the CUDA/ROCm activity, "
        "or a window where nothing ran)"]


def test_the_refusals_word_for_word(tmp_path):
    with pytest.raises(census.TraceError) as refused:
        census.trace_files(["  "])
    assert str(refused.value) == "an empty path was given (it would scan the current directory): name the traces"
    # three ranks, two of the candidate's with the decode ranges: the ranks are listed
    for r in range(3):
        _arm(tmp_path / f"b_rank{r}.json", [("stock", "stock")])
        _arm(tmp_path / f"c_rank{r}.json", [("fused", "absorb")], drop=() if r < 2 else (DECODE,))
    base, cand = (census.read_census(sorted(tmp_path.glob(f"{arm}_rank*.json"))) for arm in "bc")
    assert census.compare(base, cand, steps=None, layers=1).problems == [
        f"{DECODE}: only some traces have its ranges (the baseline: every rank; the candidate: ranks 0, 1): one arm "
        "counted by range and the other by name would credit kernels outside the region; profile both arms alike: "
        "eager (--enforce-eager) with the overlay on, K3_AMD_OVERLAY=stock for the baseline"]
    # a baseline with neither the fused launches nor the kernels they replace, counted by name
    other = tmp_path / "o_rank0.json"
    other.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "other", "dur": 1.5}]}))
    qk_only = _arm(tmp_path / "q_rank0.json", [("stock", "qk_cache")], drop=(DECODE, NORM))
    assert census.compare(census.read_census([other]), qk_only, steps=None, layers=1).problems == [
        "qk_cache: the baseline has none of the kernels its launch replaces (concat_and_cache_mla, "
        "CatArrayBatchedCopy, scaled_quant, triton_poi_fused__to_copy_cat_clamp_mul_reciprocal) by kernel name: "
        "nothing to compare against"]


def test_both_decode_launches_share_one_section_and_one_title(tmp_path):
    """The candidate ran qk_cache's and the absorbed launch: one section, titled with both, and a
    baseline that ran both fused launches is refused under that title, each launch named."""
    both = [("fused", "qk_cache"), ("fused", "absorb")]
    base = _arm(tmp_path / "b_rank0.json", [("stock", "stock")] * 2)
    cand = _arm(tmp_path / "c_rank0.json", both)
    comparison = census.compare(base, cand, steps=1, layers=2)
    assert [s.fusions for s in comparison.sections] == [("qk_cache", "absorb_qk_cache"), ("qkv_norm",)]
    assert comparison.sections[0].render()[0] == (
        "\nqk_cache + absorb_qk_cache (summed over ranks; count × mean µs = total µs; the launches of each ran in "
        "the candidate and the baseline's kernels cannot be told apart by the launch that replaced them: one "
        "section, each kernel once; counted inside the overlay's k3_amd_overlay::mla_decode ranges)")
    assert comparison.sections[1].render()[0] == (
        "\nqkv_norm (summed over ranks; count × mean µs = total µs; counted inside the overlay's "
        "k3_amd_overlay::qkv_norm ranges)")
    refused = census.compare(_arm(tmp_path / "c2_rank0.json", both), cand, steps=1, layers=2)
    assert refused.problems[0] == (
        "qk_cache + absorb_qk_cache: the baseline ran the fused launch too (qk_cache_kernel 1, "
        "absorb_qk_cache_kernel 1 inside its k3_amd_overlay::mla_decode ranges): not an unfused baseline; profile "
        "it with K3_AMD_OVERLAY=stock")


def test_one_region_s_problem_leaves_the_other_regions_judged(tmp_path):
    """Nested decode ranges refuse the decode region only: the qkv_norm region still gets its section,
    and the comparison does not hold. A decode problem is kept when the qkv_norm region adds its own."""
    base = _arm(tmp_path / "b_rank0.json", [("stock", "stock")] * 2)
    nested = _arm(tmp_path / "n_rank0.json", [("fused", "absorb")] * 2, nest=DECODE)
    comparison = census.compare(base, nested, steps=1, layers=2)
    assert [s.fusions for s in comparison.sections] == [("qkv_norm",)]
    assert len(comparison.problems) == 1 and comparison.problems[0].startswith(f"{DECODE}: the candidate has 1 ")
    assert comparison.holds is False and comparison.to_json()["holds"] is False
    fused_base = _arm(tmp_path / "f_rank0.json", [("stock", "absorb")] * 2, drop=(NORM,))
    cand = _arm(tmp_path / "c_rank0.json", [("fused", "absorb")] * 2)
    assert census.compare(fused_base, cand, steps=1, layers=2).problems == [
        f"absorb_qk_cache: the baseline ran the fused launch too (absorb_qk_cache_kernel 2 inside its {DECODE} "
        "ranges): not an unfused baseline; profile it with K3_AMD_OVERLAY=stock",
        f"{NORM}: only some traces have its ranges (the baseline: none; the candidate: every rank): one arm counted "
        "by range and the other by name would credit kernels outside the region; profile both arms alike: eager "
        "(--enforce-eager) with the overlay on, K3_AMD_OVERLAY=stock for the baseline"]


# A GEMM per pattern, named as profilers report it: AITER's fp8 and MXFP4 batched GEMMs, torch's bmm
# (cuBLAS's cutlass kernel), Composable Kernel's gemm, hipBLASLt's Cijk_, cuBLASLt's nvjet.
GEMM_NAMES = ["_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel",
              "_batched_gemm_a16wfp4_kernel", "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816bmm_64x64_32x6_tn_"
              "align8>", "kernel_gemm_xdl_cshuffle_v3<ck::GridwiseGemm>", GEMM, "nvjet_tst_128x64_64x6_2x1_v_bz_TNT"]


def test_the_gemm_names_cover_every_gemm_pattern():
    assert {census.claiming_pattern(name) for name in GEMM_NAMES} == census.GEMM_PATTERNS


@pytest.mark.parametrize("gemm", GEMM_NAMES)
def test_inside_a_decode_range_each_gemm_counts_only_before_the_region_s_work(tmp_path, gemm):
    """The W_UK GEMM (before the KV write) counts; the W_UV GEMM after the attention kernel, of the
    same name, does not: for every GEMM pattern."""
    decode = [ROPE, gemm, "concat_and_cache_mla_kernel", "mla_decode_stage1_kernel", gemm]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": ranged_events([[(None, [gemm]), (DECODE, decode)]] * 3)}))
    pattern = census.claiming_pattern(gemm)
    claimed = census.region_claims(census.read_census([path]), "absorb_qk_cache", (pattern, "concat_and_cache_mla"))
    assert {p: s.count for p, s in claimed.items()} == {pattern: 3, "concat_and_cache_mla": 3}


def _launch(corr: int, ts: float | None, tid: int) -> dict[str, Any]:
    event = {"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel", "pid": 1, "tid": tid, "dur": 0.5,
             "args": {"correlation": corr}}
    return event if ts is None else {**event, "ts": ts}


def _kernel(corr: int | None, name: str, dur: float | None = 1.375) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": 1000.0}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event if dur is None else {**event, "dur": dur}


def _range(name: str, ts: float | None, dur: float | None, tid: int, cat: str = "user_annotation") -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid}
    event.update({k: v for k, v in (("ts", ts), ("dur", dur)) if v is not None})
    return event


def test_which_range_a_kernel_belongs_to_at_the_boundaries(tmp_path):
    """Ranges are closed intervals; the innermost (latest opened) wins where two touch; a range at 0
    and a zero-long one hold the kernels launched at their instant; a kernel of 0 µs counts; a kernel
    without a launch (a graph replay) is skipped and the kernels after it still counted; only the
    overlay's ``user_annotation`` ranges are ranges; ranges opened at one instant on one thread nest,
    touching ones do not."""
    events = [
        _kernel(None, "graph_replayed_kernel"),  # no launch: skipped, the ones after it still attributed
        _range(DECODE, 10.0, 10.0, tid=1), _range(NORM, 20.0, 5.0, tid=1),  # touching at 20
        _launch(1, 10.0, 1), _kernel(1, "at_the_start"), _launch(2, 20.0, 1), _kernel(2, "where_they_touch", 2.625),
        _launch(3, 25.0, 1), _kernel(3, "at_the_end", 3.875), _launch(4, 25.5, 1), _kernel(4, "after_both"),
        _range(DECODE, 100.0, 10.0, tid=2), _range(NORM, 100.0, 5.0, tid=2),  # opened at one instant: nested
        _range(DECODE, 0.0, 5.0, tid=3), _launch(5, 0.0, 3), _kernel(5, "at_0_of_0_us", 0.0),
        _range(NORM, 50.0, 0.0, tid=4), _launch(6, 50.0, 4), _kernel(6, "in_a_zero_long_range"),
        _launch(7, 50.5, 4), _kernel(7, "past_a_zero_long_range"),
        _range(DECODE, 0.5, 9.5, tid=5), _launch(8, 0.25, 5), _kernel(8, "launched_before_the_range"),
        _range("vllm::execute_model", 200.0, 10.0, tid=6), _launch(9, 205.0, 6), _kernel(9, "in_a_foreign_range"),
        _range(DECODE, 300.0, 10.0, tid=6, cat="cpu_op"), _launch(10, 305.0, 6), _kernel(10, "in_a_cpu_op"),
        {k: v for k, v in _launch(11, 12.0, 1).items() if k != "cat"}, _kernel(11, "launched_by_an_event_without_cat"),
    ]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    read = census.read_census([path])
    assert read.regions == {"0": [
        (DECODE, [(10.0, "at_the_start", 1.375), (12.0, "launched_by_an_event_without_cat", 1.375)]),
        (NORM, [(20.0, "where_they_touch", 2.625), (25.0, "at_the_end", 3.875)]),
        (DECODE, []), (NORM, []),
        (DECODE, [(0.0, "at_0_of_0_us", 0.0)]),
        (NORM, [(50.0, "in_a_zero_long_range", 1.375)]),
        (DECODE, [])]}
    assert read.nested == {"0": [(NORM, DECODE)]}  # one range opened inside the other, found in one pass
    assert read.launches() == 12 and read.ranks["0"]["at_0_of_0_us"].total_us == 0.0



MISSING = object()
ROLES = {"range": 0, "launch": 1, "kernel": 2}
NUMBER, DURATION, THREAD = "expected a number", "expected a number, 0 or more", (
    "expected a process or thread id (a number or a name)")
RANGE, LAUNCH, KERNEL = (f"user_annotation event {DECODE!r}", "cuda_runtime event 'hipLaunchKernel'",
                         "kernel event 'qk_cache_kernel'")


def _one_bad_field(role: str, key: str, value: Any) -> list[dict[str, Any]]:
    """A decode range, a launch in it and its kernel, with ``key`` of one of them set to ``value``
    (removed where MISSING; ``correlation`` is the event's ``args``')."""
    events = [_range(DECODE, 10.0, 10.0, tid=1), _launch(1, 12.0, 1), _kernel(1, "qk_cache_kernel")]
    fields = events[ROLES[role]]["args"] if key == "correlation" else events[ROLES[role]]
    if value is MISSING:
        del fields[key]
    else:
        fields[key] = value
    return events


@pytest.mark.parametrize("role,key,value,message", [
    ("kernel", "dur", None, f"{KERNEL} has dur=None, {DURATION}"),
    ("kernel", "dur", "abc", f"{KERNEL} has dur='abc', {DURATION}"),
    ("kernel", "dur", MISSING, f"{KERNEL} has no dur, {DURATION}"),  # a kernel's time unknown: not 0 µs
    ("kernel", "dur", float("nan"), f"{KERNEL} has dur=nan, {DURATION}"),
    ("kernel", "dur", -1.5, f"{KERNEL} has dur=-1.5, {DURATION}"),
    ("kernel", "dur", True, f"{KERNEL} has dur=True, {DURATION}"),
    ("kernel", "correlation", [1], f"{KERNEL} has correlation=[1], {NUMBER}"),
    ("range", "ts", None, f"{RANGE} has ts=None, {NUMBER}"),
    ("range", "ts", MISSING, f"{RANGE} has no ts, {NUMBER}"),
    ("range", "ts", float("inf"), f"{RANGE} has ts=inf, {NUMBER}"),
    ("range", "dur", MISSING, f"{RANGE} has no dur, {DURATION}"),
    ("range", "pid", [1], f"{RANGE} has pid=[1], {THREAD}"),
    ("launch", "ts", None, f"{LAUNCH} has ts=None, {NUMBER}"),
    ("launch", "ts", "12", f"{LAUNCH} has ts='12', {NUMBER}"),
    ("launch", "ts", MISSING, f"{LAUNCH} has no ts, {NUMBER}"),
    ("launch", "correlation", None, f"{LAUNCH} has correlation=None, {NUMBER}"),
    ("launch", "tid", {"t": 1}, f"{LAUNCH} has tid={{'t': 1}}, {THREAD}"),
])
def test_a_number_the_census_reads_and_cannot_is_refused_by_name(tmp_path, role, key, value, message):
    """Every ``ts``, ``dur``, ``correlation``, ``pid`` and ``tid`` the census reads, read one way: a
    TraceError naming the file, the event and the value, never a TypeError or a guessed 0."""
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": _one_bad_field(role, key, value)}))
    with pytest.raises(census.TraceError) as raised:
        census.read_census([path])
    assert str(raised.value) == f"{path}: {message}"


def test_a_bad_number_is_a_usage_error_on_the_cli_and_unread_events_stay_lenient(tmp_path, capsys):
    """rc 2 with the message (one JSON object on stdout with --json), no traceback; a kernel's bad
    ``dur`` is refused in a trace without ranges too. Events whose numbers the census never reads (a
    CPU op, another tool's range, launches in a trace without overlay ranges) may carry anything."""
    bad = tmp_path / "bad" / "rank0.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"traceEvents": [_kernel(1, "qk_cache_kernel", 2.0), {**_kernel(2, "qk_cache_kernel"),
                                                                                     "dur": None}]}))
    message = f"{bad}: {KERNEL} has dur=None, {DURATION}"
    assert main(["census", str(bad), "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"command": "census", "ok": False, "exit_status": 2, "usage_error": message,
                               "error": message}
    assert err.endswith(f"error: {message}\n") and "Traceback" not in err
    unread = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": None, "dur": "abc"},
              _range("vllm::execute_model", None, None, tid=1), {**_launch(1, None, 1), "pid": [1]},
              _kernel(1, "qk_cache_kernel", 2.0)]
    ok = tmp_path / "ok_rank0.json"
    ok.write_text(json.dumps({"traceEvents": unread}))
    assert census.read_census([ok]).ranks == {"0": {"qk_cache_kernel": census.KernelStats(1, 2.0)}}
    assert main(["census", str(ok), "--baseline", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err.endswith(f"error: {message}\n")

def test_the_work_a_launch_shares_is_a_symmetric_relation():
    """``_work_shared`` pairs the absorbed launch with qk_cache's both ways and a fusion never with itself."""
    fusions = list(census.FUSION_KERNELS)
    for f in fusions:
        assert f not in census._work_shared(f)
        for g in fusions:
            assert (g in census._work_shared(f)) is (f in census._work_shared(g)), (f, g)
    for doer, covered in DOES_THE_WORK_OF.items():
        assert census._work_shared(covered) == {doer} and census._work_shared(doer) == {covered}
