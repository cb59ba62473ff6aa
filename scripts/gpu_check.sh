#!/usr/bin/env bash
# The one GPU script: the tests marked `kernels` (kernel parity at K3 shapes, bit-exact; graph capture and
# replay; planted faults) and the kernel benchmarks; on ROCm also the compile report of this GPU's arch
# (`k3-amd-overlay kernels`). Run from the repository root on a machine with a CUDA or ROCm GPU,
# torch and triton; vLLM is not needed. Writes logs under ${OUT:-gpu-out}; the GPU as nvidia-smi, or
# rocm-smi and amd-smi, report it goes into device.txt.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
: > "$out/device.txt"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$out/device.txt"
fi
if command -v rocm-smi >/dev/null; then
  rocm-smi --showproductname --showdriverversion --showclocks 2>&1 | tee -a "$out/device.txt"
fi
if command -v amd-smi >/dev/null; then
  amd-smi static --asic --vbios --driver 2>&1 | tee -a "$out/device.txt"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider -m kernels tests --ignore tests/engine 2>&1 | tee "$out/gpu-tests.log"
tests=${PIPESTATUS[0]}
python3 scripts/bench_kernels.py --json-out "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
report=0
if python3 -c "import sys, torch; sys.exit(torch.version.hip is None)"; then  # ROCm: this arch's compile report
  python3 -m k3_amd_overlay.commands.compile_report 2>&1 | tee "$out/kernels.md"
  report=${PIPESTATUS[0]}
fi
echo "gpu tests exit $tests, bench exit $bench, compile report exit $report"
exit $(( tests || bench || report ))
