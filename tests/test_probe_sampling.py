"""``k3_amd_overlay.kernels.probe`` on a CPU: which batch sizes and head counts the ahead-of-time
compile samples (one of each kind Triton compiles apart, for every config a rule can pick, none for
a rule no batch reaches), the compile-only session it runs in, that it runs once per kernel,
device, dtype, heads, format and kind of block size, only for the Triton provider on a GPU, that a
sample whose config was degraded is compiled again on the safe config, and that each probe launch
hands the launcher vLLM's layouts (recorded through stand-in launchers)."""

from __future__ import annotations

import pytest
import torch
from drawn_seconds import seconds_between

from k3_amd_overlay import k3, mxfp4
from k3_amd_overlay.fp8 import E4M3FN, E4M3FNUZ
from k3_amd_overlay.kernels import launch, launch_configs, names, probe, target
from k3_amd_overlay.kernels.launch_configs import Rule

A, B, C, D, E = (((name, 1),) for name in "ABCDE")
# rule order is lookup order: A for one token; B up to 16 tokens at <= 8 heads, then up to 64 at any;
# E shadowed by B (no batch reaches it); C up to 2048 (past probe.TOKENS); D beyond everything
RULES = (Rule(1, None, A), Rule(16, 8, B), Rule(8, 8, E), Rule(64, None, B), Rule(2048, None, C),
         Rule(None, None, D))


@pytest.fixture
def table(monkeypatch):
    asked = []

    def resolve(arch, device_name=None):
        asked.append((arch, device_name))
        return {kernel: (RULES, None) for kernel in launch_configs.KERNEL_PARAMETERS}

    monkeypatch.setattr(launch_configs, "resolve", resolve)
    return asked


def test_triton_compiles_a_batch_size_apart_when_it_is_one_or_a_multiple_of_16():
    kinds = {t: probe._specialization(t) for t in range(1, 1100)}
    assert {t for t, k in kinds.items() if k == 0} == {1}
    assert {t for t, k in kinds.items() if k == 1} == set(range(16, 1100, 16))
    assert len({0, 1, 2} - set(kinds.values())) == 0


def test_each_config_is_sampled_once_per_kind_of_batch_at_each_head_count_from_its_first_batch(table):
    got = probe.reachable(names.QK_CACHE_KERNEL, "gfx942", (3, 12), "AMD Instinct MI300X")
    assert table == [("gfx942", "AMD Instinct MI300X")]
    assert got == [
        (A, [(1, 3), (1, 12)], ["T<=1, H<=any"]),
        (B, [(2, 3), (16, 3), (2, 12), (16, 12)], ["T<=16, H<=8", "T<=64, H<=any"]),
        (C, [(65, 3), (80, 3), (65, 12), (80, 12)], ["T<=2048, H<=any"]),
        (D, [(2049, 3), (2064, 3), (2049, 12), (2064, 12)], ["T<=any, H<=any"]),
    ]  # E: shadowed, never compiled


def test_the_norm_kernel_is_sampled_at_one_head_whatever_the_heads(table):
    got = probe.reachable(names.RMSNORM_PAIR_KERNEL, "gfx950", (3, 12))
    assert table == [("gfx950", None)]
    assert [samples for _, samples, _ in got] == [[(1, 1)], [(2, 1), (16, 1)], [(65, 1), (80, 1)],
                                                  [(2049, 1), (2064, 1)]]


def test_precompile_compiles_every_sample_in_a_compile_only_session_for_the_devices_own_target(table, monkeypatch):
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, "gfx942"))
    monkeypatch.setattr(launch, "device_name", lambda device: "AMD Instinct MI300X")
    launched = []

    def launch_at(kernel, device, dtype, tokens, heads, fmt, block_size=1):
        session = target.compile_session()
        launched.append((kernel, device, dtype, tokens, heads, fmt, block_size, session and session.target))

    monkeypatch.setattr(probe, "launch_at", launch_at)
    device = torch.device("cuda", 0)
    assert probe.precompile(names.QK_CACHE_KERNEL, device, torch.float16, 12, E4M3FNUZ, 16) == 4
    assert table == [("gfx942", "AMD Instinct MI300X")]
    assert [(t, h) for _, _, _, t, h, *_ in launched] == [(1, 12), (2, 12), (16, 12), (65, 12), (80, 12),
                                                         (2049, 12), (2064, 12)]
    assert {(k, d, dt, f, b, s) for k, d, dt, _, _, f, b, s in launched} == {
        (names.QK_CACHE_KERNEL, device, torch.float16, E4M3FNUZ, 16, None)}  # None: the device's target
    launched.clear()
    # the absorbed launch serves batches up to ABSORB_MAX_TOKENS only: configs past it are not compiled
    assert probe.precompile(names.ABSORB_QK_CACHE_KERNEL, device, torch.float16, 12, E4M3FNUZ, 16) == 3
    assert [(t, h) for _, _, _, t, h, *_ in launched] == [(1, 12), (2, 12), (16, 12), (65, 12), (80, 12)]
    assert target.compile_session() is None  # the session ends with the compile
    launched.clear()
    probe.precompile(names.QK_CACHE_KERNEL, device, torch.bfloat16, 3, E4M3FNUZ)
    assert {b for *_, b, _ in launched} == {1}  # AITER MLA's one-row blocks by default


@pytest.fixture
def precompiled(monkeypatch):
    calls = []
    gpu = {"on": True}
    saved = set(probe._precompiled)  # the process's own record, emptied and restored (not replaced)
    probe._precompiled.clear()
    monkeypatch.setattr(probe, "precompile", lambda *args: calls.append(args) or 1)
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP if gpu["on"] else target.INTERPRETER,
                                                                   "gfx942" if gpu["on"] else "cpu"))
    yield calls, gpu
    probe._precompiled.clear()
    probe._precompiled.update(saved)


def test_the_ahead_of_time_compile_runs_once_per_kernel_device_dtype_heads_format_and_block(precompiled):
    calls, _ = precompiled
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    base = ("triton", names.QK_CACHE_KERNEL, dev0, torch.bfloat16, 8, E4M3FNUZ, 1)
    probe.precompile_once(*base)
    probe.precompile_once(*base)
    assert calls == [base[1:]]
    for i, other in ((1, names.ABSORB_QK_CACHE_KERNEL), (2, dev1), (3, torch.float16), (4, 16), (5, E4M3FN),
                     (6, 64)):
        changed = (*base[:i], other, *base[i + 1:])
        probe.precompile_once(*changed)
        probe.precompile_once(*changed)
        assert calls[-1] == changed[1:]
    assert len(calls) == 7
    probe.precompile_once(*base[:-1])  # block size by default: AITER MLA's 1, already compiled
    assert len(calls) == 7
    for same_kind in (16, 128, 32):  # 64's kind (multiples of 16): Triton compiles them alike
        assert probe.precompile_once(*base[:-1], same_kind) is None
    probe.precompile_once(*base[:-1], 5)  # neither 1 nor a multiple of 16: its own compile
    assert len(calls) == 8 and calls[-1][-1] == 5


def test_the_ahead_of_time_compile_says_how_long_it_took(precompiled, monkeypatch, caplog):
    import logging

    took = seconds_between(1.0, 90.0)
    ticks = iter([50.0, 50.0 + took])
    monkeypatch.setattr(probe, "perf_counter", lambda: next(ticks))
    args = ("triton", names.ABSORB_QK_CACHE_KERNEL, torch.device("cuda", 0), torch.bfloat16, 12, E4M3FNUZ, 16)
    with caplog.at_level(logging.INFO, logger="vllm.k3_amd_overlay"):
        assert probe.precompile_once(*args) == pytest.approx(took)
        assert probe.precompile_once(*args) is None  # done: nothing compiled, nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        f"K3 AMD overlay: compiled 1 configs of {names.ABSORB_QK_CACHE_KERNEL} (bfloat16, 12 heads, {E4M3FNUZ.name}, "
        f"KV cache blocks of 16) in {took:.1f} s"]


def test_a_sample_whose_config_was_degraded_is_compiled_again(table, monkeypatch):
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, "gfx942"))
    monkeypatch.setattr(launch, "device_name", lambda device: "AMD Instinct MI300X")
    launched, degrade_at = [], {(2, 12)}

    def launch_at(kernel, device, dtype, tokens, heads, fmt, block_size=1):
        launched.append((tokens, heads))
        if (tokens, heads) in degrade_at:
            degrade_at.discard((tokens, heads))
            raise launch_configs.ConfigDegraded("B: RuntimeError: LDS")

    monkeypatch.setattr(probe, "launch_at", launch_at)
    probe.precompile(names.QK_CACHE_KERNEL, torch.device("cuda", 0), torch.bfloat16, 12, E4M3FNUZ)
    assert launched == [(1, 12), (2, 12), (2, 12), (16, 12), (65, 12), (80, 12), (2049, 12), (2064, 12)]


def test_a_config_that_fails_at_one_batch_is_compiled_on_the_safe_config_at_every_batch_it_served(table,
                                                                                                 monkeypatch):
    arch, gpu, kernel = "gfx942", "AMD Instinct MI300X", names.QK_CACHE_KERNEL
    monkeypatch.setattr(launch_configs, "_degraded", {})
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, arch))
    monkeypatch.setattr(launch, "device_name", lambda device: gpu)
    compiled = []

    def launch_at(kernel, device, dtype, tokens, heads, fmt, block_size=1):
        config = launch_configs.choose(kernel, arch, gpu, tokens, heads, amd=True)
        if config == dict(B) and tokens == 16:  # B builds at 2 tokens, fails at 16 (another kind of batch)
            assert launch_configs.degrade(kernel, arch, gpu, tokens, heads, "planted")
            raise launch_configs.ConfigDegraded("B")
        compiled.append((tuple(sorted(config.items())), probe._specialization(tokens)))

    monkeypatch.setattr(probe, "launch_at", launch_at)
    probe.precompile(kernel, torch.device("cuda", 0), torch.bfloat16, 12, E4M3FNUZ)
    served = {(tuple(sorted(launch_configs.choose(kernel, arch, gpu, t, 12, amd=True).items())),
               probe._specialization(t)) for t in range(1, 2100)}
    assert served <= set(compiled)  # the safe config at 2-15 tokens too, which B took before it failed


def test_the_absorb_kernels_and_their_query_quant_are_sampled_only_up_to_the_batches_they_serve():
    from k3_amd_overlay.package import ABSORB_MAX_TOKENS

    capped = (names.ABSORB_QK_CACHE_KERNEL, names.ABSORB_FP8_QK_CACHE_KERNEL, names.ABSORB_MXFP4_QK_CACHE_KERNEL,
              names.STATIC_QUANT_KERNEL)
    assert set(probe.SERVED_MOST) == set(capped) and set(probe.SERVED_MOST.values()) == {ABSORB_MAX_TOKENS}
    for arch in launch_configs.SHIPPED_ARCHS:
        for kernel in capped:
            served = probe.reachable(kernel, arch, (12,))
            every = probe.reachable(kernel, arch, (12,), every_rule=True)
            assert max(t for _, samples, _ in served for t, _ in samples) <= ABSORB_MAX_TOKENS, (arch, kernel)
            assert {c for c, _, _ in served} <= {c for c, _, _ in every}, (arch, kernel)
    # at K3's TP 8 on an MI300X the table's rule past 256 tokens has a config of its own: compiled by
    # `kernels --arch` (every rule), not at model load
    served, every = (probe.reachable(names.ABSORB_QK_CACHE_KERNEL, "gfx942", (12,), every_rule=e)
                     for e in (False, True))
    assert {c for c, _, _ in every} - {c for c, _, _ in served}


def test_a_safe_config_no_served_batch_takes_is_not_compiled_so_its_failure_refuses_nothing(monkeypatch):
    from k3_amd_overlay import kernel_failures

    arch, gpu, kernel = "gfx942", "AMD Instinct MI300X", names.ABSORB_QK_CACHE_KERNEL
    monkeypatch.setattr(launch_configs, "_degraded", {})
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, arch))
    monkeypatch.setattr(launch, "device_name", lambda device: gpu)
    safe = dict(launch_configs.safe_config(kernel, arch))
    built = []

    def launch_at(kernel, device, dtype, tokens, heads, fmt, block_size=1):
        config = launch_configs.choose(kernel, arch, gpu, tokens, heads, amd=True)
        if config == safe:
            if launch_configs.degrade(kernel, arch, gpu, tokens, heads, "planted: the safe config fails"):
                raise launch_configs.ConfigDegraded("safe")
            raise RuntimeError("the safe config failed")
        built.append(tokens)

    monkeypatch.setattr(probe, "launch_at", launch_at)
    kernel_failures.guarded("absorb_qk_cache", lambda: probe.precompile(kernel, torch.device("cuda", 0),
                                                                        torch.bfloat16, 12, E4M3FNUZ))
    assert built and launch_configs.degraded() == {}


def test_every_rule_sweeps_each_rules_own_head_bound(monkeypatch):
    """A tuned file's rules for head counts between the swept ones (``tune --heads 24 32``) are reached
    by ``kernels --arch`` (every rule), which the sweep of probe.HEADS alone never compiled."""
    x, y = ((("X", 1),), (("Y", 1),))
    rules = (Rule(64, 24, A), Rule(None, 24, B), Rule(64, 32, x), Rule(None, 32, y), Rule(None, None, C))
    monkeypatch.setattr(launch_configs, "resolve",
                        lambda arch, device_name=None: {k: (rules, None) for k in launch_configs.KERNEL_PARAMETERS})
    assert 32 not in probe.HEADS
    served = {c for c, _, _ in probe.reachable(names.QK_CACHE_KERNEL, "gfx942")}
    every = {c for c, _, _ in probe.reachable(names.QK_CACHE_KERNEL, "gfx942", every_rule=True)}
    assert {x, y} & served == set() and {x, y} <= every


def test_no_ahead_of_time_compile_for_another_provider_or_off_gpu(precompiled):
    calls, gpu = precompiled
    args = (names.QK_CACHE_KERNEL, torch.device("cuda", 0), torch.bfloat16, 8, E4M3FNUZ)
    probe.precompile_once("aiter", *args)
    probe.precompile_once(None, *args)
    gpu["on"] = False
    probe.precompile_once("triton", *args)
    assert calls == []
    gpu["on"] = True
    probe.precompile_once("triton", *args)
    assert len(calls) == 1


def test_a_compile_that_fails_raises_and_is_tried_again_at_the_next_call(monkeypatch, precompiled):
    monkeypatch.setattr(target, "of", lambda device: target.Target(target.HIP, "gfx942"))
    tries = []

    def precompile(*args):
        tries.append(args)
        if len(tries) == 1:
            raise RuntimeError("PassManager::run failed")
        return 1

    monkeypatch.setattr(probe, "precompile", precompile)
    args = ("triton", names.QK_CACHE_KERNEL, torch.device("cuda", 0), torch.bfloat16, 8, E4M3FNUZ)
    with pytest.raises(RuntimeError, match="PassManager"):
        probe.precompile_once(*args)
    probe.precompile_once(*args)
    probe.precompile_once(*args)
    assert len(tries) == 2


# ---- each probe launch, in vLLM's layouts (then the shipped tables' sweep: the slowest) ---------

def _layout(t):
    if not isinstance(t, torch.Tensor):
        return t
    return (tuple(t.shape), t.stride(), t.dtype, t.device.type)


LAUNCHERS = {names.RMSNORM_PAIR_KERNEL: ("rmsnorm_pair", "rmsnorm_pair"),
             names.QK_CACHE_KERNEL: ("qk_cache", "qk_cache"),
             names.STATIC_QUANT_KERNEL: ("static_quant", "scaled_quant"),
             names.ABSORB_QK_CACHE_KERNEL: ("absorb_qk_cache", "absorb_qk_cache"),
             names.ABSORB_FP8_QK_CACHE_KERNEL: ("absorb_fp8_qk_cache", "absorb_fp8_qk_cache"),
             names.ABSORB_MXFP4_QK_CACHE_KERNEL: ("absorb_mxfp4_qk_cache", "absorb_mxfp4_qk_cache")}


@pytest.fixture
def recorded(monkeypatch):
    import importlib

    calls = []
    for module, function in LAUNCHERS.values():
        mod = importlib.import_module(f"k3_amd_overlay.kernels.{module}")
        monkeypatch.setattr(mod, function, lambda *args, _f=function: calls.append((_f, args)))
    return calls


T, H, BS = 5, 3, 4
LORA, ROPE, NOPE, QL = k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM, k3.QK_NOPE_HEAD_DIM, k3.Q_LORA_RANK
BF = torch.bfloat16
ROW = NOPE + ROPE  # one query head: nope then rope, in one row of q
QUERY = [((T, H, NOPE), (H * ROW, ROW, 1), BF, "cpu"), ((T, H, ROPE), (H * ROW, ROW, 1), BF, "cpu")]
KV = [((T, LORA), (LORA, 1), BF, "cpu"), ((T, ROPE), (ROPE, 1), BF, "cpu")]
CACHE = [((T // BS + 1, BS, LORA + ROPE), (BS * (LORA + ROPE), LORA + ROPE, 1), torch.uint8, "cpu"),
         ((T,), (1,), torch.int64, "cpu")]
SCALE = ((1,), (1,), torch.float32, "cpu")
Q_OUT = ((T, H, LORA + ROPE), (H * (LORA + ROPE), LORA + ROPE, 1), torch.uint8, "cpu")


@pytest.mark.parametrize("kernel", list(LAUNCHERS), ids=list(LAUNCHERS))
def test_each_probe_launch_hands_its_launcher_vllms_layouts(kernel, recorded):
    probe.launch_at(kernel, torch.device("cpu"), BF, T, H, E4M3FN, BS)
    ((function, args),) = recorded
    assert function == LAUNCHERS[kernel][1]
    got = [_layout(a) for a in args]
    if kernel == names.RMSNORM_PAIR_KERNEL:
        latent = QL + LORA + ROPE  # q_c and kv_c are views of one projected row
        assert got == [((T, QL), (latent, 1), BF, "cpu"), ((T, LORA), (latent, 1), BF, "cpu"),
                       ((QL,), (1,), BF, "cpu"), ((LORA,), (1,), BF, "cpu"), 1e-6, 1e-6,
                       ((T, QL), (QL, 1), BF, "cpu"), ((T, LORA), (LORA, 1), BF, "cpu")]
        assert args[1].data_ptr() - args[0].data_ptr() == QL * 2
        return
    if kernel == names.STATIC_QUANT_KERNEL:
        assert got == [((T, H, LORA + ROPE), (H * (LORA + ROPE), LORA + ROPE, 1), BF, "cpu"), SCALE, Q_OUT, E4M3FN]
        return
    tail = [*KV, *CACHE, SCALE, SCALE, Q_OUT, E4M3FN]
    assert torch.equal(args[-5], torch.arange(T))  # every token writes its own slot
    if kernel == names.QK_CACHE_KERNEL:  # vLLM's bmm output (heads, tokens, lora), transposed
        assert got == [((T, H, LORA), (LORA, T * LORA, 1), BF, "cpu"), QUERY[1], *tail]
        return
    assert args[-9].data_ptr() - args[0].data_ptr() == NOPE * 2  # q_pe: the same rows, after nope
    if kernel == names.ABSORB_QK_CACHE_KERNEL:  # vLLM's W_UK_T: (lora, heads, nope) permuted
        assert got == [QUERY[0], ((H, NOPE, LORA), (NOPE, 1, H * NOPE), BF, "cpu"), QUERY[1], *tail]
    elif kernel == names.ABSORB_FP8_QK_CACHE_KERNEL:
        assert got == [QUERY[0], ((H, LORA, NOPE), (LORA * NOPE, NOPE, 1), E4M3FN.dtype, "cpu"), SCALE, QUERY[1],
                       *tail]
    else:
        half, groups = NOPE // 2, NOPE // mxfp4.GROUP
        assert got == [QUERY[0], ((H, LORA, half), (half, H * half, 1), torch.uint8, "cpu"),
                       ((H, LORA, groups), (groups, H * groups, 1), torch.uint8, "cpu"), QUERY[1], *tail]


def test_a_probe_launch_takes_the_activation_dtype_and_aitters_one_row_blocks_by_default(recorded):
    probe.launch_at(names.QK_CACHE_KERNEL, torch.device("cpu"), torch.float16, 7, 2, E4M3FNUZ)
    ((_, args),) = recorded
    assert [a.dtype for a in args[:4]] == [torch.float16] * 4
    assert tuple(args[4].shape) == (8, 1, LORA + ROPE) and args[-1] is E4M3FNUZ


def test_an_unknown_kernel_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"^unknown kernel 'fused_moe' \(known: rmsnorm_pair_kernel, .*\)$"):
        probe.launch_at("fused_moe", torch.device("cpu"), BF, 1, 1, E4M3FN)


def test_the_default_sweep_reaches_every_shipped_rule_that_some_batch_can_pick():
    """Against the shipped tables: every config the dispatch picks at 12 per-rank heads (the fake
    tables above cover several) at any batch (swept past the largest bound) is sampled, at each kind
    of batch size it is picked for."""
    assert probe.HEADS == tuple(sorted(set(k3.HEADS_PER_RANK.values())))
    for arch in launch_configs.SHIPPED_ARCHS:
        for kernel in launch_configs.KERNEL_PARAMETERS:
            rules, _ = launch_configs.resolve(arch)[kernel]
            heads = (1,) if kernel == names.RMSNORM_PAIR_KERNEL else (12,)
            beyond = min(max([r.tokens or 0 for r in rules] + [1024]) + 64, probe.SERVED_MOST.get(kernel, 10**6) + 1)
            wanted = {(dict(launch_configs.rule_for(rules, t, h).config).__repr__(), probe._specialization(t), h)
                      for h in heads for t in range(1, beyond)}
            got = {(dict(config).__repr__(), probe._specialization(t), h)
                   for config, samples, _ in probe.reachable(kernel, arch, heads) for t, h in samples}
            assert got == wanted, (arch, kernel)
