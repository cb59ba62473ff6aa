"""The qk_cache predicate and its one site, enumerated over every combination of provider x
kv-cache dtype x rotation x PCP x HiSparse x DCP x batch mix x heads per rank, driving the
overlay's real control flow (LayerInstaller -> DecodeSite.attend -> the real provider) with
recording stand-ins for the vLLM layer: the fused path runs exactly when the predicate says so,
RoPE is applied exactly once wherever a rotation exists, every token's KV is written exactly
once, and AITER is always called with zero positions and an identity table."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fp8 import E4M3FN
from k3_amd_overlay.fusions import qk_cache as qk
from k3_amd_overlay.fusions.qkv_norm import QkvNormInputs, decide_qkv_norm
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.ops.reference import quantize_fp8
from k3_amd_overlay.package import ABSORB_MAX_TOKENS
from k3_amd_overlay.settings import load_settings
from k3_amd_overlay.targets import installer as installer_module
from k3_amd_overlay.targets import vllm_env

L, R, NOPE = 32, 16, 8
PROVIDERS = ["reference", "aiter", "triton"]
KV_DTYPES = ["fp8", "fp8_e4m3", "auto", "bfloat16", "fp8_ds_mla"]
ROTATIONS = ["none", "identity", "real"]
BATCHES = ["decode", "prefill", "mixed", "empty", "no-metadata"]
HEADS = [1, 3, 4, 12, 16]


class Rotary:
    def __init__(self, identity: bool, log: list) -> None:
        self.is_identity = identity
        self.log = log

    def __call__(self, positions, q_pe, k_pe):
        self.log.append("identity" if self.is_identity else "real")
        return q_pe, k_pe


def make_layer(heads, kv_dtype, rotation, pcp, hisparse, dcp, rope_log, stock_writes):
    attn = SimpleNamespace(
        layer_name="model.layers.3.self_attn.attn", kv_cache_dtype=kv_dtype, use_pcp=pcp,
        hisparse_cache=object() if hisparse else None, q_pad_num_heads=None,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=R, kv_lora_rank=L,
        W_UK_T=torch.randn(heads, NOPE, L).to(torch.bfloat16),
        _k_scale=torch.tensor([0.5]), _q_scale=torch.tensor([1.25]),
        impl=SimpleNamespace(dcp_world_size=dcp, supports_quant_query_input=True),
        is_aiter_triton_fp4_bmm_enabled=False, is_aiter_triton_fp8_bmm_enabled=False,
    )
    attn.queries = []  # what the fused path hands the MQA kernel

    def forward_mqa(q, cache, md, layer):
        attn.queries.append(q.clone())
        return torch.zeros(q.shape[0], heads, L, dtype=torch.bfloat16), None

    attn.impl.forward_mqa = forward_mqa
    attn._v_up_proj = lambda x, out: out.zero_()
    rotary = None if rotation == "none" else Rotary(rotation == "identity", rope_log)
    wrapper = SimpleNamespace(
        mla_attn=attn, num_heads=heads, rotary_emb=rotary,
        kv_a_layernorm=SimpleNamespace(weight=torch.ones(L)),
    )

    def stock(q, kv_c, k_pe, output_shape=None, q_dcp_replicated=None):
        stock_writes.append("stock")
        if getattr(attn, "stock_kv_write", None):  # the stock path writes the KV rows itself
            attn.stock_kv_write(kv_c, k_pe)
        return torch.zeros(output_shape)

    return wrapper, attn, stock


def metadata(kind, tokens):
    if kind == "no-metadata":
        return None
    decode = {"decode": tokens, "prefill": 0, "mixed": tokens // 2, "empty": 0}[kind]
    return SimpleNamespace(num_actual_tokens=tokens, num_decode_tokens=decode)


def write_rows(cache, kv_c, k_pe, slots, k_scale):
    """What the stock KV write stores: fp8([kv_c | k_pe] / k_scale) at each valid slot."""
    valid = slots >= 0
    rows = quantize_fp8(torch.cat([kv_c, k_pe.reshape(kv_c.shape[0], R)], dim=-1)[valid], k_scale, E4M3FN)
    flat = cache.view(-1, L + R)
    flat[slots[valid]] = rows.view(torch.uint8)


def expected_cache(kv_c, k_pe, slots, k_scale):
    want = torch.zeros(4, 8, L + R, dtype=torch.uint8)
    write_rows(want, kv_c, k_pe, slots, k_scale)
    return want


COMBOS = list(itertools.product(PROVIDERS, KV_DTYPES, ROTATIONS, [False, True], [False, True],
                                [1, 2], BATCHES, HEADS))


@pytest.fixture
def standin(aiter_standin):
    return aiter_standin(fmt=E4M3FN)


def inputs(**changes) -> qk.QkCacheInputs:
    """The static inputs of a layer the overlay fuses, with ``changes``."""
    base = dict(stock_mode=False, provider_setting="auto", provider_missing={"aiter": None}, kv_cache_dtype="fp8",
                rotation=qk.Rotation.NONE, dcp_world_size=1, pcp=False, hisparse=False, q_pad_num_heads=None,
                num_heads=3, absorb=qk.AbsorbVariant.BF16, quant_query_input=True, upstream_fuses=False)
    return qk.QkCacheInputs(**{**base, **changes})


def execute_model(run, *args, **kwargs):  # named as vLLM's worker names the step serving a batch
    return run(*args, **kwargs)


def test_every_combination_runs_rope_once_writes_kv_once_and_fuses_exactly_when_decided(
        standin, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_env, "vllm_fp8_format", lambda: E4M3FN)
    monkeypatch.setattr(vllm_env, "vllm_aiter_missing", lambda: None)  # a ROCm process with AITER on
    fused_count = 0
    for provider, kv_dtype, rotation, pcp, hisparse, dcp, batch_kind, heads in COMBOS:
        if provider == "triton" and not (kv_dtype == "fp8" and batch_kind == "decode" and heads in (1, 12)):
            continue  # the interpreter is slow: Triton covers the fused cases only, at two head counts
        settings = load_settings({"K3_AMD_OVERLAY": "qk_cache", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": provider,
                                  "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path)})
        installer = installer_module.LayerInstaller(settings, Evidence(settings))
        rope_log, stock_writes = [], []
        wrapper, attn, stock = make_layer(heads, kv_dtype, rotation, pcp, hisparse, dcp, rope_log, stock_writes)
        site = installer.install_qk_cache(wrapper, upstream_fuses=False)
        tokens = 0 if batch_kind == "empty" else 6
        md = metadata(batch_kind, tokens)
        cache = torch.zeros(4, 8, L + R, dtype=torch.uint8)
        slots = torch.tensor([3, -1, 17, 9, 30, 22][:tokens], dtype=torch.int64)
        site.context = lambda name, md=md, cache=cache, slots=slots: (md, attn, cache, slots)
        attn.stock_kv_write = lambda kv_c, k_pe, cache=cache, slots=slots: write_rows(cache, kv_c, k_pe, slots,
                                                                                      attn._k_scale)
        standin.calls.clear()
        # the wrapper's own steps, as vLLM runs them: the rotation (if any), then the attention call
        q = torch.randn(tokens, heads, NOPE + R).to(torch.bfloat16)
        kv_c = torch.randn(tokens, L).to(torch.bfloat16)
        k_pe = torch.randn(tokens, 1, R).to(torch.bfloat16)
        if wrapper.rotary_emb is not None:
            q[..., NOPE:], k_pe = wrapper.rotary_emb(None, q[..., NOPE:], k_pe)
        execute_model(site.attend, attn, stock, q, kv_c, k_pe, output_shape=(tokens, heads * 4),
                      q_dcp_replicated=torch.zeros(1) if dcp > 1 else None)

        combo = (provider, kv_dtype, rotation, pcp, hisparse, dcp, batch_kind, heads)
        fusable_static = (kv_dtype in ("fp8", "fp8_e4m3") and rotation != "real" and not pcp
                          and not hisparse and dcp == 1)
        assert site.plan.decision.fused == fusable_static, combo
        expect_fused = fusable_static and batch_kind == "decode"
        fused = not stock_writes
        assert fused == expect_fused, combo
        fused_count += fused
        # every token's KV exactly once, in its own slot, with its own value: by the stock attention
        # call (which writes it itself) or by the fused provider, never both, never neither
        assert stock_writes == ([] if fused else ["stock"]), combo
        want = expected_cache(kv_c, k_pe, slots, attn._k_scale)
        assert torch.equal(cache, want), combo
        # the query the MQA kernel got: [ql_nope | q_pe] quantised once with q_scale, fused path only
        if fused:
            ql_nope = torch.bmm(q[..., :NOPE].transpose(0, 1), attn.W_UK_T).transpose(0, 1)
            want_q = quantize_fp8(torch.cat([ql_nope, q[..., NOPE:]], dim=-1), attn._q_scale, E4M3FN)
            rows = slots >= 0  # AITER writes the query of tokens with a slot only (padding rows have none)
            assert torch.equal(attn.queries[0].view(torch.uint8)[rows], want_q.view(torch.uint8)[rows]), combo
        assert len(attn.queries) == int(fused), combo
        # and the evidence says whether the fused path ran, on which batches
        entry = installer.evidence.fusion("qk_cache")
        assert (entry.effective, entry.runs["served"]) == (fused, int(fused)), combo
        # RoPE exactly once where a rotation exists, never a real one inside the fused path
        assert rope_log == ([] if rotation == "none" else [rotation]), combo
        if provider == "aiter" and fused:
            assert len(standin.calls) == 1 and standin.calls[0]["identity"], combo
            assert standin.calls[0]["positions_max"] == 0, combo
        else:
            assert standin.calls == [], combo
    assert fused_count == 44  # (reference, aiter) x 2 fp8 dtypes x 2 rotations x 5 head counts + 4 Triton


@pytest.mark.parametrize("upstream,setting,stock,state", [
    (True, "auto", False, FusionState.UPSTREAM), (True, "triton", False, FusionState.APPLIED),
    (False, "auto", False, FusionState.APPLIED), (True, "auto", True, FusionState.FORCED_STOCK),
])
def test_qk_cache_ownership(upstream, setting, stock, state):
    layer = inputs(stock_mode=stock, provider_setting=setting,
                   provider_missing={"aiter": "no", "triton": None, "reference": None}, upstream_fuses=upstream)
    assert qk.decide_qk_cache(layer).state is state


@pytest.mark.parametrize("absorb,fused", [("bf16", True), ("fp8", True), ("fp4", True), ("amx", False)])
def test_absorption_variants(absorb, fused):
    assert qk.decide_qk_cache(inputs(absorb=qk.AbsorbVariant(absorb))).fused is fused


def test_head_padding_and_quant_query_are_refused_with_reasons():
    padded = qk.decide_qk_cache(inputs(num_heads=12, q_pad_num_heads=16))
    assert padded.state is FusionState.REFUSED and "padded to 16" in padded.reason
    no_fp8_q = qk.decide_qk_cache(inputs(num_heads=12, quant_query_input=False))
    assert no_fp8_q.state is FusionState.REFUSED and "fp8 query" in no_fp8_q.reason


@pytest.mark.parametrize("absorb,qk_state,setting,missing,state", [
    ("bf16", FusionState.APPLIED, "auto", {"triton": None}, FusionState.APPLIED),
    ("bf16", FusionState.UPSTREAM, "auto", {"triton": None}, FusionState.DISABLED),  # defer to vLLM's own
    ("bf16", FusionState.UPSTREAM, "triton", {"triton": None}, FusionState.APPLIED),  # named: override
    ("fp8", FusionState.APPLIED, "auto", {"triton": None}, FusionState.APPLIED),  # vLLM's fp8 BMM, folded
    ("fp8", FusionState.APPLIED, "aiter", {"triton": None, "aiter": None}, FusionState.APPLIED),
    ("fp4", FusionState.APPLIED, "auto", {"triton": None}, FusionState.APPLIED),  # vLLM's MXFP4 BMM, folded
    ("fp4", FusionState.APPLIED, "aiter", {"triton": None, "aiter": "no gfx950"}, FusionState.REFUSED),
    ("amx", FusionState.APPLIED, "auto", {"triton": None}, FusionState.REFUSED),
    ("bf16", FusionState.APPLIED, "auto", {"triton": "no GPU"}, FusionState.REFUSED),
])
def test_absorb_decisions(absorb, qk_state, setting, missing, state):
    layer = inputs(provider_missing={}, num_heads=12, absorb=qk.AbsorbVariant(absorb))
    decision = qk.decide_absorb(layer, qk.LayerDecision(qk_state, None, ""), setting, missing)
    assert decision.state is state, decision.reason
    if absorb in ("fp8", "fp4") and state is FusionState.APPLIED:
        assert f"{absorb} W_UK" in decision.reason
    if absorb == "amx":
        assert decision.reason == "the amx W_UK absorption is not reproduced"


@pytest.mark.parametrize("stock,has_q,upstream,setting,missing,state,provider", [
    (True, True, True, "auto", {}, FusionState.FORCED_STOCK, None),
    (False, False, False, "auto", {}, FusionState.REFUSED, None),
    (False, True, True, "auto", {}, FusionState.UPSTREAM, "aiter"),
    (False, True, True, "triton", {"triton": None}, FusionState.APPLIED, "triton"),
    (False, True, False, "auto", {"aiter": "x", "triton": None, "vllm": None}, FusionState.APPLIED, "triton"),
    (False, True, False, "auto", {"aiter": "x", "triton": "y", "vllm": None}, FusionState.APPLIED, "vllm"),
    (False, True, False, "auto", {"aiter": "x", "triton": "y", "vllm": "z"}, FusionState.REFUSED, None),
])
def test_qkv_norm_decisions(stock, has_q, upstream, setting, missing, state, provider):
    decision = decide_qkv_norm(QkvNormInputs(stock, has_q, upstream, setting, missing))
    assert (decision.state, decision.provider) == (state, provider)


def _plan(qk_state, absorb_state, upstream):
    decision = qk.LayerDecision
    return qk.DecodePlan(decision(qk_state, None, ""), decision(absorb_state, None, ""), upstream_fuses=upstream)


@pytest.mark.parametrize("qk_state,absorb_state,upstream,keeps,branch_on", [
    # absorb_qk_cache alone, refused (no provider): vLLM's own fused decode stays on
    (FusionState.DISABLED, FusionState.REFUSED, True, True, True),
    # absorb_qk_cache alone, applied: vLLM keeps every batch the absorbed launch does not take
    (FusionState.DISABLED, FusionState.APPLIED, True, True, True),
    # qk_cache named but refused where vLLM fuses: vLLM keeps it
    (FusionState.REFUSED, FusionState.DISABLED, True, True, True),
    (FusionState.UPSTREAM, FusionState.DISABLED, True, True, True),
    # stock mode: everything off
    (FusionState.FORCED_STOCK, FusionState.FORCED_STOCK, True, False, False),
    # vLLM does not fuse the layer: the branch is on only where the overlay fuses
    (FusionState.DISABLED, FusionState.APPLIED, False, False, True),
    (FusionState.REFUSED, FusionState.REFUSED, False, False, False),
])
def test_fused_decode_branch_follows_vllm_where_the_overlay_does_not_act(qk_state, absorb_state, upstream, keeps,
                                                                        branch_on):
    plan = _plan(qk_state, absorb_state, upstream)
    assert (plan.upstream_keeps, plan.fused_decode_on) == (keeps, branch_on)


def test_a_layer_vllm_fuses_stays_vllms_in_auto_mode_whatever_the_overlay_would_refuse():
    layer = inputs(num_heads=4, absorb=qk.AbsorbVariant.FP8, quant_query_input=False, upstream_fuses=True)
    assert qk.decide_qk_cache(layer).state is FusionState.UPSTREAM
    named = qk.decide_qk_cache(inputs(provider_setting="triton", provider_missing={"triton": None}, num_heads=4,
                                      quant_query_input=False, upstream_fuses=True))
    assert named.state is FusionState.REFUSED and named.reason.endswith("vLLM's own fused decode keeps the layer")


def test_fp8_query_is_a_view_of_the_backends_padded_buffer(tmp_path, monkeypatch):
    """Where the backend pads query heads (AITER MLA to 16) the fused path allocates the padded
    buffer and hands the backend a view of it: the backend's zero-copy branch, not 1-4 copies per
    layer per step. The values in the real heads are the same as with an unpadded buffer."""
    monkeypatch.setattr(vllm_env, "vllm_fp8_format", lambda: E4M3FN)
    seen = {}
    for padded in (0, 16):
        settings = load_settings({"K3_AMD_OVERLAY": "qk_cache", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "reference",
                                  "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path)})
        installer = installer_module.LayerInstaller(settings, Evidence(settings))
        torch.manual_seed(0)  # the same W_UK_T for both layers
        wrapper, attn, stock = make_layer(3, "fp8", "none", False, False, 1, [], [])
        site = installer.install_qk_cache(wrapper, upstream_fuses=False)
        site.query_heads = padded
        queries = []
        def forward_mqa(q, cache, md, layer, queries=queries):
            queries.append(q)
            return torch.zeros(q.shape[0], 3, L), None

        attn.impl.forward_mqa = forward_mqa
        md, cache = metadata("decode", 4), torch.zeros(4, 8, L + R, dtype=torch.uint8)
        slots = torch.tensor([3, 9, 17, 30])
        site.context = lambda name, md=md, cache=cache, slots=slots: (md, attn, cache, slots)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(4, 3, NOPE + R, generator=gen).to(torch.bfloat16)
        kv_c, k_pe = torch.randn(4, L, generator=gen).to(torch.bfloat16), torch.randn(4, 1, R, generator=gen)
        site.attend(attn, stock, q, kv_c, k_pe.to(torch.bfloat16), output_shape=(4, 12))
        seen[padded] = queries[0]
    assert seen[0].is_contiguous() and tuple(seen[0].shape) == (4, 3, L + R)
    assert tuple(seen[16].shape) == (4, 3, L + R) and seen[16].stride(0) == 16 * (L + R)
    assert torch.equal(seen[16].view(torch.uint8), seen[0].view(torch.uint8))


def test_qkv_norm_under_whole_model_compilation_and_its_reasons():
    """Compiled whole, a layer keeps vLLM's own norm fusion where vLLM fuses, and is refused (with
    the reason) where only the overlay would; stock and a missing q norm say why, word for word."""
    from k3_amd_overlay.fusions.states import TRACED_WHOLE

    def decide(**changes):
        base = dict(stock_mode=False, has_q_norm=True, upstream_fuses=False, provider_setting="auto",
                    provider_missing={"triton": None})
        return decide_qkv_norm(QkvNormInputs(**{**base, **changes}))

    assert decide(traced_whole=True, upstream_fuses=True).state is FusionState.UPSTREAM
    refused = decide(traced_whole=True)
    assert (refused.state, refused.reason) == (FusionState.REFUSED, TRACED_WHOLE)
    assert decide().state is FusionState.APPLIED and QkvNormInputs(False, True, False, "auto", {}).traced_whole is False
    assert decide(stock_mode=True).reason == "stock mode: two separate RMSNorms"
    assert decide(has_q_norm=False).reason == "no q norm (q_lora_rank is None)"
    with pytest.raises(AttributeError):
        QkvNormInputs(False, True, False, "auto", {}).stock_mode = True  # frozen


@pytest.mark.parametrize("changes,reason", [
    (dict(kv_cache_dtype="auto"), "kv cache dtype 'auto' is not a plain fp8 cache (['fp8', 'fp8_e4m3'])"),
    (dict(rotation=qk.Rotation.REAL), "a real rotary embedding: the fused path does not rotate"),
    (dict(dcp_world_size=2), "DCP is on (world size 2)"),
    (dict(pcp=True), "PCP is on (the latent all-gather must run)"),
    (dict(hisparse=True), "HiSparse is on (its cursor and remapped slots must run)"),
    (dict(q_pad_num_heads=16), "query heads are padded to 16"),
    (dict(num_heads=0), "0 heads per rank"),
    (dict(absorb=qk.AbsorbVariant.AMX), "the amx W_UK absorption is not reproduced"),
    (dict(quant_query_input=False), "the attention backend does not take an fp8 query"),
    (dict(traced_whole=True), qk.TRACED_WHOLE),
    (dict(activation_dtype="float16", absorb=qk.AbsorbVariant.FP8),
     "fp16 activations with the fp8 W_UK BMM: its GEMM returns bf16 ql_nope, which the fused path would round to fp16"),
    (dict(activation_dtype="float16", absorb=qk.AbsorbVariant.FP4),
     "fp16 activations with the fp4 W_UK BMM: its GEMM returns bf16 ql_nope, which the fused path would round to fp16"),
])
def test_every_refusal_reason_word_for_word(changes, reason):
    """What the marker, the log and `check` print for each refused layer, for both decode fusions;
    where vLLM's own fused decode takes the layer, the reason says it keeps it."""
    layer = inputs(**changes)
    for decision in (qk.decide_qk_cache(layer), qk.decide_absorb(layer, qk.decide_qk_cache(layer), "auto", {})):
        assert (decision.state, decision.provider, decision.reason) == (FusionState.REFUSED, None, reason)
    upstream = inputs(**changes, upstream_fuses=True, provider_setting="triton")
    assert qk.decide_qk_cache(upstream).reason == reason + "; vLLM's own fused decode keeps the layer"


def test_fp16_activations_are_refused_only_with_the_quantised_absorptions():
    """Issue 19: fp16 layers with the bf16 W_UK_T keep fusing (stock's bmm returns fp16 there too)."""
    assert qk.decide_qk_cache(inputs(activation_dtype="float16")).state is FusionState.APPLIED
    assert qk.decide_qk_cache(inputs(absorb=qk.AbsorbVariant.FP8)).state is FusionState.APPLIED


def test_every_decode_decision_word_for_word():
    """The decisions that are not refusals, their providers and reasons, and the plain values
    markers and enums carry (the enums' values are the marker's words)."""
    assert [r.value for r in qk.Rotation] == ["none", "identity", "real"]
    assert [v.value for v in qk.AbsorbVariant] == ["bf16", "fp8", "fp4", "amx"]
    assert qk.FOLDED_ABSORPTIONS == {qk.AbsorbVariant.BF16, qk.AbsorbVariant.FP8, qk.AbsorbVariant.FP4}
    assert (qk.DecodePath.ABSORB.value, qk.DecodePath.QK_CACHE.value) == ("absorb", "qk_cache")
    assert qk.decide_qk_cache(inputs(stock_mode=True)) == qk.LayerDecision(
        FusionState.FORCED_STOCK, None, "stock mode: three launches")
    assert qk.decide_qk_cache(inputs(upstream_fuses=True)) == qk.LayerDecision(
        FusionState.UPSTREAM, "aiter", "vLLM's own fused decode takes this layer")
    assert qk.decide_qk_cache(inputs(num_heads=12, absorb=qk.AbsorbVariant.FP8)) == qk.LayerDecision(
        FusionState.APPLIED, "aiter", "aiter: first available fused provider; 12 heads, fp8 absorption")
    # an applied decision where vLLM would fuse too is not a refusal: no "keeps" suffix
    named = qk.decide_qk_cache(inputs(upstream_fuses=True, provider_setting="aiter"))
    assert named.reason == "aiter: forced by setting; 3 heads, bf16 absorption"
    layer = inputs(num_heads=16, absorb=qk.AbsorbVariant.FP4)
    qk_decision = qk.decide_qk_cache(layer)
    assert qk.decide_absorb(inputs(stock_mode=True), qk_decision, "auto", {}) == qk.LayerDecision(
        FusionState.FORCED_STOCK, None, "stock mode: the absorption is its own launch")
    assert qk.decide_absorb(layer, qk_decision, "auto", {"triton": None}) == qk.LayerDecision(
        FusionState.APPLIED, "triton",
        f"triton: first available fused provider; decode batches of <= {ABSORB_MAX_TOKENS} tokens, 16 heads, fp4 W_UK")
    upstream = qk.LayerDecision(FusionState.UPSTREAM, "aiter", "")
    assert qk.decide_absorb(layer, upstream, "auto", {"triton": None}) == qk.LayerDecision(
        FusionState.DISABLED, None,
        "deferred: vLLM's own fused decode owns this layer (it keeps its own absorption)")
    assert inputs().traced_whole is False
    plan = qk.DecodePlan(qk_decision, qk_decision)
    assert (plan.absorb, plan.upstream_fuses) == (qk.AbsorbVariant.BF16, False)


@pytest.mark.parametrize("tokens,decode,has_cache,replicated,fusable", [
    (1, 1, True, False, True),
    (4, 4, True, False, True),
    (0, 0, True, False, False),  # empty
    (4, 3, True, False, False),  # a prefill row
    (4, 4, False, False, False),  # no cache: a profile or dummy run
    (4, 4, True, True, False),  # DCP-replicated query
])
def test_the_per_batch_half(tokens, decode, has_cache, replicated, fusable):
    """A one-token decode batch is fusable (the smallest), a batch with no tokens or one prefill row
    is not; nor one without a cache or with a replicated query; no metadata at all is not."""
    assert qk.batch_fusable(qk.BatchFacts(tokens, decode, has_cache, replicated)) is fusable
    assert qk.batch_fusable(None) is False


def test_the_shared_decision_vocabulary_word_for_word():
    """fusions/states.py: the states' words (the marker's), which of them fuse, the traced-whole
    reason, and choose_provider's every answer (fusions/states.py mutants survived here)."""
    from k3_amd_overlay.fusions import states

    assert [s.value for s in FusionState] == ["pending", "applied", "upstream", "forced-stock", "refused",
                                              "disabled"]
    assert states.FUSED_STATE_VALUES == {"applied", "upstream"}
    assert [states.LayerDecision(s, None, "").fused for s in FusionState] == [False, True, True, False, False,
                                                                             False]
    assert states.TRACED_WHOLE == ("vLLM compiles the whole model (STOCK_TORCH_COMPILE, fullgraph=True): the "
                                   "overlay's sites stand down under tracing, so the compiled graph holds the "
                                   "stock path")
    choose = states.choose_provider
    assert choose(("aiter", "triton"), "auto", {"aiter": "no ROCm", "triton": None}) == states.LayerDecision(
        FusionState.APPLIED, "triton", "triton: first available fused provider")
    assert choose(("aiter", "triton"), "aiter", {"aiter": None}, "3 heads").reason == \
        "aiter: forced by setting; 3 heads"
    assert choose(("aiter", "triton"), "auto", {"aiter": "no ROCm", "triton": "no GPU"}) == states.LayerDecision(
        FusionState.REFUSED, None, "no provider can run here (aiter: no ROCm; triton: no GPU)")
    # a provider the table does not know of is never taken
    assert choose(("aiter",), "vllm", {}).reason == "no provider can run here (vllm: None)"


def test_the_decision_inputs_cannot_change_once_read():
    """What the predicate decided on is what the marker says: the inputs are frozen."""
    import dataclasses

    layer = inputs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.kv_cache_dtype = "auto"  # type: ignore[misc]


def test_a_layer_decision_cannot_change_once_made():
    import dataclasses

    decision = qk.LayerDecision(FusionState.APPLIED, "triton", "ok")
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.state = FusionState.REFUSED  # type: ignore[misc]


def test_every_decision_and_its_inputs_are_frozen():
    """A decision read by several sites (and the marker) can never be changed by one of them."""
    import dataclasses

    from k3_amd_overlay.fusions import qk_cache as qk_cache_fusion
    from k3_amd_overlay.fusions import qkv_norm as qkv_norm_fusion
    from k3_amd_overlay.fusions import states

    for cls in (qk_cache_fusion.QkCacheInputs, qk_cache_fusion.BatchFacts, qk_cache_fusion.DecodePlan,
                qkv_norm_fusion.QkvNormInputs, states.LayerDecision):
        assert cls.__dataclass_params__.frozen, cls.__name__
    plan = qk_cache_fusion.DecodePlan(states.LayerDecision(FusionState.DISABLED, None, "x"),
                                      states.LayerDecision(FusionState.DISABLED, None, "x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.upstream_fuses = True


def test_vllms_own_dual_norm_decision_word_for_word():
    assert decide_qkv_norm(QkvNormInputs(False, True, True, "auto", {})) == LayerDecision(
        FusionState.UPSTREAM, "aiter", "vLLM's AITER dual RMSNorm is on")


def _gated_plan(absorb_state=FusionState.APPLIED, qk_state=FusionState.APPLIED, measured=None):
    return qk.DecodePlan(LayerDecision(qk_state, "triton", ""), LayerDecision(absorb_state, "triton", ""),
                         measured=measured)


def _decode(tokens):
    return qk.BatchFacts(tokens, tokens, True, False)


SLOWER = "stock at 129-256 tokens: 0.93x of stock on this GPU"
ABOVE = "stock above 256 tokens: not measured on this GPU"


def test_the_measured_gate_sends_a_slower_bucket_and_counts_above_the_largest_to_stock():
    """With a self-measurement (measured.py), the decode plan takes a fused launch only in the buckets
    where it measured exact and at least as fast; a slower bucket and any count above the largest
    bucket run stock, with the reason as the marker shows it."""
    from k3_amd_overlay.fusions.states import BucketGate
    from k3_amd_overlay.package import ABSORB_QK_CACHE, QK_CACHE

    gates = {QK_CACHE: BucketGate(((8, None), (128, None), (256, SLOWER)), ABOVE),
             ABSORB_QK_CACHE: BucketGate(((8, None), (64, "stock at 9-64 tokens: 0.97x of stock on this GPU")),
                                         "stock above 64 tokens: not measured on this GPU")}
    plan = _gated_plan(measured=gates)
    assert [plan.path_for(_decode(t)) for t in (1, 8, 9, 64, 65, 128, 129, 256, 257)] == [
        qk.DecodePath.ABSORB, qk.DecodePath.ABSORB,  # the absorbed launch where it measured faster
        qk.DecodePath.QK_CACHE, qk.DecodePath.QK_CACHE,  # refused there, qk_cache's launch measured faster
        qk.DecodePath.QK_CACHE, qk.DecodePath.QK_CACHE,
        None, None, None]
    assert plan.choose(_decode(200)) == (None, f"absorb_qk_cache: stock above 64 tokens: not measured on this GPU; "
                                               f"qk_cache: {SLOWER}")
    assert plan.choose(_decode(1000)) == (None, f"qk_cache: {ABOVE}")
    assert plan.choose(_decode(9)) == (qk.DecodePath.QK_CACHE, None)
    # qk_cache off: the absorbed launch's own refusal is the reason
    alone = _gated_plan(qk_state=FusionState.DISABLED, measured=gates)
    assert alone.choose(_decode(9)) == (None, "absorb_qk_cache: stock at 9-64 tokens: 0.97x of stock on this GPU")
    assert alone.choose(_decode(8)) == (qk.DecodePath.ABSORB, None)
    # both refused: both reasons
    assert _gated_plan(measured={QK_CACHE: BucketGate(((64, SLOWER),), ABOVE),
                                 ABSORB_QK_CACHE: gates[ABSORB_QK_CACHE]}).choose(_decode(9)) == (
        None, f"absorb_qk_cache: stock at 9-64 tokens: 0.97x of stock on this GPU; qk_cache: {SLOWER}")
    # a fusion the measurement does not name runs stock; a failed kernel still refuses; stock batches give no reason
    assert _gated_plan(measured={}).choose(_decode(1)) == (
        None, "absorb_qk_cache: not measured on this GPU; qk_cache: not measured on this GPU")
    assert plan.path_for(_decode(1), frozenset({ABSORB_QK_CACHE})) is qk.DecodePath.QK_CACHE
    assert plan.choose(qk.BatchFacts(4, 3, True, False)) == (None, None)


def test_without_a_measurement_every_batch_is_decided_as_before():
    plan = _gated_plan()
    assert [plan.path_for(_decode(t)) for t in (1, ABSORB_MAX_TOKENS, ABSORB_MAX_TOKENS + 1, 4096)] == [
        qk.DecodePath.ABSORB, qk.DecodePath.ABSORB, qk.DecodePath.QK_CACHE, qk.DecodePath.QK_CACHE]
    assert plan.choose(_decode(4096)) == (qk.DecodePath.QK_CACHE, None)
