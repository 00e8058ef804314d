"""Transcoders served by a real engine (the tiny Llama, chunked prefill), against sae-lens'
own ``encode`` / ``forward`` on transformers' rows: features read at ``mlp_in`` with the
reconstruction error of the MLP's output; ``replace_mlp`` (the prediction written over the
MLP's output; with ``keep_error`` the unmodified run, and a clamp's difference) equal to
transformers with the same edit in hooks, beside a plain request of the same batch; a
transcoder feature added at the point it predicts; bad requests refused by field while the
engine serves on."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import IDLE, held
from tests.integration.saes import replacement_edits, saved_transcoder
from vllm_lens import LensRequestError

PROMPT = "Once upon a time in a quiet village by the sea, an old fisherman mended his nets."
LAYER = 1


@pytest.fixture(scope="module")
def transcoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("transcoders")
    return {arch: (root / arch, saved_transcoder(root / arch, arch, LAYER))
            for arch in ("jumprelu_skip_transcoder", "transcoder")}


def _nmse(y, predicted):
    return (y - predicted).pow(2).sum(-1) / y.pow(2).sum(-1)


def test_transcoder_features_and_reconstruction_equal_sae_lens(tiny_llm, tiny_ref,
                                                               transcoders):
    """Top features of ``mlp_in`` rows and the NMSE of the transcoder's prediction against
    ``mlp_out``, every position (prompt chunks and generated rows), for a JumpReLU skip
    transcoder and a plain one; without ``reconstruction`` one site is read alone."""
    (skip_path, skip), (plain_path, plain) = (transcoders["jumprelu_skip_transcoder"],
                                              transcoders["transcoder"])
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": [
            {"sae": str(skip_path), "top_k": 16, "reconstruction": True},
            {"sae": str(plain_path), "top_k": 8, "reconstruction": True},
            {"sae": str(plain_path), "top_k": 4, "positions": "generated"}]})
    out = tiny_llm.generate([PROMPT], sp)[0]
    assert out.lens_error is None
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    n_rows, n_prompt = len(ids) - 1, len(out.prompt_token_ids)
    rows = tiny_ref.points(ids[:n_rows])
    x, y = rows[("mlp_in", LAYER)], rows[("mlp_out", LAYER)]
    first, second, third = out.sae_features
    for found, reference, k in ((first, skip, 16), (second, plain, 8)):
        assert (found["layer"], found["point"]) == (LAYER, "mlp_in")
        assert found["positions"].tolist() == list(range(n_rows))
        with torch.no_grad():
            dense = reference.encode(x)
            predicted = reference.forward(x)
        assert (dense > 0).any() and (dense == 0).any()
        top = dense.topk(k)
        torch.testing.assert_close(found["values"], top.values * (top.values > 0),
                                   rtol=1e-4, atol=1e-4)
        assert found["l0"].tolist() == (dense > 0).sum(-1).tolist()
        torch.testing.assert_close(found["nmse"], _nmse(y, predicted), rtol=1e-4, atol=1e-6)
    assert third["positions"].tolist() == list(range(n_prompt, n_rows))
    assert "nmse" not in third
    with torch.no_grad():
        top = plain.encode(x[n_prompt:]).topk(4)
    torch.testing.assert_close(third["values"], top.values * (top.values > 0), rtol=1e-4,
                               atol=1e-4)
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_replacing_an_mlp_equals_transformers_with_the_same_edit(tiny_llm, tiny_ref,
                                                                 transcoders):
    """``replace_mlp``: the prediction written over the MLP's output (tokens and the next
    layers' rows equal transformers'), a plain request in the same batch untouched;
    ``keep_error`` reproduces the unmodified run; with a clamp it adds the clamp's difference
    only; a transcoder feature added by steering lands at ``mlp_out``."""
    skip_path, skip = transcoders["jumprelu_skip_transcoder"]
    ids = tiny_llm.get_tokenizer().encode(PROMPT)

    def params(**extra):
        return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                              extra_args={"output_residual_stream": [3], **extra} or None)

    plain_sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                              extra_args={"output_residual_stream": [3]})
    # Two requests replacing alike (one group, their rows apart in the batch) around a plain
    # one.
    other_ids = tiny_llm.get_tokenizer().encode("A lighthouse keeper counted the ships.")
    replace = params(replace_mlp=[{"transcoder": str(skip_path), "keep_error": False}])
    replaced, plain, other = tiny_llm.generate(
        [{"prompt_token_ids": ids}, {"prompt_token_ids": ids}, {"prompt_token_ids": other_ids}],
        [replace, plain_sp, replace])
    assert replaced.lens_error is None and plain.lens_error is None
    edits = replacement_edits(LAYER, skip, keep_error=False)
    tokens = list(replaced.outputs[0].token_ids)
    assert tokens == tiny_ref.point_greedy(ids, 8, edits)
    assert other.lens_error is None
    assert list(other.outputs[0].token_ids) == tiny_ref.point_greedy(
        other_ids, 8, replacement_edits(LAYER, skip, keep_error=False))
    assert tokens != list(plain.outputs[0].token_ids)
    every = ids + tokens
    torch.testing.assert_close(replaced.activations["residual_stream"][0],
                               tiny_ref.points(every[:-1], replacement_edits(LAYER, skip, False))[
                                   ("resid_post", 3)], rtol=1e-4, atol=1e-4)
    reference_plain = tiny_ref.point_greedy(ids, 8, {})
    assert list(plain.outputs[0].token_ids) == reference_plain
    # keep_error alone: the layer computes what it did (tokens identical, rows within 1e-4).
    kept = tiny_llm.generate([{"prompt_token_ids": ids}], params(
        replace_mlp={"transcoder": str(skip_path), "keep_error": True}))[0]
    assert kept.lens_error is None
    assert list(kept.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    torch.testing.assert_close(kept.activations["residual_stream"][0],
                               plain.activations["residual_stream"][0], rtol=1e-4, atol=1e-4)
    # keep_error with a clamp: only the clamped features' difference is added.
    clamp = {3: 6.0, 40: 0.0}
    clamped = tiny_llm.generate([{"prompt_token_ids": ids}], params(replace_mlp=[{
        "transcoder": str(skip_path), "keep_error": True,
        "clamp": {str(k): v for k, v in clamp.items()}}]))[0]
    assert clamped.lens_error is None
    edits = replacement_edits(LAYER, skip, keep_error=True, clamp=clamp)
    tokens = list(clamped.outputs[0].token_ids)
    assert tokens == tiny_ref.point_greedy(ids, 8, edits)
    assert tokens != list(plain.outputs[0].token_ids)
    torch.testing.assert_close(clamped.activations["residual_stream"][0],
                               tiny_ref.points((ids + tokens)[:-1],
                                               replacement_edits(LAYER, skip, True, clamp))[("resid_post", 3)],
                               rtol=1e-4, atol=1e-4)
    # A transcoder's feature added by steering: its decoder row at the point it predicts.
    added = tiny_llm.generate([{"prompt_token_ids": ids}], params(apply_steering_vectors=[
        {"sae": str(skip_path), "feature": 3, "scale": 8.0}]))[0]
    assert added.lens_error is None
    row = skip.W_dec.detach()[3]
    tokens = list(added.outputs[0].token_ids)
    assert tokens == tiny_ref.point_greedy(ids, 8, {("mlp_out", LAYER): lambda y: y + 8.0 * row})
    assert tokens != list(plain.outputs[0].token_ids)
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_bad_replacements_are_refused_by_field_and_the_engine_serves_on(tiny_llm, tmp_path,
                                                                        transcoders):
    from tests.integration.saes import saved_sae

    skip_path, _ = transcoders["jumprelu_skip_transcoder"]
    sae_path = tmp_path / "sae"
    saved_sae(sae_path, "standard", "blocks.1.hook_mlp_in")
    wide = tmp_path / "wide"
    saved_transcoder(wide, "transcoder", LAYER, d_in=64)
    cases = [
        ({"transcoder": str(skip_path)}, "replace_mlp.keep_error", "required"),
        ({"transcoder": str(sae_path), "keep_error": False}, "replace_mlp.transcoder",
         "not a transcoder"),
        ({"transcoder": str(wide), "keep_error": False}, "replace_mlp.transcoder",
         "rows of 64 values"),
        ({"transcoder": str(skip_path), "keep_error": True, "clamp": {"512": 1.0}},
         "replace_mlp.clamp", "not a feature of this transcoder"),
        ({"transcoder": str(skip_path), "keep_error": True, "clamp": {"3": "x"}},
         "replace_mlp.clamp.3", "a finite number"),
        ([{"transcoder": str(skip_path), "keep_error": True},
          {"transcoder": str(skip_path), "keep_error": False}], "replace_mlp[1].transcoder",
         "one transcoder per layer"),
        ({"transcoder": str(skip_path), "keep_error": False, "layer": 2},
         "replace_mlp.layer", "unknown field"),
    ]
    for value, field, problem in cases:
        with pytest.raises(LensRequestError, match=problem) as info:
            tiny_llm.generate([PROMPT], SamplingParams(max_tokens=2, extra_args={
                "replace_mlp": value}))
        assert info.value.field == field, (value, info.value.field)
    with pytest.raises(LensRequestError, match="is a transcoder") as info:
        tiny_llm.generate([PROMPT], SamplingParams(max_tokens=2, extra_args={
            "apply_steering_vectors": [{"sae": str(skip_path), "feature": 3, "clamp": 1.0}]}))
    assert info.value.field == "apply_steering_vectors[0].clamp"
    out = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_over_http_a_named_transcoder_replaces_and_reads_as_offline(smol_server, smol_llm,
                                                                    smol_transcoder):
    """The server's ``VLLM_LENS_SAES`` transcoder ``smol-t5`` is listed with the point it
    predicts; over HTTP (compiled SmolLM2) ``replace_mlp`` by name and its features with
    reconstruction equal the offline engine's with its directory; a path is refused, naming
    the field, and the server serves on."""
    import json

    import httpx

    from vllm_lens.client import LensClient, LensHTTPError

    path, _ = smol_transcoder
    listing = httpx.get(smol_server.base_url + "/v1/lens/saes", timeout=60).json()["data"]
    (entry,) = [e for e in listing if e["name"] == "smol-t5"]
    assert entry == {"name": "smol-t5", "layout": "sae-lens",
                     "architecture": "jumprelu_skip_transcoder",
                     "hook_name": "blocks.5.hook_mlp_in", "point": "mlp_in", "layer": 5,
                     "d_in": 576, "d_sae": 512, "dtype": "float32", "labels": True,
                     "hook_name_out": "blocks.5.hook_mlp_out", "out_point": "mlp_out",
                     "d_out": 576}
    prompt = "The capital of France is"
    ask = {"sae": "smol-t5", "top_k": 8, "reconstruction": True}
    with LensClient(smol_server.base_url) as client:
        replaced = client.generate(prompt, max_tokens=8, sae_features=ask, replace_mlp=[
            {"transcoder": "smol-t5", "keep_error": False}])
        with pytest.raises(LensHTTPError) as bad:
            client.generate(prompt, max_tokens=2, replace_mlp=[
                {"transcoder": str(path), "keep_error": False}])
    assert bad.value.status == 400 and bad.value.param == "replace_mlp[0].transcoder"
    assert str(path) not in str(bad.value)
    offline = smol_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, extra_args={
        "output_sae_features": {**ask, "sae": str(path)},
        "replace_mlp": [{"transcoder": str(path), "keep_error": False}]}))[0]
    assert offline.lens_error is None
    assert replaced.token_ids == list(offline.outputs[0].token_ids)
    plain = smol_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert replaced.token_ids != list(plain.outputs[0].token_ids)  # it replaced
    (found,), (expected,) = replaced.sae_features, offline.sae_features
    for key in ("positions", "indices", "l0"):
        assert torch.equal(found[key], expected[key]), key
    for key in ("values", "nmse"):
        torch.testing.assert_close(found[key], expected[key], rtol=1e-3, atol=1e-3)
    # Neuronpedia's explanations in its directory (every third feature) label the features.
    present = sorted({int(i) for i in found["indices"].flatten().tolist() if i >= 0})
    assert found["labels"] == {i: f"third {i}" for i in present if i % 3 == 0}
    assert found["labels"] == expected["labels"]
    # With its own prediction in place the transcoder reconstructs mlp_out exactly.
    assert float(found["nmse"].abs().max()) < 1e-4
    ok = httpx.post(smol_server.base_url + "/v1/completions", timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, json.dumps(ok.json())
