"""``judge_merge`` called directly, with its clock given: the edges of --max-age (both directions of
the clock), a node that says not when it ran, a default age and clock, and a version a record does
not give. Each refusal is a line that names the node; nothing holds that is not live, dated and
matching."""

from __future__ import annotations

import time
from typing import Any

from records import process

from k3_amd_overlay.commands.verdict import MERGE_MAX_AGE_S, NodeEvidence, Verdict, judge_merge
from k3_amd_overlay.package import __version__
from k3_amd_overlay.record import MarkerRecord

NOW = 1_800_000_000.0


def _node(host: str, pid: int, checked_at: float | None, **fields: Any) -> NodeEvidence:
    record = MarkerRecord.from_json(process(pid=pid, host=host, **fields))
    return NodeEvidence(f"{host}.json", host, "fused", True, True, [record], [], checked_at)


def _merge(*nodes: NodeEvidence, max_age_s: float = 900.0, now: float | None = NOW) -> Verdict:
    return judge_merge(list(nodes), "fused", None, True, max_age_s=max_age_s, now=now)


def _fails(verdict: Verdict) -> list[str]:
    return [line for line in verdict.lines if line.startswith("FAIL ")]


def test_a_node_checked_exactly_max_age_ago_holds_and_one_second_more_fails() -> None:
    edge = _merge(_node("node-a", 11, NOW - 900.0))
    assert edge.holds and not _fails(edge), edge.lines
    late = _merge(_node("node-a", 11, NOW - 901.0))
    assert not late.holds
    assert _fails(late)[0].startswith(
        "FAIL node host node-a (node-a.json): checked 901 s ago, more than --max-age 900 s: it proves that node as "
        "it was then, not this deployment: run `k3-amd-overlay check --expect fused --json > FILE` on host node-a"
    ), late.lines
    assert "ok   host node-a pid 11" not in "\n".join(late.lines)  # its processes are not judged at all


def test_a_node_checked_ahead_of_this_clock_fails_past_max_age_as_clocks_apart() -> None:
    edge = _merge(_node("node-a", 11, NOW + 900.0))
    assert edge.holds, edge.lines
    ahead = _merge(_node("node-a", 11, NOW + 3600.0))
    assert not ahead.holds
    assert _fails(ahead)[0].startswith(
        "FAIL node host node-a (node-a.json): checked 3600 s in the future (clocks apart?), more than --max-age 900 s"
    ), ahead.lines


def test_max_age_is_the_one_given_not_the_default() -> None:
    assert _merge(_node("node-a", 11, NOW - 3600.0), max_age_s=3600.0).holds
    tight = _merge(_node("node-a", 11, NOW - 61.0), max_age_s=60.0)
    assert not tight.holds and "checked 61 s ago, more than --max-age 60 s" in _fails(tight)[0], tight.lines


def test_the_default_max_age_is_900_seconds_and_the_default_clock_is_now() -> None:
    assert MERGE_MAX_AGE_S == 900
    assert judge_merge([_node("node-a", 11, NOW - 900.0)], "fused", None, True, now=NOW).holds
    old = judge_merge([_node("node-a", 11, NOW - 901.0)], "fused", None, True, now=NOW)
    assert not old.holds and "more than --max-age 900 s" in _fails(old)[0], old.lines
    assert judge_merge([_node("node-a", 11, time.time())], "fused", None, True).holds
    stale = judge_merge([_node("node-a", 11, time.time() - 901.0)], "fused", None, True)
    assert not stale.holds and "more than --max-age 900 s" in _fails(stale)[0], stale.lines


def test_a_node_built_without_a_check_time_is_undated_and_fails() -> None:
    record = MarkerRecord.from_json(process(pid=11, host="node-a"))
    undated = NodeEvidence("node-a.json", "node-a", "fused", True, True, [record])
    verdict = _merge(undated)
    assert not verdict.holds
    assert _fails(verdict)[0].startswith(
        "FAIL node host node-a (node-a.json): says not when it was checked (an older k3-amd-overlay wrote it), "
        "so it may be another run's"), verdict.lines


def test_a_fresh_node_beside_a_stale_one_does_not_hold_and_only_the_stale_one_is_named() -> None:
    verdict = _merge(_node("node-a", 11, NOW - 10.0), _node("node-b", 12, NOW - 5000.0))
    assert not verdict.holds
    assert [line.split(":")[0] for line in _fails(verdict)] == ["FAIL node host node-b (node-b.json)"], verdict.lines
    assert "ok   node host node-a (node-a.json): 1 live process prove fused there" in verdict.lines


def test_a_record_without_an_overlay_version_is_another_version() -> None:
    versioned = _node("node-a", 11, NOW)
    unversioned = NodeEvidence("node-b.json", "node-b", "fused", True, True,
                               [MarkerRecord.from_json(process(pid=12, host="node-b", overlay_version=""))], [], NOW)
    verdict = _merge(versioned, unversioned)
    assert not verdict.holds
    assert (f"FAIL not one deployment: overlay versions differ: {__version__} (host node-a pid 11); unknown (host "
            "node-b pid 12)") in verdict.lines


def test_one_version_on_every_node_is_one_deployment() -> None:
    verdict = _merge(_node("node-a", 11, NOW), _node("node-b", 12, NOW), _node("node-c", 13, NOW))
    assert verdict.holds and not _fails(verdict), verdict.lines
    assert not any("not one deployment" in line for line in verdict.lines)


def test_no_node_at_all_proves_nothing() -> None:
    verdict = _merge()
    assert not verdict.holds and _fails(verdict), verdict.lines


def test_an_undated_or_stale_node_first_still_leaves_every_later_node_judged() -> None:
    for first in (_node("node-a", 11, None), _node("node-a", 11, NOW - 5000.0)):
        verdict = _merge(first, _node("node-b", 12, NOW), _node("node-c", 13, NOW, vllm_version="0.29.0"))
        assert not verdict.holds
        assert "ok   node host node-b (node-b.json): 1 live process prove fused there" in verdict.lines, verdict.lines
        assert ("FAIL not one deployment: vllm versions differ: 0.33.0 (host node-b pid 12); 0.29.0 (host node-c "
                "pid 13)") in verdict.lines


def test_a_version_shared_by_two_hosts_names_both() -> None:
    newer = _node("node-c", 13, NOW, vllm_version="0.29.0")
    verdict = _merge(_node("node-a", 11, NOW), _node("node-b", 12, NOW), newer)
    assert not verdict.holds
    assert ("FAIL not one deployment: vllm versions differ: 0.33.0 (host node-a pid 11, host node-b pid 12); 0.29.0 "
            "(host node-c pid 13)") in verdict.lines


def test_a_sub_second_max_age_still_says_the_node_was_checked_in_the_past() -> None:
    verdict = _merge(_node("node-a", 11, NOW - 0.7), max_age_s=0.5)
    assert not verdict.holds
    assert "checked 1 s ago, more than --max-age 0.5 s" in _fails(verdict)[0], verdict.lines
