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


def test_logit_attribution_parses_round_trips_and_refuses_by_field():
    """``output_logit_attribution``: true or the dict form, its captures (signals ``dla:``),
    the payload's round trip; refusals name the field, the engine's reason included."""
    import dataclasses

    from vllm_lens import UnsupportedConfigError

    served = dataclasses.replace(FACTS, readout_refused=None, heads_refused=None, n_heads=2,
                                 head_dim=4, vocab_size=100,
                                 sites=("pre", "attn", "mid", "post"))
    _, lens = parse_extra_args({"output_logit_attribution": True}, lambda: served)
    spec = lens.logit_attribution
    assert (spec.layers, spec.positions, spec.token, spec.heads) == ((0, 1, 2, 3), "all", None, 0)
    assert [c.signal for c in lens.sae_captures] == [
        "dla:resid_pre", "dla:attn_out", "dla:mlp_out", "dla:resid_post"]
    assert lens.wants_tokens
    _, lens = parse_extra_args({"output_logit_attribution": json.dumps(
        {"layers": [2], "positions": "prompt", "attribution_token": 7, "heads": True})},
        lambda: served)
    assert lens.logit_attribution.heads == 2 and not lens.wants_tokens
    assert lens.sae_captures[-1].signal == "dla:attn_z"
    assert LensRequest.from_payload(lens.to_payload()) == lens
    for extra, field, words, facts in (
        ({"layers": [9]}, "output_logit_attribution.layers[0]", "out of range", served),
        ({"attribution_token": 100}, "output_logit_attribution.attribution_token",
         "vocabulary", served),
        ({"heads": "yes"}, "output_logit_attribution.heads", "true or false", served),
        ({"head": True}, "output_logit_attribution.head", "unknown field", served),
        (True, "output_logit_attribution", "tensor parallelism",
         dataclasses.replace(served, readout_refused="tensor parallelism (2 ranks)")),
        ({"heads": True}, "output_logit_attribution.heads", "post-attention norm",
         dataclasses.replace(served, heads_refused="a post-attention norm")),
        (True, "output_logit_attribution", "pipeline parallelism",
         dataclasses.replace(served, pp_size=2)),
    ):
        with pytest.raises(LensRequestError, match=words) as info:
            parse_extra_args({"output_logit_attribution": extra}, lambda f=facts: f)
        assert info.value.field == field
    with pytest.raises(UnsupportedConfigError, match="did not describe"):  # an older worker
        parse_extra_args({"output_logit_attribution": True},
                         lambda: dataclasses.replace(FACTS, sites=served.sites))


QK_FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8,
                      max_model_len=64, mapped=True, n_heads=4, n_kv_heads=2, head_dim=2,
                      sites=("pre", "post", "attn"),
                      qk_meta=({"scale": 0.5},) * 4)


def test_output_qk_chooses_heads_and_keeps_the_list_form():
    _, lens = parse_extra_args({"output_qk": {"layers": [2, 0], "heads": [3, 1, 3]}},
                               lambda: QK_FACTS)
    assert lens.qk_layers == (0, 2) and lens.qk_heads == (1, 3)
    assert LensRequest.from_payload(lens.to_payload()).qk_heads == (1, 3)
    _, plain = parse_extra_args({"output_qk": [1]}, lambda: QK_FACTS)
    assert plain.qk_heads is None and "qk_heads" not in plain.to_payload()
    # over HTTP the dict arrives as a JSON string, heads may be one index
    _, one = parse_extra_args({"output_qk": json.dumps({"layers": "true", "heads": 2})},
                              lambda: QK_FACTS)
    assert one.qk_layers == (0, 1, 2, 3) and one.qk_heads == (2,)


@pytest.mark.parametrize("raw, field, problem", [
    ({"layers": [0], "heads": [4]}, "output_qk.heads[0]", "head index 4 is out of range"),
    ({"layers": [0], "heads": []}, "output_qk.heads", "non-empty list"),
    ({"layers": [0], "heads": ["a"]}, "output_qk.heads[0]", "expected an integer"),
    ({"heads": [0]}, "output_qk.layers", "is required"),
    ({"layers": [0], "head": [0]}, "output_qk.head", "unknown field"),
    ({"layers": [9]}, "output_qk.layers[0]", "out of range"),
])
def test_output_qk_heads_refused_by_field(raw, field, problem):
    with pytest.raises(LensRequestError, match=problem) as info:
        parse_extra_args({"output_qk": raw}, lambda: QK_FACTS)
    assert info.value.field == field


def test_output_qk_heads_refused_with_a_capture_sink(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_LENS_SINKS", json.dumps({"local": {"root": str(tmp_path)}}))
    with pytest.raises(LensRequestError, match="writes every head") as info:
        parse_extra_args({"output_qk": {"layers": [0], "heads": [1]},
                          "capture_sink": {"sink": "local", "dataset": "d", "key": "k"}},
                         lambda: QK_FACTS)
    assert info.value.field == "output_qk.heads"
