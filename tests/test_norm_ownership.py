"""Whose q/kv norm runs where the overlay's own fused norm does not: vLLM's own ``_normalize_q_kv``,
exactly as with the overlay off (its AITER dual RMSNorm on 0.30+ with AITER on), whether qkv_norm
was refused when the layer was built (a named provider that cannot run here) or its kernel failed
at run time; only stock mode forces the two separate norms. First as plain objects, then on the
real K3 layer of the installed vLLM (0.29 has no fused norm of its own: nothing changes there)."""

from __future__ import annotations

import pytest
import torch
from machine import HAS_VLLM
from test_sites import Norm
from vllm_support import next_layer_index, overlay, shape_name

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.fusions.qkv_norm import UPSTREAM_KEEPS, QkvNormInputs, decide_qkv_norm
from k3_amd_overlay.fusions.states import BucketGate, FusionState, LayerDecision
from k3_amd_overlay.ops import rmsnorm_pair
from k3_amd_overlay.targets.norm import QKV_NORM_SITE, QkvNormSite

if HAS_VLLM:
    import layer_harness as harness
    from test_vllm_layer import aiter_dual_norm_standin  # noqa: F401  (the fixture)

TOKENS = 5
SEQ_LENS = [5, 17, 30, 9]
CANNOT = {"aiter": "needs ROCm/CUDA GPU tensors (got cpu)"}


@pytest.fixture
def no_failed_kernels(monkeypatch):
    monkeypatch.setattr(kernel_failures, "_failed", {})


# --- the decision's reason says whose code runs ---------------------------------------------------

@pytest.mark.parametrize("upstream", [True, False])
def test_a_refused_layer_vllm_fuses_is_kept_by_vllms_own_fused_norm(upstream):
    decision = decide_qkv_norm(QkvNormInputs(False, True, upstream, "aiter", CANNOT))
    refused = "no provider can run here (aiter: needs ROCm/CUDA GPU tensors (got cpu))"
    assert decision == LayerDecision(FusionState.REFUSED, None, refused + (UPSTREAM_KEEPS if upstream else ""))
    assert UPSTREAM_KEEPS == "; vLLM's own fused q/kv norm keeps the layer"
    # stock and a layer without a q norm (vLLM's _normalize_q_kv never runs there) say nothing of it
    assert decide_qkv_norm(QkvNormInputs(True, True, True, "aiter", CANNOT)).reason == \
        "stock mode: two separate RMSNorms"
    assert decide_qkv_norm(QkvNormInputs(False, False, True, "aiter", CANNOT)).reason == \
        "no q norm (q_lora_rank is None)"


# --- the site as a plain object -------------------------------------------------------------------

def _upstream(calls):
    def own(q_c, kv_c):
        calls.append(q_c.shape[0])
        return q_c * 5.0, kv_c * 7.0  # recognisable: vLLM's own method

    return own


def _site(state, callback=None, gate=None):
    q_norm, kv_norm = Norm(24, 1e-6, 2.0), Norm(16, 1e-6, 3.0)
    counted, failures = [], []
    site = QkvNormSite(LayerDecision(state, "reference", "why"), callback, counted.append,
                       on_failure=lambda fusion, why: failures.append((fusion, why)), gate=gate)
    return site, q_norm, kv_norm, counted, failures


def _raises(q_c, kv_c):
    raise RuntimeError("planted: the fused launch fails")


@pytest.mark.parametrize("case", ["refused", "failed", "gated"])
def test_where_the_overlays_norm_does_not_run_vllms_own_method_does(case, no_failed_kernels):
    """Refused, failed at run time, or a batch the self-measurement sends to stock: vLLM's own
    ``_normalize_q_kv`` runs (not the two norm modules behind its back), and is not counted fused."""
    state = FusionState.REFUSED if case == "refused" else FusionState.APPLIED
    callback = {"refused": None, "failed": _raises, "gated": lambda q, kv: ("fused",)}[case]
    gate = BucketGate(((TOKENS - 1, None),)) if case == "gated" else None  # fuses up to 4 tokens only
    site, q_norm, kv_norm, counted, failures = _site(state, callback, gate)
    q_c, kv_c = torch.randn(TOKENS, 24), torch.randn(TOKENS, 16)
    own = []
    for _ in range(2):  # a failed kernel: this batch and the next
        q_out, kv_out = site.normalize(q_norm, kv_norm, _upstream(own), q_c, kv_c)
        assert torch.equal(q_out, q_c * 5.0) and torch.equal(kv_out, kv_c * 7.0)
    assert own == [TOKENS, TOKENS] and counted == []
    assert [f for f, _ in failures] == (["qkv_norm"] if case == "failed" else [])


def test_stock_mode_still_runs_the_two_separate_norms():
    site, q_norm, kv_norm, counted, _ = _site(FusionState.FORCED_STOCK)
    q_c, kv_c = torch.randn(TOKENS, 24), torch.randn(TOKENS, 16)
    own = []
    q_out, kv_out = site.normalize(q_norm, kv_norm, _upstream(own), q_c, kv_c)
    assert torch.equal(q_out, q_c * 2.0) and torch.equal(kv_out, kv_c * 3.0) and own == [] and counted == []


# --- the real K3 layer of the installed vLLM ------------------------------------------------------

def _count_norm_modules(layer):
    """Calls of the layer's two RMSNorm modules (vLLM's fused op bypasses them)."""
    calls = []
    for norm in (layer.wrapper.q_a_layernorm, layer.wrapper.kv_a_layernorm):
        norm.register_forward_hook(lambda module, args, out: calls.append(1))
    return calls


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm_layer_session", "no_failed_kernels")
@pytest.mark.parametrize("case", ["refused", "failed", "stock"])
def test_vllms_own_norm_runs_where_the_overlays_does_not(case, aiter_dual_norm_standin, tmp_path,
                                                         monkeypatch):
    """With AITER on (vLLM 0.30+ then fuses the two norms itself): a named provider that cannot run
    here, or a fused kernel that fails at run time, leaves vLLM's own dual RMSNorm running, output
    for output the overlay-off layer's; stock mode runs the two separate norms."""
    fuses = shape_name() != "plain_wrapper"  # 0.30+: vLLM's K3 wrapper has its own dual norm
    spec = harness.LayerSpec(kv_cache_dtype="auto", gate=False)  # the gate would import AITER's sigmoid-mul
    off = harness.build_layer(spec, next_layer_index(), seed=3)
    off_norms = _count_norm_modules(off)
    switch, provider = ("stock", "auto") if case == "stock" else ("qkv_norm", "aiter" if case == "refused" else
                                                                  "reference")
    with overlay(tmp_path, K3_AMD_OVERLAY=switch, K3_AMD_OVERLAY_QKV_NORM_PROVIDER=provider) as activation:
        on = harness.build_layer(spec, next_layer_index(), seed=3)
        built = vars(on.wrapper)[QKV_NORM_SITE].decision
        on_norms = _count_norm_modules(on)
        if case == "failed":
            assert built.state is FusionState.APPLIED, built

            def planted(*args, **kwargs):
                raise RuntimeError("planted: the fused launch fails")

            monkeypatch.setattr(rmsnorm_pair, "run_provider", planted)
        batch = harness.decode_batch([off, on], SEQ_LENS)
        aiter_dual_norm_standin.clear()
        out_on = harness.run(on, batch)
        on_dual = len(aiter_dual_norm_standin)
        entry = activation.evidence.fusion("qkv_norm")
        if case == "refused":
            assert (entry.state, built.reason.endswith(UPSTREAM_KEEPS)) == (FusionState.REFUSED, fuses), entry
        elif case == "failed":
            assert entry.state is FusionState.REFUSED and "planted" in entry.reason, entry
            assert kernel_failures.failed() == frozenset({"qkv_norm"})
        else:
            assert entry.state is FusionState.FORCED_STOCK, entry
        assert entry.effective is False  # nothing of the overlay's fused
    aiter_dual_norm_standin.clear()
    out_off = harness.run(off, batch)
    off_dual = len(aiter_dual_norm_standin)
    assert (off_dual, len(off_norms)) == ((1, 0) if fuses else (0, 2))
    if case == "stock":  # the A/B baseline: the two separate norms, vLLM's own fusion off
        assert (on_dual, len(on_norms)) == (0, 2)
        if fuses:
            off.wrapper._use_eager_qk_rmsnorm_fusion = False
            out_off = harness.run(off, batch)
    else:  # vLLM's own code, as with the overlay off
        assert (on_dual, len(on_norms)) == (off_dual, len(off_norms))
    assert torch.equal(out_on, out_off)
