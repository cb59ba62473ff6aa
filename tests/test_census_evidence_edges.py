"""The census's evidence checks at their edges: a world size of 1 is a whole deployment, GPU names
gathered over every rank of an arm (not the last file read), ``deviceProperties`` entries that name
no GPU, a number it cannot read on an event that carries no ``cat``, one file named twice, a copy of
a trace given as another rank's, and ``--steps`` without a comparison to divide."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from kineto_traces import ATTENTION, kernel_trace

from k3_amd_overlay.commands import census
from k3_amd_overlay.commands.cli import main
from k3_amd_overlay.commands.usage import UsageError

DECODE = "k3_amd_overlay::mla_decode"
MI300X, H200 = "AMD Instinct MI300X", "NVIDIA H200"


def _trace(path: Path, kernels: dict[str, int], **fields: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return kernel_trace(path, kernels, **{"traceName": str(path), **fields})  # as each rank's own trace names it


def _on(gpu: str) -> dict[str, Any]:
    return {"deviceProperties": [{"id": 0, "name": gpu}]}


def test_one_rank_of_world_size_one_is_a_whole_deployment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only = _trace(tmp_path / "rank0.json", {"qk_cache_kernel": 3},
                  distributedInfo={"backend": "nccl", "rank": 0, "world_size": 1})
    read = census.read_census([only])
    assert read.world_sizes == {only: 1} and census.rank_problems(read) == []
    assert census.check_expectations(read, [("qk_cache_kernel", 3)]) == []
    assert main(["census", str(only), "--expect", "qk_cache_kernel=3"]) == 0, capsys.readouterr()


def test_gpus_are_gathered_over_every_rank_of_an_arm(tmp_path: Path) -> None:
    """A baseline whose rank 0 ran on an MI300X and rank 1 on an H200 is not the H200 candidate's
    GPU, though the last file read names an H200."""
    base = [_trace(tmp_path / "base" / f"rank{r}.json", {"concat_and_cache_mla_kernel": 4, ATTENTION: 4}, **_on(gpu))
            for r, gpu in enumerate((MI300X, H200))]
    cand = [_trace(tmp_path / "cand" / f"rank{r}.json", {"qk_cache_kernel": 4, ATTENTION: 4}, **_on(H200))
            for r in range(2)]
    baseline, candidate = census.read_census(base), census.read_census(cand)
    assert baseline.gpus == {MI300X, H200} and candidate.gpus == {H200}
    comparison = census.compare(baseline, candidate, steps=None, layers=1)
    assert not comparison.holds and comparison.problems == [
        f"the baseline ran on {MI300X}, {H200}, the candidate on {H200} (deviceProperties): kernel times of "
        "different GPUs say nothing of a fusion; profile both arms on the same GPU"]
    assert census.compare(candidate, baseline, steps=None, layers=1).problems[-1].startswith(
        f"the baseline ran on {H200}, the candidate on {MI300X}, {H200} (deviceProperties)")
    alike = [_trace(tmp_path / "alike" / f"rank{r}.json", {"concat_and_cache_mla_kernel": 4, ATTENTION: 4},
                    **_on(H200)) for r in range(2)]
    same = census.compare(census.read_census(alike), candidate, steps=None, layers=1)
    assert same.holds and same.problems == [], same.problems


@pytest.mark.parametrize("devices", [[{"id": 0}], [{"id": 0, "name": ""}], ["gfx942"], [None], [[H200]]])
def test_device_entries_that_name_no_gpu_give_no_gpu_and_no_error(tmp_path: Path, devices: list[Any]) -> None:
    trace = _trace(tmp_path / "rank0.json", {"qk_cache_kernel": 1}, deviceProperties=devices)
    assert census.read_census([trace]).gpus == set()
    named = _trace(tmp_path / "named" / "rank0.json", {"qk_cache_kernel": 1},
                   deviceProperties=[*devices, {"id": 1, "name": H200}])
    assert census.read_census([named]).gpus == {H200}


def test_a_bad_launch_time_on_an_event_without_a_category_is_named_without_one(tmp_path: Path) -> None:
    """The census reads the ``ts`` of any non-kernel event that carries a ``correlation`` (a launch),
    with or without ``cat``: the message then names the event alone."""
    launch = {"ph": "X", "name": "hipLaunchKernel", "pid": 1, "tid": 1, "ts": None, "args": {"correlation": 1}}
    events = [{"ph": "X", "cat": "user_annotation", "name": DECODE, "pid": 1, "tid": 1, "ts": 10.0, "dur": 10.0},
              launch, {"ph": "X", "cat": "kernel", "name": "qk_cache_kernel", "pid": 0, "tid": 7, "ts": 20.0,
                       "dur": 1.0, "args": {"correlation": 1}}]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(census.TraceError) as raised:
        census.read_census([path])
    assert str(raised.value) == f"{path}: event 'hipLaunchKernel' has ts=None, expected a number"


def test_a_launch_of_another_process_on_the_same_thread_id_is_outside_the_range(tmp_path: Path) -> None:
    """Ranges and launches are matched by (pid, tid): thread 1 of process 2 launching during process
    1's decode range did not launch inside it."""
    def launch(pid: int, ts: float, corr: int) -> dict[str, Any]:
        return {"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel", "pid": pid, "tid": 1, "ts": ts,
                "dur": 0.5, "args": {"correlation": corr}}

    def kernel(name: str, corr: int) -> dict[str, Any]:
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": 30.0 + corr, "dur": 1.0,
                "args": {"correlation": corr}}

    events = [{"ph": "X", "cat": "user_annotation", "name": DECODE, "pid": 1, "tid": 1, "ts": 10.0, "dur": 10.0},
              launch(1, 12.0, 1), launch(2, 14.0, 2), kernel("qk_cache_kernel", 1),
              kernel("concat_and_cache_mla_kernel", 2)]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert census.read_census([path]).regions == {"0": [(DECODE, [(12.0, "qk_cache_kernel", 1.0)])]}


def test_two_missing_ranks_are_named_as_ranks(tmp_path: Path) -> None:
    only = _trace(tmp_path / "rank0.json", {"qk_cache_kernel": 1},
                  distributedInfo={"backend": "nccl", "rank": 0, "world_size": 3})
    assert census.rank_problems(census.read_census([only])) == [
        "ranks 1, 2: no trace, though distributedInfo gives world size 3: a verdict would rest on 1 of its 3 ranks; "
        "profile every rank, one trace per rank"]


NAMED = 16  # census.MISSING_NAMED: the missing ranks a problem names


@pytest.mark.parametrize("size", [10**6, 10**12], ids=["a-million", "a-trillion"])
def test_a_huge_world_size_names_a_few_missing_ranks_and_counts_the_rest(tmp_path: Path, size: int,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The missing ranks are found without walking the world size: the first 16 named, the
    others counted, the field and its value said (a trace's world_size may be any whole number)."""
    traces = [_trace(tmp_path / f"rank{rank}.json", {"qk_cache_kernel": 1},
                     distributedInfo={"backend": "nccl", "rank": rank, "world_size": size}) for rank in (0, 2)]
    named = [1, *range(3, NAMED + 2)]
    more = size - 2 - NAMED
    problem = (f"ranks {', '.join(map(str, named))} and {more} more: no trace, though distributedInfo gives world "
               f"size {size}: a verdict would rest on 2 of its {size} ranks; profile every rank, one trace per rank")
    problems = census.rank_problems(census.read_census(traces))
    assert sum(map(len, problems)) < 500 and problems == [problem]
    assert main(["census", *map(str, traces), "--expect", "qk_cache_kernel=1", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["expect"]["problems"] == [problem]
    assert census.MISSING_NAMED == NAMED


def test_a_world_size_just_above_the_ranks_named_lists_every_missing_rank(tmp_path: Path) -> None:
    size = NAMED + 1
    only = _trace(tmp_path / "rank0.json", {"qk_cache_kernel": 1},
                  distributedInfo={"backend": "nccl", "rank": 0, "world_size": size})
    (problem,) = census.rank_problems(census.read_census([only]))
    assert problem.startswith(f"ranks {', '.join(map(str, range(1, size)))}: no trace, though distributedInfo gives "
                              f"world size {size}:")


@pytest.mark.parametrize("how", ["a-path-twice", "a-folder-and-a-file-in-it", "a-link-to-it"])
def test_one_file_named_twice_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   how: str) -> None:
    """Before, ``census t.json t.json --expect qk_cache_kernel=1`` counted one trace as ranks 0 and 1
    and held ("rank 0: 1, rank 1: 1"), exit 0."""
    trace = _trace(tmp_path / "traces" / "t.json", {"qk_cache_kernel": 1})
    link = tmp_path / "link.json"
    link.symlink_to(trace)
    argv = {"a-path-twice": [trace, trace], "a-folder-and-a-file-in-it": [trace.parent, trace],
            "a-link-to-it": [trace, link]}[how]
    assert main(["census", *map(str, argv), "--expect", "qk_cache_kernel=1", "--json"]) == 2
    named = f"{trace}" if how != "a-link-to-it" else f"{trace} and {link}: one file ({trace.resolve()})"
    assert json.loads(capsys.readouterr().out)["usage_error"] == (
        f"{named} named twice (a path given twice, or a file given beside the folder holding it): read twice, one "
        "trace would count as two ranks; name each rank's trace once")


@pytest.mark.parametrize("copy_name", ["b.json", "b.json.gz"])
def test_a_copy_of_a_trace_is_no_second_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             copy_name: str) -> None:
    """Two ranks' real traces never match byte for byte (each has its own process ids and times): two
    files that do (gzipped or not) are one rank's evidence, so every verdict on them fails, saying so;
    the table is still shown (the files are readable traces, not a command-line mistake)."""
    first = _trace(tmp_path / "a.json", {"qk_cache_kernel": 1})
    copy = tmp_path / copy_name
    copy.write_bytes(gzip.compress(first.read_bytes()) if copy_name.endswith(".gz") else first.read_bytes())
    problem = (f"{first} and {copy}: the same trace byte for byte, a copy (no two ranks' traces are: each has its own "
               "process ids and times), so one rank's kernels would count twice; keep one profiler session per "
               "directory, one trace per rank")
    read = census.read_census([first, copy])
    assert read.copies == [(first, copy)] and census.rank_problems(read) == [problem]
    assert main(["census", str(first), str(copy), "--expect", "qk_cache_kernel=1", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["expect"]["problems"] == [problem] and data["ranks"]
    base = [_trace(tmp_path / "base" / f"rank{r}.json", {"concat_and_cache_mla_kernel": 1}) for r in range(2)]
    assert census.compare(census.read_census(base), read, None, 1).problems[0] == f"the candidate's {problem}"
    other = _trace(tmp_path / "c.json", {"qk_cache_kernel": 1}, traceName="c.json")  # one field differs: no copy
    assert census.read_census([first, other]).copies == []


def test_steps_without_a_baseline_are_refused_not_dropped() -> None:
    """The steps divide only the comparison's figures: before, ``census t.json --steps 5`` printed the
    table as without them, not a word said."""
    with pytest.raises(UsageError) as refused:
        census.check_steps(5, None)
    assert str(refused.value) == (
        "--steps 5 without --baseline: the steps divide the before/after comparison's figures (per step, per layer "
        "and step), which only --baseline gives; give --baseline TRACE ..., or leave --steps out (--expect counts "
        "per rank over the whole window)")
    census.check_steps(5, ["base.json"])
    census.check_steps(None, None)


def test_layers_without_steps_are_refused_not_dropped() -> None:
    """The layers divide only the per-layer figures, which need --steps: before, ``census t.json
    --layers 30`` (with or without --baseline) printed what it prints without them."""
    with pytest.raises(UsageError) as refused:
        census.check_steps(None, ["base.json"], 30)
    assert str(refused.value) == (
        "--layers 30 without --steps: the layers divide only the comparison's figures per layer and step, which "
        "--steps (with --baseline) gives; give --steps N, or leave --layers out")
    census.check_steps(5, ["base.json"], 30)
