"""The patch engine on a stand-in module: verify, apply all or nothing, never twice, revert to the
identical originals, refuse to revert over someone else's change."""

from __future__ import annotations

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
