"""The census compares like with like and reads any file a user can hand it: arms that profiled a
different number of layer steps give no ratio (before, 8 stock steps against 4 fused ones read as a
2x gain); a trace nested too deeply, a duration too large for a float, durations summing beyond
one, a FIFO, a folder named like a trace or a folder it cannot list are clear errors or skipped,
never a traceback or a hang; and a trace of many ranges is read in one pass, not one per pair."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from kineto_traces import ranged_events

from k3_amd_overlay.commands import census
from k3_amd_overlay.commands.cli import main

DECODE, NORM = "k3_amd_overlay::mla_decode", "k3_amd_overlay::qkv_norm"
STOCK = ["concat_and_cache_mla_kernel", "Cijk_Ailk_Bljk_BBS_BH_MT64x64x64_MI16x16x16x1", "CatArrayBatchedCopy",
         "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_0"]


def _trace(path: Path, steps: int, kernels: list[str]) -> Path:
    path.write_text(json.dumps({"traceEvents": ranged_events([[(DECODE, kernels)]] * steps, True)}))
    return path


def _run(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["census", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_arms_with_different_numbers_of_layer_steps_give_no_ratio(tmp_path, capsys):
    base = _trace(tmp_path / "b_rank0.json", 8, STOCK)
    cand = _trace(tmp_path / "c_rank0.json", 4, ["absorb_qk_cache_kernel"])
    code, out = _run(capsys, str(cand), "--baseline", str(base), "--steps", "4")
    assert code == 1 and not out["ok"] and out["comparison"]["sections"] == [], out
    assert out["comparison"]["launches"] is None  # launches per step of windows not shown to match: none
    assert out["comparison"]["problems"] == [
        f"{DECODE}: the baseline has 8 {DECODE} ranges on rank 0, the candidate 4: one range is one layer's decode "
        "step, so the arms profiled windows of different lengths and their totals cannot be compared; profile the "
        "same steps in both arms (the same requests, the same profiler window)"]
    same = _trace(tmp_path / "s_rank0.json", 4, STOCK)
    code, out = _run(capsys, str(cand), "--baseline", str(same), "--steps", "4")
    assert code == 0 and out["comparison"]["holds"], out


def test_vllm_029s_two_stock_norm_ranges_per_step_are_one_window_with_the_fused_one(tmp_path):
    """vLLM 0.29's stock norms open a range each, two per layer step, where the fused pair opens one:
    the steps are counted by the decode ranges, one per step in both arms, so the windows match."""
    def arm(path: Path, norms: list[tuple[str, list[str]]], decode: list[str]) -> census.Census:
        path.write_text(json.dumps({"traceEvents": ranged_events([[*norms, (DECODE, decode)]] * 4, True)}))
        return census.read_census([path])

    stock = arm(tmp_path / "b_rank0.json", [(NORM, ["rms_norm_kernel"]), (NORM, ["rms_norm_kernel"])], STOCK)
    fused = arm(tmp_path / "c_rank0.json", [(NORM, ["rmsnorm_pair_kernel"])], ["absorb_qk_cache_kernel"])
    comparison = census.compare(stock, fused, steps=4, layers=1)
    assert not any("ranges on rank" in problem for problem in comparison.problems), comparison.problems
    assert {s.region for s in comparison.sections} == {NORM, DECODE}


def _bad_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "rank0.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,said", [
    ('{"traceEvents":[' + "[" * 100_000 + "]" * 100_000 + "]}", "RecursionError"),
    ('{"traceEvents":[' + '{"ph":"X","cat":"kernel","name":"a","dur":1' + "0" * 5000 + "}]}", "ValueError"),
])
def test_a_json_no_trace_holds_is_a_usage_error_naming_the_file(tmp_path, capsys, text, said):
    path = _bad_file(tmp_path, text)
    code, out = _run(capsys, path)
    assert code == 2 and out["usage_error"] and out["error"].startswith(f"{path}: not a trace JSON can hold ({said}")


def test_a_duration_too_large_for_a_float_is_named(tmp_path, capsys):
    path = _bad_file(tmp_path, '{"traceEvents":[{"ph":"X","cat":"kernel","name":"a","dur":1' + "0" * 400 + "}]}")
    code, out = _run(capsys, path)
    assert code == 2 and out["error"].startswith(f"{path}: kernel event 'a' has dur=1000"), out
    assert out["error"].endswith("expected a number, 0 or more")


def test_durations_summing_beyond_a_float_are_refused(tmp_path, capsys):
    event = {"ph": "X", "cat": "kernel", "name": "a", "dur": 1e308}
    path = _bad_file(tmp_path, json.dumps({"traceEvents": [event, {**event, "name": "b"}]}))
    code, out = _run(capsys, path)
    assert code == 2 and "sum beyond what a float holds" in out["error"], out


def test_a_fifo_or_a_folder_named_like_a_trace_is_skipped_and_a_fifo_named_is_refused(tmp_path, capsys):
    folder = tmp_path / "traces"
    folder.mkdir()
    _trace(folder / "rank0.json", 2, STOCK)
    os.mkfifo(folder / "rank1.json")  # reading it would block for ever
    (folder / "rank2.json").mkdir()
    assert [p.name for p in census.trace_files([folder])] == ["rank0.json"]
    code, out = _run(capsys, str(folder / "rank1.json"))
    assert code == 2 and out["error"] == (f"{folder / 'rank1.json'}: not a regular file (a FIFO, a socket or a "
                                          "device): name a trace file"), out


def test_a_folder_that_cannot_be_listed_is_an_error_not_an_empty_census(tmp_path, monkeypatch):
    folder = tmp_path / "traces"
    (folder / "locked").mkdir(parents=True)
    _trace(folder / "rank0.json", 2, STOCK)
    scandir = os.scandir

    def refuse(path="."):
        if Path(path) == folder / "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    with pytest.raises(census.TraceError, match=f"^{folder / 'locked'}: cannot list \\(Permission denied\\)$"):
        census.trace_files([folder])


def _unsearchable(monkeypatch, folder: Path) -> None:
    """``folder`` as a non-root user sees a folder of mode r--: its names can be listed, but nothing
    in it can be looked at (root bypasses the permission, so the refusal is stood in)."""
    for name in ("is_file", "is_dir", "exists"):
        real = getattr(Path, name)

        def refuse(self, *args, _real=real, **kwargs):
            if self.parent == folder:
                raise PermissionError(13, "Permission denied", str(self))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Path, name, refuse)


@pytest.mark.parametrize("named", ["folder", "file in it"])
def test_a_folder_that_can_be_listed_but_not_searched_is_an_error_not_a_traceback(tmp_path, monkeypatch, capsys,
                                                                                  named):
    """Audit: a folder of mode r-- (listed, not searched) ended the census in a PermissionError
    traceback, whether the folder or a file in it was named; now exit 2 naming the path."""
    folder = tmp_path / "traces"
    folder.mkdir()
    _trace(folder / "rank0.json", 2, STOCK)
    _unsearchable(monkeypatch, folder)
    given = folder if named == "folder" else folder / "rank0.json"
    message = f"{folder / 'rank0.json'}: cannot read (Permission denied)"
    with pytest.raises(census.TraceError, match=f"^{re.escape(message)}$"):
        census.trace_files([given])
    code, out = _run(capsys, str(given))
    assert code == 2 and out["usage_error"] == message, out


def test_many_ranges_are_read_in_one_pass(tmp_path):
    """24,000 decode ranges on one thread (200 steps of 60 layers, two regions each): 17 s before,
    with every pair of ranges compared; a bound far above the one pass, far below the pairs."""
    path = _trace(tmp_path / "rank0.json", 24_000, ["absorb_qk_cache_kernel"])
    began = time.perf_counter()
    read = census.read_census([path])
    assert time.perf_counter() - began < 8.0
    assert len(read.regions["0"]) == 24_000 and read.nested == {"0": []}
    assert all(kernels for _, kernels in read.regions["0"])


def test_every_region_s_problem_is_kept_beside_the_by_name_window_s(tmp_path):
    """One arm with the norm's ranges and one without (a region problem), and the decode counted by
    name over windows of different lengths (the kernels no fusion touches ran 8 against 4 times): both
    reasons are given, not only the last."""
    def arm(name: str, steps: int, norm_range: str | None, decode: list[str]) -> census.Census:
        step = [(norm_range, ["rms_norm_kernel"]), (None, [*decode, "attention_kernel"])]
        path = tmp_path / f"{name}_rank0.json"
        path.write_text(json.dumps({"traceEvents": ranged_events([step] * steps, True)}))
        return census.read_census([path])

    comparison = census.compare(arm("b", 8, NORM, STOCK), arm("c", 4, None, ["qk_cache_kernel"]), steps=4, layers=1)
    assert not comparison.holds
    assert any(NORM in problem for problem in comparison.problems), comparison.problems
    assert any("counted by kernel name" in problem for problem in comparison.problems), comparison.problems
