"""``tune``'s decisions, made on a GPU, reached on a CPU through fakes (``tests/fakes_gpu.py``): a
scripted timer, a case whose bytes check answers per config, a fake device for the command. The
winner is the fastest candidate passing the bytes check, and it replaces the shipped config only
when an interleaved re-timing finds it faster by more than 2%; ``--compare`` calls a shape slower
only past 2% too; the file written keeps another kernel's tuning for the same arch and GPU."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from fakes_gpu import ScriptedTimer, config_key, no_compile_workers

from k3_amd_overlay import fp8
from k3_amd_overlay.commands import tune
from k3_amd_overlay.commands.bench import shapes
from k3_amd_overlay.commands.usage import UsageError
from k3_amd_overlay.kernels import launch, launch_configs, names, target

SHIPPED = {"HEADS": 4, "num_warps": 4}
FAST = {"HEADS": 8, "num_warps": 4}
FASTER = {"HEADS": 2, "num_warps": 8}
WRONG = {"HEADS": 1, "num_warps": 2}
BROKEN = {"HEADS": 1, "num_warps": 8}


class FakeCase:
    """A case whose bytes check answers ``checks[config]``: (near, far), or an exception raised."""

    exact_outputs = ()
    allowance = tune.Case.allowance

    def __init__(self, checks, numel=(6000, 3000)):
        self.kernel = names.QK_CACHE_KERNEL
        self.checks = {config_key(c): v for c, v in checks}
        self.wanted = tuple(torch.empty(n) for n in numel)
        self.run = lambda: None
        self.checked = []

    def mismatches(self, config):
        self.checked.append(config_key(config))
        answer = self.checks[config_key(config)]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _tune(monkeypatch, checks, times, tried, numel=(6000, 3000)):
    timer = ScriptedTimer({config_key(c): t for c, t in times})
    monkeypatch.setattr(tune, "time_us", timer)
    logged = []
    case = FakeCase(checks, numel)
    return tune.tune_case(case, SHIPPED, tried, logged.append), timer, logged, case


def test_the_fastest_passing_candidate_wins_when_the_interleaved_retiming_beats_shipped_by_over_2_percent(
        monkeypatch):
    checks = [(SHIPPED, (0, 0)), (FAST, (0, 0)), (FASTER, (0, 0))]
    # first pass: FASTER 60 beats FAST 70; re-timing (3 rounds, in turn): FASTER 97.9 vs shipped 100
    times = [(FAST, [70.0]), (FASTER, [60.0, 97.9]), (SHIPPED, [100.0])]
    (config, us, shipped_us), timer, _, _ = _tune(monkeypatch, checks, times, [FAST, SHIPPED, FASTER])
    assert (config, us, shipped_us) == (FASTER, 97.9, 100.0)
    k_fast, k_faster, k_shipped = config_key(FAST), config_key(FASTER), config_key(SHIPPED)
    assert timer.calls == [k_fast, k_faster] + [k_faster, k_shipped] * 3  # shipped never a candidate


@pytest.mark.parametrize(("retimed", "wins"), [(98.0, False), (98.1, False), (97.99, True), (100.5, False)])
def test_the_margin_is_more_than_2_percent_of_the_shipped_time(monkeypatch, retimed, wins):
    times = [(FAST, [50.0, retimed]), (SHIPPED, [100.0])]
    (config, us, shipped_us), *_ = _tune(monkeypatch, [(SHIPPED, (0, 0)), (FAST, (0, 0))], times, [FAST])
    assert (config, us, shipped_us) == ((FAST, retimed, 100.0) if wins else (SHIPPED, 100.0, 100.0))


def test_a_tie_keeps_the_first_candidate_and_the_median_of_three_rounds_decides(monkeypatch):
    checks = [(SHIPPED, (0, 0)), (FAST, (0, 0)), (FASTER, (0, 0))]
    # FAST's three re-timed rounds 90, 200, 91: median 91 (a mean, 127, would lose)
    times = [(FAST, [60.0, 90.0, 200.0, 91.0]), (FASTER, [60.0]), (SHIPPED, [100.0, 100.0, 95.0])]
    (config, us, shipped_us), *_ = _tune(monkeypatch, checks, times, [FAST, FASTER])
    assert (config, us, shipped_us) == (FAST, 91.0, 100.0)


def test_only_candidates_within_the_bytes_allowance_are_timed(monkeypatch):
    # shipped: 5 codes one step off; allowance: 5 + 0.1% of the 9000 reference codes = 14
    checks = [(SHIPPED, (5, 0)), (FAST, (15, 0)), (FASTER, (14, 0)), (WRONG, (0, 1)), (BROKEN, (0, 0))]
    times = [(FASTER, [80.0, 90.0]), (SHIPPED, [100.0]), (BROKEN, [1.0])]
    (config, *_), timer, logged, _ = _tune(monkeypatch, checks, times, [FAST, FASTER, WRONG])
    assert config == FASTER
    assert set(timer.calls) == {config_key(FASTER), config_key(SHIPPED)}
    assert logged == [f"    {FAST}: rejected (0 codes off, 15 one step off; allowed 14)",
                      f"    {WRONG}: rejected (1 codes off, 0 one step off; allowed 14)"]


def test_the_allowance_grows_with_the_reference_size(monkeypatch):
    checks = [(SHIPPED, (0, 0)), (FAST, (2, 0))]
    times = [(FAST, [50.0]), (SHIPPED, [100.0])]
    (config, *_), *_ = _tune(monkeypatch, checks, times, [FAST], numel=(1999,))  # int(1.999) = 1
    assert config == SHIPPED
    (config, *_), *_ = _tune(monkeypatch, checks, times, [FAST], numel=(1000, 1000))  # 2
    assert config == FAST


@pytest.mark.parametrize("exc", [RuntimeError("PassManager::run failed"), OSError(28, "no space"),
                                 torch.OutOfMemoryError("HIP out of memory"), ValueError("bad block")],
                         ids=["runtime", "oserror", "oom", "value"])
def test_a_candidate_that_cannot_build_or_launch_is_skipped_and_named(monkeypatch, exc):
    checks = [(SHIPPED, (0, 0)), (BROKEN, exc), (FAST, (0, 0))]
    times = [(FAST, [50.0]), (SHIPPED, [100.0])]
    (config, *_), _, logged, case = _tune(monkeypatch, checks, times, [BROKEN, FAST])
    assert config == FAST and logged == [f"    {BROKEN}: {type(exc).__name__}"]
    assert case.checked == [config_key(SHIPPED), config_key(BROKEN), config_key(FAST)]


def test_with_no_passing_candidate_the_shipped_config_is_kept_and_timed_once(monkeypatch):
    checks = [(SHIPPED, (0, 0)), (WRONG, (0, 3))]
    (result, timer, _, _) = _tune(monkeypatch, checks, [(SHIPPED, [42.0])], [WRONG, SHIPPED])
    assert result == (SHIPPED, 42.0, 42.0) and timer.calls == [config_key(SHIPPED)]


def test_a_shipped_config_off_the_reference_stops_the_tuning(monkeypatch):
    with pytest.raises(RuntimeError, match=r"^qk_cache_kernel: the shipped config is 2 codes off the reference$"):
        _tune(monkeypatch, [(SHIPPED, (0, 2))], [], [FAST])


def test_the_bytes_check_runs_each_config_once_into_poisoned_outputs_under_that_config():
    seen = []
    case = object.__new__(tune.Case)
    case.kernel = names.QK_CACHE_KERNEL
    case.outputs = (torch.zeros(4, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    case.wanted = (torch.tensor([1, 2, 3, 4], dtype=torch.uint8), torch.tensor([7, 0x85, 9], dtype=torch.uint8))

    def run():
        seen.append((launch._forced.get(), [o.tolist() for o in case.outputs]))
        case.outputs[0].copy_(torch.tensor([1, 3, 5, 4], dtype=torch.uint8))  # one step, two steps, right
        case.outputs[1][:2].copy_(torch.tensor([8, 0x84], dtype=torch.uint8))  # one step each; last unwritten

    case.run = run
    assert case.mismatches(FAST) == (3, 2)
    assert case.mismatches(None) == (3, 2)
    assert seen == [(FAST, [[0xA5] * 4, [0xA5] * 3]), (None, [[0xA5] * 4, [0xA5] * 3])]


def test_codes_apart_reads_signs_and_magnitudes_of_one_byte_codes():
    want = torch.tensor([0x10, 0x90, 0x7E, 0x00, 0x01, 0x7F, 0x10], dtype=torch.uint8)
    got = torch.tensor([0x11, 0x91, 0x7E, 0x80, 0x81, 0x7E, 0x12], dtype=torch.uint8)
    assert tune._codes_apart(got, want) == (6, 3)  # +1, -1 (same sign); +0/-0 and 1/-1 flips; 0x7F->0x7E; +2
    # adjacent as bytes, not as codes: 0x7F (the largest positive) and 0x80 (-0; e4m3fnuz's NaN) differ in sign
    edge = torch.tensor([0x7F, 0x80, 0xFF], dtype=torch.uint8)
    assert tune._codes_apart(edge, torch.tensor([0x80, 0x7F, 0x00], dtype=torch.uint8)) == (3, 3)


def test_codes_apart_reads_the_bits_of_two_byte_codes():
    want = torch.tensor([0.5, 0.25, 3.0, 1.5], dtype=torch.bfloat16)
    one_ulp = (want.view(torch.int16) + torch.tensor([1, 0, 0, 0], dtype=torch.int16)).view(torch.bfloat16)
    got = torch.where(torch.arange(4) == 2, -want, one_ulp)  # 0.5 one step up; 3.0 sign-flipped
    got[3] = 1.75  # many steps
    assert tune._codes_apart(got, want) == (3, 2)


# ---- timing -----------------------------------------------------------------------------------------

def test_a_config_is_timed_under_graph_replay_while_it_is_forced(monkeypatch):
    from k3_amd_overlay.commands.bench import timing

    seen = []
    monkeypatch.setattr(timing, "graph_us", lambda fn, per_graph, reps: seen.append(
        (launch._forced.get(), per_graph, reps)) or 12.5)
    assert tune.time_us(lambda: None, FAST) == 12.5
    assert tune.time_us(lambda: None, None) == 12.5
    assert seen == [(FAST, 20, 50), (None, 20, 50)] and launch._forced.get() is None


def test_interleaved_timing_takes_the_configs_in_turn_each_round_and_keeps_each_median(monkeypatch):
    timer = ScriptedTimer({config_key(FAST): [5.0, 1.0, 3.0, 9.0], config_key(SHIPPED): [2.0, 8.0, 4.0, 7.0]})
    monkeypatch.setattr(tune, "time_us", timer)
    assert tune.interleaved_us(lambda: None, [FAST, SHIPPED]) == [3.0, 4.0]
    assert timer.calls == [config_key(FAST), config_key(SHIPPED)] * 3
    assert tune.interleaved_us(lambda: None, [FAST], rounds=1) == [9.0]


# ---- candidates, shapes, the file -------------------------------------------------------------------

def test_the_candidate_grid_of_each_kernel():
    def grid(kernel, tokens, amd):
        return {tuple(sorted(c.items())) for c in tune.candidates(kernel, tokens, amd)}

    norm = grid(names.RMSNORM_PAIR_KERNEL, 8, True)
    assert norm == {(("ROWS_KV", kv), ("ROWS_Q", q), ("num_warps", w)) for q in (1, 2) for kv in (1, 2, 4, 8)
                    for w in (2, 4, 8)} == grid(names.RMSNORM_PAIR_KERNEL, 8, False)
    assert grid(names.QK_CACHE_KERNEL, 1, True) == {(("HEADS", h), ("num_warps", w)) for h in (1, 2, 4, 8)
                                                    for w in (1, 2, 4, 8)} == grid(names.QK_CACHE_KERNEL, 1, False)

    def tiles(kernel, tokens, amd):
        found = tune.candidates(kernel, tokens, amd)
        widths = (16, 32, 64, 128, 256) if tokens >= 128 else (16, 32, 64, 128)
        assert {c["BLOCK_N"] for c in found if c["BLOCK_T"] >= 16} == set(widths)
        # no dot: BLOCK_T x BLOCK_N at most 128, as in the widest one-token program
        assert {(c["BLOCK_T"], c["BLOCK_N"]) for c in found if 1 < c["BLOCK_T"] <= 4} <= {(2, 16), (2, 32), (2, 64),
                                                                                       (4, 16), (4, 32)}
        # off AMD, programs of 8 tokens (a padded dot) at 3-15 tokens, every width
        assert {c["BLOCK_N"] for c in found if c["BLOCK_T"] == 8} == (set() if amd or not 3 <= tokens < 16
                                                                      else set(widths))
        assert {c["BLOCK_N"] for c in found if c["BLOCK_T"] == 1} <= {8, *widths}
        assert {c["num_warps"] for c in found} == {1, 2, 4, 8}
        assert len(found) == len({tuple(sorted(c.items())) for c in found})
        plain = {c["BLOCK_T"] for c in found if "matrix_instr_nonkdim" not in c}
        wide = {c["BLOCK_T"] for c in found if "matrix_instr_nonkdim" in c}
        assert all(c.get("matrix_instr_nonkdim", 16) == 16 for c in found)
        arch = "gfx942" if amd else "sm90"  # only configs the loader accepts there: one warp per matrix tile on AMD
        full = [{"BLOCK_N": n, "BLOCK_T": t, "num_warps": w} for t in plain for n in widths
                for w in (1, 2, 4, 8) if n * t <= (32768 if t > 4 else 128)]
        full += [{"BLOCK_N": 8, "BLOCK_T": 1, "num_warps": w} for w in (1, 2, 4, 8)] if 1 in plain else []
        full += [{**c, "matrix_instr_nonkdim": 16} for c in full if c["BLOCK_T"] >= 16] if amd else []
        sliced = tokens >= 128 and kernel == names.ABSORB_QK_CACHE_KERNEL
        full += [{**c, "K_STEPS": 4} for c in full if c["BLOCK_T"] >= 64 and c["BLOCK_N"] >= 128] if sliced else []
        assert {c.get("K_STEPS", 1) for c in found} == ({1, 4} if sliced else {1})
        full += [{**c, "KV_ROWS": 16} for c in full] if tokens >= 128 else []
        assert {c.get("KV_ROWS", 1) for c in found} == ({1, 16} if tokens >= 128 else {1})
        fitting = {tuple(sorted(c.items())) for c in full if launch_configs.dot_warps_fit(arch, kernel, c)}
        assert {tuple(sorted(c.items())) for c in found} == fitting
        assert len(fitting) < len(full) if amd and 16 in plain else len(fitting) == len(full)
        return plain, wide

    assert tiles(names.ABSORB_QK_CACHE_KERNEL, 1, True) == ({1, 16}, {16})
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 1, True) == ({1, 16}, {16})
    assert tiles(names.ABSORB_MXFP4_QK_CACHE_KERNEL, 1, False) == ({1, 16}, set())
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 2, True) == ({1, 2, 16}, {16})
    assert tiles(names.ABSORB_QK_CACHE_KERNEL, 3, False) == ({1, 2, 8, 16}, set())
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 2, False) == ({1, 2, 16}, set())
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 4, False) == ({1, 2, 4, 8, 16}, set())
    assert tiles(names.ABSORB_MXFP4_QK_CACHE_KERNEL, 4, True) == ({1, 2, 4, 16}, {16})
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 5, True) == ({16}, {16})
    assert tiles(names.ABSORB_QK_CACHE_KERNEL, 8, False) == ({8, 16}, set())
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 5, False) == ({8, 16}, set())
    assert tiles(names.ABSORB_MXFP4_QK_CACHE_KERNEL, 15, False) == ({8, 16}, set())
    assert tiles(names.ABSORB_MXFP4_QK_CACHE_KERNEL, 8, True) == ({16}, {16})
    assert tiles(names.ABSORB_QK_CACHE_KERNEL, 16, False) == ({16}, set())
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 31, True) == ({16}, {16})
    assert tiles(names.ABSORB_FP8_QK_CACHE_KERNEL, 32, True) == ({16, 32}, {16, 32})
    assert tiles(names.ABSORB_QK_CACHE_KERNEL, 64, False) == ({16, 32, 64}, set())
    assert tiles(names.ABSORB_MXFP4_QK_CACHE_KERNEL, 127, False) == ({16, 32, 64}, set())
    assert tiles(names.ABSORB_MXFP4_QK_CACHE_KERNEL, 128, False) == ({16, 32, 64, 128}, set())
    assert tiles(names.ABSORB_QK_CACHE_KERNEL, 1024, True) == ({16, 32, 64, 128}, {16, 32, 64, 128})


def test_the_shapes_tuned_by_default_and_asked_for():
    assert tune.shapes_of(names.RMSNORM_PAIR_KERNEL, [3, 6], None) == [(t, 1) for t in shapes.NORM_TOKENS]
    assert tune.shapes_of(names.RMSNORM_PAIR_KERNEL, [3, 6], [5, 9]) == [(5, 1), (9, 1)]
    assert tune.shapes_of(names.QK_CACHE_KERNEL, [3, 6], None) == [(t, h) for h in (3, 6)
                                                                  for t in shapes.QK_CACHE_BATCHES]
    # the absorb kernels also where programs of 2 and 4 tokens compete (vLLM captures those batches)
    assert tune.shapes_of(names.ABSORB_FP8_QK_CACHE_KERNEL, [16], None) == [(t, 16) for t in (1, 2, 4, 8, 32, 64,
                                                                                            128, 256)]
    assert [t for t, _ in tune.shapes_of(names.ABSORB_MXFP4_QK_CACHE_KERNEL, [3], None)] == \
        sorted({*shapes.ABSORB_BATCHES, *tune.FEW_TOKEN_BATCHES})
    assert tune.shapes_of(names.ABSORB_QK_CACHE_KERNEL, [3, 6], [7]) == [(7, 3), (7, 6)]
    assert shapes.QK_CACHE_BATCHES != shapes.ABSORB_BATCHES  # else the two defaults are not told apart


def test_mxfp4_absorption_is_tuned_only_where_vllm_runs_it():
    assert not tune.reachable_here(names.ABSORB_MXFP4_QK_CACHE_KERNEL, "gfx942", amd=True)
    assert tune.reachable_here(names.ABSORB_MXFP4_QK_CACHE_KERNEL, "gfx950", amd=True)
    assert tune.reachable_here(names.ABSORB_MXFP4_QK_CACHE_KERNEL, "sm90", amd=False)
    assert all(tune.reachable_here(k, "gfx942", amd=True) for k in tune.TUNED_KERNELS[:-1])
    assert tune.TUNED_KERNELS[-1] == names.ABSORB_MXFP4_QK_CACHE_KERNEL


def test_the_shipped_rules_are_the_nearest_shipped_arch():
    for arch, shipped in (("gfx942", "gfx942"), ("gfx90a", "gfx942"), ("sm100", "sm90")):
        assert tune.shipped_rules(arch, names.QK_CACHE_KERNEL) == \
            launch_configs.shipped(shipped).kernels[names.QK_CACHE_KERNEL]


def test_norm_rules_have_no_heads_and_end_with_one_catch_all():
    rules = tune.with_catch_alls([{"tokens": 64, "config": {"n": 2}}, {"tokens": 8, "config": {"n": 1}}])
    assert rules == [{"tokens": 8, "config": {"n": 1}}, {"tokens": 64, "config": {"n": 2}},
                     {"config": {"n": 2}, "note": "beyond the tuned batches and heads: the largest's"}]
    headed = tune.with_catch_alls([{"tokens": 8, "heads": 6, "config": 1}, {"tokens": 8, "heads": 3, "config": 2}])
    assert headed[1] == {"heads": 3, "config": 2, "note": "larger batches: the largest tuned batch's"}


def test_the_output_path_for_a_directory_or_a_file(tmp_path):
    assert tune.device_slug("AMD Instinct MI300X (gfx942:sramecc+)") == "AMD_Instinct_MI300X_gfx942_sramecc"
    assert tune.out_path(str(tmp_path), "gfx942", "AMD Instinct MI300X") == tmp_path / "gfx942-AMD_Instinct_MI300X.json"
    assert tune.out_path(str(tmp_path / "new"), "sm90", "H200") == tmp_path / "new" / "sm90-H200.json"
    assert tune.out_path(str(tmp_path / "mine.json"), "sm90", "H200") == tmp_path / "mine.json"


def _rules(config, heads=3):
    return [{"tokens": 8, "heads": heads, "config": config}]


def test_the_file_keeps_another_kernels_tuning_for_the_same_arch_and_gpu_only(tmp_path):
    path = tmp_path / "t.json"
    config = {"HEADS": 2, "num_warps": 4}
    tune.write(path, "gfx942", "MI300X", {names.QK_CACHE_KERNEL: _rules(config)}, "2.9", "3.4")
    config_fp8 = {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 1}
    tune.write(path, "gfx942", "MI300X", {names.ABSORB_FP8_QK_CACHE_KERNEL: _rules(config_fp8)}, "2.9", "3.4")
    data = json.loads(path.read_text())
    assert set(data["kernels"]) == {names.QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL}
    assert data["schema"] == launch_configs.SCHEMA and data["arch"] == "gfx942"
    assert data["tuned_on"] == {"device": "MI300X", "date": datetime.date.today().isoformat(), "torch": "2.9",
                                "triton": "3.4"}
    assert data["origin"] == ("k3-amd-overlay tune: per shape the fastest candidate passing the bytes check, graph "
                              "replay, median; the shipped config kept unless beaten by more than 2%")
    assert launch_configs.load(path).tuned_on == "MI300X"
    for other in (("gfx942", "MI325X"), ("gfx950", "MI300X")):  # another GPU or arch: nothing kept
        tune.write(path, *other, {names.QK_CACHE_KERNEL: _rules(config)}, "2.9", "3.4")
        assert set(json.loads(path.read_text())["kernels"]) == {names.QK_CACHE_KERNEL}
        tune.write(path, "gfx942", "MI300X", {names.ABSORB_FP8_QK_CACHE_KERNEL: _rules(config_fp8)}, "2.9", "3.4")


def test_a_file_the_overlay_would_refuse_is_never_written(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(launch_configs.LaunchConfigError):
        tune.write(path, "gfx942", "MI300X", {names.QK_CACHE_KERNEL: _rules({"HEADS": 3, "num_warps": 4})}, "2", "3")
    assert not path.exists()


# ---- the command on a fake GPU ------------------------------------------------------------------

class CommandCase:
    made: typing.ClassVar[list] = []
    seeds: typing.ClassVar[list] = []

    def __init__(self, kernel, tokens, heads, fmt):
        CommandCase.made.append((kernel, tokens, heads, fmt))
        CommandCase.seeds.append(torch.initial_seed())
        self.run = lambda: None


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    gpu = torch.device("cuda", 2)

    def on_gpu(answer):
        return lambda device: answer if device == gpu else pytest.fail(f"asked about {device}, not {gpu}")

    monkeypatch.setattr(target, "of", on_gpu(target.Target(target.HIP, "gfx942")))
    monkeypatch.setattr(launch, "device_name", on_gpu("AMD Instinct MI300X"))
    monkeypatch.setattr(fp8, "device_format", on_gpu(fp8.E4M3FNUZ))
    CommandCase.made, CommandCase.seeds = [], []
    monkeypatch.setattr(tune, "Case", CommandCase)
    no_compile_workers(monkeypatch)


def test_tune_on_a_fake_mi300x_writes_each_kernels_winners_for_this_gpu(fake_gpu, monkeypatch, tmp_path, capsys):
    picked = []

    def tune_case(case, shipped, tried, log):
        tried = list(tried)
        log(f"tried {len(tried)}")
        picked.append((CommandCase.made[-1][:3], shipped, tried))
        return tried[0], 10.0, 12.5

    monkeypatch.setattr(tune, "tune_case", tune_case)
    kernels = [names.RMSNORM_PAIR_KERNEL, names.ABSORB_MXFP4_QK_CACHE_KERNEL, names.QK_CACHE_KERNEL]
    assert tune.main(["--out", str(tmp_path), "--kernels", *kernels, "--heads", "6", "3", "6", "--tokens", "8", "1",
                      "8"]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # the log only with --verbose
    assert [shape for shape, _, _ in picked] == [(names.RMSNORM_PAIR_KERNEL, 1, 1), (names.RMSNORM_PAIR_KERNEL, 8, 1),
                                                (names.QK_CACHE_KERNEL, 1, 3), (names.QK_CACHE_KERNEL, 8, 3),
                                                (names.QK_CACHE_KERNEL, 1, 6), (names.QK_CACHE_KERNEL, 8, 6)]
    assert {c[3] for c in CommandCase.made} == {fp8.E4M3FNUZ}
    assert all(tried == tune.candidates(kernel, tokens, amd=True) for (kernel, tokens, _), _, tried in picked)
    assert picked[2][1] == dict(launch_configs.rule_for(tune.shipped_rules("gfx942", names.QK_CACHE_KERNEL), 1,
                                                        3).config)
    path = tmp_path / "gfx942-AMD_Instinct_MI300X.json"
    table = launch_configs.load(path)
    assert table.tuned_on == "AMD Instinct MI300X" and set(table.kernels) == {kernels[0], kernels[2]}  # no mxfp4 here
    assert [(r.tokens, r.heads) for r in table.kernels[names.QK_CACHE_KERNEL]] == [(1, 3), (8, 3), (None, 3), (1, 6),
                                                                                  (8, 6), (None, None)]
    assert [(r.tokens, r.heads) for r in table.kernels[names.RMSNORM_PAIR_KERNEL]] == [(1, None), (8, None),
                                                                                      (None, None)]
    assert json.loads(path.read_text())["kernels"][names.QK_CACHE_KERNEL][0]["note"] == "10.00 us"
    import triton

    lines = out.splitlines()
    assert lines[:5] == [f"AMD Instinct MI300X (gfx942), torch {torch.__version__}, triton {triton.__version__}",
                         f"{names.ABSORB_MXFP4_QK_CACHE_KERNEL}: not tuned, it does not run on gfx942",
                         tune.plan_line("gfx942", tune.plan(kernels, [3, 6], [1, 8], "gfx942")),
                         "| kernel | T | H | shipped µs | tuned µs | shipped / tuned | tuned config |",
                         "|---|---|---|---|---|---|---|"]
    assert set(CommandCase.seeds) == {0}  # every case's random inputs from seed 0: a rerun tunes the same bytes
    lines = out.splitlines()
    first = tune.candidates(names.QK_CACHE_KERNEL, 8, amd=True)[0]
    assert f"| {names.QK_CACHE_KERNEL} | 8 | 6 | 12.50 | 10.00 | 1.25 | {first} |" in lines
    assert lines[-1] == (f"wrote {path}; the overlay uses it with K3_AMD_OVERLAY_KERNEL_CONFIGS={path} or "
                         f"K3_AMD_OVERLAY_KERNEL_CONFIGS={tmp_path}")
    tune.main(["--out", str(tmp_path), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "8", "--verbose"])
    assert "tried " in capsys.readouterr().err
    assert {h for (_, _, h), _, _ in picked[6:]} == set(shapes.HEADS)


@pytest.mark.parametrize(("argv", "message", "code"), [
    (["--heads", "0"], "error: --heads [0]: every value must be an integer from 1 to 96 (K3 has 96 query heads)", 2),
    (["--heads", "12", "5000"], "error: --heads [12, 5000]: every value must be an integer from 1 to 96 (K3 has 96 "
                                "query heads)", 2),
    (["--tokens", "4", "-1"], "error: --tokens [4, -1]: every value must be an integer from 1 to 16384", 2),
    (["--tokens", "1000000000"], "error: --tokens [1000000000]: every value must be an integer from 1 to 16384", 2),
    (["--compare", "/nonexistent.json"], "error: --compare /nonexistent.json: no such file", 2),
    (["--compare", "/"], "error: --compare /: a directory, not a file", 2),  # said "no such file" before
    (["--compare", ""], "error: argument --compare: '' names no path (an empty value: an unset variable?); give the "
                        "path, or leave the option out", 2),  # was read as no --compare: a full tune; no default
    (["--out", ""], "error: argument --out: '' names no path (an empty value: an unset variable?); give the path, or "
                    "leave the option out for its default", 2),
    (["--out", "  "], "error: argument --out: '  ' names no path (an empty value: an unset variable?); give the "
                      "path, or leave the option out for its default", 2),
    ([], "no GPU here: tune runs on the GPU it tunes for", 1),
])
def test_bad_arguments_and_no_gpu_are_refused_in_one_line(argv, message, code, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        assert tune.main(argv) == code
    except SystemExit as exited:  # argparse's own errors (an empty path) exit
        assert exited.code == code
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"k3-amd-overlay tune: {message}"
    assert err.startswith("usage: k3-amd-overlay tune ") == (code == 2)


def test_compare_calls_a_shape_slower_only_past_2_percent(fake_gpu, monkeypatch, tmp_path, capsys):
    mine = {"HEADS": 1, "num_warps": 2}
    mine_rules = [{"config": mine}]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"schema": 1, "arch": "gfx942", "kernels": {names.QK_CACHE_KERNEL: mine_rules}}))
    shipped = dict(launch_configs.rule_for(tune.shipped_rules("gfx942", names.QK_CACHE_KERNEL), 1, 3).config)
    assert shipped != mine

    def run(mine_us):
        monkeypatch.setattr(tune, "interleaved_us", lambda run, configs: (
            [mine_us, 100.0] if configs == [mine, shipped] else pytest.fail(f"timed {configs}")))
        code = tune.main(["--compare", str(path), "--heads", "3"])
        return code, capsys.readouterr().out

    code, out = run(102.0)
    assert code == 0 and out.splitlines()[-1] == "0 shapes slower than the shipped configs by more than 2%"
    assert f"| {names.QK_CACHE_KERNEL} | 1 | 3 | 100.00 | 102.00 | 0.98 |" in out
    assert out.splitlines()[1:3] == ["| kernel | T | H | shipped µs | mine.json µs | shipped / it |",
                                     "|---|---|---|---|---|---|"]
    assert names.RMSNORM_PAIR_KERNEL not in out.split("|---|")[-1]  # not in the file: not compared
    assert {c[:3] for c in CommandCase.made} == {(names.QK_CACHE_KERNEL, t, 3) for t in shapes.QK_CACHE_BATCHES}
    code, out = run(102.1)
    assert code == 1 and out.splitlines()[-1] == \
        f"{len(shapes.QK_CACHE_BATCHES)} shapes slower than the shipped configs by more than 2%"


def test_compare_times_no_shape_where_both_pick_the_same_config(fake_gpu, monkeypatch, tmp_path, capsys):
    """A file with the shipped rules themselves: every shape picks the same config on both sides, so
    nothing is timed (one config against itself would be noise) and nothing is called slower."""
    rules = json.loads((launch_configs.CONFIG_DIR / "gfx942.json").read_text())["kernels"][names.QK_CACHE_KERNEL]
    path = tmp_path / "same.json"
    path.write_text(json.dumps({"schema": 1, "arch": "gfx942", "kernels": {names.QK_CACHE_KERNEL: rules}}))
    monkeypatch.setattr(tune, "interleaved_us", lambda run, configs: pytest.fail(f"timed {configs}"))
    assert tune.main(["--compare", str(path), "--heads", "3"]) == 0
    out = capsys.readouterr().out
    assert CommandCase.made == []
    assert [line for line in out.splitlines() if line.startswith(f"| {names.QK_CACHE_KERNEL} |")] == [
        f"| {names.QK_CACHE_KERNEL} | {t} | 3 | same config | same config | 1.00 |" for t in shapes.QK_CACHE_BATCHES]


def test_compare_times_the_batches_tokens_names_not_the_defaults(fake_gpu, monkeypatch, tmp_path, capsys):
    """``--compare`` with ``--tokens`` compares at those batches, as a run with the same options tunes
    (it compared at the default batches whatever ``--tokens`` said)."""
    rules = json.loads((launch_configs.CONFIG_DIR / "gfx942.json").read_text())["kernels"][names.QK_CACHE_KERNEL]
    path = tmp_path / "same.json"
    path.write_text(json.dumps({"schema": 1, "arch": "gfx942", "kernels": {names.QK_CACHE_KERNEL: rules}}))
    monkeypatch.setattr(tune, "interleaved_us", lambda run, configs: pytest.fail(f"timed {configs}"))
    assert tune.main(["--compare", str(path), "--heads", "3", "--tokens", "5", "2", "5"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith(f"| {names.QK_CACHE_KERNEL} |")] == [
        f"| {names.QK_CACHE_KERNEL} | {t} | 3 | same config | same config | 1.00 |" for t in (2, 5)]


def test_compare_skips_mxfp4_where_vllm_does_not_run_it(fake_gpu, monkeypatch, tmp_path, capsys):
    config = {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 1}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"schema": 1, "arch": "gfx942",
                                "kernels": {names.ABSORB_MXFP4_QK_CACHE_KERNEL: [{"config": config}]}}))
    monkeypatch.setattr(tune, "interleaved_us", lambda run, configs: pytest.fail("timed an unreachable kernel"))
    assert tune.main(["--compare", str(path)]) == 0
    assert CommandCase.made == []


def test_the_module_runs_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay.commands.tune", "--heads", "0"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: k3-amd-overlay tune "), proc.stderr
    assert proc.stderr.splitlines()[-1] == ("k3-amd-overlay tune: error: --heads [0]: every value must be an "
                                            "integer from 1 to 96 (K3 has 96 query heads)")


def test_the_help_names_each_option_and_what_it_does(capsys):
    with pytest.raises(SystemExit) as exit_:
        tune.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("usage: k3-amd-overlay tune", "Find the fastest launch config of each overlay kernel on this GPU",
                   "a file, or a directory for <arch>-<device>.json (default .); an existing file for this arch and "
                   "GPU keeps the kernels not tuned now",
                   "--heads HEADS [HEADS ...] per-rank query heads (default: the benchmarks')",
                   "--tokens TOKENS [TOKENS ...] batch sizes (default: the benchmarks', and 2 and 4 tokens for the "
                   "absorb kernels)",
                   "--compare FILE instead of tuning: time FILE's configs against the shipped ones at the shapes a "
                   "run with the same --heads and --tokens tunes; exit 1 where FILE's are slower",
                   "--verbose say why each rejected candidate was"):
        assert phrase in text, phrase


def test_without_out_the_file_goes_to_the_working_directory(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(tune, "tune_case", lambda case, shipped, tried, log: (shipped, 1.0, 1.0))
    monkeypatch.chdir(tmp_path)
    assert tune.main(["--kernels", names.QK_CACHE_KERNEL, "--tokens", "4", "--heads", "3"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["gfx942-AMD_Instinct_MI300X.json"]


def test_a_run_for_other_heads_keeps_the_head_counts_tuned_before(tmp_path):
    """Tuning 12 heads after 3 (one head count per run, as the help suggests) keeps the rules of 3."""
    path = tmp_path / "t.json"
    three, twelve = {"HEADS": 2, "num_warps": 4}, {"HEADS": 4, "num_warps": 8}
    tune.write(path, "gfx942", "MI300X", {names.QK_CACHE_KERNEL: _rules(three, 3)}, "2.9", "3.4")
    tune.write(path, "gfx942", "MI300X", {names.QK_CACHE_KERNEL: _rules(twelve, 12)}, "2.9", "3.4")
    rules = launch_configs.load(path).kernels[names.QK_CACHE_KERNEL]
    assert [(r.tokens, r.heads, dict(r.config)) for r in rules] == [
        (8, 3, three), (None, 3, three), (8, 12, twelve), (None, None, twelve)]
    tune.write(path, "gfx942", "MI300X", {names.QK_CACHE_KERNEL: _rules(twelve, 3)}, "2.9", "3.4")  # 3 again
    rules = launch_configs.load(path).kernels[names.QK_CACHE_KERNEL]
    assert [(r.tokens, r.heads, dict(r.config)) for r in rules] == [
        (8, 3, twelve), (None, 3, twelve), (8, 12, twelve), (None, None, twelve)]


def test_a_write_that_fails_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    tune.write(path, "gfx942", "MI300X", {names.QK_CACHE_KERNEL: _rules({"HEADS": 2, "num_warps": 4})}, "2.9", "3.4")
    before = path.read_bytes()

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        tune.write(path, "gfx942", "MI300X", {names.ABSORB_FP8_QK_CACHE_KERNEL: _rules(
            {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 1})}, "2.9", "3.4")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_out_may_not_name_the_packages_own_configs_or_a_file_it_cannot_write(tmp_path, monkeypatch):
    shipped = launch_configs.CONFIG_DIR / "gfx942.json"
    with pytest.raises(UsageError, match="in the package's own launch-config directory"):
        tune.check_out_file(shipped, shipped)
    with pytest.raises(UsageError, match="in the package's own launch-config directory"):
        tune.check_out_file(launch_configs.CONFIG_DIR / "gfx942-AMD_Instinct_MI300X.json", launch_configs.CONFIG_DIR)
    path = tmp_path / "t.json"
    tune.write(path, "gfx942", "MI300X", {names.QK_CACHE_KERNEL: _rules({"HEADS": 2, "num_warps": 4})}, "2.9", "3.4")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == path else real_access(p, mode))
    with pytest.raises(UsageError, match=r"t\.json exists and is not writable here$"):
        tune.check_out_file(path, path)


def test_tune_refuses_to_replace_another_gpus_tuning_and_to_tune_nothing(fake_gpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "tune_case", lambda case, shipped, tried, log: (shipped, 1.0, 1.0))
    other = tmp_path / "mine.json"
    tune.write(other, "gfx942", "AMD Instinct MI325X", {names.QK_CACHE_KERNEL: _rules({"HEADS": 2, "num_warps": 4})},
               "2.9", "3.4")
    before = other.read_bytes()
    assert tune.main(["--out", str(other), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "8"]) == 1
    assert other.read_bytes() == before
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3-amd-overlay tune: --out {other}: {other} holds launch configs tuned on AMD Instinct MI325X (gfx942); "
        "tune keeps no other GPU's tuning by replacing it: name another file or directory; nothing tuned")
    assert tune.main(["--out", str(tmp_path), "--kernels", names.ABSORB_MXFP4_QK_CACHE_KERNEL, "--tokens", "8",
                      "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["file"] is None and "none runs on gfx942" in out["error"]
    assert not (tmp_path / "gfx942-AMD_Instinct_MI300X.json").exists()
    mine = tmp_path / "mi300x-tuned.json"
    assert tune.main(["--out", str(mine), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "8", "--heads", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"wrote {mine}; the overlay uses it with K3_AMD_OVERLAY_KERNEL_CONFIGS={mine} (a directory is read for "
        "gfx942-AMD_Instinct_MI300X.json only)")
