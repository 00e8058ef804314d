"""Named steering presets: registered by the operator (offline, from a file at server start,
or through the opt-in routes), selected by clients with ``"preset:<name>"``, validated against
the model when registered."""

import json

import pytest
import torch
from vllm import SamplingParams

from tests.integration.conftest import server_preset
from tests.integration.test_steering import _direction
from vllm_lens import LensRequestError, SteeringVector
from vllm_lens.client import LensClient, LensHTTPError

PROMPT = "The capital of France is"


def _tokens(llm, vectors, max_tokens=8):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        extra_args={"apply_steering_vectors": vectors})
    return list(llm.generate([PROMPT], sp)[0].outputs[0].token_ids)


def test_offline_presets_steer_as_their_vectors(tiny_llm):
    push = SteeringVector(activations=_direction(128, 50, 5.0)[None], layer_indices=[1])
    patch = SteeringVector(activations=_direction(128, 51, 3.0)[None, None], layer_indices=[2],
                           position_indices=[2], mode="replace")
    described = tiny_llm.register_steering("push", [push, patch])
    try:
        assert described["name"] == "push"
        assert [(v["layers"], v["mode"], v["shape"]) for v in described["vectors"]] == [
            ([1], "add", [1, 128]), ([2], "replace", [1, 1, 128])]
        assert [p["name"] for p in tiny_llm.steering_presets()] == ["push"]
        assert _tokens(tiny_llm, ["preset:push"]) == _tokens(tiny_llm, [push, patch])
        assert _tokens(tiny_llm, ["preset:push"]) != _tokens(tiny_llm, None)
        # a preset and the caller's own vectors together
        extra = SteeringVector(activations=_direction(128, 52, 4.0)[None], layer_indices=[3])
        assert _tokens(tiny_llm, ["preset:push", extra]) == _tokens(tiny_llm,
                                                                    [push, patch, extra])
        with pytest.raises(LensRequestError, match="unknown steering preset 'nope'") as info:
            _tokens(tiny_llm, ["preset:push", "preset:nope"])
        assert info.value.field == "apply_steering_vectors[1]"
    finally:
        tiny_llm.unregister_steering("push")
    with pytest.raises(LensRequestError, match="unknown steering preset 'push'"):
        _tokens(tiny_llm, "preset:push")
    assert len(_tokens(tiny_llm, None, 2)) == 2  # serving on


@pytest.mark.parametrize(("args", "field", "words"), [
    (("wide", [SteeringVector(activations=torch.ones(1, 64), layer_indices=[1])]),
     "presets.wide[0].activations", "hidden size"),
    (("deep", [SteeringVector(activations=torch.ones(1, 128), layer_indices=[40])]),
     "presets.deep[0].layer_indices[0]", "out of range"),
    (("bad name!", [SteeringVector(activations=torch.ones(1, 128), layer_indices=[1])]),
     "name", "not a preset name"),
    (("other", [SteeringVector(activations=torch.ones(1, 128), layer_indices=[1])],
      "meta-llama/Llama-3.1-8B"), "model", "is for 'meta-llama/Llama-3.1-8B'"),
])
def test_bad_presets_are_refused_at_registration(tiny_llm, args, field, words):
    with pytest.raises(LensRequestError, match=words) as info:
        tiny_llm.register_steering(*args)
    assert info.value.field == field
    assert tiny_llm.steering_presets() == []


def test_server_preset_from_file_equals_its_vectors_sent_inline(smol_server):
    with LensClient(smol_server.base_url) as client:
        (listed,) = client.steering_presets()
        assert listed["name"] == "calm" and listed["model"] == "SmolLM2-135M-Instruct"
        assert listed["vectors"][0]["phase"] == "decode"
        by_name = client.generate(PROMPT, max_tokens=8, ignore_eos=True,
                                  steering_vectors=["preset:calm"])
        inline = client.generate(PROMPT, max_tokens=8, ignore_eos=True,
                                 steering_vectors=[server_preset()])
        plain = client.generate(PROMPT, max_tokens=8, ignore_eos=True)
        assert by_name.token_ids == inline.token_ids != plain.token_ids
        with pytest.raises(LensHTTPError) as info:
            client.generate(PROMPT, max_tokens=2, steering_vectors=["preset:loud"])
        assert info.value.status == 400 and info.value.param == "apply_steering_vectors[0]"
        assert "calm" in info.value.message  # the error lists what is registered


def test_server_preset_routes_register_validate_and_unregister(smol_server):
    loud = SteeringVector(activations=_direction(576, 60, 8.0)[None], layer_indices=[12])
    with LensClient(smol_server.base_url) as client:
        with pytest.raises(LensHTTPError) as info:
            client.register_steering("thin", [SteeringVector(activations=torch.ones(1, 64),
                                                             layer_indices=[1])])
        assert info.value.status == 400 and info.value.param == "presets.thin[0].activations"
        client.register_steering("loud", [loud])
        try:
            assert [p["name"] for p in client.steering_presets()] == ["calm", "loud"]
            assert client.generate(PROMPT, max_tokens=6, ignore_eos=True,
                                   steering_vectors="preset:loud").token_ids == \
                client.generate(PROMPT, max_tokens=6, ignore_eos=True,
                                steering_vectors=[loud]).token_ids
        finally:
            client.unregister_steering("loud")
        assert [p["name"] for p in client.steering_presets()] == ["calm"]


def test_server_with_a_preset_that_does_not_fit_the_model_does_not_start(tiny_path, tmp_path):
    from tests.integration.server import running_server

    presets = tmp_path / "presets.json"
    presets.write_text(json.dumps({"calm": [server_preset().model_dump(mode="json")]}))  # 576 wide
    with pytest.raises(RuntimeError, match="server exited") as info:
        with running_server(tiny_path, "--enforce-eager",
                            env={"VLLM_LENS_STEERING_PRESETS": str(presets)}):
            pass
    message = str(info.value)
    assert "VLLM_LENS_STEERING_PRESETS" in message and "presets.calm[0].activations" in message
