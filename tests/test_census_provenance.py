"""Where the census's evidence comes from (audit of 2026-12): counted by kernel name, nothing showed
that the two arms profiled the same window (a stock baseline of 20 decode steps against a fused
candidate of 4, ``--steps 20``, read as 8.75x where a step gains 1.75x), and a candidate where only
vLLM's own fused decode ran (AITER's fused write, vLLM 0.30+ deciding ``upstream``) was credited to
the overlay's qk_cache. By name, the kernels no fusion touches (attention, the model's other GEMMs,
MoE, all-reduce) must have run in both arms, as often on every rank; a section is the overlay's
fusion only where an overlay kernel of it ran. Each test failed before the fix."""

from __future__ import annotations

import json
from pathlib import Path

from kineto_traces import ATTENTION, kernel_trace, ranged_events

from k3_amd_overlay.commands import census
from k3_amd_overlay.commands.cli import main

LAYERS = 24
STOCK = {"void vllm::concat_and_cache_mla_kernel<bf16>": 1, "CatArrayBatchedCopy": 1,
         "aiter::scaled_quant_kernel<bf16>": 1}  # per layer step: the KV write, concat and quant
VLLM_FUSED = "void aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel<bf16>"  # vLLM 0.30+'s own fused decode
AITER_NORM = "void aiter::fused_qk_rmsnorm_kernel<bf16, 8>"  # vLLM's own fused q/kv norm (AITER)
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"


def _arm(path: Path, steps: int, per_step: dict[str, int], rank: int = 0, **untouched: int) -> Path:
    """One rank's graph-replayed trace (kernels alone, counted by name): ``per_step`` kernels per layer
    step over ``steps`` steps of 24 layers, and the attention kernel once per layer step (``untouched``
    gives other counts of kernels no fusion touches)."""
    kernels = {name: n * steps * LAYERS for name, n in per_step.items()}
    kernels.update(untouched or {ATTENTION: steps * LAYERS})
    path.parent.mkdir(parents=True, exist_ok=True)
    return kernel_trace(path, kernels, traceName=str(path), distributedInfo={"rank": rank, "world_size": 1})


def _compare(base: Path | list[Path], cand: Path | list[Path], steps: int | None = 20) -> census.Comparison:
    def read(paths: Path | list[Path]) -> census.Census:
        return census.read_census(paths if isinstance(paths, list) else [paths])

    return census.compare(read(base), read(cand), steps, LAYERS)


def test_a_fused_window_of_fewer_steps_counted_by_name_gives_no_ratio(tmp_path, capsys):
    """The audit's case with the attention kernel a real window holds: 20 stock steps against 4 fused
    ones, --steps 20. Before: "qk_cache region: 3360.0 µs -> 384.0 µs", holds, exit 0."""
    base = _arm(tmp_path / "stock" / "rank0.json", 20, STOCK)
    cand = _arm(tmp_path / "fused" / "rank0.json", 4, {"qk_cache_kernel": 1})
    comparison = _compare(base, cand)
    assert not comparison.holds and comparison.sections == [] and comparison.launches is None
    assert comparison.problems == [
        f"counted by kernel name (no overlay ranges to count the steps by), and on rank 0 {ATTENTION}, which no "
        "fusion touches, ran 480 times in the baseline and 96 in the candidate: the arms profiled windows of "
        "different lengths, so their totals cannot be compared; profile the same number of steps in both arms (the "
        "same requests, the same profiler window)"]
    assert main(["census", str(cand), "--baseline", str(base), "--steps", "20"]) == 1
    out = capsys.readouterr().out
    assert "region:" not in out and "kernel launches per rank" not in out and "NO COMPARISON: counted by kernel" in out
    same = _compare(base, _arm(tmp_path / "fused20" / "rank0.json", 20, {"qk_cache_kernel": 1}))
    assert same.holds and [s.fusions for s in same.sections] == [("qk_cache",)]
    assert same.sections[0].ratio == 3.0  # 3 stock launches of 2 µs per layer step against one


def test_one_rank_whose_window_differs_is_named_with_how_many_kernels_differ(tmp_path):
    """Rank 0's windows match; rank 1's candidate profiled fewer steps: its attention and all-reduce
    counts differ (the larger named, both counted)."""
    base = [_arm(tmp_path / "b" / f"rank{r}.json", 10, STOCK, rank=r, **{ATTENTION: 240, ALLREDUCE: 480})
            for r in range(2)]
    cand = [_arm(tmp_path / "c" / f"rank{r}.json", 10 - 5 * r, {"qk_cache_kernel": 1}, rank=r,
                 **{ATTENTION: 240 - 120 * r, ALLREDUCE: 480 - 240 * r}) for r in range(2)]
    comparison = _compare(base, cand, steps=None)
    assert not comparison.holds and not comparison.sections
    assert comparison.problems == [
        f"counted by kernel name (no overlay ranges to count the steps by), and on rank 1 {ALLREDUCE}, which no "
        "fusion touches, ran 480 times in the baseline and 240 in the candidate (2 such kernels differ): the arms "
        "profiled windows of different lengths, so their totals cannot be compared; profile the same number of "
        "steps in both arms (the same requests, the same profiler window)"]


def test_arms_without_a_kernel_in_common_that_no_fusion_touches_give_no_ratio(tmp_path, capsys):
    """The audit's own traces: the region's kernels alone, nothing else of the model in either window
    (or only kernels one arm ran): nothing shows that the arms profiled the same steps."""
    base = _arm(tmp_path / "stock" / "rank0.json", 20, STOCK, **{"only_in_the_baseline_kernel": 3})
    cand = _arm(tmp_path / "fused" / "rank0.json", 4, {"qk_cache_kernel": 1}, **{"only_in_the_candidate": 3})
    bare = _arm(tmp_path / "bare" / "rank0.json", 4, {"qk_cache_kernel": 1}, **{})
    bare.write_text(json.dumps({"traceEvents": [e for e in json.loads(bare.read_text())["traceEvents"]
                                                if e["name"] == "qk_cache_kernel"]}))
    said = ("counted by kernel name (no overlay ranges to count the steps by), and on rank 0 the arms ran no kernel "
            "in common that no fusion touches (the attention kernel, the model's other GEMMs, MoE, all-reduce): "
            "nothing shows they profiled the same steps, so their totals cannot be compared; profile the same steps "
            "in both arms with the whole model in the window (the same requests, the same profiler window), or eager "
            "(--enforce-eager) with the overlay on, K3_AMD_OVERLAY=stock for the baseline, whose ranges count the "
            "steps")
    for candidate in (cand, bare):
        comparison = _compare(base, candidate)
        assert comparison.problems == [said] and not comparison.holds and not comparison.sections
    assert main(["census", str(bare), "--baseline", str(base), "--steps", "20", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["comparison"]["problems"] == [said]


def test_vllms_own_fused_decode_alone_is_not_the_overlays_qk_cache(tmp_path, capsys):
    """vLLM 0.30+'s own fused decode (AITER's fused write) in the candidate, no overlay kernel, the
    windows alike. Before: "qk_cache region: 3360.0 µs -> 1920.0 µs (1.75x)", holds, exit 0."""
    base = _arm(tmp_path / "stock" / "rank0.json", 20, STOCK)
    cand = _arm(tmp_path / "upstream" / "rank0.json", 20, {VLLM_FUSED: 1})
    comparison = _compare(base, cand)
    assert not comparison.holds and comparison.sections == []
    assert comparison.problems == ["no fusion's own launch ran in the candidate: nothing to compare"]
    assert comparison.not_run["qk_cache"] == (
        "qk_cache: only vLLM's or AITER's own fused kernel ran in the candidate (fuse_qk_rope_concat_and_cache_mla "
        "480, counted by kernel name), no overlay kernel (qk_cache_kernel): this is not the overlay's fusion but "
        "vLLM's own (the overlay's decision upstream), or the overlay's aiter or vllm provider launching the same "
        "kernel, which neither kernel names nor the overlay's ranges tell apart (k3-amd-overlay check says which "
        "ran; the triton provider runs the overlay's own kernel): no section, no ratio")
    assert main(["census", str(cand), "--baseline", str(base), "--steps", "20"]) == 1
    out = capsys.readouterr().out
    assert "qk_cache region" not in out and "this is not the overlay's fusion" in out


def test_vllms_own_fused_decode_inside_the_overlays_ranges_is_not_the_overlays_either(tmp_path):
    """The overlay opens its decode range around vLLM's own fused decode too (a batch vLLM keeps): the
    range does not make AITER's fused write the overlay's launch."""
    def arm(name: str, decode: list[str]) -> census.Census:
        path = tmp_path / f"{name}_rank0.json"
        step = [(None, ["Cijk_Ailk_Bljk_BBS_BH_MT64x64x64"]), ("k3_amd_overlay::mla_decode", [*decode, ATTENTION])]
        path.write_text(json.dumps({"traceEvents": ranged_events([step * 4] * 2)}))
        return census.read_census([path])

    base = arm("stock", ["concat_and_cache_mla_kernel", "CatArrayBatchedCopy", "scaled_quant_kernel"])
    comparison = census.compare(base, arm("upstream", [VLLM_FUSED]), 2, 4)
    assert not comparison.holds and not comparison.sections
    assert comparison.not_run["qk_cache"].startswith(
        "qk_cache: only vLLM's or AITER's own fused kernel ran in the candidate (fuse_qk_rope_concat_and_cache_mla 8, "
        "counted inside its k3_amd_overlay::mla_decode ranges), no overlay kernel (qk_cache_kernel): this is not the "
        "overlay's fusion")
    mixed = census.compare(base, arm("mixed", ["qk_cache_kernel"]), 2, 4)  # the overlay's own launch: its section
    assert mixed.holds and [s.fusions for s in mixed.sections] == [("qk_cache",)]


def test_the_overlays_section_holds_beside_vllms_own_fused_norm_which_gets_none(tmp_path):
    """The overlay's qk_cache launch and vLLM's own AITER q/kv norm in one candidate: the comparison
    holds on the overlay's section alone, and the norm is said to be vLLM's. The overlay's aiter
    absorb provider (AITER's fused BMM with the overlay's own query quant) is the overlay's fusion."""
    base = _arm(tmp_path / "stock" / "rank0.json", 20, {**STOCK, "void vllm::rms_norm_kernel<bf16>": 2})
    cand = _arm(tmp_path / "fused" / "rank0.json", 20, {"qk_cache_kernel": 1, AITER_NORM: 1})
    comparison = _compare(base, cand)
    assert comparison.holds and [s.fusions for s in comparison.sections] == [("qk_cache",)]
    assert comparison.not_run["qkv_norm"].startswith(
        "qkv_norm: only vLLM's or AITER's own fused kernel ran in the candidate (fused_qk_rmsnorm 480, counted by "
        "kernel name), no overlay kernel (rmsnorm_pair_kernel): this is not the overlay's fusion")
    bmm = {"_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel": 1}
    absorb = _compare(_arm(tmp_path / "fp8" / "rank0.json", 20, {**STOCK, **bmm}),
                      _arm(tmp_path / "aiter" / "rank0.json", 20, {"_fused_fp8_bmm_rope_cat_and_cache_mla_kernel": 1,
                                                                   "query_fp8_quant_kernel": 1}))
    assert absorb.holds and [s.fusions for s in absorb.sections] == [("absorb_qk_cache",)]
    assert absorb.sections[0].launched == {"absorb_qk_cache": 960}


def test_each_of_vllms_own_fused_kernels_that_ran_is_named_with_its_count(tmp_path):
    """Two of vLLM's or AITER's fused norm kernels in one candidate: each named with its count."""
    base = _arm(tmp_path / "stock" / "rank0.json", 20, {**STOCK, "void vllm::rms_norm_kernel<bf16>": 2})
    cand = _arm(tmp_path / "fused" / "rank0.json", 20,
                {"qk_cache_kernel": 1, AITER_NORM: 1, "void vllm::FusedQKVRMSNormKernel<bf16>": 2})
    assert _compare(base, cand).not_run["qkv_norm"].startswith(
        "qkv_norm: only vLLM's or AITER's own fused kernel ran in the candidate (fused_qk_rmsnorm 480, "
        "FusedQKVRMSNormKernel 960, counted by kernel name), no overlay kernel (rmsnorm_pair_kernel)")
