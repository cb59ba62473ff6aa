"""The per-layer sites as plain objects (no vLLM): the qkv_norm site acts on its layer's decision
alone, its callback runs the provider it was built with, the evidence hook is given the batch's
token count; the attention hook swaps one instance's class and nothing else."""

from __future__ import annotations

import types

import pytest
import torch

from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.ops import rmsnorm_pair
from k3_amd_overlay.targets import attend_hook, norm_hook
from k3_amd_overlay.targets.decode import DECODE_SITE
from k3_amd_overlay.targets.norm import QKV_NORM_SITE, QkvNormCallback, QkvNormSite

TOKENS, Q_LORA, KV_LORA = 5, 24, 16


class Norm(torch.nn.Module):
    """An RMSNorm module as vLLM's K3 layer holds it: ``weight`` and ``variance_epsilon``."""

    def __init__(self, width: int, eps: float, tag: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.variance_epsilon = eps
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.tag  # recognisable: the stock path


def _inputs():
    return torch.randn(TOKENS, Q_LORA), torch.randn(TOKENS, KV_LORA)


def test_the_callback_runs_its_own_provider_on_the_layers_weights(monkeypatch):
    q_norm, kv_norm = Norm(Q_LORA, 1e-6, 2.0), Norm(KV_LORA, 1e-5, 3.0)
    calls = []
    monkeypatch.setattr(rmsnorm_pair, "run_provider", lambda *args: calls.append(args) or ("q", "kv"))
    q_c, kv_c = _inputs()
    assert QkvNormCallback(q_norm, kv_norm, "reference")(q_c, kv_c) == ("q", "kv")
    (name, *tensors, q_eps, kv_eps), = calls
    assert name == "reference" and (q_eps, kv_eps) == (1e-6, 1e-5)
    assert all(a is b for a, b in zip(tensors, [q_c, kv_c, q_norm.weight, kv_norm.weight], strict=True))


def test_the_callback_reads_the_weights_at_call_time():
    q_norm, kv_norm = Norm(Q_LORA, 1e-6, 2.0), Norm(KV_LORA, 1e-6, 3.0)
    callback = QkvNormCallback(q_norm, kv_norm, "reference")
    q_c, kv_c = _inputs()
    with torch.no_grad():
        q_norm.weight.mul_(2)  # loading weights after the layer was built
    q_out, kv_out = callback(q_c, kv_c)
    rms = (q_c.float().pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    torch.testing.assert_close(q_out, q_c * rms * q_norm.weight)
    assert kv_out.shape == kv_c.shape


def _site(state: FusionState, with_callback: bool):
    q_norm, kv_norm = Norm(Q_LORA, 1e-6, 2.0), Norm(KV_LORA, 1e-6, 3.0)
    counted: list[int] = []
    callback = (lambda q, kv: ("fused", q.shape[0])) if with_callback else None
    site = QkvNormSite(LayerDecision(state, "reference", "why"), callback, counted.append)
    return site, q_norm, kv_norm, counted


def _upstream(q, kv):
    return ("upstream", q.shape[0])


@pytest.mark.parametrize("state", list(FusionState))
@pytest.mark.parametrize("with_callback", [True, False])
def test_the_norm_site_acts_on_its_decision_alone(state, with_callback):
    site, q_norm, kv_norm, counted = _site(state, with_callback)
    q_c, kv_c = _inputs()
    out = site.normalize(q_norm, kv_norm, _upstream, q_c, kv_c)
    if state is FusionState.APPLIED and with_callback:
        assert out == ("fused", TOKENS) and counted == [TOKENS]
    elif state is FusionState.UPSTREAM:
        assert out == ("upstream", TOKENS) and counted == [TOKENS]
    elif state is FusionState.FORCED_STOCK:  # stock: each norm on its own, nothing counted as fused
        torch.testing.assert_close(out[0], q_c * 2.0)
        torch.testing.assert_close(out[1], kv_c * 3.0)
        assert counted == []
    else:  # the overlay's fused norm does not run: vLLM's own method, nothing counted as fused
        assert out == ("upstream", TOKENS) and counted == []


def test_upstream_without_vllms_fused_norm_runs_the_two_norms():
    site, q_norm, kv_norm, counted = _site(FusionState.UPSTREAM, with_callback=False)
    q_c, kv_c = _inputs()
    out = site.normalize(q_norm, kv_norm, None, q_c, kv_c)
    torch.testing.assert_close(out[0], q_c * 2.0)
    assert counted == []


def test_under_tracing_the_overlays_kernel_stands_down_and_upstream_stays(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    site, q_norm, kv_norm, counted = _site(FusionState.APPLIED, with_callback=True)
    q_c, kv_c = _inputs()
    assert site.normalize(q_norm, kv_norm, _upstream, q_c, kv_c) == ("upstream", TOKENS)  # vLLM's own method
    out = site.normalize(q_norm, kv_norm, None, q_c, kv_c)  # no method of vLLM's own (0.29): the two norms
    torch.testing.assert_close(out[0], q_c * 2.0)
    assert counted == []
    site, q_norm, kv_norm, counted = _site(FusionState.UPSTREAM, with_callback=False)
    assert site.normalize(q_norm, kv_norm, _upstream, q_c, kv_c) == ("upstream", TOKENS) and counted == []


def test_the_site_attribute_names_are_the_overlays_own():
    assert QKV_NORM_SITE.startswith("_k3_overlay_") and DECODE_SITE.startswith("_k3_overlay_")
    assert QKV_NORM_SITE != DECODE_SITE


class Attention:
    """Stands for vLLM's MLAAttention: only its forward signature matters to the hook."""

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        return ("stock", q, output_shape, q_dcp_replicated)


class RecordingSite:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def attend(self, attn, stock_forward, q, kv_c_normed, k_pe, *, output_shape, q_dcp_replicated):
        self.calls.append((attn, q, kv_c_normed, k_pe, output_shape, q_dcp_replicated))
        return stock_forward(q, kv_c_normed, k_pe, output_shape, q_dcp_replicated)


def test_the_attention_hook_swaps_one_instances_class_and_routes_forward_through_its_site():
    hooked, other, site = Attention(), Attention(), RecordingSite()
    attend_hook.install(hooked, site)
    assert type(other) is Attention and Attention.forward is not type(hooked).forward
    assert type(hooked).__mro__[1] is Attention
    assert type(hooked).__name__ == "K3OverlayAttention"
    assert type(hooked).__module__ == "k3_amd_overlay.targets.attend_hook"
    assert type(hooked).__doc__ == "Attention of a Kimi-K3 layer with the overlay's qk_cache decode site."
    assert hooked.__dict__[DECODE_SITE] is site
    assert hooked.forward("q", "kv", "pe", output_shape=(2, 3), q_dcp_replicated="r") == ("stock", "q", (2, 3), "r")
    assert site.calls == [(hooked, "q", "kv", "pe", (2, 3), "r")]
    assert hooked.forward("q2", "kv", "pe") == ("stock", "q2", None, None)
    assert other.forward("q", "kv", "pe") == ("stock", "q", None, None) and len(site.calls) == 2


def test_the_hooked_class_is_made_once_per_base():
    first, second = Attention(), Attention()
    attend_hook.install(first, RecordingSite())
    attend_hook.install(second, RecordingSite())
    assert type(first) is type(second) is attend_hook.hooked_class(Attention)
    assert attend_hook.REGISTER_KEY == "mla_attention.class_swap"


class StockNorm(torch.nn.Module):
    def forward(self, x, residual=None):
        return ("stock", x, residual)


def _opened(run) -> tuple[object, list[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = run()
    return out, [e.name for e in profile.events() if e.name.startswith("k3_amd_overlay::")]


def test_the_norm_hook_swaps_each_instances_class_and_opens_one_range_per_call_around_the_stock_forward():
    from k3_amd_overlay.regions import QKV_NORM_REGION

    q_norm, kv_norm, other = StockNorm(), StockNorm(), StockNorm()
    norm_hook.install(q_norm, None, kv_norm)  # a layer without q-LoRA has no q_a norm
    norm_hook.install(kv_norm)  # installed twice: still one subclass deep
    assert type(other) is StockNorm and type(q_norm) is type(kv_norm) is norm_hook.ranged_class(StockNorm)
    assert type(kv_norm).__mro__[1] is StockNorm and type(kv_norm).__name__ == "K3OverlayStockNorm"
    assert type(kv_norm).__module__ == "k3_amd_overlay.targets.norm_hook"
    assert q_norm("x", residual="r") == ("stock", "x", "r")  # not profiling: no range, the stock call
    out, opened = _opened(lambda: (q_norm("q"), kv_norm("kv"), other("o")))
    assert out == (("stock", "q", None), ("stock", "kv", None), ("stock", "o", None))
    assert opened == [QKV_NORM_REGION, QKV_NORM_REGION]
    assert norm_hook.REGISTER_KEY == "rms_norm.class_swap"


def test_under_tracing_the_norm_hook_calls_the_stock_forward_without_a_range(monkeypatch):
    norm = StockNorm()
    norm_hook.install(norm)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out, opened = _opened(lambda: norm("x"))
    assert out == ("stock", "x", None) and opened == []


def test_the_norm_hooks_class_names_its_base_in_its_docstring_and_adds_only_forward():
    """The swapped norm's class is what a reader meets in a traceback or ``help()``: its docstring names
    the base it wraps (as the attention hook's does), and it adds nothing to the base but ``forward``."""
    ranged = norm_hook.ranged_class(StockNorm)
    assert ranged.__doc__ == "StockNorm of a Kimi-K3 layer's q/kv front end, inside the census's qkv_norm range."
    assert set(vars(ranged)) - set(vars(type("Bare", (StockNorm,), {}))) == {"forward"}


def test_vllms_own_w_uk_t_failure_is_named_on_the_exception_and_others_pass_untouched():
    from k3_amd_overlay.targets.defects import W_UK_T_BEFORE_LOAD
    from k3_amd_overlay.targets.k3_wrapper import decide_fused_qk_prep

    outcomes = []  # the installer is reached only to record the defect's outcome when vLLM's check fails
    decide = decide_fused_qk_prep(installer=types.SimpleNamespace(evidence=types.SimpleNamespace(
        defect_outcome=lambda name, fired: outcomes.append((name, fired)))))

    def fails(message):
        def check():
            raise AttributeError(message)
        return check

    with pytest.raises(AttributeError) as raised:
        decide(fails("'MLAAttention' object has no attribute 'W_UK_T'"), object(), (), {})
    assert raised.value.__notes__ == [
        f"k3-amd-overlay: a known vLLM defect, not the overlay's: {W_UK_T_BEFORE_LOAD.describe()}"]
    with pytest.raises(AttributeError) as raised:
        decide(fails("'MLAAttention' object has no attribute 'W_UV'"), object(), (), {})
    assert not hasattr(raised.value, "__notes__")
    assert outcomes == [(W_UK_T_BEFORE_LOAD.name, True)]


def test_the_batch_facts_the_per_batch_predicate_reads():
    from k3_amd_overlay.fusions.qk_cache import BatchFacts
    from k3_amd_overlay.targets.decode import batch_facts

    meta = types.SimpleNamespace(num_actual_tokens=torch.tensor(6), num_decode_tokens=4)
    slots, cache = torch.arange(6), torch.zeros(1)
    assert batch_facts(None, slots, cache, None) is None  # vLLM's profile run
    assert batch_facts(meta, slots, cache, None) == BatchFacts(num_actual_tokens=6, num_decode_tokens=4,
                                                               has_cache=True, dcp_replicated=False)
    assert not batch_facts(meta, None, cache, None).has_cache
    assert not batch_facts(meta, slots, torch.zeros(0), None).has_cache
    assert batch_facts(meta, slots, cache, torch.zeros(1)).dcp_replicated


def upstream_site(on_effective, kv_transfer=None):
    """A decode site on a layer vLLM 0.32+'s own fused decode keeps (the overlay takes no batch)."""
    from k3_amd_overlay.fusions.qk_cache import DecodePlan
    from k3_amd_overlay.targets.decode import DecodeSite

    plan = DecodePlan(LayerDecision(FusionState.UPSTREAM, "aiter", "r"),
                      LayerDecision(FusionState.DISABLED, None, "deferred"), upstream_fuses=True)
    return DecodeSite(plan=plan, on_effective=on_effective, on_absorb_effective=on_effective, kv_transfer=kv_transfer)


@pytest.mark.parametrize("connector", [True, False])
def test_a_batch_left_to_vllms_own_fused_decode_runs_between_the_connectors_hooks(connector, monkeypatch):
    """vLLM 0.32+'s fused decode skips the KV connector's per-layer hooks that the stock attention op
    runs; the overlay runs vLLM's own call inside them, and counts the batch as vLLM's fusion."""
    from k3_amd_overlay.targets import vllm_env
    from k3_amd_overlay.targets.k3_wrapper import fused_decode_wrapper

    counted, hooked, ran = [], [], []

    def transfer(layer_name, step):
        hooked.append(layer_name)
        return step()

    meta = types.SimpleNamespace(num_actual_tokens=7, num_decode_tokens=7)
    cache, slots = torch.zeros(1), torch.arange(7)
    monkeypatch.setattr(vllm_env, "get_attention_context", lambda name: (meta, "layer", cache, slots))
    layer = types.SimpleNamespace(mla_attn=types.SimpleNamespace(layer_name="layers.0.attn"))
    layer.__dict__[DECODE_SITE] = upstream_site(counted.append, transfer if connector else None)
    q = torch.randn(7, 4, 8)
    args = (q, "kv", "pe", "positions", (7, 32), meta, "layer", cache, slots)
    assert fused_decode_wrapper(lambda *a: ran.append(a) or "vllm's", layer, args, {}) == "vllm's"
    assert ran == [args] and counted == [7]
    assert hooked == (["layers.0.attn"] if connector else [])


def test_a_replayed_batch_with_prefill_rows_never_takes_vllms_own_fused_decode(monkeypatch):
    """Issue 19, fault 1: under a breakable capture the site runs again for each replayed batch, with
    that batch's context; one with prefill rows goes to the stock attention call, not to vLLM's own
    fused decode (which the capture's decode-only dummy batch had chosen)."""
    from k3_amd_overlay.targets import vllm_env
    from k3_amd_overlay.targets.k3_wrapper import fused_decode_wrapper

    meta = types.SimpleNamespace(num_actual_tokens=7, num_decode_tokens=3)
    context = (meta, "layer", torch.zeros(1), torch.arange(7))
    monkeypatch.setattr(vllm_env, "get_attention_context", lambda name: context)
    attended, counted = [], []

    class Attention:  # the layer's MLAAttention: only its call matters here
        layer_name = "layers.0.attn"

        def __call__(self, *args, **kwargs):
            attended.append((args, kwargs))
            return "stock"

    layer = types.SimpleNamespace(mla_attn=Attention())
    layer.__dict__[DECODE_SITE] = upstream_site(counted.append)
    q = torch.randn(7, 4, 8)
    args = (q, "kv", "pe", "positions", (7, 32), "capture-time metadata", "layer", torch.zeros(1), torch.arange(7))
    assert fused_decode_wrapper(lambda *a: pytest.fail("vLLM's fused decode took a mixed batch"), layer, args, {}) \
        == "stock"
    assert attended == [((q, "kv", "pe"), {"output_shape": (7, 32)})] and counted == []


@pytest.mark.parametrize(("indexer", "sparse", "q_lora", "rotary", "dcp", "state", "takes"), [
    (None, False, 24, None, False, FusionState.APPLIED, True),
    (object(), False, 24, None, False, FusionState.APPLIED, True),  # an indexer is used only when sparse
    (None, True, 24, None, False, FusionState.APPLIED, True),
    (object(), True, 24, None, False, FusionState.APPLIED, False),
    (None, False, None, None, False, FusionState.APPLIED, False),  # no q-LoRA
    (None, False, 24, object(), False, FusionState.APPLIED, False),  # a rotary embedding on the front end
    (None, False, 24, None, True, FusionState.APPLIED, False),  # DCP query replication
    (None, False, 24, None, False, FusionState.REFUSED, False),
])
def test_the_plain_wrappers_own_front_end_takes_only_the_k3_shape(indexer, sparse, q_lora, rotary, dcp, state,
                                                                  takes):
    """vLLM 0.29's shared wrapper: the overlay's subclass runs its own K3 front end (the one with
    the normalize seam) only where its qkv_norm is applied and the layer is K3's shape."""
    from k3_amd_overlay.targets.plain_wrapper import k3_wrapper_class

    cls = k3_wrapper_class(object, installer=None, fusions=frozenset())
    layer = types.SimpleNamespace(indexer=indexer, is_sparse=sparse, q_lora_rank=q_lora, rotary_emb=rotary,
                                  dcp_q_replicate=dcp)
    layer.__dict__[QKV_NORM_SITE] = QkvNormSite(LayerDecision(state, "reference", "r"), None, lambda n: None)
    assert cls._k3_front_end(layer) is takes
    assert cls.__name__ == cls.__qualname__ == "K3OverlayMLAWrapper"


def test_a_decode_site_without_a_kv_connector_runs_its_step_directly(monkeypatch):
    from k3_amd_overlay.fusions import qk_cache as qk
    from k3_amd_overlay.targets.decode import DecodeSite

    applied = LayerDecision(FusionState.APPLIED, "reference", "")
    site = DecodeSite(qk.DecodePlan(applied, applied), lambda n: None, lambda n: None)
    assert (site.fmt, site.context, site.kv_transfer, site.query_heads) == (None, None, None, 0)
    attn = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    out = torch.randn(2, 3)
    monkeypatch.setattr(site, "_fused_step", lambda *args: out)
    assert site.fused_decode("qk_cache", attn, *([None] * 7)) is out
    calls = []
    site.kv_transfer = lambda name, step: calls.append(name) or step()
    assert site.fused_decode("qk_cache", attn, *([None] * 7)) is out
    assert calls == ["model.layers.0.self_attn.attn"]
