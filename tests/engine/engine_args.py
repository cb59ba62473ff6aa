"""The one set of engine arguments every real-engine test uses (offline ``LLM`` and the OpenAI
server alike): the tiny checkpoint with dummy weights (the test kit makes them deterministic), an
fp8 KV cache (so the decode fusions can take the layers), eager mode, a small cache."""

from __future__ import annotations

import json
import os

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
# Set for every engine process the tests start.
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "K3ENGINE_WEIGHTS": "fanin",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
}
# The overlay's providers that run on a CPU: the torch references (Triton needs a GPU here).
REFERENCE_PROVIDERS = {
    "K3_AMD_OVERLAY_QKV_NORM_PROVIDER": "reference",
    "K3_AMD_OVERLAY_QK_CACHE_PROVIDER": "reference",
    "K3_AMD_OVERLAY_ABSORB_QK_CACHE_PROVIDER": "reference",
}
NO_MEDIA = {"image": 0, "video": 0}
# vLLM's CPU MLA, named: on a CPU with AMX tiles vLLM otherwise picks its AMX MLA backend, which the
# test kit's fp8 cache (written for CPU MLA) does not cover.
ATTENTION_BACKEND = "CPU_MLA"


def llm_kwargs() -> dict:
    return {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS, "kv_cache_dtype": os.environ.get("K3ENGINE_KV_CACHE_DTYPE", "fp8"),
            "enforce_eager": True, "seed": 0, "limit_mm_per_prompt": NO_MEDIA, "attention_backend": ATTENTION_BACKEND}


def server_args() -> list[str]:
    kwargs = llm_kwargs()
    return ["--load-format", kwargs["load_format"], "--dtype", kwargs["dtype"],
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--kv-cache-dtype", kwargs["kv_cache_dtype"], "--enforce-eager", "--seed", "0",
            "--limit-mm-per-prompt", json.dumps(NO_MEDIA), "--attention-backend", ATTENTION_BACKEND]
