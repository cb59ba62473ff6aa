#!/usr/bin/env bash
# The one GPU script: the tests marked `kernels` (kernel parity at K3 shapes, bit-exact; graph capture and
# replay; planted faults) and the kernel benchmarks. Run from the repository root on a machine with
# a CUDA or ROCm GPU, torch and triton; vLLM is not needed. Writes logs under ${OUT:-gpu-out}.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider -m kernels tests --ignore tests/engine 2>&1 | tee "$out/gpu-tests.log"
tests=${PIPESTATUS[0]}
python3 scripts/bench_kernels.py --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
