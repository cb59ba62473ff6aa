"""ab-serve credits each fusion to the code that ran it: every arm's per-fusion states as its check
proved them (applied: the overlay's; upstream: vLLM's own; forced-stock) are kept with the run and
written to summary.md and summary.json, and each comparison is headed by what its arms ran. Where the
baseline hazard sends an operator to ``--arm-a stock`` (vLLM 0.32-0.33, breakable graphs, Model
Runner V2, AITER MLA, fp8 KV cache), vLLM fuses the layer itself, so arm B (``1``) runs vLLM's own
fused norm and decode: that table must not read as the overlay's win over vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3_amd_overlay.commands import ab_run, ab_serve, arms

TPOT_A = [20.0, 21.0, 20.5, 22.0, 21.5, 20.8]
STOCK = {"absorb_qk_cache": "forced-stock", "qk_cache": "forced-stock", "qkv_norm": "forced-stock"}
HAZARD_B = {"absorb_qk_cache": "disabled", "qk_cache": "upstream", "qkv_norm": "upstream"}  # vLLM fuses itself


def record(mode: str, states: dict[str, str], role: str = "main", layers: int = 61) -> dict:
    """One process as `check --json` lists it."""
    return {"pid": 101, "mode": mode, "role": role,
            "fusions": {f: {"state": s, "layers": layers if s != "disabled" else 0} for f, s in states.items()}}


def saved_run(out: Path, proofs: dict[str, list[dict] | None], repeats: int = 6) -> str:
    """A run's folders as ab-serve leaves them: each arm measured in each repeat, B's TPOT 5% lower,
    and the check that held after its benches (none where ``proofs`` has None)."""
    run_id = ab_run.claim(out, "ab-serve")
    for repeat in range(repeats):
        for label, records in proofs.items():
            folder = out / f"repeat{repeat}-arm{label}"
            ab_run.stamp(folder, run_id)
            tpot = TPOT_A[repeat] / (1.05 if label == "B" else 1.0)
            (folder / "bench-c8.json").write_text(json.dumps({"median_tpot_ms": tpot, "completed": 32}))
            if records is not None:  # the name arms.CHECK_AFTER_JSON gives it
                (folder / "check-after.json").write_text(json.dumps({"holds": True, "records": records}))
            ab_run.mark_measured(folder, run_id)
    return run_id


def summary_of(tmp_path: Path, arm_list: list[arms.Arm], proofs: dict[str, list[dict] | None],
               monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict]:
    monkeypatch.setattr(ab_serve, "plot_serving", lambda *args: False)
    out = tmp_path / "out"
    run_id = saved_run(out, proofs)
    text = ab_serve.summarise(out, run_id, arm_list, {"baseline_hazards": []})
    return text, json.loads((out / "summary.json").read_text())


def test_against_stock_vllm_s_own_fusions_are_named_not_credited_to_the_overlay(tmp_path, monkeypatch):
    arm_list = [arms.Arm("A", "stock", "stock"), arms.Arm("B", "1", "fused")]
    proofs = {"A": [record("stock", STOCK)],
              "B": [record("auto", HAZARD_B), record("auto", {f: "pending" for f in HAZARD_B}, "api-server", 0)]}
    text, summary = summary_of(tmp_path, arm_list, proofs, monkeypatch)
    head, note = text.split("\n\n")[:2]
    assert head == ("### B (K3_AMD_OVERLAY=1) vs A (K3_AMD_OVERLAY=stock): vLLM's own fusions only vs all unfused; "
                    "B vs A > 1: B is better")
    assert note == ("note: B's upstream fusions (qk_cache, qkv_norm) are vLLM's own code, not the overlay's; vLLM as "
                    "shipped runs them too, but A (all unfused) does not: this table measures them together with the "
                    "overlay's, and a B better than A is not the overlay's alone (for the overlay alone, compare with "
                    "K3_AMD_OVERLAY=0 where it is a sound baseline)")
    assert "the candidate is better" not in text
    assert ("Fusions as each arm's check proved them after its measurement (applied: the overlay's; upstream: vLLM's "
            "own; forced-stock: off in stock mode):\n"
            "- A (K3_AMD_OVERLAY=stock): absorb_qk_cache forced-stock; qk_cache forced-stock; qkv_norm forced-stock\n"
            "- B (K3_AMD_OVERLAY=1): absorb_qk_cache disabled; qk_cache upstream; qkv_norm upstream") in text
    assert summary["fusions"] == {  # the API server (no layer built) is not what ran the model
        "A": {"mode": "stock", "fusions": {f: ["forced-stock"] for f in STOCK}},
        "B": {"mode": "auto", "fusions": {"absorb_qk_cache": ["disabled"], "qk_cache": ["upstream"],
                                          "qkv_norm": ["upstream"]}}}
    assert summary["rows"]["B_vs_A"][0]["verdict"] == "faster"  # the measurement itself is unchanged


@pytest.mark.parametrize("b_states,switch_a,ran,note", [
    ({"absorb_qk_cache": "applied", "qk_cache": "upstream", "qkv_norm": "upstream"}, "stock",
     "the overlay's + vLLM's own fusions vs all unfused", "this table measures them together with the overlay's"),
    ({"absorb_qk_cache": "applied", "qk_cache": "upstream", "qkv_norm": "upstream"}, "0",
     "the overlay's + vLLM's own fusions vs vLLM as shipped",
     "A (vLLM as shipped) runs them too, so the difference is the overlay's applied fusions"),
    ({"absorb_qk_cache": "applied", "qk_cache": "applied", "qkv_norm": "applied"}, "stock",
     "the overlay's fusions vs all unfused", None),
])
def test_each_comparison_is_headed_by_what_its_arms_ran(tmp_path, monkeypatch, b_states, switch_a, ran, note):
    a = [record("stock", STOCK)] if switch_a == "stock" else [{"pid": 7, "mode": "off", "role": "main", "fusions": {}}]
    arm_list = [arms.Arm("A", switch_a, arms.expectation(switch_a)), arms.Arm("B", "1", "fused")]
    text, summary = summary_of(tmp_path, arm_list, {"A": a, "B": [record("auto", b_states)]}, monkeypatch)
    assert text.startswith(f"### B (K3_AMD_OVERLAY=1) vs A (K3_AMD_OVERLAY={switch_a}): {ran}; B vs A > 1: B is better")
    second = text.split("\n\n")[1]
    assert (note in second) if note else not second.startswith("note:")
    if switch_a == "0":
        assert "- A (K3_AMD_OVERLAY=0): overlay off (vLLM as shipped, its own fusions where it has them)" in text
        assert summary["fusions"]["A"] == {"mode": "off", "fusions": {}}


def test_an_arm_whose_repeats_ran_different_states_lists_each_and_one_unsaved_repeat_is_unknown(tmp_path):
    out = tmp_path / "out"
    run_id = saved_run(out, {"A": [record("stock", STOCK)], "B": [record("auto", HAZARD_B)]}, repeats=2)
    (out / "repeat1-armB" / arms.CHECK_AFTER_JSON).write_text(json.dumps({"holds": True, "records": [
        record("auto", {**HAZARD_B, "qk_cache": "applied"}), record("auto", HAZARD_B, "cli-client")]}))
    arm_list = [arms.Arm("A", "stock", "stock"), arms.Arm("B", "1", "fused")]
    proved = ab_serve.proved_arms(out, run_id, arm_list)
    assert proved["B"]["fusions"]["qk_cache"] == ["applied", "upstream"]
    assert ab_serve.arm_runs(proved["B"]) == "the overlay's + vLLM's own fusions"
    (out / "repeat0-armA" / arms.CHECK_AFTER_JSON).unlink()  # a repeat without its proof: what ran is not known
    assert ab_serve.proved_arms(out, run_id, arm_list)["A"] is None


def test_a_saved_check_that_is_not_one_is_refused_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ab_serve, "plot_serving", lambda *args: False)
    out = tmp_path / "out"
    run_id = saved_run(out, {"A": [record("stock", STOCK)], "B": [record("auto", HAZARD_B)]}, repeats=1)
    arm_list = [arms.Arm("A", "stock", "stock"), arms.Arm("B", "1", "fused")]
    ab_serve.summarise(out, run_id, arm_list, {"baseline_hazards": [], "arms": {
        a.label: {"switch": a.switch, "expect": a.expect} for a in arm_list}})
    broken = out / "repeat0-armB" / arms.CHECK_AFTER_JSON
    for content in ("{not json", json.dumps({"holds": True, "records": "none"}),
                    json.dumps({"holds": True, "records": [{"mode": "auto", "fusions": ["qk_cache"]}]}),
                    json.dumps({"holds": True, "records": [{"mode": "auto", "fusions": {"qk_cache": {"layers": 1}}}]})):
        broken.write_text(content)
        assert ab_serve.main(["report", str(out)]) == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith(f"k3-amd-overlay ab-serve report: error: {broken} is no saved check: "), err


def test_the_proof_is_kept_whole_and_as_check_prints_it(tmp_path, monkeypatch):
    """Server.prove runs `check --json`: the object kept in check.json, its text in check.txt (as
    `check` prints it without --json), the arm failed where it does not hold."""
    import subprocess

    held = {"command": "check", "expect": "fused", "holds": True, "notes": ["markers read from M: 1 live"],
            "lines": ["ok   host h pid 1 (main, vLLM 0.33.0): qk_cache=upstream on 61 layers (vLLM's own)"],
            "records": [record("auto", HAZARD_B)]}
    answers = [json.dumps(held), json.dumps({**held, "holds": False, "lines": ["FAIL qk_cache=refused"]}), "Traceback"]
    calls = []

    def check(command, **kwargs):
        calls.append(command)
        answer = answers.pop(0)
        return subprocess.CompletedProcess(command, 0 if '"holds": true' in answer else 1, stdout=answer, stderr="")

    monkeypatch.setattr(arms.subprocess, "run", check)
    server = arms.Server(["serve"], arms.Arm("B", "1", "fused"), tmp_path, 8000)
    text = server.prove()
    assert text == ("markers read from M: 1 live\nok   host h pid 1 (main, vLLM 0.33.0): qk_cache=upstream on 61 "
                    "layers (vLLM's own)\nHOLDS: expect fused (1 process)\n")
    assert calls[0][-1] == "--json" and json.loads((tmp_path / arms.CHECK_JSON).read_text()) == held
    assert (tmp_path / arms.CHECK_FILE).read_text() == text
    with pytest.raises(arms.ArmFailed, match=r"^arm B \(K3_AMD_OVERLAY=1\) is no longer fused after its measurement"):
        server.prove(after=True)
    assert (tmp_path / arms.CHECK_AFTER_FILE).read_text().endswith("FAIL qk_cache=refused\nDOES NOT HOLD: expect "
                                                                     "fused (1 process)\n")
    with pytest.raises(arms.ArmFailed, match="Traceback"):  # no JSON: what it printed is kept and shown
        server.prove()
    assert (tmp_path / arms.CHECK_FILE).read_text() == "Traceback"
