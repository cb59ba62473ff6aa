"""The launch-config loader's contract, pinned exactly: every message a bad file gets (each names the
value and what is allowed), the parsed config values, the order rules match in and their inclusive
bounds, the dot-warps bound per arch, the fallback arch's note and warning, the tuned file's checks,
``sources()``'s JSON, and what ``degrade`` logs and records."""

from __future__ import annotations

import dataclasses
import json
import logging
import random

import pytest

from k3_amd_overlay.kernels import launch_configs, names
from k3_amd_overlay.kernels.launch_configs import LaunchConfigError
from k3_amd_overlay.settings import KERNEL_CONFIGS

QK = names.QK_CACHE_KERNEL
FP8 = names.ABSORB_FP8_QK_CACHE_KERNEL
LOGGER = "vllm.k3_amd_overlay"
TUNE_HINT = "; `k3-amd-overlay tune` on this GPU writes its own"


def _clear_caches() -> None:
    for cached in (launch_configs._resolve, launch_configs._tuned, launch_configs.shipped,
                   launch_configs._warn_fallback, launch_configs._log_unusable, launch_configs._warn_foreign):
        cached.cache_clear()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(KERNEL_CONFIGS, raising=False)
    monkeypatch.setattr(launch_configs, "_degraded", {})
    _clear_caches()
    yield
    _clear_caches()


def _refusal(data, path="tuned.json") -> str:
    with pytest.raises(LaunchConfigError) as caught:
        launch_configs.parse(data, path)
    return str(caught.value)


def _file(kernel, rules, arch="gfx942", device=None):
    return {"schema": 1, "arch": arch, "tuned_on": {"device": device} if device else None, "kernels": {kernel: rules}}


def _one(kernel, config, arch="gfx942"):
    return _file(kernel, [{"config": config}], arch)


QK_ALLOWED = "HEADS, num_warps, num_stages, waves_per_eu, matrix_instr_nonkdim, kpack"


def test_every_message_of_the_file_parser_word_for_word():
    path = f"tuned-{random.randrange(1, 10**6)}.json"
    at = f"{path} {QK}"
    known = ", ".join(launch_configs.KERNEL_PARAMETERS)
    cases = [
        (5, f"{path}: not a launch-config file of schema 1"),
        ({"schema": 2, "arch": "gfx942", "kernels": {}}, f"{path}: not a launch-config file of schema 1"),
        ({"schema": 1, "arch": 942, "kernels": {}}, f"{path}: needs a string 'arch' and a 'kernels' object"),
        ({"schema": 1, "arch": "gfx942", "kernels": []}, f"{path}: needs a string 'arch' and a 'kernels' object"),
        ({"schema": 1, "arch": "gfx942", "kernels": {"zeta": [], "alpha": []}},
         f"{path}: unknown kernels ['alpha', 'zeta'] (known: {known})"),
        (_file(QK, "x"), f"{at}: a non-empty list of rules is needed, got 'x'"),
        (_file(QK, []), f"{at}: a non-empty list of rules is needed, got []"),
        (_file(QK, [5]), f"{at} rule 0: 5 must be {{tokens?, heads?, config, note?}}"),
        (_file(QK, [{"config": {"HEADS": 2, "num_warps": 2}, "tokenz": 3}]),
         f"{at} rule 0: {{'config': {{'HEADS': 2, 'num_warps': 2}}, 'tokenz': 3}} must be "
         "{tokens?, heads?, config, note?}"),
        (_file(QK, [{"tokens": 4}]), f"{at} rule 0: {{'tokens': 4}} must be {{tokens?, heads?, config, note?}}"),
        (_file(QK, [{"tokens": 0, "config": {"HEADS": 2, "num_warps": 2}}, {"config": {"HEADS": 2, "num_warps": 2}}]),
         f"{at} rule 0 tokens: 0 is not a positive integer"),
        (_file(QK, [{"config": {"HEADS": 2, "num_warps": 2}}, {"heads": True, "config": {"HEADS": 2, "num_warps": 2}}]),
         f"{at} rule 1 heads: True is not a positive integer"),
        (_file(QK, [{"config": {"HEADS": 2, "num_warps": 2}}, {"tokens": 8, "config": {"HEADS": 2, "num_warps": 2}}]),
         f"{at}: the last rule must match every launch (no tokens or heads bound)"),
        (_one(QK, [1]), f"{at} rule 0: config must be an object, got [1]"),
        (_one(QK, {"num_warps": 4, "BLOCK": 2}),
         f"{at} rule 0: config {{'num_warps': 4, 'BLOCK': 2}} lacks ['HEADS'] or has unknown keys ['BLOCK'] "
         f"(allowed: {QK_ALLOWED})"),
        (_one(QK, {"HEADS": 4, "num_warps": 0}), f"{at} rule 0 num_warps: 0 is not a positive integer"),
        (_one(QK, {"HEADS": 4, "num_warps": 4, "num_stages": 0}),
         f"{at} rule 0 num_stages: 0 is not a positive integer"),
        (_one(QK, {"HEADS": 4, "num_warps": "4"}), f"{at} rule 0 num_warps: '4' is not a positive integer"),
        (_one(QK, {"HEADS": 4, "num_warps": 4, "kpack": -1}), f"{at} rule 0 kpack: -1 is not a positive integer"),
        (_one(QK, {"HEADS": 4, "num_warps": 4, "matrix_instr_nonkdim": 8}),
         f"{at} rule 0: matrix_instr_nonkdim = 8: 0 (Triton's choice) or one of 16, 32"),
        (_one(QK, {"HEADS": 3, "num_warps": 4}), f"{at} rule 0: HEADS = 3 is not a power of two"),
        (_one(QK, {"HEADS": 4, "num_warps": 6}), f"{at} rule 0: num_warps = 6 is not a power of two"),
        (_one(FP8, {"BLOCK_N": 32, "BLOCK_T": 8, "num_warps": 1}),
         f"{path} {FP8} rule 0: BLOCK_T = 8 on gfx942: at most 4 (no dot: the products summed in fp32) or at "
         "least 16 (AMD's smallest matrix tile; Triton computes a smaller dot there with FMA)"),
        (_one(names.ABSORB_QK_CACHE_KERNEL, {"BLOCK_N": 32, "BLOCK_T": 1, "K_STEPS": 2, "num_warps": 1}),
         f"{path} {names.ABSORB_QK_CACHE_KERNEL} rule 0: K_STEPS = 2 with BLOCK_T = 1: the product in slices "
         "is for programs of at least 16 tokens"),
        # the dot-warps bound on AMD: one warp per matrix tile, 16x16 below 32 on either side, 32x32 from 32
        (_one(FP8, {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 8}),
         f"{path} {FP8} rule 0: num_warps = 8 on a 16x64 block (BLOCK_T x BLOCK_N) of 16x16 matrix tiles on gfx942: "
         "at most 4 warps (more compute the same tile over again)"),
        (_one(FP8, {"BLOCK_N": 32, "BLOCK_T": 32, "num_warps": 2}),
         f"{path} {FP8} rule 0: num_warps = 2 on a 32x32 block (BLOCK_T x BLOCK_N) of 32x32 matrix tiles on gfx942: "
         "at most 1 warps (more compute the same tile over again)"),
        (_one(FP8, {"BLOCK_N": 128, "BLOCK_T": 64, "num_warps": 16, "matrix_instr_nonkdim": 32}, arch="gfx950"),
         f"{path} {FP8} rule 0: num_warps = 16 on a 64x128 block (BLOCK_T x BLOCK_N) of 32x32 matrix tiles on gfx950: "
         "at most 8 warps (more compute the same tile over again)"),
    ]
    assert [_refusal(data, path) for data, _ in cases] == [message for _, message in cases]


def test_a_file_that_cannot_be_read_names_the_path_and_why(tmp_path):
    missing = tmp_path / f"gone-{random.randrange(1, 10**6)}.json"
    with pytest.raises(LaunchConfigError) as caught:
        launch_configs.load(missing)
    assert str(caught.value) == \
        f"cannot read launch configs {missing}: [Errno 2] No such file or directory: '{missing}'"
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(LaunchConfigError) as caught:
        launch_configs.load(broken)
    assert str(caught.value).startswith(f"cannot read launch configs {broken}: Expecting property name")


def test_parsed_values_are_kept_exactly_amd_zero_meaning_the_compilers_choice():
    heads, warps, stages = (random.choice((2, 4, 8, 16)) for _ in range(3))
    config = {"HEADS": heads, "num_warps": warps, "num_stages": stages, "waves_per_eu": 0, "kpack": 1,
              "matrix_instr_nonkdim": 0}
    table = launch_configs.parse(_file(QK, [{"tokens": 3, "heads": 5, "config": config, "note": "n"},
                                            {"config": dict(config, waves_per_eu=2, matrix_instr_nonkdim=32)}],
                                       device="AMD Instinct MI300X"), "t.json")
    assert (table.path, table.arch, table.tuned_on) == ("t.json", "gfx942", "AMD Instinct MI300X")
    assert table.kernels == {QK: (
        launch_configs.Rule(3, 5, (("HEADS", heads), ("kpack", 1), ("matrix_instr_nonkdim", 0), ("num_stages", stages),
                                   ("num_warps", warps), ("waves_per_eu", 0))),
        launch_configs.Rule(None, None, (("HEADS", heads), ("kpack", 1), ("matrix_instr_nonkdim", 32),
                                         ("num_stages", stages), ("num_warps", warps), ("waves_per_eu", 2))))}
    # NVIDIA files are not held to one warp per matrix tile
    sm90 = launch_configs.parse(_one(FP8, {"BLOCK_N": 16, "BLOCK_T": 16, "num_warps": 8}, arch="sm90"), "s.json")
    assert sm90.kernels[FP8][0].config == (("BLOCK_N", 16), ("BLOCK_T", 16), ("num_warps", 8))


def test_programs_of_fewer_tokens_than_a_dot_tile_parse_with_any_warps_on_amd():
    """BLOCK_T 2 and 4 (no dot: the products summed lane by lane) are allowed, and, having no matrix
    tiles, are not held to one warp per tile; 8 is refused (above)."""
    for block_t in (2, 4):
        config = {"BLOCK_N": 16, "BLOCK_T": block_t, "num_warps": 8}
        assert launch_configs.dot_warps_fit("gfx942", FP8, config)
        table = launch_configs.parse(_one(FP8, config), "few.json")
        assert table.kernels[FP8][0].config == (("BLOCK_N", 16), ("BLOCK_T", block_t), ("num_warps", 8))
    assert not launch_configs.dot_warps_fit("gfx942", FP8, {"BLOCK_N": 16, "BLOCK_T": 16, "num_warps": 8})


def test_parsed_tables_are_frozen_and_hashable():
    table = launch_configs.shipped("gfx942")
    rule = table.kernels[QK][0]
    source = launch_configs.resolve("gfx942")[QK][1]
    for frozen, field in ((rule, "tokens"), (table, "arch"), (source, "file")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, field, None)
    assert hash(rule) == hash(launch_configs.Rule(rule.tokens, rule.heads, rule.config))
    assert hash(source) == hash(dataclasses.replace(source))


def test_the_matrix_tile_and_the_dot_warps_bound_per_arch():
    block = {"BLOCK_T": 64, "BLOCK_N": 128}
    assert launch_configs.matrix_tile("sm90", block) == (16, 8)
    assert launch_configs.matrix_tile("sm100", {"BLOCK_T": 16, "BLOCK_N": 16}) == (16, 8)
    assert [launch_configs.matrix_tile("gfx942", {"BLOCK_T": t, "BLOCK_N": n}) for t, n in
            ((64, 128), (32, 32), (16, 128), (128, 16), (16, 16))] == [(32, 32), (32, 32), (16, 16), (16, 16), (16, 16)]
    assert launch_configs.matrix_tile("gfx950", {**block, "matrix_instr_nonkdim": 16}) == (16, 16)
    cases = [("sm90", {"BLOCK_T": 64, "BLOCK_N": 64}, 32), ("sm90", {"BLOCK_T": 16, "BLOCK_N": 8}, 1),
             ("gfx942", {"BLOCK_T": 16, "BLOCK_N": 16}, 1), ("gfx942", {"BLOCK_T": 16, "BLOCK_N": 64}, 4),
             ("gfx942", {"BLOCK_T": 64, "BLOCK_N": 16}, 4), ("gfx942", {"BLOCK_T": 64, "BLOCK_N": 128}, 8),
             ("gfx942", {"BLOCK_T": 16, "BLOCK_N": 16, "matrix_instr_nonkdim": 32}, 1),
             ("gfx950", {"BLOCK_T": 32, "BLOCK_N": 256, "matrix_instr_nonkdim": 16}, 32)]
    bounds = [launch_configs.max_dot_warps(arch, config) for arch, config, _ in cases]
    assert bounds == [expected for _, _, expected in cases]
    assert all(type(bound) is int for bound in bounds)


def test_dot_warps_fit_holds_amd_dot_blocks_only_to_one_warp_per_tile():
    fits = launch_configs.dot_warps_fit
    assert not fits("gfx942", FP8, {"BLOCK_T": 16, "BLOCK_N": 16, "num_warps": 2})
    assert not fits("gfx942", FP8, {"BLOCK_T": 16, "BLOCK_N": 64, "num_warps": 8})
    assert fits("gfx942", FP8, {"BLOCK_T": 16, "BLOCK_N": 64, "num_warps": 4})
    assert fits("gfx942", FP8, {"BLOCK_T": 1, "BLOCK_N": 16, "num_warps": 8})  # one token a program: no dot
    assert fits("gfx942", FP8, {"BLOCK_T": 4, "BLOCK_N": 16, "num_warps": 8})  # nor at four
    assert fits("sm90", FP8, {"BLOCK_T": 16, "BLOCK_N": 16, "num_warps": 8})
    assert fits("gfx942", QK, {"BLOCK_T": 16, "BLOCK_N": 16, "num_warps": 8, "HEADS": 4})


FALLBACK = {
    "gfx90a": "no launch-config file for gfx90a: gfx942's rules, untuned there" + TUNE_HINT,
    "gfx1100": "no launch-config file for gfx1100: gfx942's rules, untuned there (32-wide waves and WMMA: gfx942's "
               "register and tile reasoning does not hold)" + TUNE_HINT,
    "sm100": "no launch-config file for sm100: sm90's rules, untuned there" + TUNE_HINT,
}


def test_the_fallback_arch_its_note_and_its_warning(caplog):
    assert [launch_configs.fallback_note(a) for a in ("cpu", *launch_configs.SHIPPED_ARCHS)] == [None] * 4
    assert {arch: launch_configs.fallback_note(arch) for arch in FALLBACK} == FALLBACK
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        launch_configs.resolve("gfx1100")
        launch_configs.resolve("gfx942")
        launch_configs.resolve("cpu")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == \
        [(LOGGER, logging.WARNING, f"K3 AMD overlay: {FALLBACK['gfx1100']}")]


def test_sources_json_exactly():
    gfx942 = str(launch_configs.CONFIG_DIR / "gfx942.json")
    assert launch_configs.sources("gfx90a", "AMD Instinct MI210") == {
        kernel: {"file": gfx942, "arch": "gfx942", "tuned_on": None, "tuned_here": False, "note": FALLBACK["gfx90a"]}
        for kernel in launch_configs.KERNEL_PARAMETERS}
    assert launch_configs.sources("gfx942") == {
        kernel: {"file": gfx942, "arch": "gfx942", "tuned_on": None, "tuned_here": False}
        for kernel in launch_configs.KERNEL_PARAMETERS}


def test_device_slug_and_tuned_file_names():
    assert launch_configs.device_slug("AMD Instinct MI300X") == "AMD_Instinct_MI300X"
    assert launch_configs.device_slug("  AMD Radeon RX 7900 XTX (gfx1100) ") == "AMD_Radeon_RX_7900_XTX_gfx1100"
    assert launch_configs.tuned_name("gfx942", "AMD Instinct MI300X") == "gfx942-AMD_Instinct_MI300X.json"


def test_a_shipped_file_lacking_a_kernel_refuses_the_fusions(tmp_path, monkeypatch, caplog):
    kept = random.choice(list(launch_configs.KERNEL_PARAMETERS))
    data = json.loads((launch_configs.CONFIG_DIR / "gfx942.json").read_text())
    data["kernels"] = {kept: data["kernels"][kept]}
    (tmp_path / "gfx942.json").write_text(json.dumps(data))
    monkeypatch.setattr(launch_configs, "CONFIG_DIR", tmp_path)
    lacking = sorted(set(launch_configs.KERNEL_PARAMETERS) - {kept})
    message = f"{tmp_path / 'gfx942.json'}: the shipped file lacks {lacking}; the fused Triton kernels are refused " \
              "(stock runs)"
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert launch_configs.startup_error("gfx90a") == message
        with pytest.raises(LaunchConfigError) as caught:
            launch_configs.safe_config(kept, "gfx942")
    assert str(caught.value) == message
    assert [(r.name, r.getMessage()) for r in caplog.records] == [(LOGGER, f"K3 AMD overlay: {message}")]


def _tuned_rules(a, b, c):
    return [{"tokens": 1, "config": a}, {"heads": 1, "config": b}, {"tokens": 64, "config": a}, {"config": c}]


def test_a_tuned_file_that_cannot_be_used_is_named_with_why(tmp_path, monkeypatch, caplog):
    device = f"AMD Instinct MI30{random.randrange(1, 9)}X"
    config = {"HEADS": 2, "num_warps": 2}
    named = tmp_path / launch_configs.tuned_name("gfx942", device)
    named.write_text(json.dumps(_file(QK, [{"config": config}])))  # its header names no GPU
    monkeypatch.setenv(KERNEL_CONFIGS, str(tmp_path))
    fallback = "; this GPU's kernels take the shipped gfx942 launch configs instead"
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        error = launch_configs.startup_error("gfx942", device)
    assert error == (f"K3_AMD_OVERLAY_KERNEL_CONFIGS={tmp_path}: {named}: named for gfx942 on {device}, its header "
                     f"says gfx942 on no GPU (untuned){fallback}")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [(LOGGER, f"K3 AMD overlay: {error}")]

    other = tmp_path / "other.json"
    other.write_text(json.dumps(_file(QK, [{"config": config}], arch="gfx950")))
    monkeypatch.setenv(KERNEL_CONFIGS, str(other))
    assert launch_configs.startup_error("gfx942", device) == \
        f"K3_AMD_OVERLAY_KERNEL_CONFIGS={other}: its configs are for gfx950, this GPU is gfx942{fallback}"


def test_rules_match_in_order_with_inclusive_bounds_and_choose_defaults(tmp_path, monkeypatch):
    a = {"HEADS": 2, "num_warps": 2, "waves_per_eu": 2}
    b = {"HEADS": 4, "num_warps": 4}
    c = {"HEADS": 8, "num_warps": 1, "kpack": 2}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(_file(QK, _tuned_rules(a, b, c))))
    monkeypatch.setenv(KERNEL_CONFIGS, str(path))
    choose = launch_configs.choose
    plain_a, plain_c = {"HEADS": 2, "num_warps": 2}, {"HEADS": 8, "num_warps": 1}
    assert [choose(QK, "gfx942", None, t, h, amd=True) for t, h in ((1, 96), (2, 1), (2, 2), (64, 2), (65, 2))] == \
        [a, b, a, a, c]
    assert choose(QK, "gfx942", None, 1) == plain_a  # AMD-only options dropped unless asked for
    assert choose(QK, "gfx942", None, 2) == b  # one head unless told
    assert choose(QK, "gfx942", None, 65, 2) == plain_c


def test_degrade_logs_records_and_serves_the_safe_config(tmp_path, monkeypatch, caplog):
    a = {"HEADS": 2, "num_warps": 2, "waves_per_eu": 3}
    b = {"HEADS": 4, "num_warps": 4}
    c = {"HEADS": 16, "num_warps": 1}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(_file(QK, _tuned_rules(a, b, c))))
    monkeypatch.setenv(KERNEL_CONFIGS, str(path))
    safe = dict(launch_configs.shipped("gfx942").kernels[QK][-1].config)
    assert dict(launch_configs.safe_config(QK, "gfx942")) == safe and safe != a
    why, again = (f"failure {random.randrange(1, 10**6)}" for _ in range(2))
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert launch_configs.degrade(QK, "gfx942", None, 30, 7, why) is True
        assert launch_configs.choose(QK, "gfx942", None, 1, 96, amd=True) == safe
        assert launch_configs.choose(QK, "gfx942", None, 30, 1, amd=True) == b  # rule 1 picks b: not degraded
        assert launch_configs.degrade(QK, "gfx942", None, 1, 1, again) is False
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (LOGGER, logging.ERROR, f"K3 AMD overlay: {QK}: config {a} (rules T<=1, H<=any, T<=64, H<=any) failed on "
                                f"gfx942 (no GPU name): {why}; those rules take the safe config {safe} from now on"),
        (LOGGER, logging.ERROR, f"K3 AMD overlay: {QK}: the safe config {safe} failed too on gfx942: {again}")]
    assert launch_configs.degraded() == {QK: [{"rules": ["T<=1, H<=any", "T<=64, H<=any"], "config": a, "safe": safe,
                                               "why": why, "safe_failed": again}]}
