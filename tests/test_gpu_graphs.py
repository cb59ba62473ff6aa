"""CUDA/HIP graph safety of both fused ops: captured once, replayed with new inputs copied into
the captured buffers, matching the reference each time; no host-device synchronisation inside."""

from __future__ import annotations

import pytest
import torch
from parity import POISON_A, make_qk_case, reference_pair, rmsnorm_inputs, rmsnorm_problems

from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ
from k3_amd_overlay.ops import fused_q_kv_rmsnorm, fused_qk_cache

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ], ids=lambda f: f.name)
@pytest.mark.parametrize("heads", [3, 12])
def test_qk_cache_graph_replay_with_new_inputs(fmt, heads):
    tokens = 64
    case = make_qk_case(tokens, heads, fmt, device="cuda", extremes=False, num_blocks=32, seed=0)
    inputs = [case.ql_nope.clone(), case.q_pe.clone(), case.kv_c.clone(), case.k_pe.clone(),
              case.slot_mapping.clone(), case.k_scale.clone(), case.q_scale.clone()]
    cache = torch.full(case.cache_shape, POISON_A, dtype=torch.uint8, device="cuda")
    q_out = torch.empty((tokens, heads, 576), dtype=fmt.dtype, device="cuda")

    def step():
        fused_qk_cache(inputs[0], inputs[1], inputs[2], inputs[3], cache, inputs[4], inputs[5],
                       inputs[6], q_out=q_out, provider="triton", kv_format=fmt.name)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (1, 2, 3):
        new = make_qk_case(tokens, heads, fmt, device="cuda", extremes=False, num_blocks=32, seed=seed)
        for dst, src in zip(inputs, [new.ql_nope, new.q_pe, new.kv_c, new.k_pe, new.slot_mapping,
                                     new.k_scale * (1 + seed / 7), new.q_scale], strict=False):
            dst.copy_(src)
        cache.fill_(POISON_A)
        graph.replay()
        ref_cache = torch.full_like(cache, POISON_A)
        ref_q = fused_qk_cache(inputs[0], inputs[1], inputs[2], inputs[3], ref_cache, inputs[4],
                               inputs[5], inputs[6], provider="reference", kv_format=fmt.name)
        valid = inputs[4] >= 0
        assert torch.equal(cache, ref_cache)
        assert torch.equal(q_out.view(torch.uint8)[valid], ref_q.view(torch.uint8)[valid])


def test_rmsnorm_pair_graph_replay_with_new_inputs():
    q, kv, q_w, kv_w = rmsnorm_inputs(256, torch.bfloat16, "cuda", seed=0)
    fused_q_kv_rmsnorm(q, kv, q_w, kv_w, 1e-5, 1e-6, provider="triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outs = fused_q_kv_rmsnorm(q, kv, q_w, kv_w, 1e-5, 1e-6, provider="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (1, 2):
        nq, nkv, _, _ = rmsnorm_inputs(256, torch.bfloat16, "cuda", seed=seed)
        q.copy_(nq)
        kv.copy_(nkv)
        graph.replay()
        assert rmsnorm_problems(outs, reference_pair(q, kv, q_w, kv_w, 1e-5, 1e-6)) == []


def test_aiter_tables_built_before_a_capture_with_no_eager_warm_up_hold_their_values():
    """The AITER provider's identity table and zero positions, built when the layer is built, are
    read correctly by a graph captured before any eager call; a table first asked for inside a
    capture is refused instead of being built there (where its contents would exist only in the
    graph: on an H200 that gave cos = 0)."""
    from k3_amd_overlay.ops import aiter_qk_cache

    device = torch.device("cuda")
    aiter_qk_cache.reserve_identity_table(device, torch.bfloat16, 64)
    aiter_qk_cache.reserve_zero_positions(device, 64)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cos, sin = aiter_qk_cache.identity_rope_table(device, torch.bfloat16, 64)
        positions = aiter_qk_cache.zero_positions(device, 8)
        total = cos[positions].float().sum() + 2 * sin[positions].float().sum() + positions.sum()
    graph.replay()
    torch.cuda.synchronize()
    assert total.item() == 8 * 32
    with pytest.raises(aiter_qk_cache.BuiltInsideCapture):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            aiter_qk_cache.identity_rope_table(device, torch.float16, 64)


def _dummy_run(hook, size):  # named as vLLM's model runner names its own warm-up batches
    hook(size)


def capture_model(graph):  # named as vLLM's model runner names its capture (one of its warm-up methods)
    for _ in range(2):
        graph.replay()


def execute_model(run, *args):  # named as vLLM's worker names the step serving a batch
    return run(*args)


def test_fused_runs_are_told_apart_warm_up_capture_served_and_replayed(tmp_path):
    """On a GPU the evidence hook sees a CUDA-graph capture through the stream's capture state:
    a run inside vLLM's warm-up counts as warm-up, one inside a capture as the captured graph's
    size, an eager one as served. The graph's replays count too (issue 19, fault 4): as replays
    when called for the engine's own batches, as warm-up inside vLLM's capture methods; a graph
    without the fused path is not counted."""
    from k3_amd_overlay.evidence import Evidence
    from k3_amd_overlay.fusions.states import FusionState, LayerDecision
    from k3_amd_overlay.settings import load_settings

    settings = load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "m")})
    evidence = Evidence(settings)
    evidence.note_layer("qk_cache", LayerDecision(FusionState.APPLIED, "triton", "r"))
    hook = evidence.effective_hook("qk_cache", "layer.0")
    x = torch.zeros(8, device="cuda")
    _dummy_run(hook, 8)
    torch.cuda.synchronize()
    graph, other = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hook(8)
        y = x + 1
    with torch.cuda.graph(other):
        z = x + 2
    entry = evidence.fusion("qk_cache")
    assert entry.runs == {"warmup": 1, "capture": 1, "served": 0, "replay": 0}
    capture_model(graph)
    for _ in range(3):
        execute_model(graph.replay)
        execute_model(other.replay)
    execute_model(hook, 5)
    torch.cuda.synchronize()
    assert entry.runs == {"warmup": 3, "capture": 1, "served": 1, "replay": 3} and entry.captured_sizes == [8]
    assert y.sum().item() == 8 and z.sum().item() == 16
    evidence.flush()
    from k3_amd_overlay.commands.verdict import judge

    line = judge([evidence.record], "fused", ["qk_cache"], require_effective=True).lines[-1]
    assert line.startswith("ok   qk_cache: served traffic took the fused path: 3 replays of the 1 graph"), line


def test_a_server_with_graphs_and_no_request_does_not_prove_served_traffic(tmp_path):
    """Capture happens at startup: before any replay for a served batch, ``fused`` does not hold."""
    from k3_amd_overlay.commands.verdict import judge
    from k3_amd_overlay.evidence import Evidence
    from k3_amd_overlay.fusions.states import FusionState, LayerDecision
    from k3_amd_overlay.settings import load_settings

    evidence = Evidence(load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "m")}))
    evidence.note_layer("qk_cache", LayerDecision(FusionState.APPLIED, "triton", "r"))
    hook = evidence.effective_hook("qk_cache", "layer.0")
    x = torch.zeros(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hook(8)
        x.add_(1)
    verdict = judge([evidence.record], "fused", ["qk_cache"], require_effective=True)
    assert not verdict.holds and "captured into 1 graph" in verdict.lines[-1] and "send a request" in verdict.lines[-1]
    graph.replay()  # outside any served step of vLLM's: not served traffic
    verdict = judge([evidence.record], "fused", ["qk_cache"], require_effective=True)
    assert not verdict.holds, verdict.lines
    execute_model(graph.replay)
    verdict = judge([evidence.record], "fused", ["qk_cache"], require_effective=True)
    assert verdict.holds, verdict.lines
