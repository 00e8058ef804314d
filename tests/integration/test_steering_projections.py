"""Directional ablation and projection caps (``mode="ablate"`` / ``"cap"``) equal
transformers with hooks doing the same edit: offline on the tiny engine (eager, prompts
prefilled in chunks of 16), and over HTTP on SmolLM2 (compiled), in the JSON and wire forms;
through presets and the Inspect provider."""

import httpx
import pytest
import torch
from vllm import SamplingParams

from tests.integration.test_steering import SMOL_PROMPT, TINY_PROMPT, _prompt_ids, _tokens
from vllm_lens import SteeringVector
from vllm_lens.steering import ABLATION_POINTS


def _projecting(direction, lower=0.0, upper=0.0, keep=lambda p: True):
    """A transformers edit clamping the projection onto ``direction`` (a tensor: at every
    position; a dict: ``{position: direction}``) into ``[lower, upper]`` at the positions
    ``keep(p)`` accepts (``(0, 0)``: an ablation), in float32."""
    def edit(value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        for p in range(value.shape[0]):
            r = direction.get(p) if isinstance(direction, dict) else direction
            if r is None or not keep(p):
                continue
            r = r.float() / r.float().norm()
            projection = value[p] @ r
            value[p] += (projection.clamp(min=lower, max=upper) - projection) * r
        return value
    return edit


def _stream_direction(ref, ids, layer):
    """The mean of the stream leaving ``layer`` over the prompt (the sink left out): a
    direction the model uses, so that removing it changes what it generates."""
    return ref.points(ids)[("resid_post", layer)][1:].mean(dim=0)


def test_ablation_at_every_layer_matches_transformers_and_leaves_no_component(
        tiny_llm, tiny_ref):
    ids = _prompt_ids(tiny_llm, TINY_PROMPT)
    n_layers = len(tiny_ref.layers)
    r = _stream_direction(tiny_ref, ids, n_layers // 2)
    vectors = SteeringVector.ablation(r)
    out = _tokens(tiny_llm, TINY_PROMPT, vectors,
                  output_residual_stream=list(range(n_layers)))
    edits = {(point, layer): _projecting(r) for point in ABLATION_POINTS
             for layer in range(n_layers)}
    expected = tiny_ref.point_greedy(ids, 12, edits)
    assert list(out.outputs[0].token_ids) == expected
    assert expected != list(_tokens(tiny_llm, TINY_PROMPT, None).outputs[0].token_ids)
    stream = out.activations["residual_stream"]  # [layers, positions, hidden]
    unit = r / r.norm()
    assert float(((stream @ unit).abs() / stream.norm(dim=-1)).max()) < 1e-5


def test_3d_cap_in_prefill_across_chunks_matches_transformers(tiny_llm, tiny_ref):
    """Per-position directions at positions in three prefill chunks, each projection set to
    a value far from the model's (``lower == upper``), prompt only."""
    ids = _prompt_ids(tiny_llm, TINY_PROMPT)
    assert len(ids) > 32  # three chunks of 16
    g = torch.Generator().manual_seed(5)
    positions = [3, 17, 33]
    dirs = torch.randn(1, len(positions), 128, generator=g)
    sv = SteeringVector(activations=dirs, layer_indices=[1], position_indices=positions,
                        mode="cap", cap=(25.0, 25.0), phase="prefill")
    out = _tokens(tiny_llm, TINY_PROMPT, [sv], output_residual_stream=[1])
    expected = tiny_ref.point_greedy(ids, 12, {("resid_post", 1): _projecting(
        dict(zip(positions, dirs[0])), 25.0, 25.0)})
    assert list(out.outputs[0].token_ids) == expected
    assert expected != list(_tokens(tiny_llm, TINY_PROMPT, None).outputs[0].token_ids)
    stream = out.activations["residual_stream"][0]
    for p, d in zip(positions, dirs[0]):
        assert float(stream[p] @ (d / d.norm())) == pytest.approx(25.0, rel=1e-4)


@pytest.mark.parametrize("point", ["resid_pre", "attn_out", "resid_mid", "mlp_out"])
def test_decode_cap_at_every_writable_point_matches_transformers(tiny_llm, tiny_ref, point):
    """An upper bound below the model's projection (one side open), generated positions
    only, at each point steering writes besides resid_post."""
    ids = _prompt_ids(tiny_llm, TINY_PROMPT)
    n = len(ids)
    r = _stream_direction(tiny_ref, ids, 2)
    projections = tiny_ref.points(ids)[(point, 2)] @ (r / r.norm())
    upper = float(projections.mean() - 2 * projections.std())
    sv = SteeringVector(activations=r[None], layer_indices=[2], hook_point=point, mode="cap",
                        cap=(None, upper), phase="decode")
    out = _tokens(tiny_llm, TINY_PROMPT, [sv])
    expected = tiny_ref.point_greedy(ids, 12, {(point, 2): _projecting(
        r, None, upper, keep=lambda p: p >= n)})
    assert list(out.outputs[0].token_ids) == expected


def test_a_preset_of_ablations_steers_as_the_vectors_inline(tiny_llm, tiny_ref):
    ids = _prompt_ids(tiny_llm, TINY_PROMPT)
    vectors = SteeringVector.ablation(_stream_direction(tiny_ref, ids, 2), [1, 2, 3])
    described = tiny_llm.register_steering("ablated", vectors)
    try:
        assert [(v["mode"], v["point"], v["layers"]) for v in described["vectors"]] == [
            ("ablate", point, [1, 2, 3]) for point in ABLATION_POINTS]
        inline = _tokens(tiny_llm, TINY_PROMPT, vectors).outputs[0].token_ids
        assert _tokens(tiny_llm, TINY_PROMPT, ["preset:ablated"]).outputs[0].token_ids == inline
    finally:
        tiny_llm.unregister_steering("ablated")


def _smol_vectors(ref, ids):
    """Ablation at every layer in decode, and a 3D cap of the prompt's last two positions
    and the first generated one after layer 12."""
    n = len(ids)
    r = _stream_direction(ref, ids, 12)
    g = torch.Generator().manual_seed(9)
    positions = [n - 2, n - 1, n + 1]
    dirs = torch.randn(1, 3, 576, generator=g)
    vectors = [*SteeringVector.ablation(r, phase="decode"),
               SteeringVector(activations=dirs, layer_indices=[12], position_indices=positions,
                              mode="cap", cap=(-30.0, -20.0))]
    edits = {(point, layer): _projecting(r, keep=lambda p: p >= n)
             for point in ABLATION_POINTS for layer in range(30)}
    # (the cap at layer 12's output runs before the ablation of layer 13's input, as in vLLM)
    edits[("resid_post", 12)] = _projecting(dict(zip(positions, dirs[0])), -30.0, -20.0)
    return vectors, edits


def test_ablation_and_cap_over_http_match_transformers_in_json_and_wire_forms(
        smol_server, smol_ref):
    from vllm_lens.client import LensClient

    with LensClient(smol_server.base_url) as client:
        ids = client.generate(SMOL_PROMPT, max_tokens=1).prompt_token_ids
        vectors, edits = _smol_vectors(smol_ref, ids)
        expected = smol_ref.point_greedy(ids, 12, edits)
        as_json = client.generate(ids, max_tokens=12, ignore_eos=True, steering_vectors=vectors)
        as_wire = client.generate(ids, max_tokens=12, ignore_eos=True,
                                  steering_vectors=[v.to_wire() for v in vectors])
        plain = client.generate(ids, max_tokens=12, ignore_eos=True)
    assert as_json.token_ids == expected
    assert as_wire.token_ids == expected
    assert plain.token_ids != expected


@pytest.mark.parametrize(("change", "param"), [
    ({"mode": "cap", "cap": [2.0, 1.0]}, "apply_steering_vectors[0].cap"),
    ({"mode": "cap", "cap": [None, None]}, "apply_steering_vectors[0].cap"),
    ({"mode": "ablate", "scale": 3.0}, "apply_steering_vectors[0].scale"),
    ({"mode": "ablate", "activations": torch.zeros(1, 576)},
     "apply_steering_vectors[0].activations"),
    ({"mode": "ablate", "hook_point": "mlp_post"}, "apply_steering_vectors[0].hook_point"),
])
def test_bad_ablations_and_caps_are_400_naming_the_field(smol_server, change, param):
    import json

    from vllm_lens.common import wire

    item = {"layer_indices": [3], **change}
    item["activations"] = wire.tensor_to_json(item.get("activations", torch.ones(1, 576)))
    r = httpx.post(f"{smol_server.base_url}/v1/completions", timeout=120, json={
        "prompt": SMOL_PROMPT, "max_tokens": 2,
        "vllm_xargs": {"apply_steering_vectors": json.dumps([item])}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_ablation_through_inspect_equals_the_client(smol_server, smollm2_path, smol_ref):
    import asyncio

    from inspect_ai.model import ChatMessageUser, GenerateConfig, get_model

    from vllm_lens.client import LensClient

    messages = [{"role": "user", "content": "Name three colours."}]
    with LensClient(smol_server.base_url) as client:
        ids = client.generate(SMOL_PROMPT, max_tokens=1).prompt_token_ids
    vectors = SteeringVector.ablation(_stream_direction(smol_ref, ids, 12))
    model = get_model(f"vllm-lens/{smollm2_path}", base_url=smol_server.base_url + "/v1",
                      api_key="unused")
    config = GenerateConfig(temperature=0, max_tokens=10,
                            extra_body={"extra_args": {"apply_steering_vectors": vectors}})
    output = asyncio.run(model.generate([ChatMessageUser(content=messages[0]["content"])],
                                        config=config))
    with LensClient(smol_server.base_url) as client:
        steered = client.chat(messages, max_tokens=10, steering_vectors=vectors)
        plain = client.chat(messages, max_tokens=10)
    assert output.completion == steered.text
    assert steered.text != plain.text

