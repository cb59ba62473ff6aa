"""baseline_hazard.py's contract, pinned exactly (issue 27 item 9): the hazard message and every
reason ``ruled_out`` gives, word for word; how serve arguments are read at their boundaries (an
option as the last word, every spelling of the compilation config and of DCP, DCP 1 against 2 and
more, ``--kv-cache-dtype auto``); the environment's spellings vLLM accepts; a bad switch; the
facts as an immutable value, and read where there is no vLLM or no K3 code vLLM's shapes know."""

from __future__ import annotations

import dataclasses
import random

import pytest

from k3_amd_overlay.commands.baseline_hazard import VllmFacts, baseline_hazard, facts_of, ruled_out
from k3_amd_overlay.commands.usage import UsageError

HAZARD_ENV = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_ROCM_USE_AITER": "1"}
K3_ARGS = ["--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8", "--trust-remote-code"]
TAIL = ("with breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1) under Model Runner V2 the PIECEWISE capture "
        "runs a decode-only dummy batch, so that fused decode (no eager break) is recorded into the graph segment, "
        "and segments are keyed by token count only: a mixed batch of a captured size replays the decode-only "
        "path; rule the configuration out, so that vLLM as shipped (K3_AMD_OVERLAY=0) stays a sound baseline: set "
        "VLLM_USE_BREAKABLE_CUDAGRAPH=0 or leave it unset (on ROCm vLLM 0.30-0.33 do not turn breakable graphs on for "
        "K3 by themselves), or VLLM_USE_V2_MODEL_RUNNER=0, --enforce-eager or a cudagraph_mode without PIECEWISE; "
        "else use K3_AMD_OVERLAY=stock as the baseline (--arm-a stock: every fusion off, vLLM's own too), knowing "
        "that the candidate arm then runs vLLM's own fusions as well (the A/B summary names each arm's fusions)")
FACTS = VllmFacts("0.33.0", True)


def test_the_hazard_word_for_word():
    assert baseline_hazard(VllmFacts("0.33.0", True), HAZARD_ENV, K3_ARGS, "0") == (
        "K3_AMD_OVERLAY='0' is no valid baseline: vLLM 0.33.0's own K3 fused decode (_fused_decode) stays live in "
        "this arm, and " + TAIL)
    assert baseline_hazard(VllmFacts(None, None), HAZARD_ENV, K3_ARGS, "qkv_norm") == (
        "K3_AMD_OVERLAY='qkv_norm' is no valid baseline: this vLLM's K3 AMD code could not be read here, so whether "
        "it has a fused decode of its own (0.32-0.33 do) is unknown; if it does, " + TAIL)


DCP = random.randint(2, 64)


@pytest.mark.parametrize("env,args,reason", [
    ({"VLLM_ROCM_USE_AITER": "1"}, K3_ARGS, "VLLM_USE_BREAKABLE_CUDAGRAPH is not 1 (no breakable CUDA graphs)"),
    ({**HAZARD_ENV, "VLLM_USE_V2_MODEL_RUNNER": "0"}, K3_ARGS,
     "VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner captures PIECEWISE sizes without metadata)"),
    (HAZARD_ENV, [*K3_ARGS, "--enforce-eager"], "--enforce-eager (no CUDA graphs)"),
    (HAZARD_ENV, [*K3_ARGS, "-cc.cudagraph_mode=full_decode_only"],
     "cudagraph_mode FULL_DECODE_ONLY (no PIECEWISE graphs)"),
    (HAZARD_ENV, [*K3_ARGS, "-cc", '{"cudagraph_mode": "NONE"}'], "cudagraph_mode NONE (no PIECEWISE graphs)"),
    (HAZARD_ENV, [*K3_ARGS, "-O", '{"cudagraph_mode": "FULL"}'], "cudagraph_mode FULL (no PIECEWISE graphs)"),
    (HAZARD_ENV, [*K3_ARGS, '--compilation-config={"cudagraph_mode": "full"}'],
     "cudagraph_mode FULL (no PIECEWISE graphs)"),
    ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, K3_ARGS,
     "AITER MLA is off (VLLM_ROCM_USE_AITER / VLLM_ROCM_USE_AITER_MLA): vLLM never fuses the decode"),
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_FP8BMM": "True", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, K3_ARGS,
     "VLLM_ROCM_USE_AITER_FP8BMM=True, and the FP4 BMM is not taken (VLLM_ROCM_USE_AITER_FP4BMM=0): vLLM never fuses "
     "the decode"),
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_FP8BMM": "1"}, K3_ARGS,
     "VLLM_ROCM_USE_AITER_FP8BMM=1, and the FP4 BMM is not taken (VLLM_ROCM_USE_AITER_FP4BMM unset: off by vLLM "
     "0.33's default): vLLM never fuses the decode"),
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER": " true "}, K3_ARGS,  # vLLM strips nothing: " true " is not "true"
     "AITER MLA is off (VLLM_ROCM_USE_AITER / VLLM_ROCM_USE_AITER_MLA): vLLM never fuses the decode"),
    (HAZARD_ENV, ["--kv-cache-dtype", "bfloat16"],
     "--kv-cache-dtype bfloat16 (vLLM fuses the decode only with an fp8 KV cache)"),
    (HAZARD_ENV, ["--kv-cache-dtype", "bfloat16", "--kv-cache-dtype"],  # a last word without a value: ignored
     "--kv-cache-dtype bfloat16 (vLLM fuses the decode only with an fp8 KV cache)"),
    (HAZARD_ENV, [*K3_ARGS, "--decode-context-parallel-size", str(DCP)],
     f"--decode-context-parallel-size {DCP} (vLLM does not fuse the decode under DCP)"),
    (HAZARD_ENV, [*K3_ARGS, f"-dcp={DCP}"],
     f"--decode-context-parallel-size {DCP} (vLLM does not fuse the decode under DCP)"),
])
def test_every_reason_that_rules_the_hazard_out_word_for_word(env, args, reason):
    assert ruled_out(env, args, FACTS) == reason
    assert baseline_hazard(FACTS, env, args, "0") is None


@pytest.mark.parametrize("version,arch,env,reason", [
    ("0.32.0", None, {"VLLM_ROCM_USE_AITER_FP4BMM": "false"},
     "VLLM_ROCM_USE_AITER_FP8BMM unset: on by vLLM 0.32's default, and the FP4 BMM is not taken "
     "(VLLM_ROCM_USE_AITER_FP4BMM=false): vLLM never fuses the decode"),
    ("0.32.0", "gfx942", {},
     "VLLM_ROCM_USE_AITER_FP8BMM unset: on by vLLM 0.32's default, and the FP4 BMM is not taken (a gfx942 GPU; vLLM "
     "takes it only on gfx950): vLLM never fuses the decode"),
    ("0.32.0", "gfx950", {}, None),
    ("0.32.0", None, {}, None),
    ("0.33.0", "gfx942", {}, None),  # the FP8 BMM off by 0.33's default: vLLM fuses
    ("0.36.1", "gfx942", {"VLLM_ROCM_USE_AITER_FP4BMM": "0"}, None),  # its FP8 default not known here
])
def test_the_bmm_reasons_word_for_word_per_release_and_gpu(version, arch, env, reason):
    facts = VllmFacts(version, True) if arch is None else VllmFacts(version, True, arch)
    assert ruled_out({**HAZARD_ENV, **env}, K3_ARGS, facts) == reason
    assert (baseline_hazard(facts, {**HAZARD_ENV, **env}, K3_ARGS, "0") is None) is (reason is not None)


@pytest.mark.parametrize("env,args", [
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER": "True"}, K3_ARGS),  # vLLM reads "1" or "true", any case
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_FP4BMM": "0"}, K3_ARGS),  # 0.33: the FP8 BMM off by default, vLLM fuses
    ({**HAZARD_ENV, "VLLM_ROCM_USE_AITER_FP8BMM": " 1"}, K3_ARGS),  # vLLM reads " 1" as off: it fuses
    ({**HAZARD_ENV, "VLLM_USE_V2_MODEL_RUNNER": "yes"}, K3_ARGS),  # vLLM refuses it itself: not ruled out here
    (HAZARD_ENV, ["--tensor-parallel-size", "8", "--kv-cache-dtype", "auto"]),  # may be fp8 from the checkpoint
    (HAZARD_ENV, ["--kv-cache-dtype=fp8_e4m3"]),
    (HAZARD_ENV, ["--tensor-parallel-size", "8", "--kv-cache-dtype"]),  # the option as the last word, no value
    (HAZARD_ENV, [*K3_ARGS, "--decode-context-parallel-size", "1"]),  # DCP 1 is no DCP
    (HAZARD_ENV, [*K3_ARGS, "-dcp", "1"]),
    (HAZARD_ENV, [*K3_ARGS, "-cc"]),  # the option as the last word
    (HAZARD_ENV, [*K3_ARGS, "-O", "3"]),  # an optimisation level, no JSON
    (HAZARD_ENV, [*K3_ARGS, "-cc", '{"cudagraph_mode": "PIECEWISE"}']),
])
def test_what_leaves_the_hazard_standing(env, args):
    assert ruled_out(env, args, FACTS) is None
    assert baseline_hazard(FACTS, env, args, "0").startswith("K3_AMD_OVERLAY='0' is no valid")


def test_a_bad_switch_is_no_hazard_here():
    """A switch the settings refuse is reported as such elsewhere (before any server starts), not as a hazard."""
    assert baseline_hazard(VllmFacts("0.33.0", True), HAZARD_ENV, K3_ARGS, "qk_cach") is None
    assert baseline_hazard(VllmFacts("0.33.0", True), HAZARD_ENV, K3_ARGS, "qkv_norm")  # a valid neighbour is


def test_serve_arguments_that_do_not_split_are_a_usage_error_naming_the_option():
    with pytest.raises(UsageError) as refused:
        baseline_hazard(VllmFacts("0.33.0", True), HAZARD_ENV, '--kv-cache-dtype "fp8', "0")
    assert str(refused.value) == ("""--serve-args '--kv-cache-dtype "fp8': No closing quotation (quote it as a shell """
                                  "would)")


def test_the_facts_are_an_immutable_value(tmp_path):
    facts = VllmFacts("0.33.0", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.fused_decode_of_its_own = False  # type: ignore[misc]
    assert {facts, VllmFacts("0.33.0", True)} == {facts}
    assert facts_of(None, "0.33.0") == VllmFacts("0.33.0", None)  # no vLLM here: unknown
    assert facts_of(tmp_path, "0.34.0") == VllmFacts("0.34.0", None)  # no K3 code vLLM's shapes know: unknown
    assert facts_of(None, "0.32.0", "gfx942") == VllmFacts("0.32.0", None, "gfx942")  # the GPU carried as given
