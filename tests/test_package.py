"""Packaging facts: cheap imports that never pull in vLLM or AITER; the tests run against the
installed wheel; every patch the code can install has its entry in docs/patches.md, and back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import k3_amd_overlay
from k3_amd_overlay.engine import PatchSpec

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("module", ["k3_amd_overlay", "k3_amd_overlay.ops", "k3_amd_overlay.plugin"])
def test_imports_never_pull_in_vllm_or_aiter(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'aiter', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plugin_off_imports_nothing_heavy():
    code = ("import sys; from k3_amd_overlay.plugin import register; register(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'wrapt')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_AMD_OVERLAY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "[]"


def test_tests_run_against_the_installed_wheel():
    if os.environ.get("K3OVL_EXPECT_INSTALLED") != "1":
        pytest.skip("set by scripts/run_tests.sh, which installs the built wheel into each venv")
    assert "site-packages" in k3_amd_overlay.__file__


def _all_specs() -> list[PatchSpec]:
    from k3_amd_overlay.evidence import Evidence
    from k3_amd_overlay.settings import load_settings
    from k3_amd_overlay.targets.installer import LayerInstaller
    from k3_amd_overlay.targets.shapes import VLLM_SHAPES

    specs = []
    for switch in ("1", "stock"):
        settings = load_settings({"K3_AMD_OVERLAY": switch, "K3_AMD_OVERLAY_MARKER_DIR": "/nonexistent/k3"})
        installer = LayerInstaller(settings, Evidence(settings))
        for shape in VLLM_SHAPES:
            for spec in shape.build(installer, settings.fusions):
                specs.append((shape.name, spec))
    return specs


def test_every_patch_has_a_register_entry_and_every_entry_a_patch():
    text = (DOCS / "patches.md").read_text()
    entries = dict(re.findall(r"^### `([^`]+)`\n(.*?)(?=^### |\Z)", text, flags=re.S | re.M))
    from k3_amd_overlay.targets import attend_hook

    keys = {spec.key for _, spec in _all_specs()} | {attend_hook.REGISTER_KEY}  # the per-instance class swap
    assert set(entries) == keys
    for key, body in entries.items():
        for field in ("**Target**", "**vLLM**", "**Why**", "**How**", "**Mirrors upstream**", "**Remove when**"):
            assert field in body, f"{key}: missing {field}"
    for shape, spec in _all_specs():
        assert spec.target.split(":")[1] in entries[spec.key], (shape, spec.key)


def test_the_package_ships_no_test_scaffolding():
    """Stand-ins and harnesses live under tests/; nothing in the wheel exists only for tests."""
    package = Path(k3_amd_overlay.__file__).resolve().parent
    names = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    assert not any("testing" in n or "standin" in n or "harness" in n for n in names), sorted(names)
    source = "\n".join(p.read_text() for p in package.rglob("*.py"))
    assert "k3_standin" not in source and "pytest" not in source


def test_the_wheel_carries_its_license_and_type_marker():
    from importlib import metadata

    files = {str(f) for f in metadata.distribution("k3-amd-overlay").files or []}
    assert any(f.endswith("LICENSE") for f in files), sorted(files)
    assert "k3_amd_overlay/py.typed" in files
    meta = metadata.metadata("k3-amd-overlay")
    assert meta["License-Expression"] == "Apache-2.0" and "Typing :: Typed" in meta.get_all("Classifier")
    assert {"plot", "gsm8k", "tools"} <= set(meta.get_all("Provides-Extra"))


@pytest.mark.parametrize("tool", ["ab-serve", "gsm8k-ab", "bench"])
def test_each_operator_tool_is_a_subcommand_of_the_installed_cli(tool):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "k3_amd_overlay", tool, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: k3-amd-overlay {tool}"), proc.stderr
    top = subprocess.run([sys.executable, "-m", "k3_amd_overlay", "--help"], capture_output=True, text=True).stdout
    assert tool in top
