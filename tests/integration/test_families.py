"""Llama-style families beyond Llama (Qwen2 with q/k/v biases, Qwen3 with q/k norms, Mistral),
each a tiny random model, against transformers: the residual stream at every layer, every tap
point, Q/K attention patterns, 2D and 3D steering, and plain requests token-identical to vLLM
without the plugin. One eager engine per family, prefill in chunks of 16 tokens."""

import pytest
import torch
from vllm import SamplingParams

from tests.families import FAMILIES, tiny_family_dir
from tests.integration.engines import generate_without_plugin, running_llm
from tests.integration.reference import HFReference, _steering_delta, max_relative_error
from vllm_lens import SteeringVector
from vllm_lens.attention import attention_patterns

PROMPT = ("Once upon a time in a quiet village by the sea, an old fisherman mended his nets "
          "and told the children stories about the storms he had seen.")
POINTS = ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "mlp_post", "attn_z"]
#: MoE layers have no single MLP activation; they have a router.
MOE = {"mixtral", "qwen2_moe"}


#: Parallel blocks (attention and MLP both read resid_pre) have no resid_mid.
PARALLEL = {"gpt_neox"}


def points_of(family: str) -> list[str]:
    if family in MOE:
        return [p for p in POINTS if p != "mlp_post"] + ["router_logits"]
    if family in PARALLEL:
        return [p for p in POINTS if p != "resid_mid"]
    return POINTS
CHUNKED = dict(enforce_eager=True, max_num_batched_tokens=16, max_num_seqs=8)
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    path = tiny_family_dir(request.param)
    with running_llm(path, **CHUNKED) as llm:
        yield request.param, path, llm, HFReference(path)


def _ids(out):
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def test_every_layer_every_point_and_attention_match_transformers(family):
    name, _, llm, ref = family
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "output_residual_stream": True,
        "output_activations": {p: [1, 3] for p in points_of(name)},
        "output_qk": [0, 3]})
    out = llm.generate([PROMPT], sp)[0]
    assert out.lens_error is None
    ids = _ids(out)
    n_rows = len(ids) - 1
    expected = ref.points(ids[:n_rows], attentions=True)
    acts = out.activations
    for layer in range(4):
        assert max_relative_error(acts["residual_stream"][layer],
                                  expected[("resid_post", layer)]) <= TOL, (name, layer)
    for point in points_of(name):
        for i, layer in enumerate((1, 3)):
            err = max_relative_error(acts[point][i].flatten(1),
                                     expected[(point, layer)].flatten(1))
            assert err <= TOL, (name, point, layer, err)
    for layer in (0, 3):
        pattern = attention_patterns(acts, layer)
        assert (pattern - expected[("attn", layer)]).abs().max() < 1e-5, (name, layer)


def test_2d_and_3d_steering_match_transformers(family):
    name, _, llm, ref = family
    n_prompt = len(llm.get_tokenizer()(PROMPT)["input_ids"])
    g = torch.Generator().manual_seed(3)
    flat = SteeringVector(activations=torch.randn(1, 128, generator=g), layer_indices=[1],
                          scale=2.0, hook_point="attn_out")
    placed = SteeringVector(activations=torch.randn(1, 3, 128, generator=g) * 3,
                            layer_indices=[2], position_indices=[2, 20, n_prompt + 1])
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": [flat, placed], "output_residual_stream": [3]})
    out = llm.generate([PROMPT], sp)[0]
    edits = {("attn_out", 1): lambda h: h + _steering_delta(flat, 0, h),
             ("resid_post", 2): lambda h: h + _steering_delta(placed, 0, h)}
    assert list(out.outputs[0].token_ids) == ref.point_greedy(
        list(out.prompt_token_ids), 6, edits), name
    expected = ref.points(_ids(out)[:-1], edits)
    assert max_relative_error(out.activations["residual_stream"][0],
                              expected[("resid_post", 3)]) <= TOL, name


def test_plain_requests_are_token_identical_to_vllm_without_plugin(family):
    name, path, llm, _ = family
    prompts = [PROMPT, "The capital of France is", "1, 2, 3, 4,"]
    sps = [SamplingParams(max_tokens=8, temperature=0,
                          extra_args={"output_activations": {"attn_out": [2]}} if i == 1
                          else None) for i in range(len(prompts))]
    with_plugin = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sps)]
    assert with_plugin == generate_without_plugin(path, prompts, 8, **CHUNKED), name
