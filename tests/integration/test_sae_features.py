"""SAE features served by a real engine (the tiny Llama, chunked prefill) equal sae-lens' own
``encode`` of transformers' rows at the SAE's point and layer, prompt and generated rows;
only the top features leave the worker; bad SAEs are refused naming the field, before
anything runs; the engine serves on and holds nothing afterwards."""

from __future__ import annotations

import json

import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import IDLE
from vllm_lens import LensRequestError

PROMPT = "Once upon a time in a quiet village by the sea, an old fisherman mended his nets."


def _saved_sae(path, architecture: str, hook: str, d_in: int = 128, **fields):
    """A sae-lens SAE with random weights at ``hook``, saved to ``path``; returns it."""
    from sae_lens import JumpReLUSAEConfig, StandardSAEConfig, TopKSAEConfig
    from sae_lens.saes.sae import SAE

    config = {"standard": StandardSAEConfig, "jumprelu": JumpReLUSAEConfig,
              "topk": TopKSAEConfig}[architecture]
    cfg = config(d_in=d_in, d_sae=512, dtype="float32", device="cpu", **fields)
    sae = SAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    sae.cfg.metadata.hook_name = hook
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.1)
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(512, generator=g) * 0.05)
    sae.save_model(path)
    return SAE.load_from_disk(path)


@pytest.fixture(scope="module")
def saes(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    return {
        "resid": (root / "resid", _saved_sae(root / "resid", "jumprelu",
                                             "blocks.2.hook_resid_post")),
        "mlp": (root / "mlp", _saved_sae(root / "mlp", "topk", "blocks.1.hook_mlp_out", k=16)),
    }


def _ids(out):
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def test_features_equal_sae_lens_on_transformers_rows(tiny_llm, tiny_ref, saes):
    (resid_path, resid), (mlp_path, mlp) = saes["resid"], saes["mlp"]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": [
            {"sae": str(resid_path), "top_k": 24, "reconstruction": True},
            {"sae": str(mlp_path), "positions": "generated", "top_k": 16}],
        "output_residual_stream": [2]})
    out = tiny_llm.generate([PROMPT], sp)[0]
    assert out.lens_error is None
    ids = _ids(out)
    n_rows = len(ids) - 1  # the last generated token never ran
    expected = tiny_ref.points(ids[:n_rows])
    first, second = out.sae_features
    assert (first["sae"], first["layer"], first["point"]) == (str(resid_path), 2, "resid_post")
    assert first["positions"].tolist() == list(range(n_rows))
    with torch.no_grad():
        dense = resid.encode(expected[("resid_post", 2)])
        recon = resid.decode(dense)
    for row in range(n_rows):
        active = int((dense[row] > 0).sum())
        assert int(first["l0"][row]) == active
        kept = min(active, 24)
        top = dense[row].topk(kept)
        torch.testing.assert_close(first["values"][row, :kept], top.values, rtol=1e-4,
                                   atol=1e-5)
        assert first["indices"][row, :kept].tolist() == top.indices.tolist()
        assert (first["indices"][row, kept:] == -1).all()
    x = expected[("resid_post", 2)]
    torch.testing.assert_close(first["nmse"], (x - recon).pow(2).sum(-1) / x.pow(2).sum(-1),
                               rtol=1e-4, atol=1e-6)
    # The dense rows of the same layer, captured beside it, are the SAE's input.
    torch.testing.assert_close(out.activations["residual_stream"][0], x, rtol=1e-4, atol=1e-4)
    # TopK at mlp_out, generated positions only: k = 16 features each (ReLU'd top-k).
    n_prompt = len(out.prompt_token_ids)
    assert second["positions"].tolist() == list(range(n_prompt, n_rows))
    assert "nmse" not in second and second["indices"].dtype == torch.int32
    with torch.no_grad():
        dense = mlp.encode(expected[("mlp_out", 1)][n_prompt:])
    values, indices = dense.topk(16)
    torch.testing.assert_close(second["values"], values * (values > 0), rtol=1e-4, atol=1e-5)
    active = values > 0
    assert torch.equal(second["indices"][active], indices[active].to(torch.int32))
    assert tiny_llm.collective_rpc("lens_stats") == [IDLE]


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
    _saved_sae(wide, "standard", "blocks.1.hook_resid_post", d_in=64)
    with pytest.raises(LensRequestError, match="rows of 64 values, but this model's"):
        ask({"sae": str(wide)})
    cfg = json.loads((wide / "cfg.json").read_text())
    (wide / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "layer_norm"}))
    with pytest.raises(LensRequestError, match="normalize_activations='layer_norm'"):
        ask({"sae": str(wide)})
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    (out,) = ask({"sae": resid_path, "top_k": 4, "positions": "last_prompt"})
    assert out.sae_features[0]["indices"].shape == (1, 4)
    assert tiny_llm.collective_rpc("lens_stats") == [IDLE]


def test_features_in_compiled_mode_on_smollm2_equal_sae_lens(smol_llm, smol_ref, tmp_path):
    """vLLM's default compiled mode, the trained model: a 4x-wide JumpReLU SAE at layer 10.
    Rows equal transformers' to ~1e-4, so values are compared with that tolerance and each
    returned feature's value with sae-lens' value of the same feature."""
    sae = _saved_sae(tmp_path / "smol", "jumprelu", "blocks.10.hook_resid_post", d_in=576)
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


def test_over_http_sae_features_are_refused_naming_the_field(smol_server, tmp_path):
    """Not served over HTTP yet (a client must never make the server open a path; the
    operator's registry of named SAEs is to come): 400 naming the field, before anything
    is scheduled; the server serves on."""
    import httpx

    _saved_sae(tmp_path / "smol", "standard", "blocks.3.hook_resid_post", d_in=576)
    body = {"prompt": "Hello", "max_tokens": 2,
            "vllm_xargs": {"output_sae_features": json.dumps({"sae": str(tmp_path / "smol")})}}
    r = httpx.post(smol_server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "output_sae_features.sae"
    assert "offline engines" in r.json()["error"]["message"]
    ok = httpx.post(smol_server.base_url + "/v1/completions", timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200
