"""Named steering presets: registered by the operator (offline, from a file at server start,
or through the opt-in routes), selected by clients with ``"preset:<name>"``, validated against
the model when registered; items steering by SAE feature are resolved then."""

import json

import pytest
import torch
from vllm import SamplingParams

from tests.integration.conftest import SERVER_FEATURE_PRESET, server_preset
from tests.integration.saes import saved_sae
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


def test_offline_presets_steer_by_sae_feature_as_the_same_items_inline(tiny_llm, tmp_path):
    """A preset may hold items steering by SAE feature (``scale`` and ``clamp``), resolved
    when it is registered: it steers as the same items given inline (not as no steering),
    its clamp is still the only clamp at its site in a request selecting it, and a clamp the
    SAE cannot serve is refused at registration naming the field."""
    path = tmp_path / "resid"
    saved_sae(path, "jumprelu", "blocks.2.hook_resid_post")
    add = {"sae": str(path), "feature": 3, "scale": 30.0}
    clamp = {"sae": str(path), "feature": [11, 300], "clamp": [6.0, 0.0]}
    assert [(v["layers"], v["mode"], v["shape"])
            for v in tiny_llm.register_steering("add", [add])["vectors"]] == [
        ([2], "add", [1, 128])]
    assert [(v["layers"], v["mode"], v["shape"])
            for v in tiny_llm.register_steering("clamp", [clamp])["vectors"]] == [
        ([2], "clamp", [2, 128])]
    try:
        plain = _tokens(tiny_llm, None)
        assert _tokens(tiny_llm, ["preset:add"]) == _tokens(tiny_llm, [add]) != plain
        assert _tokens(tiny_llm, ["preset:clamp"]) == _tokens(tiny_llm, [clamp]) != plain
        with pytest.raises(LensRequestError, match="only clamp or replacement"):
            _tokens(tiny_llm, ["preset:clamp", clamp])
    finally:
        tiny_llm.unregister_steering("add")
        tiny_llm.unregister_steering("clamp")
    saved_sae(tmp_path / "topk", "topk", "blocks.1.hook_resid_post", k=16)
    with pytest.raises(LensRequestError, match="a preset cannot keep it") as info:
        tiny_llm.register_steering("topk", [{"sae": str(tmp_path / "topk"), "feature": 1,
                                             "clamp": 2.0}])
    assert info.value.field == "presets.topk[0].clamp"
    assert tiny_llm.steering_presets() == []


def test_server_preset_from_file_equals_its_vectors_sent_inline(smol_server):
    with LensClient(smol_server.base_url) as client:
        listed = {p["name"]: p for p in client.steering_presets()}["calm"]
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
            assert [p["name"] for p in client.steering_presets()] == ["calm", "focus", "loud"]
            assert client.generate(PROMPT, max_tokens=6, ignore_eos=True,
                                   steering_vectors="preset:loud").token_ids == \
                client.generate(PROMPT, max_tokens=6, ignore_eos=True,
                                steering_vectors=[loud]).token_ids
        finally:
            client.unregister_steering("loud")
        assert [p["name"] for p in client.steering_presets()] == ["calm", "focus"]


def test_server_presets_steer_by_the_features_of_its_named_saes(smol_server, smol_sae):
    """The presets file may steer by the features of an SAE of ``VLLM_LENS_SAES`` (registered
    first): the preset steers as the same items sent inline. So may a preset registered
    through the routes, by the SAE's name only: a directory is refused naming the field, and
    nothing is registered."""
    focus = [{**SERVER_FEATURE_PRESET[0], "scale": 20.0}]
    with LensClient(smol_server.base_url) as client:
        listed = {p["name"]: p for p in client.steering_presets()}["focus"]
        assert [(v["layers"], v["mode"], v["shape"]) for v in listed["vectors"]] == [
            ([10], "add", [1, 576]), ([10], "clamp", [2, 576])]
        by_name = client.generate(PROMPT, max_tokens=8, ignore_eos=True,
                                  steering_vectors=["preset:focus"])
        inline = client.generate(PROMPT, max_tokens=8, ignore_eos=True,
                                 steering_vectors=SERVER_FEATURE_PRESET)
        plain = client.generate(PROMPT, max_tokens=8, ignore_eos=True)
        assert by_name.token_ids == inline.token_ids != plain.token_ids
        client.register_steering("sharper", focus)
        try:
            assert client.generate(PROMPT, max_tokens=8, ignore_eos=True,
                                   steering_vectors="preset:sharper").token_ids == \
                client.generate(PROMPT, max_tokens=8, ignore_eos=True,
                                steering_vectors=focus).token_ids
        finally:
            client.unregister_steering("sharper")
        with pytest.raises(LensHTTPError) as info:
            client.register_steering("far", [{**focus[0], "sae": str(smol_sae[0])}])
        assert info.value.status == 400 and info.value.param == "presets.far[0].sae"
        assert "cannot name a path" in info.value.message
        assert [p["name"] for p in client.steering_presets()] == ["calm", "focus"]


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
