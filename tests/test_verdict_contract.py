"""The verdict's contract, word for word, on records built directly (no files, no CLI): the launch
configs summary of every kind of source, the ``off`` arm's mixed count, each way ``--merge`` turns a
node away while still judging every later node, doctor's verdict for each arm, and the defaults of
``judge_merge`` and ``NodeEvidence`` (fail closed: mixed layers are no fused arm unless asked).
Lines are pinned whole: a user reads them, and ``check --json`` carries them."""

from __future__ import annotations

from typing import Any

from records import off_process, process

from k3_amd_overlay.commands import verdict
from k3_amd_overlay.commands.verdict import NodeEvidence, Verdict, judge, judge_doctor, judge_merge
from k3_amd_overlay.package import FUSIONS
from k3_amd_overlay.record import MarkerRecord

NOW = 1_796_000_000.0  # when the merge runs, and each node's check just before it
TUNED = "/opt/tuned/gfx950-AMD_Instinct_MI355X.json"
LAUNCH_CONFIGS = {"arch": "gfx950", "device": "AMD Instinct MI355X", "kernels": {
    "qk_cache_kernel": {"file": TUNED, "arch": "gfx950", "tuned_on": "AMD Instinct MI355X", "tuned_here": True},
    "absorb_qk_cache_kernel": {"file": "/opt/pkg/gfx942-AMD_Instinct_MI300X.json", "arch": "gfx942",
                               "tuned_on": "AMD Instinct MI300X", "tuned_here": False},
    "rmsnorm_pair_kernel": {"file": TUNED, "arch": "gfx950", "tuned_on": "AMD Instinct MI355X", "tuned_here": True},
    "qk_rope_kernel": {"file": "/opt/pkg/gfx950.json", "arch": "gfx950", "tuned_on": None, "tuned_here": False},
    "lost_kernel": {"arch": "gfx950", "tuned_on": None, "tuned_here": False},  # a source naming no file
}}
SUMMARY = ("gfx950 (AMD Instinct MI355X): gfx950-AMD_Instinct_MI355X.json (tuned on this GPU): qk_cache_kernel, "
           "rmsnorm_pair_kernel; gfx942-AMD_Instinct_MI300X.json (tuned on AMD Instinct MI300X, not this GPU): "
           "absorb_qk_cache_kernel; gfx950.json (untuned): qk_rope_kernel; ? (untuned): lost_kernel")


def record(host: str, **fields: Any) -> MarkerRecord:
    return MarkerRecord.from_json(process(host=host, **fields))


def test_the_launch_configs_summary_names_each_file_once_with_its_kernels_and_whether_tuned_here():
    assert verdict.launch_configs_summary(LAUNCH_CONFIGS) == SUMMARY
    no_gpu = {"arch": "gfx942", "device": None, "kernels": {
        "qk_cache_kernel": {"file": "/opt/pkg/gfx942.json", "arch": "gfx942", "tuned_on": None, "tuned_here": False}}}
    assert verdict.launch_configs_summary(no_gpu) == "gfx942 (no GPU): gfx942.json (untuned): qk_cache_kernel"


def test_the_launch_configs_line_is_an_info_line_of_a_fused_check_only():
    fused = judge([record("gpu-node-7", pid=4127, served=6, launch_configs=LAUNCH_CONFIGS)], "fused", ["qk_cache"],
                  require_effective=True)
    assert fused.holds and fused.lines == [
        f"info host gpu-node-7 pid 4127 (worker, vLLM 0.33.0): launch configs {SUMMARY}",
        "ok   host gpu-node-7 pid 4127 (worker, vLLM 0.33.0): qk_cache=applied provider=triton on 2 layers (r)",
        "ok   qk_cache: served traffic took the fused path: 6 eager batches after startup (host gpu-node-7 pid "
        "4127: 6)"]
    stock = judge([record("gpu-node-7", mode="stock", state="forced-stock", pid=4128, launch_configs=LAUNCH_CONFIGS)],
                  "stock", None, require_effective=True)
    assert stock.holds and stock.lines == [
        "ok   host gpu-node-7 pid 4128 (worker, vLLM 0.33.0): qkv_norm=forced-stock on 2 layers (r)",
        "ok   host gpu-node-7 pid 4128 (worker, vLLM 0.33.0): qk_cache=forced-stock on 2 layers (r)"]


def test_off_counts_the_processes_on_each_side_of_a_mixed_deployment():
    records = [MarkerRecord.from_json(r) for r in (
        off_process(pid=5101, host="gpu-a"), off_process(pid=5102, host="gpu-a"),
        process("stock", "forced-stock", pid=5103, host="gpu-a", switch="stock"))]
    mixed = judge(records, "off", None, require_effective=True)
    assert not mixed.holds and mixed.lines == [
        "ok   host gpu-a pid 5101 (worker, vLLM 0.33.0): overlay off",
        "ok   host gpu-a pid 5102 (worker, vLLM 0.33.0): overlay off",
        "FAIL host gpu-a pid 5103 (worker, vLLM 0.33.0): overlay in stock mode (K3_AMD_OVERLAY='stock')",
        "FAIL mixed: 2 processes with the overlay off, 1 with it on: not one arm"]
    # every process on: not off, and not mixed either
    on = judge([records[2], record("gpu-a", pid=5104, switch="1")], "off", None, require_effective=True)
    assert not on.holds and on.lines == [
        "FAIL host gpu-a pid 5103 (worker, vLLM 0.33.0): overlay in stock mode (K3_AMD_OVERLAY='stock')",
        "FAIL host gpu-a pid 5104 (worker, vLLM 0.33.0): overlay in auto mode (K3_AMD_OVERLAY='1')"]


def how(expect: str, host: str) -> str:
    return (f"run `k3-amd-overlay check --expect {expect} --json > FILE` on host {host} while its vLLM serves, and "
            "merge that FILE")


NOT_RUN = "absorb_qk_cache: no process has run its fused path yet"


def test_merge_judges_every_node_after_one_it_turns_away_each_line_word_for_word():
    """Each kind of node turned away (no host, a host again, not live, another expectation, no
    process, another host's record, its own check failed) is followed by a node that must still be
    judged; a CLI client's record is no process of its node."""
    nodes = [
        NodeEvidence("/srv/ev/nameless.json", None, "fused", True, True, [record("", pid=3301)], checked_at=NOW),
        NodeEvidence("/srv/ev/a.json", "gpu-a", "fused", True, True,
                     [record("gpu-a", pid=3302, served=5), record("gpu-a", pid=3303, served=9, role="engine-core")],
                     checked_at=NOW),
        NodeEvidence("/srv/ev/a-again.json", "gpu-a", "fused", True, True, [record("gpu-a", pid=3302)], checked_at=NOW),
        NodeEvidence("/srv/ev/b.json", "gpu-b", "fused", True, False, [record("gpu-b", pid=3304)], checked_at=NOW),
        NodeEvidence("/srv/ev/c.json", "gpu-c", "stock", True, True, [record("gpu-c", pid=3305)], checked_at=NOW),
        NodeEvidence("/srv/ev/d.json", "gpu-d", "fused", False, True, [record("gpu-d", pid=3306, role="cli-client")],
                     checked_at=NOW),
        NodeEvidence("/srv/ev/e.json", "gpu-e", "fused", True, True,
                     [record("gpu-e", pid=3307, served=7), record("gpu-e", pid=3308, role="cli-client")],
                     checked_at=NOW),
        NodeEvidence("/srv/ev/f.json", "gpu-f", "fused", True, True,
                     [record("gpu-f", pid=3309, served=11), record("gpu-g", pid=3310, served=13)],
                     checked_at=NOW),
        NodeEvidence("/srv/ev/h.json", "gpu-h", "fused", False, True, [record("gpu-h", pid=3311, served=17)],
                     ["ok   qkv_norm: it held", f"FAIL {NOT_RUN}", "FAIL qk_cache: its fused path ran",
                      f"FAIL {NOT_RUN}"], checked_at=NOW),
    ]
    merged = judge_merge(nodes, "fused", None, True, now=NOW)
    applied = "=applied provider=triton on 2 layers (r)"
    judged = [("gpu-a", 3302, "worker"), ("gpu-a", 3303, "engine-core"), ("gpu-e", 3307, "worker"),
              ("gpu-f", 3309, "worker"), ("gpu-h", 3311, "worker")]
    served = ("49 eager batches after startup (host gpu-a pid 3302: 5, host gpu-a pid 3303: 9, host gpu-e pid 3307: 7, "
              "host gpu-f pid 3309: 11, host gpu-h pid 3311: 17)")
    assert not merged.holds
    assert merged.lines == [
        "FAIL node (/srv/ev/nameless.json): names no host, so its pids cannot be told from another node's: "
        + how("fused", "?"),
        "ok   node host gpu-a (/srv/ev/a.json): 2 live processes prove fused there",
        "FAIL node host gpu-a (/srv/ev/a-again.json): host gpu-a again (also /srv/ev/a.json): one file per node, "
        "each once",
        "FAIL node host gpu-b (/srv/ev/b.json): not read from that node's live markers (a --static or --merge "
        "output): " + how("fused", "gpu-b"),
        "FAIL node host gpu-c (/srv/ev/c.json): judged there against --expect stock, not fused: "
        + how("fused", "gpu-c"),
        "FAIL node host gpu-d (/srv/ev/d.json): 0 processes: no live vLLM process left overlay evidence (is the "
        "server up there, k3-amd-overlay installed in its Python, K3_AMD_OVERLAY set, the marker directory the "
        "same?); " + how("fused", "gpu-d"),
        "ok   node host gpu-e (/srv/ev/e.json): 1 live process prove fused there",
        "FAIL node host gpu-f (/srv/ev/f.json): holds host gpu-g pid 3310 (worker, vLLM 0.33.0), another host's "
        "process: that node's file proves only its own processes",
        "ok   node host gpu-f (/srv/ev/f.json): 1 live process prove fused there",
        "FAIL node host gpu-h (/srv/ev/h.json): its own processes do not prove fused: absorb_qk_cache: no process "
        "has run its fused path yet; qk_cache: its fused path ran",
        *(f"ok   host {host} pid {pid} ({role}, vLLM 0.33.0): {fusion}{applied}"
          for host, pid, role in judged for fusion in ("qkv_norm", "qk_cache")),
        f"ok   qkv_norm: served traffic took the fused path: {served}",
        f"ok   qk_cache: served traffic took the fused path: {served}",
    ]


def mixed_record(host: str, pid: int) -> MarkerRecord:
    """qk_cache fused on 3 layers and refused on 1; qkv_norm refused (not asked for below)."""
    raw = process(host=host, pid=pid, layers=4, served=23)
    raw["fusions"]["qk_cache"]["layer_states"] = {"applied": {"layers": 3, "reason": "fits"},
                                                  "refused": {"layers": 1, "reason": "too wide"}}
    raw["fusions"]["qkv_norm"] = {**raw["fusions"]["qkv_norm"], "state": "refused", "provider": None,
                                  "reason": "no provider"}
    return MarkerRecord.from_json(raw)


def test_merge_fails_closed_on_mixed_layers_by_default_and_judges_only_the_fusions_asked():
    mixed = "qk_cache=applied provider=triton on 4 layers (r); mixed across layers: applied on 3/4 (fits), " \
            "refused on 1/4 (too wide)"
    who = "host gpu-m pid 6201 (worker, vLLM 0.33.0)"
    nodes = [NodeEvidence("/srv/ev/m.json", "gpu-m", "fused", True, True, [mixed_record("gpu-m", 6201)],
                          checked_at=NOW)]
    default = judge_merge(nodes, "fused", ["qk_cache"], True, now=NOW)
    refusal = f"{who}: {mixed} (pass --allow-mixed to accept a partly fused process)"
    assert not default.holds and default.lines == [
        f"FAIL node host gpu-m (/srv/ev/m.json): its own processes do not prove fused: {refusal}",
        f"FAIL {refusal}",
        "ok   qk_cache: served traffic took the fused path: 23 eager batches after startup (host gpu-m pid 6201: 23)"]
    allowed = judge_merge(nodes, "fused", ["qk_cache"], True, allow_mixed=True, now=NOW)
    assert allowed.holds and allowed.lines == [
        "ok   node host gpu-m (/srv/ev/m.json): 1 live process prove fused there",
        f"ok   {who}: {mixed}",
        "ok   qk_cache: served traffic took the fused path: 23 eager batches after startup (host gpu-m pid 6201: 23)"]
    # no fusions named: each one the process requested, and its qkv_norm was refused
    every = judge_merge(nodes, "fused", None, True, allow_mixed=True, now=NOW)
    assert not every.holds and f"FAIL {who}: qkv_norm=refused on 4 layers (no provider)" in every.lines
    assert not judge_merge([], "fused", None, True).holds  # no node at all proves nothing


def doctor_report(mode: str, state: str, **outlook: dict[str, Any]) -> dict[str, Any]:
    """A doctor report as run_doctor builds it for a recognised vLLM, each fusion in ``state``."""
    why = {"off": "not requested", "stock": "stock mode (the unfused A/B baseline)", "fused": "triton runs here"}
    fusions = {f: {"state": state, "provider": "triton" if state == "fused" else None, "why": why[state]}
               for f in FUSIONS}
    return {"switch": {"mode": mode}, "vllm shape": {"recognised": "k3_decode_wrapper"}, "launch configs": {},
            "self-test": [], "fusions": {**fusions, **outlook}}


def doctor_lines(report: dict[str, Any], expect: str, fusions: list[str] | None = None) -> tuple[bool, list[str]]:
    said = Verdict()
    judge_doctor(report, expect, fusions, said)
    return said.holds, said.lines


def test_doctor_holds_each_arm_on_its_own_verdict_and_names_what_is_missing():
    stock = ("ready (stock): every fusion forced to the unfused path, vLLM's own fusions off too (the A/B "
             "baseline)")
    off = "off: K3_AMD_OVERLAY is unset or 0, nothing is patched (vLLM runs as it is)"
    assert doctor_lines(doctor_report("stock", "stock"), "stock") == (True, [f"ok   doctor on this machine: {stock}"])
    assert doctor_lines(doctor_report("off", "off"), "off") == (True, [f"ok   doctor on this machine: {off}"])
    # another arm's verdict, with no fusion asked: the line names none
    assert doctor_lines(doctor_report("off", "off"), "fused") == (False, [f"FAIL doctor on this machine: {off}"])
    assert doctor_lines(doctor_report("stock", "stock"), "fused") == (
        False, [f"FAIL doctor on this machine for qkv_norm, qk_cache, absorb_qk_cache: {stock}"])
    # asked for a fusion the report does not have: the doctor judges none of those asked (never an empty "ready")
    report = doctor_report("auto", "off", qkv_norm={"state": "fused", "provider": "triton", "why": "triton runs here"})
    del report["fusions"]["qk_cache"]
    assert doctor_lines(report, "fused", ["qk_cache"]) == (
        False, ["FAIL doctor on this machine for qk_cache: not ready: no fusion in this report to judge"])


STOCK_PIDS = {"api-server": 6100, "engine-core": 6101, "worker": 6102}  # one process a role: a pid counts once


def stock_record(role: str, layers: int, patches: list[str], version: str = "0.33.0") -> MarkerRecord:
    return record("gpu-a", mode="stock", state="forced-stock", pid=STOCK_PIDS[role], role=role, layers=layers,
                  patches=patches, vllm_version=version)


NO_LAYER = ("FAIL no live process has built a K3 MLA layer (is the model loaded in a process that shares this "
            "marker directory?)")


def test_stock_needs_a_process_that_built_layers_not_an_api_server_alone():
    """Workers that left no marker (another marker directory, another node, the plugin not loaded there)
    may have run anything, vLLM's own fusions included: the API server's stock record alone is no stock arm."""
    patched = ["k3_wrapper.init", "linear.report_layers"]
    for role, patches, version in (("api-server", patched, "0.33.0"), ("api-server", [], "0.29.0"),
                                   ("engine-core", patched, "0.33.0")):
        alone = judge([stock_record(role, 0, patches, version)], "stock", None, require_effective=True)
        assert not alone.holds and alone.lines[-1] == NO_LAYER, (role, alone.lines)
    built = judge([stock_record("api-server", 0, patched), stock_record("worker", 2, patched)], "stock", None,
                  require_effective=True)
    assert built.holds, built.lines


def test_stock_on_vllm_0_29_counts_layers_as_on_every_release():
    """vLLM 0.29's stock mode installs the overlay's K3 wrapper too (it counts the layers and opens the
    census's ranges), so a live engine core or worker that built no counted layer is no stock arm there
    either: nothing stands in for the count."""
    patched = ["linear.mla_wrapper", "linear.report_layers", "mtp.report_layers"]
    for role in ("engine-core", "worker"):
        for patches in (patched, []):
            alone = judge([stock_record("api-server", 0, patches, "0.29.0"), stock_record(role, 0, patches, "0.29.0")],
                          "stock", None, require_effective=True)
            assert not alone.holds and alone.lines[-1] == NO_LAYER, (role, patches, alone.lines)
        built = judge([stock_record("api-server", 0, patched, "0.29.0"), stock_record(role, 2, patched, "0.29.0")],
                      "stock", None, require_effective=True)
        assert built.holds, built.lines


def test_unreadable_informational_parts_of_a_record_do_not_stop_the_verdict():
    broken = record("gpu-a", pid=6200, served=6, launch_configs={"arch": "gfx942", "kernels": {"k": "gfx942"}},
                    measurement={"state": "used", "stock": ["x"]})
    judged = judge([broken], "fused", ["qk_cache"], require_effective=True)
    assert judged.holds
    infos = [line for line in judged.lines if line.startswith("info ")]
    assert infos[0].startswith("info host gpu-a pid 6200 (worker, vLLM 0.33.0): unreadable launch configs in its "
                               "record (AttributeError: "), infos
    assert len(infos) == 2 and "measurement" in infos[1], infos


def test_a_compile_time_too_large_for_a_float_is_an_unreadable_line_not_a_crash():
    broken = record("gpu-a", pid=6200, served=6, launch_configs={"arch": "gfx942", "compile_seconds": {"k": 10 ** 400}})
    judged = judge([broken], "fused", ["qk_cache"], require_effective=True)
    assert judged.holds
    assert any(line.startswith("info host gpu-a pid 6200 (worker, vLLM 0.33.0): unreadable launch configs in its "
                               "record (OverflowError: ") for line in judged.lines), judged.lines
