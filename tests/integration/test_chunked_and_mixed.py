"""Chunked prefill, mixed batches and bad input on the tiny engine (16-token prefill chunks)."""

import pytest
import torch
from vllm import SamplingParams

from tests.integration.conftest import TINY_CHUNKED
from tests.integration.engines import IDLE, held, generate_without_plugin
from tests.integration.reference import max_relative_error

# 6 to ~60 tokens: most prompts span several 16-token prefill chunks.
PROMPTS = [
    "Short prompt.",
    "A much longer prompt that will certainly need more than one chunk of sixteen tokens to be "
    "prefilled, because it keeps going with many more words than that.",
    "Medium length prompt with a handful of words in it, maybe twenty tokens.",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


def test_chunked_prefill_rows_match_transformers(tiny_llm, tiny_ref):
    sp = SamplingParams(max_tokens=6, temperature=0, extra_args={"output_residual_stream": True})
    outs = tiny_llm.generate(PROMPTS, sp)
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * TINY_CHUNKED["max_num_batched_tokens"]
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        acts = out.activations["residual_stream"]
        assert acts.shape == (4, len(ids) - 1, 128)
        assert max_relative_error(acts, tiny_ref.residual_stream(ids[:-1], [0, 1, 2, 3])) <= 1e-4


def test_prefix_cache_hits_still_return_every_prompt_row(tiny_llm, tiny_ref):
    block = tiny_llm.llm_engine.vllm_config.cache_config.block_size
    prompt = " ".join(PROMPTS * 8)  # several full KV blocks
    plain = SamplingParams(max_tokens=2, temperature=0)
    tiny_llm.generate([prompt], plain)  # fills the prefix cache
    assert tiny_llm.generate([prompt], plain)[0].num_cached_tokens >= block  # it is used
    sp = SamplingParams(max_tokens=2, temperature=0, extra_args={"output_residual_stream": [1]})
    out = tiny_llm.generate([prompt], sp)[0]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    assert len(out.prompt_token_ids) > 2 * block
    acts = out.activations["residual_stream"]
    assert acts.shape[1] == len(ids) - 1
    assert max_relative_error(acts, tiny_ref.residual_stream(ids[:-1], [1])) <= 1e-4


def test_mixed_batch_each_request_gets_only_its_rows(tiny_llm):
    layer_sets = {0: [0], 2: [1, 3]}  # prompts 1 and 3 are plain
    sps = [
        SamplingParams(max_tokens=5, temperature=0,
                       extra_args={"output_residual_stream": layer_sets[i]} if i in layer_sets
                       else None)
        for i in range(len(PROMPTS))
    ]
    mixed = tiny_llm.generate(PROMPTS, sps)
    for i, out in enumerate(mixed):
        if i not in layer_sets:
            assert getattr(out, "activations", None) is None
            continue
        alone = tiny_llm.generate([PROMPTS[i]], sps[i])[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        torch.testing.assert_close(out.activations["residual_stream"],
                                   alone.activations["residual_stream"], rtol=1e-5, atol=1e-6)


def test_plain_requests_are_token_identical_to_vllm_without_plugin(tiny_llm, tiny_path):
    sps = [
        SamplingParams(max_tokens=8, temperature=0,
                       extra_args={"output_residual_stream": [2]} if i % 2 else None)
        for i in range(len(PROMPTS))
    ]
    with_plugin = [list(o.outputs[0].token_ids) for o in tiny_llm.generate(PROMPTS, sps)]
    without = generate_without_plugin(tiny_path, PROMPTS, 8, **TINY_CHUNKED)
    assert with_plugin == without


BAD_INPUTS = [
    ({"output_residual_stream": [4]}, "output_residual_stream[0]"),
    ({"output_residual_stream": [-2]}, "output_residual_stream[0]"),
    ({"output_residual_stream": []}, "output_residual_stream"),
    ({"output_residual_stream": [0.5]}, "output_residual_stream[0]"),
    ({"output_residual_stream": "layers"}, "output_residual_stream"),
    ({"output_residual_stream": {"layers": [0], "positions": "everything"}},
     "output_residual_stream.positions"),
    ({"output_residual_stream": {"layers": [0], "reduce": "sum"}}, "output_residual_stream.reduce"),
    ({"output_residual_stream": {"layers": [0], "positions": [1024]}},
     "output_residual_stream.positions[0]"),
    ({"output_residual_steam": [0]}, "output_residual_steam"),
]


@pytest.mark.parametrize(("extra", "field"), BAD_INPUTS, ids=[f for _, f in BAD_INPUTS])
def test_bad_input_fails_alone_and_engine_keeps_serving(tiny_llm, extra, field):
    bad = SamplingParams(max_tokens=2, temperature=0, extra_args=extra)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tiny_llm.generate([PROMPTS[0]], bad)
    good = SamplingParams(max_tokens=2, temperature=0, extra_args={"output_residual_stream": [1]})
    out = tiny_llm.generate([PROMPTS[0]], good)[0]
    assert out.activations["residual_stream"].shape[0] == 1
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_n_greater_than_one_gives_each_completion_its_own_rows(tiny_llm):
    sp = SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=1,
                        extra_args={"output_residual_stream": [3]})
    out = tiny_llm.generate([PROMPTS[0]], sp)[0]
    n_prompt = len(out.prompt_token_ids)
    streams = [c.activations["residual_stream"] for c in out.outputs]
    for c, s in zip(out.outputs, streams):
        assert s.shape[1] == n_prompt + len(c.token_ids) - 1
    # prompt rows agree; generated rows follow each completion's own tokens
    for s in streams[1:]:
        torch.testing.assert_close(s[:, :n_prompt], streams[0][:, :n_prompt])
    distinct = {tuple(c.token_ids) for c in out.outputs}
    if len(distinct) > 1:
        assert any(not torch.equal(s, streams[0]) for s in streams[1:])
