"""``k3-amd-overlay measure`` (k3_amd_overlay/commands/self_measure.py) on the CPU: the measuring logic through a
fake timer (the real one is a CUDA-graph replay median on the GPU), the real fused paths' parity
against the stock sequence under the Triton interpreter, the table and the result file from a
planted timing where one bucket is slower (that bucket's verdict: stock, with the reason the marker
shows), a bucket whose parity fails (never timed, stock), rows of an earlier file kept only where it
was measured under the same conditions, the command's usage errors (values as given; --heads checked
against --tensor-parallel-size), and its --json object's ``error`` on every failing path."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import triton
from machine import DEVICE

from k3_amd_overlay import fp8, measured, versions
from k3_amd_overlay.commands import self_measure
from k3_amd_overlay.commands.bench import aiter_peers, layer_step
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.fusions import qk_cache as qk
from k3_amd_overlay.kernels import launch, target
from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import KERNEL_CONFIGS


class FakeTimer:
    """Times a callable as planted: ``times[name]`` is a list handed out in turn (the last repeated)."""

    def __init__(self, times: dict[str, list[float]]) -> None:
        self.times = times
        self.calls: list[str] = []

    def __call__(self, fn: Callable[[], None]) -> float:
        name = self.name(fn)
        self.calls.append(name)
        planted = self.times[name]
        return planted.pop(0) if len(planted) > 1 else planted[0]

    @staticmethod
    def name(fn: Callable[[], None]) -> str:
        return getattr(fn, "__name__", "")


def fake_pair(fusion: str, tokens: int, problems: list[str] | None = None) -> self_measure.Pair:
    def stock_a() -> None: ...
    def stock_b() -> None: ...
    def fused() -> None: ...
    stock_a.__name__, stock_b.__name__, fused.__name__ = (f"{fusion}{tokens}-stock-a", f"{fusion}{tokens}-stock-b",
                                                           f"{fusion}{tokens}-fused")
    return self_measure.Pair(fusion, tokens, 12, "bf16", [stock_a, stock_b], fused, lambda: list(problems or []))


def test_stock_and_fused_are_timed_in_turn_and_their_medians_kept():
    timer = FakeTimer({"qk_cache8-stock-a": [9.0], "qk_cache8-stock-b": [8.0, 8.4, 7.9],
                       "qk_cache8-fused": [5.0, 7.0, 6.0]})
    got = self_measure.measure_pair(fake_pair(QK_CACHE, 8), timer, rounds=3)
    assert timer.calls == ["qk_cache8-stock-a", "qk_cache8-stock-b", "qk_cache8-fused", "qk_cache8-fused",
                           "qk_cache8-stock-b", "qk_cache8-fused", "qk_cache8-stock-b"]
    assert got == measured.Row(QK_CACHE, 8, 12, "bf16", True, stock_us=8.0, fused_us=6.0)  # the fastest stock


def test_a_bucket_whose_parity_fails_is_never_timed_and_runs_stock():
    timer = FakeTimer({})
    got = self_measure.measure_pair(fake_pair(QK_CACHE, 16, ["cache: 3 bytes written outside the valid slots' rows"]),
                                    timer)
    assert timer.calls == [] and not got.exact and not got.fused and got.verdict() == "stock: not exact"

    def broken() -> list[str]:
        raise RuntimeError("no kernel image for this GPU")

    pair = fake_pair(QK_CACHE, 16)
    pair.parity = broken
    assert self_measure.measure_pair(pair, timer).problems == ("RuntimeError: no kernel image for this GPU",)

    def refused(fn: Callable[[], None]) -> float:
        raise RuntimeError("operation not permitted when stream is capturing")

    timed_out = self_measure.measure_pair(fake_pair(QK_CACHE, 16), refused)
    assert not timed_out.exact and timed_out.problems == (
        "timing failed: RuntimeError: operation not permitted when stream is capturing",)
    gate = measured.gate_for(self_measure_file([got]), QK_CACHE, 12, "bf16")
    assert gate.refusal(9) == ("stock at 1-16 tokens: not exact on this GPU (cache: 3 bytes written outside the valid "
                               "slots' rows)")


def self_measure_file(rows: list[measured.Row], **conditions: str) -> measured.Measurement:
    """A file of this process's conditions (``conditions``: those that differ)."""
    return measured.Measurement(path="", arch="sm90", device="NVIDIA H200", date="2026-12-02T11:00:00+00:00",
                                overlay_version=measured.__version__, stock=self_measure.STOCK_WORDS, seed=3,
                                rows=tuple(rows), **{**measured.conditions("sm90", "NVIDIA H200"), **conditions})


def real_names(fn: Callable[[], None]) -> str:
    """A real pair's callables are partials of a segment over one Step: name them by segment and tokens."""
    return f"{fn.func.__name__}@{fn.args[0].tokens}"  # type: ignore[attr-defined]


def test_the_real_fused_paths_are_exact_and_a_planted_slower_bucket_goes_to_stock(tmp_path, capsys):
    """heads 1, bf16, buckets 1 and 2 (the interpreter runs K3's widths): every fused path's bytes
    match stock's; qk_cache is planted slower at bucket 2 (10 µs stock, 12.5 µs fused: 0.80x), so
    the table, the file and the server's gate say stock there, fused at 1."""
    times = {}
    for tokens in (1, 2):
        times.update({f"stock_norms@{tokens}": [3.0], f"norm_pair@{tokens}": [2.0], f"stock_tail@{tokens}": [10.0],
                      f"stock_tail_compiled@{tokens}": [10.5],
                      f"absorbed_tail@{tokens}": [4.0], f"qk_cache_tail@{tokens}": [6.0 if tokens == 1 else 12.5]})
    timer = FakeTimer(times)
    timer.name = real_names  # type: ignore[method-assign]
    lines: list[str] = []
    rows = self_measure.measure(self_measure.pairs([1], ["bf16"], [1, 2], DEVICE, E4M3FN, seed=17), timer, rounds=2,
                                out=lines.append)
    assert [(r.fusion, r.tokens, r.exact) for r in rows] == [
        (QKV_NORM, 1, True), (ABSORB_QK_CACHE, 1, True), (QK_CACHE, 1, True),
        (QKV_NORM, 2, True), (ABSORB_QK_CACHE, 2, True), (QK_CACHE, 2, True)]
    assert lines == [*self_measure.HEADER,
                     "| qkv_norm | - | - | 1 | 3.00 | 2.00 | 1.50x | exact | fused |",
                     "| absorb_qk_cache | 1 | bf16 | 1 | 10.00 | 4.00 | 2.50x | exact | fused |",
                     "| qk_cache | 1 | bf16 | 1 | 10.00 | 6.00 | 1.66x | exact | fused |",
                     "| qkv_norm | - | - | 2 | 3.00 | 2.00 | 1.50x | exact | fused |",
                     "| absorb_qk_cache | 1 | bf16 | 2 | 10.00 | 4.00 | 2.50x | exact | fused |",
                     "| qk_cache | 1 | bf16 | 2 | 10.00 | 12.50 | 0.80x | exact | stock: 0.80x of stock |"]
    assert self_measure.table(rows) == lines
    path = self_measure.write(self_measure_file(rows), tmp_path)
    assert path == tmp_path / "sm90-NVIDIA_H200.measured.json"
    loaded = measured.load_here("sm90", "NVIDIA H200", {KERNEL_CONFIGS: str(tmp_path)})
    assert loaded.error is None and loaded.measurement is not None
    assert json.loads(path.read_text())["results"][5] == {
        "fusion": QK_CACHE, "tokens": 2, "heads": 1, "variant": "bf16", "stock_us": 10.0, "fused_us": 12.5,
        "ratio": 0.8, "exact": True, "problems": []}
    gates = measured.decode_gates(loaded, 1, "bf16")
    plan = qk.DecodePlan(qk.LayerDecision(qk.FusionState.APPLIED, "triton", ""),
                         qk.LayerDecision(qk.FusionState.DISABLED, None, ""), measured=gates)
    batch = lambda t: qk.BatchFacts(t, t, True, False)  # noqa: E731
    assert plan.choose(batch(1)) == (qk.DecodePath.QK_CACHE, None)
    assert plan.choose(batch(2)) == (None, "qk_cache: stock at 2 tokens: 0.80x of stock on this GPU")
    assert plan.choose(batch(3)) == (None, "qk_cache: stock above 2 tokens: not measured on this GPU")
    assert self_measure.gate_lines(loaded.measurement)[1] == (
        "qk_cache (1 heads, bf16 W_UK): fused in 1 of 2 buckets; stock at 2 tokens: 0.80x of stock on this GPU; "
        "stock above 2 tokens: not measured on this GPU")


def test_a_fused_path_that_writes_wrong_bytes_is_stock_in_its_bucket(monkeypatch):
    """A planted fault in the absorbed launch (it writes no query and no cache row): the parity check
    finds it and the bucket is not exact, never timed."""
    monkeypatch.setattr(layer_step, "absorbed_tail", lambda s: None)
    timer = FakeTimer({})
    timer.name = real_names  # type: ignore[method-assign]
    pair = next(p for p in self_measure.pairs([1], ["bf16"], [2], DEVICE, E4M3FN, seed=5)
                if p.fusion == ABSORB_QK_CACHE)
    got = self_measure.measure_pair(pair, timer)
    assert timer.calls == [] and not got.exact
    assert any(p.startswith("q_out: ") and "bytes of valid tokens not written" in p for p in got.problems)
    assert any(p.startswith("cache: ") for p in got.problems)


def test_writing_keeps_the_rows_of_other_shapes_and_replaces_those_measured_again(tmp_path):
    first = [measured.Row(QK_CACHE, 8, 12, "bf16", True, 5.0, 4.0),
             measured.Row(QK_CACHE, 8, 12, "fp8", True, 6.0, 4.0)]
    self_measure.write(self_measure_file(first), tmp_path)
    again = [measured.Row(QK_CACHE, 8, 12, "bf16", True, 4.0, 5.0)]
    path = self_measure.write(self_measure_file(again), tmp_path)
    assert {r.key: r.ratio for r in measured.load(path).rows} == {(QK_CACHE, 12, "fp8", 8): 1.5,
                                                                  (QK_CACHE, 12, "bf16", 8): 0.8}
    assert not list(tmp_path.glob(".*.tmp"))


def test_two_runs_writing_one_file_at_once_keep_both_their_rows(tmp_path, monkeypatch):
    """Each run read the file, merged its rows and replaced it: a run that read before the other wrote
    lost the other's rows (both ran at once: another variant, another container on the volume). Now
    they take turns at a lock beside the file, the second merging into what the first wrote."""
    import threading
    import time

    first_inside, release = threading.Event(), threading.Event()
    parse = measured.parse

    def slow_parse(data, path):  # the first run, inside its write, waits until the second has tried
        if data["results"][0]["variant"] == "bf16":
            first_inside.set()
            release.wait(10)
        return parse(data, path)

    monkeypatch.setattr(measured, "parse", slow_parse)
    first = threading.Thread(target=self_measure.write, args=(
        self_measure_file([measured.Row(QK_CACHE, 8, 12, "bf16", True, 5.0, 4.0)]), tmp_path))
    first.start()
    assert first_inside.wait(10)
    second = threading.Thread(target=self_measure.write, args=(
        self_measure_file([measured.Row(QK_CACHE, 8, 12, "fp8", True, 6.0, 4.0)]), tmp_path))
    second.start()
    time.sleep(0.3)  # without the lock the second has read the empty directory and written by now
    release.set()
    first.join(10)
    second.join(10)
    path = tmp_path / measured.result_name("sm90", "NVIDIA H200")
    assert sorted(r.variant for r in measured.load(path).rows) == ["bf16", "fp8"]


def test_a_write_that_fails_leaves_no_temporary_file_and_the_old_file_whole(tmp_path, monkeypatch):
    path = self_measure.write(self_measure_file([measured.Row(QK_CACHE, 8, 12, "bf16", True, 5.0, 4.0)]), tmp_path)
    before = path.read_bytes()

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        self_measure.write(self_measure_file([measured.Row(QK_CACHE, 16, 12, "bf16", True, 5.0, 4.0)]), tmp_path)
    assert path.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))


def test_a_bucket_whose_inputs_cannot_be_made_is_not_exact_and_the_run_goes_on(monkeypatch):
    """Out of memory beside a live server while a bucket's timed inputs were made escaped the run:
    every row measured so far was lost and no file written. Now that bucket is not exact (stock)."""
    def no_memory(*given, **named):
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(layer_step, "make_step", no_memory)
    pair = next(iter(self_measure.pairs([12], ["bf16"], [8], torch.device(DEVICE), E4M3FN, 5)))
    row = self_measure.measure_pair(pair, FakeTimer({}))
    assert not row.exact and row.problems == (
        "its inputs could not be prepared: OutOfMemoryError: HIP out of memory. Tried to allocate 64.00 MiB",)


@pytest.mark.parametrize("field,old", [("torch", "2.8.0"), ("triton", "3.3.0"), ("launch_configs", "0" * 64),
                                       ("aiter", "0.1.6 at /opt/aiter/aiter"), ("fp8_format", "e4m3fnuz"),
                                       ("kv_cache_dtype", "auto")],
                         ids=["torch", "triton", "launch_configs", "aiter", "fp8_format", "kv_cache_dtype"])
def test_rows_measured_under_other_conditions_are_dropped_saying_so(tmp_path, field, old):
    first = [measured.Row(QK_CACHE, 8, 12, "fp8", True, 6.0, 4.0),
             measured.Row(QK_CACHE, 16, 12, "fp8", True, 6.0, 4.0),
             measured.Row(QK_CACHE, 8, 12, "bf16", True, 5.0, 4.0)]
    self_measure.write(self_measure_file(first, **{field: old}), tmp_path)
    lines: list[str] = []
    path = self_measure.write(self_measure_file([measured.Row(QK_CACHE, 8, 12, "bf16", True, 4.0, 5.0)]), tmp_path,
                              out=lines.append)
    written = measured.load(path)
    assert [r.key for r in written.rows] == [(QK_CACHE, 12, "bf16", 8)]
    now = measured.conditions("sm90", "NVIDIA H200")[field]
    assert lines == [f"dropped 2 rows of {path} (other shapes or buckets) measured under other conditions ({field} "
                     f"{old!r}, this process's is {now!r}): measure those again"]
    assert measured.load_here("sm90", "NVIDIA H200", {KERNEL_CONFIGS: str(tmp_path)}).measurement == \
        measured.Measurement(**{**written.__dict__, "path": str(path)})


def test_rows_of_a_file_that_does_not_record_the_conditions_are_dropped(tmp_path):
    """A file an older overlay wrote: no launch-config fingerprint."""
    data = self_measure_file([measured.Row(QK_CACHE, 8, 12, "fp8", True, 6.0, 4.0)]).to_json()
    del data["launch_configs"]
    path = tmp_path / measured.result_name("sm90", "NVIDIA H200")
    path.write_text(json.dumps(data))
    lines: list[str] = []
    self_measure.write(self_measure_file([measured.Row(QK_CACHE, 8, 12, "bf16", True, 4.0, 5.0)]), tmp_path,
                       out=lines.append)
    assert [r.key for r in measured.load(path).rows] == [(QK_CACHE, 12, "bf16", 8)]
    assert lines[0].startswith(f"dropped 1 row of {path} (other shapes or buckets) measured under other conditions "
                               "(launch_configs absent, this process's is '")


def test_the_result_records_the_conditions_it_measured_under():
    got = self_measure.result([], "gfx942", "AMD Instinct MI300X", "e4m3fnuz", seed=9)
    assert got.conditions() == measured.conditions("gfx942", "AMD Instinct MI300X")
    assert got.conditions() == {"launch_configs": measured.configs_fingerprint("gfx942", "AMD Instinct MI300X"),
                                "torch": torch.__version__, "triton": triton.__version__,
                                "aiter": versions.aiter_identity(), "kv_cache_dtype": "fp8", "fp8_format": "e4m3fnuz"}
    assert got.to_json()["aiter"] == got.aiter and got.aiter  # recorded, never ""


def flags(**given) -> list[str]:
    return [f for k, v in given.items() for f in (f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, list)
                                                                                  else [v]))]


def args(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    self_measure.add_arguments(parser)
    return parser.parse_args(flags(**given))


@pytest.mark.parametrize("given,message", [
    ({"heads": 12, "variant": "fp4"}, "--variant fp4: allowed bf16, fp8 (fp4: its stock absorption is AITER's MXFP4"),
    ({"heads": 0}, "--heads 0: every value must be a positive integer"),
    ({"heads": 12, "buckets": [8, -1]}, "--buckets 8 -1: every value must be a positive integer"),
    ({"heads": 12, "rounds": -1}, "--rounds -1: a positive integer"),
    ({"heads": 12, "seed": -1}, "--seed -1: a whole number 0-4294967295"),
    ({"heads": 12, "seed": 2**32}, "--seed 4294967296: a whole number 0-4294967295"),
    ({"model": "/nonexistent/k3"}, "--model /nonexistent/k3: cannot read /nonexistent/k3"),
])
def test_usage_errors_name_the_value_and_what_is_allowed(given, message, capsys):
    assert self_measure.run(args(**given)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3-amd-overlay measure: {message}") and "Traceback" not in err


def test_heads_per_rank_come_from_the_models_config_and_the_tensor_parallel_size(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 96}}))
    assert self_measure.heads_from_model(str(tmp_path), 8) == 12
    assert self_measure.heads_from_model(str(tmp_path / "config.json"), 32) == 3
    assert self_measure.run(args(model=str(tmp_path), tensor_parallel_size=7)) == 2
    assert "--tensor-parallel-size 7: does not divide the model's 96 attention heads" in capsys.readouterr().err


@pytest.mark.parametrize("given,message", [
    ({"heads": 96, "tensor_parallel_size": 8}, "--heads 96 with --tensor-parallel-size 8: --heads is heads per rank, "
     "and K3's 96 heads at that size are 12 per rank; give --heads 12, or --heads alone (another model's heads per "
     "rank)"),
    ({"heads": [3, 12], "tensor_parallel_size": 8}, "--heads 3 12 with --tensor-parallel-size 8: --heads is heads "
     "per rank"),
    ({"heads": 12, "tensor_parallel_size": 1}, "--heads 12 with --tensor-parallel-size 1: --heads is heads per "
     "rank, and K3's 96 heads at that size are 96 per rank; give --heads 96"),
    ({"heads": 12, "tensor_parallel_size": 5}, "--tensor-parallel-size 5: does not divide K3's 96 attention heads"),
])
def test_heads_given_with_a_tensor_parallel_size_must_be_k3s_heads_per_rank_there(given, message, capsys):
    assert self_measure._checked(args(heads=12, tensor_parallel_size=8))[0] == [12]  # they agree
    assert self_measure.main(flags(**given)) == 2
    err = capsys.readouterr().err
    assert f"k3-amd-overlay measure: error: {message}" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a GPU there")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert self_measure.run(args(heads=12, out=str(tmp_path))) == 1
    assert "no GPU here" in capsys.readouterr().err and not list(Path(tmp_path).iterdir())


def json_run(argv: list[str], capsys) -> tuple[int, dict, str]:
    code = self_measure.main([*argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a GPU there")
def test_json_without_a_gpu_carries_the_error(tmp_path, capsys):
    code, data, err = json_run(["--heads", "12", "--out", str(tmp_path)], capsys)
    assert code == 1 and data == {"command": "measure", "ok": False, "exit_status": 1, "file": None,
                                  "error": "no GPU here: it measures the GPU the server runs on"}
    assert f"k3-amd-overlay measure: {data['error']}" in err


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU as run() sees it (an H200), its pairs two fake ones at qk_cache buckets 8 and 16 (set
    ``problems`` for 16's parity) timed by a FakeTimer: no kernel runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 << 20)
    monkeypatch.setattr(target, "of", lambda device: types.SimpleNamespace(arch="sm90"))
    monkeypatch.setattr(launch, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(fp8, "device_format", lambda device: E4M3FN)
    planted = types.SimpleNamespace(problems=[])
    monkeypatch.setattr(self_measure, "pairs", lambda *given: [fake_pair(QK_CACHE, 8),
                                                               fake_pair(QK_CACHE, 16, planted.problems)])
    times = {f"qk_cache{t}-{name}": [5.0 if name == "fused" else 8.0] for t in (8, 16)
             for name in ("stock-a", "stock-b", "fused")}
    monkeypatch.setattr(self_measure, "graph_timer", lambda: FakeTimer(times))
    return planted


def test_json_of_a_bucket_not_exact_names_the_file_and_says_why(tmp_path, capsys, fake_gpu):
    code, data, err = json_run(["--heads", "12", "--out", str(tmp_path)], capsys)
    path = tmp_path / "sm90-NVIDIA_H200.measured.json"
    assert code == 0 and data == {"command": "measure", "ok": True, "exit_status": 0, "file": str(path)}
    assert "this run's tensors took at most 3 MiB of GPU memory" in err  # beside a live server: what it took
    fake_gpu.problems.append("cache: 3 bytes written outside the valid slots' rows")
    code, data, err = json_run(["--heads", "12", "--out", str(tmp_path)], capsys)
    assert code == 1 and data == {"command": "measure", "ok": False, "exit_status": 1, "file": str(path), "error": (
        f"1 of 2 buckets not exact (qk_cache; the table says why): they run stock ({path} is written)")}
    assert f"k3-amd-overlay measure: {data['error']}" in err and "FAILED: cache: 3 bytes" in err


@pytest.mark.parametrize("failure", ["the write fails", "no AITER for fp8"])
def test_json_of_every_other_failing_path_carries_the_error(tmp_path, capsys, fake_gpu, monkeypatch, failure):
    out, variant = tmp_path, "bf16"
    if failure == "the write fails":  # --out checked before measuring; the disk may still refuse the file
        def refused(*given):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(self_measure, "write", refused)
        why = f"cannot write the result file into {out}: [Errno 13] Permission denied"
    else:
        monkeypatch.setattr(aiter_peers, "enable", lambda: "AITER's Triton kernels are not importable")
        variant = "fp8"
        why = ("--variant fp8: stock's fp8 absorption is AITER's Triton fp8 BMM: AITER's Triton kernels are not "
               "importable")
    code, data, err = json_run(["--heads", "12", "--variant", variant, "--out", str(out)], capsys)
    assert code == 1 and data["file"] is None and data["error"].startswith(why)
    assert f"k3-amd-overlay measure: {data['error']}" in err


def test_json_of_an_unexpected_failure_carries_the_error_and_the_traceback_stays(tmp_path, capsys, fake_gpu,
                                                                                monkeypatch):
    def lost(*given):
        raise RuntimeError("HIP error: the device was lost\nCompile with TORCH_USE_HIP_DSA for device-side asserts")

    monkeypatch.setattr(self_measure, "pairs", lost)
    with pytest.raises(RuntimeError, match="the device was lost"):  # the traceback on stderr: not hidden
        self_measure.main(["--heads", "12", "--out", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out) == {
        "command": "measure", "ok": False, "exit_status": 1, "file": None, "error": (
            "RuntimeError: HIP error: the device was lost Compile with TORCH_USE_HIP_DSA for device-side asserts (the "
            "traceback is on stderr)")}


def test_run_as_a_module_without_torch_says_so_in_its_json(tmp_path):
    hide_torch = ("import runpy, sys; sys.modules['torch'] = None; "
                  "runpy.run_module('k3_amd_overlay.commands.self_measure', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", hide_torch, "--heads", "12", "--json", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    data = json.loads(proc.stdout)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert data["command"] == "measure" and data["missing"] == "torch" and data["ok"] is False
    assert data["error"].startswith("k3-amd-overlay measure: needs torch, which this Python")


def test_the_default_buckets_are_vllms_capture_sizes():
    """vLLM 0.33's defaults (vllm/config/vllm.py, capped at 512 by vllm/config/compilation.py)."""
    sizes = self_measure.VLLM_CAPTURE_SIZES
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-3:] == (480, 496, 512) and len(sizes) == 51
    assert 248 in sizes and 256 in sizes and 264 not in sizes


def test_the_command_parses_its_own_arguments_and_needs_one_source_of_heads(capsys):
    assert self_measure.main(["--heads", "12", "--variant", "bf16", "fp4"]) == 2
    assert "--variant fp4: allowed bf16, fp8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        self_measure.parser().parse_args(["--variant", "bf16"])
    assert exited.value.code == 2 and "one of the arguments --heads --model is required" in capsys.readouterr().err
    assert self_measure.parser().prog == "k3-amd-overlay measure"


def _out_is_a_file(tmp_path: Path) -> tuple[Path, str]:
    out = tmp_path / "file"
    out.write_text("")
    return out, f"--out {out}: is a file; --out names a directory for the result file"


def _out_under_a_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "sub"
    return out, f"--out {out}: lies under {tmp_path / 'file'}, which is a file; --out names a directory"


@pytest.mark.parametrize("make_out", [_out_is_a_file, _out_under_a_file], ids=["a file", "under a file"])
def test_an_out_that_is_no_directory_is_a_usage_error_before_anything_is_measured(tmp_path, capsys, fake_gpu,
                                                                                   monkeypatch, make_out):
    out, message = make_out(tmp_path)
    monkeypatch.setattr(self_measure, "measure", lambda *given: pytest.fail("measured before --out was checked"))
    code, data, err = json_run(["--heads", "12", "--out", str(out)], capsys)
    assert code == 2 and data["exit_status"] == 2 and data["usage_error"].startswith(message)
    assert f"k3-amd-overlay measure: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("config,message", [
    ([1], "holds a list, not a model config object (with num_attention_heads)"),
    ({"num_attention_heads": True}, "num_attention_heads True is not a positive whole number of heads"),
    ({"text_config": {"num_attention_heads": False}},
     "text_config.num_attention_heads False is not a positive whole number of heads"),
    ({"num_attention_heads": 96.0}, "num_attention_heads 96.0 is not a positive whole number of heads"),
    ({"hidden_size": 7168}, "has no num_attention_heads (top level or text_config)"),
], ids=["a list", "true", "text-false", "float", "none"])
def test_a_model_config_that_is_no_object_or_has_no_whole_heads_is_a_usage_error_naming_the_file(
        tmp_path, capsys, config, message):
    config_file = tmp_path / "cfg.json"
    config_file.write_text(json.dumps(config))
    code, data, err = json_run(["--model", str(config_file)], capsys)
    said = f"--model {config_file}: {config_file} {message}"
    assert code == 2 and data["exit_status"] == 2 and data["usage_error"].startswith(said)
    assert f"k3-amd-overlay measure: error: {said}" in err and "Traceback" not in err


def test_without_out_and_without_a_home_directory_it_is_a_usage_error_before_measuring(capsys, fake_gpu,
                                                                                      monkeypatch):
    from pathlib import Path

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    for name in ("XDG_CACHE_HOME", "K3_AMD_OVERLAY_KERNEL_CONFIGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setattr(self_measure, "measure", lambda *given: pytest.fail("measured with nowhere to write"))
    code, data, err = json_run(["--heads", "12"], capsys)
    assert code == 2 and data["usage_error"] == ("no home directory here for the per-user result directory: give "
                                                 "--out DIR, or set K3_AMD_OVERLAY_KERNEL_CONFIGS as the server has it")
    assert "Traceback" not in err


@pytest.mark.parametrize("model", ["", "   "], ids=["empty", "blank"])
def test_an_empty_model_is_a_usage_error_naming_the_option_not_the_current_directorys_config(
        tmp_path, capsys, monkeypatch, model):
    """``--model ''`` (an unset variable) names no model: refused naming the option, even where the
    current directory holds a config.json it would otherwise have read."""
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 96}))
    monkeypatch.chdir(tmp_path)
    code, data, err = json_run(["--model", model, "--out", str(tmp_path)], capsys)
    said = f"--model {model!r} names no model (an empty value: an unset variable?); give the model's directory"
    assert code == 2 and data["exit_status"] == 2 and data["usage_error"].startswith(said)
    assert f"k3-amd-overlay measure: error: {said}" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_a_model_config_nested_too_deep_or_a_fifo_is_a_usage_error_never_a_crash_or_a_hang(
        tmp_path, capsys, kind):
    """A model config of JSON nested past the parser's limit, or a FIFO in its place (a plain read
    would block forever), is a usage error naming --model and the file."""
    config_file = tmp_path / "config.json"
    if kind == "deep":
        config_file.write_text("[" * 100_000 + "]" * 100_000)
    else:
        os.mkfifo(config_file)
    for model in (config_file, tmp_path):
        code, data, err = json_run(["--model", str(model), "--out", str(tmp_path)], capsys)
        said = f"--model {model}: cannot read {config_file} ("
        assert code == 2 and data["usage_error"].startswith(said), data
        assert f"k3-amd-overlay measure: error: {said}" in err and "Traceback" not in err


def test_a_default_result_directory_that_cannot_be_one_is_a_usage_error_before_measuring(
        tmp_path, capsys, fake_gpu, monkeypatch):
    """Without --out the result file goes beside the launch configs K3_AMD_OVERLAY_KERNEL_CONFIGS names:
    where that directory lies under a file, the run is refused naming the variable before anything is
    measured, as --out is."""
    (tmp_path / "afile").write_text("")
    setting = tmp_path / "afile" / "x.json"
    monkeypatch.setenv(KERNEL_CONFIGS, str(setting))
    monkeypatch.setattr(self_measure, "measure", lambda *given: pytest.fail("measured before its directory's check"))
    code, data, err = json_run(["--heads", "12"], capsys)
    said = f"{KERNEL_CONFIGS}={setting}: its result directory {tmp_path / 'afile'}: is a file; give --out DIR"
    assert code == 2 and data["exit_status"] == 2 and data["usage_error"] == said
    assert f"k3-amd-overlay measure: error: {said}" in err and "Traceback" not in err


@pytest.mark.parametrize("setting,said", [
    (" /tmp/x", "K3_AMD_OVERLAY_KERNEL_CONFIGS=' /tmp/x': spaces before or after the path; give '/tmp/x'"),
    ("/tmp/" + "x" * 300, "K3_AMD_OVERLAY_KERNEL_CONFIGS=/tmp/" + "x" * 300 + ": its result directory cannot be "
                          "looked at ([Errno 36] File name too long"),
])
def test_a_configs_variable_the_server_refuses_or_cannot_look_at_is_a_usage_error(setting, said, capsys, fake_gpu,
                                                                                 monkeypatch):
    """measure read the variable as it is: with ' /tmp/x' it wrote a relative directory the server
    now refuses to start with; a path too long to look at was a traceback."""
    monkeypatch.setenv(KERNEL_CONFIGS, setting)
    monkeypatch.setattr(self_measure, "measure", lambda *given: pytest.fail("measured before its directory's check"))
    code, data, err = json_run(["--heads", "12"], capsys)
    assert code == 2 and data["usage_error"].startswith(said) and "Traceback" not in err


@pytest.mark.parametrize(("argv", "said"), [
    (["--heads", "0"], "--heads 0: every value must be a positive integer"),
    (["--model", ""], "--model '' names no model"),
    (["--heads", "12", "--out", "/dev/null/x"], "--out /dev/null/x: lies under /dev/null"),
])
def test_without_torch_its_argument_checks_are_usage_errors_not_a_missing_torch(argv, said):
    """The CLI runs measure's check_args before it looks for torch: a bad argument is exit 2 saying
    what is wrong, in a Python that cannot import torch."""
    hide_torch = ("import sys; sys.modules['torch'] = None; from k3_amd_overlay.commands import cli; "
                  "sys.exit(cli.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", hide_torch, "measure", *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and said in proc.stderr and "needs torch" not in proc.stderr, proc.stderr[-2000:]


def test_the_decode_pairs_time_vllms_compiled_concat_and_quant_beside_the_eager_ones():
    """vLLM's default serving compiles the concat and quant into one kernel (the eager path runs two):
    each decode bucket's stock candidates hold both, and the faster counts (measure_pair)."""
    found = {pair.fusion: [fn.func.__name__ for fn in pair.stocks]  # type: ignore[attr-defined]
             for pair in self_measure.pairs([1], ["bf16"], [1], DEVICE, E4M3FN, seed=5)}
    assert found[QK_CACHE] == found[ABSORB_QK_CACHE] == ["stock_tail", "stock_tail_compiled"]
    assert "stock_tail_compiled" not in found[QKV_NORM]
    assert "one torch.compile'd kernel (vLLM's default serving)" in self_measure.STOCK_WORDS
