"""First contact on a real engine: one bad request in a batch fails the call before anything
runs, naming its index in the caller's list; outputs that asked for nothing have
``activations`` = None."""

import dataclasses
import json

import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import IDLE, held
from vllm_lens import (
    LensRequestError,
    NamedHook,
    SteeringVector,
    UnsupportedConfigError,
)
from vllm_lens.frontend.session import LensSession
from vllm_lens.spec.facts import facts_from_describe

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


SINK = {"sink": "acts", "dataset": "d", "key": "k"}
GATED = SteeringVector(activations=torch.ones(1, 128), layer_indices=[1], condition={
    "probe": torch.ones(128), "layer": 0, "point": "resid_post", "threshold": 0.0,
    "sharpness": 1.0})

#: Every way one request of an offline call can be refused: kind -> (its extra_args, its n,
#: the field its error names, settings of the call). Request 0 carries the same sink in
#: "sink key twice"; "speculative" runs on an engine the front end believes speculative.
BAD_REQUESTS = {
    "capture layer": ({"output_residual_stream": [99]}, 1, "output_residual_stream[0]", {}),
    "tap point": ({"output_activations": {"nope": [0]}}, 1, "output_activations.nope", {}),
    "Q/K layer": ({"output_qk": [99]}, 1, "output_qk[0]", {}),
    "misspelt key": ({"output_residual_streams": [0]}, 1, "output_residual_streams", {}),
    "steering vector": ({"apply_steering_vectors": [SteeringVector(
        activations=torch.ones(1, 64), layer_indices=[0])]}, 1,
        "apply_steering_vectors[0].activations", {}),
    "steering preset": ({"apply_steering_vectors": ["preset:nope"]}, 1,
                        "apply_steering_vectors[0]", {}),
    "SAE": ({"output_sae_features": {"sae": "/nonexistent/sae"}}, 1,
            "output_sae_features.sae", {}),
    "hook argument (HookArgumentError)": ({"apply_hooks": [NamedHook(
        "linear_probe", [2], {"weight": [0.1] * 5})]}, 1, "apply_hooks[0].args.weight", {}),
    "hook point (HookArgumentError)": ({"apply_hooks": [NamedHook(
        "attention_to_span", [1], {"span": [0, 2]})]}, 1, "apply_hooks[0].hook_point", {}),
    "hook factory": ({"apply_hooks": [NamedHook("logit_lens_topk", [1], {"k": 0})]}, 1,
                     "apply_hooks[0].args", {}),
    "capture size": ({"output_residual_stream": True}, 1, "output_residual_stream",
                     {"VLLM_LENS_MAX_CAPTURE_BYTES": str(16 << 10)}),
    "hook rows": ({"apply_hooks": [NamedHook("logit_lens_topk", [0, 1, 2, 3], {"k": 1})]}, 1,
                  "apply_hooks[0]", {"VLLM_LENS_LOGIT_LENS_MAX_ROWS": "8"}),
    "unknown sink": ({"output_residual_stream": [0], "capture_sink": SINK}, 1,
                     "capture_sink.sink", {}),
    "sink key twice": ({"output_residual_stream": [0], "capture_sink": SINK}, 1,
                       "capture_sink.key", {"VLLM_LENS_SINKS": "configured"}),
    "sink with n=2": ({"output_residual_stream": [0], "capture_sink": SINK}, 2,
                      "capture_sink", {"VLLM_LENS_SINKS": "configured"}),
    "stream value": ({"output_residual_stream": [0], "stream_activations": "maybe"}, 1,
                     "stream_activations", {}),
    "stream with n=2": ({"output_residual_stream": [0], "stream_activations": True}, 2,
                        "stream_activations", {}),
    "gated steering with n=2": ({"apply_steering_vectors": [GATED]}, 2,
                                "apply_steering_vectors", {}),
    "speculative (UnsupportedConfigError)": ({"apply_hooks": [NamedHook(
        "linear_probe", [2], {"weight": [0.1] * 128})]}, 1, "apply_hooks", {}),
}


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
def test_every_refusal_names_the_request_of_the_call(tiny_llm, monkeypatch, tmp_path, kind):
    extra, n, field, settings = BAD_REQUESTS[kind]
    for name, value in settings.items():
        if name == "VLLM_LENS_SINKS":
            value = json.dumps({"acts": {"root": str(tmp_path)}})
        monkeypatch.setenv(name, value)
    if kind.startswith("speculative"):
        session = LensSession.of(tiny_llm.llm_engine)
        facts = session.facts or facts_from_describe(
            tiny_llm.llm_engine.collective_rpc("lens_describe"))
        monkeypatch.setattr(session, "facts", dataclasses.replace(facts, speculative=True))
    first = (SamplingParams(max_tokens=2, temperature=0, extra_args=dict(extra))
             if kind == "sink key twice" else GOOD)
    bad = SamplingParams(max_tokens=16, temperature=1.0 if n > 1 else 0, n=n, seed=0,
                         extra_args=extra)
    with pytest.raises(LensRequestError) as info:
        tiny_llm.generate(["Hello", "World", "Again"], [first, GOOD, bad])
    assert f"invalid '{field}' (request 2 of this call)" in str(info.value), str(info.value)
    assert info.value.index == 2 and info.value.field == field
    if kind.startswith("speculative"):
        assert isinstance(info.value, UnsupportedConfigError)
    assert not tiny_llm.llm_engine.has_unfinished_requests()  # nothing was added
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]
