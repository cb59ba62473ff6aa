"""The patch engine on a stand-in module: verify, apply all or nothing, never twice, revert to the
identical originals, refuse to revert over someone else's change."""

from __future__ import annotations

import dataclasses
import types

import pytest
import wrapt

from k3_amd_overlay.engine import AnchorError, PatchEngine, PatchSpec


def make_module():
    module = types.ModuleType("fake_vllm_k3")

    class Wrapper:
        def _normalize_q_kv(self, q_c, kv_c):
            return ("stock", q_c, kv_c)

        def forward(self, x):
            return x

    class Child(Wrapper):
        pass

    module.Wrapper, module.Child, module.Shared = Wrapper, Child, object
    return module


def tag(label):
    def wrapper(wrapped, instance, args, kwargs):
        return (label, *wrapped(*args, **kwargs)[1:])
    return wrapper


def test_apply_wraps_and_revert_restores_identical_objects():
    module = make_module()
    original = vars(module.Wrapper)["_normalize_q_kv"]
    engine = PatchEngine()
    spec = PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",), wrapper=tag("fused"),
                     params=("q_c", "kv_c"))
    assert engine.apply([spec], module) == ["w.norm"]
    assert isinstance(vars(module.Wrapper)["_normalize_q_kv"], wrapt.FunctionWrapper)
    assert module.Wrapper()._normalize_q_kv(1, 2) == ("fused", 1, 2)
    assert engine.apply([spec], module) == []  # never wrapped twice
    assert module.Wrapper()._normalize_q_kv(1, 2) == ("fused", 1, 2)
    assert engine.revert_all() == ["w.norm"]
    assert vars(module.Wrapper)["_normalize_q_kv"] is original


def test_inherited_attribute_is_deleted_not_overwritten_on_revert():
    module = make_module()
    engine = PatchEngine()
    engine.apply([PatchSpec("c.norm", "fake", "Child._normalize_q_kv", ("qkv_norm",), wrapper=tag("x"))], module)
    assert "_normalize_q_kv" in vars(module.Child)
    engine.revert_all()
    assert "_normalize_q_kv" not in vars(module.Child)


def test_a_failure_part_way_reverts_everything_applied_in_that_call():
    module = make_module()
    before = dict(vars(module.Wrapper))
    engine = PatchEngine()

    def boom(original):
        raise RuntimeError("factory failed")

    specs = [PatchSpec("a", "fake", "Wrapper.forward", (), wrapper=tag("a")),
             PatchSpec("b", "fake", "Shared", (), replace=boom)]
    with pytest.raises(RuntimeError, match="factory failed"):
        engine.apply(specs, module)
    assert dict(vars(module.Wrapper)) == before and engine.applied == []


def test_missing_or_changed_anchor_is_refused_before_anything_is_applied():
    module = make_module()
    engine = PatchEngine()
    good = PatchSpec("a", "fake", "Wrapper.forward", (), wrapper=tag("a"))
    with pytest.raises(AnchorError, match=r"fake:Wrapper\._fused_decode does not exist"):
        engine.apply([good, PatchSpec("b", "fake", "Wrapper._fused_decode", (), wrapper=tag("b"))], module)
    with pytest.raises(AnchorError, match=r"takes \('q_c', 'kv_c'\), the overlay expects \('q', 'kv'\)"):
        engine.apply([good, PatchSpec("c", "fake", "Wrapper._normalize_q_kv", (), wrapper=tag("c"),
                                      params=("q", "kv"))], module)
    with pytest.raises(AnchorError, match="registered elsewhere"):
        engine.apply([PatchSpec("d", "fake", "Shared", (), replace=lambda o: o,
                                guard=lambda m: "registered elsewhere")], module)
    assert engine.applied == [] and not isinstance(vars(module.Wrapper)["forward"], wrapt.FunctionWrapper)


def test_revert_refuses_to_clobber_a_later_patch():
    module = make_module()
    engine = PatchEngine()
    engine.apply([PatchSpec("a", "fake", "Wrapper.forward", (), wrapper=tag("a"))], module)
    module.Wrapper.forward = lambda self, x: x
    with pytest.raises(AnchorError, match="changed by someone else"):
        engine.revert_all()


def test_every_anchor_message_word_for_word():
    """The messages a user reads when vLLM changed under the overlay (engine.py mutants survived a
    substring match)."""
    module = make_module()
    module.no_signature = max  # a builtin without an inspectable signature
    engine = PatchEngine()
    cases = [
        (PatchSpec("b", "fake", "Wrapper._fused_decode", (), wrapper=tag("b")),
         "fake:Wrapper._fused_decode does not exist"),
        (PatchSpec("c", "fake", "Wrapper._normalize_q_kv", (), wrapper=tag("c"), params=("q", "kv")),
         "fake:Wrapper._normalize_q_kv takes ('q_c', 'kv_c'), the overlay expects ('q', 'kv')"),
        (PatchSpec("d", "fake", "Shared", (), replace=lambda o: o, guard=lambda m: "registered elsewhere"),
         "fake:Shared: registered elsewhere"),
        (PatchSpec("e", "fake", "no_signature", (), wrapper=tag("e"), params=("x",)),
         "fake:no_signature has no inspectable signature"),
    ]
    for spec, message in cases:
        with pytest.raises(AnchorError) as raised:
            engine.apply([spec], module)
        assert str(raised.value) == message
    engine.apply([PatchSpec("a", "fake", "Wrapper.forward", (), wrapper=tag("a"))], module)
    module.Wrapper.forward = lambda self, x: x
    with pytest.raises(AnchorError) as raised:
        engine.revert_all()
    assert str(raised.value) == ("fake:Wrapper.forward was changed by someone else after the overlay patched it; "
                                 "not reverting over it")


def test_classmethod_parameters_skip_cls_and_module_attributes_revert_to_the_original():
    module = make_module()

    class Ops:
        @classmethod
        def fp8_bmm(cls, x, w):
            return "stock"

    module.Ops = Ops
    module.helper = lambda q, kv: "stock"
    original_helper = module.helper
    engine = PatchEngine()
    specs = [PatchSpec("ops", "fake", "Ops.fp8_bmm", (), wrapper=tag("x"), params=("x", "w")),
             PatchSpec("helper", "fake", "helper", (), replace=lambda o: (lambda q, kv: "fused"), params=("q", "kv"))]
    assert engine.apply(specs, module) == ["ops", "helper"]
    assert module.helper(1, 2) == "fused"
    engine.revert_all()
    assert module.helper is original_helper  # a module global is put back, not deleted
    spec = PatchSpec("k", "fake", "helper", ())
    assert (spec.wrapper, spec.replace, spec.params, spec.guard) == (None, None, None, None)


def test_a_patch_spec_cannot_change_once_made():
    spec = PatchSpec("k", "fake", "helper", ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.attribute = "other"  # type: ignore[misc]


def test_layers_built_while_patched_keep_their_routes_after_revert():
    """``deactivate()`` takes the wrappers off the classes; a layer given a site meanwhile keeps the
    route through it (the wrapper bound around the original on the instance), a layer without one and
    every later layer run the original, and the class gets back the identical object."""
    from k3_amd_overlay.evidence import Evidence
    from k3_amd_overlay.settings import load_settings
    from k3_amd_overlay.targets.installer import LayerInstaller

    module = make_module()
    original = vars(module.Wrapper)["_normalize_q_kv"]
    settings = load_settings({"K3_AMD_OVERLAY": "qkv_norm"})
    installer = LayerInstaller(settings, Evidence(settings))

    def routed(wrapped, instance, args, kwargs):
        site = vars(instance).get("_site")
        return (site, *wrapped(*args, **kwargs)[1:]) if site else wrapped(*args, **kwargs)

    engine = PatchEngine()
    spec = PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",), wrapper=routed, kept_by="_site")
    engine.apply([spec, PatchSpec("w.fwd", "fake", "Wrapper.forward", ("qkv_norm",), wrapper=tag("x"))], module)
    with_site, without, child = module.Wrapper(), module.Wrapper(), module.Child()
    with_site._site = "overlay"
    child._site = "child's"
    for layer in (with_site, without, child):
        installer.layers.add(layer)
    applied = list(engine.applied)
    engine.revert_all()
    installer.keep_routes(applied)
    assert vars(module.Wrapper)["_normalize_q_kv"] is original
    assert with_site._normalize_q_kv(1, 2) == ("overlay", 1, 2) and child._normalize_q_kv(3, 4) == ("child's", 3, 4)
    assert without._normalize_q_kv(1, 2) == module.Wrapper()._normalize_q_kv(1, 2) == ("stock", 1, 2)
    assert "forward" not in vars(with_site) and with_site.forward(5) == 5  # no kept_by: nothing kept
