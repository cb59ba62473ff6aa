"""Launch configs per arch (the shipped files, a tuned file by K3_AMD_OVERLAY_KERNEL_CONFIGS, the
errors a bad file gets), the compile report's reading of AMD code objects, ``tune``'s pure parts,
and the refusal of a fusion whose kernel fails (``kernel_failures``, the plan and the norm site)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import subprocess
import sys
import types

import pytest
import torch
from packaging.version import Version

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.commands import compile_report, tune
from k3_amd_overlay.fusions.qk_cache import AbsorbVariant, BatchFacts, DecodePath, DecodePlan
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.kernels import launch_configs, names
from k3_amd_overlay.settings import KERNEL_CONFIGS

APPLIED = LayerDecision(FusionState.APPLIED, "triton", "ok")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(KERNEL_CONFIGS, raising=False)
    monkeypatch.setattr(kernel_failures, "_failed", {})
    launch_configs._resolve.cache_clear()
    launch_configs._tuned.cache_clear()
    yield
    launch_configs._resolve.cache_clear()
    launch_configs._tuned.cache_clear()


@pytest.mark.parametrize("arch", [*launch_configs.SHIPPED_ARCHS, launch_configs.INTERPRETER_ARCH])
def test_every_shipped_file_parses_and_covers_every_kernel(arch):
    table = launch_configs.shipped(arch)
    assert table.arch == arch and set(table.kernels) == set(launch_configs.KERNEL_PARAMETERS)
    text = (launch_configs.CONFIG_DIR / f"{arch}.json").read_text()
    assert launch_configs.dumps(json.loads(text)) == text  # the one layout, as tune writes it


def test_amd_only_options_reach_amd_launches_only():
    rules = launch_configs.shipped("gfx950").kernels[names.ABSORB_MXFP4_QK_CACHE_KERNEL]
    with_option = next(r for r in rules if "matrix_instr_nonkdim" in dict(r.config))
    tokens, heads = with_option.tokens or 100_000, with_option.heads or 1
    amd = launch_configs.choose(names.ABSORB_MXFP4_QK_CACHE_KERNEL, "gfx950", None, tokens, heads, amd=True)
    other = launch_configs.choose(names.ABSORB_MXFP4_QK_CACHE_KERNEL, "gfx950", None, tokens, heads, amd=False)
    assert amd["matrix_instr_nonkdim"] == 16 and "matrix_instr_nonkdim" not in other
    assert {k: v for k, v in amd.items() if k != "matrix_instr_nonkdim"} == other


def test_archs_without_a_file_take_the_nearest_shipped_one():
    assert [launch_configs.shipped_arch(a) for a in ("gfx942", "gfx90a", "sm100", "cpu")] == \
        ["gfx942", "gfx942", "sm90", "cpu"]


def _file(arch="gfx942", device=None, kernels=None):
    data = {"schema": 1, "arch": arch, "tuned_on": {"device": device} if device else None,
            "kernels": kernels or {names.QK_CACHE_KERNEL: [{"config": {"HEADS": 2, "num_warps": 2}}]}}
    return data


@pytest.mark.parametrize(("kernels", "message"), [
    ({"nope_kernel": [{"config": {}}]}, "unknown kernels ['nope_kernel']"),
    ({names.QK_CACHE_KERNEL: [{"config": {"num_warps": 4}}]}, "lacks ['HEADS']"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": 4, "BLOCK": 2}}]}, "unknown keys ['BLOCK']"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 3, "num_warps": 4}}]}, "HEADS = 3 is not a power of two"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": "4"}}]}, "'4' is not a positive integer"),
    ({names.ABSORB_QK_CACHE_KERNEL: [{"config": {"BLOCK_N": 32, "BLOCK_T": 8, "num_warps": 4}}]},
     "BLOCK_T = 8 on gfx942: at most 4 (no dot: the products summed in fp32) or at least 16 (AMD's smallest "
     "matrix tile; Triton computes a smaller dot there with FMA)"),
    ({names.ABSORB_QK_CACHE_KERNEL: [{"config": {"BLOCK_N": 32, "BLOCK_T": 1, "K_STEPS": 2, "num_warps": 4}}]},
     "K_STEPS = 2 with BLOCK_T = 1: the product in slices is for programs of at least 16"),
    ({names.ABSORB_QK_CACHE_KERNEL: [{"config": {"BLOCK_N": 32, "BLOCK_T": 16, "K_STEPS": 16, "num_warps": 4}}]},
     "K_STEPS = 16: allowed 1-8 (slices of the 128 q_nope lanes of at least 16"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": 2 ** 70}}]},
     f"num_warps = {2 ** 70}: allowed 1-32 (1024 threads a workgroup"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": 64}}]}, "num_warps = 64: allowed 1-32"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 8192, "num_warps": 4}}]}, "HEADS = 8192: allowed 1-4096"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": 4, "num_stages": 32}}]},
     "num_stages = 32: allowed 1-16"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": 4, "waves_per_eu": 21}}]},
     "waves_per_eu = 21: allowed 0-20 (0: the compiler's choice"),
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": 4, "kpack": 4}}]}, "kpack = 4: allowed 1-2"),
    # 0 is the compiler's choice for the other AMD options; Triton's AMD matmul pass fails on a kpack of 0
    ({names.QK_CACHE_KERNEL: [{"config": {"HEADS": 4, "num_warps": 4, "kpack": 0}}]}, "kpack: 0 is not a positive"),
    ({names.ABSORB_QK_CACHE_KERNEL: [{"config": {"BLOCK_N": 2 ** 40, "BLOCK_T": 16, "num_warps": 4}}]},
     f"BLOCK_N = {2 ** 40}: allowed 1-4096"),
    ({names.ABSORB_QK_CACHE_KERNEL: [{"config": {"BLOCK_N": 32, "BLOCK_T": 16, "K_STEPS": 3, "num_warps": 4}}]},
     "K_STEPS = 3 is not a power of two"),
    ({names.ABSORB_FP8_QK_CACHE_KERNEL: [{"config": {"BLOCK_N": 32, "BLOCK_T": 16, "K_STEPS": 2, "num_warps": 4}}]},
     "unknown keys ['K_STEPS']"),
    ({names.QK_CACHE_KERNEL: [{"tokens": 8, "config": {"HEADS": 4, "num_warps": 4}}]},
     "the last rule must match every launch"),
    ({names.QK_CACHE_KERNEL: []}, "a non-empty list of rules"),
])
def test_a_bad_file_is_refused_naming_the_value_and_what_is_allowed(kernels, message):
    with pytest.raises(launch_configs.LaunchConfigError, match=re.escape(message)):
        launch_configs.parse(_file(kernels=kernels), "f.json")
    with pytest.raises(launch_configs.LaunchConfigError, match="schema 1"):
        launch_configs.parse({**_file(), "schema": 2}, "f.json")


def test_every_key_a_config_may_set_has_an_upper_bound_the_shipped_files_and_tune_keep_under():
    """Each constexpr and launch option a config can set is bounded (matrix_instr_nonkdim by its set of
    sizes), and every shipped value and every candidate tune tries lies within its bound."""
    settable = {key for kernel in launch_configs.KERNEL_PARAMETERS
                for key in (*launch_configs.KERNEL_PARAMETERS[kernel], *launch_configs.OPTIONAL_PARAMETERS[kernel])}
    settable |= set(launch_configs.LAUNCH_OPTIONS) - {"matrix_instr_nonkdim"}
    assert settable == set(launch_configs.MOST_VALUES)
    configs = [dict(rule.config) for arch in (*launch_configs.SHIPPED_ARCHS, launch_configs.INTERPRETER_ARCH)
               for rules in launch_configs.shipped(arch).kernels.values() for rule in rules]
    configs += [c for kernel, tokens, amd in itertools.product(tune.TUNED_KERNELS, (1, 8, 32, 256), (False, True))
                for c in tune.candidates(kernel, tokens, amd)]
    for config in configs:
        assert all(value <= launch_configs.MOST_VALUES.get(key, (32, ""))[0] for key, value in config.items())


@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_a_file_nested_too_deep_or_a_fifo_is_one_clear_line_never_a_crash_or_a_hang(tmp_path, monkeypatch, kind):
    """A launch-config file of JSON nested past the parser's limit, or a FIFO in its place (which a plain
    read would block on forever), is a LaunchConfigError naming the file: one line at startup."""
    path = tmp_path / "configs.json"
    if kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        os.mkfifo(path)
    with pytest.raises(launch_configs.LaunchConfigError, match=f"cannot read launch configs {re.escape(str(path))}"):
        launch_configs.load(path)
    monkeypatch.setenv(KERNEL_CONFIGS, str(path))
    error = launch_configs.startup_error("gfx942", "AMD Instinct MI300X")
    assert error is not None and str(path) in error and "\n" not in error


def test_a_tuned_file_named_by_the_variable_comes_first_for_its_kernels(tmp_path, monkeypatch):
    path = tmp_path / "gfx942-AMD_Instinct_MI300X.json"
    path.write_text(json.dumps(_file(device="AMD Instinct MI300X")))
    monkeypatch.setenv(KERNEL_CONFIGS, str(path))
    assert launch_configs.choose(names.QK_CACHE_KERNEL, "gfx942", "AMD Instinct MI300X", 8, 3) == \
        {"HEADS": 2, "num_warps": 2}
    sources = launch_configs.sources("gfx942", "AMD Instinct MI300X")
    assert sources[names.QK_CACHE_KERNEL] == {"file": str(path), "arch": "gfx942", "tuned_on": "AMD Instinct MI300X",
                                              "tuned_here": True}
    assert sources[names.RMSNORM_PAIR_KERNEL]["file"].endswith("gfx942.json")  # not in the tuned file: shipped
    assert launch_configs.sources("gfx942", "AMD Instinct MI325X")[names.QK_CACHE_KERNEL]["tuned_here"] is False
    # a file for another arch: the shipped configs, and the one line saying why (tests/test_config_degrade.py)
    assert launch_configs.resolve("gfx950", "AMD Instinct MI355X")[names.QK_CACHE_KERNEL][1].file.endswith(
        "gfx950.json")
    assert "its configs are for gfx942, this GPU is gfx950" in launch_configs.startup_error("gfx950", "MI355X")


def test_in_a_directory_only_the_file_tuned_on_this_gpu_is_used(tmp_path, monkeypatch):
    (tmp_path / "gfx942-AMD_Instinct_MI300X.json").write_text(json.dumps(_file(device="AMD Instinct MI300X")))
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    assert launch_configs.choose(names.QK_CACHE_KERNEL, "gfx942", "AMD Instinct MI300X", 8, 3)["HEADS"] == 2
    launch_configs._resolve.cache_clear()
    shipped = launch_configs.choose(names.QK_CACHE_KERNEL, "gfx942", "AMD Instinct MI325X", 8, 3)
    assert shipped == dict(launch_configs.shipped("gfx942").kernels[names.QK_CACHE_KERNEL][0].config)



def test_in_a_directory_only_tuned_names_are_read_and_other_names_are_named_in_a_warning(tmp_path, monkeypatch,
                                                                                        caplog):
    (tmp_path / "gfx942-AMD_Instinct_MI300X.json").write_text(json.dumps(_file(device="AMD Instinct MI300X")))
    (tmp_path / "notes.json").write_text('{"who": "ops team"}')  # foreign JSON
    (tmp_path / "old.json").write_text("not json at all")
    (tmp_path / "gfx942-AMD_Instinct_MI325X.json").write_text("{broken")  # another GPU's: not read
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    launch_configs._warn_foreign.cache_clear()
    with caplog.at_level(logging.WARNING, logger="vllm.k3_amd_overlay"):
        assert launch_configs.choose(names.QK_CACHE_KERNEL, "gfx942", "AMD Instinct MI300X", 8, 3)["HEADS"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"K3 AMD overlay: {KERNEL_CONFIGS}={tmp_path}: ignored notes.json, old.json (only <arch>-<device>.json "
        "files, as `k3-amd-overlay tune` names them, are read)"]
    assert launch_configs.tuned_name("gfx942", "AMD Instinct MI300X") == \
        tune.out_path(str(tmp_path), "gfx942", "AMD Instinct MI300X").name  # the name tune writes


@pytest.mark.parametrize(("text", "why"), [
    ("{broken", "cannot read launch configs"),
    (json.dumps(_file(kernels={names.QK_CACHE_KERNEL: []}, device="AMD Instinct MI300X")), "a non-empty list of rules"),
    (json.dumps(_file(device="AMD Instinct MI325X")), "named for gfx942 on AMD Instinct MI300X, its header says gfx942 "
                                                      "on AMD Instinct MI325X"),
])
def test_a_bad_file_for_this_gpu_is_one_clear_line_at_startup(tmp_path, monkeypatch, text, why):
    path = tmp_path / "gfx942-AMD_Instinct_MI300X.json"
    path.write_text(text)
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    error = launch_configs.startup_error("gfx942", "AMD Instinct MI300X")
    assert error is not None and str(path) in error and why in error and "\n" not in error
    assert launch_configs.startup_error("gfx942", "AMD Instinct MI325X") is None  # no file for that GPU: shipped
    assert launch_configs.startup_error("gfx950", "AMD Instinct MI300X") is None


def test_a_configs_path_that_cannot_be_looked_at_is_the_startup_error_not_a_crash(monkeypatch):
    """A path the OS refuses to look at (too long here; no access where the server's user cannot
    search a parent) raised OSError from ``is_dir`` into vLLM's layer build; now it is the one ERROR
    line of a file that cannot be used, and the shipped configs serve."""
    setting = "/tmp/" + "x" * 300
    monkeypatch.setenv(KERNEL_CONFIGS, setting)
    error = launch_configs.startup_error("gfx942", "AMD Instinct MI300X")
    assert error is not None and error.startswith(f"{KERNEL_CONFIGS}={setting}: [Errno 36] File name too long")
    assert error.endswith("this GPU's kernels take the shipped gfx942 launch configs instead")


@pytest.mark.parametrize("arch", ["gfx90a", "gfx908", "gfx1100", "gfx1201", "sm100"])
def test_an_arch_without_a_file_takes_the_nearest_untuned_with_a_warning_and_a_note(arch, caplog):
    launch_configs._warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="vllm.k3_amd_overlay"):
        found = launch_configs.sources(arch, "some GPU")
        launch_configs.choose(names.ABSORB_FP8_QK_CACHE_KERNEL, arch, "some GPU", 8, 16, amd=arch.startswith("gfx"))
    nearest = "gfx942" if arch.startswith("gfx") else "sm90"
    note = f"no launch-config file for {arch}: {nearest}'s rules, untuned there"
    assert all(source["note"].startswith(note) and source["file"].endswith(f"{nearest}.json")
               for source in found.values())
    assert ("32-wide waves" in found[names.QK_CACHE_KERNEL]["note"]) == arch.startswith("gfx1")
    assert [r.getMessage() for r in caplog.records] == [f"K3 AMD overlay: {found[names.QK_CACHE_KERNEL]['note']}"]
    assert "note" not in launch_configs.sources("gfx942", "some GPU")[names.QK_CACHE_KERNEL]


AMDGCN = """
\t.amdgcn_target "amdgcn-amd-amdhsa--gfx950"
    .sgpr_count:     50
    .sgpr_spill_count: 0
    .vgpr_count:     137
    .vgpr_spill_count: 2
    .agpr_count:     0
    .private_segment_fixed_size: 8
\tv_mfma_f32_16x16x32_bf16 a[0:3], v[0:3], v[4:7], 0
"""
TTGIR = ("#mma = #ttg.amd_mfma<{version = 3, warpsPerCTA = [8, 1], instrShape = [16, 16, 32], isTransposed = true}>\n"
         "%1 = tt.dot %a, %b, %c : tensor<16x128xbf16, #x> * tensor<128x32xbf16, #y> -> tensor<16x32xf32, #mma>\n")


def test_the_report_reads_the_code_objects_metadata():
    facts = compile_report.isa_facts(AMDGCN)
    assert facts == {"sgpr_count": 50, "sgpr_spill_count": 0, "vgpr_count": 137, "vgpr_spill_count": 2,
                     "agpr_count": 0, "private_segment_fixed_size": 8, "target": "gfx950"}
    assert compile_report.tile_copies(TTGIR) == 8  # 8 warps down a 16-row tile of 16-row MFMAs
    assert compile_report.tile_copies(TTGIR.replace("[8, 1]", "[1, 2]")) == 1
    assert compile_report.tile_copies("no dot here") == 1


@pytest.mark.parametrize(("vgpr", "agpr", "lds", "warps", "arch", "waves"), [
    (64, 0, 0, 4, "gfx942", 8), (128, 0, 0, 4, "gfx942", 4), (129, 0, 0, 4, "gfx942", 3),
    (252, 0, 0, 4, "gfx942", 2), (62, 64, 0, 4, "gfx942", 4),  # AGPRs after the VGPRs, rounded to 4
    (40, 0, 16384, 4, "gfx942", 4), (40, 0, 16384, 4, "gfx950", 8), (40, 0, 32768, 2, "gfx942", 1),
])
def test_waves_per_simd_from_registers_and_lds(vgpr, agpr, lds, warps, arch, waves):
    assert compile_report.waves_per_simd(vgpr, agpr, lds, warps, arch) == waves


def test_a_configuration_falls_short_for_each_goal_it_misses():
    entry = compile_report.Entry(kernel="k", config={}, compiled=True, target="gfx942", vgpr=160, agpr=0, sgpr=40,
                                 vgpr_spill=1, sgpr_spill=0, scratch_bytes=16, waves_per_simd=3, tile_copies=8)
    assert compile_report.problems(entry, "gfx950") == [
        "built for gfx942, not gfx950", "spills 1 VGPRs, 0 SGPRs", "16 B scratch", "3 waves per SIMD (< 4)",
        "the dot's tile computed 8 times over by its warps"]
    assert compile_report.problems(compile_report.Entry(kernel="k", config={}, compiled=False), "gfx942") == \
        ["compile error"]


def test_the_kernels_command_needs_an_arch_where_there_is_no_amd_gpu(capsys):
    assert compile_report.main([]) == 2
    assert "no AMD GPU here: pass --arch gfx942 or gfx950" in capsys.readouterr().err


def _oldest_gate_triton() -> Version:
    """The oldest Triton release the CI compile gate builds the AMD files with (scripts/compile-tritons.txt)."""
    with open(f"{__file__.rsplit('/', 2)[0]}/scripts/compile-tritons.txt") as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    return min(Version(line) for line in lines if line != "newest")


@pytest.mark.kernels
def test_the_report_compiles_every_kernel_for_mi300x_with_the_fields_promised():
    """The report of gfx942 with this venv's Triton (CI runs it for both archs and three Tritons). The
    shipped AMD files are held to no shortfall from the oldest Triton the compile gate builds with on;
    with an older one (the GPU machine's 3.6.0 gave two gfx942 fp8 configs 3 waves per SIMD) every
    kernel must still compile and the report say what falls short."""
    proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay.commands.compile_report", "--arch", "gfx942",
                           "--json"],
                          capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout)
    short = [e for e in report["kernels"] if e["problems"]]
    if Version(report["triton"]) >= _oldest_gate_triton():
        assert proc.returncode == 0, short
    else:
        assert all(e["compiled"] and e["error"] is None for e in report["kernels"]), short
        assert proc.returncode == (1 if short else 0) and bool(short) == ("error" in report), report.get("error")
    assert report["arch"] == "gfx942" and report["triton"]
    fields = ["kernel", "config", "compiled", "error", "target", "vgpr", "agpr", "sgpr", "lds_bytes", "vgpr_spill",
              "sgpr_spill", "scratch_bytes", "waves_per_simd"]
    assert all(list(e)[:len(fields)] == fields and e["target"] == "gfx942" for e in report["kernels"])
    compiled = {e["kernel"] for e in report["kernels"]}
    assert compiled == set(launch_configs.KERNEL_PARAMETERS) - {names.ABSORB_MXFP4_QK_CACHE_KERNEL}  # CDNA4 only
    assert {e["dtype"] for e in report["kernels"]} == {"bfloat16", "float16"}


def test_tune_tries_amd_options_only_on_amd_and_one_token_programs_only_for_one_token():
    nvidia = tune.candidates(names.ABSORB_FP8_QK_CACHE_KERNEL, 1, amd=False)
    amd = tune.candidates(names.ABSORB_FP8_QK_CACHE_KERNEL, 1, amd=True)
    assert not any("matrix_instr_nonkdim" in c for c in nvidia) and any("matrix_instr_nonkdim" in c for c in amd)
    assert {c["BLOCK_T"] for c in nvidia} == {1, 16}
    assert {c["BLOCK_T"] for c in tune.candidates(names.ABSORB_FP8_QK_CACHE_KERNEL, 64, amd=False)} == {16, 32, 64}


def test_every_candidate_tune_tries_is_a_config_the_overlay_would_accept():
    for kernel, tokens in itertools.product(tune.TUNED_KERNELS, (1, 32, 256)):
        for config in tune.candidates(kernel, tokens, amd=True):
            launch_configs.parse(_file(kernels={kernel: [{"config": config}]}), "candidate")


def test_tuned_rules_close_each_head_count_and_end_with_a_catch_all():
    def rule(tokens, heads, n):
        return {"tokens": tokens, "heads": heads, "config": {"HEADS": n, "num_warps": 4}}

    rules = tune.with_catch_alls([rule(8, 6, 1), rule(1, 3, 2), rule(8, 3, 4), rule(1, 6, 8)])
    parsed = launch_configs.parse(_file(kernels={names.QK_CACHE_KERNEL: rules}), "t").kernels[names.QK_CACHE_KERNEL]
    pick = {(t, h): dict(launch_configs.rule_for(parsed, t, h).config)["HEADS"]
            for t in (1, 8, 500) for h in (2, 3, 5, 6, 64)}
    assert pick == {(1, 2): 2, (8, 2): 4, (500, 2): 4, (1, 3): 2, (8, 3): 4, (500, 3): 4,
                    (1, 5): 8, (8, 5): 1, (500, 5): 1, (1, 6): 8, (8, 6): 1, (500, 6): 1,
                    (1, 64): 1, (8, 64): 1, (500, 64): 1}


def test_tunes_bytes_check_counts_codes_one_step_and_further_off():
    want = torch.tensor([0x10, 0x90, 0x7E, 0x00], dtype=torch.uint8)
    got = torch.tensor([0x11, 0x91, 0x7E, 0x80], dtype=torch.uint8)  # +1 step, -1 step, same, sign flip
    assert tune._codes_apart(got, want) == (3, 1)
    assert tune.out_path(".", "sm90", "NVIDIA H200").name == "sm90-NVIDIA_H200.json"


# ---- a fused kernel that fails -------------------------------------------------------------------

def _plan(qk=APPLIED, absorb=APPLIED):
    return DecodePlan(qk, absorb, AbsorbVariant.BF16)


def test_a_failed_fusion_leaves_the_batch_to_the_other_fusion_or_to_stock():
    batch = BatchFacts(num_actual_tokens=8, num_decode_tokens=8, has_cache=True, dcp_replicated=False)
    plan = _plan()
    assert plan.path_for(batch) is DecodePath.ABSORB
    assert plan.path_for(batch, frozenset({"absorb_qk_cache"})) is DecodePath.QK_CACHE
    assert plan.path_for(batch, frozenset({"absorb_qk_cache", "qk_cache"})) is None
    assert plan.path_for(batch, frozenset({"qk_cache"})) is DecodePath.ABSORB


def test_a_failure_is_refused_once_logged_with_the_message_and_recorded(caplog):
    recorded = []
    with caplog.at_level(logging.ERROR, logger="vllm.k3_amd_overlay"):
        for _ in range(2):
            with pytest.raises(kernel_failures.KernelFailed) as failure:
                kernel_failures.guarded("qk_cache", lambda: (_ for _ in ()).throw(RuntimeError("x\nLDS 70000 > 65536")))
            kernel_failures.refuse(failure.value, lambda fusion, why: recorded.append((fusion, why)))
    assert kernel_failures.failed() == {"qk_cache"}
    assert recorded == [("qk_cache", "its kernel failed on this GPU, so the stock path runs for the rest of this "
                                     "process: RuntimeError: LDS 70000 > 65536")]
    assert [r.getMessage() for r in caplog.records] == [
        "k3-amd-overlay: qk_cache refused: " + recorded[0][1]]


def test_the_norm_site_runs_the_two_stock_norms_when_its_kernel_fails():
    from k3_amd_overlay.targets.norm import QkvNormSite

    counted, recorded, calls = [], [], []

    def failing(q, kv):
        calls.append(1)
        raise RuntimeError("PassManager::run failed")

    site = QkvNormSite(APPLIED, failing, counted.append, on_failure=lambda f, why: recorded.append(f))
    q_norm, kv_norm = (lambda x: x * 2), (lambda x: x * 3)
    q_c, kv_c = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        q_out, kv_out = site.normalize(q_norm, kv_norm, None, q_c, kv_c)
        assert torch.equal(q_out, q_c * 2) and torch.equal(kv_out, kv_c * 3)
    assert calls == [1] and recorded == ["qkv_norm"] and counted == []  # refused for good after the first


def test_the_decode_site_routes_a_failed_batch_to_stock_and_keeps_it_there(monkeypatch):
    from k3_amd_overlay.targets import decode

    recorded, stock_calls, tried = [], [], []
    site = decode.DecodeSite(plan=_plan(absorb=LayerDecision(FusionState.DISABLED, None, "no")),
                             on_effective=lambda n: None, on_absorb_effective=lambda n: None,
                             on_failure=lambda f, why: recorded.append(f))
    meta = types.SimpleNamespace(num_actual_tokens=4, num_decode_tokens=4)
    site.context = lambda name: (meta, None, torch.zeros(2), torch.arange(4))

    def fused_step(*args, **kwargs):
        tried.append(1)
        return kernel_failures.guarded("qk_cache", lambda: (_ for _ in ()).throw(RuntimeError("no kernel")))

    monkeypatch.setattr(site, "_fused_step", fused_step)
    attn = types.SimpleNamespace(layer_name="layers.0.attn")

    def stock(*args, **kwargs):
        stock_calls.append(1)
        return "stock"

    for _ in range(2):
        assert site.route_attention(attn, stock, torch.randn(4, 2, 8), "kv", "pe", (4, 16), None) == "stock"
    assert tried == [1] and stock_calls == [1, 1] and recorded == ["qk_cache"]


def test_check_says_which_config_file_each_kernel_used_and_whether_tuned_here():
    from records import judge

    from k3_amd_overlay.package import __version__

    entry = {"state": "applied", "provider": "triton", "reason": "r", "effective": True, "layers": 2,
             "runs": {"served": 3}}
    source = {"arch": "gfx942", "tuned_on": "AMD Instinct MI300X"}
    record = {"pid": 7, "role": "worker", "vllm_version": "0.33.0", "mode": "auto", "overlay_version": __version__,
              "fusions": {"qk_cache": entry},
              "launch_configs": {"arch": "gfx942", "device": "AMD Instinct MI300X", "kernels": {
                  "qk_cache_kernel": {**source, "file": "/t/gfx942-AMD_Instinct_MI300X.json", "tuned_here": True},
                  "rmsnorm_pair_kernel": {"file": "/p/gfx942.json", "arch": "gfx942", "tuned_on": None,
                                          "tuned_here": False}}}}
    verdict = judge([record], "fused", ["qk_cache"], require_effective=True)
    assert verdict.holds
    # the process is named by pid, with its host where check names hosts
    assert any(re.fullmatch(r"info (host \S+ )?pid 7 \(worker, vLLM 0\.33\.0\): launch configs gfx942 \(AMD Instinct "
                            r"MI300X\): gfx942-AMD_Instinct_MI300X\.json \(tuned on this GPU\): qk_cache_kernel; "
                            r"gfx942\.json \(untuned\): rmsnorm_pair_kernel", line) for line in verdict.lines)
