"""What `check` says of a process's launch configs beyond their files: a tuned file it could not use,
a config degraded to the arch's safe one (and whether that failed too), and the seconds its kernels
took to compile at model load. Each is a fact for the reader (info), never a reason to hold."""

from drawn_seconds import seconds_between
from records import judge

from k3_amd_overlay.commands import verdict
from k3_amd_overlay.package import __version__


def _record(launch_configs):
    entry = {"state": "applied", "provider": "triton", "reason": "r", "effective": True, "layers": 2,
             "runs": {"served": 3}}
    return {"pid": 41, "role": "worker", "vllm_version": "0.33.0", "mode": "auto",
            "overlay_version": __version__, "fusions": {"qk_cache": entry},
            "launch_configs": {"arch": "gfx942", "device": "AMD Instinct MI300X", "kernels": {}, **launch_configs}}


def test_an_unusable_file_a_degraded_config_and_the_compile_seconds_are_each_said():
    seconds = seconds_between(0.5, 9.0)
    launch_configs = {
        "error": "/t/gfx942-AMD_Instinct_MI300X.json: cannot read launch configs; this GPU's kernels take the "
                 "shipped gfx942 launch configs instead",
        "degraded": {"qk_cache_kernel": [
            {"rules": ["tokens<=8", "*"], "config": {"HEADS": 4, "num_warps": 8}, "safe": {"HEADS": 1, "num_warps": 4},
             "why": "RuntimeError: out of resources"},
            {"rules": ["tokens<=64"], "config": {"HEADS": 2, "num_warps": 2}, "safe": {"HEADS": 1, "num_warps": 4},
             "why": "RuntimeError: bad", "safe_failed": "RuntimeError: worse"}]},
        "compile_seconds": {"qk_cache_kernel": seconds, "rmsnorm_pair_kernel": 0.25},
    }
    assert verdict.launch_config_notes(launch_configs) == [
        "unusable launch-config file: /t/gfx942-AMD_Instinct_MI300X.json: cannot read launch configs; this GPU's "
        "kernels take the shipped gfx942 launch configs instead",
        "qk_cache_kernel config {'HEADS': 4, 'num_warps': 8} (rules tokens<=8, *) degraded to the safe config "
        "{'HEADS': 1, 'num_warps': 4}: RuntimeError: out of resources",
        "qk_cache_kernel config {'HEADS': 2, 'num_warps': 2} (rules tokens<=64) degraded to the safe config "
        "{'HEADS': 1, 'num_warps': 4}: RuntimeError: bad; the safe config failed too: RuntimeError: worse",
        f"compiled at model load in {seconds + 0.25:.1f} s (qk_cache_kernel {seconds:.1f} s, "
        "rmsnorm_pair_kernel 0.2 s)",
    ]
    found = judge([_record(launch_configs)], "fused", ["qk_cache"], require_effective=True)
    assert found.holds
    notes = [line for line in found.lines if "unusable launch-config" in line or "degraded to" in line
             or "compiled at model load" in line]
    assert len(notes) == 4 and all(line.startswith("info ") and "pid 41" in line for line in notes), notes


def test_nothing_is_said_where_nothing_happened():
    assert verdict.launch_config_notes({"arch": "gfx942", "kernels": {}}) == []
    found = judge([_record({})], "fused", ["qk_cache"], require_effective=True)
    assert not [line for line in found.lines if "degraded" in line or "compiled at model load" in line]
