"""Replacing the stream (activation patching, embedding injection) and steering one phase
(prefill or decode) equal transformers with hooks that do the same, and decode-only steering
shares the prompt's prefix-cache blocks, never its generated ones."""

import pytest
import torch
from vllm import SamplingParams

from tests.integration.test_steering import SMOL_PROMPT, _direction, _prompt_ids, _tokens
from vllm_lens import SteeringVector


def _replacing(rows: dict[int, torch.Tensor]):
    """A transformers edit writing ``rows[p]`` over position ``p`` of a stream point."""
    def edit(value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        for p, vector in rows.items():
            if p < value.shape[0]:
                value[p] = vector.to(value.dtype)
        return value
    return edit


def _adding(vector: torch.Tensor, keep):
    """A transformers edit adding ``vector`` at the positions ``keep(p)`` accepts."""
    def edit(value: torch.Tensor) -> torch.Tensor:
        mask = torch.tensor([keep(p) for p in range(value.shape[0])])[:, None]
        return value + mask * vector.to(value.dtype)
    return edit


def test_replace_at_positions_matches_transformers_and_shows_in_the_capture(smol_llm, smol_ref):
    ids = _prompt_ids(smol_llm, SMOL_PROMPT)
    n = len(ids)
    # A clean run's rows at other positions, patched in: the stream at (layer 6, resid_post)
    # becomes exactly those rows at positions 2, n-1 (last prompt) and n+1 (generated).
    clean = smol_ref.points(ids)
    positions = [2, n - 1, n + 1]
    rows = torch.stack([clean[("resid_post", 6)][p] for p in (5, 1, 3)])
    sv = SteeringVector(activations=rows[None], layer_indices=[6], position_indices=positions,
                        mode="replace")
    out = _tokens(smol_llm, SMOL_PROMPT, [sv], output_residual_stream=[6])
    expected = smol_ref.point_greedy(ids, 12, {("resid_post", 6): _replacing(
        dict(zip(positions, rows)))})
    assert list(out.outputs[0].token_ids) == expected
    assert expected != list(_tokens(smol_llm, SMOL_PROMPT, None).outputs[0].token_ids)
    captured = out.activations["residual_stream"][0]  # [positions, hidden] at layer 6
    for p, row in zip(positions, rows):
        torch.testing.assert_close(captured[p], row, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("point", ["attn_out", "mlp_out", "resid_mid", "resid_pre"])
def test_replace_at_every_writable_point_matches_transformers(smol_llm, smol_ref, point):
    ids = _prompt_ids(smol_llm, SMOL_PROMPT)
    vector = _direction(576, 11, 30.0)
    sv = SteeringVector(activations=vector[None], layer_indices=[9], hook_point=point,
                        mode="replace", phase="decode")
    out = _tokens(smol_llm, SMOL_PROMPT, [sv])
    n = len(ids)
    expected = smol_ref.point_greedy(ids, 12, {(point, 9): _replacing(
        {p: vector for p in range(n, n + 12)})})
    assert list(out.outputs[0].token_ids) == expected


def test_embedding_injection_matches_transformers(smol_llm, smol_ref):
    """``layer_indices=[-1]`` writes the token embeddings: position 3 gets another token's
    embedding, as an activation oracle injects an activation as a token's input."""
    ids = _prompt_ids(smol_llm, SMOL_PROMPT)
    embedding = smol_ref.model.get_input_embeddings().weight[ids[1]].detach().float() * 3
    edits = {("resid_pre", 0): _replacing({3: embedding})}
    expected_stream = smol_ref.points(ids, edits)[("resid_post", 0)]
    plain = _tokens(smol_llm, SMOL_PROMPT, None, output_residual_stream=[0])
    for form in ({"layer_indices": [-1]}, {"layer_indices": [-1], "hook_point": "embed"}):
        sv = SteeringVector(activations=embedding[None, None], position_indices=[3],
                            mode="replace", **form)
        out = _tokens(smol_llm, SMOL_PROMPT, [sv], output_residual_stream=[0])
        assert list(out.outputs[0].token_ids) == smol_ref.point_greedy(ids, 12, edits)
        stream = out.activations["residual_stream"][0, : len(ids)]
        torch.testing.assert_close(stream, expected_stream, rtol=1e-4, atol=1e-4)
        changed = (stream - plain.activations["residual_stream"][0, : len(ids)]).norm(dim=-1)
        assert changed[3] > 1 and changed[:3].max() == 0  # position 3 alone, from layer 0 on


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_one_phase_steering_matches_transformers(smol_llm, smol_ref, phase):
    ids = _prompt_ids(smol_llm, SMOL_PROMPT)
    n = len(ids)
    vector = _direction(576, 12, 40.0)
    sv = SteeringVector(activations=vector[None], layer_indices=[10], phase=phase)
    out = _tokens(smol_llm, SMOL_PROMPT, [sv])
    keep = (lambda p: p < n) if phase == "prefill" else (lambda p: p >= n)
    expected = smol_ref.point_greedy(ids, 12, {("resid_post", 10): _adding(vector, keep)})
    assert list(out.outputs[0].token_ids) == expected
    everywhere = _tokens(smol_llm, SMOL_PROMPT, [SteeringVector(activations=vector[None],
                                                                layer_indices=[10])])
    assert expected != list(everywhere.outputs[0].token_ids)  # the phase matters


def test_replace_then_add_at_one_site(smol_llm, smol_ref):
    """At one site replacements are written first, then additions (in any list order)."""
    ids = _prompt_ids(smol_llm, SMOL_PROMPT)
    patch, push = _direction(576, 13, 25.0), _direction(576, 14, 20.0)
    vectors = [SteeringVector(activations=push[None], layer_indices=[7]),
               SteeringVector(activations=patch[None, None], layer_indices=[7],
                              position_indices=[4], mode="replace")]
    out = _tokens(smol_llm, SMOL_PROMPT, vectors)

    def edit(value):
        return _adding(push, lambda p: True)(_replacing({4: patch})(value))
    assert list(out.outputs[0].token_ids) == smol_ref.point_greedy(
        ids, 12, {("resid_post", 7): edit})


def test_decode_only_steering_shares_prompt_blocks_but_not_generated_ones(tiny_llm):
    cache = tiny_llm.llm_engine.vllm_config.cache_config
    block = cache.block_size
    words = " ".join(f"w{i}" for i in range(400))
    prompt_ids = _prompt_ids(tiny_llm, words)[: 2 * block]  # exactly two full blocks
    decode = [SteeringVector(activations=_direction(128, 31, 6.0)[None], layer_indices=[0],
                             phase="decode")]
    prefill = [SteeringVector(activations=_direction(128, 31, 6.0)[None], layer_indices=[0],
                              phase="prefill")]

    def run(ids, vectors, max_tokens):
        extra = {"apply_steering_vectors": vectors} if vectors else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            extra_args=extra)
        return tiny_llm.generate([{"prompt_token_ids": ids}], sp)[0]

    def cold(ids, vectors, max_tokens):
        tiny_llm.reset_prefix_cache()
        return list(run(ids, vectors, max_tokens).outputs[0].token_ids)

    steered_cold = cold(prompt_ids, decode, block + 8)  # fills a third block with its tokens
    # Prompt blocks computed by an unsteered request are reused by decode-only steering.
    tiny_llm.reset_prefix_cache()
    run(prompt_ids, None, 1)
    warm = run(prompt_ids, decode, block + 8)
    assert warm.num_cached_tokens > 0
    assert list(warm.outputs[0].token_ids) == steered_cold
    # A prompt that repeats the steered text (a chat's next turn) reuses the prompt's blocks,
    # never the block of generated (steered) tokens.
    follow_up = prompt_ids + steered_cold[: block + 4]  # three full blocks and a bit
    plain_cold = cold(follow_up, None, 4)
    tiny_llm.reset_prefix_cache()
    run(prompt_ids, decode, block + 8)
    plain_after = run(follow_up, None, 4)
    assert plain_after.num_cached_tokens == 2 * block
    assert list(plain_after.outputs[0].token_ids) == plain_cold
    # Steering that touches the prompt shares nothing with unsteered requests.
    tiny_llm.reset_prefix_cache()
    run(prompt_ids, None, 1)
    assert run(prompt_ids, prefill, 2).num_cached_tokens == 0
    # Prefill-only steering: a later request steered the same way whose prompt repeats the
    # output steers those tokens as prompt, so it reuses the prompt's blocks, never theirs.
    tiny_llm.reset_prefix_cache()
    first = run(prompt_ids, prefill, block + 8)
    follow = prompt_ids + list(first.outputs[0].token_ids)[: block + 4]
    assert run(follow, prefill, 2).num_cached_tokens == 2 * block


@pytest.mark.parametrize(("read", "phase"), [(("resid_post", 5), "all"),
                                             (("resid_mid", 10), "decode")])
def test_conditional_steering_matches_transformers_and_returns_its_gates(
        smol_llm, smol_ref, read, phase):
    """scale * sigmoid(s * (h · probe - t)) per token, ``h`` read earlier in the same pass;
    the same two hooks in transformers give the same tokens and the same gates."""
    ids = _prompt_ids(smol_llm, SMOL_PROMPT)
    n = len(ids)
    point, layer = read
    probe = _direction(576, 15, 1.0)
    projections = smol_ref.points(ids)[(point, layer)] @ probe
    threshold = float(projections.median())  # fires on about half the prompt
    sharpness = 4.0 / float(projections.std())
    vector, scale = _direction(576, 16, 1.0), 60.0
    sv = SteeringVector(activations=vector[None], layer_indices=[10], scale=scale, phase=phase,
                        condition={"probe": probe, "layer": layer, "point": point,
                                   "threshold": threshold, "sharpness": sharpness})
    out = _tokens(smol_llm, SMOL_PROMPT, [sv])

    gates: dict[int, float] = {}

    def gate(value):
        g = torch.sigmoid(sharpness * (value @ probe - threshold))
        gates.update({p: float(g[p]) for p in range(value.shape[0])})
        return value

    def steer(value):
        g = torch.tensor([gates[p] for p in range(value.shape[0])])[:, None]
        keep = torch.tensor([phase == "all" or p >= n for p in range(value.shape[0])])[:, None]
        return value + keep * scale * g * vector

    edits = {(point, layer): gate, ("resid_post", 10): steer}
    if (point, layer) == ("resid_mid", 10):  # both at layer 10: chain them in one edit
        edits = {("resid_mid", 10): gate, ("resid_post", 10): steer}
    expected = smol_ref.point_greedy(ids, 12, edits)
    assert list(out.outputs[0].token_ids) == expected
    got = out.steering_gates[0]
    first = 0 if phase == "all" else n
    assert got["positions"].tolist() == list(range(first, n + 11))
    reference = torch.tensor([gates[p] for p in range(first, n + 11)])
    torch.testing.assert_close(got["gates"], reference, rtol=1e-3, atol=1e-4)
    assert got["gates"].min() < 0.2 and got["gates"].max() > 0.8  # it fired, and not always


def test_conditional_steering_over_http_equals_offline(smol_server, smol_llm):
    """The client sends the vector as JSON; the gates come back on the choice."""
    from vllm_lens.client import LensClient

    sv = SteeringVector(activations=_direction(576, 17, 1.0)[None], layer_indices=[10],
                        scale=60.0, condition={"probe": _direction(576, 18, 1.0), "layer": 5,
                                               "threshold": 0.0, "sharpness": 0.5})
    offline = _tokens(smol_llm, SMOL_PROMPT, [sv])
    with LensClient(smol_server.base_url) as client:
        online = client.generate(list(offline.prompt_token_ids), max_tokens=12,
                                 ignore_eos=True, steering_vectors=[sv])
    assert online.token_ids == list(offline.outputs[0].token_ids)
    got, expected = online.steering_gates["0"], offline.steering_gates[0]
    assert got["positions"].tolist() == expected["positions"].tolist()
    torch.testing.assert_close(got["gates"], expected["gates"], rtol=1e-4, atol=1e-5)


def test_gated_prompt_steering_with_several_samples_is_refused(tiny_llm):
    from vllm_lens import LensRequestError

    sv = SteeringVector(activations=torch.ones(1, 128), layer_indices=[2],
                        condition={"probe": torch.ones(128), "layer": 1})
    sp = SamplingParams(max_tokens=2, n=2, extra_args={"apply_steering_vectors": [sv]})
    with pytest.raises(LensRequestError, match="n=2") as info:
        tiny_llm.generate(["Hello"], sp)
    assert info.value.field == "apply_steering_vectors"
    decode_only = SteeringVector(activations=torch.ones(1, 128), layer_indices=[2],
                                 phase="decode", condition={"probe": torch.ones(128), "layer": 1})
    out = tiny_llm.generate(["Hello"], SamplingParams(
        max_tokens=3, n=2, temperature=1.0, seed=1,
        extra_args={"apply_steering_vectors": [decode_only]}))[0]
    assert [len(c.steering_gates[0]["gates"]) for c in out.outputs] == [2, 2]
