"""Issue 27 item 10: an A/B arm vLLM itself gets wrong is named before any server starts. The one
pure function (baseline_hazard.py) over vLLM facts, environment, serve arguments and the arm's
switch; the facts read from each release's source; ab-serve and gsm8k-ab refusing (overridable)
and the doctor warning, all through that function."""

from __future__ import annotations

import sys

import pytest
from releases import MATRIX, minor, tree_of
from test_ab import STANDINS

from k3_amd_overlay.commands import ab_serve, gsm8k_ab
from k3_amd_overlay.commands.usage import UsageError

HAZARD_ENV = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_ROCM_USE_AITER": "1"}
K3_ARGS = "--tensor-parallel-size 8 --kv-cache-dtype fp8 --trust-remote-code"


def hazard(switch="0", env=None, args=K3_ARGS, own=True, version="0.33.0", arch=None):
    from k3_amd_overlay.commands.baseline_hazard import VllmFacts, baseline_hazard

    facts = VllmFacts(version, own) if arch is None else VllmFacts(version, own, arch)
    return baseline_hazard(facts, HAZARD_ENV if env is None else env, args, switch)


def test_the_off_arm_on_a_vllm_with_its_own_fused_decode_under_breakable_graphs_is_named():
    why = hazard()
    assert why.startswith("K3_AMD_OVERLAY='0' is no valid baseline: vLLM 0.33.0's own K3 fused decode "
                          "(_fused_decode) stays live in this arm")
    assert "decode-only dummy batch" in why and "keyed by token count only" in why
    # ruling the configuration out (vLLM as shipped stays the baseline) first; stock, with its caveat, second
    rule_out = why.index("rule the configuration out, so that vLLM as shipped (K3_AMD_OVERLAY=0) stays a sound "
                         "baseline: set VLLM_USE_BREAKABLE_CUDAGRAPH=0 or leave it unset")
    assert rule_out < why.index("else use K3_AMD_OVERLAY=stock as the baseline (--arm-a stock")
    assert why.endswith("knowing that the candidate arm then runs vLLM's own fusions as well (the A/B summary names "
                        "each arm's fusions)")
    assert hazard("") == hazard("0").replace("'0'", "''")  # unset is off
    assert hazard("qkv_norm")  # the overlay on, but vLLM's fused decode left as vLLM wrote it


@pytest.mark.parametrize("switch", ["stock", "1", "qk_cache", "absorb_qk_cache", "qkv_norm,qk_cache"])
def test_arms_where_the_overlay_owns_or_disables_the_fused_decode_are_valid(switch):
    assert hazard(switch) is None


@pytest.mark.parametrize("env,args", [
    ({"VLLM_ROCM_USE_AITER": "1"}, K3_ARGS),  # no breakable graphs
    ({**HAZARD_ENV, "VLLM_USE_BREAKABLE_CUDAGRAPH": "true"}, K3_ARGS),  # vLLM reads only "1"
    ({**HAZARD_ENV, "VLLM_USE_V2_MODEL_RUNNER": "0"}, K3_ARGS),  # the V1 runner captures without metadata
    (HAZARD_ENV, K3_ARGS + " --enforce-eager"),
    (HAZARD_ENV, K3_ARGS + " -cc.cudagraph_mode=FULL_DECODE_ONLY"),
    (HAZARD_ENV, K3_ARGS + " --compilation-config.cudagraph_mode full"),
    (HAZARD_ENV, K3_ARGS + """ --compilation-config '{"cudagraph_mode": "NONE"}'"""),
    ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, K3_ARGS),  # AITER off: vLLM never fuses the decode
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_MLA": "0"}, K3_ARGS),
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_FP8BMM": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, K3_ARGS),  # fp8 on, fp4 off
    (HAZARD_ENV, "--tensor-parallel-size 8 --kv-cache-dtype bfloat16"),
    (HAZARD_ENV, K3_ARGS + " -dcp 2"),
])
def test_what_rules_the_hazard_out(env, args):
    assert hazard(env=env, args=args) is None
    assert hazard(env=HAZARD_ENV, args=K3_ARGS)  # and the same without it holds


@pytest.mark.parametrize("env,args", [
    ({**HAZARD_ENV, "VLLM_USE_V2_MODEL_RUNNER": "1"}, K3_ARGS),
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_FP8BMM": "0", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, K3_ARGS),
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, K3_ARGS),  # 0.33: the fp8 BMM is off by default, vLLM fuses
    (HAZARD_ENV, "--tensor-parallel-size 8"),  # auto KV cache: may be fp8 from the checkpoint
    (HAZARD_ENV, K3_ARGS + " -cc.cudagraph_mode=FULL_AND_PIECEWISE"),
    (HAZARD_ENV, K3_ARGS + " --compilation-config.cudagraph_mode=PIECEWISE"),
])
def test_what_does_not_rule_it_out(env, args):
    assert hazard(env=env, args=args)


FP8, FP4 = "VLLM_ROCM_USE_AITER_FP8BMM", "VLLM_ROCM_USE_AITER_FP4BMM"


@pytest.mark.parametrize("version,bmm,arch,fires", [
    ("0.33.0", {FP4: "0"}, None, True),  # 0.33's fp8 BMM is off unset: vLLM fuses (the audit's missed hazard)
    ("0.33.0", {}, "gfx942", True),
    ("0.33.0", {FP8: "1"}, None, False),  # the fp4 switch off by 0.33's default: never taken, whatever the GPU
    ("0.33.0", {FP8: "1"}, "gfx950", False),
    ("0.33.0", {FP8: "1", FP4: "1"}, "gfx950", True),  # the fp4 BMM taken: vLLM fuses
    ("0.33.0", {FP8: "1", FP4: "0"}, "gfx950", False),
    ("0.32.0", {FP4: "0"}, None, False),  # 0.32's fp8 BMM is on unset
    ("0.32.0", {}, "gfx942", False),  # fp4 on by 0.32's default, but taken only on gfx950: vLLM never fuses
    ("0.32.0", {}, "gfx950", True),
    ("0.32.0", {}, None, True),  # the GPU unknown: the fp4 BMM may be taken
    ("0.32.0", {FP8: "0"}, "gfx942", True),
    ("0.35.0", {FP4: "0"}, "gfx942", True),  # a release whose defaults are not in the table: not assumed on
    (None, {FP4: "0"}, "gfx942", True),
    ("0.35.0", {FP8: "1", FP4: "0"}, None, False),  # both set: no default needed
    ("0.33.0rc2.dev7+rocm", {FP8: "1"}, "gfx942", False),  # the release read from a local version
])
def test_the_bmm_switches_are_read_with_each_release_s_defaults_and_the_gpu(version, bmm, arch, fires):
    """vLLM fuses the decode where the FP4 BMM is taken (its switch on, gfx950) or the FP8 BMM is off;
    each switch unset takes its release's default (0.29-0.32: on, 0.33-0.34: off)."""
    assert bool(hazard(env={**HAZARD_ENV, **bmm}, version=version, arch=arch)) is fires


@pytest.mark.parametrize("version", MATRIX)
def test_the_bmm_defaults_are_each_release_s_envs_py(version):
    """BMM_DEFAULTS against each release's vllm/envs.py, and the line its comment names."""
    import re
    from pathlib import Path

    from k3_amd_overlay.commands import baseline_hazard

    lines = (tree_of(version) / "envs.py").read_text().splitlines()
    found = {}
    reading = re.compile(r'os\.getenv\("(VLLM_ROCM_USE_AITER_FP[48]BMM)", "(True|False)"\)\.lower\(\) in '
                         r'\("true", "1"\)')
    for number, line in enumerate(lines, start=1):
        read = reading.search(line)
        if read:
            found[read.group(1)] = (read.group(2) == "True", number)
    assert baseline_hazard.BMM_DEFAULTS[minor(version)] == (found[FP8][0], found[FP4][0])
    source = Path(baseline_hazard.__file__).read_text()
    assert f'"{minor(version)}": ' in source and f"vllm/envs.py:{found[FP8][1]} and :{found[FP4][1]}" in source


def test_the_gpu_arch_is_read_from_the_driver_s_topology(tmp_path):
    from k3_amd_overlay.commands.baseline_hazard import gfx_arch, gpu_arch

    assert (gfx_arch(90402), gfx_arch(90500), gfx_arch(90010)) == ("gfx942", "gfx950", "gfx90a")
    assert (gfx_arch(110000), gfx_arch(120001)) == ("gfx1100", "gfx1201")  # two-digit majors
    for node, version in (("0", 0), ("1", 90402), ("2", 90402)):  # node 0: the CPU
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\nsimd_count 1\n")
    assert gpu_arch(tmp_path) == "gfx942"
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "properties").write_text("gfx_target_version 90500\n")
    assert gpu_arch(tmp_path) is None  # GPUs of two archs: which one a server runs on is not known here
    assert gpu_arch(tmp_path / "none") is None


def test_facts_here_carry_this_host_s_gpu(monkeypatch):
    from k3_amd_overlay.commands import baseline_hazard

    monkeypatch.setattr(baseline_hazard, "gpu_arch", lambda: "gfx942")
    assert baseline_hazard.facts_here().arch == "gfx942"


def test_unknown_facts_are_reported_not_assumed_away():
    assert hazard(own=False) is None
    unknown = hazard(own=None, version=None)
    assert unknown.startswith("K3_AMD_OVERLAY='0' is no valid baseline: this vLLM's K3 AMD code could not be read "
                              "here")


@pytest.mark.parametrize("version", MATRIX)
def test_each_release_s_own_fused_decode_read_from_its_source(version):
    """0.32 and 0.33 carry vLLM's own _fused_decode in the K3 wrapper; 0.29-0.31 do not."""
    from k3_amd_overlay.commands.baseline_hazard import facts_of

    facts = facts_of(tree_of(version), version)
    assert facts.fused_decode_of_its_own is (minor(version) in ("0.32", "0.33"))
    assert (hazard(env=HAZARD_ENV, own=facts.fused_decode_of_its_own) is None) is (minor(version) < "0.32")


@pytest.fixture
def a_hazardous_vllm(monkeypatch):
    from k3_amd_overlay.commands import baseline_hazard

    monkeypatch.setattr(baseline_hazard, "facts_here", lambda: baseline_hazard.VllmFacts("0.33.0", True))
    for name, value in HAZARD_ENV.items():
        monkeypatch.setenv(name, value)


def ab_args(tmp_path, *extra):
    return ab_serve.parser().parse_args(["--model", "m", "--out", str(tmp_path / "out"), "--serve-args", K3_ARGS,
                                         "--serve-cmd", sys.executable, "--bench-cmd", sys.executable, *extra])


def test_ab_serve_refuses_an_invalid_baseline_before_any_server_starts(tmp_path, a_hazardous_vllm):
    with pytest.raises(UsageError) as refused:
        ab_serve.validate(ab_args(tmp_path))
    assert str(refused.value).startswith("arm A: K3_AMD_OVERLAY='0' is no valid baseline")
    assert str(refused.value).endswith("(to measure it anyway, pass --accept-baseline-hazard: the summary says so)")
    ab_serve.validate(ab_args(tmp_path, "--arm-a", "stock"))  # the baseline to use
    accepted = ab_args(tmp_path, "--accept-baseline-hazard")
    ab_serve.validate(accepted)
    assert len(accepted.baseline_hazards) == 1 and accepted.baseline_hazards[0].startswith("arm A: ")


def test_ab_serve_records_an_accepted_hazard_in_its_summary(tmp_path, a_hazardous_vllm, monkeypatch, capsys):
    from test_ab import free_port

    from k3_amd_overlay.commands import arms

    monkeypatch.setattr(arms.Server, "prove", lambda self, after=False: "")
    code = ab_serve.main(["--model", "k3", "--out", str(tmp_path / "out"), "--port", str(free_port()),
                          "--serve-cmd", f"{sys.executable} {STANDINS / 'fake_serve.py'}", "--concurrency", "1",
                          "--bench-cmd", f"{sys.executable} {STANDINS / 'fake_bench.py'}", "--repeats", "1",
                          "--health-timeout", "60", "--serve-args", K3_ARGS, "--accept-baseline-hazard"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "warning (--accept-baseline-hazard): arm A: K3_AMD_OVERLAY='0' is no valid baseline" in printed.err
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith("WARNING, measured with --accept-baseline-hazard: arm A: K3_AMD_OVERLAY='0'")


def test_gsm8k_ab_refuses_an_invalid_baseline(tmp_path, a_hazardous_vllm):
    def args(*extra):
        parsed = gsm8k_ab.parse_args(["--model", "m", "--out", str(tmp_path / "out"), "--serve-args", K3_ARGS,
                                      "--serve-cmd", sys.executable, "--lm-eval-cmd", sys.executable, *extra])
        gsm8k_ab.validate(parsed)
        return parsed

    with pytest.raises(UsageError, match=r"^arm A: K3_AMD_OVERLAY='0' is no valid baseline"):
        args()
    with pytest.raises(UsageError, match=r"^arm B: K3_AMD_OVERLAY='qkv_norm' is no valid baseline"):
        args("--arm-a", "stock", "--arm-b", "qkv_norm")
    assert args("--arm-a", "stock").baseline_hazards == []
    assert args("--accept-baseline-hazard").baseline_hazards[0].startswith("arm A: ")


def test_the_doctor_warns_about_the_default_baseline_and_this_switch(monkeypatch):
    from k3_amd_overlay.commands import doctor
    from k3_amd_overlay.targets.shapes import K3_DECODE_WRAPPER, K3_NORM_WRAPPER

    env = {**HAZARD_ENV, "K3_AMD_OVERLAY": "stock"}
    (warning,) = doctor.ab_baseline(env, K3_DECODE_WRAPPER)  # stock itself is valid; the default "0" is not
    assert warning.startswith("K3_AMD_OVERLAY='0' is no valid baseline") and "serve arguments not given" in warning
    assert len(doctor.ab_baseline({**env, "K3_AMD_OVERLAY": "qkv_norm"}, K3_DECODE_WRAPPER)) == 2
    assert doctor.ab_baseline(env, K3_NORM_WRAPPER) == []  # 0.30-0.31: no fused decode of vLLM's own
    assert doctor.ab_baseline({"VLLM_ROCM_USE_AITER": "1"}, K3_DECODE_WRAPPER) == []
    assert doctor.ab_baseline(env, K3_DECODE_WRAPPER, K3_ARGS + " --enforce-eager") == []
    (known,) = doctor.ab_baseline(env, K3_DECODE_WRAPPER, K3_ARGS)
    assert "serve arguments not given" not in known


def test_doctor_serve_args_reach_the_baseline_judgement(monkeypatch):
    from k3_amd_overlay.commands import cli, doctor

    seen = {}
    monkeypatch.setattr(doctor, "run_doctor", lambda switch=None, serve_args=None: (
        seen.update(switch=switch, serve_args=serve_args) or ({}, True)))
    monkeypatch.setattr(doctor, "render", lambda report: "")
    assert cli.main(["doctor", "--serve-args=--enforce-eager"]) == 0
    assert seen == {"switch": None, "serve_args": "--enforce-eager"}


def test_the_doctor_report_carries_the_warning(monkeypatch):
    """run_doctor with the overlay off on this venv's vLLM: the warning where its K3 code has a fused
    decode of its own (0.32-0.33), none elsewhere; the verdict itself is unchanged."""
    from k3_amd_overlay.commands import doctor
    from k3_amd_overlay.commands.baseline_hazard import facts_here

    for name, value in HAZARD_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("K3_AMD_OVERLAY", raising=False)
    monkeypatch.setattr(doctor, "selftest", lambda device: [])
    report, healthy = doctor.run_doctor()
    assert healthy and report["verdict"].startswith("off: ")
    own = facts_here().fused_decode_of_its_own
    assert bool(report["a/b baseline"]) is (own is not False)
    if report["a/b baseline"]:
        assert "== A/B baseline\n  warning: K3_AMD_OVERLAY='0' is no valid baseline" in doctor.render(report)
