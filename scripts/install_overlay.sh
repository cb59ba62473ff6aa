#!/usr/bin/env bash
# Build the k3-amd-overlay wheel from this checkout and install it (no dependencies touched,
# reinstalled every time) into each given venv. The tests and the doctor run against this wheel,
# not the source tree, so a packaging mistake fails them.
#   scripts/install_overlay.sh VENV [VENV ...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || { echo "usage: $0 VENV [VENV ...]" >&2; exit 2; }
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
rm -rf "$repo/build"  # setuptools builds in-tree: a stale build/ would ship modules since removed
"$1/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dist" "$repo" 2>&1 | grep -v "WARNING: Location" || true
wheel=$(ls "$dist"/k3_amd_overlay-*.whl)
for venv in "$@"; do
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel" 2>&1 \
    | grep -v "WARNING: Location" || true
  echo "[install] $(basename "$wheel") -> $venv"
done
