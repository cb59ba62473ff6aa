"""Realistic faults that the rest of the suite once let through, one test each (each fails with its
fault planted, passes on the code): the check's verdicts, the decode predicate and its per-batch
choice, the norm callback, the per-layer readings, the older shapes' seams, the AITER call, the
activation lifecycle, markers and the census."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from machine import HAS_VLLM
from records import judge
from vllm_support import run_vllm_process

from k3_amd_overlay import markers
from k3_amd_overlay.commands import census
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fusions import qk_cache as qk
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.ops.reference import rmsnorm_reference
from k3_amd_overlay.package import ABSORB_MAX_TOKENS, __version__
from k3_amd_overlay.settings import load_settings
from k3_amd_overlay.targets import attend_hook, decode, installer
from k3_amd_overlay.targets.norm import QKV_NORM_SITE, QkvNormCallback, QkvNormSite

APPLIED = LayerDecision(FusionState.APPLIED, "reference", "")


def entry(state, served=0, warmup=0, effective=None, layers=2):
    effective = bool(served or warmup) if effective is None else effective
    return {"state": state, "provider": "reference", "reason": "r", "layers": layers, "effective": effective,
            "runs": {"warmup": warmup, "capture": 0, "served": served}, "captured_sizes": []}


def record(mode, **fusions):
    return {"pid": 7, "role": "worker", "vllm_version": "0.33.0", "mode": mode, "overlay_version": __version__,
            "fusions": fusions}


# --- verdict.py ------------------------------------------------------------------------------

def test_fused_needs_each_fusion_to_have_served_not_one_of_them():
    rec = record("auto", qkv_norm=entry("applied", served=3), qk_cache=entry("applied"))
    verdict = judge([rec], "fused", None, require_effective=True)
    assert not verdict.holds
    assert any(line.startswith("FAIL qk_cache: no process has run its fused path yet") for line in verdict.lines)


def test_stock_fails_where_a_fused_path_ran_even_in_stock_mode():
    rec = record("stock", qkv_norm=entry("forced-stock", served=1), qk_cache=entry("forced-stock"))
    verdict = judge([rec], "stock", None, require_effective=True)
    assert not verdict.holds and any("its fused path ran" in line for line in verdict.lines)


def test_a_refused_fusion_stays_in_the_requested_set():
    rec = record("auto", qkv_norm=entry("applied", served=3), qk_cache=entry("refused"),
                 absorb_qk_cache=entry("disabled"))
    verdict = judge([rec], "fused", None, require_effective=True)
    assert not verdict.holds and any(line.startswith("FAIL") and "qk_cache=refused" in line for line in verdict.lines)


# --- fusions/qk_cache.py: the per-batch half of the predicate --------------------------------

def site(hooks: list) -> decode.DecodeSite:
    return decode.DecodeSite(qk.DecodePlan(APPLIED, APPLIED), lambda n: hooks.append(("qk", n)),
                             lambda n: hooks.append(("absorb", n)))


def fusable(*batch_args) -> bool:
    return qk.batch_fusable(decode.batch_facts(*batch_args))


def batch(tokens, decode=None):
    return SimpleNamespace(num_actual_tokens=tokens, num_decode_tokens=tokens if decode is None else decode)


def test_consulting_the_per_batch_choice_marks_nothing():
    hooks: list = []
    s = site(hooks)
    assert s.path_for(batch(6, decode=3), torch.zeros(6), torch.zeros(4), None) is None
    assert s.path_for(batch(6), torch.zeros(6), torch.zeros(4), None) == "absorb"
    assert hooks == []  # only the fused decode itself records that it ran


def test_absorb_takes_batches_up_to_and_including_its_limit():
    s = site([])
    slots, cache = torch.zeros(ABSORB_MAX_TOKENS + 1), torch.zeros(4)
    assert s.path_for(batch(ABSORB_MAX_TOKENS), slots, cache, None) == "absorb"
    assert s.path_for(batch(ABSORB_MAX_TOKENS + 1), slots, cache, None) == "qk_cache"


def test_no_cache_or_a_replicated_dcp_query_is_never_fused():
    assert not fusable(batch(4), torch.zeros(4), torch.zeros(0), None)
    assert not fusable(batch(4), torch.zeros(4), torch.zeros(4), torch.zeros(4))
    assert fusable(batch(4), torch.zeros(4), torch.zeros(4), None)


def test_decode_site_stands_down_under_fullgraph_tracing(tmp_path):
    hooks: list = []
    s = site(hooks)
    s.context = lambda name: (batch(2), None, torch.zeros(4), torch.zeros(2))
    attn = SimpleNamespace(layer_name="layer.0")

    def stock(q, kv, pe, output_shape=None, q_dcp_replicated=None):
        return q * 2

    traced = torch.compile(lambda q: s.attend(attn, stock, q, q, q, output_shape=(2, 2)), fullgraph=True,
                           backend="eager")
    torch._dynamo.reset()
    try:
        assert torch.equal(traced(torch.ones(2, 2)), torch.full((2, 2), 2.0))
    finally:
        torch._dynamo.reset()
    assert hooks == []


# --- targets/norm.py -----------------------------------------------------------------------

def norms(q_eps=1e-2, kv_eps=1e-6):
    q_norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(64)).to(torch.bfloat16), variance_epsilon=q_eps)
    kv_norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(32)).to(torch.bfloat16), variance_epsilon=kv_eps)
    return q_norm, kv_norm


def test_the_norm_callback_uses_each_norms_own_eps():
    q_norm, kv_norm = norms()
    q_c, kv_c = (torch.randn(5, 64) * 0.05).to(torch.bfloat16), (torch.randn(5, 32) * 0.05).to(torch.bfloat16)
    got_q, got_kv = QkvNormCallback(q_norm, kv_norm, "reference")(q_c, kv_c)
    assert torch.equal(got_q, rmsnorm_reference(q_c, q_norm.weight, 1e-2))
    assert torch.equal(got_kv, rmsnorm_reference(kv_c, kv_norm.weight, 1e-6))


def test_norm_site_stands_down_under_fullgraph_tracing():
    q_norm, kv_norm = norms()
    calls: list = []
    norm_site = QkvNormSite(APPLIED, QkvNormCallback(q_norm, kv_norm, "reference"), calls.append)

    def two_norms(x, w, eps):
        return rmsnorm_reference(x, w, eps)

    q_mod = lambda x: two_norms(x, q_norm.weight, q_norm.variance_epsilon)  # noqa: E731
    kv_mod = lambda x: two_norms(x, kv_norm.weight, kv_norm.variance_epsilon)  # noqa: E731
    traced = torch.compile(lambda a, b: norm_site.normalize(q_mod, kv_mod, None, a, b), fullgraph=True,
                           backend="eager")
    torch._dynamo.reset()
    try:
        traced(torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 32).to(torch.bfloat16))
    finally:
        torch._dynamo.reset()
    assert calls == []


# --- targets/installer.py ----------------------------------------------------------------------

def test_the_absorption_variant_is_read_fp4_first_as_vllm_does():
    both = SimpleNamespace(is_aiter_triton_fp4_bmm_enabled=True, is_aiter_triton_fp8_bmm_enabled=True)
    assert installer.absorb_variant(both) == "fp4"


def test_norm_providers_are_judged_with_both_eps(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(installer.rmsnorm_pair, "provider_missing",
                        lambda device, q_eps, kv_eps: seen.append((q_eps, kv_eps)) or {"reference": None})
    settings = load_settings({"K3_AMD_OVERLAY": "qkv_norm", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path)})
    q_norm, kv_norm = norms(q_eps=1e-5, kv_eps=1e-3)
    wrapper = SimpleNamespace(q_a_layernorm=SimpleNamespace(**vars(q_norm)), kv_a_layernorm=kv_norm,
                              mla_attn=SimpleNamespace(layer_name="layer.0"))
    installer.LayerInstaller(settings, Evidence(settings)).install_qkv_norm(wrapper, upstream_fuses=False)
    assert seen == [(1e-5, 1e-3)]


# --- the older shapes' seams ---------------------------------------------------------------------

def test_the_plain_wrapper_front_end_is_never_taken_with_a_rotary_embedding():
    from k3_amd_overlay.targets.plain_wrapper import k3_wrapper_class

    cls = k3_wrapper_class(type("SharedWrapper", (), {}), None, frozenset())
    layer = SimpleNamespace(q_lora_rank=1536, rotary_emb=None, indexer=None, is_sparse=False, dcp_q_replicate=False)
    layer.__dict__[QKV_NORM_SITE] = QkvNormSite(APPLIED, None, lambda n: None)
    assert cls._k3_front_end(layer) is True
    layer.rotary_emb = object()  # a real rotation: RoPE must run, so the stock forward does
    assert cls._k3_front_end(layer) is False


def test_the_decode_hook_passes_the_dcp_query_to_the_stock_call():
    seen = {}

    class Attention:
        def forward(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
            seen["q_dcp_replicated"] = q_dcp_replicated
            return q

    attn = Attention()
    attend_hook.install(attn, decode.DecodeSite(qk.DecodePlan(APPLIED, APPLIED), lambda n: None, lambda n: None))
    replicated = torch.ones(1)
    attn.forward(torch.zeros(1), torch.zeros(1), torch.zeros(1), output_shape=(1,), q_dcp_replicated=replicated)
    assert seen["q_dcp_replicated"] is replicated


# --- ops/aiter_qk_cache.py: the AITER call's layout -------------------------------------------

def test_aiter_is_asked_for_the_nope_first_layout(monkeypatch, aiter_standin):
    from k3_amd_overlay.fp8 import E4M3FN
    from k3_amd_overlay.ops import aiter_qk_cache

    standin = aiter_standin(fmt=E4M3FN)
    received = []
    original = standin.op
    monkeypatch.setattr(standin, "op", lambda *args: received.append(args[13]) or original(*args))
    t, h = 3, 2
    q_out = torch.empty(t, h, 576, dtype=E4M3FN.dtype)
    cache = torch.zeros(2, 16, 576, dtype=E4M3FN.dtype)
    one = torch.ones(1)
    aiter_qk_cache.run(torch.randn(t, h, 512).bfloat16(), torch.randn(t, h, 64).bfloat16(),
                       torch.randn(t, 512).bfloat16(), torch.randn(t, 64).bfloat16(), cache,
                       torch.tensor([0, 5, 9]), one, one, q_out)
    assert received == [True]


def test_the_aiter_standin_holds_the_layout_argument_to_its_meaning():
    """With is_nope_first=False AITER writes [rope | nope]: the stand-in computes that too, so a
    provider that asked for it would fail every parity test."""
    from aiter_standin import AiterStandIn

    from k3_amd_overlay.fp8 import E4M3FN

    standin = AiterStandIn(fmt=E4M3FN)
    t, h = 2, 1
    nope, rope = torch.full((t, h, 512), 2.0).bfloat16(), torch.full((t, h, 64), -1.0).bfloat16()
    outs = []
    for nope_first in (True, False):
        q_out = torch.empty(t, h, 576, dtype=E4M3FN.dtype)
        standin.op(nope, rope, torch.zeros(t, 512).bfloat16(), torch.zeros(t, 64).bfloat16(),
                   torch.zeros(2, 16, 576, dtype=E4M3FN.dtype), q_out, torch.tensor([0, 1]), torch.ones(1),
                   torch.ones(1), torch.zeros(t, dtype=torch.int64), torch.ones(1, 32).bfloat16(),
                   torch.zeros(1, 32).bfloat16(), True, nope_first)
        outs.append(q_out.float())
    assert outs[0][..., 0].eq(2).all() and outs[1][..., 0].eq(-1).all()


# --- activation.py and plugin.py ----------------------------------------------------------------

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs a real vLLM")


@needs_vllm
@pytest.mark.vllm
def test_strict_mode_stops_startup_for_a_vllm_outside_the_range(tmp_path, monkeypatch):
    from k3_amd_overlay import activation

    monkeypatch.setattr(activation, "installed_vllm_version", lambda: "0.28.0")
    for strict, raises in (("1", True), ("0", False)):
        settings = load_settings({"K3_AMD_OVERLAY": "qk_cache", "K3_AMD_OVERLAY_STRICT": strict,
                                  "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path)})
        try:
            if raises:
                with pytest.raises(activation.OverlayActivationError, match=r"vLLM 0\.28\.0 is outside"):
                    activation.activate(settings)
            else:
                assert activation.activate(settings) is not None
        finally:
            activation.deactivate()


DEACTIVATE_THEN_IMPORT = """
from vllm.plugins import load_general_plugins
load_general_plugins()
import k3_amd_overlay, wrapt
k3_amd_overlay.deactivate()
import vllm.models.kimi_k3.amd.linear as linear
wrapped = [k for k, v in vars(linear).items() if isinstance(v, wrapt.FunctionWrapper)]
mla = sys.modules.get("vllm.models.kimi_k3.amd.mla")
cls = getattr(mla, "KimiK3MultiHeadLatentAttentionWrapper", None)
wrapped += [k for k, v in (vars(cls).items() if cls else []) if isinstance(v, wrapt.FunctionWrapper)]
replaced = getattr(linear, "MultiHeadLatentAttentionWrapper", None)
marker = json.load(open(os.path.join(os.environ["K3_AMD_OVERLAY_MARKER_DIR"], f"{os.getpid()}.json")))
result(wrapped=wrapped, replaced=getattr(replaced, "__name__", None),
       states=sorted({f["state"] for f in marker["fusions"].values()}))
"""
RAY_VARIABLE_AROUND_PLUGIN_LOADING = """
os.environ.pop("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", None)  # as a fresh shell has it (not pytest's)
before = os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY")
from vllm.plugins import load_general_plugins
load_general_plugins()
result(before=before, after=os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"))
"""


@needs_vllm
@pytest.mark.vllm
def test_deactivate_stops_the_hooks_and_says_so_in_the_marker(tmp_path):
    proc, result = run_vllm_process(DEACTIVATE_THEN_IMPORT, tmp_path, K3_AMD_OVERLAY="1")
    assert result is not None, proc.stderr[-3000:]
    assert result["wrapped"] == [] and result["replaced"] != "K3OverlayMLAWrapper"
    assert result["states"] == ["refused"]  # requested, yet neither path of the overlay runs: no verdict holds


@needs_vllm
@pytest.mark.vllm
def test_the_plugin_switched_off_changes_no_environment(tmp_path):
    proc, result = run_vllm_process(RAY_VARIABLE_AROUND_PLUGIN_LOADING, tmp_path, K3_AMD_OVERLAY="0")
    assert result is not None, proc.stderr[-3000:]
    assert result["after"] == result["before"]


# --- markers.py and census.py ------------------------------------------------------------------

def test_a_reused_pid_is_not_alive():
    pid = os.getpid()
    assert markers.is_alive(pid, markers.process_start_ticks(pid))
    assert not markers.is_alive(pid, markers.process_start_ticks(pid) + 1)


def test_a_group_writable_marker_directory_is_refused(tmp_path):
    directory = tmp_path / "m"
    directory.mkdir()
    os.chmod(directory, 0o770)
    with pytest.raises(markers.MarkerDirError, match="writable by group or others"):
        markers.ensure_marker_dir(directory)


def test_the_census_counts_gpu_op_events(tmp_path):
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "gpu_op", "name": "qk_cache_kernel", "ts": 0, "dur": 2.0},
        {"ph": "X", "cat": "kernel", "name": "qk_cache_kernel", "ts": 5, "dur": 3.0},
        {"ph": "X", "cat": "cpu_op", "name": "qk_cache_kernel", "ts": 9, "dur": 9.0},
    ]}))
    assert census.read_census([trace]).matching("qk_cache_kernel").count == 2


def test_a_partly_fused_process_is_not_a_fused_arm_unless_told_so():
    """One layer applied and 23 refused: before, the first layer's state decided and check held."""
    split = entry("applied", served=3)
    split["layer_states"] = {"applied": {"layers": 1, "reason": "triton"}, "refused": {"layers": 23, "reason": "x"}}
    rec = record("auto", qkv_norm=split)
    verdict = judge([rec], "fused", ["qkv_norm"], require_effective=True)
    assert not verdict.holds
    assert any("mixed across layers: applied on 1/24 (triton), refused on 23/24 (x)" in line for line in verdict.lines)
    assert judge([rec], "fused", ["qkv_norm"], require_effective=True, allow_mixed=True).holds
    split["layer_states"] = {"applied": {"layers": 24, "reason": "triton"}}
    assert judge([rec], "fused", ["qkv_norm"], require_effective=True).holds


# --- one guarantee per test (each was caught only inside the big enumeration) -------------------

BASE = dict(stock_mode=False, provider_setting="auto", provider_missing={"aiter": None}, kv_cache_dtype="fp8",
            rotation=qk.Rotation.NONE, dcp_world_size=1, pcp=False, hisparse=False, q_pad_num_heads=None, num_heads=12,
            absorb=qk.AbsorbVariant.BF16, quant_query_input=True, upstream_fuses=False)


@pytest.mark.parametrize("change,reason", [
    ({"dcp_world_size": 2}, "DCP is on (world size 2)"),
    ({"pcp": True}, "PCP is on"),
    ({"hisparse": True}, "HiSparse is on"),
    ({"rotation": qk.Rotation.REAL}, "a real rotary embedding"),
    ({"kv_cache_dtype": "auto"}, "not a plain fp8 cache"),
])
def test_each_static_refusal_on_its_own(change, reason):
    assert qk.decide_qk_cache(qk.QkCacheInputs(**BASE)).state is FusionState.APPLIED
    decision = qk.decide_qk_cache(qk.QkCacheInputs(**{**BASE, **change}))
    assert decision.state is FusionState.REFUSED and reason in decision.reason


@pytest.mark.parametrize("decode,actual,expected", [(4, 4, True), (3, 4, False), (0, 0, False), (0, 4, False)])
def test_only_decode_only_batches_are_fused(decode, actual, expected):
    md = SimpleNamespace(num_decode_tokens=decode, num_actual_tokens=actual)
    assert fusable(md, torch.zeros(actual), torch.zeros(4), None) is expected
    assert not fusable(None, torch.zeros(actual), torch.zeros(4), None)
    assert not fusable(md, None, torch.zeros(4), None)
