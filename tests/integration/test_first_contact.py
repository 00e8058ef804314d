"""First contact on a real engine: one bad request in a batch fails the call before anything
runs, naming its index in the caller's list; outputs that asked for nothing have
``activations`` = None."""

import pytest
from vllm import SamplingParams

from tests.integration.engines import IDLE, held
from vllm_lens import LensRequestError

GOOD = SamplingParams(max_tokens=2, temperature=0, extra_args={"output_residual_stream": [0]})
BAD = SamplingParams(max_tokens=2, temperature=0, extra_args={"output_residual_stream": [99]})


def test_a_bad_request_fails_the_whole_call_naming_its_index(tiny_llm):
    with pytest.raises(LensRequestError, match=r"'output_residual_stream\[0\]' \(request 2 of "
                                               r"this call\)") as info:
        tiny_llm.generate(["Hello", "World", "Again"], [GOOD, GOOD, BAD])
    assert info.value.index == 2
    assert not tiny_llm.llm_engine.has_unfinished_requests()  # nothing runs half-way
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(LensRequestError, match=r"request 1 of this call"):
        tiny_llm.chat([conversation, conversation], [GOOD, BAD])
    out, plain = tiny_llm.generate(["Hello", "World"], [GOOD, SamplingParams(max_tokens=2)])
    assert out.activations["residual_stream"].shape[0] == 1
    assert plain.activations is None and plain.outputs[0].activations is None
    assert plain.lens_error is None and out.lens_error is None
