"""The switch: every accepted value, and a clear error for everything else."""

import re

import pytest

from k3_amd_overlay.settings import Mode, SettingsError, load_settings


@pytest.mark.parametrize("raw,mode,fusions", [
    (None, Mode.OFF, set()), ("", Mode.OFF, set()), ("0", Mode.OFF, set()),
    ("1", Mode.AUTO, {"qkv_norm", "qk_cache", "absorb_qk_cache"}),
    ("stock", Mode.STOCK, {"qkv_norm", "qk_cache", "absorb_qk_cache"}),
    ("qkv_norm", Mode.AUTO, {"qkv_norm"}), ("qk_cache", Mode.AUTO, {"qk_cache"}),
    (" qk_cache , qkv_norm ", Mode.AUTO, {"qkv_norm", "qk_cache"}),
    ("1 ", Mode.AUTO, {"qkv_norm", "qk_cache", "absorb_qk_cache"}),  # spaces around the value: ignored (README)
    (" stock", Mode.STOCK, {"qkv_norm", "qk_cache", "absorb_qk_cache"}), (" ", Mode.OFF, set()),
])
def test_switch_values(raw, mode, fusions):
    settings = load_settings({} if raw is None else {"K3_AMD_OVERLAY": raw})
    assert (settings.mode, set(settings.fusions)) == (mode, fusions)
    assert settings.strict is True


@pytest.mark.parametrize("raw", ["2", "on", "true", "STOCK", "qkv_norm,", "qk-cache", "qkv_norm,nope"])
def test_bad_switch_names_value_and_valid_ones(raw):
    with pytest.raises(SettingsError) as err:
        load_settings({"K3_AMD_OVERLAY": raw})
    assert repr(raw) in str(err.value)
    assert "'0' (off), '1' (all fusions), 'stock' (force unfused)" in str(err.value)
    assert "qkv_norm, qk_cache, absorb_qk_cache" in str(err.value)


def test_strict_and_providers():
    s = load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_STRICT": "0",
                       "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "triton"})
    assert s.strict is False and s.provider("qk_cache") == "triton" and s.provider("qkv_norm") == "auto"
    with pytest.raises(SettingsError, match=r"K3_AMD_OVERLAY_STRICT='yes' is not valid; allowed: '1'"):
        load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_STRICT": "yes"})
    with pytest.raises(SettingsError, match="allowed: auto, aiter, triton, reference"):
        load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "vllm"})


@pytest.mark.parametrize("switch", [None, "0"])
def test_a_bad_value_of_a_known_variable_is_an_error_with_the_overlay_off_too(switch):
    env = {} if switch is None else {"K3_AMD_OVERLAY": switch}
    with pytest.raises(SettingsError, match=r"K3_AMD_OVERLAY_STRICT='yes' is not valid"):
        load_settings({**env, "K3_AMD_OVERLAY_STRICT": "yes"})
    with pytest.raises(SettingsError, match="allowed: auto, aiter, triton, reference"):
        load_settings({**env, "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "vllm"})


def test_unknown_overlay_variables_are_errors_when_on_and_reported_when_off():
    with pytest.raises(SettingsError, match=r"unknown overlay variable.*K3_AMD_OVERLAY_STRCT"):
        load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_STRCT": "0"})
    off = load_settings({"K3_AMD_OVERLAY_STRCT": "0"})
    assert off.mode is Mode.OFF and off.unknown_variables == ("K3_AMD_OVERLAY_STRCT",)


def test_a_known_name_in_another_case_is_an_unknown_variable_not_silently_ignored():
    """``k3_amd_overlay_strict=0`` (lower case) was passed over: strict stayed on without a word."""
    for name in ("k3_amd_overlay_strict", "K3_amd_overlay_STRICT", "k3_amd_overlay"):
        with pytest.raises(SettingsError, match=rf"unknown overlay variable\(s\) {name}; known \(upper case\)"):
            load_settings({"K3_AMD_OVERLAY": "1", name: "0"})
    assert load_settings({"k3_amd_overlay": "1"}).unknown_variables == ("k3_amd_overlay",)  # off: for the warning


def test_the_settings_object_says_what_it_holds():
    """Every field's default and the three queries on it, for on, off and a partial switch."""
    from k3_amd_overlay import settings as module

    default = module.OverlaySettings()
    assert (default.mode, default.fusions, default.strict, default.marker_dir, dict(default.providers),
            default.raw, default.unknown_variables) == (Mode.OFF, frozenset(), True, None, {}, "", ())
    assert default.enabled is False and default.provider("qk_cache") == "auto"
    with pytest.raises(AttributeError):
        default.mode = Mode.AUTO  # frozen: a process's settings never change after the plugin loads
    partial = load_settings({"K3_AMD_OVERLAY": "qk_cache", "K3_AMD_OVERLAY_MARKER_DIR": "/tmp/m"})
    assert partial.enabled is True and partial.raw == "qk_cache" and partial.marker_dir == "/tmp/m"
    assert partial.requested("qk_cache") and not partial.requested("qkv_norm")
    assert load_settings({"K3_AMD_OVERLAY": "stock"}).enabled is True
    assert load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": ""}).marker_dir is None
    assert [m.value for m in Mode] == ["off", "auto", "stock"]  # the values markers and logs carry


def test_the_variable_names_are_the_documented_ones():
    from k3_amd_overlay import settings as module

    assert (module.SWITCH, module.STRICT, module.MARKER_DIR, module.ENV_PREFIX) == (
        "K3_AMD_OVERLAY", "K3_AMD_OVERLAY_STRICT", "K3_AMD_OVERLAY_MARKER_DIR", "K3_AMD_OVERLAY")
    assert module.KNOWN_VARIABLES == {
        "K3_AMD_OVERLAY", "K3_AMD_OVERLAY_STRICT", "K3_AMD_OVERLAY_MARKER_DIR", "K3_AMD_OVERLAY_KERNEL_CONFIGS",
        "K3_AMD_OVERLAY_QKV_NORM_PROVIDER", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER",
        "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER"}
    assert module.PROVIDER_SETTINGS == {
        "qkv_norm": ("auto", "aiter", "triton", "vllm", "reference"),
        "qk_cache": ("auto", "aiter", "triton", "reference"),
        "absorb_qk_cache": ("auto", "triton", "aiter", "reference")}


@pytest.mark.parametrize("variable,value,message", [
    ("K3_AMD_OVERLAY", "qk-cache", "K3_AMD_OVERLAY='qk-cache' is not valid (unknown: 'qk-cache'); allowed: '0' (off), "
     "'1' (all fusions), 'stock' (force unfused), or a comma list of: qkv_norm, qk_cache, absorb_qk_cache"),
    ("K3_AMD_OVERLAY_STRICT", " 2 ", "K3_AMD_OVERLAY_STRICT=' 2 ' is not valid; allowed: '1' (default, raise) "
     "or '0' (warn)"),
    ("K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER", "vllm", "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER='vllm' is not "
     "valid; allowed: auto, triton, aiter, reference"),
    ("K3_AMD_OVERLAY_QKV_NORM_PROVIDR", "triton", "unknown overlay variable(s) K3_AMD_OVERLAY_QKV_NORM_PROVIDR; "
     "known (upper case): K3_AMD_OVERLAY, K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER, K3_AMD_OVERLAY_KERNEL_CONFIGS, "
     "K3_AMD_OVERLAY_MARKER_DIR, "
     "K3_AMD_OVERLAY_QKV_NORM_PROVIDER, K3_AMD_OVERLAY_QK_CACHE_PROVIDER, K3_AMD_OVERLAY_STRICT"),
])
def test_each_error_message_in_full(variable, value, message):
    env = {"K3_AMD_OVERLAY": "1", variable: value}
    with pytest.raises(SettingsError) as err:
        load_settings(env)
    assert str(err.value) == message


@pytest.mark.parametrize("strict,expected", [(" 1 ", True), ("0", False), (" 0", False)])
def test_strict_values_with_spaces(strict, expected):
    assert load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_STRICT": strict}).strict is expected


def test_provider_values_are_trimmed_and_default_to_auto():
    s = load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_QKV_NORM_PROVIDER": " vllm "})
    assert dict(s.providers) == {"qkv_norm": "vllm", "qk_cache": "auto", "absorb_qk_cache": "auto"}


@pytest.mark.parametrize("value,why", [
    ("1,qk_cache", "'1' stands alone, never in a list"),  # said "unknown: '1'" beside "allowed: '1'"
    ("stock, qkv_norm", "'stock' stands alone, never in a list"),
    ("0,1", "'0' and '1' stand alone, never in a list"),
    ("qk_cache,", "an empty name: a stray comma?"),
    ("fast,,stock", "unknown: 'fast'; 'stock' stands alone, never in a list; an empty name: a stray comma?"),
])
def test_a_list_says_what_is_wrong_with_it(value, why):
    with pytest.raises(SettingsError) as err:
        load_settings({"K3_AMD_OVERLAY": value})
    assert str(err.value) == (f"K3_AMD_OVERLAY={value!r} is not valid ({why}); allowed: '0' (off), '1' (all fusions), "
                              "'stock' (force unfused), or a comma list of: qkv_norm, qk_cache, absorb_qk_cache")


def test_every_bad_name_is_listed_separated():
    with pytest.raises(SettingsError, match=r"\(unknown: 'qk-cache', 'norm'\)"):
        load_settings({"K3_AMD_OVERLAY": "qk-cache,qkv_norm,norm"})
    with pytest.raises(SettingsError, match=r"variable\(s\) K3_AMD_OVERLAY_A, K3_AMD_OVERLAY_B; known"):
        load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_B": "x", "K3_AMD_OVERLAY_A": "y"})


def test_a_provider_for_a_fusion_not_switched_on_is_named_as_having_no_effect():
    """``K3_AMD_OVERLAY=qkv_norm`` with ``K3_AMD_OVERLAY_QK_CACHE_PROVIDER=triton`` looks like qk_cache is
    wanted; the plugin warns with these words (it was silent)."""
    qk = "K3_AMD_OVERLAY_QK_CACHE_PROVIDER"
    assert load_settings({"K3_AMD_OVERLAY": "qkv_norm", qk: "triton"}).ineffective_providers() == [
        f"{qk}=triton has no effect with K3_AMD_OVERLAY='qkv_norm' (qk_cache is not switched on)"]
    assert load_settings({"K3_AMD_OVERLAY": "stock", qk: "aiter"}).ineffective_providers() == [
        f"{qk}=aiter has no effect with K3_AMD_OVERLAY='stock' (stock mode runs every fusion unfused)"]
    for quiet in ({"K3_AMD_OVERLAY": "1", qk: "triton"}, {"K3_AMD_OVERLAY": "qkv_norm", qk: "auto"},
                  {"K3_AMD_OVERLAY": "0", qk: "triton"}, {"K3_AMD_OVERLAY": "qkv_norm,qk_cache", qk: "triton"}):
        assert load_settings(quiet).ineffective_providers() == [], quiet


@pytest.mark.parametrize("blank", [" ", "\t"])
def test_a_blank_marker_directory_is_an_error_not_a_directory_named_with_spaces(blank):
    with pytest.raises(SettingsError, match=re.escape(f"K3_AMD_OVERLAY_MARKER_DIR={blank!r} names no directory")):
        load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": blank})
    assert load_settings({"K3_AMD_OVERLAY_MARKER_DIR": ""}).marker_dir is None


@pytest.mark.parametrize("variable", ["K3_AMD_OVERLAY_MARKER_DIR", "K3_AMD_OVERLAY_KERNEL_CONFIGS"])
@pytest.mark.parametrize("value", [" /tmp/x", "/tmp/x ", "\t/tmp/x\n"])
def test_a_path_with_spaces_around_it_is_an_error_not_a_relative_path(variable, value):
    """' /tmp/x' was taken as it is: a directory ' ' under each process's own working directory, where
    `check` run from elsewhere finds nothing."""
    with pytest.raises(SettingsError) as raised:
        load_settings({"K3_AMD_OVERLAY": "1", variable: value})
    assert str(raised.value) == f"{variable}={value!r}: spaces before or after the path; give '/tmp/x'"


@pytest.mark.parametrize("switch", ["0", "1"])
@pytest.mark.parametrize("blank", [" ", "\t"])
def test_a_blank_kernel_configs_value_is_an_error_not_a_file_named_with_spaces(blank: str, switch: str) -> None:
    """A blank K3_AMD_OVERLAY_KERNEL_CONFIGS was read as a file named by spaces ("cannot read launch configs
    : ..."); it is a settings error naming the variable, as a blank marker directory is, whatever the switch."""
    with pytest.raises(SettingsError) as raised:
        load_settings({"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_KERNEL_CONFIGS": blank})
    assert str(raised.value) == (f"K3_AMD_OVERLAY_KERNEL_CONFIGS={blank!r} names no file or directory; unset it for "
                                 "the shipped launch configs")
    for usable in ("", "/c"):  # no SettingsError: unset-alike, and a path (the launch configs judge the file)
        load_settings({"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_KERNEL_CONFIGS": usable})
