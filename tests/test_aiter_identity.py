"""Which AITER a process would import (versions.aiter_identity), found without importing it, and the
self-measurement's ``aiter`` condition built on it: a file measured with one AITER is not used by a
process that would load another (stock's fp8 absorption is AITER's fp8 BMM, so its times were of
that AITER), nor where the process cannot tell."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
from installed_distributions import InstalledOnly

from k3_amd_overlay import measured, versions
from k3_amd_overlay.package import QK_CACHE, __version__
from k3_amd_overlay.settings import KERNEL_CONFIGS

ARCH, DEVICE = "gfx942", "AMD Instinct MI300X"


def tree(root, name: str = "tree"):
    """A source tree holding an ``aiter`` package whose import fails loudly (so a test sees any import)."""
    package = root / name / "aiter"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('aiter was imported')\n")
    return package


@pytest.fixture
def path_of(monkeypatch):
    """sys.path with the given directories first and no other ``aiter`` on it, none imported."""
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    others = [p for p in sys.path if not (Path(p or ".") / "aiter").exists()]

    def put(*directories) -> None:
        monkeypatch.setattr(sys, "path", [*(str(d) for d in directories), *others])
        importlib.invalidate_caches()
    return put


def test_no_aiter_package_reads_not_installed(tmp_path, path_of):
    path_of(tmp_path)
    assert versions.aiter_identity() == versions.AITER_ABSENT == "not installed"


def test_a_source_tree_without_a_distribution_is_named_by_its_directory_and_not_imported(tmp_path, path_of,
                                                                                         monkeypatch):
    monkeypatch.setattr(versions, "metadata", InstalledOnly({}))
    package = tree(tmp_path)
    path_of(package.parent)
    assert versions.aiter_identity() == f"unversioned at {package}"
    assert "aiter" not in sys.modules


@pytest.mark.parametrize("installed,version", [({"amd-aiter": "0.1.7.dev3+g1a2b3c", "aiter": "0.0.1"},
                                                "0.1.7.dev3+g1a2b3c"),
                                               ({"aiter": "0.0.1"}, "0.0.1")], ids=["amd-aiter", "aiter"])
def test_an_installed_distribution_gives_its_version_and_the_package_directory(tmp_path, path_of, monkeypatch,
                                                                               installed, version):
    monkeypatch.setattr(versions, "metadata", InstalledOnly(installed))
    package = tree(tmp_path)
    path_of(package.parent)
    assert versions.installed_aiter_version() == version
    assert versions.aiter_identity() == f"{version} at {package}"


def test_a_broken_aiter_entry_cannot_be_told(monkeypatch):
    half = types.ModuleType("aiter")
    half.__spec__ = None
    monkeypatch.setitem(sys.modules, "aiter", half)
    assert versions.aiter_identity() is None


class _Failing:
    """A meta-path finder that fails (a broken import hook): looking for AITER raises."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "aiter":
            raise RuntimeError("broken finder")
        return None


def test_a_finder_that_fails_or_a_spec_with_no_place_cannot_be_told_and_never_raises(monkeypatch):
    """The server reads this at its first K3 layer: an exception there would stop the model build."""
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Failing(), *sys.meta_path])
    assert versions.aiter_identity() is None
    assert measured.conditions(ARCH, DEVICE)["aiter"] is None
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])
    placeless = types.ModuleType("aiter")
    placeless.__spec__ = importlib.machinery.ModuleSpec("aiter", None)  # no origin, no search locations
    monkeypatch.setitem(sys.modules, "aiter", placeless)
    assert versions.aiter_identity() is None  # not "unversioned at None", which two such processes would share


def test_a_file_measured_with_another_aiter_tree_is_not_used(tmp_path, path_of, monkeypatch):
    """The stale case: `measure` ran with one AITER tree on the path; the server would load another."""
    monkeypatch.delenv(KERNEL_CONFIGS, raising=False)
    monkeypatch.setattr(versions, "metadata", InstalledOnly({}))
    first, second = tree(tmp_path, "first"), tree(tmp_path, "second")
    path_of(first.parent)
    written = measured.Measurement(path="", arch=ARCH, device=DEVICE, date="2026-12-05T10:00:00+00:00",
                                   overlay_version=__version__, stock="words", seed=1,
                                   rows=(measured.Row(QK_CACHE, 8, 12, "fp8", True, 6.0, 4.0),),
                                   **measured.conditions(ARCH, DEVICE))
    assert written.aiter == f"unversioned at {first}"
    path = tmp_path / measured.result_name(ARCH, DEVICE)
    path.write_text(json.dumps(written.to_json()))
    environ = {KERNEL_CONFIGS: str(tmp_path)}
    same = measured.load_here(ARCH, DEVICE, environ)
    assert same.error is None and same.measurement is not None
    path_of(second.parent)
    moved = measured.load_here(ARCH, DEVICE, environ)
    assert moved.measurement is None and moved.error == (
        f"{path}: field 'aiter' is 'unversioned at {first}', this process's is 'unversioned at {second}': this "
        "process does not run the kernels it timed; run `k3-amd-overlay measure` again")
    path_of(tmp_path / "nowhere")
    assert measured.load_here(ARCH, DEVICE, environ).error == (
        f"{path}: field 'aiter' is 'unversioned at {first}', this process's is 'not installed': this "
        "process does not run the kernels it timed; run `k3-amd-overlay measure` again")
    assert "aiter" not in sys.modules


def test_a_configs_path_that_cannot_be_looked_at_uses_no_measurement_and_says_why():
    """``load_here`` never raises: an OSError from looking at the configured path (too long here)
    escaped it into vLLM's layer build."""
    setting = "/tmp/" + "x" * 300
    loaded = measured.load_here(ARCH, DEVICE, {KERNEL_CONFIGS: setting})
    assert loaded.measurement is None and loaded.path is None
    assert loaded.error.startswith(f"{KERNEL_CONFIGS}={setting}: cannot be looked in ([Errno 36] File name too long")
    assert loaded.error.endswith("); no self-measurement is used")
