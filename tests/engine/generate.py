"""Offline greedy generation on the real vLLM engine (``vllm.LLM``) for the A/B tests: prints one
``RESULT=`` JSON line with each prompt's tokens and their logprobs.

Every run schedules the same steps: the engine core (its own process) starts stepping as soon as
the first request reaches it, so on a busy machine a prompt could be prefilled a step later in one
run than in another. The scheduler is paused while the prompts are added and resumed at the first
step (vLLM's ``pause_scheduler("keep")`` queues the adds; they travel on the same input socket, in
order). (Prompts delayed by hand did not change this model's outputs here; the hold takes the
arrival timing out of the comparison all the same.)

    python generate.py CHECKPOINT [MAX_TOKENS]
"""

import json
import os
import sys

PROMPTS = ["The quick brown fox", "One plus one is", "Kimi reads long documents", "The cache holds keys"]


def hold_requests_until_first_step(engine) -> None:
    """Pause ``engine``'s scheduler now and resume it at its first ``step()`` (see the module doc)."""
    engine.engine_core.call_utility("pause_scheduler", "keep", False)
    step = engine.step

    def resume_then_step():
        engine.step = step
        engine.engine_core.call_utility("resume_scheduler")
        return step()

    engine.step = resume_then_step


def main() -> None:
    from engine_args import llm_kwargs
    from vllm import LLM, SamplingParams

    kwargs = llm_kwargs()
    if os.environ.get("K3ENGINE_KV_CONNECTOR"):  # the test kit's recording connector
        kwargs["kv_transfer_config"] = {"kv_connector": "RecordingConnector", "kv_role": "kv_both",
                                        "kv_connector_module_path": "k3_engine_testkit"}
    if os.environ.get("K3ENGINE_TP"):  # heads split across ranks, one worker process per rank
        kwargs["tensor_parallel_size"] = int(os.environ["K3ENGINE_TP"])
    llm = LLM(model=sys.argv[1], **kwargs)
    hold_requests_until_first_step(llm.llm_engine)
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0))
    result = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        result.append({"tokens": list(completion.token_ids), "logprobs": logprobs})
    print("RESULT=" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
