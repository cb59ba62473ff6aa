"""The census's comparison and counts on evidence that is not what it seems (a read-only audit,
2026-12-07): a baseline that ran another fusion's fused launch of the region; arms counted by name
where one ran a kernel the other never did; one trace given as a rank of both arms; a trace naming no
rank beside a world of ranks; a corrupt gzip; vLLM 0.33's frontend and graph-capture traces in a
profiler folder. Each test failed on the census before the fix."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kineto_traces import ATTENTION, kernel_trace, with_kernels
from test_census_attribution import DECODE, GRAPH_BASE, GRAPH_FUSED, _read, _trace

from k3_amd_overlay.commands import census
from k3_amd_overlay.commands.cli import main


def test_a_baseline_that_ran_another_fusions_launch_of_the_region_is_no_baseline(tmp_path):
    base = _read(_trace(tmp_path / "b_rank0.json", ["absorb", "stock"]))  # one layer ran the absorbed launch
    cand = _read(_trace(tmp_path / "c_rank0.json", ["qk_cache", "qk_cache"]))
    comparison = census.compare(base, cand, steps=None, layers=2)
    assert not comparison.holds and not comparison.sections
    assert comparison.problems == [f"qk_cache: the baseline ran the fused launch too (absorb_qk_cache_kernel 1 inside "
                                   f"its {DECODE} ranges): not an unfused baseline; profile it with "
                                   "K3_AMD_OVERLAY=stock"]


def test_by_name_a_kernel_that_ran_in_one_arm_only_means_the_arms_profiled_different_work(tmp_path):
    base = _read(with_kernels(GRAPH_BASE, tmp_path / "base-rank0.json", {ATTENTION: 12, "fmha_fwd_prefill": 10}))
    fused = _read(with_kernels(GRAPH_FUSED, tmp_path / "fused-rank0.json", {ATTENTION: 12}))
    comparison = census.compare(base, fused, steps=None, layers=1)
    assert not comparison.holds and not comparison.sections and comparison.launches is None
    assert comparison.problems == [
        "counted by kernel name (no overlay ranges to count the steps by), and on rank 0 fmha_fwd_prefill, which no "
        "fusion touches, ran 10 times in the baseline and never in the candidate: the arms profiled different work "
        "(a prefill in one window, another step), so their totals cannot be compared; profile the same steps in "
        "both arms (the same requests, the same profiler window), or eager (--enforce-eager) with the overlay on, "
        "K3_AMD_OVERLAY=stock for the baseline, whose ranges count the steps"]
    rotated = _read(with_kernels(GRAPH_BASE, tmp_path / "rot-rank0.json",
                                 {ATTENTION: 12, "void vllm::rotary_embedding_kernel<bf16>": 12}))
    assert census.compare(rotated, fused, steps=None, layers=1).holds  # the rotation the fused decode skips


def _rank(source: Path, path: Path, rank: int) -> Path:
    """The trace at ``source`` with the attention kernel added, as rank ``rank`` of a world of 2 writes it."""
    with_kernels(source, path, {ATTENTION: 12})
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "distributedInfo": {"rank": rank, "world_size": 2}}))
    return path


def test_one_trace_given_as_a_rank_of_both_arms_is_refused(tmp_path):
    base0, base1 = (_rank(GRAPH_BASE, tmp_path / f"base-rank{r}.json", r) for r in (0, 1))
    fused0 = _rank(GRAPH_FUSED, tmp_path / "fused-rank0.json", 0)
    assert main(["census", str(fused0), str(base1), "--baseline", str(base0), str(base1)]) == 1
    comparison = census.compare(_read(base0, base1), _read(fused0, base1), steps=None, layers=1)
    assert not comparison.holds
    assert comparison.problems == [f"{base1} (baseline) and {base1} (candidate): the same trace byte for byte, so one "
                                   "run's kernels would stand for both arms; profile each arm in its own run"]


def test_a_trace_naming_no_rank_cannot_fill_a_rank_of_a_world(tmp_path):
    world = {"distributedInfo": {"rank": 0, "world_size": 2}}
    ranked = kernel_trace(tmp_path / "rank0.json", {"qk_cache_kernel": 6}, **world)
    stray = kernel_trace(tmp_path / "profile.json", {"qk_cache_kernel": 6})
    assert main(["census", str(tmp_path), "--expect", "qk_cache_kernel=6"]) == 1
    problems = census.rank_problems(_read(ranked, stray))
    assert problems == [f"{stray}: no rank in the trace (distributedInfo) or its name, beside traces of a world of "
                        "ranks: it cannot stand for one of them (a stray file, or a copy re-written without its "
                        "rank?); keep one profiler session per directory, one trace per rank"]
    alone = [kernel_trace(tmp_path / f"solo{i}.json", {"qk_cache_kernel": 6}, traceName=f"solo{i}") for i in range(2)]
    assert census.rank_problems(_read(*alone)) == []  # no world named anywhere: as before, by place


def test_a_corrupt_gzip_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    body = bytearray(gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": i,
                                                                 "dur": 1.0} for i in range(4000)]}).encode()))
    body[40:60] = bytes(20)  # the deflate stream broken, the header and length intact
    bad = tmp_path / "rank0.json.gz"
    bad.write_bytes(bytes(body))
    with pytest.raises(census.TraceError, match=r"rank0\.json\.gz: cannot read \((error|BadGzipFile|EOFError)"):
        census.trace_bytes(bad)
    assert main(["census", str(bad), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["usage_error"].startswith(f"{bad}: cannot read")


def test_vllms_frontend_and_graph_capture_traces_in_a_profiler_folder_are_not_ranks(tmp_path):
    """vLLM 0.33 writes its API frontend's CPU-only trace (``<host>_<pid>.async_llm.<time>.pt.trace.json.gz``)
    beside the ranks' traces, and rank 0's graph-capture trace into ``capture_traces``: read as ranks,
    the first was an empty rank 1 and the second a second trace of rank 0."""
    folder = tmp_path / "profile"
    (folder / census.CAPTURE_FOLDER).mkdir(parents=True)
    worker = with_kernels(GRAPH_FUSED, folder / "dp0_pp0_tp0_dcp0_ep0_rank0.1733000000.pt.trace.json",
                          {ATTENTION: 12})
    kernel_trace(folder / "host_4242.async_llm.1733000001.pt.trace.json", {})
    kernel_trace(folder / census.CAPTURE_FOLDER / "graph_capture_rank_0.1733000002.pt.trace.json",
                 {"qk_cache_kernel": 99})
    read = census.read_census([folder])
    assert list(read.ranks) == ["0"] and read.files["0"] == [worker]
    assert census.rank_problems(read) == [] and census.empty_ranks(read) == []
    named = census.read_census([folder / "host_4242.async_llm.1733000001.pt.trace.json"])  # named: read
    assert census.empty_ranks(named) == ["0"]


def test_steps_and_layers_are_bounded(tmp_path, capsys):
    trace = kernel_trace(tmp_path / "rank0.json", {"qk_cache_kernel": 2})
    assert main(["census", str(trace), "--baseline", str(trace), "--steps", str(10**400)]) == 2
    assert f"--steps {10**400}: from 1 to {census.MOST_STEPS}" in capsys.readouterr().err
