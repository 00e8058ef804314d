"""Greedy generation in a fresh process (run with VLLM_LENS_DISABLE=1 by the tests).

Reads {"model", "prompts", "max_tokens", "engine", "cores"} as JSON on stdin and prints the
generated token ids as one JSON line, so tests can compare against vLLM without the plugin.
``cores`` (or null): the cores to run on, for a one-process engine that should compute as a
multiprocess engine's pinned worker would.
"""

import json
import os
import sys

if __name__ == "__main__":
    req = json.loads(sys.stdin.read())
    if req.get("cores"):
        os.sched_setaffinity(0, req["cores"])  # before torch starts its threads

    from vllm import LLM, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    llm = LLM(req["model"], **req["engine"])
    outs = llm.generate(req["prompts"], SamplingParams(max_tokens=req["max_tokens"], temperature=0))
    # Prove the plugin really stayed out: nothing wrapped here, no extension on the workers.
    assert not getattr(LLMEngine.add_request, "__vllm_lens_wrapper__", False)
    try:
        llm.collective_rpc("lens_describe")
    except Exception:
        pass
    else:
        raise AssertionError("VLLM_LENS_DISABLE=1 but the worker extension was loaded")
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
