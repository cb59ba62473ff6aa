"""The compile report's tile-copy verdict (any dot op Triton emits: ``tt.dot``, gfx950's fp8
``tt.dot_scaled``, a newer name; a dot it cannot read is no verdict), and the launch-config loader's
refusal of a rule with more warps than its block has matrix tiles, so no file can ship one."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap
import types

import pytest

from k3_amd_overlay.commands import compile_report
from k3_amd_overlay.kernels import launch_configs, names

# gfx950, Triton 3.9.0, the fp8 absorb kernel at BLOCK_T=16, BLOCK_N=64, 8 warps (the rule the gfx950
# file shipped for T<=8 at more than 6 heads): the MFMA layout, the operand loads, the dot.
GFX950_FP8_16X64_8_WARPS = """\
#mma = #ttg.amd_mfma<{version = 4, warpsPerCTA = [8, 1], instrShape = [16, 16, 128], isTransposed = true}>
    %q8_66 = ttg.local_load %q8_65 : !ttg.memdesc<16x128xf8E4M3FN, #shared, #smem> -> \
tensor<16x128xf8E4M3FN, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 16}>> loc(#loc159)
    %w_68 = ttg.local_load %w_67 : !ttg.memdesc<128x64xf8E4M3FN, #shared1, #smem> -> \
tensor<128x64xf8E4M3FN, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 16}>> loc(#loc237)
    %ql = tt.dot_scaled %q8_66, %w_68, %cst_1 lhs = e4m3 rhs = e4m3 {fastMath = false} : \
tensor<16x128xf8E4M3FN, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 16}>> * \
tensor<128x64xf8E4M3FN, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 16}>> -> tensor<16x64xf32, #mma> loc(#loc160)
"""
BF16_DOT = ("#mma1 = #ttg.amd_mfma<{version = 3, warpsPerCTA = [1, 2], instrShape = [16, 16, 16], "
            "isTransposed = true}>\n"
            "%1 = tt.dot %a, %b, %c : tensor<16x128xbf16, #x> * tensor<128x32xbf16, #y> -> tensor<16x32xf32, #mma1>\n")


def test_a_scaled_dot_counts_its_repeated_tile():
    """gfx950 lowers fp8 dots to tt.dot_scaled: 8 warps down a 16-row tile each compute all of it."""
    assert compile_report.tile_copies(GFX950_FP8_16X64_8_WARPS) == 8
    assert compile_report.tile_copies(GFX950_FP8_16X64_8_WARPS.replace("[8, 1]", "[1, 4]")) == 1


@pytest.mark.parametrize("op", ["tt.dot", "tt.dot_scaled", "amdg.scaled_mfma", "ttg.some_new_dot"])
def test_any_dot_op_is_counted_whichever_name_triton_gives_it(op):
    ttgir = GFX950_FP8_16X64_8_WARPS.replace("tt.dot_scaled", op)
    assert compile_report.tile_copies(ttgir) == 8
    generic = ('#mma = #ttg.amd_mfma<{instrShape = [16, 16, 32], warpsPerCTA = [4, 1], version = 3}>\n'
               f'%2 = "{op}"(%a, %b, %c) : (tensor<16x64xbf16>, tensor<64x16xbf16>, tensor<16x16xf32, #mma>) '
               '-> tensor<16x16xf32, #mma>\n')  # MLIR's generic form, fields in another order
    assert compile_report.tile_copies(generic) == 4


def test_the_most_repeated_of_several_dots_is_the_verdict():
    assert compile_report.tile_copies(BF16_DOT + GFX950_FP8_16X64_8_WARPS) == 8
    assert compile_report.tile_copies(BF16_DOT) == 1


@pytest.mark.parametrize(("ttgir", "why"), [
    (GFX950_FP8_16X64_8_WARPS.replace("-> tensor<16x64xf32, #mma>", "-> tensor<16x64xf32, #blocked>"),
     "its layout #blocked is not an MFMA layout"),
    (GFX950_FP8_16X64_8_WARPS.replace("%ql = tt.dot_scaled", "%ql = amdg.fused_thing"), "but no dot op read"),
    (GFX950_FP8_16X64_8_WARPS.replace("warpsPerCTA = [8, 1], ", ""), "without warpsPerCTA and instrShape"),
])
def test_a_dot_whose_layout_cannot_be_read_is_no_verdict(ttgir, why):
    with pytest.raises(compile_report.TileUnread, match=re.escape(why)):
        compile_report.tile_copies(ttgir)


def _compiled(amdgcn: str, ttgir: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(asm={"amdgcn": amdgcn, "ttgir": ttgir}, metadata=types.SimpleNamespace(shared=8192))


AMDGCN_950 = ('\t.amdgcn_target "amdgcn-amd-amdhsa--gfx950"\n    .vgpr_count:     60\n    .agpr_count:     0\n'
              '    .sgpr_count:     30\n    .vgpr_spill_count: 0\n    .sgpr_spill_count: 0\n'
              '    .private_segment_fixed_size: 0\n'
              '\tv_mfma_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], 0\n')
BAD = {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 8}


def _verdict(amdgcn: str, ttgir: str, config: dict[str, int]) -> compile_report.Entry:
    entry = compile_report.describe(_compiled(amdgcn, ttgir), names.ABSORB_FP8_QK_CACHE_KERNEL, config, "gfx950",
                                    "bfloat16")
    entry.problems = compile_report.problems(entry, "gfx950")
    return entry


def test_the_report_flags_the_known_bad_gfx950_fp8_rule():
    entry = _verdict(AMDGCN_950, GFX950_FP8_16X64_8_WARPS, BAD)
    assert entry.tile_copies == 8
    assert "the dot's tile computed 8 times over by its warps" in entry.problems


@pytest.mark.parametrize(("amdgcn", "ttgir", "config", "why"), [
    (AMDGCN_950, "", {**BAD, "num_warps": 4},
     "v_mfma_f32_16x16x128_f8f6f4 in the code object but no dot op read in the TTGIR"),
    (AMDGCN_950.replace("16x16x128", "32x32x64"), GFX950_FP8_16X64_8_WARPS.replace("[8, 1]", "[1, 4]"),
     {**BAD, "num_warps": 4}, "the launch-config check assumes 16x16 matrix tiles, the code object uses "
                              "v_mfma_f32_32x32x64_f8f6f4"),
])
def test_a_configuration_whose_tiles_are_not_read_falls_short(amdgcn, ttgir, config, why):
    entry = _verdict(amdgcn, ttgir, config)
    assert entry.problems == [f"tile copies not known: {why}"]


def test_the_table_shows_each_configurations_tile_copies():
    entry = dataclasses.asdict(_verdict(AMDGCN_950, GFX950_FP8_16X64_8_WARPS, BAD))
    row = compile_report.table({"arch": "gfx950", "triton": "3.9.0", "fp8_format": "e4m3fn", "device": None,
                                "sources": {}, "kernels": [entry]})
    assert "| v_mfma_f32_16x16x128_f8f6f4 | 8 | the dot's tile computed 8 times over by its warps |" in row


# ---- the loader ---------------------------------------------------------------------------------

def _file(arch: str, kernel: str, config: dict[str, int]) -> dict:
    return {"schema": 1, "arch": arch, "tuned_on": None, "kernels": {kernel: [{"config": config}]}}


@pytest.mark.parametrize(("arch", "config", "block", "tile", "allowed"), [
    # the four gfx950 fp8 rules this replaced
    ("gfx950", {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 8}, "16x64", "16x16", 4),
    ("gfx950", {"BLOCK_N": 16, "BLOCK_T": 16, "num_warps": 4}, "16x16", "16x16", 1),
    ("gfx950", {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 8}, "16x32", "16x16", 2),
    ("gfx950", {"BLOCK_N": 32, "BLOCK_T": 32, "num_warps": 8}, "32x32", "32x32", 1),  # Triton's 32-wide MFMA
    ("gfx942", {"BLOCK_N": 32, "BLOCK_T": 32, "num_warps": 8, "matrix_instr_nonkdim": 16}, "32x32", "16x16", 4),
])
def test_the_loader_refuses_more_warps_than_matrix_tiles(arch, config, block, tile, allowed):
    message = (f"f.json {names.ABSORB_FP8_QK_CACHE_KERNEL} rule 0: num_warps = {config['num_warps']} on a {block} "
               f"block (BLOCK_T x BLOCK_N) of {tile} matrix tiles on {arch}: at most {allowed} warps")
    with pytest.raises(launch_configs.LaunchConfigError, match=re.escape(message)):
        launch_configs.parse(_file(arch, names.ABSORB_FP8_QK_CACHE_KERNEL, config), "f.json")
    fitting = {**config, "num_warps": allowed}
    launch_configs.parse(_file(arch, names.ABSORB_FP8_QK_CACHE_KERNEL, fitting), "f.json")


def test_nvidia_rules_keep_their_measured_warps():
    """On the H200 the sm90 rules with more warps than 16x8 tiles measured faster than one warp per tile:
    the loader bounds AMD files only."""
    config = {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 8}
    launch_configs.parse(_file("sm90", names.ABSORB_FP8_QK_CACHE_KERNEL, config), "f.json")
    assert launch_configs.dot_warps_fit("sm90", names.ABSORB_FP8_QK_CACHE_KERNEL, config)
    assert not launch_configs.dot_warps_fit("gfx942", names.ABSORB_FP8_QK_CACHE_KERNEL, config)


@pytest.mark.parametrize("block_t", [1, 2, 4])
def test_programs_of_too_few_tokens_for_a_dot_have_no_dot_to_bound(block_t):
    config = {"BLOCK_N": 16, "BLOCK_T": block_t, "num_warps": 8}
    launch_configs.parse(_file("gfx950", names.ABSORB_FP8_QK_CACHE_KERNEL, config), "f.json")


@pytest.mark.parametrize("arch", [a for a in launch_configs.SHIPPED_ARCHS if a.startswith("gfx")])
def test_no_shipped_rule_has_more_warps_than_its_block_has_tiles(arch):
    data = json.loads((launch_configs.CONFIG_DIR / f"{arch}.json").read_text())
    over = [(kernel, i, rule["config"]) for kernel, rules in data["kernels"].items()
            if kernel in launch_configs.DOT_TILE_KERNELS for i, rule in enumerate(rules)
            if rule["config"]["BLOCK_T"] >= launch_configs.DOT_LEAST and  # fewer tokens a program: no dot
            rule["config"]["num_warps"] > launch_configs.max_dot_warps(arch, rule["config"])]
    assert over == []


# ---- the real compiler ---------------------------------------------------------------------------

_COMPILE_BAD = textwrap.dedent("""
    import json, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from triton.runtime import driver
    from k3_amd_overlay.commands import compile_report
    from k3_amd_overlay.fp8 import E4M3FN
    from k3_amd_overlay.kernels import launch, names, probe, target
    driver.set_active(compile_report.AotDriver("gfx950"))
    config = json.loads(sys.argv[1])
    with target.compile_only("gfx950") as session, launch.forced(config):
        probe.launch_at(names.ABSORB_FP8_QK_CACHE_KERNEL, torch.device("cpu"), torch.bfloat16, 8, 16, E4M3FN)
    name, options, compiled = session.compiled[-1]
    entry = compile_report.describe(compiled, name, options, "gfx950", "bfloat16")
    print(json.dumps([entry.tile_copies, entry.mfma, compile_report.problems(entry, "gfx950")]))
""")


@pytest.mark.kernels
@pytest.mark.parametrize(("config", "copies"), [(BAD, 8), ({**BAD, "num_warps": 4}, 1)])
def test_triton_builds_the_known_bad_rule_with_its_tile_repeated_and_the_report_says_so(config, copies):
    """Compiled for gfx950 with this venv's Triton (the loader would refuse the bad rule: forced here)."""
    pytest.importorskip("triton.backends.amd")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_BAD, json.dumps(config)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found, mfma, problems = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mfma.startswith("v_mfma_") and found == copies
    assert ("the dot's tile computed 8 times over by its warps" in problems) == (copies > 1)


_COMPILE_BOTH_CACHES = textwrap.dedent("""
    import json, os, re, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from triton.runtime import driver
    from k3_amd_overlay.commands import compile_report
    from k3_amd_overlay.fp8 import E4M3FNUZ
    from k3_amd_overlay.kernels import launch, names, probe, target
    driver.set_active(compile_report.AotDriver("gfx942"))
    empty = torch.empty
    served = empty(3 << 30, dtype=torch.int8)  # vLLM's KV cache: a view of one buffer of GiB (never touched)

    def as_served(*shape, dtype=None, device=None):
        if dtype == torch.uint8 and len(shape) == 3 and shape[1] == 1:  # the cache (block size 1), not q_out
            rows = torch.as_strided(served, shape, (shape[2], shape[2], 1), storage_offset=shape[2] * 7)
            return rows.view(torch.uint8)
        return empty(*shape, dtype=dtype, device=device)

    found = {}
    for kernel in (names.QK_CACHE_KERNEL, names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL,
                   names.ABSORB_MXFP4_QK_CACHE_KERNEL):
        with target.compile_only("gfx942") as session:
            probe.launch_at(kernel, torch.device("cpu"), torch.bfloat16, 8, 12, E4M3FNUZ)  # as at model load
            torch.empty = as_served
            try:
                probe.launch_at(kernel, torch.device("cpu"), torch.bfloat16, 8, 12, E4M3FNUZ)  # as served
            finally:
                torch.empty = empty
        (_, _, loaded), (_, _, serving) = session.compiled[-2:]
        found[kernel] = loaded is serving
    torch.empty = as_served
    tiles = {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 4, "KV_ROWS": 16}  # KV programs of 16 rows
    with target.compile_only("gfx942") as session, launch.forced(tiles):
        probe.launch_at(names.ABSORB_QK_CACHE_KERNEL, torch.device("cpu"), torch.bfloat16, 16, 12, E4M3FNUZ)
    torch.empty = empty
    stores = sorted(set(re.findall(r"\\b(?:global|buffer)_store_\\w+", session.compiled[-1][2].asm["amdgcn"])))
    print(json.dumps([found, stores]))
""")


@pytest.mark.kernels
def test_the_kv_cache_pointer_builds_one_binary_whatever_its_storage_size():
    """Triton's AMD backend specializes a tensor argument on whether its storage is at most 2 GiB; the
    compile at model load used a small cache, vLLM serves a view of a buffer of many GiB: every
    cache-writing kernel built a second binary at the first served batch (compiled for gfx942 on this
    CPU, Triton 3.9). Now one binary, its cache stores still 16 bytes wide where rows are written as
    tiles (the alignment the unspecialized pointer lost, stated in the kernel)."""
    pytest.importorskip("triton.backends.amd")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_BOTH_CACHES], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found, stores = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == dict.fromkeys(found, True) and len(found) == 4
    assert "global_store_dwordx4" in stores and not any("byte" in s for s in stores), stores


def test_a_matrix_size_amd_has_no_instruction_for_is_refused():
    config = {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 2, "matrix_instr_nonkdim": 8}
    with pytest.raises(launch_configs.LaunchConfigError, match=re.escape(
            "matrix_instr_nonkdim = 8: 0 (Triton's choice) or one of 16, 32")):
        launch_configs.parse(_file("gfx942", names.ABSORB_FP8_QK_CACHE_KERNEL, config), "f.json")


# ---- a GPU of an arch the report does not cover ---------------------------------------------------

@pytest.fixture
def amd_gpu(monkeypatch):
    """torch answering as a ROCm build on one GPU of the arch given (no GPU is touched)."""
    import torch

    from k3_amd_overlay.kernels import launch, target

    def on(arch: str, name: str = "AMD Instinct MI250X") -> torch.device:
        monkeypatch.setattr(torch.version, "hip", "6.4.0")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index=0: types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-", major=9,
                                                                  minor=0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
        target._arch_of_index.cache_clear()
        launch._device_name.cache_clear()
        launch_configs._resolve.cache_clear()
        return torch.device("cuda", 0)

    yield on
    target._arch_of_index.cache_clear()
    launch._device_name.cache_clear()
    launch_configs._resolve.cache_clear()


@pytest.mark.parametrize("arch", ["gfx90a", "gfx908", "gfx1100", "gfx1201"])
def test_the_kernels_command_on_an_arch_it_does_not_cover_says_so(arch, amd_gpu, capsys):
    amd_gpu(arch)
    assert compile_report.main([]) == 2
    err = capsys.readouterr().err
    assert f"this GPU is {arch}: the compile report covers gfx942, gfx950 only (no launch-config file for {arch}" in err
    assert "pass --arch gfx942 or gfx950" in err and "Traceback" not in err and "KeyError" not in err


def test_doctors_launch_configs_on_such_a_gpu_name_the_fallback_and_why_there_is_no_report(amd_gpu):
    from k3_amd_overlay.commands import doctor

    found = doctor.launch_configs_here(amd_gpu("gfx90a"))
    assert found["arch"] == "gfx90a" and found["device"] == "AMD Instinct MI250X"
    assert found["kernels"][names.QK_CACHE_KERNEL]["note"].startswith(
        "no launch-config file for gfx90a: gfx942's rules, untuned there")
    assert found["compile report"] == {"error": compile_report.unreported("gfx90a"), "covered": False}


def test_doctor_names_a_bad_tuned_file_for_this_gpu_in_one_line(amd_gpu, tmp_path, monkeypatch):
    from k3_amd_overlay.commands import doctor
    from k3_amd_overlay.settings import KERNEL_CONFIGS

    path = tmp_path / "gfx942-AMD_Instinct_MI300X.json"
    path.write_text(json.dumps({"schema": 1, "arch": "gfx942", "tuned_on": {"device": "AMD Instinct MI325X"},
                                "kernels": {names.QK_CACHE_KERNEL: [{"config": {"HEADS": 2, "num_warps": 2}}]}}))
    (tmp_path / "README.json").write_text("[]")  # foreign: ignored
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    asked = []
    monkeypatch.setattr(compile_report, "run_worker",  # no compile here; the real signature
                        lambda arch, device_name=None: asked.append((arch, device_name)) or {"kernels": []})
    found = doctor.launch_configs_here(amd_gpu("gfx942", "AMD Instinct MI300X"))
    assert asked == [("gfx942", "AMD Instinct MI300X")]
    assert found["error"] == (f"{KERNEL_CONFIGS}={tmp_path}: {path}: named for gfx942 on AMD Instinct MI300X, "
                              "its header says gfx942 on "
                              "AMD Instinct MI325X; this GPU's kernels take the shipped gfx942 launch configs instead")
    assert found["kernels"][names.QK_CACHE_KERNEL]["file"].endswith("configs/gfx942.json")


def test_the_config_column_names_an_optional_key_only_where_it_is_not_its_default():
    name = names.ABSORB_FP8_QK_CACHE_KERNEL
    (key, default), = launch_configs.OPTIONAL_PARAMETERS[name].items()
    plain = {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 4}
    assert compile_report.describe(_compiled(AMDGCN_950, ""), name, {**plain, key: default}, "gfx950",
                                   "bfloat16").config == plain
    assert compile_report.describe(_compiled(AMDGCN_950, ""), name, {**plain, key: default * 4}, "gfx950",
                                   "bfloat16").config == {**plain, key: default * 4}
