"""Parity checks shared by the kernel tests and the mutation tests: each returns a list of
problems (empty when the provider matches the reference), so a test can assert both that the
real provider passes and that a planted fault is caught."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3_amd_overlay import k3
from k3_amd_overlay.fp8 import Fp8Format
from k3_amd_overlay.ops import qk_cache as qk_cache_op
from k3_amd_overlay.ops import reference

POISON_A, POISON_B = 0xA5, 0x5A
# The GPU arches' kinds of layout (sm90.json, gfx942.json, gfx950.json: several heads, rows or column
# blocks a program; one-token programs) that the interpreter's own rules (cpu.json) never take,
# forced where a kernel's bytes are checked on CPU. The one-token layout takes a wider column block
# than those files' 8-32 (the same code path, fewer programs under the interpreter).
GPU_LAYOUTS = {
    "rmsnorm_pair": {"ROWS_Q": 2, "ROWS_KV": 4, "num_warps": 4},
    "qk_cache": {"HEADS": 2, "num_warps": 4},
    "absorb_one_token": {"BLOCK_N": 128, "BLOCK_T": 1, "num_warps": 1},  # no tensor-core tile: products summed
    "absorb_few_tokens": {"BLOCK_N": 64, "BLOCK_T": 2, "num_warps": 2},  # two tokens a program, no tile either
    "absorb_column_blocks": {"BLOCK_N": 64, "BLOCK_T": 16, "KV_ROWS": 4, "num_warps": 4},
    "absorb_eight_token_dot": {"BLOCK_N": 64, "BLOCK_T": 8, "num_warps": 4},  # a dot of 8 rows (padded on NVIDIA)
}
# The absorb layouts and the tokens each is checked at: column blocks over two token blocks, the second
# part-filled; one-token programs at fewer tokens (each a program under the interpreter); two-token
# programs over three token blocks, the last part-filled; eight-token dots over two, the second part-filled.
ABSORB_GPU_LAYOUTS = {"absorb_one_token": 5, "absorb_column_blocks": 17, "absorb_few_tokens": 5,
                      "absorb_eight_token_dot": 11}


def skip_under_interpreter(tokens: int, heads: int, fmt: Fp8Format) -> None:
    """Skip an absorb parity case the Triton interpreter would take too long over (it runs a launch's
    programs one after another): more than 48 token-heads; and at 12 or more heads, one fp8 format
    each (12: e4m3fn, 16: e4m3fnuz), while the format-specific part (the quant) runs in both formats
    at 1 and 3 heads. A GPU runs them all."""
    import pytest
    from machine import HAS_GPU

    if HAS_GPU:
        return
    if tokens * heads > 48:
        pytest.skip("too slow under the Triton interpreter; the GPU run (scripts/gpu_check.sh) covers it")
    if heads >= 12 and fmt.name != ("e4m3fn" if heads == 12 else "e4m3fnuz"):
        pytest.skip("the other fp8 format at this head count under the Triton interpreter; both at 1 and 3 "
                    "heads, and all on the GPU (scripts/gpu_check.sh)")


@dataclass
class QkCase:
    """Fresh random decode-step inputs with realistic strides (q_pe and k_pe are column slices)."""

    ql_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor
    q_scale: torch.Tensor
    cache_shape: tuple[int, int, int]
    fmt: Fp8Format


def make_qk_case(tokens: int, heads: int, fmt: Fp8Format, *, block_size: int = 16, lora: int = k3.KV_LORA_RANK,
                 rope: int = 64, nope: int = 128, num_blocks: int | None = None,
                 extremes: bool = True, padding_every: int = 3, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", seed: int | None = None) -> QkCase:
    gen = torch.Generator(device="cpu")
    gen.seed() if seed is None else gen.manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 3.0

    ql_nope = randn(tokens, heads, lora)
    q_full = randn(tokens, heads, nope + rope)
    latent = randn(tokens, lora + rope + 7)
    kv_c = randn(tokens, lora)
    if extremes and tokens:
        # saturating values, inf and NaN in both the nope and the rope lanes
        ql_nope.view(-1)[:: 97] = 1e4
        ql_nope.view(-1)[5:: 89] = -1e4
        rope_lanes = q_full[..., nope:]  # a strided view: a reshape of it would be a copy, the inf never placed
        every_53rd = torch.zeros(rope_lanes.numel(), dtype=torch.bool)
        every_53rd[::53] = True
        rope_lanes[every_53rd.view(rope_lanes.shape)] = float("inf")
        kv_c.view(-1)[::61] = -1e5
        latent[:, lora + 3] = float("nan")
        ql_nope.view(-1)[7:: 211] = float("nan")
    num_blocks = num_blocks or max(4, 2 * tokens // block_size + 3)
    total = num_blocks * block_size
    slots = torch.randperm(total, generator=gen)[:tokens]
    if padding_every:  # from the third token: a batch of one or two tokens has every token's query checked
        slots[padding_every - 1:: padding_every] = -1
    to = dict(device=device)
    return QkCase(
        ql_nope=ql_nope.to(dtype).to(**to),
        q_pe=q_full.to(dtype).to(**to)[..., nope:],
        kv_c=kv_c.to(dtype).to(**to),
        k_pe=latent.to(dtype).to(**to)[:, lora: lora + rope].unsqueeze(1),
        slot_mapping=slots.to(torch.int64).to(**to),
        k_scale=torch.tensor([1.3137], dtype=torch.float32, device=device),
        q_scale=torch.tensor([0.7123], dtype=torch.float32, device=device),
        cache_shape=(num_blocks, block_size, lora + rope),
        fmt=fmt,
    )


def unchecked(case: QkCase) -> list[str]:
    """A batch whose every token is padding (slot -1) leaves the queries unchecked: a problem, so a
    parity check cannot pass on nothing."""
    if case.slot_mapping.numel() and not bool((case.slot_mapping >= 0).any()):
        return ["no token has a slot: the query bytes would go unchecked"]
    return []


QkRunner = Callable[[QkCase, torch.Tensor, torch.Tensor], None]  # (case, cache_u8, q_out_u8)


def run_provider(provider: str) -> QkRunner:
    def run(case: QkCase, cache: torch.Tensor, q_out: torch.Tensor) -> None:
        qk_cache_op.fused_qk_cache(case.ql_nope, case.q_pe, case.kv_c, case.k_pe, cache,
                                   case.slot_mapping, case.k_scale, case.q_scale,
                                   q_out=q_out.view(case.fmt.dtype), provider=provider,
                                   kv_format=case.fmt.name)
    return run


def _outputs(case: QkCase, runner: QkRunner, poison: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = case.ql_nope.device
    tokens, heads, lora = case.ql_nope.shape
    cache = torch.full(case.cache_shape, poison, dtype=torch.uint8, device=device)
    q_out = torch.full((tokens, heads, lora + case.q_pe.shape[-1]), poison, dtype=torch.uint8, device=device)
    runner(case, cache, q_out)
    return cache, q_out


def _decode(bits: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    return bits.view(fmt.dtype).float()


def _value_problems(name: str, got: torch.Tensor, want: torch.Tensor, fmt: Fp8Format) -> list[str]:
    g, w = _decode(got, fmt), _decode(want, fmt)
    bad = (got != want) & ~(g.isnan() & w.isnan())  # bit equality; any NaN code for a NaN
    count = int(bad.sum())
    if count:
        idx = bad.nonzero()[0].tolist()
        return [f"{name}: {count} values differ, first at {idx}: got {g[tuple(idx)].item()} "
                f"want {w[tuple(idx)].item()}"]
    return []


def qk_cache_problems(case: QkCase, runner: QkRunner) -> list[str]:
    """Run ``runner`` and the reference twice each, over two different poisons; bytes that differ
    between the two poisons were not written. Problems: a byte written that should not be, one not
    written that should be, a code that differs from the reference's (bit equality, on the GPU and
    under the Triton interpreter alike)."""
    problems: list[str] = unchecked(case)
    ref = run_provider("reference")
    cache_a, q_a = _outputs(case, runner, POISON_A)
    cache_b, q_b = _outputs(case, runner, POISON_B)
    ref_cache, ref_q = _outputs(case, ref, POISON_A)
    valid = case.slot_mapping >= 0
    block_size = case.cache_shape[1]
    expected_rows = torch.zeros(case.cache_shape[:2], dtype=torch.bool, device=cache_a.device)
    slots = case.slot_mapping[valid]
    expected_rows[slots // block_size, slots % block_size] = True
    written = cache_a == cache_b
    expected = expected_rows.unsqueeze(-1).expand_as(written)
    if (written & ~expected).any():
        problems.append(f"cache: {int((written & ~expected).sum())} bytes written outside the valid slots")
    if (~written & expected).any():
        problems.append(f"cache: {int((~written & expected).sum())} bytes of valid slots not written")
    q_written = q_a == q_b
    if (~q_written[valid]).any():
        problems.append(f"q_out: {int((~q_written[valid]).sum())} bytes of valid tokens not written")
    problems += _value_problems("cache", cache_a[expected_rows], ref_cache[expected_rows], case.fmt)
    problems += _value_problems("q_out", q_a[valid], ref_q[valid], case.fmt)
    return problems


def rmsnorm_problems(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                     ulps: float = 2.0) -> list[str]:
    """Each output within ``ulps`` units in the last place of the reference (fp32 rounding and
    rsqrt implementations may differ by one), same shape and dtype, no NaN."""
    problems = []
    for name, g, w in (("q", got[0], want[0]), ("kv", got[1], want[1])):
        if g.shape != w.shape or g.dtype != w.dtype:
            problems.append(f"{name}: got {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}")
            continue
        if g.numel() == 0:
            continue
        eps = torch.finfo(w.dtype).eps
        tol = ulps * eps * w.float().abs() + 1e-6
        diff = (g.float() - w.float()).abs()
        if g.isnan().any() or (diff > tol).any():
            problems.append(f"{name}: {int((diff > tol).sum())} values off by more than {ulps} ulp "
                            f"(max {diff.max().item():.3g})")
    return problems


def rmsnorm_inputs(tokens: int, dtype: torch.dtype, device: torch.device | str, q_size: int = 1536,
                   kv_size: int = k3.KV_LORA_RANK, seed: int | None = None) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator()
    gen.seed() if seed is None else gen.manual_seed(seed)
    latent = (torch.randn((tokens, q_size + kv_size + 64), generator=gen) * 2).to(dtype).to(device)
    q_w = (1 + 0.3 * torch.randn(q_size, generator=gen)).to(dtype).to(device)
    kv_w = (1 + 0.3 * torch.randn(kv_size, generator=gen)).to(dtype).to(device)
    return latent[:, :q_size], latent[:, q_size: q_size + kv_size], q_w, kv_w


def reference_pair(q: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, kv_w: torch.Tensor,
                   q_eps: float, kv_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.rmsnorm_pair_reference(q, kv, q_w, kv_w, q_eps, kv_eps)


def fp8_code_rank(codes: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Each fp8 code's position among the format's sorted representable values (-0 and +0 one)."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = values[~values.isnan()].unique()
    return torch.searchsorted(grid.to(codes.device), codes.view(fmt.dtype).float())


def absorb_problems(case: QkCase, fused: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                    want: tuple[torch.Tensor, torch.Tensor], max_differing: float = 0.002) -> list[str]:
    """A fused absorbed launch against the unfused path's bytes ``want`` (cache, q_out), each output
    poisoned twice (``fused(poison)``): written bytes exactly the valid slots' rows and the valid
    tokens' queries; cache codes identical; query codes identical except one step apart at a
    rounding boundary (the two fp32 sums in another order) for at most ``max_differing`` of them."""
    cache_a, q_a = fused(POISON_A)
    cache_b, q_b = fused(POISON_B)
    ref_cache, ref_q = want
    valid = case.slot_mapping >= 0
    found = unchecked(case)
    block = case.cache_shape[1]
    rows = torch.zeros(case.cache_shape[:2], dtype=torch.bool, device=cache_a.device)
    slots = case.slot_mapping[valid]
    rows[slots // block, slots % block] = True
    if not torch.equal(cache_a == cache_b, rows.unsqueeze(-1).expand_as(cache_a)):
        found.append("cache: written bytes are not exactly the valid slots' rows")
    if not (q_a == q_b)[valid].all():
        found.append("q_out: bytes of valid tokens not written")
    if not torch.equal(cache_a[rows], ref_cache[rows]):
        found.append(f"cache: {int((cache_a[rows] != ref_cache[rows]).sum())} codes differ")
    got, ref = q_a[valid], ref_q[valid]
    differ = _decode(got, case.fmt) != _decode(ref, case.fmt)
    adjacent = (fp8_code_rank(got, case.fmt) - fp8_code_rank(ref, case.fmt)).abs().le(1)
    if (differ & ~adjacent).any() or differ.float().mean() > max_differing:
        found.append(f"q_out: {int(differ.sum())} of {got.numel()} codes differ "
                     f"({int((differ & ~adjacent).sum())} by more than one step)")
    return found


AbsorbMaker = Callable[[int], tuple]  # seed -> (case, q_nope, *weights): what the absorb tests' case makers return


def absorb_graph_replay_problems(make: AbsorbMaker, op: Callable[..., torch.Tensor],
                                 max_differing: float = 0.002, seeds: tuple[int, ...] = (2, 3)) -> list[str]:
    """An absorbed op (``op(q_nope, *weights, q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale, ...)``)
    captured once in a CUDA/HIP graph on ``make(1)``'s tensors, no host sync allowed inside, then
    replayed after ``make(seed)``'s values are copied into those tensors: the queries, rope lanes, KV
    rows, slots, both static scales, and the weights with their scales (a value taken when captured
    goes stale there). Per replay, what ``absorb_problems`` finds against the reference provider run
    on the same tensors: outputs poisoned twice, every meant byte written and nothing else."""
    case, q_nope, *weights = make(1)
    fmt = case.fmt
    tensors = [q_nope, *weights, case.q_pe, case.kv_c, case.k_pe, case.slot_mapping, case.k_scale, case.q_scale]
    cache = torch.full(case.cache_shape, POISON_A, dtype=torch.uint8, device=q_nope.device)
    q_out = torch.full((*q_nope.shape[:2], k3.LATENT_ROW), POISON_A, dtype=torch.uint8, device=q_nope.device)

    def step(provider: str, into: torch.Tensor, q_into: torch.Tensor | None) -> torch.Tensor:
        return op(q_nope, *weights, case.q_pe, case.kv_c, case.k_pe, into, case.slot_mapping, case.k_scale,
                  case.q_scale, q_out=None if q_into is None else q_into.view(fmt.dtype), provider=provider,
                  kv_format=fmt.name)

    step("triton", cache, q_out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step("triton", cache, q_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    def replayed(poison: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache.fill_(poison)
        q_out.fill_(poison)
        graph.replay()
        return cache.clone(), q_out.clone()

    found = []
    for seed in seeds:
        new, new_q, *new_weights = make(seed)
        news = [new_q, *new_weights, new.q_pe, new.kv_c, new.k_pe, new.slot_mapping, new.k_scale * (1 + seed / 7),
                new.q_scale * (1 + seed / 11)]
        for dst, src in zip(tensors, news, strict=True):
            dst.copy_(src)
        ref_cache = torch.full_like(cache, POISON_A)
        ref_q = step("reference", ref_cache, None).view(torch.uint8)
        found += [f"seed {seed}: {p}" for p in absorb_problems(new, replayed, (ref_cache, ref_q), max_differing)]
    return found


def weight_scale_held_from_first_call(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Planted fault for the graph-replay tests of the scaled absorptions (fp8, MXFP4): ``op`` whose
    Triton path keeps the W_K scale of its first call, as a prepared-weights cache would, so a graph
    captured after it scales every replay by that stale value."""
    held: list[torch.Tensor] = []

    def stale(q_nope, w_k, w_k_scale, *rest, provider, **kwargs):
        if provider == "triton":
            held[:] = held or [w_k_scale.clone()]
            w_k_scale = held[0]
        return op(q_nope, w_k, w_k_scale, *rest, provider=provider, **kwargs)

    return stale
