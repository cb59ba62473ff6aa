#!/usr/bin/env bash
# `k3-amd-overlay kernels` for gfx942 (MI300X) and gfx950 (MI355X) with each Triton of
# scripts/compile-tritons.txt, on this CPU machine: every kernel at every launch config vLLM's batches
# reach there, compiled to a linked AMD code object. Each Triton is installed once into
# <venv root>/triton-<version> (pip --target, no dependencies) and put first on PYTHONPATH of the
# given venv's Python (CPU torch, the overlay installed or on the PYTHONPATH given). Writes
# OUT/kernels-<arch>-triton-<v>.json and OUT/amd-compile-report.md; exits 1 if any report falls short
# (a compile error, a spill, scratch, fewer than 4 waves per SIMD, a dot tile repeated across warps or
# not read, a launch-config file the loader refuses, e.g. a rule with more warps than matrix tiles).
#   scripts/compile_reports.sh VENV OUT
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(cd "$1" && pwd) out=$2
venv_root=${K3OVL_VENV_ROOT:-$repo/.venvs}
mkdir -p "$out"
status=0
mapfile -t tritons < <(grep -v '^#' "$repo/scripts/compile-tritons.txt")
for t in "${tritons[@]}"; do
  dir="$venv_root/triton-$t"
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    spec=triton; [ "$t" != newest ] && spec="triton==$t"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "$spec" 2>&1 \
      | grep -v "WARNING: Location"
    touch "$dir/.complete"
  fi
  for arch in gfx942 gfx950; do
    json="$out/kernels-$arch-triton-$t.json"
    (cd "$out" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m k3_amd_overlay.commands.compile_report \
       --arch "$arch" --json > "$json")
    rc=$?
    [ $rc -eq 0 ] || status=1
    echo "[kernels] $arch, triton $t: exit $rc"
  done
done
"$venv/bin/python" - "$out" > "$out/amd-compile-report.md" <<'PY'
import json, pathlib, sys
from k3_amd_overlay.commands.compile_report import table
for path in sorted(pathlib.Path(sys.argv[1]).glob("kernels-*.json")):
    try:
        print(table(json.loads(path.read_text())) + "\n")
    except ValueError:
        print(f"## {path.stem}: no report (the run failed; see its log)\n")
PY
exit $status
