"""The patch engine on a stand-in module: verify, apply all or nothing, never twice, revert to the
identical originals, refuse to revert over someone else's change."""

from __future__ import annotations

import copy
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
        engine._revert_one(engine.applied[0])


def test_revert_all_takes_off_every_patch_it_can_and_keeps_the_one_wrapped_again():
    """Another tool (a tracer) wraps one patched method again: revert_all still reverts the others,
    newest first, and keeps that one, under the other tool's wrapper, in ``applied``. Before, the
    refusal escaped part-way: the patches after it stayed on, and nothing could take them off."""
    module = make_module()
    original_forward = vars(module.Wrapper)["forward"]

    class Other:
        def method(self, x):
            return x

    module.Other = Other
    other_original = vars(Other)["method"]
    engine = PatchEngine()
    engine.apply([PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", (), wrapper=tag("n")),
                  PatchSpec("w.fwd", "fake", "Wrapper.forward", (), wrapper=tag("f")),
                  PatchSpec("o.m", "fake", "Other.method", (), wrapper=tag("m"))], module)
    wrapt.wrap_function_wrapper(module.Wrapper, "_normalize_q_kv", lambda w, i, a, k: ("tracer", *w(*a, **k)))
    assert engine.revert_all() == ["o.m", "w.fwd"]
    assert vars(module.Wrapper)["forward"] is original_forward and vars(Other)["method"] is other_original
    assert [a.spec.key for a in engine.applied] == ["w.norm"]
    assert module.Wrapper()._normalize_q_kv(1, 2) == ("tracer", "n", 1, 2)  # both wrappers still there


def test_an_optional_patch_whose_target_fails_is_left_out_and_the_rest_apply():
    """A patch for the log only (the layer report) must not take the fusions down with it."""
    module = make_module()
    engine = PatchEngine()
    applied = engine.apply([PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", (), wrapper=tag("n")),
                            PatchSpec("r.log", "fake", "Missing.__init__", (), wrapper=tag("r"), optional=True)],
                           module)
    assert applied == ["w.norm"] and engine.left_out == {"r.log": "fake:Missing.__init__ does not exist"}
    assert engine.apply([PatchSpec("r.log", "fake", "Missing.__init__", (), wrapper=tag("r"), optional=True)],
                        module) == []  # not checked again
    with pytest.raises(AnchorError, match=r"Missing\.__init__ does not exist"):  # not optional: all or nothing
        PatchEngine().apply([PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", (), wrapper=tag("n")),
                             PatchSpec("r.log", "fake", "Missing.__init__", (), wrapper=tag("r"))], module)


def test_a_guard_that_raises_is_an_anchor_error_naming_it():
    """A live condition that cannot be checked (it raised) is a failed anchor, not a traceback from an
    import hook; before, a KeyError escaped and every other module's patches stayed on."""
    module = make_module()

    def guard(_module):
        raise KeyError("missing")

    with pytest.raises(AnchorError) as failed:
        PatchEngine().apply([PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", (), wrapper=tag("n"),
                                       guard=guard)], module)
    assert str(failed.value) == "fake:Wrapper._normalize_q_kv: its check raised KeyError: 'missing'"
    assert not isinstance(vars(module.Wrapper)["_normalize_q_kv"], wrapt.FunctionWrapper)


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
        engine._revert_one(engine.applied[-1])
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


def _kept_setup(module):
    from k3_amd_overlay.evidence import Evidence
    from k3_amd_overlay.settings import load_settings
    from k3_amd_overlay.targets.installer import LayerInstaller

    settings = load_settings({"K3_AMD_OVERLAY": "qkv_norm", "K3_AMD_OVERLAY_STRICT": "0"})
    return settings, Evidence(settings), LayerInstaller(settings, Evidence(settings))


def routed(label):
    """A wrapper routing by the instance's site, as the overlay's K3 wrappers do."""
    def wrapper(wrapped, instance, args, kwargs):
        site = vars(instance).get("_site")
        return (f"{label}:{site}", *wrapped(*args, **kwargs)) if site else wrapped(*args, **kwargs)
    return wrapper


def test_layers_built_while_patched_keep_their_routes_after_revert():
    """``deactivate()`` takes the wrappers off the classes; a layer given a site meanwhile keeps the
    routes through it (the kept wrappers composed as applied, bound on the instance around the
    original), a layer without one, a layer whose class overrides the method and every later layer
    run their own method, and the class gets back the identical object."""
    module = make_module()

    class Own(module.Wrapper):
        def _normalize_q_kv(self, q_c, kv_c):
            return ("own", q_c, kv_c)

    original = vars(module.Wrapper)["_normalize_q_kv"]
    _, _, installer = _kept_setup(module)
    engine = PatchEngine()
    engine.apply([PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",), wrapper=routed("in"),
                            kept_by="_site"),
                  PatchSpec("w.fwd", "fake", "Wrapper.forward", ("qkv_norm",), wrapper=tag("x"))], module)
    engine.apply([PatchSpec("w.norm2", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",), wrapper=routed("out"),
                            kept_by="_site")], module)
    with_site, without, child, own = module.Wrapper(), module.Wrapper(), module.Child(), Own()
    for layer, site in ((with_site, "a"), (without, None), (child, "c"), (own, "o")):
        if site:
            layer._site = site
        installer.track(layer)
    before = with_site._normalize_q_kv(1, 2)
    assert before == ("out:a", "in:a", "stock", 1, 2) and own._normalize_q_kv(1, 2) == ("own", 1, 2)
    applied = list(engine.applied)
    engine.revert_all()
    installer.keep_routes(applied)
    assert vars(module.Wrapper)["_normalize_q_kv"] is original
    assert with_site._normalize_q_kv(1, 2) == before and child._normalize_q_kv(3, 4) == ("out:c", "in:c", "stock", 3, 4)
    assert without._normalize_q_kv(1, 2) == module.Wrapper()._normalize_q_kv(1, 2) == ("stock", 1, 2)
    assert own._normalize_q_kv(1, 2) == ("own", 1, 2) and "_normalize_q_kv" not in vars(own)  # never wrapped
    assert "forward" not in vars(with_site) and with_site.forward(5) == 5  # no kept_by: nothing kept
    twin = copy.deepcopy(with_site)
    twin._site = "twin"
    assert twin._normalize_q_kv(1, 2) == ("out:twin", "in:twin", "stock", 1, 2)  # bound to the copy
    assert with_site._normalize_q_kv(1, 2) == before


def test_a_failed_live_anchor_check_keeps_the_routes_of_layers_built_before(monkeypatch):
    """The other revert: a module imported later (vLLM's MTP draft model, after the target's layers
    are built) fails its anchor check, and every patch comes off; the built layers keep their routes."""
    from k3_amd_overlay.activation import Activation

    module = make_module()
    settings, evidence, installer = _kept_setup(module)
    active = Activation(settings, evidence, installer=installer)
    active.engine.apply([PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",), wrapper=routed("in"),
                                   kept_by="_site")], module)
    layer = module.Wrapper()
    layer._site = "a"
    installer.track(layer)
    active.specs_by_module = {"later": [PatchSpec("m.x", "later", "Missing.attr", ("qkv_norm",), wrapper=tag("x"))]}
    active.apply_module("later", types.ModuleType("later"))
    assert active.engine.applied == [] and vars(module.Wrapper)["_normalize_q_kv"].__name__ == "_normalize_q_kv"
    assert layer._normalize_q_kv(1, 2) == ("in:a", "stock", 1, 2)
    assert evidence.fusion("qkv_norm").state.value == "refused"


def test_deactivating_under_another_tools_wrapper_leaves_the_overlay_inert_not_half_on(caplog):
    """``deactivate()`` with a tracer's wrapper on top of the overlay's ``__init__`` patch: the others
    come off, that one stays under the tracer, and no layer built from then on gets a site, so every
    later layer runs vLLM's own code; the marker lists only the patch left in place, the fusions say
    deactivated, nothing raises. Before, the refusal escaped part-way: patches stayed on and later
    layers still got the overlay's sites."""
    from k3_amd_overlay import activation
    from k3_amd_overlay.activation import Activation
    from k3_amd_overlay.targets.k3_wrapper import install_layer_sites

    module = make_module()
    settings, evidence, installer = _kept_setup(module)
    active = Activation(settings, evidence, installer=installer)
    installer.install_qkv_norm = lambda layer, upstream_fuses: setattr(layer, "_site", "s")  # the site, stood in
    install = install_layer_sites(installer, frozenset({"qkv_norm"}), False)  # the overlay's __init__ wrapper
    active.engine.apply([PatchSpec("w.init", "fake", "Wrapper.__init__", (), wrapper=install),
                         PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",), wrapper=routed("in"),
                                   kept_by="_site")], module)
    built = module.Wrapper()
    installer.track(built)
    traced = []
    wrapt.wrap_function_wrapper(module.Wrapper, "__init__", lambda w, i, a, k: traced.append(1) or w(*a, **k))
    activation._active = active
    with caplog.at_level("WARNING", logger="vllm.k3_amd_overlay"):
        assert activation.deactivate() == ["w.norm"]
    assert [a.spec.key for a in active.engine.applied] == ["w.init"] and evidence.record.patches == ["w.init"]
    assert "fake:Wrapper.__init__ was wrapped again after the overlay patched it" in caplog.text
    later = module.Wrapper()
    assert traced == [1] and "_site" not in vars(later)  # the overlay's __init__ ran, inert
    assert later._normalize_q_kv(1, 2) == ("stock", 1, 2)
    assert built._normalize_q_kv(1, 2) == ("in:s", "stock", 1, 2)  # built before: keeps its route
    assert evidence.fusion("qkv_norm").reason == activation.DEACTIVATED


def test_a_patch_that_fails_with_another_error_is_refused_like_a_failed_anchor(monkeypatch):
    """wrapt failing to patch (or any error from a module's apply) reverts every patch and refuses the
    fusions in the overlay's words, as a failed anchor does; it was a traceback from the import hook
    that left the other modules' patches on, in either strict mode."""
    from k3_amd_overlay.activation import Activation

    module = make_module()
    settings, evidence, installer = _kept_setup(module)
    active = Activation(settings, evidence, installer=installer)
    active.engine.apply([PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",), wrapper=tag("n"))],
                        module)
    monkeypatch.setattr(wrapt, "wrap_function_wrapper", lambda *args: (_ for _ in ()).throw(TypeError("no wrap")))
    active.specs_by_module = {"later": [PatchSpec("w.fwd", "later", "Wrapper.forward", ("qkv_norm",),
                                                  wrapper=tag("x"))]}
    active.apply_module("later", module)
    assert active.engine.applied == [] and not isinstance(vars(module.Wrapper)["_normalize_q_kv"],
                                                          wrapt.FunctionWrapper)
    assert evidence.fusion("qkv_norm").reason == ("live anchor check failed in later: TypeError: no wrap; every "
                                                  "overlay patch reverted")


def test_a_report_patch_left_out_is_warned_and_off_the_markers_list(caplog):
    """The layer-report patch's target failing the live check: the fusions' patches apply, a WARNING
    names it, and the marker's ``patches`` (those planned or in place) no longer lists it."""
    from k3_amd_overlay.activation import Activation

    module = make_module()
    settings, evidence, installer = _kept_setup(module)
    active = Activation(settings, evidence, installer=installer)
    active.specs_by_module = {"fake": [PatchSpec("w.norm", "fake", "Wrapper._normalize_q_kv", ("qkv_norm",),
                                                 wrapper=tag("n")),
                                       PatchSpec("r.log", "fake", "Missing.__init__", ("qkv_norm",), wrapper=tag("r"),
                                                 optional=True)]}
    with caplog.at_level("WARNING", logger="vllm.k3_amd_overlay"):
        active.apply_module("fake", module)
    assert [a.spec.key for a in active.engine.applied] == ["w.norm"] and evidence.record.patches == ["w.norm"]
    assert "r.log left out" in caplog.text and "fake:Missing.__init__ does not exist" in caplog.text
    assert evidence.fusion("qkv_norm").state.value != "refused"


def test_the_layer_report_of_a_retired_installer_says_nothing(monkeypatch):
    """Left inert under another tool's wrapper after deactivate(), the report patch would log "then
    refused ... on none of them" for layers that keep the overlay's sites."""
    from k3_amd_overlay.targets.k3_wrapper import report_layers

    module = make_module()
    _, _, installer = _kept_setup(module)
    said = []
    monkeypatch.setattr(installer.evidence, "publish_layers", lambda: said.append(1))
    report = report_layers(installer)
    report(lambda: None, None, (), {})
    installer.retire()
    report(lambda: None, None, (), {})
    assert said == [1]
