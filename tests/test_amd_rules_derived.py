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


def config_problem(arch: str, kernel: str, want: dict[str, int], changes: list[tuple[str, int, int]],
                   got: dict[str, int]) -> str | None:
    """Why ``got`` is not sm90's ``want`` as ``arch`` takes it (``amd_adapted``, whose rows and warp cut
    the note names first, exactly where it makes them) with the note's further ``changes`` applied in
    turn, each from the value the config holds then (None: it is)."""
    config = launch_configs.amd_adapted(arch, kernel, want)
    for key, what in (("BLOCK_T", "rows"), ("num_warps", "warp cut")):  # amd_adapted's changes, in this order
        if config[key] != want[key]:
            cut = (key, want[key], config[key])
            if changes[:1] != [cut]:
                return f"the note does not name amd_adapted's {what} {cut[1]} -> {cut[2]} first"
            changes = changes[1:]
    for key, old, new in changes:
        if config.get(key) != old:
            return f"the note's change {key} {old} -> {new} does not apply: the config holds {config.get(key)}"
        config[key] = new
    if config != got:
        return f"the AMD config {got}, sm90's as {arch} takes it with the note's changes {config}"
    return None


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
            problem = config_problem(arch, kernel, want, note[1], rule["config"])
            if problem:
                found.append(f"{tokens} tokens, {heads} heads: {problem}")
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


@pytest.mark.parametrize(("change", "config"), [
    ("num_warps 2 -> 8", {"num_warps": 4}),  # a wrong note over a config the derivation rejected
    ("BLOCK_N 512 -> 256", {}),  # a change from a value the config never held
    ("waves_per_eu 2 -> 1", {}),  # a change of a key the rule does not set
])
def test_a_note_change_that_does_not_apply_is_caught(change, config):
    """Planted fault: the 256-token, 12-head bf16 rule's note given a change that cannot have been
    made (its config edited to match where one is given): every batch it serves is named."""
    kernel = names.ABSORB_QK_CACHE_KERNEL
    derived = json.loads(json.dumps(raw_rules("gfx942", kernel)))
    edited = next(rule for rule in derived if rule.get("tokens") == 256 and rule.get("heads") == 12)
    edited["note"] = f"{edited['note'].split(';')[0]}; {change}"
    edited["config"].update(config)
    problems = drift(raw_rules(SOURCE, kernel), derived, kernel, "gfx942")
    where = {re.match(r"(\d+) tokens, (\d+) heads:", p).groups() for p in problems}
    assert where == {(str(t), str(h)) for t in range(129, 257) for h in HEADS if 6 < h <= 12}


def test_a_note_without_the_warp_cut_is_caught():
    """Planted fault: the 8-token, 3-head bf16 rule's note without amd_adapted's cut (4 -> 1 warps)."""
    kernel = names.ABSORB_QK_CACHE_KERNEL
    derived = json.loads(json.dumps(raw_rules("gfx942", kernel)))
    edited = next(rule for rule in derived if rule.get("tokens") == 8 and rule.get("heads") == 3)
    assert "; num_warps 4 -> 1 (one a matrix tile)" in edited["note"]
    edited["note"] = edited["note"].split(";")[0]
    problems = drift(raw_rules(SOURCE, kernel), derived, kernel, "gfx942")
    assert problems and all("does not name amd_adapted's warp cut 4 -> 1" in p for p in problems)
