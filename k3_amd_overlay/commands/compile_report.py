"""``k3-amd-overlay kernels``: build every Triton kernel of the overlay for an AMD GPU arch
(gfx942: MI300X/MI325X, gfx950: MI355X) at every launch configuration its dispatch can choose there
for vLLM's decode batches, with no AMD GPU needed, and report what the code objects say: target,
registers, LDS, spills, scratch, waves per SIMD, the matrix instruction, and whether the dot's
warps each compute the same tile.

    k3-amd-overlay kernels [--arch gfx942|gfx950] [--device NAME] [--json]

The configurations are those a server on a GPU of that arch and name would use
(``launch_configs.resolve``: a tuned file from K3_AMD_OVERLAY_KERNEL_CONFIGS over the shipped one),
the GPU named by ``--device`` or else this machine's GPU of that arch; the report names each
kernel's config file. Each arch compiles in its own process (Triton keeps one JIT cache per device
id; a second arch in the same process could reuse the first's target), launched through the
kernels' own launchers at each config, with Triton's driver answering the AMD target and nothing
run. Exit status 1 when a configuration vLLM reaches fails to compile, spills, uses scratch, holds
fewer than ``MIN_WAVES`` waves per SIMD or repeats its tile across warps, and when a tuned file for
the arch goes unchecked (a directory of them with no GPU named, or the file that GPU would read
unusable)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3_amd_overlay.commands import usage
from k3_amd_overlay.commands.usage import EXIT_FAILED, Parser, UsageError, json_result, tool_main
from k3_amd_overlay.kernels import launch_configs, names
from k3_amd_overlay.settings import KERNEL_CONFIGS

AMD_ARCHS = ("gfx942", "gfx950")
MIN_WAVES = 4
# CDNA3/CDNA4 (AMD's ISA guides): 512 VGPRs+AGPRs per SIMD lane in granules of 8, at most 8 waves per
# SIMD, 4 SIMDs per CU; LDS per CU 64 KiB on gfx942, 160 KiB on gfx950.
REGISTERS_PER_LANE = 512
REGISTER_GRANULE = 8
MAX_WAVES_PER_SIMD = 8
SIMDS_PER_CU = 4
LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
# fp8 formats by arch: MI300's e4m3fnuz, MI355X's OCP e4m3fn (vLLM's current_platform.fp8_dtype())
FP8_FORMAT = {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}
KERNEL_ORDER = (names.RMSNORM_PAIR_KERNEL, names.QK_CACHE_KERNEL, names.STATIC_QUANT_KERNEL,
                names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL, names.ABSORB_MXFP4_QK_CACHE_KERNEL)


def query_dtypes(kernel: str, arch: str) -> tuple[str, ...]:
    """The activation dtypes vLLM runs ``kernel`` with on ``arch``: the model dtype, bf16 or fp16
    (vLLM's ROCm MLA backends, ROCM_AITER_MLA and TRITON_MLA, support only those); the fp8 and
    MXFP4 absorbed paths not with fp16 (the overlay refuses fp16 there); MXFP4 only on gfx950 (vLLM's
    ``rocm_aiter_ops.is_fp4bmm_enabled``: CDNA4 only) for a bf16 kv_b_proj."""
    if kernel == names.ABSORB_MXFP4_QK_CACHE_KERNEL:
        return ("bfloat16",) if arch == "gfx950" else ()
    if kernel in (names.ABSORB_FP8_QK_CACHE_KERNEL, names.STATIC_QUANT_KERNEL):
        return ("bfloat16",)
    return ("bfloat16", "float16")


@dataclass
class Entry:
    """One compiled configuration (the JSON fields the issue names first, then the context)."""

    kernel: str
    config: dict[str, int]
    compiled: bool
    error: str | None = None
    target: str | None = None
    vgpr: int | None = None
    agpr: int | None = None
    sgpr: int | None = None
    lds_bytes: int | None = None
    vgpr_spill: int | None = None
    sgpr_spill: int | None = None
    scratch_bytes: int | None = None
    waves_per_simd: int | None = None
    dtype: str = ""
    shapes: list[str] = field(default_factory=list)  # the (tokens, heads) rules this config serves
    mfma: str | None = None
    tile_copies: int | None = 1  # None: not read (tile_error says why)
    tile_error: str | None = None
    problems: list[str] = field(default_factory=list)


_META = re.compile(r"^\s*\.(vgpr_count|agpr_count|sgpr_count|vgpr_spill_count|sgpr_spill_count|"
                   r"private_segment_fixed_size):\s*(\d+)", re.M)
_TARGET = re.compile(r"\.amdgcn_target\s+\"[^\"]*-(gfx\w+)")
# An MFMA layout's definition: its alias and its fields (warpsPerCTA, instrShape, ... in any order)
_MFMA_LAYOUT = re.compile(r"^(#\w+) = #\w+\.amd_mfma<\{([^}]*)\}>", re.M)
_FIELD = r"\b{} = \[(\d+), (\d+)"
# Any op whose name holds "dot", "mma" or "mfma" (tt.dot, tt.dot_scaled on gfx950's fp8, and whatever a newer Triton
# names its matrix op), in the custom or the generic form, and the result type it ends on
_DOT_OP = re.compile(r"= \"?(\w+(?:\.\w+)*\.\w*(?:dot|mma|mfma)\w*)\"?[ (]"
                     r"[^\n]*-> tensor<(\d+)x(\d+)x\w+(?:, (#\w+))?>")
_MFMA_SHAPE = re.compile(r"v_mfma_\w*?(\d+)x(\d+)x\d+")


def isa_facts(amdgcn: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for key, value in _META.findall(amdgcn):
        facts.setdefault(key, int(value))
    found = _TARGET.search(amdgcn)
    facts["target"] = found.group(1) if found else None
    return facts


_NUM_AGPRS = re.compile(r"^\s*;\s*NumAgprs:\s*(\d+)\s*$", re.M)


def agpr_count(amdgcn: str, facts: dict[str, Any]) -> int | None:
    """The kernel's AGPRs: the metadata's ``.agpr_count``, else the assembler's own ``; NumAgprs:``
    line (the gfx942 code objects Triton 3.9.0 builds carry only the latter); None where
    neither says (the row then fails: a count is never assumed)."""
    if facts.get("agpr_count") is not None:
        return int(facts["agpr_count"])
    found = _NUM_AGPRS.search(amdgcn)
    return int(found.group(1)) if found else None


def waves_per_simd(vgpr: int, agpr: int, lds_bytes: int, num_warps: int, arch: str) -> int:
    """Occupancy from registers (AGPRs follow the VGPRs at a multiple of 4) and LDS."""
    registers = ((vgpr + 3) // 4 * 4 + agpr) if agpr else vgpr
    allocated = max(REGISTER_GRANULE, -(-registers // REGISTER_GRANULE) * REGISTER_GRANULE)
    waves = min(MAX_WAVES_PER_SIMD, REGISTERS_PER_LANE // allocated)
    if lds_bytes:
        groups_per_cu = LDS_PER_CU[arch] // lds_bytes
        waves = min(waves, groups_per_cu * num_warps // SIMDS_PER_CU)
    return waves


class TileUnread(ValueError):
    """The TTGIR has a dot whose layout cannot be read, or an MFMA layout with no dot read: no verdict."""


def dot_tiles(ttgir: str) -> list[tuple[str, int, int, int, int, int, int]]:
    """Each dot op of the TTGIR: (op, rows, cols, warps along rows, along cols, instruction rows, cols).
    Raises ``TileUnread`` where a dot's result layout is not an MFMA layout defined in the text, or an
    MFMA layout is defined and no dot op is found (an op this reading does not know)."""
    layouts = {}
    for alias, fields in _MFMA_LAYOUT.findall(ttgir):
        warps, instr = (re.search(_FIELD.format(name), fields) for name in ("warpsPerCTA", "instrShape"))
        if warps is None or instr is None:
            raise TileUnread(f"MFMA layout {alias} without warpsPerCTA and instrShape: {fields}")
        layouts[alias] = (*map(int, warps.groups()), *map(int, instr.groups()))
    found = []
    for op, rows, cols, encoding in _DOT_OP.findall(ttgir):
        if encoding not in layouts:
            raise TileUnread(f"{op} -> {rows}x{cols}: its layout {encoding or '(none)'} is not an MFMA layout "
                             "of this TTGIR")
        found.append((op, int(rows), int(cols), *layouts[encoding]))
    if layouts and not found:
        raise TileUnread(f"MFMA layouts {', '.join(layouts)} but no dot op read")
    return found


def tile_copies(ttgir: str) -> int:
    """How many warps compute each part of a dot's tile (1: none repeated; the most over the kernel's
    dots): the warps laid along a dimension over more rows or columns than the tile has compute copies
    of each other's work (8 warps on a 16-row tile: each of the 8 computes the whole tile). 1 where
    the kernel has no dot; ``TileUnread`` where a dot is there and its layout cannot be read."""
    copies = 1
    for _, rows, cols, warps_m, warps_n, instr_m, instr_n in dot_tiles(ttgir):
        copies = max(copies, max(1, warps_m * instr_m // rows) * max(1, warps_n * instr_n // cols))
    return copies


def describe(compiled: Any, kernel: str, options: dict[str, Any], arch: str, dtype: str) -> Entry:
    amdgcn = compiled.asm.get("amdgcn", "")
    facts = isa_facts(amdgcn)
    keys = (*launch_configs.KERNEL_PARAMETERS[kernel], *launch_configs.LAUNCH_OPTIONS)
    optional = launch_configs.OPTIONAL_PARAMETERS[kernel]
    # an optional key shows where it is not its default, as a config file leaves it out then
    config = {k: v for k, v in options.items() if k in keys or (k in optional and v != optional[k])}
    entry = Entry(kernel=kernel, config=config, compiled=True, dtype=dtype,
                  target=facts["target"],
                  # a count the metadata lacks stays None and fails the row (problems), never read as 0
                  vgpr=facts.get("vgpr_count"), agpr=agpr_count(amdgcn, facts),
                  sgpr=facts.get("sgpr_count"), lds_bytes=int(compiled.metadata.shared),
                  vgpr_spill=facts.get("vgpr_spill_count"), sgpr_spill=facts.get("sgpr_spill_count"),
                  scratch_bytes=facts.get("private_segment_fixed_size"))
    if entry.vgpr is not None and entry.agpr is not None:
        entry.waves_per_simd = waves_per_simd(entry.vgpr, entry.agpr, entry.lds_bytes or 0,
                                              int(options.get("num_warps", 4)), arch)
    mfma = re.search(r"\bv_mfma_\w+", amdgcn)
    entry.mfma = mfma.group(0) if mfma else None
    ttgir = compiled.asm.get("ttgir", "")
    try:
        entry.tile_copies = tile_copies(ttgir)
        if entry.mfma and not dot_tiles(ttgir):
            raise TileUnread(f"{entry.mfma} in the code object but no dot op read in the TTGIR")
    except TileUnread as exc:
        entry.tile_copies = None
        entry.tile_error = str(exc)
    if entry.mfma and kernel in launch_configs.DOT_TILE_KERNELS:
        shape = _MFMA_SHAPE.match(entry.mfma)
        assumed = launch_configs.matrix_tile(arch, config)
        if shape is None or (int(shape.group(1)), int(shape.group(2))) != assumed:
            entry.tile_error = (f"the launch-config check assumes {assumed[0]}x{assumed[1]} matrix tiles, the code "
                                f"object uses {entry.mfma}")
    return entry


def problems(entry: Entry, arch: str) -> list[str]:
    if not entry.compiled:
        return ["compile error"]
    found = []
    if entry.target != arch:
        found.append(f"built for {entry.target}, not {arch}")
    unread = [key for key, value in (("vgpr_count", entry.vgpr), ("agpr_count", entry.agpr),
                                     ("sgpr_count", entry.sgpr), ("vgpr_spill_count", entry.vgpr_spill),
                                     ("sgpr_spill_count", entry.sgpr_spill),
                                     ("private_segment_fixed_size", entry.scratch_bytes)) if value is None]
    if unread:
        found.append(f"not in the code object's metadata: {', '.join(unread)}")
    if entry.vgpr_spill or entry.sgpr_spill:
        found.append(f"spills {entry.vgpr_spill} VGPRs, {entry.sgpr_spill} SGPRs")
    if entry.scratch_bytes:
        found.append(f"{entry.scratch_bytes} B scratch")
    if (entry.waves_per_simd or 0) < MIN_WAVES:
        found.append(f"{entry.waves_per_simd} waves per SIMD (< {MIN_WAVES})")
    if entry.tile_error:
        found.append(f"tile copies not known: {entry.tile_error}")
    elif entry.tile_copies is None or entry.tile_copies > 1:
        found.append(f"the dot's tile computed {entry.tile_copies} times over by its warps")
    return found


# ---- the compiling process (one arch) ----------------------------------------------------------

class AotDriver:
    """Triton's active driver for compile-only runs: answers an AMD target, launches nothing."""

    def __init__(self, arch: str) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("hip", arch, 64)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def _is_dir(path: Path) -> bool:
    """Whether ``path`` is a directory; False where it cannot be looked at (too long a name, no access):
    the launch configs' own reading then says why (``launch_configs.startup_error``)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def missing_kernels(report: dict[str, Any], arch: str) -> list[str]:
    """Each kernel and dtype the report should hold a row of on ``arch`` and does not (a worker that
    stopped short, or a sweep that reached none of its configs): no evidence is no pass."""
    found = {(e.get("kernel"), e.get("dtype")) for e in report.get("kernels") or [] if isinstance(e, dict)}
    return [f"{kernel} ({dtype})" for kernel in KERNEL_ORDER for dtype in query_dtypes(kernel, arch)
            if (kernel, dtype) not in found]


def unchecked(arch: str, device_name: str | None) -> list[str]:
    """Each tuned file for ``arch`` this report cannot check, in a line that names it and why: with
    no GPU named, the <arch>-<device>.json files of a K3_AMD_OVERLAY_KERNEL_CONFIGS directory (a
    server reads the one of its own GPU); the tuned file the GPU would read where it is unusable."""
    setting = os.environ.get(KERNEL_CONFIGS, "")
    found = []
    if setting and device_name is None and _is_dir(Path(setting)):
        files = sorted(p.name for p in Path(setting).glob(f"{arch}-*.json")
                       if launch_configs.TUNED_NAME.fullmatch(p.name))
        if files:
            found.append(f"{KERNEL_CONFIGS}={setting}: {', '.join(files)} not checked: no GPU name known (no AMD GPU "
                         f"of {arch} here); pass --device NAME to check the configs that GPU's server uses")
    error = launch_configs.startup_error(arch, device_name)
    if error:
        found.append(error)
    return found


def compile_config(kernel: str, arch: str, config: launch_configs.Config | dict[str, int], dtype: str, tokens: int,
                   heads: int) -> Entry:
    """``kernel`` built for ``arch`` at ``config`` for one launch of ``tokens`` tokens and ``heads`` heads
    with ``dtype`` queries, read from its code object, with its problems (Triton's active driver must
    answer ``arch``: ``AotDriver``)."""
    import torch

    from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ
    from k3_amd_overlay.kernels import launch, probe, target

    fmt = E4M3FNUZ if FP8_FORMAT[arch] == "e4m3fnuz" else E4M3FN
    # forced: a launch for a named arch resolves no GPU name, so it would take the shipped config
    with target.compile_only(arch) as session, launch.forced(dict(config)):
        try:
            probe.launch_at(kernel, torch.device("cpu"), getattr(torch, dtype), tokens, heads, fmt)
            error = None
        except Exception as exc:  # the compiler's own message is the report
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    if error is not None or not session.compiled:
        entry = Entry(kernel=kernel, config=dict(config), compiled=False, dtype=dtype,
                      error=error or "nothing was compiled")
    else:
        name, options, compiled = session.compiled[-1]
        entry = describe(compiled, name, options, arch, dtype)
    entry.problems = problems(entry, arch)
    return entry


def compile_arch(arch: str, device_name: str | None = None) -> dict[str, Any]:
    """Compile everything for ``arch``, at the configs a GPU named ``device_name`` uses, in this
    process (its Triton driver is replaced)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.runtime import driver

    from k3_amd_overlay.kernels import probe

    driver.set_active(AotDriver(arch))
    entries = []
    for kernel in KERNEL_ORDER:
        for dtype in query_dtypes(kernel, arch):
            for config, samples, labels in probe.reachable(kernel, arch, device_name=device_name, every_rule=True):
                tokens, heads = samples[0]
                entry = compile_config(kernel, arch, config, dtype, tokens, heads)
                entry.shapes = labels
                entries.append(asdict(entry))
    sources = launch_configs.sources(arch, device_name)
    return {"arch": arch, "triton": triton.__version__, "fp8_format": FP8_FORMAT[arch], "device": device_name,
            "sources": {kernel: sources[kernel] for kernel in KERNEL_ORDER if query_dtypes(kernel, arch)},
            "unchecked": unchecked(arch, device_name), "kernels": entries}


# ---- the command -------------------------------------------------------------------------------

def local_gpu() -> tuple[str, str] | None:
    """This machine's AMD GPU 0: its arch without feature flags and its name as ``tune`` records it;
    None without torch, a ROCm build or a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if torch.version.hip is None or not torch.cuda.is_available():
        return None
    from k3_amd_overlay.kernels.launch import device_name

    arch = str(torch.cuda.get_device_properties(0).gcnArchName).split(":")[0]
    return arch, str(device_name(torch.device("cuda", 0)))


def local_arch() -> str:
    here = local_gpu()
    if here is None:
        raise UsageError("no AMD GPU here: pass --arch " + " or ".join(AMD_ARCHS))
    if here[0] not in AMD_ARCHS:
        raise UsageError(f"{unreported(here[0])}; pass --arch " + " or ".join(AMD_ARCHS) + " to build for one of them")
    return here[0]


def local_device(arch: str) -> str | None:
    """The name of this machine's GPU where it is of ``arch`` (None: no such GPU here)."""
    here = local_gpu()
    return here[1] if here is not None and here[0] == arch else None


def unreported(arch: str) -> str:
    """Why there is no report for ``arch`` (its occupancy and fp8 facts are known for AMD_ARCHS only)."""
    note = launch_configs.fallback_note(arch)
    return f"this GPU is {arch}: the compile report covers {', '.join(AMD_ARCHS)} only" + (f" ({note})" if note else "")


def run_worker(arch: str, device_name: str | None = None) -> dict[str, Any]:
    if arch not in AMD_ARCHS:
        raise RuntimeError(unreported(arch))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    device = ["--device", device_name] if device_name else []
    # The worker runs where this package lies (``-m`` puts its working directory first on the path: run
    # from elsewhere, a k3_amd_overlay folder there would be compiled instead of this one), and writes its
    # report to a file of its own (Triton may print to stdout: AMDGCN_ENABLE_DUMP, say).
    home = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="k3-amd-overlay-kernels-") as scratch:
        out = Path(scratch) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay.commands.compile_report", "--worker", arch,
                               "--worker-out", str(out), *device], capture_output=True, text=True, env=env, cwd=home)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)  # the whole of it (a traceback, say) here; the error is its last line
            raise RuntimeError(f"compiling for {arch} failed (exit {proc.returncode}): {last_line(proc.stderr)}")
        try:
            report = json.loads(out.read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"compiling for {arch}: the worker left no report ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("kernels"), list):
        raise RuntimeError(f"compiling for {arch}: the worker's report is not one (no list of kernels)")
    return report


def last_line(text: str) -> str:
    """The last line of ``text`` that says something (a traceback's exception), or that nothing was said."""
    said = [line.strip() for line in text.splitlines() if line.strip()]
    return said[-1] if said else "nothing on stderr"


def source_text(source: dict[str, Any]) -> str:
    """Where a kernel's configs come from, as the report says it: the shipped file, or the tuned file's path."""
    path = Path(source["file"])
    if path.parent == launch_configs.CONFIG_DIR:
        return f"shipped {path.name}"
    return str(path) + (f" (tuned on {source['tuned_on']})" if source.get("tuned_on") else "")


def table(report: dict[str, Any]) -> str:
    lines = [f"## {report['arch']} (Triton {report['triton']}, fp8 {report['fp8_format']})", "",
             f"Launch configs for {report['device'] or 'no GPU named'}:",
             *(f"- {kernel}: {source_text(source)}" for kernel, source in report["sources"].items()), "",
             "| kernel | dtype | config | serves | VGPR | AGPR | SGPR | LDS B | spill V/S | scratch B | waves | "
             "MFMA | tile copies | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report["kernels"]:
        config = " ".join(f"{k}={v}" for k, v in e["config"].items())
        verdict = "; ".join(e["problems"]) or "ok"
        if not e["compiled"]:
            lines.append(f"| {e['kernel']} | {e['dtype']} | {config} | {', '.join(e['shapes'])} | | | | | | | | | | "
                         f"{e['error']} |")
            continue
        lines.append(f"| {e['kernel']} | {e['dtype']} | {config} | {', '.join(e['shapes'])} | {e['vgpr']} | "
                     f"{e['agpr']} | {e['sgpr']} | {e['lds_bytes']} | {e['vgpr_spill']}/{e['sgpr_spill']} | "
                     f"{e['scratch_bytes']} | {e['waves_per_simd']} | {e['mfma'] or '-'} | "
                     f"{'?' if e.get('tile_copies') is None else e['tile_copies']} | {verdict} |")
    return "\n".join(lines)


def parser() -> Parser:
    p = Parser(prog="k3-amd-overlay kernels", description=usage.describe(__doc__))
    p.add_argument("--arch", choices=AMD_ARCHS, help="the AMD arch to build for (default: this machine's GPU)")
    p.add_argument("--device", metavar="NAME",
                   help="the GPU whose launch configs to check, named as k3-amd-overlay tune records it, e.g. "
                        "'AMD Instinct MI300X' (its tuned <arch>-<device>.json in K3_AMD_OVERLAY_KERNEL_CONFIGS "
                        "over the shipped file; default: this machine's GPU of that arch)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout on every path (the report)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p


def check_args(args: argparse.Namespace) -> None:
    """The checks of the report's arguments that need no torch (the CLI runs them before it looks for it):
    UsageError naming the value and what is allowed."""
    if args.device is not None and not launch_configs.device_slug(args.device):
        raise UsageError(f"--device {args.device!r}: a GPU name as k3-amd-overlay tune records it is needed, "
                         "e.g. 'AMD Instinct MI300X'")
    usage.kernel_configs_setting()


def main(argv: list[str] | None = None) -> int:
    return tool_main(sys.modules[__name__], argv)


def checked_main(args: argparse.Namespace) -> int:
    """The run of arguments ``usage.checked_args`` accepted (the CLI calls it once it has found torch
    and triton)."""
    if args.worker:
        try:
            report = compile_arch(args.worker, args.device)
        except launch_configs.LaunchConfigError as exc:  # a bad launch-config file: its one-line reason
            print(exc, file=sys.stderr)
            return 1
        if args.worker_out:
            Path(args.worker_out).write_text(json.dumps(report))
        else:
            json.dump(report, sys.stdout)
        return 0
    try:
        arch = args.arch or local_arch()
    except UsageError as exc:  # no AMD GPU of a covered arch to take the arch from
        return parser().usage_error(exc, json_wanted=args.json)
    try:
        report = run_worker(arch, args.device or local_device(arch))
    except RuntimeError as exc:  # a failed compile
        if args.json:
            print(json_result("kernels", False, error=str(exc)))
        print(f"k3-amd-overlay kernels: {exc}", file=sys.stderr)
        return EXIT_FAILED
    failing = [e for e in report["kernels"] if e["problems"]]
    missing = missing_kernels(report, arch)
    ok = not failing and not report["unchecked"] and not missing
    unseen = [f"no configuration of {', '.join(missing)} in the report: not checked"] if missing else []
    short = [f"{len(failing)} of {len(report['kernels'])} configurations fall short on {arch}"] if failing else []
    error = "; ".join(short + unseen + list(report["unchecked"]))
    print(json_result("kernels", ok, **report, **({} if ok else {"error": error})) if args.json else table(report))
    if not args.json:
        for line in report["unchecked"]:
            print(f"\n{line}", file=sys.stderr)
        for line in unseen:
            print(f"\n{line}", file=sys.stderr)
        if failing:
            print(f"\n{len(failing)} of {len(report['kernels'])} configurations fall short on {arch}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
