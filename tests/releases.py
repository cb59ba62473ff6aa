"""The vLLM releases of the test matrix and their source trees on disk (the matrix venvs that
scripts/setup_venvs.sh builds), read without importing vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MATRIX = [line.strip() for line in (REPO / "scripts/vllm-versions.txt").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
VENV_ROOT = Path(os.environ.get("K3OVL_VENV_ROOT", REPO / ".venvs"))


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def tree_of(version: str) -> Path:
    """The ``vllm`` package directory of that release's venv; skips where the venv is absent."""
    found = sorted((VENV_ROOT / f"vllm-{version}" / "lib").glob("python*/site-packages/vllm"))
    if not found:
        pytest.skip(f"no vLLM {version} venv under {VENV_ROOT} (scripts/setup_venvs.sh builds it)")
    return found[0]
