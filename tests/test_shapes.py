"""Recognising vLLM by its source: every release of the matrix read from disk (no vLLM import, so
one venv's run checks the probes against all five source trees), each anchor's answer on each
tree, the probes' AST rules on small sources, the patches each shape builds per mode, and the
known vLLM defect found where it is and fired where vLLM's variables make it fire."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
from releases import MATRIX, minor, tree_of

from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.package import ABSORB_QK_CACHE, FUSIONS, QK_CACHE, QKV_NORM
from k3_amd_overlay.settings import load_settings
from k3_amd_overlay.targets import sources as src
from k3_amd_overlay.targets.defects import (
    REAL_POSITIONS_IN_FUSED_DECODE,
    UPSTREAM_DEFECTS,
    W_UK_T_BEFORE_LOAD,
    present_defects,
    trigger_words,
)
from k3_amd_overlay.targets.installer import DECODE_FUSIONS, LayerInstaller
from k3_amd_overlay.targets.shapes import (
    ATTEND_SEAM,
    FUSED_DECODE_PARAMS,
    FUSED_DECODE_SEAM,
    K3_DECODE_WRAPPER,
    K3_NORM_WRAPPER,
    NO_UPSTREAM_DECODE,
    PLAIN_WRAPPER,
    SHARED_FRONT_END,
    UPSTREAM_DECODE_MIN_LATENT_HEADS,
    VLLM_SHAPES,
    recognise,
)

# Each anchor's answer per release (1 holds, 0 not), per shape: identity, then each fusion's anchors.
HOLDS = {
    "0.29": {"k3_decode_wrapper": ("0001", "00", "000001"), "k3_norm_wrapper": ("0011", "00", "0111"),
             "plain_wrapper": ("1111", "11", "111")},
    "0.30": {"k3_decode_wrapper": ("1101", "11", "000001"), "k3_norm_wrapper": ("1111", "11", "1111"),
             "plain_wrapper": ("0001", "11", "111")},
    "0.32": {"k3_decode_wrapper": ("1111", "11", "111111"), "k3_norm_wrapper": ("1101", "11", "1111"),
             "plain_wrapper": ("0001", "11", "111")},
}
HOLDS["0.31"], HOLDS["0.33"] = HOLDS["0.30"], HOLDS["0.32"]


def _in_releases(version: str, releases: str) -> bool:
    low, high = (tuple(int(p) for p in end.split(".")) for end in releases.split("-"))
    return low <= tuple(int(p) for p in minor(version).split(".")) <= high


@pytest.mark.parametrize("version", MATRIX)
def test_each_release_is_recognised_as_the_shape_its_releases_name(version):
    sources = src.VllmSources(tree_of(version))
    found = recognise(sources)
    expected = [shape for shape in VLLM_SHAPES if _in_releases(version, shape.releases)]
    assert [found.shape] == expected
    assert found.missing_for_fusion == {f: [] for f in FUSIONS}
    earlier = VLLM_SHAPES[:VLLM_SHAPES.index(found.shape)]
    assert list(found.missing_identity) == [shape.name for shape in earlier]
    for shape in earlier:
        assert found.missing_identity[shape.name] == [a.what for a in shape.identity if not a.holds(sources)]


@pytest.mark.parametrize("version", MATRIX)
def test_every_anchor_answers_as_recorded_on_every_release(version):
    sources = src.VllmSources(tree_of(version))
    for shape in VLLM_SHAPES:
        identity, norm, decode = HOLDS[minor(version)][shape.name]
        answers = "".join(str(int(a.holds(sources))) for a in shape.identity)
        assert answers == identity, (shape.name, "identity")
        assert "".join(str(int(a.holds(sources))) for a in shape.fusion_anchors[QKV_NORM]) == norm
        for fusion in DECODE_FUSIONS:
            got = "".join(str(int(a.holds(sources))) for a in shape.fusion_anchors[fusion])
            assert got == decode, (shape.name, fusion)


def test_a_tree_without_vllm_names_every_missing_identity_anchor(tmp_path):
    found = recognise(src.VllmSources(tmp_path))
    assert found.shape is None and found.missing_for_fusion == {}
    mla, linear = src.K3_MLA, src.LINEAR
    wrapper = src.K3_WRAPPER
    assert found.missing_identity == {
        "k3_decode_wrapper": [
            f"{mla}: class {wrapper}",
            f"{linear}: KimiMLAAttention.__init__ constructs {wrapper}",
            f"{mla}: {wrapper}._fused_decode{FUSED_DECODE_PARAMS}",
            f"{linear}: class KimiLinearModel",
        ],
        "k3_norm_wrapper": [
            f"{mla}: class {wrapper}",
            f"{linear}: KimiMLAAttention.__init__ constructs {wrapper}",
            f"{linear}: class KimiLinearModel",
        ],
        "plain_wrapper": [
            f"{linear}: imports MultiHeadLatentAttentionWrapper from vllm.model_executor.layers.mla",
            f"{linear}: KimiMLAAttention.__init__ constructs MultiHeadLatentAttentionWrapper",
            f"{linear}: class KimiLinearModel",
        ],
    }
    assert recognise(src.VllmSources(None)).missing_identity == found.missing_identity


def test_the_anchor_descriptions_word_for_word():
    mla, shared, attn = src.K3_MLA, src.SHARED_MLA, src.MLA_ATTENTION
    w = src.K3_WRAPPER
    assert [a.what for a in K3_DECODE_WRAPPER.fusion_anchors[QKV_NORM]] == [
        f"{mla}: {w}._normalize_q_kv(q_c, kv_c)", f"{mla}: {w}.forward calls self._normalize_q_kv"]
    assert [a.what for a in K3_DECODE_WRAPPER.fusion_anchors[QK_CACHE]] == [
        f"{mla}: {w}._fused_qk_prep_supported()",
        f"{mla}: {w}.__init__ sets self._fused_qk_prep from _fused_qk_prep_supported()",
        f"{mla}: {w}._fused_decode{FUSED_DECODE_PARAMS}",
        f"{mla}: {w}.forward calls self._fused_decode",
        f"{mla}: {w}.forward fuses decode-only batches (num_actual_tokens == num_decode_tokens)",
        f"{attn}: MLAAttention._v_up_proj(x, out)",
    ]
    assert [a.what for a in K3_NORM_WRAPPER.fusion_anchors[QK_CACHE]] == [
        f"{mla}: {w}.forward calls self.mla_attn",
        f"{attn}: MLAAttention.forward('q', 'kv_c_normed', 'k_pe', 'output_shape', 'q_dcp_replicated')",
        f"{attn}: MLAAttention._v_up_proj(x, out)",
        f"{src.ATTENTION}: get_attention_context(layer_name)",
    ]
    assert PLAIN_WRAPPER.identity[2].what == f"{src.LINEAR}: no {w}"
    assert K3_NORM_WRAPPER.identity[2].what == (
        f"{mla}: no fused decode of its own (no _fused_decode, no fused_qk_rope_concat_and_cache_mla)")
    assert [a.what for a in PLAIN_WRAPPER.fusion_anchors[QKV_NORM]] == [
        f"{shared}: MultiHeadLatentAttentionWrapper.forward(positions, hidden_states, llama_4_scaling)",
        f"{shared}: MultiHeadLatentAttentionWrapper.forward normalises with self.q_a_layernorm and "
        "self.kv_a_layernorm",
    ]
    for shape in VLLM_SHAPES:
        assert shape.fusion_anchors[ABSORB_QK_CACHE] == shape.fusion_anchors[QK_CACHE]


def test_what_each_shape_says_upstream_fuses():
    assert K3_DECODE_WRAPPER.upstream == {
        QKV_NORM: "AITER dual RMSNorm when AITER is on",
        QK_CACHE: "AITER fused decode when AITER MLA is on, fp8 KV cache, kv_lora_rank*heads >= 2048, no "
                  "DCP/PCP/HiSparse/padded heads, and the fp4 BMM (taken on gfx950 only; on by default in 0.32, "
                  "off in 0.33) or no fp8 BMM",
        ABSORB_QK_CACHE: ""}
    assert UPSTREAM_DECODE_MIN_LATENT_HEADS == 2048
    assert K3_NORM_WRAPPER.upstream == {QKV_NORM: "AITER dual RMSNorm when AITER is on", QK_CACHE: "",
                                        ABSORB_QK_CACHE: ""}
    assert PLAIN_WRAPPER.upstream == dict.fromkeys(FUSIONS, "")
    assert [s.releases for s in VLLM_SHAPES] == ["0.32-0.33", "0.30-0.31", "0.27-0.29"]


def _write(root: Path, rel: str, code: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))


def test_probes_read_code_not_comments_or_nested_definitions(tmp_path):
    _write(tmp_path, "m.py", """
        # class Hidden: a comment is not code
        from a.b import Name as Alias, Other
        import pkg.sub as short

        def top(x, /, y, *, z):
            helper.run(x)
            self.value = 1
            self.typed: int = 2

        class Outer:
            def method(self, a, b):
                self.inner.call(a)
                return Name

            class Nested:
                pass

        def wrapper():
            def inner_fn():
                pass
    """)
    sources = src.VllmSources(tmp_path)
    tree = sources.tree("m.py")
    assert sources.tree("m.py") is tree  # parsed once
    assert sources.text("absent.py") is None and sources.tree("absent.py") is None
    assert src.VllmSources(None).text("m.py") is None
    assert src.find_class(tree, "Outer") is not None
    assert src.find_class(tree, "Hidden") is None and src.find_class(tree, "Nested") is None
    assert src.find_class(tree, "top") is None and src.find_class(None, "Outer") is None
    assert src.find_function(tree, "top") is not None and src.find_function(tree, "Outer") is None
    assert src.find_function(tree, "inner_fn") is None and src.find_function(None, "top") is None
    outer = src.find_class(tree, "Outer")
    method = src.find_method(outer, "method")
    assert method is not None and src.find_method(outer, "Nested") is None
    assert src.find_method(outer, "top") is None and src.find_method(None, "method") is None
    assert src.params(src.find_function(tree, "top")) == ("x", "y", "z")
    assert src.params(method) == ("a", "b") and src.params(None) == ()
    assert src.calls(tree, "helper.run") and src.calls(method, "self.inner.call")
    assert not src.calls(tree, "helper") and not src.calls(method, "helper.run")
    assert not src.calls(tree, "Hidden") and not src.calls(None, "helper.run")
    assert src.mentions(method, "Name") and src.mentions(method, "inner")
    assert src.mentions(tree, "Alias") and src.mentions(tree, "Other") and src.mentions(tree, "sub")
    assert src.mentions(tree, "short")
    assert not src.mentions(tree, "Hidden") and not src.mentions(method, "helper")
    assert not src.mentions(None, "Name")
    assert src.imports_name(tree, "a.b", "Name") and src.imports_name(tree, "a.b", "Other")
    assert not src.imports_name(tree, "a.b", "Alias") and not src.imports_name(tree, "a", "Name")
    assert not src.imports_name(None, "a.b", "Name")
    fn = src.find_function(tree, "top")
    assert src.assigns_self_attr(fn, "value") and src.assigns_self_attr(fn, "typed")
    assert not src.assigns_self_attr(fn, "other") and not src.assigns_self_attr(method, "value")
    assert not src.assigns_self_attr(None, "value")


def _holds(anchor, tmp_path: Path, rel: str, code: str) -> bool:
    root = tmp_path / str(len(list(tmp_path.iterdir())))
    _write(root, rel, code)
    return anchor.holds(src.VllmSources(root))


def _k3(body: str) -> str:
    return f"class {src.K3_WRAPPER}:\n" + textwrap.indent(textwrap.dedent(body), "    ")


def test_an_anchor_of_several_clauses_needs_each_of_them(tmp_path):
    """Every release has all of an anchor's clauses or none, so only small sources tell "and" from
    "or", a clause dropped, or a parameter list read too far."""
    supported, set_at_init = FUSED_DECODE_SEAM[0], FUSED_DECODE_SEAM[1]
    assert _holds(supported, tmp_path, src.K3_MLA, _k3("def _fused_qk_prep_supported(self): pass"))
    assert not _holds(supported, tmp_path, src.K3_MLA, _k3("def _fused_qk_prep_supported(self, layer): pass"))
    assert not _holds(supported, tmp_path, src.K3_MLA, _k3("def other(self): pass"))

    for init, holds in (("self._fused_qk_prep = self._fused_qk_prep_supported()", True),
                        ("self._fused_qk_prep = True", False),
                        ("self.ready = self._fused_qk_prep_supported()", False)):
        assert _holds(set_at_init, tmp_path, src.K3_MLA, _k3(f"def __init__(self):\n    {init}")) is holds, init

    for code, holds in (("def forward(self, q):\n    return self.mla_attn(q)", True),
                        ("def forward(self, q):\n    return self._fused_decode(q)", False),
                        ("def forward(self, q):\n    return fused_qk_rope_concat_and_cache_mla(q)", False)):
        assert _holds(NO_UPSTREAM_DECODE, tmp_path, src.K3_MLA, _k3(code)) is holds, code

    decode_only = FUSED_DECODE_SEAM[4]  # the per-batch test fusions.qk_cache.upstream_takes mirrors
    for test, holds in (("m.num_actual_tokens == m.num_decode_tokens", True),
                        ("m.num_decode_tokens == m.num_actual_tokens", True),
                        ("m.num_actual_tokens >= m.num_decode_tokens", False),
                        ("m.num_actual_tokens == m.num_prefill_tokens", False)):
        code = f"def forward(self, m):\n    fuse = {test}\n    return self._fused_decode(m)"
        assert _holds(decode_only, tmp_path, src.K3_MLA, _k3(code)) is holds, test

    forward = ATTEND_SEAM[0]
    for params, holds in (("q, kv_c_normed, k_pe, output_shape, q_dcp_replicated", True),
                          ("q, kv_c_normed, k_pe, output_shape, q_dcp_replicated, extra=None", True),
                          ("q, k_pe, kv_c_normed, output_shape, q_dcp_replicated", False)):
        code = f"class MLAAttention:\n    def forward(self, {params}): pass\n"
        assert _holds(forward, tmp_path, src.MLA_ATTENTION, code) is holds, params

    norms = SHARED_FRONT_END[1]
    for calls, holds in (("self.q_a_layernorm(q); self.kv_a_layernorm(kv)", True),
                         ("self.q_a_layernorm(q)", False), ("self.kv_a_layernorm(kv)", False)):
        code = f"class MultiHeadLatentAttentionWrapper:\n    def forward(self, q, kv):\n        {calls}\n"
        assert _holds(norms, tmp_path, src.SHARED_MLA, code) is holds, calls


def test_vllm_root_is_the_importable_package_or_none(monkeypatch):
    import importlib.machinery
    import importlib.util

    from k3_amd_overlay.versions import installed_vllm_version

    version = installed_vllm_version()
    if version is not None and version in MATRIX:  # found without importing vLLM
        assert src.vllm_root().resolve() == tree_of(version).resolve()
    asked = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: asked.append(name))
    assert src.vllm_root() is None and asked == ["vllm"]
    bare = importlib.machinery.ModuleSpec("vllm", None, is_package=True)  # no search locations
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: bare)
    assert src.vllm_root() is None


def _installer(tmp_path, switch: str) -> LayerInstaller:
    settings = load_settings({"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path)})
    return LayerInstaller(settings, Evidence(settings))


def _specs(shape, installer, fusions):
    return [(s.key, s.module, s.attribute, s.fusions, s.params)
            for s in shape.build(installer, frozenset(fusions))]


FUSION_SETS = [set(c) for n in range(len(FUSIONS) + 1) for c in itertools.combinations(sorted(FUSIONS), n)]
MLA, LINEAR, W = "vllm.models.kimi_k3.amd.mla", "vllm.models.kimi_k3.amd.linear", src.K3_WRAPPER
MTP = "vllm.models.kimi_k3.amd.mtp"


def _report(fusions) -> list[tuple]:
    return [("linear.report_layers", LINEAR, "KimiLinearModel.__init__", tuple(sorted(fusions)), None),
            ("mtp.report_layers", MTP, "KimiK3MultiTokenPredictor.__init__", tuple(sorted(fusions)), None)]


def _norm_specs(hooked) -> list[tuple]:
    specs = [("k3_wrapper.init", MLA, f"{W}.__init__", tuple(sorted(hooked)), None)]
    if QKV_NORM in hooked:
        specs.append(("k3_wrapper.normalize_q_kv", MLA, f"{W}._normalize_q_kv", (QKV_NORM,), ("q_c", "kv_c")))
    return specs


@pytest.mark.parametrize("switch", ["1", "stock"])
@pytest.mark.parametrize("fusions", FUSION_SETS, ids=lambda f: "+".join(sorted(f)) or "none")
def test_each_shape_builds_the_patches_its_mode_needs(tmp_path, switch, fusions):
    installer = _installer(tmp_path, switch)
    decode = tuple(sorted(set(fusions) & DECODE_FUSIONS))

    expected = _norm_specs({QKV_NORM}) if QKV_NORM in fusions else []
    if decode:
        expected += [
            ("k3_wrapper.fused_qk_prep_supported", MLA, f"{W}._fused_qk_prep_supported", decode, ()),
            ("k3_wrapper.fused_decode", MLA, f"{W}._fused_decode", decode, FUSED_DECODE_PARAMS),
        ]
    assert _specs(K3_DECODE_WRAPPER, installer, fusions) == (expected + _report(fusions) if fusions else [])

    # stock mode too: the decode site counts each layer and opens the census's decode range (0.30-0.31)
    assert _specs(K3_NORM_WRAPPER, installer, fusions) == (
        _norm_specs(set(fusions)) + _report(set(fusions)) if fusions else [])

    plain = [("linear.mla_wrapper", LINEAR, "MultiHeadLatentAttentionWrapper", tuple(sorted(fusions)), None)]
    # stock mode too: the subclass counts each layer and opens the census's ranges around vLLM's forward
    assert _specs(PLAIN_WRAPPER, installer, fusions) == (plain + _report(fusions) if fusions else [])


@pytest.mark.parametrize("version", MATRIX)
def test_the_known_vllm_defect_is_found_in_exactly_the_release_that_has_it(version):
    # vLLM 0.32.0's _fused_qk_prep_supported reads attn.W_UK_T, called from __init__ (before loading);
    # 0.33 no longer reads it there, 0.29-0.31 have no such check.
    found = present_defects(src.VllmSources(tree_of(version)))
    # 0.32-0.33's _fused_decode hands AITER's fused write the real positions (0.34: zeros)
    assert found == ([W_UK_T_BEFORE_LOAD] if minor(version) == "0.32" else []) + (
        [REAL_POSITIONS_IN_FUSED_DECODE] if minor(version) in ("0.32", "0.33") else [])


def test_a_source_where_the_check_is_not_called_at_init_has_no_defect(tmp_path):
    _write(tmp_path, src.K3_MLA, f"""
        class {src.K3_WRAPPER}:
            def __init__(self):
                self.ready = True

            def _fused_qk_prep_supported(self):
                return self.attn.W_UK_T is not None
    """)
    assert present_defects(src.VllmSources(tmp_path)) == []
    _write(tmp_path / "called", src.K3_MLA, f"""
        class {src.K3_WRAPPER}:
            def __init__(self):
                self._fused_qk_prep = self._fused_qk_prep_supported()

            def _fused_qk_prep_supported(self):
                return self.attn.W_UK_T is not None
    """)
    assert present_defects(src.VllmSources(tmp_path / "called")) == [W_UK_T_BEFORE_LOAD]


@pytest.mark.parametrize(("env", "fires"), [
    ({}, False),
    ({"VLLM_ROCM_USE_AITER": "1"}, False),  # the fp8 BMM defaults on: vLLM never reads W_UK_T
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP8BMM": "0"}, None),  # fp4 BMM: gfx950 + bf16 only
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, False),
    ({"VLLM_ROCM_USE_AITER_FP8BMM": "0", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, False),  # AITER defaults off
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP8BMM": "0", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, None),
    ({"VLLM_ROCM_USE_AITER": "True ", "VLLM_ROCM_USE_AITER_FP8BMM": "false", "VLLM_ROCM_USE_AITER_FP4BMM": "0"},
     None),
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MLA": "0", "VLLM_ROCM_USE_AITER_FP8BMM": "0",
      "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, False),
    ({"VLLM_ROCM_USE_AITER": "0", "VLLM_ROCM_USE_AITER_FP8BMM": "0", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, False),
])
def test_the_defect_fires_in_exactly_the_environment_vllm_reads(env, fires):
    """Issue 19, fault 5: the environment alone never says "not triggered" where vLLM may still read
    W_UK_T (the fp4 BMM variable defaults on, but vLLM uses the fp4 BMM only on gfx950 with a bf16
    kv_b_proj: on an MI300X the defect fires); the rest is decided per layer, by vLLM."""
    assert W_UK_T_BEFORE_LOAD.triggered(env) is fires


def test_the_defect_is_described_word_for_word():
    assert UPSTREAM_DEFECTS == (W_UK_T_BEFORE_LOAD, REAL_POSITIONS_IN_FUSED_DECODE)
    assert W_UK_T_BEFORE_LOAD.describe() == (
        "vllm-k3-fused-qk-prep-reads-W_UK_T-before-load: vLLM's KimiK3MultiHeadLatentAttentionWrapper.__init__ "
        "calls _fused_qk_prep_supported(), which reads attn.W_UK_T before the weights are loaded (W_UK_T does "
        "not exist yet): building the model fails with AttributeError, with or without this overlay; keep "
        "VLLM_ROCM_USE_AITER_FP8BMM on (vLLM then never fuses the decode itself) or use a vLLM whose check "
        "does not read W_UK_T (0.33) (fires when VLLM_ROCM_USE_AITER=1 with AITER MLA on and "
        "VLLM_ROCM_USE_AITER_FP8BMM=0, on a layer with an fp8 KV cache and >= 4 heads per rank where vLLM's fp4 "
        "BMM is off (it is on only on a gfx950 GPU, with a bf16 kv_b_proj and VLLM_ROCM_USE_AITER_FP4BMM, on by "
        "default: every MI300X takes the defect))")
    assert [trigger_words(t) for t in (None, True, False)] == [
        "may fire here: decided per layer when vLLM builds it", "TRIGGERED here", "not triggered here"]


def test_shapes_anchors_and_recognitions_are_frozen(tmp_path):
    import dataclasses

    recognition = recognise(src.VllmSources(tmp_path))
    for value, name in ((K3_DECODE_WRAPPER, "name"), (K3_DECODE_WRAPPER.identity[0], "what"),
                        (recognition, "shape"), (W_UK_T_BEFORE_LOAD, "name")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, None)


@pytest.mark.parametrize(("env", "fires"), [
    ({}, False),  # AITER defaults off: vLLM's fused decode never runs
    ({"VLLM_ROCM_USE_AITER": "1"}, None),  # the fp4 BMM defaults on: per layer (gfx950 only), KV cache, heads
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MLA": "0"}, False),
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, False),  # the fp8 BMM (default on) only
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "0", "VLLM_ROCM_USE_AITER_FP8BMM": "0"}, None),
])
def test_the_positions_defect_may_fire_wherever_vllms_fused_decode_may_run(env, fires):
    assert REAL_POSITIONS_IN_FUSED_DECODE.triggered(env) is fires


def test_the_positions_defect_is_the_call_with_real_positions_not_a_mention(tmp_path):
    """Found only where _fused_decode passes ``positions`` itself to AITER's fused write: vLLM 0.34's
    zeros, or a name in a comment, are not it."""
    for where, argument, found in (("real", "positions", True), ("zeros", "self._zero_positions[:n]", False)):
        _write(tmp_path / where, src.K3_MLA, f"""
            class {src.K3_WRAPPER}:
                def _fused_decode(self, q, positions, slot_mapping):
                    # positions are not clamped by every kernel
                    fused_qk_rope_concat_and_cache_mla(q, slot_mapping, {argument}, self.cos, self.sin)
        """)
        assert (present_defects(src.VllmSources(tmp_path / where)) == [REAL_POSITIONS_IN_FUSED_DECODE]) is found
