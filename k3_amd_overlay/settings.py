"""The overlay's environment switch, parsed and validated in one place.

``K3_AMD_OVERLAY``           unset or ``0``: off (nothing installed); ``1``: every fusion in auto
                             mode; ``stock``: force the unfused path everywhere; or a comma list
                             of fusion names (``qkv_norm``, ``qk_cache``, ``absorb_qk_cache``):
                             those, in auto mode.
``K3_AMD_OVERLAY_STRICT``    ``1`` (default): a requested fusion this vLLM cannot take raises;
                             ``0``: warn, leave it stock, record it as refused.
``K3_AMD_OVERLAY_MARKER_DIR``  where per-process evidence markers go (default: a 0700 per-user
                             directory).
``K3_AMD_OVERLAY_<FUSION>_PROVIDER``  force one provider for a fusion (default ``auto``).
``K3_AMD_OVERLAY_KERNEL_CONFIGS``  a launch-config file written by ``k3-amd-overlay tune``, or a
                             directory of them (the one tuned on this GPU is used); default: the
                             package's file for the GPU's arch.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from k3_amd_overlay.package import AUTO, FUSIONS, PROVIDERS

SWITCH = "K3_AMD_OVERLAY"
STRICT = "K3_AMD_OVERLAY_STRICT"
MARKER_DIR = "K3_AMD_OVERLAY_MARKER_DIR"
KERNEL_CONFIGS = "K3_AMD_OVERLAY_KERNEL_CONFIGS"
ENV_PREFIX = SWITCH  # every variable of the overlay starts with this; Ray forwarding relies on it

PROVIDER_SETTINGS: dict[str, tuple[str, ...]] = {f: (AUTO, *names) for f, names in PROVIDERS.items()}


def provider_variable(fusion: str) -> str:
    return f"{SWITCH}_{fusion.upper()}_PROVIDER"


KNOWN_VARIABLES = frozenset({SWITCH, STRICT, MARKER_DIR, KERNEL_CONFIGS, *(provider_variable(f) for f in FUSIONS)})


class Mode(str, enum.Enum):
    OFF = "off"
    AUTO = "auto"
    STOCK = "stock"


class SettingsError(ValueError):
    """A K3_AMD_OVERLAY* variable holds a value the overlay does not accept."""


@dataclass(frozen=True)
class OverlaySettings:
    """The switch as parsed: what to do, for which fusions, how strictly, and where to report."""

    mode: Mode = Mode.OFF
    fusions: frozenset[str] = frozenset()
    strict: bool = True
    marker_dir: str | None = None
    providers: Mapping[str, str] = field(default_factory=dict)
    raw: str = ""
    unknown_variables: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.mode is not Mode.OFF

    def requested(self, fusion: str) -> bool:
        return fusion in self.fusions

    def provider(self, fusion: str) -> str:
        return self.providers.get(fusion, AUTO)

    def ineffective_providers(self) -> list[str]:
        """Each provider variable naming a provider for a fusion this switch does not fuse (not asked
        for, or stock mode), with why it has no effect: worth a warning, as a likely mistake."""
        if self.mode is Mode.OFF:
            return []
        why = {f: "stock mode runs every fusion unfused" if self.mode is Mode.STOCK
               else f"{f} is not switched on" for f in FUSIONS}
        return [f"{provider_variable(f)}={p} has no effect with {SWITCH}={self.raw!r} ({why[f]})"
                for f, p in self.providers.items() if p != AUTO and (self.mode is Mode.STOCK or f not in self.fusions)]


def _valid_switch_values() -> str:
    names = ", ".join(FUSIONS)
    return f"'0' (off), '1' (all fusions), 'stock' (force unfused), or a comma list of: {names}"


def parse_switch(raw: str) -> tuple[Mode, frozenset[str]]:
    value = raw.strip()
    if value in ("", "0"):
        return Mode.OFF, frozenset()
    if value == "1":
        return Mode.AUTO, frozenset(FUSIONS)
    if value == "stock":
        return Mode.STOCK, frozenset(FUSIONS)
    names = [part.strip() for part in value.split(",")]
    whole = [name for name in names if name in ("0", "1", "stock")]
    unknown = [name for name in names if name and name not in FUSIONS and name not in whole]
    problems = [f"unknown: {', '.join(map(repr, unknown))}"] if unknown else []
    if whole:
        verb = "stands" if len(whole) == 1 else "stand"
        problems.append(f"{' and '.join(map(repr, whole))} {verb} alone, never in a list")
    if "" in names:
        problems.append("an empty name: a stray comma?")
    if problems:
        raise SettingsError(f"{SWITCH}={raw!r} is not valid ({'; '.join(problems)}); allowed: {_valid_switch_values()}")
    return Mode.AUTO, frozenset(names)


def _parse_strict(raw: str | None) -> bool:
    if raw is None or raw.strip() == "1":
        return True
    if raw.strip() == "0":
        return False
    raise SettingsError(f"{STRICT}={raw!r} is not valid; allowed: '1' (default, raise) or '0' (warn)")


# Each path variable: what it names, and what runs where it is unset.
_PATH_VARIABLES = {MARKER_DIR: ("directory", "the per-user directory"),
                   KERNEL_CONFIGS: ("file or directory", "the shipped launch configs")}


def parse_path(variable: str, raw: str | None) -> str | None:
    """A path variable's value (None: unset or empty, its default); SettingsError for a blank value,
    which would name a path of spaces relative to each process's own directory."""
    names, default = _PATH_VARIABLES[variable]
    if raw and not raw.strip():
        raise SettingsError(f"{variable}={raw!r} names no {names}; unset it for {default}")
    if raw and raw != raw.strip():  # ' /tmp/x' is a path relative to each process's own directory
        raise SettingsError(f"{variable}={raw!r}: spaces before or after the path; give {raw.strip()!r}")
    return raw or None


def _parse_provider(fusion: str, raw: str | None) -> str:
    if raw is None:
        return AUTO
    value = raw.strip()
    if value not in PROVIDER_SETTINGS[fusion]:
        raise SettingsError(
            f"{provider_variable(fusion)}={raw!r} is not valid; "
            f"allowed: {', '.join(PROVIDER_SETTINGS[fusion])}"
        )
    return value


def load_settings(environ: Mapping[str, str] | None = None) -> OverlaySettings:
    """Parse every K3_AMD_OVERLAY* variable; raise SettingsError naming a bad value and the valid ones.

    Unknown K3_AMD_OVERLAY_* variables are an error while the overlay is on (a misspelt
    ``K3_AMD_OVERLAY_STRCT=0`` must not silently do the opposite of what was meant) and are
    returned in ``unknown_variables`` for a warning while it is off.
    """
    env = os.environ if environ is None else environ
    raw = env.get(SWITCH, "")
    mode, fusions = parse_switch(raw)
    parse_path(KERNEL_CONFIGS, env.get(KERNEL_CONFIGS))  # checked only: the launch configs read it themselves
    # any case: a lowercase k3_amd_overlay_strict=0 is as surely meant as the real name, and as surely ignored
    unknown = tuple(sorted(k for k in env if k.upper().startswith(SWITCH) and k not in KNOWN_VARIABLES))
    if unknown and mode is not Mode.OFF:
        raise SettingsError(
            f"unknown overlay variable(s) {', '.join(unknown)}; "
            f"known (upper case): {', '.join(sorted(KNOWN_VARIABLES))}"
        )
    return OverlaySettings(
        mode=mode,
        fusions=fusions,
        strict=_parse_strict(env.get(STRICT)),
        marker_dir=parse_path(MARKER_DIR, env.get(MARKER_DIR)),
        providers={f: _parse_provider(f, env.get(provider_variable(f))) for f in FUSIONS},
        raw=raw,
        unknown_variables=unknown,
    )
