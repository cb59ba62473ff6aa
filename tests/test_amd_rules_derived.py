"""The AMD files' absorb rules stay derived from sm90.json's (``scripts/derive_amd_rules.py``): at every
decode batch and per-rank head count, the AMD rule that serves it names, in its note, the config of the
sm90 rule that serves it, and its config is that one as the arch takes it (``launch_configs.amd_adapted``)
with exactly the changes the note lists. A re-tuned sm90.json without a re-derivation, or an AMD config
edited under a stale note, fails here, naming the batch, the heads and both configs; the compile gate
(``scripts/compile_reports.sh``) checks the AMD configs themselves."""

from __future__ import annotations

import json
import re

import pytest

from k3_amd_overlay import k3
from k3_amd_overlay.kernels import launch_configs, names

AMD_ARCHS = ("gfx942", "gfx950")
SOURCE = "sm90"
BATCHES = range(1, 1025)  # past every rule's token bound
HEADS = sorted(set(k3.HEADS_PER_RANK.values()))
_NOTE = re.compile(r"^sm90's rule \(([^)]*)\)(?:; (.*))?$")
_CHANGE = re.compile(r"^(\w+) (\d+) -> (\d+)")


def raw_rules(arch: str, kernel: str) -> list[dict]:
    return json.loads((launch_configs.CONFIG_DIR / f"{arch}.json").read_text())["kernels"][kernel]


def server(rules: list[dict], kernel: str, arch: str):
    """For a batch and head count, the rule (as written in the file) the loader picks (``Rule.matches``)."""
    parsed = launch_configs.parse({"schema": launch_configs.SCHEMA, "arch": arch, "kernels": {kernel: rules}},
                                  arch).kernels[kernel]
    return lambda tokens, heads: rules[next(i for i, rule in enumerate(parsed) if rule.matches(tokens, heads))]


def noted(rule: dict) -> tuple[dict[str, int], list[tuple[str, int, int]]] | None:
    """The sm90 config a derived rule's note names and the changes it lists (None: no such note)."""
    found = _NOTE.match(rule.get("note", ""))
    if found is None:
        return None
    source = {key: int(value) for key, value in (pair.rsplit(" ", 1) for pair in found.group(1).split(", "))}
    changes = [_CHANGE.match(part).groups() for part in found.group(2).split(", ")] if found.group(2) else []
    return source, [(key, int(old), int(new)) for key, old, new in changes]


def drift(source: list[dict], derived: list[dict], kernel: str, arch: str) -> list[str]:
    """Each batch and head count whose derived rule names another config than sm90's rule there, or
    whose config is not sm90's as the arch takes it with the note's changes."""
    found = []
    source_rule, derived_rule = server(source, kernel, SOURCE), server(derived, kernel, arch)
    for heads in HEADS:
        for tokens in BATCHES:
            want, rule = source_rule(tokens, heads)["config"], derived_rule(tokens, heads)
            note = noted(rule)
            if note is None or note[0] != want:
                found.append(f"{tokens} tokens, {heads} heads: sm90 {want}, the AMD rule's note {rule.get('note')!r}")
                continue
            config = launch_configs.amd_adapted(arch, kernel, want)
            for key, old, new in note[1]:
                if key == "num_warps" and new == config[key] and old == want[key]:
                    continue  # amd_adapted's own cut, which the note names first
                if config.get(key) != old:
                    break
                config[key] = new
            if config != rule["config"]:
                found.append(f"{tokens} tokens, {heads} heads: the AMD config {rule['config']}, sm90's as {arch} "
                             f"takes it with the note's changes {config}")
    return found


@pytest.mark.parametrize("arch", AMD_ARCHS)
@pytest.mark.parametrize("kernel", launch_configs.DOT_TILE_KERNELS)
def test_each_amd_absorb_rule_is_the_sm90_config_of_its_batches(arch, kernel):
    problems = drift(raw_rules(SOURCE, kernel), raw_rules(arch, kernel), kernel, arch)
    assert problems == [], (f"{arch}.json {kernel} is not derived from sm90.json (run scripts/derive_amd_rules.py "
                            f"--arch {arch} --write): " + "; ".join(problems[:3]))


def test_a_retuned_sm90_rule_not_carried_to_amd_is_caught():
    """Planted fault for the test above: one sm90 rule re-tuned (the two-token rule at 12 heads) with
    the AMD file left as it was: the batches it serves, and only those, are named."""
    kernel = names.ABSORB_QK_CACHE_KERNEL
    source = json.loads(json.dumps(raw_rules(SOURCE, kernel)))
    retuned = next(rule for rule in source if rule.get("tokens") == 2 and rule.get("heads") == 12)
    retuned["config"] = {**retuned["config"], "num_warps": 8}
    problems = drift(source, raw_rules("gfx942", kernel), kernel, "gfx942")
    where = [re.match(r"(\d+) tokens, (\d+) heads:", p).groups() for p in problems]
    assert sorted(where) == sorted(("2", str(h)) for h in HEADS if 6 < h <= 12)


def test_an_amd_config_edited_under_its_note_is_caught():
    """Planted fault: the AMD file's 256-token, 12-head bf16 rule given 4 warps (sm90's) while its note
    still says 8: every batch it serves is named."""
    kernel = names.ABSORB_QK_CACHE_KERNEL
    derived = json.loads(json.dumps(raw_rules("gfx942", kernel)))
    edited = next(rule for rule in derived if rule.get("tokens") == 256 and rule.get("heads") == 12)
    assert edited["config"]["num_warps"] == 8 and "num_warps 4 -> 8" in edited["note"]
    edited["config"]["num_warps"] = 4
    problems = drift(raw_rules(SOURCE, kernel), derived, kernel, "gfx942")
    where = {re.match(r"(\d+) tokens, (\d+) heads:", p).groups() for p in problems}
    assert where == {(str(t), str(h)) for t in range(129, 257) for h in HEADS if 6 < h <= 12}
