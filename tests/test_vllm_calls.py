"""Every call the package makes into vLLM's internals binds on the installed release (run once per
release of the matrix): read from the package's own source (every ``rocm_aiter_ops.NAME(...)``
call and each listed vLLM method), bound against the release's real signature with the call's
own positional count and keyword names. vLLM 0.29-0.30's ``batched_gemm_a16wfp4`` takes ``Y``
without a default; a call without it passed every test through a lenient stand-in (issue 19)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import k3_amd_overlay

pytestmark = pytest.mark.vllm
PACKAGE = Path(k3_amd_overlay.__file__).parent

# A call in the package's source, by its callee's text, -> (vLLM module, attribute path, is an
# instance method called on an instance: the signature's ``self`` is bound by the call).
INTERNALS = {
    "attn.impl.forward_mqa": ("vllm.model_executor.layers.attention.mla_attention", "MLACommonImpl.forward_mqa", True),
    "attn._v_up_proj": ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention._v_up_proj", True),
    "vllm_ctx": ("vllm.model_executor.layers.attention.attention", "get_attention_context", False),
    "maybe_transfer_kv_layer": ("vllm.model_executor.layers.attention.kv_transfer_utils", "maybe_transfer_kv_layer",
                                False),
    "eager_break_during_capture": ("vllm.compilation.breakable_cudagraph", "eager_break_during_capture", False),
    "vllm_pair": ("vllm.models.common.ops.fused_qk_rmsnorm", "fused_q_kv_rmsnorm", False),
    # the op vLLM registers from this function when AITER is installed (its schema is the function's)
    "torch.ops.vllm.fused_mla_dual_rms_norm": ("vllm._aiter_ops", "_fused_mla_dual_rms_norm_impl", False),
    "AiterMLAHelper.get_actual_mla_num_heads": ("vllm.v1.attention.backends.mla.rocm_aiter_mla",
                                                "AiterMLAHelper.get_actual_mla_num_heads", False),
    "AiterMLAHelper.get_mla_padded_q": ("vllm.v1.attention.backends.mla.rocm_aiter_mla",
                                        "AiterMLAHelper.get_mla_padded_q", False),
}
AITER_OPS = "rocm_aiter_ops"


def calls_in_package() -> list[tuple[str, str, ast.Call]]:
    """(file, callee text, call) for each call of rocm_aiter_ops or of a listed internal."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                callee = ast.unparse(node.func)
                if callee in INTERNALS or callee.startswith(f"{AITER_OPS}."):
                    found.append((str(path.relative_to(PACKAGE)), callee, node))
    return found


def resolve(callee: str) -> tuple[object | None, bool]:
    """The installed vLLM's callable for ``callee`` (None where this release lacks it: the package
    reaches it only where its shape probe found it) and whether ``self`` is bound by the call."""
    if callee.startswith(f"{AITER_OPS}."):
        from vllm._aiter_ops import rocm_aiter_ops

        return getattr(rocm_aiter_ops, callee.split(".", 1)[1], None), False
    module_name, attribute, method = INTERNALS[callee]
    try:
        target: object = importlib.import_module(module_name)
    except ImportError:
        return None, method
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            return None, method
    return target, method


def test_the_scan_finds_the_calls_it_checks():
    callees = {callee for _, callee, _ in calls_in_package()}
    assert {"rocm_aiter_ops.batched_gemm_a16wfp4", "rocm_aiter_ops.triton_fp8_bmm", "attn.impl.forward_mqa",
            "attn._v_up_proj", "vllm_ctx", "maybe_transfer_kv_layer", "eager_break_during_capture",
            "torch.ops.vllm.fused_mla_dual_rms_norm"} <= callees


@pytest.mark.parametrize("where,callee,call", calls_in_package(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_call_into_vllm_binds_on_this_release(where, callee, call):
    target, method = resolve(callee)
    if target is None:
        pytest.skip(f"{callee} does not exist in this vLLM (the package reaches it only where it does)")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        pytest.fail(f"{where}: {callee} is called with *args/**kwargs, which this test cannot bind")
    positional = [object()] * (len(call.args) + (1 if method else 0))
    keywords = {k.arg: object() for k in call.keywords}
    try:
        inspect.signature(target).bind(*positional, **keywords)
    except TypeError as exc:
        pytest.fail(f"{where}: {ast.unparse(call)} does not bind on this vLLM's {callee}"
                    f"{inspect.signature(target)}: {exc}")


def test_the_check_catches_the_call_that_broke_vllm_029():
    """The planted fault: the MXFP4 call as it was (no ``Y``) fails to bind on 0.29-0.30 and binds
    from 0.31, where ``Y`` defaults to None."""
    from vllm._aiter_ops import rocm_aiter_ops

    signature = inspect.signature(rocm_aiter_ops.batched_gemm_a16wfp4)
    old = ast.parse("f(x, w, s, transpose_bm=True, prequant=True, y_scale=q)").body[0].value
    required_y = signature.parameters["Y"].default is inspect.Parameter.empty
    try:
        signature.bind(*[object()] * len(old.args), **{k.arg: object() for k in old.keywords})
        bound = True
    except TypeError:
        bound = False
    assert bound is not required_y


def test_the_fused_decode_wrappers_argument_reader_takes_vllms_own_parameters():
    """``k3_wrapper._fused_decode_args`` reads the arguments vLLM passes its own ``_fused_decode``
    (0.32+): its parameters are that method's, name for name and in order, on this release."""
    from k3_amd_overlay.targets import k3_wrapper, shapes

    try:
        wrapper = getattr(importlib.import_module(shapes.K3_MLA_MODULE), shapes.K3_WRAPPER, None)
    except ModuleNotFoundError:  # 0.29: no K3 MLA module of its own
        wrapper = None
    if wrapper is None or not hasattr(wrapper, "_fused_decode"):
        pytest.skip("this release's K3 wrapper has no _fused_decode (0.32+)")
    real = list(inspect.signature(wrapper._fused_decode).parameters)[1:]  # self dropped
    assert list(inspect.signature(k3_wrapper._fused_decode_args).parameters) == real
