"""The AMD files' absorb rules stay derived from sm90.json's (``scripts/derive_amd_rules.py``): at every
decode batch and per-rank head count, the AMD rule that serves it names, in its note, the config of the
sm90 rule that serves it. A re-tuned sm90.json without a re-derivation fails here, naming the batch,
the heads and both configs; the compile gate (``scripts/compile_reports.sh``) checks the AMD configs
themselves."""

from __future__ import annotations

import json
import re

import pytest

from k3_amd_overlay.kernels import launch_configs, probe

AMD_ARCHS = ("gfx942", "gfx950")
SOURCE = "sm90"
_NOTE = re.compile(r"^sm90's rule \(([^)]*)\)")


def rules_of(arch: str) -> dict[str, list[dict]]:
    return json.loads((launch_configs.CONFIG_DIR / f"{arch}.json").read_text())["kernels"]


def serving(rules: list[dict], tokens: int, heads: int) -> dict:
    return next(rule for rule in rules if tokens <= rule.get("tokens", tokens) and heads <= rule.get("heads", heads))


def noted_source(rule: dict) -> dict[str, int] | None:
    """The sm90 config a derived rule's note names (None: no such note)."""
    found = _NOTE.match(rule.get("note", ""))
    if found is None:
        return None
    return {key: int(value) for key, value in (pair.rsplit(" ", 1) for pair in found.group(1).split(", "))}


def drift(source: list[dict], derived: list[dict]) -> list[str]:
    """Each batch and head count whose derived rule names another config than sm90's rule there."""
    found = []
    for heads in probe.HEADS:
        for tokens in range(1, max(probe.TOKENS) + 1):
            want, rule = serving(source, tokens, heads)["config"], serving(derived, tokens, heads)
            if noted_source(rule) != want:
                found.append(f"{tokens} tokens, {heads} heads: sm90 {want}, the AMD rule's note "
                             f"{rule.get('note')!r}")
    return found


@pytest.mark.parametrize("arch", AMD_ARCHS)
@pytest.mark.parametrize("kernel", launch_configs.DOT_TILE_KERNELS)
def test_each_amd_absorb_rule_names_the_sm90_config_of_its_batches(arch, kernel):
    problems = drift(rules_of(SOURCE)[kernel], rules_of(arch)[kernel])
    assert problems == [], (f"{arch}.json {kernel} is not derived from sm90.json (run scripts/derive_amd_rules.py "
                            f"--arch {arch} --write): " + "; ".join(problems[:3]))


def test_a_retuned_sm90_rule_not_carried_to_amd_is_caught():
    """Planted fault for the test above: one sm90 rule re-tuned (the two-token rule at 12 heads) with
    the AMD file left as it was: the batches it serves, and only those, are named."""
    source = json.loads(json.dumps(rules_of(SOURCE)[launch_configs.names.ABSORB_QK_CACHE_KERNEL]))
    retuned = next(rule for rule in source if rule.get("tokens") == 2 and rule.get("heads") == 12)
    retuned["config"] = {**retuned["config"], "num_warps": 8}
    problems = drift(source, rules_of("gfx942")[launch_configs.names.ABSORB_QK_CACHE_KERNEL])
    where = [re.match(r"(\d+) tokens, (\d+) heads:", p).groups() for p in problems]
    assert sorted(where) == sorted(("2", str(h)) for h in probe.HEADS if 6 < h <= 12)
