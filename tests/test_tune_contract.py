"""``tune``'s contracts, on a CPU: what the command says (its help, word for word; with --json one
object on stdout on every path, with the file written or the file compared; each table row on the
terminal before the next shape is measured), and what a ``tune.Case`` checks against (the model's
norm eps in the launch and the reference alike; inputs like a real decode step's, whose query codes
neither saturate nor vanish nor repeat; every output paired with a reference, or no verdict)."""

from __future__ import annotations

import inspect
import io
import json
import sys
import typing

import pytest
import torch
from fakes_gpu import no_compile_workers

from k3_amd_overlay import fp8, k3
from k3_amd_overlay.commands import tune, tune_compile
from k3_amd_overlay.commands.bench import shapes
from k3_amd_overlay.kernels import launch, launch_configs, names, target
from k3_amd_overlay.ops import reference

NO_GPU = "no GPU here: tune runs on the GPU it tunes for"
ABSORBING = (names.QK_CACHE_KERNEL, names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL,
             names.ABSORB_MXFP4_QK_CACHE_KERNEL)


# ---- the help ------------------------------------------------------------------------------------

def test_the_help_says_every_option_word_for_word(capsys):
    with pytest.raises(SystemExit) as exit_:
        tune.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: k3-amd-overlay tune [-h] [--out OUT] [--heads HEADS [HEADS ...]] "
                           "[--tokens TOKENS [TOKENS ...]] [--kernels KERNEL [KERNEL ...]] [--compare FILE] "
                           "[--plan] [--arch {sm90,gfx942,gfx950}] [--jobs N] [--verbose] [--json] ")
    options = (
        "options: -h, --help show this help message and exit "
        "--out OUT a file, or a directory for <arch>-<device>.json (default .); an existing file for this arch "
        "and GPU keeps the kernels not tuned now "
        "--heads HEADS [HEADS ...] per-rank query heads (default: the benchmarks') "
        "--tokens TOKENS [TOKENS ...] batch sizes (default: the benchmarks', and 2 and 4 tokens for the absorb "
        "kernels) "
        "--kernels KERNEL [KERNEL ...] the kernels to tune, of rmsnorm_pair_kernel, qk_cache_kernel, "
        "absorb_qk_cache_kernel, absorb_fp8_qk_cache_kernel, absorb_mxfp4_qk_cache_kernel (default: all) "
        "--compare FILE instead of tuning: time FILE's configs against the shipped ones at the shapes a run with "
        "the same --heads and --tokens tunes; exit 1 where FILE's are slower "
        "--plan instead of tuning: print how many candidates a run with these options would compile and time, per "
        "kernel and in all; nothing is written "
        "--arch {sm90,gfx942,gfx950} with --plan: the arch to count for (default: this GPU's; with it no GPU is "
        "needed) "
        "--jobs N compile each shape's candidates in N worker processes on this GPU before timing them (default: "
        f"this machine's cores, at most 16, here {tune_compile.default_jobs()}; 1: no workers, each is compiled at "
        "its first launch) "
        "--verbose say why each rejected candidate was "
        "--json one JSON object on stdout on every path (the file written; the table goes to stderr) ")
    assert options in text
    assert ", ".join(tune.TUNED_KERNELS) in text  # the list is the kernels tune takes, in their order


# ---- --plan: what a run would time ---------------------------------------------------------------

def _plan_total(arch, heads=None, tokens=None, kernels=tune.TUNED_KERNELS):
    return sum(found for _, _, found in tune.plan(kernels, heads or list(shapes.HEADS), tokens, arch))


def test_the_plan_counts_each_shapes_candidates_of_the_kernels_run_on_that_arch():
    rows = tune.plan(tune.TUNED_KERNELS, [12], [1, 256], "gfx942")
    assert [kernel for kernel, _, _ in rows] == [k for k in tune.TUNED_KERNELS
                                                 if k != names.ABSORB_MXFP4_QK_CACHE_KERNEL]  # CDNA4 only
    for kernel, shapes_counted, found in rows:
        shape_list = tune.shapes_of(kernel, [12], [1, 256])
        assert shapes_counted == len(shape_list) == 2
        assert found == sum(len(tune.candidates(kernel, t, True, "gfx942")) for t, _ in shape_list) > 2
    assert [k for k, _, _ in tune.plan(tune.TUNED_KERNELS, [12], None, "gfx950")] == list(tune.TUNED_KERNELS)


def test_the_durations_told_in_the_help_and_readme_are_the_plans_counts():
    from pathlib import Path

    totals = {arch: _plan_total(arch) for arch in launch_configs.SHIPPED_ARCHS}
    help_text = " ".join(tune.__doc__.split())
    assert (f"{totals['gfx942']} candidates on gfx942, {totals['gfx950']} on gfx950 ({totals['sm90']} on sm90)"
            in help_text)
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert f"{totals['gfx942']} candidates on gfx942 and {totals['gfx950']} on gfx950" in readme
    assert f"times {_plan_total('gfx942', heads=[12])} of the {totals['gfx942']} on gfx942" in readme


def test_plan_with_an_arch_needs_no_gpu_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("--plan --arch asked for a GPU"))
    assert tune.main(["--plan", "--arch", "gfx942", "--heads", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = tune.plan(tune.TUNED_KERNELS, [12], None, "gfx942")
    assert lines[0] == tune.plan_line("gfx942", rows)
    assert lines[0].startswith(f"{_plan_total('gfx942', heads=[12])} candidates at {sum(r[1] for r in rows)} "
                               "shapes on gfx942, each compiled and timed (rmsnorm_pair_kernel 144 at 6, ")
    assert lines[1:] == ["| kernel | shapes | candidates |", "|---|---|---|",
                         *(f"| {k} | {n} | {c} |" for k, n, c in rows)]
    assert list(tmp_path.iterdir()) == []


def test_plan_without_an_arch_counts_for_this_gpus(fake_h200, monkeypatch, capsys):
    monkeypatch.setattr(tune, "run", lambda args: pytest.fail("--plan tuned"))
    assert tune.main(["--plan", "--json", "--kernels", names.QK_CACHE_KERNEL, "--tokens", "8", "1", "8"]) == 0
    heads = sorted(shapes.HEADS)
    assert json.loads(capsys.readouterr().out) == {
        "command": "tune", "ok": True, "exit_status": 0,
        "plan": {"arch": "sm90", "heads": heads, "candidates": 2 * len(heads) * 16, "shapes": 2 * len(heads),
                 "kernels": [{"kernel": names.QK_CACHE_KERNEL, "shapes": 2 * len(heads),
                              "candidates": 2 * len(heads) * 16}]}}


@pytest.mark.parametrize(("argv", "message", "code"), [
    (["--arch", "gfx942"], "error: --arch gfx942: only with --plan (a run tunes the GPU it runs on)", 2),
    (["--plan", "--compare", "x.json"], "error: --plan and --compare: give one of them", 2),
    (["--plan"], "no GPU here: --plan counts for this GPU's arch unless --arch names one (sm90, gfx942, gfx950)", 1),
])
def test_plan_misused_is_refused_in_one_line(argv, message, code, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(argv) == code
    assert capsys.readouterr().err.splitlines()[-1] == f"k3-amd-overlay tune: {message}"


def test_plan_refuses_an_arch_without_a_shipped_file(capsys):
    with pytest.raises(SystemExit) as exited:
        tune.main(["--plan", "--arch", "gfx90a"])
    assert exited.value.code == 2
    assert "argument --arch: invalid choice: 'gfx90a'" in capsys.readouterr().err


def test_a_run_says_how_many_candidates_it_will_time_before_its_first_shape(fake_h200, monkeypatch, tmp_path):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    seen = []

    def tune_case(case, shipped, tried, log):
        seen.append((terminal.shown, len(list(tried))))
        return shipped, 8.0, 10.0

    monkeypatch.setattr(tune, "tune_case", tune_case)
    kernels = [names.QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL]
    assert tune.main(["--out", str(tmp_path), "--kernels", *kernels, "--tokens", "2", "256", "--heads", "12"]) == 0
    line = tune.plan_line("sm90", tune.plan(kernels, [12], [2, 256], "sm90"))
    assert line.startswith(f"{sum(n for _, n in seen)} candidates at 4 shapes on sm90, ")
    assert terminal.shown.splitlines()[1] == line
    assert line in seen[0][0].splitlines()  # shown before the first shape is tuned


# ---- the command on a fake H200 ------------------------------------------------------------------

class LightCase:
    """``tune.Case`` without tensors: its kernel and shape recorded, a launch that does nothing."""

    made: typing.ClassVar[list[tuple[str, int, int]]] = []

    def __init__(self, kernel: str, tokens: int, heads: int, fmt: fp8.Fp8Format) -> None:
        LightCase.made.append((kernel, tokens, heads))
        self.run = lambda: None


@pytest.fixture
def fake_h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    gpu = torch.device("cuda", 1)

    def on_gpu(answer):
        return lambda device: answer if device == gpu else pytest.fail(f"asked about {device}, not {gpu}")

    monkeypatch.setattr(target, "of", on_gpu(target.Target(target.CUDA, "sm90")))
    monkeypatch.setattr(launch, "device_name", on_gpu("NVIDIA H200"))
    monkeypatch.setattr(fp8, "device_format", on_gpu(fp8.E4M3FN))
    LightCase.made = []
    monkeypatch.setattr(tune, "Case", LightCase)
    no_compile_workers(monkeypatch)


class Terminal(io.TextIOBase):
    """A stdout that shows what was written only when flushed (as a pipe or a file does)."""

    def __init__(self) -> None:
        self.pending, self.shown = "", ""

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        self.shown, self.pending = self.shown + self.pending, ""


def _shipped(kernel, tokens, heads):
    return dict(launch_configs.rule_for(tune.shipped_rules("sm90", kernel), tokens, heads).config)


def _mine_file(tmp_path, kernel=names.QK_CACHE_KERNEL):
    mine = {"HEADS": 1, "num_warps": 2}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"schema": launch_configs.SCHEMA, "arch": "sm90",
                                "kernels": {kernel: [{"config": mine}]}}))
    return path, mine


def test_with_json_a_machine_without_a_gpu_says_so_in_one_object(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--json", "--heads", "3"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"command": "tune", "ok": False, "exit_status": 1, "error": NO_GPU}
    assert err == f"k3-amd-overlay tune: {NO_GPU}\n"


def test_with_json_a_tuning_prints_one_object_naming_the_file_and_the_table_goes_to_stderr(
        fake_h200, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "tune_case", lambda case, shipped, tried, log: (shipped, 8.0, 10.0))
    out_file = tmp_path / "mine.json"
    code = tune.main(["--json", "--out", str(out_file), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "4",
                      "--heads", "2"])
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out) == {"command": "tune", "ok": True, "exit_status": 0, "file": str(out_file),
                               "compare": None}
    assert f"| {names.QK_CACHE_KERNEL} | 4 | 2 | 10.00 | 8.00 | 1.25 | {_shipped(names.QK_CACHE_KERNEL, 4, 2)} |" \
        in err.splitlines()
    assert err.splitlines()[-1].startswith(f"wrote {out_file}; ")
    assert launch_configs.load(out_file).tuned_on == "NVIDIA H200"


@pytest.mark.parametrize("name", ["", " "])
def test_a_gpu_that_reports_no_name_tunes_nothing_and_says_why(fake_h200, monkeypatch, tmp_path, capsys, name):
    """Some ROCm containers report an empty GPU name: tune wrote `gfx942-.json`, which the server never
    reads (it looks a tuned file up by the GPU's name), and its warning then called the file foreign."""
    monkeypatch.setattr(launch, "device_name", lambda device: name)
    monkeypatch.setattr(tune, "tune_case", lambda *given: pytest.fail("tuned for a file no server reads"))
    code = tune.main(["--json", "--out", str(tmp_path), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "4"])
    out, err = capsys.readouterr()
    why = (f"this GPU reports no name (torch.cuda.get_device_name() gives {name!r}): the server reads a tuned file by "
           "the GPU's name, and would read none written for this one; nothing tuned")
    assert code == 1 and json.loads(out) == {"command": "tune", "ok": False, "exit_status": 1, "file": None,
                                             "compare": None, "error": why}
    assert f"k3-amd-overlay tune: {why}" in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("mine_us", "code"), [(100.0, 0), (150.0, 1)], ids=["as-fast", "slower"])
def test_with_json_a_compare_prints_one_object_naming_the_file_compared_and_no_file_written(
        fake_h200, monkeypatch, tmp_path, capsys, mine_us, code):
    path, mine = _mine_file(tmp_path)
    monkeypatch.setattr(tune, "interleaved_us", lambda run, configs: (
        [mine_us, 100.0] if configs[0] == mine else pytest.fail(f"timed {configs}, not the file's first")))
    assert tune.main(["--json", "--compare", str(path), "--heads", "2"]) == code
    out, err = capsys.readouterr()
    assert json.loads(out) == {"command": "tune", "ok": code == 0, "exit_status": code, "file": None,
                               "compare": str(path)}
    slower = len(shapes.QK_CACHE_BATCHES) if code else 0
    assert err.splitlines()[-1] == f"{slower} shapes slower than the shipped configs by more than 2%"
    assert [p.name for p in tmp_path.iterdir()] == ["mine.json"]


def test_each_tuned_row_is_on_the_terminal_before_the_next_shape_is_tuned(fake_h200, monkeypatch, tmp_path):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    shown_when_tuned = []

    def tune_case(case, shipped, tried, log):
        shown_when_tuned.append(terminal.shown)
        return shipped, 8.0, 10.0

    monkeypatch.setattr(tune, "tune_case", tune_case)
    assert tune.main(["--out", str(tmp_path), "--kernels", names.QK_CACHE_KERNEL, names.ABSORB_QK_CACHE_KERNEL,
                      "--tokens", "1", "4", "--heads", "2"]) == 0
    made = LightCase.made
    assert len(made) == len(shown_when_tuned) == 4
    rows = [f"| {k} | {t} | {h} | 10.00 | 8.00 | 1.25 | {_shipped(k, t, h)} |" for k, t, h in made]
    for i, shown in enumerate(shown_when_tuned):
        assert [row for row in rows if row in shown.splitlines()] == rows[:i]
    assert all(row in terminal.shown.splitlines() for row in rows)


def test_each_compared_row_is_on_the_terminal_before_the_next_shape_is_timed(fake_h200, monkeypatch, tmp_path):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    path, _ = _mine_file(tmp_path)
    shown_when_timed = []

    def interleaved_us(run, configs):
        shown_when_timed.append(terminal.shown)
        return [90.0, 100.0]

    monkeypatch.setattr(tune, "interleaved_us", interleaved_us)
    assert tune.main(["--compare", str(path), "--heads", "2"]) == 0
    rows = [f"| {names.QK_CACHE_KERNEL} | {t} | 2 | 100.00 | 90.00 | 1.11 |" for t in shapes.QK_CACHE_BATCHES]
    assert len(shown_when_timed) == len(rows) > 1
    for i, shown in enumerate(shown_when_timed):
        assert [row for row in rows if row in shown.splitlines()] == rows[:i]
    assert all(row in terminal.shown.splitlines() for row in rows)


# ---- what a case checks against -------------------------------------------------------------------


def test_the_norm_case_launches_and_checks_with_the_models_eps(cpu_for_cuda, monkeypatch):
    from k3_amd_overlay.kernels import rmsnorm_pair

    calls = {}

    def spy(name, function):
        signature = inspect.signature(function)

        def called(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            calls[name] = (bound["q_eps"], bound["kv_eps"])
            return function(*args, **kwargs) if name == "reference" else None
        return called

    monkeypatch.setattr(reference, "rmsnorm_pair_reference", spy("reference", reference.rmsnorm_pair_reference))
    monkeypatch.setattr(rmsnorm_pair, "rmsnorm_pair", spy("launch", rmsnorm_pair.rmsnorm_pair))
    case = tune.Case(names.RMSNORM_PAIR_KERNEL, 3, 1, fp8.E4M3FN)
    assert calls == {"reference": (k3.RMS_NORM_EPS, k3.RMS_NORM_EPS)}
    case.run()
    assert calls["launch"] == (k3.RMS_NORM_EPS, k3.RMS_NORM_EPS)


@pytest.mark.parametrize("fmt", [fp8.E4M3FN, fp8.E4M3FNUZ], ids=lambda f: f.name)
@pytest.mark.parametrize("kernel", ABSORBING)
def test_a_cases_query_codes_are_like_a_decode_steps(kernel, fmt, cpu_for_cuda):
    """The reference's query (the absorbed 512 codes and the rope 64 of each head) is what a real step
    quantizes: the absorbed part of the same order as the rope part (the one q_scale serves both), no
    code saturated or flushed to zero, and each head's codes varied: a bytes check over such codes
    sees a candidate's rounding everywhere."""
    tokens, heads = 4, 2
    case = tune.Case(kernel, tokens, heads, fmt)
    want_out = case.wanted[0]
    assert tuple(want_out.shape) == (tokens, heads, k3.KV_LORA_RANK + k3.QK_ROPE_HEAD_DIM)
    values = want_out.view(fmt.dtype).float()
    absorbed, rope = values[..., : k3.KV_LORA_RANK], values[..., k3.KV_LORA_RANK:]
    ratio = float(absorbed.abs().median() / rope.abs().median())
    assert 0.25 < ratio < 4, ratio
    assert float((absorbed.abs() >= fmt.fmax).float().mean()) < 1e-3
    assert float((absorbed == 0).float().mean()) < 1e-2
    distinct = [len(set(row.tolist())) for row in want_out[..., : k3.KV_LORA_RANK].reshape(-1, k3.KV_LORA_RANK)]
    assert min(distinct) >= 64, distinct


class PairedCase(tune.Case):
    """A case with outputs and a reference set by hand (no kernel, no GPU)."""

    def __init__(self, outputs, wanted):
        self.kernel, self.outputs, self.wanted = names.QK_CACHE_KERNEL, outputs, wanted
        self.run = lambda: [o.copy_(w) for o, w in zip(outputs, wanted, strict=False)]


def test_a_case_whose_reference_does_not_pair_every_output_gives_no_verdict():
    def codes(n):
        return torch.randint(0, 256, (n,), dtype=torch.uint8)

    reference_codes = codes(7)
    assert PairedCase((torch.empty(7, dtype=torch.uint8),), (reference_codes,)).mismatches(None) == (0, 0)
    # the second output never checked (or a reference for an output that is not there): refused, not a pass
    with pytest.raises(ValueError, match="zip"):
        PairedCase((torch.empty(7, dtype=torch.uint8), torch.empty(5, dtype=torch.uint8)),
                   (reference_codes,)).mismatches(None)
    with pytest.raises(ValueError, match="zip"):
        PairedCase((torch.empty(7, dtype=torch.uint8),), (reference_codes, codes(5))).mismatches(None)


# ---- bad input: refused before any tuning, one JSON object --------------------------------------

def _usage_error(argv, capsys):
    """tune.main with --json: (exit code, the one JSON object on stdout, stderr)."""
    code = tune.main(["--json", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _never_tuned(monkeypatch):
    monkeypatch.setattr(tune, "tune_case", lambda *given: pytest.fail("tuned before the arguments were checked"))
    monkeypatch.setattr(tune, "interleaved_us", lambda *given: pytest.fail("timed before the arguments were checked"))


def _assert_usage_error(code, data, err, said):
    assert code == 2 and data["exit_status"] == 2 and data["ok"] is False and said in data["usage_error"], data
    assert f"k3-amd-overlay tune: error: {said}" in err and "Traceback" not in err


def _with_or_without_gpu(request, monkeypatch, gpu: bool) -> None:
    """A fake H200, or no GPU at all; either way nothing is ever tuned (the checks come before it)."""
    if gpu:
        request.getfixturevalue("fake_h200")
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _never_tuned(monkeypatch)


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "not a usable launch-config file (cannot read launch configs"),
    ('{"schema": 1, "arch": "sm90", "kernels": {"no_such_kernel": []}}', "not a usable launch-config file"),
    ("[1]", "not a launch-config file of schema 1"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deep to read"),
], ids=["malformed", "unknown-kernel", "a-list", "nested-too-deep"])
@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "fake-h200"])
def test_a_compare_file_that_is_no_launch_config_file_is_a_usage_error_before_the_gpu(
        request, monkeypatch, tmp_path, capsys, text, why, gpu):
    _with_or_without_gpu(request, monkeypatch, gpu)
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    code, data, err = _usage_error(["--compare", str(bad), "--heads", "2"], capsys)
    _assert_usage_error(code, data, err, f"--compare {bad}: ")
    assert why in data["usage_error"]


def _file_for(arch):
    return {"schema": launch_configs.SCHEMA, "arch": arch,
            "kernels": {names.QK_CACHE_KERNEL: [{"config": {"HEADS": 2, "num_warps": 2}}]}}


def test_out_with_compare_is_a_usage_error_naming_both(monkeypatch, tmp_path, capsys):
    """--compare writes no file, so an --out beside it (a file or a directory) is refused naming both
    options, whichever comes first, before any GPU work; nothing is written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked for a GPU before the check"))
    _never_tuned(monkeypatch)
    compared = tmp_path / "mine.json"
    compared.write_text(json.dumps(_file_for("sm90")))
    for argv in (["--compare", str(compared), "--out", "nodir"], ["--out", str(tmp_path), "--compare", str(compared)]):
        code, data, err = _usage_error(argv, capsys)
        out = argv[argv.index("--out") + 1]
        _assert_usage_error(code, data, err, f"--out {out} and --compare: --compare writes no file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]


def test_out_with_plan_is_a_usage_error_naming_both(monkeypatch, tmp_path, capsys):
    """Audit: --plan writes nothing, and an --out beside it was silently ignored (exit 0, no file):
    refused as --out beside --compare is, whichever comes first; nothing is written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked for a GPU before the check"))
    _never_tuned(monkeypatch)
    for argv in (["--plan", "--arch", "gfx942", "--out", str(tmp_path / "f.json")],
                 ["--out", str(tmp_path), "--plan", "--arch", "gfx942"]):
        code, data, err = _usage_error(argv, capsys)
        out = argv[argv.index("--out") + 1]
        _assert_usage_error(code, data, err, f"--out {out} and --plan: --plan writes no file (it counts the "
                                             "candidates a run would time); give one of them")
    assert list(tmp_path.iterdir()) == []


def _nested_too_deep(path):
    path.write_text("[" * 100_000 + "]" * 100_000)
    return "exists and is not a launch-config file tune can update (JSON nested too deep to read)"


def _malformed(path):
    path.write_text('{"schema": 1, "arch": ')
    return "exists and is not a launch-config file tune can update"


def _tuned_on_a_string(path):
    path.write_text(json.dumps({"schema": launch_configs.SCHEMA, "arch": "sm90", "tuned_on": "NVIDIA H200",
                                "kernels": {}}))
    return "exists and its tuned_on 'NVIDIA H200' is not an object"


def _no_launch_configs(path):
    path.write_text(json.dumps({"some": "other file"}))
    return "exists and is not a launch-config file tune can update"


@pytest.mark.parametrize("make", [_malformed, _tuned_on_a_string, _no_launch_configs, _nested_too_deep],
                         ids=["malformed", "tuned_on-a-string", "another-json-file", "nested-too-deep"])
@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "fake-h200"])
def test_an_out_file_tune_cannot_update_is_a_usage_error_before_any_tuning_and_is_kept(
        request, monkeypatch, tmp_path, capsys, make, gpu):
    _with_or_without_gpu(request, monkeypatch, gpu)
    out = tmp_path / "mine.json"
    why = make(out)
    before = out.read_text()
    code, data, err = _usage_error(["--out", str(out), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "4",
                                    "--heads", "2"], capsys)
    _assert_usage_error(code, data, err, f"--out {out} {why}")
    assert out.read_text() == before and LightCase.made == []


def test_the_file_in_an_out_directory_is_checked_once_the_gpu_names_it_before_any_tuning(
        fake_h200, monkeypatch, tmp_path, capsys):
    _never_tuned(monkeypatch)
    named = tmp_path / "sm90-NVIDIA_H200.json"
    why = _tuned_on_a_string(named)
    code, data, err = _usage_error(["--out", str(tmp_path), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "4",
                                    "--heads", "2"], capsys)
    _assert_usage_error(code, data, err, f"--out {tmp_path}: {named} {why}")
    assert LightCase.made == []


@pytest.mark.parametrize("where", ["missing/mine.json", "missing"], ids=["file", "directory"])
@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "fake-h200"])
def test_an_out_under_a_missing_directory_is_a_usage_error_before_any_tuning(
        request, monkeypatch, tmp_path, capsys, where, gpu):
    _with_or_without_gpu(request, monkeypatch, gpu)
    out = tmp_path / where
    code, data, err = _usage_error(["--out", str(out), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "4"], capsys)
    said = (f"--out {out}: the directory {tmp_path / 'missing'} does not exist" if where.endswith(".json")
            else f"--out {out}: no such directory")
    _assert_usage_error(code, data, err, said)
    assert not (tmp_path / "missing").exists()


def test_an_out_file_for_another_gpu_is_refused_untouched_and_one_for_this_gpu_keeps_its_other_kernels(
        fake_h200, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "tune_case", lambda case, shipped, tried, log: (shipped, 8.0, 10.0))
    out = tmp_path / "mine.json"
    kept = [{"config": {"ROWS_Q": 1, "ROWS_KV": 1, "num_warps": 2}}]
    out.write_text(json.dumps({"schema": launch_configs.SCHEMA, "arch": "sm90", "tuned_on": {"device": "NVIDIA H200"},
                               "kernels": {names.RMSNORM_PAIR_KERNEL: kept}}))
    argv = ["--out", str(out), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "4", "--heads", "2"]
    assert tune.main(argv) == 0
    assert sorted(launch_configs.load(out).kernels) == [names.QK_CACHE_KERNEL, names.RMSNORM_PAIR_KERNEL]
    out.write_text(json.dumps({"schema": launch_configs.SCHEMA, "arch": "sm90", "tuned_on": {"device": "other"},
                               "kernels": {names.RMSNORM_PAIR_KERNEL: kept}}))
    before = out.read_bytes()
    assert tune.main(argv) == 1  # another GPU's tuning is never replaced (before: replaced whole)
    assert out.read_bytes() == before


def test_with_json_a_failure_while_tuning_still_prints_one_object_and_keeps_the_traceback(
        fake_h200, monkeypatch, tmp_path, capsys):
    def off(case, shipped, tried, log):
        raise RuntimeError("qk_cache_kernel: the shipped config is 3 codes off the reference")

    monkeypatch.setattr(tune, "tune_case", off)
    with pytest.raises(RuntimeError, match="3 codes off"):
        tune.main(["--json", "--out", str(tmp_path), "--kernels", names.QK_CACHE_KERNEL, "--tokens", "4"])
    assert json.loads(capsys.readouterr().out) == {
        "command": "tune", "ok": False, "exit_status": 1, "file": None, "compare": None,
        "error": "RuntimeError: qk_cache_kernel: the shipped config is 3 codes off the reference (the traceback is "
                 "on stderr)"}
