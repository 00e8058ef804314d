"""Steering equals transformers generation with a hook adding the same vectors."""

import pytest
import torch
from vllm import SamplingParams

from tests.integration.conftest import TINY_CHUNKED
from vllm_lens import SteeringVector

SMOL_PROMPT = "Tell me about your favourite animal."
TINY_PROMPT = ("A long prompt for the tiny model, long enough to be prefilled in several chunks "
               "of sixteen tokens each, so that the steering positions cross the boundaries "
               "between chunks, which is the whole point of this particular test case.")


def _direction(hidden: int, seed: int, norm: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(hidden, generator=g)
    return v / v.norm() * norm


def _tokens(llm, prompt, vectors, max_tokens=12, **extra):
    extra_args = {"apply_steering_vectors": vectors} if vectors else {}
    extra_args.update(extra)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        extra_args=extra_args or None)
    return llm.generate([prompt], sp)[0]


def _prompt_ids(llm, prompt):
    return llm.get_tokenizer()(prompt)["input_ids"]


def smol_cases(n_prompt: int) -> dict[str, list[SteeringVector]]:
    d = _direction(576, 0, 1.0)
    return {
        "2d": [SteeringVector(activations=d[None] * 60, layer_indices=[10])],
        "3d-prompt-and-decode": [SteeringVector(
            activations=torch.stack([d * 40, -d * 40, d * 60])[None], layer_indices=[6],
            position_indices=[1, n_prompt - 1, n_prompt + 2])],
        "norm-match-two-vectors": [
            SteeringVector(activations=d[None], layer_indices=[5], norm_match=True, scale=0.4),
            SteeringVector(activations=_direction(576, 1, 1.0)[None].repeat(2, 1),
                           layer_indices=[5, 20], scale=8.0),
        ],
    }


@pytest.mark.parametrize("case", ["2d", "3d-prompt-and-decode", "norm-match-two-vectors"])
def test_steered_generation_matches_transformers(smol_llm, smol_ref, case):
    ids = _prompt_ids(smol_llm, SMOL_PROMPT)
    vectors = smol_cases(len(ids))[case]
    plain = _tokens(smol_llm, SMOL_PROMPT, None)
    steered = _tokens(smol_llm, SMOL_PROMPT, vectors)
    assert list(steered.prompt_token_ids) == ids
    expected = smol_ref.steered_greedy(ids, 12, vectors)
    assert list(steered.outputs[0].token_ids) == expected
    assert steered.outputs[0].token_ids != plain.outputs[0].token_ids  # the test has teeth


def test_scale_zero_is_exactly_unsteered(smol_llm):
    sv = SteeringVector(activations=_direction(576, 3, 50.0)[None], layer_indices=[3], scale=0.0)
    plain = _tokens(smol_llm, SMOL_PROMPT, None, output_residual_stream=[3, 29])
    zero = _tokens(smol_llm, SMOL_PROMPT, [sv], output_residual_stream=[3, 29])
    assert zero.outputs[0].token_ids == plain.outputs[0].token_ids
    assert torch.equal(zero.activations["residual_stream"], plain.activations["residual_stream"])


def test_capture_at_a_steered_layer_shows_the_steered_stream(smol_llm):
    v = _direction(576, 4, 5.0)
    sv = SteeringVector(activations=v[None], layer_indices=[8])
    plain = _tokens(smol_llm, SMOL_PROMPT, None, output_residual_stream=[8])
    steered = _tokens(smol_llm, SMOL_PROMPT, [sv], output_residual_stream=[8])
    n_prompt = len(plain.prompt_token_ids)
    diff = steered.activations["residual_stream"][0, :n_prompt] - \
        plain.activations["residual_stream"][0, :n_prompt]
    # Prompt rows at layer 8 are identical before steering, so the difference is the vector.
    torch.testing.assert_close(diff, v.expand(n_prompt, -1), rtol=1e-4, atol=1e-4)


def test_every_accepted_form_steers_the_same(smol_llm):
    sv = SteeringVector(activations=_direction(576, 5, 12.0)[None], layer_indices=[12])
    import json
    forms = [[sv], [sv.model_dump()], sv.to_wire(), [sv.to_wire()],
             json.dumps([sv.model_dump(mode="json")]),
             [SteeringVector(activations=sv.activations.to(torch.bfloat16),
                             layer_indices=[12])]]
    outs = [_tokens(smol_llm, SMOL_PROMPT, form).outputs[0].token_ids for form in forms]
    assert all(o == outs[0] for o in outs[:-1])
    assert len(outs[-1]) == len(outs[0])  # bfloat16 input is cast and applied


def tiny_vectors(n_prompt: int) -> list[SteeringVector]:
    return [
        SteeringVector(activations=_direction(128, 7, 2.0)[None].repeat(2, 1),
                       layer_indices=[0, 2]),
        SteeringVector(
            activations=torch.stack([_direction(128, s, 3.0) for s in (8, 9, 10, 11)])[None],
            layer_indices=[1], position_indices=[5, 17, 33, n_prompt + 1]),
    ]


def test_chunked_prefill_steering_matches_transformers(tiny_llm, tiny_ref):
    ids = _prompt_ids(tiny_llm, TINY_PROMPT)
    assert len(ids) > 2 * TINY_CHUNKED["max_num_batched_tokens"]
    vectors = tiny_vectors(len(ids))
    steered = _tokens(tiny_llm, TINY_PROMPT, vectors)
    assert list(steered.outputs[0].token_ids) == tiny_ref.steered_greedy(ids, 12, vectors)
    assert steered.outputs[0].token_ids != _tokens(tiny_llm, TINY_PROMPT, None).outputs[0].token_ids


def test_mixed_batch_each_request_gets_exactly_its_steering(tiny_llm):
    prompts = [TINY_PROMPT, "Second prompt here.", "Third prompt, captured.", "Fourth, plain."]
    svs = [
        [SteeringVector(activations=_direction(128, 20, 3.0)[None], layer_indices=[1])],
        [SteeringVector(activations=_direction(128, 21, 3.0)[None], layer_indices=[2])],
    ]
    extras = [
        {"apply_steering_vectors": svs[0]},
        {"apply_steering_vectors": svs[1], "output_residual_stream": [2]},
        {"output_residual_stream": [1, 3]},
        None,
    ]
    sps = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, extra_args=e)
           for e in extras]
    mixed = tiny_llm.generate(prompts, sps)
    for i, out in enumerate(mixed):
        alone = tiny_llm.generate([prompts[i]], sps[i])[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, i
        if extras[i] and "output_residual_stream" in extras[i]:
            torch.testing.assert_close(out.activations["residual_stream"],
                                       alone.activations["residual_stream"],
                                       rtol=1e-5, atol=1e-5)
    unsteered = tiny_llm.generate(prompts[3:], SamplingParams(max_tokens=10, temperature=0,
                                                              ignore_eos=True))[0]
    assert mixed[3].outputs[0].token_ids == unsteered.outputs[0].token_ids


def test_prefix_cache_never_mixes_steered_and_unsteered_blocks(tiny_llm):
    cache = tiny_llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching
    prompt = " ".join([TINY_PROMPT] * 12)  # several full KV blocks (128 tokens on CPU)
    assert len(_prompt_ids(tiny_llm, prompt)) > 2 * cache.block_size
    sv = [SteeringVector(activations=_direction(128, 30, 4.0)[None], layer_indices=[0])]

    def cold(vectors):
        tiny_llm.reset_prefix_cache()
        return _tokens(tiny_llm, prompt, vectors).outputs[0].token_ids

    plain_cold, steered_cold = cold(None), cold(sv)
    assert plain_cold != steered_cold

    tiny_llm.reset_prefix_cache()
    _tokens(tiny_llm, prompt, sv)
    after_steered = _tokens(tiny_llm, prompt, None)
    assert after_steered.outputs[0].token_ids == plain_cold
    assert _tokens(tiny_llm, prompt, None).num_cached_tokens > 0  # the cache does get used

    tiny_llm.reset_prefix_cache()
    _tokens(tiny_llm, prompt, None)
    after_plain = _tokens(tiny_llm, prompt, sv)
    assert after_plain.outputs[0].token_ids == steered_cold
    # identical steering may share its blocks
    again = _tokens(tiny_llm, prompt, sv)
    assert again.outputs[0].token_ids == steered_cold and again.num_cached_tokens > 0


BAD_STEERING = [
    ([SteeringVector(activations=torch.ones(1, 64), layer_indices=[0])],
     "apply_steering_vectors[0].activations"),
    ([SteeringVector(activations=torch.ones(2, 128), layer_indices=[0, 9])],
     "apply_steering_vectors[0].layer_indices[1]"),
    ([{"activations": torch.ones(2, 128), "layer_indices": [0]}], "apply_steering_vectors[0]"),
    ([{"activations": torch.ones(1, 2, 128), "layer_indices": [0], "position_indices": [1]}],
     "apply_steering_vectors[0]"),
    ([{"activations": torch.ones(1, 2, 128), "layer_indices": [0], "position_indices": [1, -3]}],
     "apply_steering_vectors[0]"),
    ([{"activations": torch.full((1, 128), float("nan")), "layer_indices": [0]}],
     "apply_steering_vectors[0]"),
    ([{"activations": torch.ones(1, 128, dtype=torch.int64), "layer_indices": [0]}],
     "apply_steering_vectors[0]"),
    ("definitely-not-a-wire-string", "apply_steering_vectors[0]"),
    ([{"activations": torch.ones(1, 128), "layer_indices": [0], "mode": "replace",
       "scale": 2.0}], "apply_steering_vectors[0]"),
    ([{"activations": torch.ones(2, 128), "layer_indices": [-1, 2]}],
     "apply_steering_vectors[0]"),
    ([{"activations": torch.ones(1, 128), "layer_indices": [1], "mode": "replace"},
      {"activations": torch.ones(1, 1, 128), "layer_indices": [1], "mode": "replace",
       "position_indices": [2]}], "apply_steering_vectors[1]"),
    ([{"activations": torch.ones(1, 1, 64), "layer_indices": [1], "mode": "replace",
       "position_indices": [2]}], "apply_steering_vectors[0].activations"),
    ([{"activations": torch.ones(1, 128), "layer_indices": [1],
       "condition": {"probe": torch.ones(128), "layer": 2}}],
     "apply_steering_vectors[0].condition.layer"),
]


@pytest.mark.parametrize(("value", "field"), BAD_STEERING, ids=range(len(BAD_STEERING)))
def test_bad_steering_fails_alone(tiny_llm, value, field):
    bad = SamplingParams(max_tokens=2, extra_args={"apply_steering_vectors": value})
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tiny_llm.generate(["Hello"], bad)
    good = [SteeringVector(activations=torch.ones(1, 128), layer_indices=[1])]
    assert len(_tokens(tiny_llm, "Hello", good, max_tokens=2).outputs[0].token_ids) == 2


def test_chat_steering_equals_generate_on_the_same_tokens(tiny_llm):
    from vllm.inputs import TokensPrompt

    sv = [SteeringVector(activations=_direction(128, 40, 3.0)[None], layer_indices=[2])]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                        extra_args={"apply_steering_vectors": sv})
    chat = tiny_llm.chat([{"role": "user", "content": "Hi there!"}], sp)[0]
    same = tiny_llm.generate(TokensPrompt(prompt_token_ids=list(chat.prompt_token_ids)), sp)[0]
    plain = tiny_llm.chat([{"role": "user", "content": "Hi there!"}],
                          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert chat.outputs[0].token_ids == same.outputs[0].token_ids
    assert chat.outputs[0].token_ids != plain.outputs[0].token_ids
