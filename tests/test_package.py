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
    from k3_amd_overlay.targets import attend_hook, norm_hook

    keys = {spec.key for _, spec in _all_specs()} | {attend_hook.REGISTER_KEY, norm_hook.REGISTER_KEY}  # class swaps
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


CHECKOUT = Path(__file__).resolve().parent.parent


def test_the_version_is_newer_than_the_last_release():
    """Between releases the version carries a dev suffix above the last release (0.2.0), so a newer
    wheel always installs over an older one: pip treats an equal version as already installed."""
    from packaging.version import Version

    from k3_amd_overlay.package import __version__

    version = Version(__version__)  # raises InvalidVersion for a string pip cannot order
    assert str(version) == __version__, f"{__version__!r} is not in normalised form ({version})"
    assert version > Version("0.2.0"), __version__


def test_extras_whose_api_the_tools_use_are_bounded_above():
    """gsm8k-ab reads lm-eval's --log_samples files and the plots use matplotlib's pyplot: a next
    major (minor, for 0.x lm-eval) release may change them, so each extra naming them is bounded."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    extras = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bounds = {"lm-eval": Version("0.5"), "matplotlib": Version("4")}
    seen = set()
    for extra, requirements in extras.items():
        for requirement in map(Requirement, requirements):
            if requirement.name in bounds:
                seen.add(requirement.name)
                uppers = [Version(s.version) for s in requirement.specifier if s.operator == "<"]
                assert uppers and min(uppers) <= bounds[requirement.name], f"[{extra}] {requirement}: no upper bound"
    assert seen == set(bounds), seen


def _module_map() -> list[tuple[str, str]]:
    """docs/architecture.md's module map: (entry, its text) for each entry under k3_amd_overlay/,
    an entry being a name at two spaces' indent (a module or a folder/) or, under a folder, at four
    (a module of that folder: ``folder/name.py``); the text runs to the next entry."""
    text = (CHECKOUT / "docs" / "architecture.md").read_text()
    block = re.search(r"^```\nk3_amd_overlay/\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "docs/architecture.md: no module map (a code block starting with k3_amd_overlay/)"
    entries: list[tuple[str, str]] = []
    folder = ""
    for line in block.group(1).splitlines():
        if not line.startswith(" "):
            break  # the next tree (tests/) is not the package's
        top = re.match(r"  (\S+)(?:\s|$)", line)
        nested = re.match(r"    (\S+\.py)(?:\s|$)", line)
        if top:
            folder = top.group(1) if top.group(1).endswith("/") else ""
            entries.append((top.group(1), line))
        elif nested and folder:
            entries.append((folder + nested.group(1), line))
        else:
            name, said = entries[-1]
            entries[-1] = (name, said + "\n" + line)
    return entries


def test_the_module_map_names_every_module_and_only_modules_that_exist():
    """docs/architecture.md's map cannot go stale: each module of the package has its entry (a
    folder's modules at least named in their folder's entry), and each name in it exists."""
    package = CHECKOUT / "k3_amd_overlay"
    entries = _module_map()
    names = [name for name, _ in entries]
    assert len(names) == len(set(names)), f"named twice: {sorted(n for n in names if names.count(n) > 1)}"
    problems = []
    for name, said in entries:
        if not (package / name).exists():
            problems.append(f"the map names {name}, which does not exist")
        if name.endswith("/"):
            problems += [f"the map's {name} names {name}{ref}, which does not exist"
                         for ref in re.findall(r"\b(\w+\.py)\b", said)
                         if not any((package / name).rglob(ref))]  # in the folder or one below it (commands/bench/)
    texts = dict(entries)
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if path.name in ("__init__.py", "__main__.py") or module in texts:
            continue
        parts = module.split("/")[:-1]  # its folders, the deepest first: commands/bench/, then commands/
        folders = ["/".join(parts[:n]) + "/" for n in range(len(parts), 0, -1)]
        if not any(re.search(rf"\b{re.escape(path.stem)}\b", texts.get(folder, "")) for folder in folders):
            problems.append(f"{module} is missing from the map")
    assert not problems, "docs/architecture.md module map:\n" + "\n".join(problems)


def test_the_runtime_never_imports_the_commands_package():
    """What runs inside vLLM processes (every module outside k3_amd_overlay/commands/) imports no
    command module, at module level or inside a function: read from each module's syntax tree, and
    seen after importing them all in one fresh interpreter."""
    import ast

    package = Path(k3_amd_overlay.__file__).parent
    runtime = [p for p in sorted(package.rglob("*.py")) if "commands" not in p.relative_to(package).parts
               and p.name != "__main__.py"]
    assert len(runtime) > 30
    found = []
    for path in runtime:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(package)}: {n}" for n in names
                      if n.startswith("k3_amd_overlay.commands") or n == "k3_amd_overlay.commands"]
    assert found == []
    modules = [".".join(("k3_amd_overlay", *p.relative_to(package).with_suffix("").parts)).removesuffix(".__init__")
               for p in runtime]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError as exc:\n"
            "        if 'vllm' not in str(exc) and 'aiter' not in str(exc):\n"
            "            raise\n"
            "print(sorted(m for m in sys.modules if m.startswith('k3_amd_overlay.commands')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_release_files_hold_every_minor_release_of_the_declared_range_and_the_next():
    """scripts/vllm-versions.txt says it holds every release of SUPPORTED_VLLM's range (one per minor)
    and scripts/beyond-range-vllm.txt the first above it: both checked against package.py's range."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    from releases import MATRIX

    from k3_amd_overlay.package import SUPPORTED_VLLM

    spec = Requirement(SUPPORTED_VLLM).specifier
    inside = [f"0.{m}" for m in range(100) if Version(f"0.{m}.0") in spec]
    assert [".".join(v.split(".")[:2]) for v in MATRIX] == inside, (MATRIX, SUPPORTED_VLLM)
    assert all(Version(v) in spec for v in MATRIX), MATRIX
    beyond = [line.strip() for line in (Path(__file__).resolve().parents[1] / "scripts/beyond-range-vllm.txt")
              .read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert len(beyond) == 1 and Version(beyond[0]) not in spec
    assert Version(beyond[0]).release[:2] == (0, int(inside[-1].split(".")[1]) + 1), beyond


def test_a_venv_build_that_fails_again_fails_the_setup_and_is_never_marked_complete(tmp_path: Path):
    """scripts/setup_venvs.sh builds a failed venv once more (a download cut short passes then); a build
    that fails twice fails the setup, with no .complete stamp that would let the next run skip it."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"python $*\" >> \"$(dirname \"$0\")/calls\"\nexit 1\n")
    python.chmod(0o755)
    script = Path(__file__).resolve().parents[1] / "scripts/setup_venvs.sh"
    env = {**os.environ, "PYTHON": str(python), "K3OVL_INSTALLER": "pip",
           "K3OVL_VENV_ROOT": str(tmp_path / "venvs"), "K3OVL_WHEEL_CACHE": str(tmp_path / "wheels")}
    proc = subprocess.run(["bash", str(script), "0.32.0"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert proc.stdout.count("[setup] vllm 0.32.0: building") == 2, proc.stdout
    assert "failed; building it once more" in proc.stdout, proc.stdout
    assert (tmp_path / "calls").read_text().count("-m venv") == 2
    assert not (tmp_path / "venvs/vllm-0.32.0/.complete").exists()
