"""Captured residual streams equal transformers' decoder-layer outputs (SmolLM2, compiled)."""

import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import IDLE, held
from tests.integration.reference import max_relative_error
from vllm_lens.common.messages import StatsAnswer, read

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the ocean, the moon and a small boat drifting at night:",
    "1, 2, 3, 4,",
]
LAYERS = [0, 7, 18, 29]  # first, middle, last decoder layer
TOL = 1e-4


def _sequence(out):
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def test_prompt_and_generated_rows_match_transformers(smol_llm, smol_ref):
    sp = SamplingParams(max_tokens=8, temperature=0, extra_args={"output_residual_stream": LAYERS})
    outs = smol_llm.generate(PROMPTS, sp)
    for out in outs:
        ids = _sequence(out)
        acts = out.activations["residual_stream"]
        n_rows = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        assert acts.shape == (len(LAYERS), n_rows, 576)
        assert acts.dtype == torch.float32 and acts.device.type == "cpu"
        assert out.activations["positions"].tolist() == list(range(n_rows))
        ref = smol_ref.residual_stream(ids[:n_rows], LAYERS)
        err = max_relative_error(acts, ref)
        print(f"max relative error vs transformers: {err:.2e}")
        assert err <= TOL


def test_greedy_tokens_match_transformers(smol_llm, smol_ref):
    sp = SamplingParams(max_tokens=10, temperature=0, extra_args={"output_residual_stream": [3]})
    out = smol_llm.generate([PROMPTS[0]], sp)[0]
    assert list(out.outputs[0].token_ids) == smol_ref.greedy(list(out.prompt_token_ids), 10)


def test_layer_semantics_match_hidden_states(smol_llm, smol_ref):
    """Row [i] is transformers' hidden_states[layer + 1] (last layer: before the final norm)."""
    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_residual_stream": True})
    out = smol_llm.generate([PROMPTS[1]], sp)[0]
    acts = out.activations["residual_stream"]
    assert acts.shape[0] == 30
    hs = smol_ref.hidden_states(list(out.prompt_token_ids))
    for layer in (0, 12, 28):
        assert max_relative_error(acts[layer], hs[layer + 1]) <= TOL
    with torch.no_grad():
        after_norm = smol_ref.model.model.norm(acts[29])
    assert max_relative_error(after_norm, hs[30]) <= TOL


def test_chat_captures_the_templated_prompt(smol_llm, smol_ref):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(max_tokens=8, temperature=0, extra_args={"output_residual_stream": [5, 29]})
    out = smol_llm.chat(messages, sp)[0]
    assert "Paris" in out.outputs[0].text
    ids = _sequence(out)
    acts = out.activations["residual_stream"]
    assert acts.shape[1] == len(ids) - 1
    assert max_relative_error(acts, smol_ref.residual_stream(ids[:-1], [5, 29])) <= TOL


def test_sampling_params_are_not_mutated_and_reuse_is_stable(smol_llm):
    extra = {"output_residual_stream": [2], "unrelated": "kept"}
    sp = SamplingParams(max_tokens=4, temperature=0, extra_args=extra)
    first = smol_llm.generate([PROMPTS[0]], sp)[0]
    assert sp.extra_args == {"output_residual_stream": [2], "unrelated": "kept"}
    assert sp.skip_reading_prefix_cache is not True or sp.prompt_logprobs is not None
    second = smol_llm.generate([PROMPTS[0]], sp)[0]
    assert torch.equal(first.activations["residual_stream"], second.activations["residual_stream"])


def test_selectors_and_reductions_are_views_of_the_full_capture(smol_llm):
    prompt = PROMPTS[1]
    full_sp = SamplingParams(max_tokens=6, temperature=0,
                             extra_args={"output_residual_stream": [4, 9]})
    full = smol_llm.generate([prompt], full_sp)[0]
    stream = full.activations["residual_stream"]
    n_prompt = len(full.prompt_token_ids)
    cases = {
        "prompt": ({"positions": "prompt"}, stream[:, :n_prompt]),
        "generated": ({"positions": "generated"}, stream[:, n_prompt:]),
        "last_prompt": ({"positions": "last_prompt"}, stream[:, n_prompt - 1 : n_prompt]),
        "list": ({"positions": [n_prompt + 2, 1, 0, 1000]}, stream[:, [0, 1, n_prompt + 2]]),
        "mean": ({"reduce": "mean"}, stream.mean(dim=1)),
        "last": ({"positions": "prompt", "reduce": "last"}, stream[:, n_prompt - 1]),
        "prompt[1:]": ({"positions": "prompt[1:]"}, stream[:, 1:n_prompt]),
        "generated[-2:]": ({"positions": "generated[-2:]"}, stream[:, -2:]),
        "all[-1]": ({"positions": "all[-1]"}, stream[:, -1:]),
        "prompt[1:] mean": ({"positions": "prompt[1:]", "reduce": "mean"},
                            stream[:, 1:n_prompt].mean(dim=1)),
        "empty mean": ({"positions": [1000], "reduce": "mean"},
                       torch.full_like(stream[:, 0], float("nan"))),
    }
    sps = [
        SamplingParams(max_tokens=6, temperature=0,
                       extra_args={"output_residual_stream": {"layers": [4, 9], **spec}})
        for spec, _ in cases.values()
    ]
    outs = smol_llm.generate([prompt] * len(sps), sps)
    for (name, (_, expected)), out in zip(cases.items(), outs):
        assert out.outputs[0].token_ids == full.outputs[0].token_ids, name
        torch.testing.assert_close(out.activations["residual_stream"], expected,
                                   rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
    n_seen = stream.shape[1]
    positions = {name: out.activations["positions"].tolist() for name, out in zip(cases, outs)}
    assert positions["prompt[1:]"] == list(range(1, n_prompt))
    assert positions["generated[-2:]"] == [n_seen - 2, n_seen - 1]
    assert positions["all[-1]"] == [n_seen - 1] and positions["empty mean"] == []
    assert positions["last"] == [n_prompt - 1]


def test_list_of_sampling_params_each_gets_its_layers(smol_llm):
    sps = [
        SamplingParams(max_tokens=3, temperature=0, extra_args={"output_residual_stream": [1]}),
        SamplingParams(max_tokens=3, temperature=0,
                       extra_args={"output_residual_stream": [0, 2, 29]}),
    ]
    outs = smol_llm.generate(PROMPTS[:2], sps)
    assert outs[0].activations["residual_stream"].shape[0] == 1
    assert outs[1].activations["residual_stream"].shape[0] == 3


@pytest.mark.parametrize("n_requests", [24])
def test_buffers_are_freed_after_many_requests(smol_llm, n_requests):
    sp = SamplingParams(max_tokens=4, temperature=0, extra_args={"output_residual_stream": True})
    for _ in range(3):
        smol_llm.generate(PROMPTS * (n_requests // 3 // len(PROMPTS) + 1), sp)
        stats = smol_llm.collective_rpc("lens_stats")
        assert held(stats) == [IDLE]
    # The prompts' steps (every layer, over 1 MiB each) took their staging tensors from the
    # worker's pool, which keeps them (within VLLM_LENS_STAGING_POOL_BYTES) for later steps.
    assert 0 < read(StatsAnswer, stats[0]).staging_bytes <= 512 << 20


@pytest.mark.slow
def test_plain_requests_in_compiled_mode_match_vllm_without_plugin(smol_llm, smollm2_path):
    """The traced graph with taps must not change plain requests (default compiled mode)."""
    from tests.integration.engines import generate_without_plugin

    sps = [SamplingParams(max_tokens=16, temperature=0,
                          extra_args={"output_residual_stream": [4]} if i == 1 else None)
           for i in range(len(PROMPTS))]
    with_plugin = [list(o.outputs[0].token_ids) for o in smol_llm.generate(PROMPTS, sps)]
    assert generate_without_plugin(smollm2_path, PROMPTS, 16) == with_plugin
