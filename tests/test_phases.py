"""Phases under dual-batch overlap (``--enable-dbo``): the forward runs in microbatch threads that
vLLM's runner starts and joins, so their own stacks hold no step of vLLM's. Each batch must take the
phase of the step that started those threads (warm-up, capture, served, replay), and a graph
captured there must be found for replay counting. Run through vLLM's real microbatch machinery of
each release: ``UBatchWrapper`` (V1 model runner: its ``__call__``, threads, ``UBatchContext``
hand-offs and forward contexts) and, where the release has it, the model runner V2's
``UBatchRunner``. Stand-ins only for what needs a GPU: CUDA streams, the cuBLAS handle, the device
index, SM/CU partitioning, the CUDA graph and its capture state."""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading

import pytest
import torch
from vllm_support import with_real_signature

from k3_amd_overlay import phases
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.phases import Phase
from k3_amd_overlay.settings import load_settings

pytestmark = pytest.mark.vllm
TOKENS = 4


class StandInGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` (no capture without a GPU): counts its replays."""

    def __init__(self, *args, **kwargs) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def no_gpu(monkeypatch):
    """The GPU-only calls vLLM's microbatch code makes, stood in; the capture state is True inside
    a stand-in ``torch.cuda.graph`` (process-wide here; on a GPU it belongs to the capture stream,
    which the microbatch threads run on)."""
    from vllm.platforms import current_platform
    from vllm.utils import torch_utils
    from vllm.v1.worker import gpu_ubatch_wrapper

    with contextlib.suppress(ImportError):  # imported before torch.cuda.Stream is stood in (annotations use it)
        import vllm.v1.worker.gpu.model_runner
        import vllm.v1.worker.gpu.ubatch_utils  # noqa: F401
    capture = {"on": False}

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        capture["on"] = True
        try:
            yield
        finally:
            capture["on"] = False

    def vllm_standin(owner, name, standin):  # vLLM's own functions: behind each release's real signature
        real = getattr(owner, name, None)
        return standin if real is None else with_real_signature(real, standin)

    monkeypatch.setattr(torch_utils, "prev_set_stream",
                        vllm_standin(torch_utils, "prev_set_stream", lambda stream: None))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: torch_utils.current_stream())
    monkeypatch.setattr(torch.cuda, "current_stream", torch_utils.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda device: None)
    monkeypatch.setattr(current_platform, "graph_pool_handle",
                        vllm_standin(current_platform, "graph_pool_handle", lambda: None), raising=False)
    monkeypatch.setattr(gpu_ubatch_wrapper, "set_graph_pool_id",
                        vllm_standin(gpu_ubatch_wrapper, "set_graph_pool_id", lambda pool: None))
    if hasattr(gpu_ubatch_wrapper, "create_sm_control_context"):  # 0.30+; 0.29: a static method of the wrapper
        monkeypatch.setattr(gpu_ubatch_wrapper, "create_sm_control_context", vllm_standin(
            gpu_ubatch_wrapper, "create_sm_control_context", lambda config: contextlib.nullcontext()))
    else:
        monkeypatch.setattr(gpu_ubatch_wrapper.UBatchWrapper, "_create_sm_control_context", staticmethod(vllm_standin(
            gpu_ubatch_wrapper.UBatchWrapper, "_create_sm_control_context", lambda config: contextlib.nullcontext())))
    monkeypatch.setattr(phases, "capturing", lambda: capture["on"])
    return capture


@pytest.fixture
def dbo_config():
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.parallel_config.data_parallel_size = 2  # vLLM microbatches only across DP ranks
    config.parallel_config.enable_dbo = True  # --enable-dbo: two microbatches
    return config


def evidence_for(tmp_path) -> Evidence:
    evidence = Evidence(load_settings({"K3_AMD_OVERLAY": "1", "K3_AMD_OVERLAY_MARKER_DIR": str(tmp_path / "m")}))
    evidence.note_layer("qk_cache", LayerDecision(FusionState.APPLIED, "triton", "r"))
    return evidence


def runs(evidence: Evidence) -> dict[str, int]:
    return {phase.value: n for phase, n in evidence.fusion("qk_cache").runs.items()}


def k3_model(evidence: Evidence, threads: list[str]):
    """The model a runner wraps: each call runs a K3 MLA layer's fused site (its evidence hook)."""
    hook = evidence.effective_hook("qk_cache", "model.layers.0.self_attn.attn")

    def model(input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        threads.append(threading.current_thread().name)
        hook(input_ids.shape[0])
        return input_ids.float()

    return model


def v1_wrapper(model, config, runtime_mode):
    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    return UBatchWrapper(model, config, runtime_mode, torch.device("cpu"))


def v1_step(wrapper, config, mode, device="cpu"):
    """One forward of the V1 runner through its UBatchWrapper, as ``execute_model``/``_dummy_run``
    make it: a forward context with two microbatch slices."""
    from vllm.forward_context import BatchDescriptor, set_forward_context
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    half = TOKENS // 2
    slices = [UBatchSlice(slice(0, 1), slice(0, half)), UBatchSlice(slice(1, 2), slice(half, TOKENS))]
    ids = torch.arange(TOKENS, device=device)
    with set_forward_context(None, config, num_tokens=TOKENS,
                             num_tokens_across_dp=torch.tensor([TOKENS, TOKENS], dtype=torch.int32),
                             cudagraph_runtime_mode=mode, batch_descriptor=BatchDescriptor(num_tokens=TOKENS),
                             ubatch_slices=slices):
        return wrapper(input_ids=ids, positions=ids, intermediate_tensors=None, inputs_embeds=None)


# Named as vLLM's V1 model runner names its dummy batch and its served step; each runs the model
# through the wrapper as those methods do.
def _dummy_run(wrapper, config, mode, device="cpu"):
    return v1_step(wrapper, config, mode, device)


def execute_model(wrapper, config, mode, device="cpu"):
    return v1_step(wrapper, config, mode, device)


def capture_model(wrapper, config, mode, device="cpu"):
    return v1_step(wrapper, config, mode, device)


def warmup_kernels(wrapper, config, mode):  # vLLM's kernel warm-up runs its batches through execute_model
    return execute_model(wrapper, config, mode)


def test_a_warm_up_batch_in_dbo_microbatch_threads_is_not_served(tmp_path, no_gpu, dbo_config):
    """The fault: vLLM's V1 runner runs a dummy batch through ``UBatchWrapper``; the fused path runs
    in the two microbatch threads, whose stacks hold no ``_dummy_run``. Those batches are warm-up,
    not served, and so are those of vLLM's kernel warm-up (which calls ``execute_model``); the same
    wrapper's served step counts as served."""
    from vllm.config import CUDAGraphMode

    evidence, threads = evidence_for(tmp_path), []
    wrapper = v1_wrapper(k3_model(evidence, threads), dbo_config, CUDAGraphMode.NONE)
    _dummy_run(wrapper, dbo_config, CUDAGraphMode.NONE)
    assert len(threads) == 2 and threading.current_thread().name not in threads  # the forward ran in vLLM's threads
    assert runs(evidence) == {"warmup": 2, "capture": 0, "served": 0, "replay": 0}
    warmup_kernels(wrapper, dbo_config, CUDAGraphMode.NONE)
    assert runs(evidence) == {"warmup": 4, "capture": 0, "served": 0, "replay": 0}
    execute_model(wrapper, dbo_config, CUDAGraphMode.NONE)
    assert runs(evidence) == {"warmup": 4, "capture": 0, "served": 2, "replay": 0}


def test_a_graph_captured_in_dbo_microbatch_threads_counts_its_replays(tmp_path, no_gpu, dbo_config):
    """vLLM's V1 runner captures a FULL graph of a microbatched step (``UBatchWrapper._capture_ubatches``:
    the fused path runs in the microbatch threads, the graph is a local of the starting thread) and
    replays it for later steps of that size. The capture is found, its replays in a served step count
    as replays, in vLLM's own warm-up as warm-up, and ``check`` holds only after a served replay."""
    from vllm.config import CUDAGraphMode

    from k3_amd_overlay.commands.verdict import judge

    evidence, threads = evidence_for(tmp_path), []
    wrapper = v1_wrapper(k3_model(evidence, threads), dbo_config, CUDAGraphMode.NONE)
    capture_model(wrapper, dbo_config, CUDAGraphMode.FULL)  # first FULL step of this size: capture
    graph = wrapper.cudagraphs[TOKENS].cudagraph
    assert isinstance(graph, StandInGraph) and len(threads) == 2
    assert runs(evidence) == {"warmup": 0, "capture": 2, "served": 0, "replay": 0}
    capture_model(wrapper, dbo_config, CUDAGraphMode.FULL)  # a replay inside vLLM's capture: warm-up
    assert graph.replays == 1 and runs(evidence)["warmup"] == 1 and runs(evidence)["replay"] == 0
    assert not judge([evidence.record], "fused", ["qk_cache"], require_effective=True).holds
    for _ in range(3):
        execute_model(wrapper, dbo_config, CUDAGraphMode.FULL)
    assert graph.replays == 4 and len(threads) == 2  # replays, no new forward
    assert runs(evidence) == {"warmup": 1, "capture": 2, "served": 0, "replay": 3}
    assert judge([evidence.record], "fused", ["qk_cache"], require_effective=True).holds


def test_a_microbatch_thread_whose_starter_is_in_no_step_is_not_served(tmp_path, no_gpu, dbo_config):
    """Fail closed: microbatches started outside any step of vLLM's (no served step, no warm-up)
    are not shown to be served, so they do not count as served."""
    from vllm.config import CUDAGraphMode

    evidence, threads = evidence_for(tmp_path), []
    v1_step(v1_wrapper(k3_model(evidence, threads), dbo_config, CUDAGraphMode.NONE), dbo_config, CUDAGraphMode.NONE)
    assert len(threads) == 2 and runs(evidence)["served"] == 0 and runs(evidence)["warmup"] == 2


def v2_runner(config):
    """The model runner V2's ``UBatchRunner`` (0.30+), its thread machinery as vLLM builds it; the
    attributes its constructor reads from a loaded model (model state, attention groups, KV cache
    config) are not needed to run microbatches and are left out."""
    ubatch_utils = pytest.importorskip("vllm.v1.worker.gpu.ubatch_utils")
    if not hasattr(ubatch_utils, "UBatchRunner"):
        pytest.skip("this vLLM's model runner V2 has no microbatch runner")
    runner = ubatch_utils.UBatchRunner.__new__(ubatch_utils.UBatchRunner)
    runner.vllm_config, runner.parallel_config = config, config.parallel_config
    runner.num_ubatches, runner.device = 2, torch.device("cpu")
    runner.comm_stream = runner.capture_stream = torch.cuda.Stream(device=runner.device)
    runner.ready_barrier = threading.Barrier(runner.num_ubatches + 1)
    runner._pending_finish = None
    runner.sm_control = contextlib.nullcontext()  # SM/CU partitioning needs a GPU
    return runner, ubatch_utils


def v2_forward(runner, ubatch_utils, config, model, for_capture=False):
    from vllm.forward_context import create_forward_context
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    half = TOKENS // 2
    slices = [UBatchSlice(slice(0, 1), slice(0, half)), UBatchSlice(slice(1, 2), slice(half, TOKENS))]
    state = ubatch_utils.UBatchState(slices=slices, forward_contexts=[create_forward_context(None, config)
                                                                      for _ in slices])
    ids = torch.arange(TOKENS)
    return runner.begin_capturable_run(model, {"input_ids": ids, "positions": ids}, state, for_capture=for_capture)()


class V2ModelRunner:
    """Names and arguments as the model runner V2 has them: dummy batches go through ``execute_model``
    with ``dummy_run=True`` (from its ``_dummy_run`` and its capture), served ones with False; a step
    with a captured graph replays it (``run_fullgraph``) instead of running the model."""

    def __init__(self, runner, ubatch_utils, config, model) -> None:
        self.args = runner, ubatch_utils, config, model

    def execute_model(self, scheduler_output=None, dummy_run: bool = False, graph=None):
        if graph is not None:
            return graph.replay()
        return v2_forward(*self.args)

    def capture_model(self):
        return self.capture()

    def capture(self):  # as CudaGraphManager.capture: the graph a local, the microbatches joined inside
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            v2_forward(*self.args, for_capture=True)
        return graph


def test_the_v2_runners_dummy_steps_in_microbatch_threads_are_not_served(tmp_path, no_gpu, dbo_config):
    """The model runner V2 runs its dummy batches through ``execute_model(dummy_run=True)``; under DBO
    the forward runs in ``UBatchRunner``'s threads. The runner's own ``dummy_run`` says warm-up; a
    graph captured with the microbatches is found, and only its replays in a served step count."""
    evidence, threads = evidence_for(tmp_path), []
    runner, ubatch_utils = v2_runner(dbo_config)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert "dummy_run" in inspect.signature(GPUModelRunner.execute_model).parameters
    model_runner = V2ModelRunner(runner, ubatch_utils, dbo_config, k3_model(evidence, threads))
    model_runner.execute_model(dummy_run=True)
    assert len(threads) == 2 and runs(evidence) == {"warmup": 2, "capture": 0, "served": 0, "replay": 0}
    model_runner.execute_model(dummy_run=False)
    assert runs(evidence) == {"warmup": 2, "capture": 0, "served": 2, "replay": 0}
    graph = model_runner.capture_model()
    assert isinstance(graph, StandInGraph) and runs(evidence)["capture"] == 2
    model_runner.execute_model(dummy_run=True, graph=graph)
    model_runner.execute_model(graph=graph)
    assert graph.replays == 2 and runs(evidence) == {"warmup": 3, "capture": 2, "served": 2, "replay": 1}


@pytest.mark.parametrize("name", sorted(getattr(phases, "SERVED_FRAMES", ("execute_model", "sample_tokens"))))
def test_each_served_step_name_is_a_method_of_vllms_workers(name):
    """Each name that makes a step served is a method vLLM's model runners and workers define in this
    release (read from the installed source)."""
    import pathlib

    import vllm

    workers = pathlib.Path(vllm.__file__).parent / "v1" / "worker"
    assert any(f"def {name}(" in path.read_text() for path in workers.rglob("*.py"))


def test_the_drafters_dummy_run_is_a_dummy_batch_of_this_release_and_names_no_served_path():
    """Read from the installed source: the V1 model runner's ``sample_tokens`` runs ``drafter.dummy_run``
    (data parallelism with a model drafter: EAGLE/MTP), which phases counts as warm-up; every function of
    vLLM named ``dummy_run`` is a drafter's (v1/spec_decode/), and each call to one is from the runner's
    ``_dummy_run`` or that dummy batch of ``sample_tokens``: none serves a request."""
    import ast
    import pathlib

    import vllm

    assert "dummy_run" in phases.WARMUP_FRAMES
    root = pathlib.Path(vllm.__file__).parent
    defining, callers = set(), set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "dummy_run(" not in text:
            continue
        for function in ast.walk(ast.parse(text)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if function.name == "dummy_run":
                defining.add(path.relative_to(root).parts[:2])
            calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            if any(c.func.attr == "dummy_run" for c in calls):
                callers.add((path.name, function.name))
    assert defining == {("v1", "spec_decode")}, defining
    assert callers == {("gpu_model_runner.py", "_dummy_run"), ("gpu_model_runner.py", "sample_tokens")}, callers


def test_a_batch_outside_any_step_is_not_served():
    """No step of vLLM's on the stack (and no starting thread in one): not served."""
    assert phases.current_phase() is Phase.WARMUP
    assert phases.step_of(sys._getframe()) is phases.Step.UNKNOWN


@pytest.mark.gpu
def test_on_a_gpu_a_dbo_graph_is_captured_in_microbatch_threads_and_its_served_replays_count(tmp_path, dbo_config):
    """Unrun so far (needs a GPU with vLLM installed): the same as the CPU test above with nothing stood
    in, the capture state read from the microbatch threads' own (capturing) stream and a real CUDA graph."""
    from vllm.config import CUDAGraphMode

    evidence, threads = evidence_for(tmp_path), []
    hook = evidence.effective_hook("qk_cache", "model.layers.0.self_attn.attn")

    def model(input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        threads.append(threading.current_thread().name)
        hook(input_ids.shape[0])
        return input_ids.float() * 2

    wrapper = v1_wrapper(model, dbo_config, CUDAGraphMode.NONE)
    capture_model(wrapper, dbo_config, CUDAGraphMode.FULL, "cuda")
    assert len(threads) == 2 and isinstance(wrapper.cudagraphs[TOKENS].cudagraph, torch.cuda.CUDAGraph)
    assert runs(evidence) == {"warmup": 0, "capture": 2, "served": 0, "replay": 0}
    out = execute_model(wrapper, dbo_config, CUDAGraphMode.FULL, "cuda")
    torch.cuda.synchronize()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0] and len(threads) == 2
    assert runs(evidence) == {"warmup": 0, "capture": 2, "served": 0, "replay": 1}
