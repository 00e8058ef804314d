"""SAE features served by a real engine (the tiny Llama, chunked prefill) equal sae-lens' own
``encode`` of transformers' rows at the SAE's point and layer, prompt and generated rows, for
each architecture (jumprelu at resid_post, topk at mlp_out, standard at attn_out); clamping
equals transformers with the same edit in a hook (jumprelu, standard and topk); only the top
features leave the worker; bad SAEs are refused naming the field, before anything runs (and
a bad ``VLLM_LENS_SAES`` stops the OpenAI server); the engine serves on and holds nothing
afterwards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import IDLE, held
from tests.integration.saes import (
    assert_top_features,
    check_clamp,
    inside_and_outside,
    saved_sae,
    topk_clamp,
)
from vllm_lens import LensRequestError
from vllm_lens.saes import load_sae

PROMPT = "Once upon a time in a quiet village by the sea, an old fisherman mended his nets."


@pytest.fixture(scope="module")
def saes(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    return {
        "resid": (root / "resid", saved_sae(root / "resid", "jumprelu",
                                             "blocks.2.hook_resid_post")),
        "mlp": (root / "mlp", saved_sae(root / "mlp", "topk", "blocks.1.hook_mlp_out", k=16)),
        "attn": (root / "attn", saved_sae(root / "attn", "standard", "blocks.1.hook_attn_out")),
        "topk": (root / "topk", saved_sae(root / "topk", "topk", "blocks.2.hook_resid_post",
                                           k=16)),
        "rescaled": (root / "rescaled", saved_sae(root / "rescaled", "topk",
                                                   "blocks.2.hook_resid_post", k=16,
                                                   rescale_acts_by_decoder_norm=True)),
    }


def _ids(out):
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def _nmse(x, recon):
    return (x - recon).pow(2).sum(-1) / x.pow(2).sum(-1)


def test_features_equal_sae_lens_on_transformers_rows(tiny_llm, tiny_ref, saes):
    (resid_path, resid), (mlp_path, mlp) = saes["resid"], saes["mlp"]
    attn_path, attn = saes["attn"]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": [
            {"sae": str(resid_path), "top_k": 24, "reconstruction": True},
            {"sae": str(mlp_path), "positions": "generated", "top_k": 16},
            {"sae": str(attn_path), "top_k": 32, "reconstruction": True},
            {"sae": str(mlp_path), "positions": "prompt", "top_k": 8}],
        "output_residual_stream": [2]})
    out = tiny_llm.generate([PROMPT], sp)[0]
    assert out.lens_error is None
    ids = _ids(out)
    n_rows = len(ids) - 1  # the last generated token never ran
    n_prompt = len(out.prompt_token_ids)
    assert n_prompt > 16  # the prompt's rows come from more than one chunk
    expected = tiny_ref.points(ids[:n_rows])
    first, second, third, fourth = out.sae_features
    assert (first["sae"], first["layer"], first["point"]) == (str(resid_path), 2, "resid_post")
    assert first["positions"].tolist() == list(range(n_rows))
    x = expected[("resid_post", 2)]
    with torch.no_grad():
        dense = resid.encode(x)
        recon = resid.decode(dense)
    assert_top_features(first, dense, 24)
    torch.testing.assert_close(first["nmse"], _nmse(x, recon), rtol=1e-4, atol=1e-6)
    # The dense rows of the same layer, captured beside it, are the SAE's input.
    torch.testing.assert_close(out.activations["residual_stream"][0], x, rtol=1e-4, atol=1e-4)
    # TopK at mlp_out, generated positions only: k = 16 features each (ReLU'd top-k); the
    # same SAE at the prompt's positions, 8 features each.
    assert second["positions"].tolist() == list(range(n_prompt, n_rows))
    assert "nmse" not in second and second["indices"].dtype == torch.int32
    assert fourth["positions"].tolist() == list(range(n_prompt))
    for found, rows, k in ((second, slice(n_prompt, None), 16), (fourth, slice(n_prompt), 8)):
        with torch.no_grad():
            dense = mlp.encode(expected[("mlp_out", 1)][rows])
        values, indices = dense.topk(k)
        torch.testing.assert_close(found["values"], values * (values > 0), rtol=1e-4,
                                   atol=1e-5)
        active = values > 0
        assert torch.equal(found["indices"][active], indices[active].to(torch.int32))
    # Standard (ReLU) at attn_out, another point, every position.
    assert (third["layer"], third["point"]) == (1, "attn_out")
    assert third["positions"].tolist() == list(range(n_rows))
    x = expected[("attn_out", 1)]
    with torch.no_grad():
        dense = attn.encode(x)
        recon = attn.decode(dense)
    assert_top_features(third, dense, 32)
    torch.testing.assert_close(third["nmse"], _nmse(x, recon), rtol=1e-4, atol=1e-6)
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


@pytest.mark.parametrize(("architecture", "fields"), [("gated", {}), ("abstopk", {"k": 16})])
def test_gated_and_abstopk_features_and_clamps_equal_sae_lens(tiny_llm, tiny_ref, tmp_path,
                                                              architecture, fields):
    """sae-lens' gated and AbsTopK SAEs at layer 2's stream: the top features (AbsTopK's by
    magnitude, signed) and the reconstruction error equal sae-lens' ``encode`` / ``decode`` of
    transformers' rows, and clamping two features (with the whole SAE on the worker) gives
    transformers' tokens with the same edit in a hook."""
    path = tmp_path / architecture
    sae = saved_sae(path, architecture, "blocks.2.hook_resid_post", **fields)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": {"sae": str(path), "top_k": 8, "reconstruction": True}})
    out = tiny_llm.generate([PROMPT], sp)[0]
    assert out.lens_error is None
    ids = _ids(out)
    x = tiny_ref.points(ids[:-1])[("resid_post", 2)]
    with torch.no_grad():
        dense = sae.encode(x)
        recon = sae.decode(dense)
    (found,) = out.sae_features
    assert found["l0"].tolist() == (dense != 0).sum(-1).tolist()
    if architecture == "abstopk":
        assert (dense < 0).any()
        top = dense.abs().topk(8).indices
    else:
        assert (dense == 0).any() and (dense > 0).any()
        top = dense.topk(8).indices
    values = dense.gather(-1, top)
    active = values != 0
    torch.testing.assert_close(found["values"], torch.where(active, values, 0.0), rtol=1e-4,
                               atol=1e-4)
    assert torch.equal(found["indices"][active], top[active].to(torch.int32))
    torch.testing.assert_close(found["nmse"], _nmse(x, recon), rtol=1e-4, atol=1e-6)
    check_clamp(tiny_llm, tiny_ref, path, sae, list(out.prompt_token_ids), [11, 300], [4.0, 0.0])


def test_bad_saes_are_refused_by_field_before_anything_runs(tiny_llm, saes, tmp_path):
    resid_path = str(saes["resid"][0])

    def ask(value):
        sp = SamplingParams(max_tokens=2, extra_args={"output_sae_features": value})
        return tiny_llm.generate(["Hello"], sp)

    for value, field, problem in [
            ({"sae": str(tmp_path)}, "output_sae_features.sae", "holds no SAE layout"),
            ({"sae": resid_path, "top_k": 0}, "output_sae_features.top_k", "from 1 to"),
            ({"sae": resid_path, "top_k": 513}, "output_sae_features.top_k", r"d_sae \(512\)"),
            ({"sae": resid_path, "bogus": 1}, "output_sae_features.bogus", "unknown field"),
            ([{"sae": resid_path}, {"sae": resid_path}], "output_sae_features[1]", "same SAE"),
            ({"sae": resid_path, "hook_point": "blocks.9.hook_resid_post"},
             "output_sae_features.sae", "reads layer 9, but the model has 4 layers")]:
        with pytest.raises(LensRequestError, match=problem) as info:
            ask(value)
        assert info.value.field == field, (value, info.value)
    wide = tmp_path / "wide"
    saved_sae(wide, "standard", "blocks.1.hook_resid_post", d_in=64)
    with pytest.raises(LensRequestError, match="rows of 64 values, but this model's"):
        ask({"sae": str(wide)})
    cfg = json.loads((wide / "cfg.json").read_text())
    (wide / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "layer_norm"}))
    with pytest.raises(LensRequestError, match="normalize_activations='layer_norm'"):
        ask({"sae": str(wide)})
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    (out,) = ask({"sae": resid_path, "top_k": 4, "positions": "last_prompt"})
    assert out.sae_features[0]["indices"].shape == (1, 4)
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_features_in_compiled_mode_on_smollm2_equal_sae_lens(smol_llm, smol_ref, tmp_path):
    """vLLM's default compiled mode, the trained model: a 4x-wide JumpReLU SAE at layer 10.
    Rows equal transformers' to ~1e-4, so values are compared with that tolerance and each
    returned feature's value with sae-lens' value of the same feature."""
    sae = saved_sae(tmp_path / "smol", "jumprelu", "blocks.10.hook_resid_post", d_in=576)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": {"sae": str(tmp_path / "smol"), "top_k": 16}})
    out = smol_llm.generate(["The capital of France is"], sp)[0]
    assert out.lens_error is None
    ids = _ids(out)
    rows = smol_ref.points(ids[:-1])[("resid_post", 10)]
    (found,) = out.sae_features
    with torch.no_grad():
        dense = sae.encode(rows)
    top = dense.topk(16)
    assert found["values"].shape == (len(ids) - 1, 16)
    torch.testing.assert_close(found["values"], top.values * (top.values > 0), rtol=1e-3,
                               atol=1e-3)
    active = found["indices"] >= 0
    picked = dense.gather(1, found["indices"].clamp(min=0).long())
    torch.testing.assert_close(found["values"][active], picked[active], rtol=1e-3, atol=1e-3)


def _expected_top(sae, rows, k):
    with torch.no_grad():
        dense = sae.encode(rows)
    return dense, dense.topk(k)


def test_registered_name_offline_and_its_listing(tiny_llm, tiny_ref, saes, tmp_path):
    """``llm.register_sae`` checks the SAE against the model and lists it (never its path);
    requests then name it."""
    resid_path, resid = saes["resid"]
    listed = tiny_llm.register_sae("resid-2", str(resid_path))
    assert listed == {"name": "resid-2", "layout": "sae-lens", "architecture": "jumprelu",
                      "hook_name": "blocks.2.hook_resid_post", "point": "resid_post",
                      "layer": 2, "d_in": 128, "d_sae": 512, "dtype": "float32",
                      "labels": False}
    assert tiny_llm.registered_saes() == [listed]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": {"sae": "resid-2", "top_k": 8, "positions": "last_prompt"}})
    out = tiny_llm.generate([PROMPT], sp)[0]
    (found,) = out.sae_features
    assert found["sae"] == "resid-2"
    rows = tiny_ref.points(list(out.prompt_token_ids))[("resid_post", 2)][-1:]
    _, top = _expected_top(resid, rows, 8)
    kept = int((top.values > 0).sum())
    assert found["indices"][0, :kept].tolist() == top.indices[0, :kept].tolist()
    torch.testing.assert_close(found["values"][0, :kept], top.values[0, :kept], rtol=1e-4,
                               atol=1e-5)
    # Gemma Scope's files do not say where they read: registered with a hook point, and
    # requests naming it read there.
    gemma_scope = tmp_path / "gemma-scope"
    gemma_scope.mkdir()
    np.savez(gemma_scope / "params.npz",
             **{k: v.detach().numpy() for k, v in resid.state_dict().items()})
    moved = tiny_llm.register_sae("gs-1", str(gemma_scope), "blocks.1.hook_resid_post")
    assert (moved["layout"], moved["layer"]) == ("gemma-scope", 1)
    sp.extra_args["output_sae_features"]["sae"] = "gs-1"
    (found,) = tiny_llm.generate([PROMPT], sp)[0].sae_features
    assert (found["sae"], found["layer"]) == ("gs-1", 1)
    rows = tiny_ref.points(list(out.prompt_token_ids))[("resid_post", 1)][-1:]
    _, top = _expected_top(load_sae(gemma_scope, "blocks.1.hook_resid_post"), rows, 8)
    kept = int((top.values > 0).sum())
    assert kept and found["indices"][0, :kept].tolist() == top.indices[0, :kept].tolist()
    saved_sae(tmp_path / "narrow", "standard", "blocks.1.hook_resid_post", d_in=64)
    with pytest.raises(LensRequestError) as bad:
        tiny_llm.register_sae("narrow", str(tmp_path / "narrow"))
    assert bad.value.field == "path" and "rows of 64 values" in str(bad.value)
    with pytest.raises(LensRequestError) as bad:
        tiny_llm.register_sae("../x", str(resid_path))
    assert bad.value.field == "name"
    with pytest.raises(LensRequestError) as bad:
        tiny_llm.register_sae("nothing", str(tmp_path / "missing"))
    assert bad.value.field == "path" and "not a directory" in str(bad.value)
    assert [s["name"] for s in tiny_llm.registered_saes()] == ["gs-1", "resid-2"]
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_a_bad_sae_file_stops_the_server_naming_each_bad_entry(tiny_path, saes, tmp_path):
    """The OpenAI server does not start with a bad ``VLLM_LENS_SAES``: an entry of the wrong
    shape stops it before its engine starts; SAEs the workers cannot read or that do not fit
    the model stop it once they are read, one error naming each bad entry and its problem
    (the good one beside them does not make it serve part of the list)."""
    from tests.integration.server import running_server

    listed = tmp_path / "saes.json"

    def exits(entries):
        listed.write_text(json.dumps(entries))
        with pytest.raises(RuntimeError) as failed:
            with running_server(tiny_path, "--enforce-eager", start_timeout_s=300,
                                env={"VLLM_LENS_SAES": str(listed)}):
                pass
        message = str(failed.value)
        assert message.startswith("server exited with 1"), message
        return message

    resid = str(saes["resid"][0])
    shape = exits({"resid": resid, "odd": {"path": resid, "layer": 2}, "../up": resid})
    assert "EngineCore" not in shape  # refused before the engine started
    assert "2 of the 3 SAEs listed cannot be served" in shape
    assert "SAE 'odd': must be a path or" in shape and "(unknown field 'layer')" in shape
    assert "SAE '../up': is not an SAE name" in shape
    assert "SAE 'resid'" not in shape
    wide = tmp_path / "wide"
    saved_sae(wide, "standard", "blocks.1.hook_resid_post", d_in=64)
    unfit = exits({"resid": resid, "missing": str(tmp_path / "missing"), "wide": str(wide),
                   "deep": {"path": resid, "hook_point": "blocks.9.hook_resid_post"}})
    assert "3 of the 4 SAEs listed cannot be served" in unfit
    for line in (f"SAE 'missing': {tmp_path / 'missing'} is not a directory holding an SAE",
                 "SAE 'wide': reads resid_post rows of 64 values, but this model's resid_post "
                 "rows have 128",
                 "SAE 'deep': reads layer 9, but the model has 4 layers"):
        assert line in unfit, unfit
    assert "SAE 'resid'" not in unfit


def test_over_http_only_registered_names_are_served(smol_server, smol_ref, smol_sae, tmp_path):
    """The operator's ``VLLM_LENS_SAES`` is listed by ``GET /v1/lens/saes`` (no paths); a
    request naming it gets ``sae_features`` per choice (JSON and binary transports, streamed
    or not, and with ``stream_activations`` chunk by chunk, through ``LensClient``) equal to sae-lens on transformers' rows; a path or an
    unknown name is refused, 400 naming the field, before anything runs; the server serves
    on."""
    import httpx

    from vllm_lens.client import LensClient

    path, sae = smol_sae
    listing = httpx.get(smol_server.base_url + "/v1/lens/saes", timeout=60).json()["data"]
    assert listing[0] == {"name": "smol-l10", "layout": "sae-lens", "architecture": "jumprelu",
                          "hook_name": "blocks.10.hook_resid_post", "point": "resid_post",
                          "layer": 10, "d_in": 576, "d_sae": 512, "dtype": "float32",
                          "labels": True}
    assert [entry["name"] for entry in listing] == ["smol-l10", "smol-t5"]  # (test_transcoders)
    assert str(path) not in json.dumps(listing)
    ask = {"sae": "smol-l10", "top_k": 16, "reconstruction": True}
    with LensClient(smol_server.base_url) as client:
        assert client.saes() == listing
        r = client.generate("The capital of France is", max_tokens=4, sae_features=ask)
        binary = client.generate("The capital of France is", max_tokens=4, sae_features=ask,
                                 capture_layers=[10], transport="binary")
        *_, streamed = client.generate("The capital of France is", max_tokens=4,
                                       sae_features=ask, stream=True)
        chunks = [c.sae_features for c in client.generate(
            "The capital of France is", max_tokens=4, sae_features=ask, stream=True,
            stream_activations=True) if c.sae_features is not None]
    ids = r.prompt_token_ids + r.token_ids
    rows = smol_ref.points(ids[:-1])[("resid_post", 10)]
    (found,) = r.sae_features
    assert (found["sae"], found["layer"], found["point"]) == ("smol-l10", 10, "resid_post")
    assert found["positions"].tolist() == list(range(len(ids) - 1))
    dense, top = _expected_top(sae, rows, 16)
    torch.testing.assert_close(found["values"], top.values * (top.values > 0), rtol=1e-3,
                               atol=1e-3)
    # Its directory's labels (even features) beside the indices, keyed by index as offline.
    present = sorted({int(i) for i in found["indices"].flatten().tolist() if i >= 0})
    assert found["labels"] == {i: f"even {i}" for i in present if i % 2 == 0}
    assert any(i % 2 for i in present) and found["labels"]
    assert found["l0"].tolist() == (dense > 0).sum(-1).tolist()
    # Streamed rows: the prompt's positions with the first token, then the newer ones.
    assert len(chunks) > 1 and len(chunks[0][0]["positions"]) == len(r.prompt_token_ids)
    joined = {key: torch.cat([c[0][key] for c in chunks]) for key in found if key in (
        "positions", "indices", "values", "nmse", "l0")}
    for other in (binary.sae_features[0], streamed.sae_features[0], joined):
        for key in ("positions", "indices", "values", "nmse", "l0"):
            torch.testing.assert_close(other[key], found[key])
    assert binary.activations["residual_stream"].shape[1] == len(ids) - 1

    def refused(value):
        body = {"prompt": "Hello", "max_tokens": 2,
                "vllm_xargs": {"output_sae_features": json.dumps(value)}}
        return httpx.post(smol_server.base_url + "/v1/completions", json=body, timeout=60)

    loaded = httpx.get(smol_server.base_url + "/v1/lens/stats", timeout=60).json()["workers"]
    for value, words in (({"sae": str(path)}, "cannot name a path"),
                         ({"sae": "smol-l10", "hook_point": "blocks.3.hook_resid_post"},
                          "cannot move it"),
                         ({"sae": "smol-l11"}, "smol-l10"),
                         ({"sae": "smol-l10", "top_k": 513}, "d_sae (512)")):
        answer = refused(value)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"].startswith("output_sae_features."), answer.text
        assert words in answer.json()["error"]["message"]
        assert str(path) not in answer.text
    after = httpx.get(smol_server.base_url + "/v1/lens/stats", timeout=60).json()["workers"]
    assert [w["saes"] for w in after] == [w["saes"] for w in loaded]  # nothing more loaded
    ok = httpx.post(smol_server.base_url + "/v1/completions", timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_steering_by_a_named_feature_over_http_equals_offline(smol_server, smol_llm, smol_sae):
    """Over HTTP a client steers by the server's named SAE; offline the same steering vector
    built from sae-lens' ``W_dec`` gives the same tokens."""
    from vllm_lens import SteeringVector
    from vllm_lens.client import LensClient, LensHTTPError

    W_dec = smol_sae[1].W_dec.detach()
    with LensClient(smol_server.base_url) as client:
        steered = client.generate("The capital of France is", max_tokens=8, steering_vectors=[
            {"sae": "smol-l10", "feature": 21, "scale": 12.0, "phase": "decode"}])
        with pytest.raises(LensHTTPError) as bad:
            client.generate("Hi", max_tokens=2, steering_vectors=[
                {"sae": str(smol_sae[0]), "feature": 21, "scale": 12.0}])
    assert bad.value.status == 400 and bad.value.param == "apply_steering_vectors[0].sae"
    offline = smol_llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=8, temperature=0, extra_args={"apply_steering_vectors": [SteeringVector(
            activations=W_dec[21:22], layer_indices=[10], scale=12.0, phase="decode")]}))[0]
    assert steered.token_ids == list(offline.outputs[0].token_ids)
    plain = smol_llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=8, temperature=0))[0]
    assert steered.token_ids != list(plain.outputs[0].token_ids)  # it steered


def test_steering_by_feature_adds_the_decoder_row_like_a_steering_vector(tiny_llm, saes):
    """``{"sae", "feature", "scale"}`` steers exactly as the steering vector ``scale *
    W_dec[feature]`` (sae-lens' own ``W_dec``) at the SAE's layer and point: same tokens, same
    rows downstream; several features sum; bad features are refused by field."""
    from vllm_lens import SteeringVector

    path, sae = saes["resid"]
    W_dec = sae.W_dec.detach()

    def run(vectors):
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={
            "apply_steering_vectors": vectors, "output_residual_stream": [3]})
        out = tiny_llm.generate([PROMPT], sp)[0]
        assert out.lens_error is None
        return out.outputs[0].token_ids, out.activations["residual_stream"]

    plain = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    for item, vector, scale in (
            ({"sae": str(path), "feature": 11, "scale": 40.0}, W_dec[11:12], 40.0),
            ({"sae": str(path), "feature": [3, 9], "scale": [30.0, -20.0]},
             (30.0 * W_dec[3] - 20.0 * W_dec[9])[None], 1.0)):
        tokens, rows = run([item])
        expected_tokens, expected_rows = run([SteeringVector(
            activations=vector, layer_indices=[2], hook_point="resid_post", scale=scale)])
        assert tokens == expected_tokens
        torch.testing.assert_close(rows, expected_rows, rtol=1e-5, atol=1e-5)
        assert tokens != plain
    with pytest.raises(LensRequestError) as bad:
        run([{"sae": str(path), "feature": 512, "scale": 1.0}])
    assert bad.value.field == "apply_steering_vectors[0].feature"
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_clamping_features_equals_transformers_with_the_same_edit(tiny_llm, tiny_ref, saes):
    """``{"sae", "feature", "clamp"}``: at every steered row the features are computed from
    the stream (sae-lens' ``encode``) and ``(clamp - f) @ W_dec[features]`` is added, the
    SAE's error term kept; tokens and the rows of the next layer equal transformers with that
    edit in a hook (prompt and generated positions; chunked prefill; a jumprelu SAE at
    resid_post and a standard one at attn_out); ``phase`` and positions apply as for any
    steering vector."""
    from vllm_lens import SteeringVector

    path, sae = saes["resid"]
    features, targets = [11, 300], [6.0, 0.0]
    index = torch.tensor(features)
    ids = tiny_llm.get_tokenizer().encode(PROMPT)

    def clamping(keep, sae=sae):
        W = sae.W_dec.detach()[index]

        def edit(x):
            with torch.no_grad():
                delta = (torch.tensor(targets) - sae.encode(x)[:, index]) @ W
            rows = torch.tensor([keep(p) for p in range(x.shape[0])])
            return x + delta * rows[:, None]
        return edit

    def run(path=path, **fields):
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={
            "apply_steering_vectors": [{"sae": str(path), "feature": features,
                                        "clamp": targets, **fields}],
            "output_residual_stream": [3]})
        out = tiny_llm.generate([{"prompt_token_ids": ids}], sp)[0]
        assert out.lens_error is None
        return out

    plain = tiny_llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    edits = {("resid_post", 2): clamping(lambda p: True)}
    attn_path, attn = saes["attn"]  # standard: the same clamp at another point
    for out, hooked in ((run(), edits),
                        (run(attn_path), {("attn_out", 1): clamping(lambda p: True, attn)})):
        assert list(out.outputs[0].token_ids) == tiny_ref.point_greedy(ids, 8, hooked)
        assert list(out.outputs[0].token_ids) != list(plain)
        every = ids + list(out.outputs[0].token_ids)
        expected = tiny_ref.points(every[:-1], hooked)[("resid_post", 3)]
        torch.testing.assert_close(out.activations["residual_stream"][0], expected,
                                   rtol=1e-4, atol=1e-4)
    n = len(ids)
    decode_only = run(phase="decode")
    assert list(decode_only.outputs[0].token_ids) == tiny_ref.point_greedy(
        ids, 8, {("resid_post", 2): clamping(lambda p: p >= n)})
    chosen = [2, 5, n + 1]
    at_positions = run(position_indices=chosen)
    assert list(at_positions.outputs[0].token_ids) == tiny_ref.point_greedy(
        ids, 8, {("resid_post", 2): clamping(lambda p: p in chosen)})
    # With a plain vector at another layer in the same request (one steering group per site).
    push = torch.randn(128, generator=torch.Generator().manual_seed(4)) * 2
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": [
            {"sae": str(path), "feature": features, "clamp": targets},
            SteeringVector(activations=push[None], layer_indices=[1])]})
    mixed = tiny_llm.generate([{"prompt_token_ids": ids}], sp)[0]
    assert list(mixed.outputs[0].token_ids) == tiny_ref.point_greedy(ids, 8, {
        ("resid_post", 1): lambda x: x + push, **edits})
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_requests_clamping_alike_in_one_batch_each_equal_their_own_reference(
        tiny_llm, tiny_ref, saes):
    """Requests clamping the same features of the same SAE to the same values are encoded
    together (one product per site and step, ``PreparedClamp.key``), at their own rows only:
    in one batch, a clamp at every position, the same clamp at chosen positions, one with
    other targets, a TopK clamp twice (all positions, chosen ones) and an unsteered request
    each equal transformers with their own edit."""
    path, sae = saes["resid"]
    topk_path, topk = saes["topk"]
    ids = tiny_llm.get_tokenizer().encode(PROMPT)
    n = len(ids)
    chosen = [1, 4, n, n + 2]
    features = [11, 300]
    index = torch.tensor(features)
    top_features = inside_and_outside(topk, tiny_ref.points(ids)[("resid_post", 2)])

    def clamping(targets, keep=lambda p: True):
        def edit(x):
            with torch.no_grad():
                delta = (torch.tensor(targets) - sae.encode(x)[:, index]) @ sae.W_dec[index]
            rows = torch.tensor([keep(p) for p in range(x.shape[0])])
            return x + delta * rows[:, None]
        return edit

    at = lambda p: p in chosen  # noqa: E731
    cases = [  # (the request's steering, the transformers edit at resid_post 2)
        ([{"sae": str(path), "feature": features, "clamp": [6.0, 0.0]}],
         clamping([6.0, 0.0])),
        ([{"sae": str(path), "feature": features, "clamp": [6.0, 0.0],
           "position_indices": chosen}], clamping([6.0, 0.0], at)),
        ([{"sae": str(path), "feature": features, "clamp": [0.0, 5.0]}],
         clamping([0.0, 5.0])),
        ([{"sae": str(topk_path), "feature": top_features, "clamp": [0.0, 8.0]}],
         topk_clamp(topk, top_features, [0.0, 8.0])),
        ([{"sae": str(topk_path), "feature": top_features, "clamp": [0.0, 8.0],
           "position_indices": chosen}], topk_clamp(topk, top_features, [0.0, 8.0], at)),
        (None, None),
    ]
    outs = tiny_llm.generate([{"prompt_token_ids": ids}] * len(cases), [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                       extra_args=None if vectors is None
                       else {"apply_steering_vectors": vectors}) for vectors, _ in cases])
    found = []
    for out, (_, edit) in zip(outs, cases):
        assert out.lens_error is None
        tokens = list(out.outputs[0].token_ids)
        assert tokens == tiny_ref.point_greedy(
            ids, 8, {} if edit is None else {("resid_post", 2): edit})
        found.append(tokens)
    assert len({tuple(t) for t in found}) >= 4  # the edits differ, and they mattered
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_clamping_topk_features_equals_transformers_with_the_same_edit(tiny_llm, tiny_ref,
                                                                      saes):
    """A TopK SAE's clamp: the worker encodes each steered row in full with the SAE it holds
    for the request (whether a feature is among the top k depends on every other) and adds
    ``decode(f') - decode(f)``; tokens and the next layer's rows equal transformers with
    that edit in a hook, for a feature raised where it is outside a row's top k and one
    lowered where it is inside, plain and with ``rescale_acts_by_decoder_norm`` (at chosen
    positions); a request without steering in the same batch is untouched; a preset cannot
    keep such a clamp."""
    path, sae = saes["topk"]
    ids = tiny_llm.get_tokenizer().encode(PROMPT)
    n = len(ids)
    # One feature in the top k at some prompt positions (lowered there), one in none (raised).
    features = inside_and_outside(sae, tiny_ref.points(ids)[("resid_post", 2)])
    targets = [0.0, 8.0]
    item = {"sae": str(path), "feature": features, "clamp": targets}
    rows = {"output_residual_stream": [3]}
    clamped, beside = tiny_llm.generate([{"prompt_token_ids": ids}] * 2, [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                       extra_args={"apply_steering_vectors": [item], **rows}),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args=rows)])
    assert clamped.lens_error is None and beside.lens_error is None
    hooked = {("resid_post", 2): topk_clamp(sae, features, targets)}
    tokens = list(clamped.outputs[0].token_ids)
    assert tokens == tiny_ref.point_greedy(ids, 8, hooked)
    expected = tiny_ref.points((ids + tokens)[:-1], hooked)[("resid_post", 3)]
    torch.testing.assert_close(clamped.activations["residual_stream"][0], expected,
                               rtol=1e-4, atol=1e-4)
    plain = list(beside.outputs[0].token_ids)
    assert plain == tiny_ref.point_greedy(ids, 8, {}) and plain != tokens  # it mattered
    expected = tiny_ref.points((ids + plain)[:-1])[("resid_post", 3)]
    torch.testing.assert_close(beside.activations["residual_stream"][0], expected,
                               rtol=1e-4, atol=1e-4)
    rescaled_path, rescaled = saes["rescaled"]
    chosen = [2, 5, n + 1]
    (out,) = tiny_llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, extra_args={"apply_steering_vectors": [
            {**item, "sae": str(rescaled_path), "position_indices": chosen}]}))
    assert out.lens_error is None
    assert list(out.outputs[0].token_ids) == tiny_ref.point_greedy(ids, 8, {
        ("resid_post", 2): topk_clamp(rescaled, features, targets, lambda p: p in chosen)})
    with pytest.raises(LensRequestError) as bad:
        tiny_llm.register_steering("topk", [item])
    assert bad.value.field == "presets.topk[0].clamp"
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]
