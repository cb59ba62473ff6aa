"""The switch: every accepted value, and a clear error for everything else."""

import pytest

from k3_amd_overlay.settings import Mode, SettingsError, load_settings


@pytest.mark.parametrize("raw,mode,fusions", [
    (None, Mode.OFF, set()), ("", Mode.OFF, set()), ("0", Mode.OFF, set()),
    ("1", Mode.AUTO, {"qkv_norm", "qk_cache", "absorb_qk_cache"}),
    ("stock", Mode.STOCK, {"qkv_norm", "qk_cache", "absorb_qk_cache"}),
    ("qkv_norm", Mode.AUTO, {"qkv_norm"}), ("qk_cache", Mode.AUTO, {"qk_cache"}),
    (" qk_cache , qkv_norm ", Mode.AUTO, {"qkv_norm", "qk_cache"}),
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


def test_unknown_overlay_variables_are_errors_when_on_and_reported_when_off():
    with pytest.raises(SettingsError, match=r"unknown overlay variable.*K3_AMD_OVERLAY_STRCT"):
        load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_STRCT": "0"})
    off = load_settings({"K3_AMD_OVERLAY_STRCT": "0"})
    assert off.mode is Mode.OFF and off.unknown_variables == ("K3_AMD_OVERLAY_STRCT",)
