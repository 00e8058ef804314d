"""First contact: the inputs users hold are accepted, mistakes name the way out."""

import numpy as np
import pytest
import torch

from vllm_lens import LensRequestError, SteeringVector, decode_activations
from vllm_lens.common import wire
from vllm_lens.spec import ModelFacts, parse_extra_args

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8,
                   max_model_len=64, mapped=True)


def test_steering_vectors_accept_numpy_arrays_and_integers():
    sv = SteeringVector(activations=np.ones((2, 8)), layer_indices=np.array([1, 3]))
    assert sv.activations.dtype == torch.float32  # float64 is cast, as documented
    assert sv.layer_indices == [1, 3] and all(type(i) is int for i in sv.layer_indices)
    _, lens = parse_extra_args({"apply_steering_vectors": [sv]}, lambda: FACTS)
    assert lens.steer[0].layers == (1, 3)
    three_d = SteeringVector(activations=np.ones((1, 2, 8), dtype=np.float32),
                             layer_indices=[np.int64(0)], position_indices=[np.int64(4), 9])
    assert three_d.positions == [4, 9]


def test_wrong_activation_types_name_the_accepted_forms():
    with pytest.raises(ValueError, match="torch.Tensor or numpy array"):
        SteeringVector(activations=[[1.0] * 8], layer_indices=[0])
    with pytest.raises(ValueError, match=r"float64 is cast.*activations.float\(\)"):
        SteeringVector(activations=torch.ones(1, 8, dtype=torch.int64), layer_indices=[0])


def test_capture_layers_accept_numpy_integers_and_arrays():
    _, lens = parse_extra_args({"output_residual_stream": [np.int64(2), 0]}, lambda: FACTS)
    assert lens.capture.layers == (0, 2)
    _, lens = parse_extra_args({"output_residual_stream": np.array([3])}, lambda: FACTS)
    assert lens.capture.layers == (3,)


def test_a_string_of_layers_is_named_a_string():
    from vllm_lens.client import LensClient

    with pytest.raises(TypeError, match=r"got the string '12' \(pass \[12\], not '12'\)"):
        # Refused while the request is built, before anything is sent.
        LensClient("http://127.0.0.1:9", model="m").generate("x", capture_layers="12")


def test_json_true_turned_into_1_by_vllm_xargs_gets_the_fix():
    with pytest.raises(LensRequestError, match=r'send the string "true"'):
        parse_extra_args({"output_residual_stream": 1}, lambda: FACTS)


def test_errors_name_the_index_in_the_callers_list():
    err = LensRequestError("output_residual_stream[0]", "bad", index=1)
    assert "(request 1 of this call)" in str(err) and err.index == 1
    assert "(request id r-7)" in str(LensRequestError("x", "bad", request_id="r-7"))


def test_decode_activations_takes_sdk_response_objects():
    record = wire.tensor_to_json(torch.arange(6, dtype=torch.float32).reshape(1, 2, 3))

    class SdkChoice:  # what openai's pydantic models offer
        def model_dump(self):
            return {"index": 0, "text": "x", "activations": {"residual_stream": record}}

    decoded = decode_activations(SdkChoice())
    assert torch.equal(decoded["residual_stream"], torch.arange(6.0).reshape(1, 2, 3))
    with pytest.raises(TypeError, match="openai SDK"):
        decode_activations(42)


def test_demo_model_paths_are_what_vllm_takes(tiny_path):
    from vllm_lens.demo_models import tiny_llama_dir

    assert isinstance(tiny_llama_dir(), str) and tiny_llama_dir() == tiny_path


def test_outputs_have_lens_fields_even_when_nothing_was_asked():
    import vllm_lens.plugin
    from vllm.outputs import CompletionOutput

    vllm_lens.plugin.register()
    out = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                           logprobs=None)
    assert out.activations is None and out.hook_results is None and out.lens_error is None


def test_a_request_whose_results_cannot_be_collated_fails_alone():
    from vllm.outputs import CompletionOutput, RequestOutput

    from vllm_lens import LensExecutionError
    from vllm_lens.frontend.collator import fail_output
    from vllm_lens.spec import CaptureSpec, LensRequest

    completion = CompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=None,
                                  logprobs=None)
    output = RequestOutput(request_id="7", prompt=None, prompt_token_ids=[1, 2],
                           prompt_logprobs=None, outputs=[completion], finished=True)
    lens = LensRequest(key="k", capture=CaptureSpec(layers=(0,)))
    fail_output(output, lens, OSError("handoff file vanished"))
    for target in (output, completion):
        assert isinstance(target.lens_error, LensExecutionError)
        assert "collation: OSError: handoff file vanished" in str(target.lens_error)
        assert target.activations is None


def test_a_request_no_worker_vouches_for_fails_instead_of_passing_silently():
    from vllm.outputs import CompletionOutput, RequestOutput

    from vllm_lens import LensExecutionError
    from vllm_lens.common.messages import FetchAnswer, FetchPart
    from vllm_lens.frontend.collator import attach
    from vllm_lens.spec import LensRequest, SteerSpec

    def output():
        completion = CompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=None,
                                      logprobs=None, finish_reason="length")
        return RequestOutput(request_id="7", prompt=None, prompt_token_ids=[1, 2],
                             prompt_logprobs=None, outputs=[completion], finished=True)

    steer = SteerSpec(layers=(0,), vectors=wire.dumps(torch.ones(1, 8)), scale=1.0,
                      norm_match=False, positions=None)
    lens = LensRequest(key="k", steer=(steer,))
    lost = output()
    # no rank held it: its steering cannot be vouched for
    attach(lost, lens, [FetchAnswer(requests={})], 1, None)
    assert isinstance(lost.lens_error, LensExecutionError) and "no worker held" in str(
        lost.lens_error)
    ran = output()
    held = FetchPart(error=None, conflict=False, capacity=None, held=True, seen=[],
                     captures={}, hooks=None, gates=None, monitors=None, receipt=None)
    attach(ran, lens, [FetchAnswer(requests={"k": {"7-abc": held}})], 1, None)
    assert ran.lens_error is None


def test_two_requests_in_flight_never_write_one_example(tmp_path, monkeypatch):
    """The sinks of the requests in flight are counted, not searched: an example another
    running request writes is refused, and free again once that request is forgotten
    (forgetting it twice is harmless)."""
    import json

    from vllm import SamplingParams

    from vllm_lens.frontend.session import LensSession

    monkeypatch.setenv("VLLM_LENS_SINKS", json.dumps({"acts": {"root": str(tmp_path)}}))
    session = LensSession()
    session.facts = FACTS

    def params(key):
        return SamplingParams(max_tokens=1, extra_args={
            "output_residual_stream": {"layers": [0], "positions": "last_prompt"},
            "capture_sink": {"sink": "acts", "dataset": "d", "key": key}})

    _, first = session.prepare(params("k1"), "r1", [1, 2, 3])
    with pytest.raises(LensRequestError, match="'k1' of dataset 'd' is already being written"):
        session.prepare(params("k1"), "r2", [1, 2, 3])
    with pytest.raises(LensRequestError, match="an earlier request of this call"):
        session.check_beside(first, 1, added={first.sink})
    session.prepare(params("k2"), "r3", [1, 2, 3])
    assert session.forget(["r1"]) == [first.key] and session.forget(["r1"]) == []
    session.prepare(params("k1"), "r2", [1, 2, 3])
    session.forget(["r2", "r3"])
    assert not session._sinks and not session.in_flight
