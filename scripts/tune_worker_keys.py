"""On a GPU: which Triton cache entries ``tune``'s tuning process compiles that its compile workers
did not leave for it, and how each differs from the workers' compile of the same config: the files in
each entry (a kernel's, or a launcher's or a driver module's), and for a kernel the fields of its
metadata JSON (options, specialisation, target) that differ from each worker entry of that kernel. It
found the case of 2026-12-07 (docs/benchmarks.md, tests/test_gpu_tune_compile.py): a kernel tested
after another in one process compiled again, until kernels/cache_keys.py settled the keys. Cases run in
turn in this one process, each with an empty Triton cache directory of its own, as the GPU test's
cases do:

    python3 scripts/tune_worker_keys.py qk_cache_kernel:8 absorb_qk_cache_kernel:64
"""

from __future__ import annotations

import difflib
import glob
import json
import os
import sys
import tempfile
from typing import Any


def metadata(entry: str) -> dict[str, Any] | None:
    """The metadata JSON of the kernel compiled in one cache entry (not the group file), or None."""
    for path in glob.glob(os.path.join(entry, "*.json")):
        if not os.path.basename(path).startswith("__grp__"):
            with open(path) as handle:
                return json.load(handle)
    return None


def differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k != "hash"}


def text_difference(mine: str, theirs: str, suffix: str) -> str:
    """The first lines that differ between the two entries' files ending in ``suffix`` (or "same")."""
    texts = []
    for entry in (mine, theirs):
        paths = glob.glob(os.path.join(entry, "*" + suffix))
        if paths:
            with open(paths[0]) as handle:
                texts.append(handle.read().splitlines())
        else:
            texts.append([])
    diff = list(difflib.unified_diff(texts[0], texts[1], "tuning process", "worker", n=0, lineterm=""))
    return "same" if not diff else "\n".join(line[:400] for line in diff[:12])


def one_case(kernel: str, tokens: int, heads: int = 16) -> None:
    import torch

    from k3_amd_overlay.commands import tune, tune_compile
    from k3_amd_overlay.fp8 import device_format

    cache = tempfile.mkdtemp()
    os.environ["TRITON_CACHE_DIR"] = cache  # the workers inherit it; Triton reads it at each lookup
    configs = tune.candidates(kernel, tokens, amd=torch.version.hip is not None)[::5][:6]  # as the GPU test
    with tune_compile.Compiler(3, torch.cuda.current_device()) as compiler:
        print(f"== {kernel} at {tokens} tokens: workers compiled", compiler.compile(kernel, tokens, heads, configs),
              "of", configs)
    workers = set(os.listdir(cache))
    torch.manual_seed(0)
    case = tune.Case(kernel, tokens, heads, device_format(torch.device("cuda")))
    for config in configs:
        print(config, "codes further off:", case.mismatches(config)[1])
    theirs = {e: metadata(os.path.join(cache, e)) for e in workers}
    for entry in sorted(set(os.listdir(cache)) - workers):
        files = sorted(os.listdir(os.path.join(cache, entry)))
        mine = metadata(os.path.join(cache, entry))
        print(f"tuning process {entry}: files {files}")
        if mine is None:
            continue
        same_kernel = {e: m for e, m in theirs.items() if m and m.get("name") == mine.get("name")}
        if not same_kernel:
            print("  no worker compiled this kernel")
        nearest = min(same_kernel.items(), key=lambda item: len(differences(mine, item[1])), default=None)
        if nearest:
            print(f"  against worker {nearest[0]}: metadata {differences(mine, nearest[1])}")
            for suffix in (".source", ".ttir"):
                print(f"  {suffix}: " + text_difference(os.path.join(cache, entry), os.path.join(cache, nearest[0]),
                                                       suffix))


def main(cases: list[str]) -> None:
    for case in cases:
        kernel, tokens = case.split(":")
        one_case(kernel, int(tokens))


if __name__ == "__main__":
    main(sys.argv[1:])
