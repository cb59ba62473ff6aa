#!/usr/bin/env bash
# Mutation testing of the patch layer and the proof with mutmut (2.5.1), against real vLLM on CPU.
# Mutates a fresh clone of this checkout (never the working tree); for each mutant it runs the
# tests that cover that module, with the clone first on PYTHONPATH so the mutated source is the
# one imported (in subprocesses too); prints the kill ratio per module and every survivor's diff.
# Not part of CI (hours for the whole list on 2 cores); results go to docs/verification.md.
# Each module's mutmut cache is kept in .mutants/ (ignored by git): a second run resumes, keeps the
# mutants already killed whose line is unchanged, and tests every other mutant (survivors too)
# again. Delete .mutants/ for a run from scratch. mutmut 2.5.1 keys a mutant by its line's text, so
# mutants on a line whose text repeats (a lone ")") can stay untested: scripts/mutmut_repeated_lines.py
# applies those one at a time.
#   scripts/mutants.sh [MODULE ...]      default: every module below; e.g. scripts/mutants.sh verdict.py
# Environment: K3OVL_MUTANTS_VLLM (default 0.33.0), K3OVL_VENV_ROOT (as scripts/setup_venvs.sh),
# K3OVL_MUTANTS_FAST=1 (leave out the tests that need vLLM, and vLLM's import, per mutant: seconds
# instead of tens of seconds; a weaker run for the modules vLLM tests cover, which the results
# table must then say), K3OVL_MUTANTS_TESTS (the tests instead of the module's list, e.g. the files
# that existed before a module's new tests, for a "before" score; the cache then resumes with the
# full list), K3OVL_MUTANTS_LIMIT (seconds per module, default 5400: mutmut 2.5.1 has
# hung mid-run here; the mutants it tested by then are still counted, the rest reported untested),
# K3OVL_MUTANTS_FORKED=1 (mutmut's mutants, each tested in a child forked from one process that imported
# torch and Triton once: scripts/mutmut_forked.py; about 10x faster here, no resumable cache, outcomes
# in .mutants/<module>.forked.json; K3OVL_MUTANTS_PRELOAD names more modules to import once).
set -uo pipefail

cache_db() {  # COMMAND [ARG]: scripts/mutmut_cache.py on the cache in the current directory
  "$tool/bin/python" "$repo/scripts/mutmut_cache.py" "$@"
}

# mutmut 2.5.1 feeds mutants to its runner from a second process; when that process dies, mutmut
# waits forever with no test running. Such a stall (no runner for 60 s) is stopped and mutmut
# started again: it resumes from its cache. Ends when every mutant is tested or the module's time
# (K3OVL_MUTANTS_LIMIT) is spent.
run_mutmut() {  # MODULE RUNNER
  local module=$1 runner=$2 deadline=$((SECONDS + ${K3OVL_MUTANTS_LIMIT:-5400})) pid idle stalled first
  local last_stall=""
  while [ "$SECONDS" -lt "$deadline" ]; do
    timeout $((deadline - SECONDS)) "$tool/bin/mutmut" run --paths-to-mutate "k3_amd_overlay/$module" \
      --runner "$runner" --test-time-base 60 --no-progress >/dev/null 2>&1 &
    pid=$!
    idle=0
    stalled=0
    while kill -0 "$pid" 2>/dev/null; do
      sleep 10
      # the runner itself (mutmut's own command line names it too)
      if pgrep -f "^$venv/bin/python $work/clone/scripts/mutant_runner.py k3_amd_overlay/$module " >/dev/null
      then idle=0; else idle=$((idle + 1)); fi
      if [ "$idle" -ge 6 ]; then
        stalled=1
        pkill -P "$pid"
        kill "$pid" 2>/dev/null
        break
      fi
    done
    wait "$pid" 2>/dev/null
    git checkout -q -- "k3_amd_overlay/$module"  # a stopped mutmut leaves its last mutant in the file
    [ "$stalled" = 1 ] && [ "$(cache_db untested)" != 0 ] || break
    first=$(cache_db first-untested)
    if [ "$first" = "${last_stall:-}" ]; then  # stalled twice on the same mutant: leave it out
      cache_db skip "$first" >/dev/null
      echo "(mutmut stalled twice on mutant $first of $module; left out, reported as not tested)"
    else
      echo "(mutmut stalled on $module; resuming from its cache)"
    fi
    last_stall=$first
  done
}

main() {
repo=$(cd "$(dirname "$0")/.." && pwd)
venv_root=${K3OVL_VENV_ROOT:-$repo/.venvs}
version=${K3OVL_MUTANTS_VLLM:-0.33.0}
venv="$venv_root/vllm-$version"
tool="$venv_root/mutmut"

# module (under k3_amd_overlay/) -> the tests that cover it; a word starting with "-" is a pytest option
# (the compile report's own run takes minutes: each mutant of the modules it reaches would pay it)
NO_COMPILE_REPORT=--deselect=tests/test_launch_configs.py::test_the_report_compiles_every_kernel_for_mi300x_with_the_fields_promised
# the statistics tests of the A/B files (their harness tests start stand-in servers: minutes, and no statistics)
AB_STATISTICS="test_ab.py::test_paired_serving_statistics_on_known_sets test_ab.py::test_sign_flip_p_by_hand
  test_ab.py::test_the_serving_table_and_its_json test_ab.py::test_mcnemar_exact_p_values_known_by_hand
  test_ab.py::test_paired_accuracy_finds_what_an_unpaired_se_misses
  test_ab_runs.py::test_default_repeats_can_reach_a_verdict
  test_ab_runs.py::test_the_table_says_when_n_cannot_give_a_verdict
  test_ab_runs.py::test_six_pairs_can_give_a_verdict_and_carry_no_note
  test_ab_runs.py::test_paired_accuracy_says_when_too_few_questions_differ"
declare -A TESTS=(
  [fusions/qk_cache.py]="test_field_faults.py test_predicates.py"
  [fusions/qkv_norm.py]="test_field_faults.py test_predicates.py"
  [fusions/states.py]="test_predicates.py test_evidence.py"
  [targets/installer.py]="test_installer.py test_field_faults.py test_predicates.py test_vllm_layer.py"
  [targets/decode.py]="test_sites.py test_installer.py test_field_faults.py test_predicates.py test_vllm_layer.py"
  [targets/norm.py]="test_sites.py test_field_faults.py test_vllm_layer.py"
  [targets/vllm_env.py]="test_vllm_layer.py test_installer.py test_predicates.py test_field_faults.py"
  [targets/k3_wrapper.py]="test_sites.py test_vllm_layer.py test_field_faults.py"
  [targets/plain_wrapper.py]="test_sites.py test_field_faults.py test_vllm_layer.py"
  [targets/attend_hook.py]="test_sites.py test_field_faults.py test_vllm_layer.py"
  [targets/norm_hook.py]="test_sites.py test_vllm_layer.py"
  [targets/class_swap.py]="test_sites.py test_vllm_layer.py"
  [targets/shapes.py]="test_shapes.py test_field_faults.py test_vllm_layer.py"
  [targets/sources.py]="test_shapes.py test_field_faults.py test_vllm_layer.py"
  [targets/defects.py]="test_shapes.py test_vllm_layer.py"
  [engine.py]="test_engine.py"
  [activation.py]="test_activation.py test_field_faults.py test_vllm_plugin.py"
  [settings.py]="test_settings.py"
  [commands/verdict.py]="test_evidence.py test_field_faults.py test_check_merge.py test_check_merge_bounds.py test_verdict_contract.py test_check_json.py"
  [record.py]="test_evidence.py test_field_faults.py test_census.py"
  [markers.py]="test_evidence.py test_field_faults.py"
  [evidence.py]="test_evidence.py"
  [phases.py]="test_evidence.py"
  [commands/census.py]="test_census.py test_field_faults.py test_census_contract.py test_census_attribution.py test_census_evidence_edges.py"
  # added since the last release (issue 27): CPU tests through fakes (tests/fakes_gpu.py) of what runs on a GPU
  [kernel_failures.py]="test_kernel_failures_containment.py test_launch_configs.py $NO_COMPILE_REPORT"
  [kernels/launch.py]="test_launch_dispatch.py test_launch_configs.py $NO_COMPILE_REPORT"
  [kernels/probe.py]="test_probe_sampling.py test_launch_configs.py $NO_COMPILE_REPORT"
  [commands/tune.py]="test_tune_choice.py test_launch_configs.py test_tune_case.py $NO_COMPILE_REPORT"
  [commands/bench/timing.py]="test_tune_timing.py"
  [commands/ab_stats.py]="test_ab_stats_sets.py $AB_STATISTICS"
)
# modules whose code only some releases run: mutated against such a release, not K3OVL_MUTANTS_VLLM
declare -A VLLM_FOR=(
  [targets/plain_wrapper.py]=0.29.0  # the shared-wrapper subclass: vLLM 0.29 only
  [targets/norm_hook.py]=0.29.0  # the qkv_norm range around the stock norms: bound on 0.29 only
)
if [ $# -gt 0 ]; then modules=("$@"); else mapfile -t modules < <(printf '%s\n' "${!TESTS[@]}" | sort); fi

prepare_venv() {  # VERSION: the matrix venv, with pytest-cov (it maps each test to the lines it executes)
  "$repo/scripts/setup_venvs.sh" "$1" 2>&1 | grep -v "WARNING: Location" || exit 1
  "$venv_root/vllm-$1/bin/python" -c "import pytest_cov" 2>/dev/null || "$venv_root/vllm-$1/bin/python" -m pip \
    install -q --disable-pip-version-check pytest-cov 2>&1 | grep -v "WARNING: Location"
}
prepare_venv "$version"
if [ ! -x "$tool/bin/mutmut" ]; then
  python3 -m venv "$tool" && "$tool/bin/python" -m pip install -q --disable-pip-version-check "mutmut==2.5.1" \
    2>&1 | grep -v "WARNING: Location"
fi
keep="$repo/.mutants"
mkdir -p "$keep"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/clone"
cd "$work/clone" || exit 1

report=()
for module in "${modules[@]}"; do
  tests=${K3OVL_MUTANTS_TESTS:-${TESTS[$module]:-}}
  # a module only one release runs is mutated against that release
  release=${VLLM_FOR[$module]:-$version}
  venv="$venv_root/vllm-$release"
  [ "$release" = "$version" ] || prepare_venv "$release"
  [ -n "$tests" ] || { echo "unknown module $module; known: ${!TESTS[*]}" >&2; exit 2; }
  targets=$(for t in $tests; do case $t in -*) printf '%s ' "$t" ;; *) printf '%s ' "$work/clone/tests/$t" ;; esac; done)
  fast=""
  [ "${K3OVL_MUTANTS_FAST:-0}" = 1 ] && fast="K3OVL_TESTS_WITHOUT_VLLM=1"
  environment="env PYTHONPATH=$work/clone K3OVL_VENV_ROOT=$venv_root VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $fast"
  coverage="$work/coverage-${module//\//-}"
  cache="$keep/${module//\//-}.sqlite"
  rm -f .mutmut-cache "$coverage"
  if [ -f "$cache" ]; then  # resume: keep the kills, test every survivor again
    cp "$cache" .mutmut-cache
    cache_db retest-survivors >/dev/null
  fi
  echo "=== k3_amd_overlay/$module against $tests"
  if [ "${K3OVL_MUTANTS_FORKED:-0}" = 1 ]; then  # every mutant in a forked child: scripts/mutmut_forked.py
    name=${module//\//-}
    "$tool/bin/python" scripts/mutmut_forked.py list "k3_amd_overlay/$module" "$work/$name.json" || exit 1
    # shellcheck disable=SC2086  # $targets: one word per test file or option
    $environment timeout "${K3OVL_MUTANTS_LIMIT:-5400}" "$venv/bin/python" scripts/mutmut_forked.py run "$work/clone" \
      "k3_amd_overlay/$module" "$work/$name.json" "$keep/$name.forked.json" -- $targets
    report+=("k3_amd_overlay/$module (vLLM $release, forked): see $keep/$name.forked.json")
    continue
  fi
  # which test executed which line, on the unmutated clone: the runner tries those tests first
  $environment COVERAGE_FILE="$coverage" $venv/bin/python -m pytest -q -p no:cacheprovider \
    --cov="$work/clone/k3_amd_overlay" --cov-context=test --cov-report= $targets >"$work/coverage.log" 2>&1 \
    || { echo "the tests fail on the unmutated clone:"; tail -20 "$work/coverage.log"; exit 1; }
  runner="$environment $venv/bin/python $work/clone/scripts/mutant_runner.py k3_amd_overlay/$module $coverage $work/pytest.log -- $targets"
  run_mutmut "$module" "$runner"
  cp .mutmut-cache "$cache"
  read -r total tested survived ids < <(cache_db report "k3_amd_overlay/$module")
  for id in ${ids//,/ }; do [ "$id" = "-" ] || "$tool/bin/mutmut" show "$id"; done
  line="k3_amd_overlay/$module (vLLM $release): $((tested - survived))/$tested mutants killed"
  [ "$tested" = "$total" ] || line+=" ($((total - tested)) of $total not tested: time limit or a stall)"
  report+=("$line")
done
echo
echo "mutmut 2.5.1, $(date -u +%F):"
printf '%s\n' "${report[@]}"
}

# "; exit" on the same line: bash has read it before main runs, so an edit of this file during a
# run cannot make bash read on at a shifted offset once main returns
main "$@"; exit
