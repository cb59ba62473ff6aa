"""The compile report's contract, pinned exactly (``k3-amd-overlay kernels``): what it parses out of
hand-written ISA and TTGIR text (registers, LDS, spills, scratch, target, the dot ops and their
MFMA layouts), the occupancy arithmetic at its boundaries, each shortfall message word for word,
the JSON entry's keys and defaults, the table's rows, the worker process it starts and the exit
statuses of the command. Triton's compiler and the kernels' launches are stood in for where a
test says so (the real compile: tests/test_compile_report.py and tests/test_launch_configs.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from k3_amd_overlay.commands import compile_report
from k3_amd_overlay.kernels import launch_configs, names
from k3_amd_overlay.settings import KERNEL_CONFIGS

FIELDS = ["kernel", "config", "compiled", "error", "target", "vgpr", "agpr", "sgpr", "lds_bytes", "vgpr_spill",
          "sgpr_spill", "scratch_bytes", "waves_per_simd", "dtype", "shapes", "mfma", "tile_copies", "tile_error",
          "problems"]


def exact(value: object) -> str:
    """JSON text: 4 and 4.0, None and "" differ here as they do in the report."""
    return json.dumps(value, sort_keys=False)


# ---- the ISA and TTGIR readings ------------------------------------------------------------------

AMDGCN_942 = """\
\t.amdgcn_target "amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-"
\tv_mfma_f32_16x16x16_bf16 a[0:3], v[2:3], v[4:5], a[0:3]
\tv_mfma_f32_32x32x8_bf16 a[0:15], v[2:3], v[4:5], a[0:15]
    .agpr_count:     17
    .private_segment_fixed_size: 272
    .sgpr_count:     41
    .sgpr_spill_count: 3
    .vgpr_count:     93
    .vgpr_spill_count: 5
    .vgpr_count:     7
"""


def test_the_isa_metadata_is_read_key_by_key_the_first_of_each():
    assert exact(compile_report.isa_facts(AMDGCN_942)) == exact({
        "agpr_count": 17, "private_segment_fixed_size": 272, "sgpr_count": 41, "sgpr_spill_count": 3,
        "vgpr_count": 93, "vgpr_spill_count": 5, "target": "gfx942"})
    assert compile_report.isa_facts("    .vgpr_count: 12\n") == {"vgpr_count": 12, "target": None}


MMA_16X32 = ("#mma = #ttg.amd_mfma<{version = 3, warpsPerCTA = [1, 2], instrShape = [16, 16, 16], "
             "isTransposed = true}>\n"
             "%1 = tt.dot %a, %b, %c : tensor<16x64xbf16, #x> * tensor<64x32xbf16, #y> -> tensor<16x32xf32, #mma>\n")


def _layout(alias: str, warps: tuple[int, int], instr: tuple[int, int]) -> str:
    return (f"{alias} = #ttg.amd_mfma<{{version = 4, warpsPerCTA = [{warps[0]}, {warps[1]}], "
            f"instrShape = [{instr[0]}, {instr[1]}, 32], isTransposed = true}}>\n")


def _dot(op: str, rows: int, cols: int, alias: str) -> str:
    return f"%r = {op} %a, %b, %c : tensor<{rows}x64xbf16, #x> * tensor<64x{cols}xbf16, #y> -> " \
           f"tensor<{rows}x{cols}xf32, {alias}>\n"


def test_each_dot_op_is_read_with_its_layouts_warps_and_instruction_shape():
    ttgir = (_layout("#mma", (1, 2), (16, 16)) + _layout("#mma1", (4, 2), (32, 32)) + _dot("tt.dot", 16, 32, "#mma")
             + _dot("tt.dot_scaled", 64, 128, "#mma1") + _dot("ttg.some_new_dot", 32, 64, "#mma"))
    assert compile_report.dot_tiles(ttgir) == [("tt.dot", 16, 32, 1, 2, 16, 16),
                                               ("tt.dot_scaled", 64, 128, 4, 2, 32, 32),
                                               ("ttg.some_new_dot", 32, 64, 1, 2, 16, 16)]
    assert compile_report.dot_tiles("%r = arith.addf %a, %b : tensor<16x32xf32, #blocked>\n") == []


@pytest.mark.parametrize(("warps", "instr", "rows", "cols", "copies"), [
    ((1, 4), (16, 16), 16, 16, 4),    # 4 warps across a 16-column tile: each column computed 4 times over
    ((4, 1), (16, 16), 16, 64, 4),    # and down a 16-row tile
    ((2, 4), (16, 16), 16, 16, 8),    # both: the copies multiply
    ((2, 2), (32, 32), 32, 64, 2),
    ((1, 2), (16, 16), 16, 32, 1),    # one warp per 16 columns: no copy
    ((4, 1), (16, 16), 64, 16, 1),
    ((2, 2), (16, 16), 32, 32, 1),
])
def test_tile_copies_counts_the_warps_over_each_dimension(warps, instr, rows, cols, copies):
    found = compile_report.tile_copies(_layout("#mma", warps, instr) + _dot("tt.dot", rows, cols, "#mma"))
    assert exact(found) == exact(copies)


@pytest.mark.parametrize(("ttgir", "message"), [
    ("#mma = #ttg.amd_mfma<{version = 4, instrShape = [16, 16, 128], isTransposed = true}>\n",
     "MFMA layout #mma without warpsPerCTA and instrShape: version = 4, instrShape = [16, 16, 128], "
     "isTransposed = true"),
    (_layout("#mma", (8, 1), (16, 16)) + _dot("tt.dot_scaled", 16, 64, "#blocked3"),
     "tt.dot_scaled -> 16x64: its layout #blocked3 is not an MFMA layout of this TTGIR"),
    (_layout("#mma", (8, 1), (16, 16)) + "%r = tt.dot %a, %b, %c : tensor<16x64xbf16> -> tensor<16x48xf32>\n",
     "tt.dot -> 16x48: its layout (none) is not an MFMA layout of this TTGIR"),
    (_layout("#mma", (8, 1), (16, 16)) + _layout("#mma2", (1, 8), (32, 32))
     + "%r = amdg.fused %a : tensor<16x16xf32>\n",
     "MFMA layouts #mma, #mma2 but no dot op read"),
])
def test_each_reason_a_tile_is_not_read_word_for_word(ttgir, message):
    with pytest.raises(compile_report.TileUnread) as caught:
        compile_report.dot_tiles(ttgir)
    assert str(caught.value) == message


# ---- occupancy -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("vgpr", "agpr", "lds", "warps", "arch", "waves"), [
    # registers in granules of 8 out of 512 per lane, at most 8 waves
    (0, 0, 0, 4, "gfx942", 8), (1, 0, 0, 4, "gfx942", 8), (64, 0, 0, 4, "gfx942", 8), (65, 0, 0, 4, "gfx942", 7),
    (100, 0, 0, 4, "gfx942", 4), (128, 0, 0, 4, "gfx942", 4), (129, 0, 0, 4, "gfx942", 3),
    (256, 0, 0, 4, "gfx942", 2), (257, 0, 0, 4, "gfx942", 1), (512, 0, 0, 4, "gfx942", 1), (513, 0, 0, 4, "gfx942", 0),
    # AGPRs start at the VGPR count rounded up to 4
    (1, 1, 0, 4, "gfx942", 8), (57, 8, 0, 4, "gfx942", 7), (64, 64, 0, 4, "gfx942", 4), (65, 63, 0, 4, "gfx942", 3),
    (125, 3, 0, 4, "gfx942", 3), (0, 126, 0, 4, "gfx950", 4),
    # LDS: whole workgroups per CU, their warps spread over 4 SIMDs (64 KiB on gfx942, 160 KiB on gfx950)
    (40, 0, 65536, 4, "gfx942", 1), (40, 0, 65537, 4, "gfx942", 0), (40, 0, 65536, 8, "gfx942", 2),
    (40, 0, 163840, 4, "gfx950", 1), (40, 0, 163841, 4, "gfx950", 0), (40, 0, 163840, 8, "gfx950", 2),
    (40, 0, 21846, 8, "gfx942", 4), (40, 0, 40000, 2, "gfx942", 0), (40, 0, 16384, 4, "gfx942", 4),
    (40, 0, 16384, 4, "gfx950", 8), (129, 0, 8192, 8, "gfx942", 3),
])
def test_waves_per_simd_at_each_boundary(vgpr, agpr, lds, warps, arch, waves):
    assert exact(compile_report.waves_per_simd(vgpr, agpr, lds, warps, arch)) == exact(waves)


def test_the_occupancy_constants_are_the_isa_guides():
    assert compile_report.LDS_PER_CU == {"gfx942": 65536, "gfx950": 163840}
    assert compile_report.FP8_FORMAT == {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}
    assert compile_report.KERNEL_ORDER == (names.RMSNORM_PAIR_KERNEL, names.QK_CACHE_KERNEL, names.STATIC_QUANT_KERNEL,
                                           names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL,
                                           names.ABSORB_MXFP4_QK_CACHE_KERNEL)


def test_the_dtypes_each_kernel_is_built_with_on_each_arch():
    found = {(kernel, arch): compile_report.query_dtypes(kernel, arch)
             for kernel in compile_report.KERNEL_ORDER for arch in compile_report.AMD_ARCHS}
    both, bf16 = ("bfloat16", "float16"), ("bfloat16",)
    assert found == {
        (names.RMSNORM_PAIR_KERNEL, "gfx942"): both, (names.RMSNORM_PAIR_KERNEL, "gfx950"): both,
        (names.QK_CACHE_KERNEL, "gfx942"): both, (names.QK_CACHE_KERNEL, "gfx950"): both,
        (names.STATIC_QUANT_KERNEL, "gfx942"): bf16, (names.STATIC_QUANT_KERNEL, "gfx950"): bf16,
        (names.ABSORB_QK_CACHE_KERNEL, "gfx942"): both, (names.ABSORB_QK_CACHE_KERNEL, "gfx950"): both,
        (names.ABSORB_FP8_QK_CACHE_KERNEL, "gfx942"): bf16, (names.ABSORB_FP8_QK_CACHE_KERNEL, "gfx950"): bf16,
        (names.ABSORB_MXFP4_QK_CACHE_KERNEL, "gfx942"): (), (names.ABSORB_MXFP4_QK_CACHE_KERNEL, "gfx950"): bf16}


# ---- one code object described -------------------------------------------------------------------

def _isa(arch: str, vgpr: int, agpr: int = 0, sgpr: int = 0, spills: tuple[int, int] = (0, 0), scratch: int = 0,
         code: str = "") -> str:
    """A code object's text with every count its metadata always carries (no reading falls back to a default)."""
    return (f'\t.amdgcn_target "amdgcn-amd-amdhsa--{arch}"\n{code}    .agpr_count: {agpr}\n'
            f"    .private_segment_fixed_size: {scratch}\n    .sgpr_count: {sgpr}\n    .sgpr_spill_count: {spills[1]}\n"
            f"    .vgpr_count: {vgpr}\n    .vgpr_spill_count: {spills[0]}\n")


def _compiled(amdgcn: str, ttgir: str, shared: int) -> types.SimpleNamespace:
    """What Triton's CompiledKernel offers the report: its asm texts and its metadata's LDS bytes."""
    return types.SimpleNamespace(asm={"amdgcn": amdgcn, "ttgir": ttgir}, metadata=types.SimpleNamespace(shared=shared))


def _entry(**fields: object) -> dict:
    """A JSON entry: every key, in order, with the defaults a failed compile keeps."""
    base = {"kernel": None, "config": {}, "compiled": False, "error": None, "target": None, "vgpr": None,
            "agpr": None, "sgpr": None, "lds_bytes": None, "vgpr_spill": None, "sgpr_spill": None,
            "scratch_bytes": None, "waves_per_simd": None, "dtype": "", "shapes": [], "mfma": None,
            "tile_copies": 1, "tile_error": None, "problems": []}
    assert set(fields) <= set(base)
    return {**base, **fields}


def test_an_entrys_json_keys_and_defaults():
    entry = dataclasses.asdict(compile_report.Entry(kernel="k", config={"HEADS": 4}, compiled=False))
    assert list(entry) == FIELDS
    assert exact(entry) == exact(_entry(kernel="k", config={"HEADS": 4}))


def test_a_code_object_is_described_field_by_field():
    options = {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 4, "num_stages": 2, "waves_per_eu": 1,
               "matrix_instr_nonkdim": 0, "num_ctas": 1, "debug": False, "arch": "gfx942"}
    entry = compile_report.describe(_compiled(AMDGCN_942, MMA_16X32, 12288), names.ABSORB_QK_CACHE_KERNEL, options,
                                    "gfx942", "float16")
    assert exact(dataclasses.asdict(entry)) == exact(_entry(
        kernel=names.ABSORB_QK_CACHE_KERNEL, compiled=True, dtype="float16", target="gfx942",
        config={"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 4, "num_stages": 2, "waves_per_eu": 1,
                "matrix_instr_nonkdim": 0},
        vgpr=93, agpr=17, sgpr=41, lds_bytes=12288, vgpr_spill=5, sgpr_spill=3, scratch_bytes=272,
        waves_per_simd=4, mfma="v_mfma_f32_16x16x16_bf16", tile_copies=1))
    assert compile_report.problems(entry, "gfx942") == ["spills 5 VGPRs, 3 SGPRs", "272 B scratch"]


@pytest.mark.parametrize(("vgpr", "agpr", "shared", "warps", "arch", "waves"), [
    (0, 126, 0, 4, "gfx942", 4), (128, 0, 0, 4, "gfx942", 4), (93, 17, 12288, 4, "gfx942", 4),
    (40, 0, 40000, 2, "gfx942", 0), (40, 0, 16384, None, "gfx942", 4), (137, 0, 20480, 8, "gfx950", 3),
])
def test_the_described_waves_are_the_occupancy_of_the_counts_read(vgpr, agpr, shared, warps, arch, waves):
    """A launch without num_warps has Triton's default 4."""
    amdgcn = _isa(arch, vgpr, agpr, sgpr=19)
    options = {"HEADS": 2} if warps is None else {"HEADS": 2, "num_warps": warps}
    entry = compile_report.describe(_compiled(amdgcn, "", shared), names.QK_CACHE_KERNEL, options, arch, "bfloat16")
    assert (entry.vgpr, entry.agpr, entry.lds_bytes) == (vgpr, agpr, shared)
    assert exact(entry.waves_per_simd) == exact(waves)
    assert waves == compile_report.waves_per_simd(vgpr, agpr, shared, 4 if warps is None else warps, arch)


def test_a_one_token_program_of_a_dot_kernel_has_no_dot_and_no_shortfall():
    amdgcn = _isa("gfx950", 52, sgpr=30)
    entry = compile_report.describe(_compiled(amdgcn, "%r = arith.addf %a, %b\n", 512),
                                    names.ABSORB_FP8_QK_CACHE_KERNEL, {"BLOCK_N": 64, "BLOCK_T": 1, "num_warps": 2},
                                    "gfx950", "bfloat16")
    assert exact(dataclasses.asdict(entry)) == exact(_entry(
        kernel=names.ABSORB_FP8_QK_CACHE_KERNEL, compiled=True, dtype="bfloat16", target="gfx950",
        config={"BLOCK_N": 64, "BLOCK_T": 1, "num_warps": 2}, vgpr=52, agpr=0, sgpr=30, lds_bytes=512,
        vgpr_spill=0, sgpr_spill=0, scratch_bytes=0, waves_per_simd=8))
    assert compile_report.problems(entry, "gfx950") == []


def test_an_unread_tile_is_no_count_in_the_json_and_a_question_mark_in_the_table():
    amdgcn = _isa("gfx942", 60, agpr=4, sgpr=26, code="\tv_mfma_f32_16x16x16_bf16 a[0:3]\n")
    ttgir = _layout("#mma", (1, 2), (16, 16)) + _dot("tt.dot", 16, 32, "#blocked")
    entry = compile_report.describe(_compiled(amdgcn, ttgir, 0), names.ABSORB_QK_CACHE_KERNEL,
                                    {"BLOCK_N": 32, "BLOCK_T": 16, "num_warps": 2}, "gfx942", "bfloat16")
    why = "tt.dot -> 16x32: its layout #blocked is not an MFMA layout of this TTGIR"
    assert exact([entry.tile_copies, entry.tile_error]) == exact([None, why])
    entry.problems = compile_report.problems(entry, "gfx942")
    assert entry.problems == [f"tile copies not known: {why}"]
    row = compile_report.table({"arch": "gfx942", "triton": "3.5.1", "fp8_format": "e4m3fnuz", "device": None,
                                "sources": {}, "kernels": [dataclasses.asdict(entry)]}).splitlines()[-1]
    assert row == (f"| {names.ABSORB_QK_CACHE_KERNEL} | bfloat16 | BLOCK_N=32 BLOCK_T=16 num_warps=2 |  | 60 | 4 | 26 "
                   f"| 0 | 0/0 | 0 | 8 | v_mfma_f32_16x16x16_bf16 | ? | tile copies not known: {why} |")


@pytest.mark.parametrize(("mfma", "config", "assumed"), [
    ("v_mfma_f32_32x16x8_f16", {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 4}, "16x16"),  # rows differ
    ("v_mfma_f32_16x32x8_f16", {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 4}, "16x16"),  # columns differ
    ("v_mfma_f32_16x16x32_bf16", {"BLOCK_N": 64, "BLOCK_T": 32, "num_warps": 4}, "32x32"),
    ("v_mfma_scale_f32", {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 4}, "16x16"),  # no shape in the name
])
def test_an_instruction_other_than_the_one_the_launch_check_assumes_is_named(mfma, config, assumed):
    amdgcn = _isa("gfx942", 60, sgpr=18, code=f"\t{mfma} a[0:3]\n")
    entry = compile_report.describe(_compiled(amdgcn, MMA_16X32, 0), names.ABSORB_QK_CACHE_KERNEL, config, "gfx942",
                                    "bfloat16")
    assert entry.tile_error == (f"the launch-config check assumes {assumed} matrix tiles, the code object uses "
                                f"{mfma}")


def test_every_shortfall_word_for_word_and_at_its_boundary():
    def problems(**fields: object) -> list[str]:
        base = {"target": "gfx950", "vgpr": 40, "agpr": 0, "sgpr": 20, "vgpr_spill": 0, "sgpr_spill": 0,
                "scratch_bytes": 0, "waves_per_simd": 4, "tile_copies": 1}
        return compile_report.problems(compile_report.Entry(kernel="k", config={}, compiled=True,
                                                            **{**base, **fields}), "gfx950")

    assert problems() == []
    assert problems(target="gfx942") == ["built for gfx942, not gfx950"]
    assert problems(target=None) == ["built for None, not gfx950"]
    assert problems(vgpr_spill=6) == ["spills 6 VGPRs, 0 SGPRs"]
    assert problems(sgpr_spill=9) == ["spills 0 VGPRs, 9 SGPRs"]
    assert problems(scratch_bytes=48) == ["48 B scratch"]
    assert problems(waves_per_simd=5) == []
    assert problems(waves_per_simd=3) == ["3 waves per SIMD (< 4)"]
    assert problems(waves_per_simd=None) == ["None waves per SIMD (< 4)"]
    assert problems(tile_copies=2) == ["the dot's tile computed 2 times over by its warps"]
    assert problems(tile_copies=None) == ["the dot's tile computed None times over by its warps"]
    assert problems(tile_copies=None, tile_error="why") == ["tile copies not known: why"]
    assert problems(tile_copies=3, tile_error="why") == ["tile copies not known: why"]
    assert compile_report.problems(compile_report.Entry(kernel="k", config={}, compiled=False, target="gfx950",
                                                        waves_per_simd=8), "gfx950") == ["compile error"]


# ---- the compiling process, its launches stood in -------------------------------------------------

def _stand_ins(monkeypatch: pytest.MonkeyPatch) -> dict:
    """probe.reachable and probe.launch_at (their real signatures) answering per kernel and dtype:
    the RMSNorm pair compiles three times (the last is the launch's), the qk_cache launch raises a
    compiler error (bf16: several lines, fp16: an empty message), the quant kernel compiles nothing;
    Triton's driver switch is recorded, not made."""
    import torch
    from triton.runtime import driver

    from k3_amd_overlay.kernels import probe, target

    seen: dict = {"launches": [], "drivers": [], "devices": set()}

    def reachable(kernel: str, arch: str, heads: tuple[int, ...] = probe.HEADS, device_name: str | None = None,
                  every_rule: bool = False):
        assert every_rule  # the report compiles every rule of the table, served batches or not
        seen["devices"].add(device_name)
        if kernel == names.RMSNORM_PAIR_KERNEL:
            return [((("ROWS_KV", 2), ("ROWS_Q", 4), ("num_warps", 4)), [(3, 1), (17, 1)], ["T<=8", "T>8"])]
        if kernel in (names.QK_CACHE_KERNEL, names.STATIC_QUANT_KERNEL):
            return [((("HEADS", 8), ("num_warps", 2)), [(5, 16), (40, 16)], ["H>4"])]
        return []

    def launch_at(kernel: str, device: torch.device, dtype: torch.dtype, tokens: int, heads: int, fmt,
                  block_size: int = 1) -> None:
        session = target.compile_session()
        seen["launches"].append((kernel, str(device), dtype, tokens, heads, fmt.name, session.target,
                                 os.environ.get("TRITON_INTERPRET")))
        if kernel == names.RMSNORM_PAIR_KERNEL:
            for vgpr in (250, 251, 36):
                amdgcn = _isa(session.target.arch, vgpr, sgpr=22)
                session.compiled.append((kernel, {"ROWS_Q": 4, "ROWS_KV": 2, "num_warps": 4, "num_stages": 1},
                                         _compiled(amdgcn, "", 3072)))
        elif kernel == names.QK_CACHE_KERNEL:
            raise (RuntimeError("\nPassManager::run failed\n  at line 7\nout of resource: shared memory 70000\n")
                   if dtype == torch.bfloat16 else ValueError("  "))

    monkeypatch.setattr(probe, "reachable", reachable)
    monkeypatch.setattr(probe, "launch_at", launch_at)
    monkeypatch.setattr(driver, "set_active", lambda active: seen["drivers"].append(active))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(KERNEL_CONFIGS, raising=False)
    return seen


@pytest.mark.parametrize(("arch", "fmt"), [("gfx942", "e4m3fnuz"), ("gfx950", "e4m3fn")])
def test_compile_arch_reports_each_reachable_config_in_order(monkeypatch, arch, fmt):
    import torch
    import triton

    from k3_amd_overlay.kernels.target import HIP, Target

    seen = _stand_ins(monkeypatch)
    report = compile_report.compile_arch(arch)
    assert list(report) == ["arch", "triton", "fp8_format", "device", "sources", "unchecked", "kernels"]
    assert (report["arch"], report["triton"], report["fp8_format"]) == (arch, triton.__version__, fmt)
    assert (report["device"], report["unchecked"], seen["devices"]) == (None, [], {None})
    shipped = {"file": str(launch_configs.CONFIG_DIR / f"{arch}.json"), "arch": arch, "tuned_on": None,
               "tuned_here": False}
    built = [k for k in compile_report.KERNEL_ORDER if compile_report.query_dtypes(k, arch)]
    assert report["sources"] == {k: shipped for k in built}
    qk = {"HEADS": 8, "num_warps": 2}
    waves = compile_report.waves_per_simd(36, 0, 3072, 4, arch)
    compiled = {"kernel": names.RMSNORM_PAIR_KERNEL, "compiled": True, "target": arch, "vgpr": 36, "agpr": 0,
                "sgpr": 22, "lds_bytes": 3072, "vgpr_spill": 0, "sgpr_spill": 0, "scratch_bytes": 0,
                "waves_per_simd": waves, "shapes": ["T<=8", "T>8"],
                "config": {"ROWS_Q": 4, "ROWS_KV": 2, "num_warps": 4, "num_stages": 1}}
    assert waves == 8
    assert exact(report["kernels"]) == exact([
        _entry(**compiled, dtype="bfloat16"), _entry(**compiled, dtype="float16"),
        _entry(kernel=names.QK_CACHE_KERNEL, config=qk, dtype="bfloat16", shapes=["H>4"], problems=["compile error"],
               error="RuntimeError: out of resource: shared memory 70000"),
        _entry(kernel=names.QK_CACHE_KERNEL, config=qk, dtype="float16", shapes=["H>4"], problems=["compile error"],
               error="ValueError: "),
        _entry(kernel=names.STATIC_QUANT_KERNEL, config=qk, dtype="bfloat16", shapes=["H>4"],
               problems=["compile error"], error="nothing was compiled")])
    on = Target(HIP, arch)
    assert seen["launches"] == [
        (names.RMSNORM_PAIR_KERNEL, "cpu", torch.bfloat16, 3, 1, fmt, on, None),
        (names.RMSNORM_PAIR_KERNEL, "cpu", torch.float16, 3, 1, fmt, on, None),
        (names.QK_CACHE_KERNEL, "cpu", torch.bfloat16, 5, 16, fmt, on, None),
        (names.QK_CACHE_KERNEL, "cpu", torch.float16, 5, 16, fmt, on, None),
        (names.STATIC_QUANT_KERNEL, "cpu", torch.bfloat16, 5, 16, fmt, on, None)]
    assert [type(d) for d in seen["drivers"]] == [compile_report.AotDriver] and seen["drivers"][0].target.arch == arch


MI300X = "AMD Instinct MI300X"
TUNED_ABSORB = {"BLOCK_N": 128, "BLOCK_T": 128, "num_warps": 4}


def _tuned_dir(tmp_path, monkeypatch: pytest.MonkeyPatch, header_device: str = MI300X):
    """A K3_AMD_OVERLAY_KERNEL_CONFIGS directory with gfx942's tuned file for the MI300X (its absorb
    rule one the shipped file does not have) and a self-measurement result file beside it."""
    path = tmp_path / launch_configs.tuned_name("gfx942", MI300X)
    path.write_text(json.dumps({"schema": 1, "arch": "gfx942", "tuned_on": {"device": header_device},
                                "kernels": {names.ABSORB_QK_CACHE_KERNEL: [{"config": TUNED_ABSORB}]}}))
    (tmp_path / "gfx942-AMD_Instinct_MI300X.measured.json").write_text("{}")
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    return path


def _config_launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """probe.launch_at as the kernels' launchers take their config (launch.config_for), compiling nothing
    real; the configs the launches took, per kernel."""
    from triton.runtime import driver

    from k3_amd_overlay.kernels import launch, probe, target

    taken = []

    def launch_at(kernel, device, dtype, tokens, heads, fmt, block_size=1) -> None:
        config = launch.config_for(kernel, device, tokens, heads)
        taken.append((kernel, config))
        target.compile_session().compiled.append((kernel, config, _compiled(_isa("gfx942", 40, sgpr=20), "", 0)))

    monkeypatch.setattr(probe, "launch_at", launch_at)
    monkeypatch.setattr(driver, "set_active", lambda active: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # compile_arch drops it (its worker's own process): restored after
    return taken


def test_compile_arch_builds_the_tuned_configs_a_named_gpus_server_uses(tmp_path, monkeypatch):
    path = _tuned_dir(tmp_path, monkeypatch)
    taken = _config_launches(monkeypatch)
    report = compile_report.compile_arch("gfx942", MI300X)
    assert [config for kernel, config in taken if kernel == names.ABSORB_QK_CACHE_KERNEL] == [TUNED_ABSORB] * 2
    assert [e["config"] for e in report["kernels"] if e["kernel"] == names.ABSORB_QK_CACHE_KERNEL] == [TUNED_ABSORB] * 2
    assert (report["device"], report["unchecked"]) == (MI300X, [])
    assert report["sources"][names.ABSORB_QK_CACHE_KERNEL] == {"file": str(path), "arch": "gfx942",
                                                              "tuned_on": MI300X, "tuned_here": True}
    assert report["sources"][names.QK_CACHE_KERNEL]["file"] == str(launch_configs.CONFIG_DIR / "gfx942.json")


def test_compile_arch_with_no_gpu_named_names_the_tuned_files_it_leaves_unchecked(tmp_path, monkeypatch):
    _tuned_dir(tmp_path, monkeypatch)
    (tmp_path / "gfx950-AMD_Instinct_MI355X.json").write_text("{}")  # another arch's: not this report's
    taken = _config_launches(monkeypatch)
    report = compile_report.compile_arch("gfx942")
    assert TUNED_ABSORB not in [config for _, config in taken]
    assert report["unchecked"] == [
        f"{KERNEL_CONFIGS}={tmp_path}: gfx942-AMD_Instinct_MI300X.json not checked: no GPU name known (no AMD GPU of "
        "gfx942 here); pass --device NAME to check the configs that GPU's server uses"]


def test_compile_arch_names_the_tuned_file_of_the_named_gpu_it_cannot_use(tmp_path, monkeypatch):
    path = _tuned_dir(tmp_path, monkeypatch, header_device="AMD Instinct MI325X")
    _config_launches(monkeypatch)
    report = compile_report.compile_arch("gfx942", MI300X)
    assert report["unchecked"] == [f"{KERNEL_CONFIGS}={tmp_path}: {path}: named for gfx942 on {MI300X}, its header "
                                   "says gfx942 on AMD Instinct MI325X; this GPU's kernels take the shipped gfx942 "
                                   "launch configs instead"]
    assert report["sources"][names.ABSORB_QK_CACHE_KERNEL]["file"] == str(launch_configs.CONFIG_DIR / "gfx942.json")


def test_the_compile_only_driver_answers_as_an_amd_gpu_0_that_runs_nothing():
    import torch
    from triton.backends.compiler import GPUTarget

    aot = compile_report.AotDriver("gfx950")
    assert aot.get_current_target() == GPUTarget("hip", "gfx950", 64)
    assert (aot.get_current_device(), aot.get_current_stream(), aot.get_current_stream(0)) == (0, 0, 0)
    assert aot.get_active_torch_device() == torch.device("cpu") and aot.is_active() is True


# ---- the worker process -------------------------------------------------------------------------

def _run_stand_in(monkeypatch: pytest.MonkeyPatch, returncode: int, stdout: str, stderr: str) -> list:
    calls = []

    def run(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):
        argv = list(popenargs[0])
        out = argv.index("--worker-out")
        Path(argv[out + 1]).write_text(stdout)  # the worker writes its report there, not to stdout
        calls.append(((argv[:out] + argv[out + 2:],), capture_output, kwargs))
        return subprocess.CompletedProcess(popenargs[0], returncode, "anything Triton printed", stderr)

    monkeypatch.setattr(compile_report.subprocess, "run", run)
    return calls


def test_the_worker_runs_this_module_for_the_arch_with_the_interpreter_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("K3_CONTRACT_PROBE", "kept-7291")
    calls = _run_stand_in(monkeypatch, 0, '{"arch": "gfx950", "kernels": [3]}', "")
    assert compile_report.run_worker("gfx950") == {"arch": "gfx950", "kernels": [3]}
    [(args, capture, kwargs)] = calls
    assert args == ([sys.executable, "-m", "k3_amd_overlay.commands.compile_report", "--worker", "gfx950"],)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    home = Path(compile_report.__file__).resolve().parents[2]  # where this package lies: no other copy compiled
    assert capture is True and kwargs == {"text": True, "env": env, "cwd": home}
    assert env["K3_CONTRACT_PROBE"] == "kept-7291"
    assert (home / "k3_amd_overlay" / "commands" / "compile_report.py").is_file()
    compile_report.run_worker("gfx942", MI300X)
    assert calls[-1][0] == ([sys.executable, "-m", "k3_amd_overlay.commands.compile_report", "--worker", "gfx942",
                             "--device", MI300X],)


TRACEBACK = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/k3_amd_overlay/kernels/launch_configs.py", line 291, in load
    data = json.loads(Path(path).read_text())
RecursionError: maximum recursion depth exceeded while decoding a JSON array from a unicode string

"""


@pytest.mark.parametrize(("code", "stderr", "said"), [
    (1, "E" * 4500 + "\nLLVM ERROR: cannot select\n", "LLVM ERROR: cannot select"),
    (3, TRACEBACK, "RecursionError: maximum recursion depth exceeded while decoding a JSON array from a unicode "
                   "string"),
    (1, "", "nothing on stderr"),
], ids=["llvm", "traceback", "silent"])
def test_a_failed_worker_is_named_in_one_line_with_its_exit_status_and_its_whole_stderr_goes_to_stderr(
        monkeypatch, capsys, code, stderr, said):
    """The error names the exit status and the worker's last line that says something (a traceback's
    exception), never a newline (it is the --json ``error``); the whole of the worker's stderr is on stderr."""
    _run_stand_in(monkeypatch, code, "", stderr)
    with pytest.raises(RuntimeError) as caught:
        compile_report.run_worker("gfx942")
    assert str(caught.value) == f"compiling for gfx942 failed (exit {code}): {said}"
    assert capsys.readouterr() == ("", stderr)


def test_an_arch_without_a_report_is_refused_before_any_worker(monkeypatch):
    calls = _run_stand_in(monkeypatch, 0, "{}", "")
    with pytest.raises(RuntimeError) as caught:
        compile_report.run_worker("gfx90a")
    assert str(caught.value) == ("this GPU is gfx90a: the compile report covers gfx942, gfx950 only (no launch-config "
                                 "file for gfx90a: gfx942's rules, untuned there; `k3-amd-overlay tune` on this GPU "
                                 "writes its own)")
    assert calls == []
    assert compile_report.unreported("sm90") == "this GPU is sm90: the compile report covers gfx942, gfx950 only"


# ---- the table and the command ------------------------------------------------------------------

SOURCES = {names.QK_CACHE_KERNEL: {"file": str(launch_configs.CONFIG_DIR / "gfx942.json"), "arch": "gfx942",
                                   "tuned_on": None, "tuned_here": False},
           names.ABSORB_QK_CACHE_KERNEL: {"file": "/cfg/gfx942-AMD_Instinct_MI300X.json", "arch": "gfx942",
                                          "tuned_on": MI300X, "tuned_here": True}}
REPORT = {"arch": "gfx942", "triton": "3.5.1", "fp8_format": "e4m3fnuz", "device": MI300X, "sources": SOURCES,
          "unchecked": [], "kernels": [
    _entry(kernel=names.QK_CACHE_KERNEL, config={"HEADS": 8, "num_warps": 2}, dtype="float16", shapes=["H>4", "T>8"],
           error="RuntimeError: out of resource", problems=["compile error"]),
    _entry(kernel=names.ABSORB_FP8_QK_CACHE_KERNEL, config={"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 8},
           compiled=True, dtype="bfloat16", shapes=["T<=8", "H>6"], target="gfx942", vgpr=137, agpr=12, sgpr=44,
           lds_bytes=9216, vgpr_spill=2, sgpr_spill=1, scratch_bytes=24, waves_per_simd=3,
           mfma="v_mfma_f32_16x16x32_fp8_fp8", tile_copies=8,
           problems=["spills 2 VGPRs, 1 SGPRs", "the dot's tile computed 8 times over by its warps"]),
    _entry(kernel=names.RMSNORM_PAIR_KERNEL, config={"ROWS_Q": 4}, compiled=True, dtype="bfloat16", shapes=["all"],
           target="gfx942", vgpr=30, agpr=0, sgpr=20, lds_bytes=0, vgpr_spill=0, sgpr_spill=0, scratch_bytes=0,
           waves_per_simd=8)]}
TABLE = "\n".join([
    "## gfx942 (Triton 3.5.1, fp8 e4m3fnuz)",
    "",
    "Launch configs for AMD Instinct MI300X:",
    f"- {names.QK_CACHE_KERNEL}: shipped gfx942.json",
    f"- {names.ABSORB_QK_CACHE_KERNEL}: /cfg/gfx942-AMD_Instinct_MI300X.json (tuned on AMD Instinct MI300X)",
    "",
    "| kernel | dtype | config | serves | VGPR | AGPR | SGPR | LDS B | spill V/S | scratch B | waves | MFMA "
    "| tile copies | verdict |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    f"| {names.QK_CACHE_KERNEL} | float16 | HEADS=8 num_warps=2 | H>4, T>8 | | | | | | | | | | "
    "RuntimeError: out of resource |",
    f"| {names.ABSORB_FP8_QK_CACHE_KERNEL} | bfloat16 | BLOCK_N=64 BLOCK_T=16 num_warps=8 | T<=8, H>6 | 137 | 12 | 44 "
    "| 9216 | 2/1 | 24 | 3 | v_mfma_f32_16x16x32_fp8_fp8 | 8 | spills 2 VGPRs, 1 SGPRs; the dot's tile computed "
    "8 times over by its warps |",
    f"| {names.RMSNORM_PAIR_KERNEL} | bfloat16 | ROWS_Q=4 | all | 30 | 0 | 20 | 0 | 0/0 | 0 | 8 | - | 1 | ok |"])


def test_the_table_row_by_row():
    assert compile_report.table(REPORT) == TABLE
    assert compile_report.table({**REPORT, "device": None}).splitlines()[2] == "Launch configs for no GPU named:"


def _report_from(monkeypatch: pytest.MonkeyPatch, report: dict) -> list[tuple[str, str | None]]:
    asked = []
    monkeypatch.setattr(compile_report, "run_worker", lambda arch, device_name=None: asked.append(
        (arch, device_name)) or json.loads(json.dumps(report)))
    monkeypatch.setattr(compile_report, "missing_kernels", lambda report, arch: [])  # the reports here: samples
    return asked


def test_the_command_prints_the_table_and_fails_on_a_shortfall(monkeypatch, capsys):
    asked = _report_from(monkeypatch, REPORT)
    assert compile_report.main(["--arch", "gfx942"]) == 1
    out, err = capsys.readouterr()
    assert (out, err, asked) == (TABLE + "\n", "\n2 of 3 configurations fall short on gfx942\n", [("gfx942", None)])
    good = {**REPORT, "kernels": REPORT["kernels"][2:]}
    _report_from(monkeypatch, good)
    assert compile_report.main(["--arch", "gfx950"]) == 0
    assert capsys.readouterr() == (compile_report.table(good) + "\n", "")


@pytest.mark.parametrize("report", [REPORT, {**REPORT, "kernels": REPORT["kernels"][2:]}])
def test_the_command_with_json_prints_the_report_and_nothing_else(monkeypatch, capsys, report):
    _report_from(monkeypatch, report)
    ok = report is not REPORT
    assert compile_report.main(["--arch", "gfx942", "--json"]) == (0 if ok else 1)
    out, err = capsys.readouterr()
    assert err == ""
    error = {} if ok else {"error": "2 of 3 configurations fall short on gfx942"}
    assert len(REPORT["kernels"]) == 3 and sum(bool(e["problems"]) for e in REPORT["kernels"]) == 2
    assert exact(json.loads(out)) == exact({"command": "kernels", "ok": ok, "exit_status": 0 if ok else 1, **report,
                                            **error})


@pytest.mark.parametrize("wants_json", [False, True])
def test_a_failed_compile_is_one_line_on_stderr_and_with_json_one_object(monkeypatch, capsys, wants_json):
    def fail(arch: str, device_name: str | None = None) -> dict:
        raise RuntimeError(f"compiling for {arch} failed (exit 3): boom")

    monkeypatch.setattr(compile_report, "run_worker", fail)
    assert compile_report.main(["--arch", "gfx950"] + ["--json"] * wants_json) == 1
    out, err = capsys.readouterr()
    assert err == "k3-amd-overlay kernels: compiling for gfx950 failed (exit 3): boom\n"
    assert (json.loads(out) if wants_json else out) == ({"command": "kernels", "ok": False, "exit_status": 1,
                                                         "error": "compiling for gfx950 failed (exit 3): boom"}
                                                        if wants_json else "")


UNCHECKED = (f"{KERNEL_CONFIGS}=/cfg: gfx942-AMD_Instinct_MI300X.json not checked: no GPU name known (no AMD GPU of "
             "gfx942 here); pass --device NAME to check the configs that GPU's server uses")


@pytest.mark.parametrize("wants_json", [False, True])
def test_a_tuned_file_left_unchecked_fails_the_command_and_is_named(monkeypatch, capsys, wants_json):
    report = {**REPORT, "device": None, "unchecked": [UNCHECKED], "kernels": REPORT["kernels"][2:]}
    _report_from(monkeypatch, report)
    assert compile_report.main(["--arch", "gfx942"] + ["--json"] * wants_json) == 1
    out, err = capsys.readouterr()
    if wants_json:
        assert err == "" and json.loads(out) == {"command": "kernels", "ok": False, "exit_status": 1, **report,
                                                 "error": UNCHECKED}
    else:
        assert (out, err) == (compile_report.table(report) + "\n", f"\n{UNCHECKED}\n")


def test_the_command_checks_the_gpu_named_by_device_else_this_machines_of_that_arch(gpus, monkeypatch, capsys):
    asked = _report_from(monkeypatch, {**REPORT, "kernels": []})
    gpus("gfx942")
    assert compile_report.main(["--arch", "gfx942", "--device", "AMD Instinct MI325X"]) == 0
    assert compile_report.main([]) == 0
    assert compile_report.main(["--arch", "gfx950"]) == 0  # this GPU is not of that arch: no name known
    assert asked == [("gfx942", "AMD Instinct MI325X"), ("gfx942", MI300X), ("gfx950", None)]


@pytest.mark.parametrize("name", ["", " ", "-/-"])
def test_a_device_name_with_no_letter_or_digit_is_a_usage_error(monkeypatch, capsys, name):
    asked = _report_from(monkeypatch, REPORT)
    assert compile_report.main(["--arch", "gfx942", f"--device={name}", "--json"]) == 2
    out, err = capsys.readouterr()
    message = f"--device {name!r}: a GPU name as k3-amd-overlay tune records it is needed, e.g. 'AMD Instinct MI300X'"
    assert asked == [] and err.endswith(f"k3-amd-overlay kernels: error: {message}\n") and "Traceback" not in err
    assert json.loads(out)["usage_error"] == message


@pytest.mark.parametrize(("value", "said"), [
    (" ", "K3_AMD_OVERLAY_KERNEL_CONFIGS=' ' names no "),
    (" /tmp/x", "K3_AMD_OVERLAY_KERNEL_CONFIGS=' /tmp/x': spaces before or after the path; give '/tmp/x'"),
], ids=["blank", "padded"])
def test_a_kernel_configs_variable_naming_no_path_is_a_usage_error_naming_it(monkeypatch, capsys, value, said):
    """Audit: a spaces-only K3_AMD_OVERLAY_KERNEL_CONFIGS gave exit 1 "cannot read launch configs  :";
    the settings call it a settings error, and measure says so with exit 2: so does the report."""
    asked = _report_from(monkeypatch, REPORT)
    monkeypatch.setenv(KERNEL_CONFIGS, value)
    assert compile_report.main(["--arch", "gfx942", "--device", "X", "--json"]) == 2
    out, err = capsys.readouterr()
    assert asked == [] and said in json.loads(out)["usage_error"] and "Traceback" not in err
    assert f"k3-amd-overlay kernels: error: {said}" in err


@pytest.mark.parametrize("argv", [["--device", ""], ["--arch", "gfx942", "--device", " "]], ids=["no-arch", "arch"])
def test_without_torch_a_nameless_device_is_a_usage_error_not_a_missing_torch(argv):
    """The CLI runs the report's check_args before it looks for torch: a --device naming no GPU is exit 2
    saying so, in a Python that cannot import torch."""
    hide_torch = ("import sys; sys.modules['torch'] = None; from k3_amd_overlay.commands import cli; "
                  "sys.exit(cli.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", hide_torch, "kernels", *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "needs torch" not in proc.stderr, proc.stderr[-2000:]
    assert f"k3-amd-overlay kernels: error: --device {argv[-1]!r}: a GPU name as k3-amd-overlay tune records it" in \
        proc.stderr


def test_the_worker_prints_its_report_as_json_or_a_bad_config_files_one_line(monkeypatch, capsys):
    made = {"arch": "gfx950", "triton": "3.5.1", "fp8_format": "e4m3fn", "kernels": [{"kernel": "k"}]}
    monkeypatch.setattr(compile_report, "compile_arch",
                        lambda arch, device_name=None: {**made, "arch": arch, "device": device_name})
    assert compile_report.main(["--worker", "gfx942"]) == 0
    assert capsys.readouterr() == (json.dumps({**made, "arch": "gfx942", "device": None}), "")
    assert compile_report.main(["--worker", "gfx942", "--device", MI300X]) == 0
    assert capsys.readouterr() == (json.dumps({**made, "arch": "gfx942", "device": MI300X}), "")

    def bad(arch: str, device_name: str | None = None) -> dict:
        raise launch_configs.LaunchConfigError("gfx942.json: BLOCK_T = 3 is not a power of two")

    monkeypatch.setattr(compile_report, "compile_arch", bad)
    assert compile_report.main(["--worker", "gfx942"]) == 1
    assert capsys.readouterr() == ("", "gfx942.json: BLOCK_T = 3 is not a power of two\n")


@pytest.fixture
def gpus(monkeypatch):
    """torch answering as a ROCm build whose GPU 0 and GPU 1 are of the archs given, each named an
    AMD Instinct MI300X (none is touched)."""
    import torch

    from k3_amd_overlay.kernels import launch

    def on(*archs: str) -> None:
        monkeypatch.setattr(torch.version, "hip", "6.4.0")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: types.SimpleNamespace(gcnArchName=f"{archs[index]}:sramecc+:xnack-"))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: MI300X)
        launch._device_name.cache_clear()

    yield on
    launch._device_name.cache_clear()


def test_the_command_builds_for_gpu_0s_arch_without_its_feature_flags(gpus, monkeypatch, capsys):
    gpus("gfx950", "gfx942")
    asked = _report_from(monkeypatch, {**REPORT, "kernels": []})
    assert compile_report.main([]) == 0
    assert asked == [("gfx950", MI300X)]
    assert compile_report.local_arch() == "gfx950"


@pytest.mark.parametrize(("setup", "message"), [
    ("no torch", "no AMD GPU here: pass --arch gfx942 or gfx950"),
    ("cuda build", "no AMD GPU here: pass --arch gfx942 or gfx950"),
    ("no gpu", "no AMD GPU here: pass --arch gfx942 or gfx950"),
    ("gfx90a", "this GPU is gfx90a: the compile report covers gfx942, gfx950 only (no launch-config file for gfx90a: "
               "gfx942's rules, untuned there; `k3-amd-overlay tune` on this GPU writes its own); pass --arch gfx942 "
               "or gfx950 to build for one of them"),
])
def test_without_a_covered_amd_gpu_the_command_needs_arch(gpus, monkeypatch, capsys, setup, message):
    import torch

    gpus("gfx90a")
    if setup == "no torch":
        monkeypatch.setitem(sys.modules, "torch", None)
    elif setup == "cuda build":
        monkeypatch.setattr(torch.version, "hip", None)
    elif setup == "no gpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    asked = _report_from(monkeypatch, REPORT)
    assert compile_report.main(["--json"]) == 2
    out, err = capsys.readouterr()
    assert asked == [] and err.endswith(f"k3-amd-overlay kernels: error: {message}\n")
    assert json.loads(out) == {"command": "kernels", "ok": False, "exit_status": 2, "usage_error": message,
                               "error": message}


def test_the_module_runs_as_the_kernels_command():
    proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay.commands.compile_report", "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert text.startswith("usage: k3-amd-overlay kernels [-h] [--arch {gfx942,gfx950}] [--device NAME] [--json] ")
    assert "--arch {gfx942,gfx950} the AMD arch to build for (default: this machine's GPU)" in text
    assert ("--device NAME the GPU whose launch configs to check, named as k3-amd-overlay tune records it, e.g. "
            "'AMD Instinct MI300X' (its tuned <arch>-<device>.json in K3_AMD_OVERLAY_KERNEL_CONFIGS over the shipped "
            "file; default: this machine's GPU of that arch)") in text
    assert "--json one JSON object on stdout on every path (the report)" in text
    assert "--worker" not in text


@pytest.mark.parametrize("lacking", ["vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count",
                                     "private_segment_fixed_size"])
def test_a_count_the_metadata_lacks_is_not_read_as_zero(lacking):
    amdgcn = "".join(line + "\n" for line in _isa("gfx950", 72, 8, 30).splitlines() if f".{lacking}:" not in line)
    entry = compile_report.describe(_compiled(amdgcn, "", 1024), names.QK_CACHE_KERNEL, {"HEADS": 4, "num_warps": 2},
                                    "gfx950", "bfloat16")
    assert f"not in the code object's metadata: {lacking}" in compile_report.problems(entry, "gfx950")


def test_a_report_without_a_row_of_some_kernel_and_dtype_is_no_pass(monkeypatch, capsys):
    """A worker that stopped short (or a sweep that reached none of a kernel's configs) leaves kernels
    unchecked: the command fails naming them (before, an empty list of kernels passed)."""
    good = {**REPORT, "kernels": REPORT["kernels"][2:]}
    monkeypatch.setattr(compile_report, "run_worker", lambda arch, device_name=None: json.loads(json.dumps(good)))
    assert compile_report.main(["--arch", "gfx942", "--json"]) == 1
    said = json.loads(capsys.readouterr().out)
    missing = compile_report.missing_kernels(good, "gfx942")
    assert said["ok"] is False
    assert said["error"] == f"no configuration of {', '.join(missing)} in the report: not checked"
    assert f"{names.RMSNORM_PAIR_KERNEL} (float16)" in missing
    assert f"{names.RMSNORM_PAIR_KERNEL} (bfloat16)" not in missing
    full = {**good, "kernels": [{**good["kernels"][0], "kernel": kernel, "dtype": dtype}
                                for kernel in compile_report.KERNEL_ORDER
                                for dtype in compile_report.query_dtypes(kernel, "gfx942")]}
    assert compile_report.missing_kernels(full, "gfx942") == []
    last = compile_report.missing_kernels({"kernels": []}, "gfx950")[-1]
    assert last == f"{names.ABSORB_MXFP4_QK_CACHE_KERNEL} (bfloat16)"


def test_the_worker_s_report_is_read_from_its_file_whatever_it_printed(monkeypatch):
    _run_stand_in(monkeypatch, 0, '{"arch": "gfx942", "kernels": []}', "")
    assert compile_report.run_worker("gfx942") == {"arch": "gfx942", "kernels": []}  # stdout: Triton's ISA dump
    _run_stand_in(monkeypatch, 0, "", "")
    with pytest.raises(RuntimeError, match=r"^compiling for gfx942: the worker left no report"):
        compile_report.run_worker("gfx942")
    _run_stand_in(monkeypatch, 0, "[1, 2]", "")
    with pytest.raises(RuntimeError, match=r"^compiling for gfx942: the worker's report is not one"):
        compile_report.run_worker("gfx942")


def test_an_unreadable_configs_setting_is_unchecked_not_a_crash(monkeypatch):
    monkeypatch.setenv("K3_AMD_OVERLAY_KERNEL_CONFIGS", "/" + "x" * 5000)  # too long a name to look at
    found = compile_report.unchecked("gfx942", None)
    assert len(found) == 1 and found[0].startswith("K3_AMD_OVERLAY_KERNEL_CONFIGS=/xxx")
