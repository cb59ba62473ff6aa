"""The absorb kernels' rules of an AMD launch-config file (gfx942, gfx950), derived from sm90.json's
on this CPU machine: no AMD GPU times them, so each AMD rule takes sm90's rule for the same batch and
head bin (measured on the H200 and H100: one-token and two-token programs without a dot, wide column
blocks and several KV rows a program at 256 tokens), made to build well on the AMD arch:

- ``launch_configs.amd_adapted``: a dot of sm90's 8 rows takes AMD's 16 (sm90's BLOCK_N kept; not
  timed at 16 rows); a dot block with both sides at least 32 takes 16-wide MFMA
  (``matrix_instr_nonkdim`` 16: Triton would take 32x32 there, with more registers); its warps are cut
  to one per matrix tile (the loader refuses more on AMD);
- the config is compiled for the arch (``k3-amd-overlay kernels``' own compile: every query dtype vLLM
  runs the kernel with there, at the rule's batch and heads, or the largest absorbed batch and K3's most
  heads a rank where the rule has no bound) and must have no problem the compile report names
  (spills, scratch, fewer than 4 waves per SIMD, a repeated tile); where it has one, the next
  candidate is tried: the largest tile (BLOCK_T x BLOCK_N, each halved at most down to 16 or sm90's
  where smaller) first, sm90's BLOCK_T before a smaller one, then the warps nearest sm90's;
- neighbouring rules of the same head bound from the same sm90 config to the same config are merged
  (each rule's note names the sm90 config it came from: tests/test_amd_rules_derived.py checks it).

    PYTHONPATH=$PWD python scripts/derive_amd_rules.py --arch gfx942 [--write]
    (Triton with the AMD backend; CPU torch; one arch a process, as Triton keeps one target)

Prints each rule and what was changed; ``--write`` replaces the absorb kernels' rules in
``k3_amd_overlay/kernels/configs/<arch>.json`` (the other kernels' rules and the header stay)."""
import argparse
import itertools
import json
import os
import sys

from k3_amd_overlay import k3, package
from k3_amd_overlay.commands import compile_report
from k3_amd_overlay.kernels import launch_configs

SOURCE_ARCH = "sm90"
# A rule without a bound is compiled at the largest absorbed batch and the most heads a rank of K3 has
CATCH_ALL_TOKENS = package.ABSORB_MAX_TOKENS
CATCH_ALL_HEADS = max(k3.HEADS_PER_RANK.values())
LEAST_BLOCK_N = launch_configs.DOT_LEAST
WARPS = (1, 2, 4, 8)


def amd_start(arch: str, kernel: str, config: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """sm90's ``config`` as ``arch`` takes it (``launch_configs.amd_adapted``), and what was changed."""
    adapted = launch_configs.amd_adapted(arch, kernel, config)
    why = {"BLOCK_T": "AMD's least dot rows", "num_warps": "one a matrix tile"}
    changed = [f"{key} {config[key]} -> {adapted[key]} ({reason})" for key, reason in why.items()
               if adapted[key] != config[key]]
    return adapted, changed


def halvings(value: int, least: int) -> list[int]:
    return [value >> i for i in range(value.bit_length()) if value >> i >= min(least, value)]


def candidates(arch: str, kernel: str, config: dict[str, int]) -> list[tuple[dict[str, int], list[str]]]:
    """``config`` as adapted, then its neighbours: the largest tile (BLOCK_T x BLOCK_N) first, sm90's
    BLOCK_T before a smaller one, then the warps nearest sm90's (more before fewer)."""
    start, changed = amd_start(arch, kernel, config)
    least_t = launch_configs.DOT_LEAST if start["BLOCK_T"] >= launch_configs.DOT_LEAST else start["BLOCK_T"]
    found = []
    for block_n, block_t, warps in itertools.product(halvings(start["BLOCK_N"], LEAST_BLOCK_N),
                                                     halvings(start["BLOCK_T"], least_t), WARPS):
        candidate = {**start, "BLOCK_N": block_n, "BLOCK_T": block_t, "num_warps": warps}
        if not launch_configs.dot_warps_fit(arch, kernel, candidate):
            continue
        notes = list(changed) + [f"{key} {start[key]} -> {value}" for key, value in
                                 (("BLOCK_N", block_n), ("BLOCK_T", block_t), ("num_warps", warps))
                                 if value != start[key]]
        distance = abs(warps.bit_length() - start["num_warps"].bit_length())
        found.append(((-block_n * block_t, block_t != start["BLOCK_T"], distance, -warps), candidate, notes))
    return [(candidate, notes) for _, candidate, notes in sorted(found, key=lambda item: item[0])]


def compile_problems(arch: str, kernel: str, config: dict[str, int], tokens: int, heads: int) -> list[str]:
    """What the compile report finds wrong with ``config`` on ``arch`` at this batch, over every query dtype
    vLLM runs ``kernel`` with there (bf16 where the arch runs none: it is compiled for the file all the same)."""
    found = []
    for dtype in compile_report.query_dtypes(kernel, arch) or ("bfloat16",):
        entry = compile_report.compile_config(kernel, arch, config, dtype, tokens, heads)
        found += [f"{dtype}: {p}" + (f" ({entry.error})" if entry.error else "") for p in entry.problems]
    return found


def derive(arch: str, kernel: str, rules: list[dict]) -> list[dict]:
    derived = []
    for rule in rules:
        tokens, heads = rule.get("tokens") or CATCH_ALL_TOKENS, rule.get("heads") or CATCH_ALL_HEADS
        tried = []
        for candidate in candidates(arch, kernel, rule["config"]):
            problems = compile_problems(arch, kernel, candidate[0], tokens, heads)
            if not problems:
                config, changed = candidate
                break
            tried.append(f"{candidate[0]}: {'; '.join(problems)}")
        else:
            raise SystemExit(f"{arch} {kernel} {rule}: no candidate builds cleanly:\n  " + "\n  ".join(tried))
        source = ", ".join(f"{k} {v}" for k, v in rule["config"].items())
        note = f"sm90's rule ({source})" + (f"; {', '.join(changed)}" if changed else "")
        out = {k: rule[k] for k in ("tokens", "heads") if k in rule}
        derived.append({**out, "config": config, "note": note})
        print(json.dumps(derived[-1]), *(f"\n    tried {t}" for t in tried), flush=True)
    merged: list[dict] = []
    for rule in derived:  # a rule's neighbour after it, of the same head bound, config and note and a
        # token bound at least as large, serves every batch the rule served
        wider = rule.get("tokens") is None or (merged and merged[-1].get("tokens") is not None
                                               and rule["tokens"] >= merged[-1]["tokens"])
        if merged and wider and all(merged[-1].get(key) == rule.get(key) for key in ("heads", "config", "note")):
            merged[-1] = rule
            continue
        merged.append(rule)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True, choices=compile_report.AMD_ARCHS)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.runtime import driver

    driver.set_active(compile_report.AotDriver(args.arch))
    source = json.loads((launch_configs.CONFIG_DIR / f"{SOURCE_ARCH}.json").read_text())
    path = launch_configs.CONFIG_DIR / f"{args.arch}.json"
    data = json.loads(path.read_text())
    for kernel in launch_configs.DOT_TILE_KERNELS:
        data["kernels"][kernel] = derive(args.arch, kernel, source["kernels"][kernel])
    launch_configs.parse(data, str(path))  # the loader takes it
    if args.write:
        path.write_text(launch_configs.dumps(data))
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
