#!/usr/bin/env bash
# The main job, on a CPU machine with real vLLM: build a venv for one vLLM release (default
# 0.33.0), install the overlay wheel, switch the overlay on and run `k3-amd-overlay doctor`:
# what this vLLM fuses by itself, what the overlay patched and why, every reachable provider
# against its reference at K3 shapes (the fused paths of real layers and servers are what
# `k3-amd-overlay check` proves against running vLLM processes).
#   scripts/main.sh [doctor options]       K3OVL_MAIN_VLLM=0.29.0 picks another release
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
version=${K3OVL_MAIN_VLLM:-0.33.0}
venv=${K3OVL_VENV_ROOT:-$repo/.venvs}/vllm-$version
"$repo/scripts/setup_venvs.sh" "$version" 2>&1 | grep -v "WARNING: Location"
"$repo/scripts/install_overlay.sh" "$venv"
cd "$(mktemp -d)"
export K3_AMD_OVERLAY=${K3_AMD_OVERLAY:-1} VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1
exec "$venv/bin/k3-amd-overlay" doctor "$@"
