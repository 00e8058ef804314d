"""Validation of lens keys in extra_args: each bad input names its field."""

import json

import pytest

from vllm_lens import LensRequestError, UnsupportedModelError
from vllm_lens.spec import PAYLOAD_KEY, CaptureSpec, LensRequest, ModelFacts, parse_extra_args

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8, max_model_len=64,
                   mapped=True)


def parse(extra):
    return parse_extra_args(extra, lambda: FACTS)


def test_plain_args_pass_through_without_asking_for_facts():
    def no_facts():
        raise AssertionError("facts must not be needed for plain requests")

    rest, lens = parse_extra_args({"other_plugin": 1}, no_facts)
    assert rest == {"other_plugin": 1} and lens is None
    assert parse_extra_args(None, no_facts) == ({}, None)
    assert parse_extra_args({"output_residual_stream": None}, no_facts)[1] is None


def test_list_of_layers_sorted_and_deduplicated():
    rest, lens = parse({"output_residual_stream": [3, 1, 3], "x": "y"})
    assert rest == {"x": "y"}
    assert lens.capture == CaptureSpec(layers=(1, 3))


def test_true_means_every_layer_and_keys_are_unique():
    _, a = parse({"output_residual_stream": True})
    _, b = parse({"output_residual_stream": True})
    assert a.capture.layers == (0, 1, 2, 3)
    assert a.key != b.key


def test_extended_form_and_json_string():
    spec = {"layers": [2], "positions": [5, 1], "reduce": "mean"}
    for raw in (spec, json.dumps(spec)):
        _, lens = parse({"output_residual_stream": raw})
        assert lens.capture == CaptureSpec(layers=(2,), positions=(1, 5), reduce="mean")


def test_payload_round_trip():
    _, lens = parse({"output_residual_stream": {"layers": [0, 2], "positions": "last_prompt"}})
    assert LensRequest.from_payload(lens.to_payload()) == lens


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"output_residual_stream": [4]}, "output_residual_stream[0]", "out of range"),
        ({"output_residual_stream": [-1]}, "output_residual_stream[0]", "out of range"),
        ({"output_residual_stream": []}, "output_residual_stream", "empty"),
        ({"output_residual_stream": ["a"]}, "output_residual_stream[0]", "integer"),
        ({"output_residual_stream": [True]}, "output_residual_stream[0]", "integer"),
        ({"output_residual_stream": 3}, "output_residual_stream", "list"),
        ({"output_residual_stream": "[1,"}, "output_residual_stream", "JSON"),
        ({"output_residual_stream": "12"}, "output_residual_stream",
         r"got the string '12' \(JSON for int 12\); send a list such as \[12\]"),
        ({"output_residual_stream": {"layers": [0], "positions": "middle"}},
         "output_residual_stream.positions", "unknown selector"),
        ({"output_residual_stream": {"layers": [0], "positions": [64]}},
         "output_residual_stream.positions[0]", "outside"),
        ({"output_residual_stream": {"layers": [0], "positions": []}},
         "output_residual_stream.positions", "non-empty"),
        ({"output_residual_stream": {"layers": [0], "reduce": "max"}},
         "output_residual_stream.reduce", "unknown reduction"),
        ({"output_residual_stream": {"layer": [0]}}, "output_residual_stream.layer", "unknown field"),
        ({"output_residual_stream": {"positions": "all"}}, "output_residual_stream.layers", "missing"),
        ({"output_residual_streams": [0]}, "output_residual_streams", "did you mean"),
        ({"ouptut_residual_stream": [0]}, "ouptut_residual_stream", "did you mean"),
        ({PAYLOAD_KEY: {"v": 1}}, PAYLOAD_KEY, "reserved"),
    ],
)
def test_bad_input_names_the_field(extra, field, words):
    with pytest.raises(LensRequestError, match=words) as info:
        parse(extra)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unmapped_model_names_its_class():
    facts = ModelFacts(model_class="GPT2LMHeadModel", n_layers=2, hidden_size=8,
                       max_model_len=64, mapped=False)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        parse_extra_args({"output_residual_stream": [0]}, lambda: facts)


def test_payload_decoding_rejects_foreign_data():
    with pytest.raises(ValueError):
        LensRequest.from_payload({"v": 99, "key": "k"})
    with pytest.raises(ValueError):
        LensRequest.from_payload("nope")
