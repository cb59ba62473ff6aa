"""Issue 27 item 10 checked against vLLM's real code, per release 0.29-0.33, as far as it runs on a
CPU: the facts baseline_hazard.py rests on.

- Read from each release's source (no import): the K3 wrapper's forward takes its own
  ``_fused_decode`` (no decorator: no eager break) only for all-decode batches (0.32-0.33; 0.29-0.31
  have none); vLLM's MLA attention op is an eager break; Model Runner V2 captures a PIECEWISE size
  with ``min(num_tokens, max_num_reqs)`` dummy requests and replays PIECEWISE graphs under a
  BatchDescriptor of token count and LoRA only; the V1 runner builds no attention metadata for a
  PIECEWISE capture; on ROCm 0.30-0.33 breakable graphs are not the K3 default.
- Run (this venv's vLLM): Model Runner V2's own dummy batch (``InputBatch.make_dummy``) at such a
  size is one token per request, a decode-only batch; vLLM's real ``BreakableCUDAGraphCapture`` and
  ``eager_break_during_capture``, with a stand-in for ``torch.cuda.CUDAGraph`` (no CUDA here),
  replay a plain call's work only as the recorded segment while an eager break runs again on the
  replayed batch.
Not run here: a real capture on a GPU, the AITER kernel, the whole K3 forward (tests the lead's GPU
runs would need)."""

from __future__ import annotations

import ast

import pytest
from releases import MATRIX, minor, tree_of

K3_MLA = "models/kimi_k3/amd/mla.py"
K3_WRAPPER = "KimiK3MultiHeadLatentAttentionWrapper"


def tree(version: str, rel: str) -> ast.Module:
    return ast.parse((tree_of(version) / rel).read_text())


def function(module: ast.AST, name: str, owner: str | None = None) -> ast.FunctionDef | None:
    scope = module
    if owner is not None:
        scope = next((n for n in ast.walk(module) if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if scope is None:
            return None
    return next((n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name), None)


@pytest.mark.parametrize("version", MATRIX)
def test_vllm_s_own_fused_decode_is_a_plain_call_taken_for_decode_only_batches(version):
    path = tree_of(version) / K3_MLA
    if minor(version) < "0.32":
        assert not path.exists() or "_fused_decode" not in path.read_text()
        return
    module = ast.parse(path.read_text())
    fused = function(module, "_fused_decode", K3_WRAPPER)
    assert fused is not None and fused.decorator_list == []  # no eager break: recorded into a segment
    forward = ast.unparse(function(module, "forward", K3_WRAPPER))
    assert "attn_metadata.num_actual_tokens == attn_metadata.num_decode_tokens" in forward
    assert "self._fused_decode(" in forward and "self.mla_attn(" in forward  # else vLLM's attention op


@pytest.mark.parametrize("version", MATRIX)
def test_vllm_s_mla_attention_op_is_an_eager_break(version):
    op = function(tree(version, "model_executor/layers/attention/mla_attention.py"),
                  "unified_mla_attention_with_output")
    assert "eager_break_during_capture" in [ast.unparse(d) for d in op.decorator_list]


@pytest.mark.parametrize("version", MATRIX)
def test_model_runner_v2_captures_piecewise_with_one_token_per_request_keyed_by_token_count(version):
    capture = ast.unparse(tree(version, "v1/worker/gpu/cudagraph_utils.py"))
    assert "num_reqs = desc.num_reqs or min(num_tokens, self.max_num_reqs)" in capture
    runner = tree(version, "v1/worker/gpu/model_runner.py")
    keys = [{k.arg for k in call.keywords} for call in ast.walk(runner)
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "BatchDescriptor"]
    assert keys and all(k <= {"num_tokens", "has_lora", "num_active_loras"} for k in keys)  # no decode/uniform key


@pytest.mark.parametrize("version", MATRIX)
def test_the_v1_runner_builds_no_attention_metadata_for_a_piecewise_capture(version):
    assert "if force_attention or cudagraph_runtime_mode == CUDAGraphMode.FULL:" in ast.unparse(
        tree(version, "v1/worker/gpu_model_runner.py"))


@pytest.mark.parametrize("version", MATRIX)
def test_on_rocm_breakable_graphs_are_the_k3_default_only_on_0_29(version):
    config = tree(version, "config/vllm.py")
    defaults = ast.unparse(function(config, "default_breakable_cudagraph_architectures"))
    rocm = defaults.split("if current_platform.is_rocm():", 1)[1]
    rocm_return = rocm[rocm.index("return"):].splitlines()[0]
    if minor(version) == "0.29":
        default_set = next(ast.unparse(n) for n in config.body if isinstance(n, ast.Assign)
                           and ast.unparse(n.targets[0]) == "DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES")
        assert "'KimiK3ForConditionalGeneration'" in default_set and "Kimi" not in rocm_return
        assert rocm_return.startswith("return DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES - {")
    else:
        assert rocm_return == "return frozenset({'DeepseekV41ForCausalLM'})"


@pytest.mark.parametrize("version", MATRIX)
def test_vllm_fuses_the_decode_where_the_fp4_bmm_is_taken_or_the_fp8_bmm_is_off_and_fp4_only_on_gfx950(version):
    """What baseline_hazard's BMM rule rests on (0.32-0.33): the K3 wrapper fuses only for the W_UK
    variants its _fused_decode reproduces (the FP4 BMM taken, or the FP8 BMM off); the MLA layer
    takes the FP4 BMM only where its switch is on, on CDNA 4 (gfx950), with a bf16 kv_b_proj."""
    if minor(version) < "0.32":
        return  # no fused decode of vLLM's own
    supported = ast.unparse(function(tree(version, K3_MLA), "_fused_qk_prep_supported", K3_WRAPPER))
    last = supported[supported.rindex("return "):]
    assert "attn.is_aiter_triton_fp4_bmm_enabled or" in last and "not attn.is_aiter_triton_fp8_bmm_enabled" in last
    enabled = ast.unparse(function(tree(version, "_aiter_ops.py"), "is_fp4bmm_enabled"))
    assert "return cls._AITER_ENABLED and cls._FP4BMM_ENABLED and (get_cdna_version() == 4)" in enabled
    cdna = ast.unparse(function(tree(version, "platforms/rocm.py"), "get_cdna_version"))
    assert "if on_gfx950():\n        return 4" in cdna
    layer = ast.unparse(tree(version, "model_executor/layers/attention/mla_attention.py"))
    assert ("self.is_aiter_triton_fp4_bmm_enabled = rocm_aiter_ops.is_fp4bmm_enabled() and hasattr(self.kv_b_proj, "
            "'weight') and (self.kv_b_proj.weight.dtype == torch.bfloat16)") in layer


@pytest.mark.vllm
@pytest.mark.parametrize("num_tokens,max_num_reqs,decode_only", [(1, 256, True), (64, 256, True), (256, 256, True),
                                                                   (512, 256, False)])
def test_model_runner_v2_s_capture_batch_is_decode_only_up_to_max_num_reqs(num_tokens, max_num_reqs, decode_only):
    """The dummy batch Model Runner V2 captures a PIECEWISE size with (this venv's real InputBatch),
    with the request count its capture uses."""
    import torch

    input_batch = pytest.importorskip("vllm.v1.worker.gpu.input_batch")
    buffers = input_batch.InputBuffers(max_num_reqs, 1024, torch.device("cpu"))
    batch = input_batch.InputBatch.make_dummy(min(num_tokens, max_num_reqs), num_tokens, buffers)
    assert (set(batch.num_scheduled_tokens.tolist()) == {1}) is decode_only


@pytest.mark.vllm
def test_a_breakable_segment_replays_a_plain_call_s_choice_and_reruns_an_eager_break(monkeypatch):
    """vLLM's real capture machinery: what a plain call (vLLM's own _fused_decode) did at capture is
    replayed as the recorded segment whatever the replayed batch is; an eager break (vLLM's attention
    op, the overlay's decode site) runs again and sees the replayed batch."""
    import torch

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    breakable = pytest.importorskip("vllm.compilation.breakable_cudagraph")
    assert breakable.is_breakable_cudagraph_enabled()
    replayed: list[str] = []

    class StandInGraph:  # torch.cuda.CUDAGraph as the capture uses it; no CUDA here
        def capture_begin(self, pool=None) -> None:
            self.work = list(ran)

        def capture_end(self) -> None:
            self.work = ran[len(self.work):]  # what was launched while this segment recorded

        def replay(self) -> None:
            replayed.extend(f"graph: {w}" for w in self.work)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    batch = {"kind": "decode"}  # the static buffers: the capture's dummy batch, then the replayed one
    ran: list[str] = []

    def fused_decode() -> None:  # vLLM's own: chosen in Python, its launches recorded
        ran.append(f"fused decode of a {batch['kind']} batch")

    @breakable.eager_break_during_capture
    def decode_site() -> None:  # an eager break deciding from the batch it runs on
        replayed.append(f"eager: {'fused' if batch['kind'] == 'decode' else 'stock'} for a {batch['kind']} batch")

    for step, name in ((fused_decode, "vllm"), (decode_site, "site")):
        ran.clear()
        replayed.clear()
        batch["kind"] = "decode"
        with breakable.BreakableCUDAGraphCapture() as capture:
            step()
        replayed.clear()
        batch["kind"] = "mixed"  # same token count: the same BatchDescriptor, so this capture replays
        capture.replay()
        if name == "vllm":
            assert replayed == ["graph: fused decode of a decode batch"]  # the decode-only path, for a mixed batch
        else:
            assert capture.num_eager_breaks == 1 and "eager: stock for a mixed batch" in replayed


@pytest.mark.vllm
def test_the_gpu_machines_breakable_capture_stand_in_has_the_real_modules_signatures():
    """tests/breakable_standin.py stands in for this module on the GPU machine (no vLLM there): the
    calls it takes and the counter it keeps are the installed release's own."""
    import inspect

    import breakable_standin

    real = pytest.importorskip(breakable_standin.MODULE)
    pairs = [(real.eager_break_during_capture, breakable_standin.eager_break_during_capture)]
    real_class, standin_class = real.BreakableCUDAGraphCapture, breakable_standin.BreakableCUDAGraphCapture
    pairs += [(getattr(real_class, name), getattr(standin_class, name))
              for name in ("__init__", "current", "add_eager", "replay", "__enter__")]
    for real_call, standin_call in pairs:
        assert list(inspect.signature(standin_call).parameters) == list(inspect.signature(real_call).parameters), (
            real_call.__qualname__)
    counter = "num_eager_breaks"
    assert hasattr(real_class(pool=object()), counter) and hasattr(standin_class(pool=object()), counter)
