"""Experiment (issue 28): does where a kernel's arguments sit in its parameter block cost time under
CUDA-graph replay? ``launch_params_cost.py`` showed that 24 unused arguments cost nothing, yet the
one-token ladder's bare read (``r0``) took 0.16 µs more than ``w_read_floor.py``'s kernel with
near-identical sm90 code, whose main difference is that ``r0`` first tests ``pid`` against
``num_heads``, an argument near the end of the parameter bank, and only then reads the W pointer and
strides near its start. The absorb kernels in their order before 2026-12-06 (``BEFORE``) did the same:
compiled for sm90 at one token (bf16, 12 heads), ``num_heads`` at offset 0x290, the branch, then the W
and q_nope pointers at 0x210-0x218 and the strides at 0x260-0x268. Each launch of a graph has its own
parameter block, read through the constant cache, so the first program on an SM misses; the guess
being tested is that a branch on one missed line before the W arguments' line is read costs a second
miss in a row. The shipped kernels now take their arguments in ``QUERY`` + ``OUTPUT`` + ``KV`` order.

Timed side by side, three rounds in turn (medians of 64-launch graphs):
- ``read``: ``w_read_floor.py``'s read-only kernel (BLOCK_N 16, one warp), arguments at 0x210-0x228;
- ``read_pad``: the same behind 16 unused pointer arguments (its arguments on another line, no branch);
- ``read_guard_near`` / ``read_guard_far``: the same behind ``if pid < n * column blocks``, with ``n``
  on the W arguments' line or 24 arguments further on;
- each absorb kernel (bf16, fp8 ``W_UK``) as shipped beside wrapper kernels (the shipped kernel called
  inline) taking the same arguments in other orders (``orders``: the order before, the shipped order
  itself as a control of the wrapper, and three variations), launched through the shipped launcher
  (same grid and config), at 1-256 tokens, 12 and 16 heads; the norm pair as shipped beside one with
  ``num_tokens`` first (and its shipped order through a wrapper), at 1-256 tokens. Every wrapper's outputs are checked against the shipped launch's, what it must write
  poisoned first (a wrapper launched with two strides swapped fails the check).

    PYTHONPATH=$PWD python scripts/param_order_cost.py OUT.json [--shapes 12x1,16x8]   (a GPU, torch, Triton)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/param_order_cost.py --check   (CPU: bytes only)

Results in docs/benchmarks.md."""
import contextlib
import inspect
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from k3_amd_overlay.commands.bench.kernels import bf16_weights, decode_step_inputs, fp8_weights
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.kernels import absorb_fp8_qk_cache as fp8_module
from k3_amd_overlay.kernels import absorb_qk_cache as bf16_module
from k3_amd_overlay.kernels import rmsnorm_pair as norm_module

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from w_read_floor import w_read_kernel

BLOCK_N = 16
SHAPES = [(12, 1), (16, 1), (12, 2), (16, 2), (12, 8), (16, 8), (12, 64), (12, 256), (16, 256)]


@triton.jit
def read_pad(p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, w_ptr, out_ptr, s_w_h, s_w_k,
             s_w_n, P: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr):
    w_read_kernel(w_ptr, out_ptr, s_w_h, s_w_k, s_w_n, P, L, BLOCK_N, 1)


@triton.jit
def read_guard_near(w_ptr, out_ptr, n, s_w_h, s_w_k, s_w_n, P: tl.constexpr, L: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    if tl.program_id(0) < n * (L // BLOCK_N):
        w_read_kernel(w_ptr, out_ptr, s_w_h, s_w_k, s_w_n, P, L, BLOCK_N, 1)


@triton.jit
def read_guard_far(w_ptr, out_ptr, s_w_h, s_w_k, s_w_n, p1, p2, p3, p4, p5, p6, p7, p8, i1, i2, i3, i4, i5, i6,
                   i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, n, P: tl.constexpr, L: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    if tl.program_id(0) < n * (L // BLOCK_N):
        w_read_kernel(w_ptr, out_ptr, s_w_h, s_w_k, s_w_n, P, L, BLOCK_N, 1)


# Argument orders tried, by the shipped kernels' argument names (the constexprs follow, as shipped).
# "query_first": what the query programs read first (the W and q_nope pointers, the counts the
# program-range test uses, the W and q_nope strides), then the rope, scale and output arguments, the KV
# program's last (the shipped order since 2026-12-06: through a wrapper, the control); "counts_first":
# the two counts, then as query_first; "counts_then_before": the two
# counts, then the order before; "kv_before_rope": query_first with the KV program's arguments before
# the rope, scale and output ones.
QUERY = {"bf16": ["w_ptr", "q_nope_ptr", "num_heads", "num_tokens", "s_w_h", "s_w_k", "s_w_n", "s_qn_t", "s_qn_h"],
         "fp8": ["w_ptr", "q_nope_ptr", "num_heads", "num_tokens", "s_w_h", "s_w_n", "s_w_k", "s_qn_t", "s_qn_h"]}
OUTPUT = {"bf16": ["q_pe_ptr", "s_qp_t", "s_qp_h", "q_scale_ptr", "q_out_ptr", "s_qo_t", "s_qo_h", "fmax"],
          "fp8": ["w_scale_ptr", "q_scale_ptr", "q_pe_ptr", "s_qp_t", "s_qp_h", "q_out_ptr", "s_qo_t", "s_qo_h",
                  "fmax"]}
KV = ["kv_c_ptr", "k_pe_ptr", "cache_ptr", "slot_ptr", "k_scale_ptr", "s_kv_t", "s_kpe_t", "s_c_blk", "s_c_row",
      "block_size"]
KERNELS = {"bf16": (bf16_module, "absorb_qk_cache_kernel"), "fp8": (fp8_module, "absorb_fp8_qk_cache_kernel"),
           "norm": (norm_module, "rmsnorm_pair_kernel")}


# The kernels' argument orders up to 2026-12-06 (the W and query strides after ten pointers,
# num_tokens and num_heads after every stride)
BEFORE = {
    "bf16": ["q_nope_ptr", "w_ptr", "q_pe_ptr", "kv_c_ptr", "k_pe_ptr", "cache_ptr", "slot_ptr", "k_scale_ptr",
             "q_scale_ptr", "q_out_ptr", "s_qn_t", "s_qn_h", "s_w_h", "s_w_k", "s_w_n", "s_qp_t", "s_qp_h", "s_kv_t",
             "s_kpe_t", "s_c_blk", "s_c_row", "s_qo_t", "s_qo_h", "num_tokens", "num_heads", "block_size", "fmax"],
    "fp8": ["q_nope_ptr", "w_ptr", "w_scale_ptr", "q_pe_ptr", "kv_c_ptr", "k_pe_ptr", "cache_ptr", "slot_ptr",
            "k_scale_ptr", "q_scale_ptr", "q_out_ptr", "s_qn_t", "s_qn_h", "s_w_h", "s_w_n", "s_w_k", "s_qp_t",
            "s_qp_h", "s_kv_t", "s_kpe_t", "s_c_blk", "s_c_row", "s_qo_t", "s_qo_h", "num_tokens", "num_heads",
            "block_size", "fmax"],
    "norm": ["q_ptr", "q_out_ptr", "q_w_ptr", "q_stride", "q_out_stride", "q_eps", "kv_ptr", "kv_out_ptr", "kv_w_ptr",
             "kv_stride", "kv_out_stride", "kv_eps", "num_tokens"],
}


def orders(kind: str) -> dict[str, list[str]]:
    if kind == "norm":  # the token count the program-range test uses first
        return {"before": BEFORE[kind], "counts_first": ["num_tokens"] + [n for n in BEFORE[kind] if n != "num_tokens"]}
    query, output = QUERY[kind], OUTPUT[kind]
    return {
        "before": BEFORE[kind],
        "query_first": query + output + KV,
        "counts_first": query[2:4] + query[:2] + query[4:] + output + KV,
        "counts_then_before": ["num_heads", "num_tokens"] + [n for n in BEFORE[kind]
                                                             if n not in ("num_heads", "num_tokens")],
        "kv_before_rope": query + KV + output,
    }


def parameter_names(kind: str, constexpr: bool) -> list[str]:
    """The shipped kernel's runtime (or constexpr) argument names, in its order."""
    module, name = KERNELS[kind]
    parameters = inspect.signature(getattr(module, name).fn).parameters.values()
    return [p.name for p in parameters if (p.annotation in (tl.constexpr, "tl.constexpr")) == constexpr]


def build_wrappers(directory: str) -> dict:
    """One wrapper kernel per (kind, order), written to a module file (Triton's jit reads a kernel's
    source) and imported: its arguments in that order, its body the shipped kernel called with them."""
    lines = ["import triton", "import triton.language as tl",
             *(f"from {module.__name__} import {name}" for module, name in KERNELS.values()), ""]
    made = {}
    for kind, (_module, name) in KERNELS.items():
        constexprs = parameter_names(kind, True)
        shipped = parameter_names(kind, False)
        for order_name, order in orders(kind).items():
            assert sorted(order) == sorted(shipped), (kind, order_name)
            fn = f"{kind}_{order_name}"
            lines += ["@triton.jit",
                      f"def {fn}({', '.join(order + [c + ': tl.constexpr' for c in constexprs])}):",
                      f"    {name}({', '.join(shipped + constexprs)})", ""]
            made[(kind, order_name)] = (fn, [shipped.index(n) for n in order])
    path = f"{directory}/param_order_wrappers.py"
    with open(path, "w") as f:
        f.write("\n".join(lines))
    sys.path.insert(0, directory)
    import param_order_wrappers
    return {key: (getattr(param_order_wrappers, fn), index) for key, (fn, index) in made.items()}


WRAPPERS: dict = {}
MODULES = {kind: module for kind, (module, _) in KERNELS.items()}


@contextlib.contextmanager
def reordered(kind: str, order_name: str):
    """The shipped launcher of ``kind`` launching the wrapper of ``order_name`` (same grid, config and
    values)."""
    module = MODULES[kind]
    wrapper, index = WRAPPERS[(kind, order_name)]
    shipped_launch = module.launch

    def launch(kernel, grid, *args, **options):
        assert len(args) == len(index)
        wrapper[grid](*(args[i] for i in index), **options)

    module.launch = launch
    try:
        yield
    finally:
        module.launch = shipped_launch


def runner(kind: str, heads: int, tokens: int, device: str):
    """``run(outputs)`` launching the shipped launcher of ``kind`` on fresh random inputs, and
    ``outputs(poisoned)``: the tensors it writes, with what it must overwrite poisoned or not."""
    torch.manual_seed(heads * 1000 + tokens)
    if kind == "norm":
        q_c = torch.randn(tokens, 1536, dtype=torch.bfloat16, device=device)
        kv_c = torch.randn(tokens, 512, dtype=torch.bfloat16, device=device)
        q_w, kv_w = torch.rand(1536, device=device).bfloat16() + 0.5, torch.rand(512, device=device).bfloat16() + 0.5

        def run(outs):
            norm_module.rmsnorm_pair(q_c, kv_c, q_w, kv_w, 1e-6, 1e-6, *outs)

        def outputs(poisoned):
            return [torch.full_like(q_c, 7.0 if poisoned else -3.0), torch.full_like(kv_c, 7.0 if poisoned else -3.0)]
        return run, outputs
    q_nope, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, q_out = decode_step_inputs(tokens, heads, device)
    cache.random_(0, 256)
    if tokens > 2:
        slots[1::3] = -1  # padding rows: no write
    if kind == "bf16":
        w = bf16_weights(heads, device)

        def run(outs):
            bf16_module.absorb_qk_cache(q_nope, w, q_pe, kv_c, k_pe, *outs, E4M3FN)
    else:
        if device == "cpu":
            w = (torch.randn(heads, 512, 128) * 40).clamp(-448, 448).to(E4M3FN.dtype)
            w_scale = torch.tensor(0.003)
        else:
            w, w_scale = fp8_weights(heads, E4M3FN)

        def run(outs):
            fp8_module.absorb_fp8_qk_cache(q_nope, w, w_scale, q_pe, kv_c, k_pe, *outs, E4M3FN)

    def outputs(poisoned):
        got_cache = cache.clone()
        if poisoned:
            live = slots[slots >= 0]
            got_cache[live // cache.shape[1], live % cache.shape[1]] = 0x5A  # the rows to be written
        return [got_cache, slots, k_scale, q_scale, torch.full_like(q_out, 0xAB if poisoned else 0x3C)]
    return run, outputs


def bytes_identical(kind: str, order_name: str, heads: int, tokens: int, device: str) -> bool:
    """The wrapper's outputs (what it must write poisoned first) against the shipped launch's."""
    run, outputs = runner(kind, heads, tokens, device)
    ref = outputs(False)
    run(ref)
    got = outputs(True)
    with reordered(kind, order_name):
        run(got)
    return all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def main() -> None:
    import tempfile

    WRAPPERS.update(build_wrappers(tempfile.mkdtemp()))
    if "--check" in sys.argv:
        for kind, order_name in WRAPPERS:
            for heads, tokens in ((3, 1), (2, 3)):
                print(kind, order_name, heads, tokens, "bytes identical:",
                      bytes_identical(kind, order_name, heads, tokens, "cpu"), flush=True)
        return
    from k3_amd_overlay.commands.bench.timing import graphs_in_turn

    def timed(runs: dict) -> dict:
        return {name: {"rounds": t, "median": statistics.median(t)} for name, t in graphs_in_turn(runs).items()}

    pointers = [torch.empty(16, device="cuda") for _ in range(16)]
    integers = list(range(3, 19))
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "reads": [], "absorb": []}
    for heads in (12, 16):
        w = bf16_weights(heads)
        out = torch.empty(heads * 512, dtype=torch.float32, device="cuda")
        grid = (heads * (512 // BLOCK_N),)
        shape = dict(P=128, L=512, BLOCK_N=BLOCK_N, num_warps=1)
        s = w.stride()
        runs = {
            "read": lambda: w_read_kernel[grid](w, out, *s, SPLIT=1, **shape),
            "read_pad": lambda: read_pad[grid](*pointers, w, out, *s, **shape),
            "read_guard_near": lambda: read_guard_near[grid](w, out, heads, *s, **shape),
            "read_guard_far": lambda: read_guard_far[grid](w, out, *s, *pointers[:8], *integers, heads, **shape),
        }
        row = {"H": heads, **timed(runs)}
        results["reads"].append(row)
        print(json.dumps(row), flush=True)
    shapes = SHAPES
    if "--shapes" in sys.argv:  # e.g. --shapes 12x1,16x8 (the norm pair takes their token counts)
        shapes = [tuple(int(v) for v in hb.split("x")) for hb in sys.argv[sys.argv.index("--shapes") + 1].split(",")]
    for kind in KERNELS:
        for heads, tokens in ([(0, b) for b in sorted({b for _, b in shapes})] if kind == "norm" else shapes):
            run, outputs = runner(kind, heads, tokens, "cuda")
            outs = outputs(False)
            runs = {"shipped": lambda: run(outs)}
            row = {"kind": kind, "H": heads, "B": tokens}
            for order_name in orders(kind):
                row[f"{order_name}_bytes_identical"] = bytes_identical(kind, order_name, heads, tokens, "cuda")

                def reorder(order_name=order_name):
                    with reordered(kind, order_name):
                        run(outs)
                runs[order_name] = reorder
            row.update(timed(runs))
            row["ratios"] = {name: round(row["shipped"]["median"] / row[name]["median"], 3) for name in orders(kind)}
            results["absorb"].append(row)
            print(json.dumps({k: row[k] for k in ("kind", "H", "B", "ratios")}), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
