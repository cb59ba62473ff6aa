"""The phase's contract on plain Python threads (no vLLM): a thread in no step of its own takes the
step of the thread that started it and waits for it (joining it, holding it alone or in a list),
never that of another thread that waits for some other thread or that holds it without waiting; a
chain of starters is followed four deep (MAX_STARTERS) and no deeper (fail closed); and ``capturing`` is
true only where torch is imported, CUDA available and initialised, and the stream capturing.
``current_phase``, ``replay_phase`` and ``capturing_graph`` read the frames of their callers as
each says; the graph of vLLM's active breakable capture comes first."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable

import pytest

from k3_amd_overlay import phases
from k3_amd_overlay.phases import Phase, Step

WAIT_S = 30


def _dummy_run(body: Callable[[], None]) -> None:  # named as vLLM's model runner names its dummy batches
    body()


def execute_model(body: Callable[[], None]) -> None:  # named as vLLM's worker names the step serving a batch
    body()


def _joining(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is threading.Thread.join.__code__:
            return True
        frame = frame.f_back
    return False


def _checked(seen: dict[str, object], done: threading.Event,
             joining: list[threading.Thread] = ()) -> Callable[[], None]:
    """Ask the step here, once each thread of ``joining`` waits in ``Thread.join`` (a starter that
    waits for the thread it started is in ``start`` until that thread runs)."""
    def check() -> None:
        while not all(_joining(thread) for thread in joining):
            threading.Event().wait(0.005)
        seen["step"] = phases.step_of(sys._getframe())
        seen["phase"] = phases.current_phase()
        done.set()

    return check


def _starts_and_joins(step: Callable, body: Callable[[], None]) -> Callable[[], None]:
    """A thread that, inside ``step``, starts one thread (held alone) running ``body`` and joins it."""
    def run() -> None:
        def inner() -> None:
            worker = threading.Thread(target=body)
            worker.start()
            worker.join(WAIT_S)

        step(inner)

    return run


def _joins_another(step: Callable, release: threading.Event) -> Callable[[], None]:
    """A thread that, inside ``step``, waits for threads of its own (held in a list), which wait for
    ``release``."""
    def run() -> None:
        def inner() -> None:
            others = [threading.Thread(target=release.wait, args=(WAIT_S,))]
            others[0].start()
            others[0].join(WAIT_S)

        step(inner)

    return run


@pytest.mark.parametrize("starter_first", [True, False])
@pytest.mark.parametrize("starter_step,other_step,expected", [
    (_dummy_run, execute_model, Step.WARMUP), (execute_model, _dummy_run, Step.SERVED)])
def test_a_thread_takes_the_step_of_the_thread_that_started_it_not_of_another_that_waits(
        starter_first, starter_step, other_step, expected):
    """Both threads are joining; only one holds the thread asking. Started in either order, so that
    whichever order the interpreter lists threads in, a wrong pick shows."""
    seen: dict[str, object] = {}
    done, release = threading.Event(), threading.Event()
    joining: list[threading.Thread] = []
    other = threading.Thread(target=_joins_another(other_step, release))
    starter = threading.Thread(target=_starts_and_joins(starter_step, _checked(seen, done, joining)))
    joining += [starter, other]
    for thread in (starter, other) if starter_first else (other, starter):
        thread.start()
    try:
        assert done.wait(WAIT_S)
    finally:
        release.set()
        starter.join(WAIT_S)
        other.join(WAIT_S)
    assert seen == {"step": expected, "phase": Phase.SERVED if expected is Step.SERVED else Phase.WARMUP}


def test_a_thread_held_by_a_served_step_that_does_not_wait_for_it_is_not_served():
    """Fail closed: a served step that started the thread and holds it, but does not join it, has
    not shown the thread runs part of its step."""
    seen: dict[str, object] = {}
    done, release = threading.Event(), threading.Event()

    def holds_without_waiting() -> None:
        worker = threading.Thread(target=_checked(seen, done))
        worker.start()
        release.wait(WAIT_S)  # holds ``worker`` in a running frame, in no join
        worker.join(WAIT_S)

    holder = threading.Thread(target=execute_model, args=(holds_without_waiting,))
    holder.start()
    try:
        assert done.wait(WAIT_S)
    finally:
        release.set()
        holder.join(WAIT_S)
    assert seen == {"step": Step.UNKNOWN, "phase": Phase.WARMUP}


def _chain(levels: int, seen: dict[str, object], starters: dict[str, list[threading.Thread]]) -> None:
    """Start a thread that starts a thread ... ``levels`` deep; the last one asks its step. The
    starters are kept in a dict, which holds no thread the way vLLM's runners hold theirs."""
    if levels == 0:
        _checked(seen, threading.Event(), starters["threads"])()
        return
    above = {"threads": [*starters["threads"], threading.current_thread()]}
    worker = threading.Thread(target=_chain, args=(levels - 1, seen, above))
    worker.start()
    worker.join(WAIT_S)


@pytest.mark.parametrize("depth,expected", [(1, Step.SERVED), (4, Step.SERVED), (5, Step.UNKNOWN)])
def test_starters_are_followed_four_deep_and_no_deeper(depth, expected):
    """Four starters up (a thread started by a thread started by ... a step's thread): more is no
    layout vLLM has, and is not shown to be served."""
    seen: dict[str, object] = {}
    execute_model(lambda: _chain(depth, seen, {"threads": []}))
    assert seen["step"] is expected


class _Cuda:
    """Stands in for ``torch.cuda`` (no CUDA here): the three facts ``capturing`` reads."""

    def __init__(self, available: bool, initialized: bool, capturing: bool) -> None:
        self.facts = available, initialized, capturing

    def is_available(self) -> bool:
        return self.facts[0]

    def is_initialized(self) -> bool:
        return self.facts[1]

    def is_current_stream_capturing(self) -> bool:
        return self.facts[2]


@pytest.mark.parametrize("available", [True, False])
@pytest.mark.parametrize("initialized", [True, False])
@pytest.mark.parametrize("capturing", [True, False])
def test_capturing_only_where_cuda_is_available_initialised_and_the_stream_captures(
        monkeypatch, available, initialized, capturing):
    import torch

    monkeypatch.setattr(torch, "cuda", _Cuda(available, initialized, capturing))
    assert phases.capturing() is (available and initialized and capturing)
    assert (phases.current_phase() is Phase.CAPTURE) is (available and initialized and capturing)
    monkeypatch.delitem(sys.modules, "torch")  # torch never imported: nothing is captured
    assert phases.capturing() is False


def test_the_phase_is_that_of_the_callers_frame_and_a_replays_that_of_the_callers_caller():
    def execute_model() -> tuple[Phase, Phase]:  # a served step that asks itself, and replays
        return phases.current_phase(), replay()

    def replay() -> Phase:  # what a graph's counted replay is to its caller
        return phases.replay_phase()

    assert execute_model() == (Phase.SERVED, Phase.REPLAY)
    assert (phases.current_phase(), replay()) == (Phase.WARMUP, Phase.WARMUP)


class _Drafter:  # as vLLM's EAGLE/MTP proposer (v1/spec_decode/llm_base_proposer.py) names its dummy batch
    def dummy_run(self, num_tokens: int) -> Phase:
        return phases.current_phase()  # what the draft model's K3 MLA layer records for this batch

    def propose(self) -> Phase:  # a served draft: the batch the scheduler asked for
        return phases.current_phase()


class _ModelRunner:  # the V1 model runner's served step, as 0.29-0.33 run the drafter from it
    drafter = _Drafter()

    def sample_tokens(self, data_parallel: bool) -> tuple[Phase, Phase | None]:
        proposed = self.drafter.propose()
        # with data parallelism, a rank whose batch does not fit the drafter runs one token to keep in step
        return proposed, self.drafter.dummy_run(num_tokens=1) if data_parallel else None


def test_a_drafters_dummy_batch_in_a_served_step_is_not_served():
    """vLLM's V1 model runner (0.29-0.33), with data parallelism and a drafter that runs a model (EAGLE,
    MTP: K3's), runs ``drafter.dummy_run(num_tokens=1)`` inside ``sample_tokens``: a dummy batch of its
    own making, never served traffic; the drafter's real proposal in the same step is served."""
    assert _ModelRunner().sample_tokens(data_parallel=True) == (Phase.SERVED, Phase.WARMUP)
    assert _ModelRunner().sample_tokens(data_parallel=False) == (Phase.SERVED, None)


class StandInGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` (no capture without a GPU)."""

    def capture_begin(self, *args, **kwargs) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass


@dataclasses.dataclass
class _Holder:  # as UBatchWrapper's CUDAGraphMetaData holds the graph being captured
    cudagraph: object


@dataclasses.dataclass
class _Other:  # a dataclass with no graph
    size: int


class _NotADataclass:
    def __init__(self, graph: object) -> None:
        self.cudagraph = graph


def test_the_graph_being_captured_is_a_local_of_the_callers_frames_or_a_dataclass_holders(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.delitem(sys.modules, "vllm.compilation.breakable_cudagraph", raising=False)
    assert phases.capturing_graph() is None  # no frame holds one (yet)
    graph = StandInGraph()

    def held_by_the_caller() -> tuple[object, object]:
        captured = StandInGraph()  # the capturing frame's own local, not this test's
        return captured, phases.capturing_graph()

    def under(holder: object) -> object:
        return phases.capturing_graph()

    captured, found = held_by_the_caller()
    assert found is captured and captured is not graph
    holder, other, not_a_holder = _Holder(StandInGraph()), _Other(23), _NotADataclass(StandInGraph())
    found = [under(holder), under(other), under(not_a_holder)]  # (computed outside pytest's rewritten assert)
    # the graph of a dataclass holder; else further up (this test's frame holds ``graph``): a dataclass
    # without one holds none, and only a dataclass holds the graph being captured
    assert found == [holder.cudagraph, graph, graph] and holder.cudagraph is not graph
    monkeypatch.delitem(sys.modules, "torch")  # torch never imported: no graph
    assert phases.capturing_graph() is None


@pytest.mark.vllm
def test_vllms_breakable_capture_segment_comes_first(monkeypatch):
    """vLLM's breakable capture (vllm/compilation/breakable_cudagraph.py) records into its current
    segment's graph, whatever graphs the frames hold; between segments (in an eager break) the
    frames are read."""
    import torch

    breakable = pytest.importorskip("vllm.compilation.breakable_cudagraph")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    local = StandInGraph()
    seen = {}
    with breakable.BreakableCUDAGraphCapture() as capture:
        segment = capture._current_graph
        seen["segment"] = phases.capturing_graph()
        capture.add_eager(lambda: seen.setdefault("between", phases.capturing_graph()))
    assert isinstance(segment, StandInGraph) and segment is not local
    assert seen == {"segment": segment, "between": local}
    assert phases.capturing_graph() is local  # no capture active
