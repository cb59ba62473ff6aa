"""On a GPU: which Triton cache entries ``tune``'s tuning process compiles that its compile workers
did not leave for it, each with its kernel's TTIR signature (the argument types and the
specialisation attributes the two compiles keyed on), beside the workers' own entries. For the
open case of 2026-12-07 (docs/benchmarks.md): ``qk_cache_kernel``'s candidates compiled again.

    python3 scripts/tune_worker_keys.py qk_cache_kernel 8
"""

from __future__ import annotations

import glob
import os
import re
import sys
import tempfile


def signature(entry: str) -> str | None:
    """The kernel's TTIR function signature in one cache entry, or None where it holds no TTIR."""
    for path in glob.glob(os.path.join(entry, "*.ttir")):
        with open(path) as handle:
            text = handle.read()
        found = re.search(r"tt\.func public @\w+\((.*?)\)\s*attributes", text, re.S)
        return " ".join((found.group(1) if found else text[:1500]).split())
    return None


def main(kernel: str, tokens: int, heads: int = 16) -> None:
    cache = tempfile.mkdtemp()
    os.environ["TRITON_CACHE_DIR"] = cache  # before torch and triton: the workers inherit it
    import torch

    from k3_amd_overlay.commands import tune, tune_compile
    from k3_amd_overlay.fp8 import device_format

    config = tune.candidates(kernel, tokens, amd=torch.version.hip is not None)[0]
    with tune_compile.Compiler(2, torch.cuda.current_device()) as compiler:
        print("workers compiled", compiler.compile(kernel, tokens, heads, [config]))
    workers = set(os.listdir(cache))
    torch.manual_seed(0)
    case = tune.Case(kernel, tokens, heads, device_format(torch.device("cuda")))
    print(config, "codes further off:", case.mismatches(config)[1])
    for label, entries in (("worker", sorted(workers)), ("tuning process", sorted(set(os.listdir(cache)) - workers))):
        for entry in entries:
            found = signature(os.path.join(cache, entry))
            if found:
                print(f"{label} {entry}: {found}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
