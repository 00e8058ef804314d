"""Every tap point inside the layer, Q/K attention patterns, and steering and hooks at a point,
against transformers (forward hooks on the HF modules), eager with tiny prefill chunks and
compiled, on prompt and generated rows, in mixed batches."""

import pytest
import torch
from vllm import SamplingParams

from tests.integration.reference import max_relative_error
from vllm_lens import Hook, LensRequestError, SteeringVector
from vllm_lens.attention import attention_patterns

STREAM_POINTS = ["resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post"]
ALL_POINTS = [*STREAM_POINTS, "mlp_post", "attn_z"]
TOL = 1e-4
TINY_PROMPT = ("Once upon a time in a quiet village by the sea, an old fisherman mended his "
               "nets and told the children stories about the storms he had seen.")


def _ids(out):
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def _check_points(acts, ref, layers, n_rows):
    for point in ALL_POINTS:
        got = acts[point]
        assert got.shape[:2] == (len(layers), n_rows), point
        assert acts[f"{point}_positions"].tolist() == list(range(n_rows))
        for i, layer in enumerate(layers):
            err = max_relative_error(got[i].flatten(1), ref[(point, layer)].flatten(1))
            assert err <= TOL, (point, layer, err)


def test_every_point_matches_transformers_with_chunked_prefill(tiny_llm, tiny_ref):
    """Eager engine, prefill in chunks of 16: every point at every layer, prompt and decode."""
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={
        "output_activations": {p: True for p in ALL_POINTS}, "output_residual_stream": True})
    out = tiny_llm.generate([TINY_PROMPT], sp)[0]
    ids = _ids(out)
    n_rows = len(ids) - 1
    assert n_rows > 2 * 16
    ref = tiny_ref.points(ids[:n_rows])
    _check_points(out.activations, ref, [0, 1, 2, 3], n_rows)
    acts = out.activations
    assert acts["attn_z"].shape[2:] == (2, 64) and acts["mlp_post"].shape[-1] == 256
    # resid_pre of layer L+1 is resid_post of layer L; resid_post is output_residual_stream.
    assert torch.equal(acts["resid_pre"][1:], acts["resid_post"][:-1])
    assert torch.equal(acts["resid_post"], acts["residual_stream"])
    torch.testing.assert_close(acts["resid_mid"], acts["resid_pre"] + acts["attn_out"])
    torch.testing.assert_close(acts["resid_post"], acts["resid_mid"] + acts["mlp_out"])


def test_two_layers_compiled_match_transformers(smol_llm, smol_ref):
    """SmolLM2 compiled (vLLM's default): every point at two layers, aliases included."""
    layers = [2, 21]
    sp = SamplingParams(max_tokens=5, temperature=0, extra_args={
        "output_activations": {"hook_resid_pre": layers, "blocks.2.hook_attn_out": True,
                               "blocks.21.hook_attn_out": True, "post_attn": layers,
                               "mlp_out": layers, "post_block": layers,
                               "mlp.hook_post": layers, "attn.hook_z": layers,
                               "blocks.2.hook_mlp_in": True,
                               "blocks.21.hook_mlp_in": True}})
    out = smol_llm.generate(["The capital of France is"], sp)[0]
    ids = _ids(out)
    ref = smol_ref.points(ids[:-1])
    _check_points(out.activations, ref, layers, len(ids) - 1)


def test_positions_and_reduce_per_point(tiny_llm):
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
        "output_activations": {"attn_out": {"layers": [1], "positions": "last_prompt"},
                               "mlp_post": {"layers": [0, 2], "positions": "generated",
                                            "reduce": "mean"}}})
    out = tiny_llm.generate([TINY_PROMPT], sp)[0]
    n_prompt = len(out.prompt_token_ids)
    acts = out.activations
    assert acts["attn_out"].shape == (1, 1, 128)
    assert acts["attn_out_positions"].tolist() == [n_prompt - 1]
    assert acts["positions"].tolist() == [n_prompt - 1]  # the first signal's
    assert acts["mlp_post"].shape == (2, 256)
    assert acts["mlp_post_positions"].tolist() == list(range(n_prompt, n_prompt + 3))


@pytest.mark.parametrize("engine", ["tiny", "smol"])
def test_attention_patterns_match_transformers_eager(engine, tiny_llm, tiny_ref, smol_llm,
                                                     smol_ref):
    llm, ref = (tiny_llm, tiny_ref) if engine == "tiny" else (smol_llm, smol_ref)
    layers = [0, 3] if engine == "tiny" else [0, 13, 29]
    prompt = TINY_PROMPT
    # Warm the prefix cache with the same prompt: Q/K requests must not read from it.
    llm.generate([prompt], SamplingParams(max_tokens=1))
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                        extra_args={"output_qk": layers})
    out = llm.generate([prompt], sp)[0]
    acts = out.activations
    ids = _ids(out)
    n_rows = len(ids) - 1
    assert acts["qk_layers"] == layers and len(acts["qk_meta"]) == len(layers)
    assert acts["attn_q"].shape[:2] == (len(layers), n_rows)
    meta = acts["qk_meta"][0]
    assert meta["scale"] == pytest.approx(meta["head_size"] ** -0.5)
    assert meta["sliding_window"] == [-1, -1] and meta["logits_soft_cap"] == 0.0
    expected = ref.points(ids[:n_rows], attentions=True)
    for layer in layers:
        pattern = attention_patterns(acts, layer)
        assert pattern.shape == (meta["num_heads"], n_rows, n_rows)
        assert (pattern - expected[("attn", layer)]).abs().max() < 1e-5, layer
    # Chosen heads only (heads of different key groups on SmolLM2: 9 query, 3 key heads).
    heads = [1] if engine == "tiny" else [7, 2]
    sp.extra_args = {"output_qk": {"layers": layers, "heads": heads}}
    chosen = llm.generate([prompt], sp)[0].activations
    assert chosen["qk_heads"] == sorted(heads)
    assert chosen["attn_q"].shape[2] == chosen["attn_k"].shape[2] == len(heads)
    assert torch.equal(chosen["attn_q"], acts["attn_q"][:, :, sorted(heads)])
    for layer in layers:
        pattern = attention_patterns(chosen, layer)
        assert (pattern - expected[("attn", layer)][sorted(heads)]).abs().max() < 1e-5, layer


def _vector(seed: int, norm: float, hidden: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(hidden, generator=g)
    return v / v.norm() * norm


def _edit(sv: SteeringVector, i: int):
    from tests.integration.reference import _steering_delta

    return lambda h: h + _steering_delta(sv, i, h)


@pytest.mark.parametrize("point", STREAM_POINTS)
@pytest.mark.parametrize("norm_match", [False, True])
def test_steering_at_a_point_matches_transformers(tiny_llm, tiny_ref, point, norm_match):
    scale, norm = (0.8, 1.0) if norm_match else (1.0, 3.0)
    sv = SteeringVector(activations=_vector(3, norm)[None], layer_indices=[1], scale=scale,
                        norm_match=norm_match, hook_point=point)
    captures = {point: [1]}
    captures["resid_post"] = [*captures.get("resid_post", []), 3]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": [sv], "output_activations": captures})
    out = tiny_llm.generate([TINY_PROMPT], sp)[0]
    ids = _ids(out)
    edits = {(point, 1): _edit(sv, 0)}
    assert list(out.outputs[0].token_ids) == tiny_ref.point_greedy(
        list(out.prompt_token_ids), 8, edits)
    ref = tiny_ref.points(ids[:-1], edits)
    for p, layer in ((point, 1), ("resid_post", 3)):
        got = out.activations[p][captures[p].index(layer)]
        assert max_relative_error(got, ref[(p, layer)]) <= TOL, (p, layer)


def test_points_steer_differently_and_mixed_batches_stay_apart(tiny_llm):
    """On the prompt's rows, steering at attn_out moves the MLP's input and steering at
    mlp_out does not (it adds to resid_post only); a plain request in the same batch is
    untouched."""
    v = _vector(5, 4.0)[None]
    def sp(point):
        extra = {"output_activations": {"mlp_post": [2], "resid_post": [2]}}
        if point is not None:
            extra["apply_steering_vectors"] = [SteeringVector(activations=v, layer_indices=[2],
                                                              hook_point=point)]
        return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=extra)

    prompts = [TINY_PROMPT] * 3
    outs = tiny_llm.generate(prompts, [sp("attn_out"), sp("mlp_out"), sp(None)])
    plain = tiny_llm.generate([TINY_PROMPT], sp(None))[0]
    attn, mlp, none = (o.activations for o in outs)
    n = len(plain.prompt_token_ids)  # later rows follow other tokens once steered
    assert not torch.allclose(attn["mlp_post"][:, :n], plain.activations["mlp_post"][:, :n])
    torch.testing.assert_close(mlp["mlp_post"][:, :n], plain.activations["mlp_post"][:, :n])
    torch.testing.assert_close(mlp["resid_post"][0, :n], plain.activations["resid_post"][0, :n]
                               + v[0].expand(n, -1))
    assert outs[2].outputs[0].token_ids == plain.outputs[0].token_ids
    torch.testing.assert_close(none["resid_post"], plain.activations["resid_post"])


def test_a_hook_at_attn_out_replaces_what_attention_adds(tiny_llm):
    def ablate(ctx, attn_out):
        ctx.saved.setdefault("norms", []).append(attn_out.norm(dim=-1))
        return torch.zeros_like(attn_out)

    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, extra_args={
        "apply_hooks": [Hook(ablate, [1], hook_point="attn_out")],
        "output_activations": {"resid_pre": [1], "attn_out": [1], "resid_mid": [1]}})
    out = tiny_llm.generate([TINY_PROMPT], sp)[0]
    acts = out.activations
    assert torch.count_nonzero(acts["attn_out"]) == 0
    torch.testing.assert_close(acts["resid_mid"], acts["resid_pre"])
    norms = torch.cat(out.hook_results["0"]["norms"])
    assert norms.numel() == acts["attn_out"].shape[1] and (norms > 0).all()


@pytest.mark.parametrize(("extra", "field", "message"), [
    ({"output_activations": {"attn_outt": [1]}}, "output_activations.attn_outt",
     "unknown tap point"),
    ({"output_activations": {"blocks.1.hook_attn_out": [1]}},
     "output_activations.blocks.1.hook_attn_out", "fixes the layer"),
    ({"output_activations": {"attn_out": [9]}}, "output_activations.attn_out[0]",
     "out of range"),
    ({"output_activations": []}, "output_activations", "non-empty object"),
    ({"output_qk": [0, 7]}, "output_qk[1]", "out of range"),
    ({"apply_steering_vectors": [SteeringVector(activations=torch.ones(1, 128),
                                                layer_indices=[1], hook_point="mlp_post")]},
     "apply_steering_vectors[0].hook_point", "cannot be written"),
    ({"apply_hooks": [Hook(lambda ctx, h: None, [1], pre=True, hook_point="mlp_out")]},
     "apply_hooks[0].pre", "pre=True means"),
])
def test_bad_points_fail_alone(tiny_llm, extra, field, message):
    with pytest.raises(LensRequestError) as info:
        tiny_llm.generate(["Hi"], SamplingParams(max_tokens=1, extra_args=extra))
    assert info.value.field == field and message in str(info.value)
    ok = tiny_llm.generate(["Hi"], SamplingParams(max_tokens=2, extra_args={
        "output_activations": {"attn_out": [1]}}))[0]
    assert ok.activations["attn_out"].shape[:2] == (1, 2)


@pytest.mark.parametrize("queries", ["prompt[-3:]", "generated", [0, 17, 30]])
def test_attention_to_span_in_the_worker_equals_the_pattern_from_qk(tiny_llm, queries):
    """The named hook keeps K of earlier prefill chunks itself; its per-head mass on the span
    equals what the client computes from output_qk."""
    from vllm_lens import NamedHook

    span = [2, 9]
    hook = NamedHook("attention_to_span", [1, 3], {"span": span, "queries": queries},
                     hook_point="attn_qk")
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                        extra_args={"apply_hooks": [hook], "output_qk": [1, 3]})
    out = tiny_llm.generate([TINY_PROMPT], sp)[0]
    assert out.hook_error is None
    saved = out.hook_results["0"]
    n_prompt = len(out.prompt_token_ids)
    n_rows = n_prompt + len(out.outputs[0].token_ids) - 1
    expected_positions = {
        "prompt[-3:]": list(range(n_prompt - 3, n_prompt)),
        "generated": list(range(n_prompt, n_rows)),
    }.get(queries if isinstance(queries, str) else "", queries)
    for layer in (1, 3):
        positions = saved["positions"][str(layer)].tolist()
        assert positions == expected_positions
        pattern = attention_patterns(out.activations, layer)  # [heads, seq, seq]
        expected = pattern[:, positions, span[0]:span[1]].sum(dim=-1).T
        torch.testing.assert_close(saved["mass"][str(layer)], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("args", "message"), [
    ({"span": [5, 2]}, "span must be"), ({"span": [0, 4], "queries": "generated[-2:]"},
                                          "queries must be"),
    ({"span": [0, 4], "top": 3}, "unknown argument"),
])
def test_attention_to_span_refuses_bad_arguments(tiny_llm, args, message):
    from vllm_lens import NamedHook

    hook = NamedHook("attention_to_span", [1], args, hook_point="attn_qk")
    with pytest.raises(LensRequestError, match=message):
        tiny_llm.generate(["Hi"], SamplingParams(max_tokens=1, extra_args={"apply_hooks": [hook]}))


def test_3d_steering_at_resid_mid_lands_on_its_positions(tiny_llm, tiny_ref):
    n_prompt = len(tiny_llm.get_tokenizer()(TINY_PROMPT)["input_ids"])
    rows = torch.stack([_vector(s, 4.0) for s in (11, 12, 13)])[None]
    sv = SteeringVector(activations=rows, layer_indices=[2], hook_point="resid_mid",
                        position_indices=[3, 20, n_prompt + 1])
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": [sv], "output_activations": {"resid_post": [2, 3]}})
    out = tiny_llm.generate([TINY_PROMPT], sp)[0]
    assert len(out.prompt_token_ids) == n_prompt
    edits = {("resid_mid", 2): _edit(sv, 0)}
    assert list(out.outputs[0].token_ids) == tiny_ref.point_greedy(
        list(out.prompt_token_ids), 6, edits)
    ref = tiny_ref.points(_ids(out)[:-1], edits)
    for i, layer in enumerate((2, 3)):
        assert max_relative_error(out.activations["resid_post"][i],
                                  ref[("resid_post", layer)]) <= TOL
