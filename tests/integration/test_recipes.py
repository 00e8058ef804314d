"""The recipes (``vllm_lens.recipes``) on a real engine (the tiny Llama, chunked prefill)
against transformers: a contrastive steering vector is the difference of the two prompt
sets' mean rows at the chosen layers and positions (normalised on request) and steers as
any vector does; ``run_with_cache`` returns transformers' rows under TransformerLens' hook
names."""

from __future__ import annotations

import pytest
import torch

from vllm_lens import LensRequestError, SteeringVector
from vllm_lens.recipes import contrastive_vector, run_with_cache

POSITIVE = ["I love this sunny day.", "What a wonderful, joyful surprise!"]
NEGATIVE = ["I hate this rainy day.", "What a terrible, painful mistake!",
            "Everything went wrong today."]


def _ids(llm, prompt):
    return llm.get_tokenizer()(prompt)["input_ids"]


def _mean(llm, ref, prompts, layers, last_only):
    rows = []
    for prompt in prompts:
        points = ref.points(_ids(llm, prompt))
        per_layer = [points[("resid_post", layer)] for layer in layers]
        rows.append(torch.stack([r[-1] if last_only else r.mean(0) for r in per_layer]))
    return torch.stack(rows).mean(0)


def test_contrastive_vector_is_the_difference_of_means(tiny_llm, tiny_ref):
    sv = contrastive_vector(tiny_llm, POSITIVE, NEGATIVE, layers=[2, 1], scale=2.0)
    assert isinstance(sv, SteeringVector)
    assert sv.layer_indices == [1, 2] and sv.hook_point == "resid_post" and sv.scale == 2.0
    want = _mean(tiny_llm, tiny_ref, POSITIVE, [1, 2], True) - _mean(
        tiny_llm, tiny_ref, NEGATIVE, [1, 2], True)
    torch.testing.assert_close(sv.activations, want, rtol=1e-4, atol=1e-5)
    every = contrastive_vector(tiny_llm, POSITIVE, NEGATIVE, layers=[3], positions="prompt",
                               normalize=True)
    want = _mean(tiny_llm, tiny_ref, POSITIVE, [3], False) - _mean(
        tiny_llm, tiny_ref, NEGATIVE, [3], False)
    torch.testing.assert_close(every.activations, want / want.norm(dim=-1, keepdim=True),
                               rtol=1e-4, atol=1e-5)
    # It steers as any vector does: the same tokens as transformers with the same addition.
    from vllm import SamplingParams

    prompt = "Tell me about your day."
    out = tiny_llm.generate([prompt], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True,
        extra_args={"apply_steering_vectors": [sv]}))[0]
    assert out.lens_error is None
    assert list(out.outputs[0].token_ids) == tiny_ref.steered_greedy(
        _ids(tiny_llm, prompt), 6, [sv])
    with pytest.raises(ValueError, match="at least one prompt"):
        contrastive_vector(tiny_llm, [], NEGATIVE, layers=[1])
    with pytest.raises(LensRequestError) as bad:
        contrastive_vector(tiny_llm, POSITIVE, NEGATIVE, layers=[7])
    assert bad.value.field.startswith("output_activations")


def test_run_with_cache_names_transformers_rows_as_transformer_lens_does(tiny_llm, tiny_ref):
    prompts = ["The capital of France is", "Once upon a time"]
    caches = run_with_cache(tiny_llm, prompts, {"resid_post": True, "hook_z": [1],
                                                "mlp_out": [0, 3]})
    assert len(caches) == 2
    for prompt, cache in zip(prompts, caches):
        ids = _ids(tiny_llm, prompt)
        assert cache["prompt_token_ids"] == ids
        assert cache["positions"].tolist() == list(range(len(ids)))
        points = tiny_ref.points(ids)
        for layer in range(4):
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_post"],
                                       points[("resid_post", layer)], rtol=1e-4, atol=1e-4)
        for layer in (0, 3):
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_mlp_out"],
                                       points[("mlp_out", layer)], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache["blocks.1.attn.hook_z"], points[("attn_z", 1)],
                                   rtol=1e-4, atol=1e-4)
        assert "blocks.1.hook_mlp_out" not in cache
    with pytest.raises(ValueError, match="names layer 2"):
        run_with_cache(tiny_llm, prompts, {"blocks.2.hook_resid_post": True})
