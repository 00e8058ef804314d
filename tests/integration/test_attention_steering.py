"""Attention steering (``steer_attention``) equals transformers with eager attention doing the
same edit (``HFReference.attention_edits``): PASTA's emphasis and biases on key positions, on
the tiny Llama (grouped-query attention, prompts prefilled in chunks of 16, eager) and on
SmolLM2 over HTTP (compiled, the OpenAI SDK); plain requests beside a steered one are
untouched; bad edits are refused naming the field."""

import httpx
import openai
import pytest
from vllm import SamplingParams

from tests.integration.reference import max_relative_error
from tests.integration.test_steering import SMOL_PROMPT, TINY_PROMPT, _prompt_ids
from vllm_lens.errors import LensRequestError


def _generate(llm, prompts, extra_args_list, max_tokens=12):
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                             extra_args=extra) for extra in extra_args_list]
    return llm.generate(prompts, params)


def test_pasta_across_prefill_chunks_matches_transformers(tiny_llm, tiny_ref):
    """The span lies in the first two chunks, one head of two (they share one key head),
    two layers; the stream every layer leaves equals transformers' under the same edit."""
    ids = _prompt_ids(tiny_llm, TINY_PROMPT)
    assert len(ids) > 32
    edits = [{"layers": [1, 2], "heads": [1], "emphasize": [6, 20], "alpha": 0.01}]
    out = _generate(tiny_llm, [TINY_PROMPT], [{"steer_attention": edits,
                                                "output_residual_stream": [0, 1, 2, 3]}])[0]
    expected = tiny_ref.attention_greedy(ids, 12, edits)
    assert list(out.outputs[0].token_ids) == expected
    plain = _generate(tiny_llm, [TINY_PROMPT], [None])[0]
    assert expected != list(plain.outputs[0].token_ids)  # the edit changes what it writes
    all_ids = ids + expected[:-1]
    with tiny_ref.attention_edits(edits):
        reference = tiny_ref.residual_stream(all_ids, [0, 1, 2, 3])
    stream = out.activations["residual_stream"]
    assert stream.shape[1] == len(all_ids)
    assert max_relative_error(stream[0], reference[0]) < 1e-6  # layer 0 is not steered
    assert max_relative_error(stream[1:], reference[1:]) < 1e-4


def test_biases_and_knocked_out_edges_beside_plain_requests(tiny_llm, tiny_ref):
    """A ``-inf`` bias knocks out every head's edge to the first token at layer 0 (its own
    query then attends to nothing), a finite bias raises two keys at layer 2, and a plain
    request and a differently steered one in the same batch keep their own tokens."""
    ids = _prompt_ids(tiny_llm, TINY_PROMPT)
    knock = [{"layers": [0], "heads": None, "key_positions": [0], "bias": "-inf"},
             {"layers": [2], "heads": [0], "key_positions": [3, 40], "bias": 4.0}]
    pasta = [{"layers": [0, 1, 2, 3], "heads": None, "emphasize": [0, 5], "alpha": 0.2}]
    other = "A different prompt, plain, in the same batch as the steered ones."
    outs = _generate(tiny_llm, [TINY_PROMPT, other, TINY_PROMPT],
                     [{"steer_attention": knock}, None,
                      {"steer_attention": '[{"layers": "all", "heads": null, '
                                          '"emphasize": [0, 5], "alpha": 0.2}]'}])
    assert list(outs[0].outputs[0].token_ids) == tiny_ref.attention_greedy(ids, 12, knock)
    assert list(outs[2].outputs[0].token_ids) == tiny_ref.attention_greedy(ids, 12, pasta)
    alone = _generate(tiny_llm, [other], [None])[0]
    assert list(outs[1].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids


def test_a_history_above_the_budget_is_refused_before_it_runs(tiny_llm, monkeypatch):
    """The front end's bound (layers x positions x key heads x head size x 2 x 4 bytes) above
    ``VLLM_LENS_ATTENTION_STEER_MAX_BYTES``: refused naming the key and the setting."""
    monkeypatch.setenv("VLLM_LENS_ATTENTION_STEER_MAX_BYTES", "4096")
    edits = [{"layers": [0, 1], "heads": None, "emphasize": [0, 2], "alpha": 0.5}]
    with pytest.raises(LensRequestError, match="VLLM_LENS_ATTENTION_STEER_MAX_BYTES") as err:
        _generate(tiny_llm, [TINY_PROMPT], [{"steer_attention": edits}])
    assert err.value.field == "steer_attention"


@pytest.mark.parametrize("edit, field", [
    ({"layers": [0], "heads": [0]}, "steer_attention[0]"),
    ({"layers": [0], "heads": [0], "emphasize": [0, 4], "alpha": 0.1, "key_positions": [1],
      "bias": 1.0}, "steer_attention[0]"),
    ({"layers": [9], "heads": [0], "emphasize": [0, 4], "alpha": 0.1},
     "steer_attention[0].layers[0]"),
    ({"layers": [0], "heads": [2], "emphasize": [0, 4], "alpha": 0.1},
     "steer_attention[0].heads[0]"),
    ({"layers": [0], "heads": None, "emphasize": [4, 4], "alpha": 0.1},
     "steer_attention[0].emphasize"),
    ({"layers": [0], "heads": None, "emphasize": [0, 4], "alpha": -1},
     "steer_attention[0].alpha"),
    ({"layers": [0], "heads": None, "emphasize": [0, 4]}, "steer_attention[0].alpha"),
    ({"layers": [0], "heads": None, "key_positions": [1], "bias": "inf"},
     "steer_attention[0].bias"),
    ({"layers": [0], "heads": None, "key_positions": [-1], "bias": 1.0},
     "steer_attention[0].key_positions[0]"),
    ({"layers": [0], "heads": None, "emphasize": [0, 4], "alpha": 0.1, "scale": 2},
     "steer_attention[0].scale"),
])
def test_bad_edits_are_refused_naming_the_field(tiny_llm, edit, field):
    with pytest.raises(LensRequestError) as err:
        _generate(tiny_llm, [TINY_PROMPT], [{"steer_attention": [edit]}])
    assert err.value.field == field


def test_pasta_over_http_compiled_matches_transformers(smol_server, smol_ref):
    """SmolLM2 (9 heads sharing 3 key heads), compiled: the edits as JSON through
    ``LensClient`` and as a ``vllm_xargs`` string through the OpenAI SDK give transformers'
    tokens; a bad edit is a 400 naming the field, and the server serves on."""
    import json

    from vllm_lens.client import LensClient

    edits = [{"layers": list(range(8, 16)), "heads": None, "emphasize": [0, 3],
              "alpha": 0.05},
             {"layers": [20], "heads": [4], "key_positions": [1, 2], "bias": float("-inf")}]
    with LensClient(smol_server.base_url) as client:
        ids = client.generate(SMOL_PROMPT, max_tokens=1).prompt_token_ids
        expected = smol_ref.attention_greedy(ids, 12, edits)
        steered = client.generate(ids, max_tokens=12, ignore_eos=True, steer_attention=edits)
        plain = client.generate(ids, max_tokens=12, ignore_eos=True)
    assert steered.token_ids == expected
    assert plain.token_ids != expected
    sdk = openai.OpenAI(base_url=f"{smol_server.base_url}/v1", api_key="x")
    got = sdk.completions.create(
        model=sdk.models.list().data[0].id, prompt=ids, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "vllm_xargs": {"steer_attention": json.dumps(edits)}})
    assert got.choices[0].model_extra["token_ids"] == expected
    bad = httpx.post(f"{smol_server.base_url}/v1/completions", timeout=60, json={
        "prompt": SMOL_PROMPT, "max_tokens": 2, "vllm_xargs": {"steer_attention": json.dumps(
            [{"layers": [3], "heads": [9], "emphasize": [0, 2], "alpha": 0.1}])}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "steer_attention[0].heads[0]"
    with LensClient(smol_server.base_url) as client:
        assert client.generate(ids, max_tokens=12, ignore_eos=True).token_ids == plain.token_ids
