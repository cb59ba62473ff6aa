#!/usr/bin/env bash
# Set up one venv per supported vLLM (scripts/setup_venvs.sh), install the built overlay wheel in
# each, lint, and run the whole suite in each venv against the installed wheel (from a scratch
# directory, so the source tree is never imported). Prints one summary line at the end.
#   scripts/run_tests.sh [VERSION ...]     default: scripts/vllm-versions.txt
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv_root=${K3OVL_VENV_ROOT:-$repo/.venvs}
if [ $# -gt 0 ]; then versions=("$@"); else mapfile -t versions < <(grep -v '^#' "$repo/scripts/vllm-versions.txt"); fi
"$repo/scripts/setup_venvs.sh" "${versions[@]}" 2>&1 | grep -v "WARNING: Location" || exit 1
venvs=()
for v in "${versions[@]}"; do venvs+=("$venv_root/vllm-$v"); done
"$repo/scripts/install_overlay.sh" "${venvs[@]}" || exit 1

status=0
"${venvs[0]}/bin/python" -m pip install -q --disable-pip-version-check "ruff>=0.6" 2>&1 | grep -v "WARNING: Location"
if "${venvs[0]}/bin/ruff" check "$repo"; then echo "[lint] ruff clean"; else echo "[lint] ruff found problems"; status=1; fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
passed=0; failed=0; skipped=0
for i in "${!versions[@]}"; do
  v=${versions[$i]}; venv=${venvs[$i]}
  echo "=== vLLM $v: pytest against the installed wheel"
  log="$scratch/pytest-$v.log"
  (cd "$scratch" && K3OVL_EXPECT_INSTALLED=1 VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 \
     "$venv/bin/pytest" -q -p no:cacheprovider -rs "$repo/tests") 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  last=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -n1)
  for kind in passed failed skipped; do
    n=$(echo "$last" | grep -oE "[0-9]+ $kind" | grep -oE '[0-9]+' || echo 0)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
done
echo "summary over vLLM ${versions[*]}:"
echo "$passed passed, $failed failed, $skipped skipped"
exit $status
