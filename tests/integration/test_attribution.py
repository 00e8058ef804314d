"""Direct feature attribution served by a real engine (the tiny Llama, chunked prefill): each
returned feature's ``logit_attribution`` equals the same formula on transformers' rows and
weights — ``value * (W_dec[i] * w) . W_U[t] / s`` with ``w`` the final RMSNorm's weight and
``s`` the position's own norm scale — for an SAE on the stream, one on ``attn_out`` and a
transcoder, onto the next token (prompt, then sampled) and onto a named token; bad requests
are refused by field while the engine serves on."""

from __future__ import annotations

import math

import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import IDLE, held
from tests.integration.saes import saved_sae, saved_transcoder
from vllm_lens import LensRequestError

PROMPT = "Once upon a time in a quiet village by the sea, an old fisherman mended his nets."


@pytest.fixture(scope="module")
def dictionaries(tmp_path_factory):
    root = tmp_path_factory.mktemp("attribution")
    return {
        "resid": (root / "resid", saved_sae(root / "resid", "jumprelu",
                                             "blocks.2.hook_resid_post")),
        "attn": (root / "attn", saved_sae(root / "attn", "standard", "blocks.1.hook_attn_out")),
        "last": (root / "last", saved_sae(root / "last", "topk", "blocks.3.hook_resid_post",
                                           k=16, rescale_acts_by_decoder_norm=True)),
        "transcoder": (root / "tc", saved_transcoder(root / "tc", "transcoder", 1)),
        "z": (root / "z", saved_sae(root / "z", "standard", "blocks.1.attn.hook_z")),
    }


def _reference(ref, ids, found, sae, token=None):
    """The formula on transformers' rows: the last layer's output, the final norm's weight and
    epsilon, the LM head's rows."""
    model = ref.model
    n_layers = model.config.num_hidden_layers
    stream = ref.residual_stream(ids, [n_layers - 1])[0]
    norm = model.model.norm
    scale = (stream.pow(2).mean(-1) + norm.variance_epsilon).sqrt()
    positions = found["positions"]
    following = [token if token is not None else (ids[p + 1] if p + 1 < len(ids) else -1)
                 for p in positions.tolist()]
    w_dec = sae.W_dec.detach()
    if getattr(sae.cfg, "rescale_acts_by_decoder_norm", False):
        w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
    unembed = model.lm_head.weight.detach()
    expected = torch.zeros_like(found["values"])
    for row, (p, t) in enumerate(zip(positions.tolist(), following)):
        for j, (i, v) in enumerate(zip(found["indices"][row].tolist(),
                                       found["values"][row].tolist())):
            if i < 0:
                continue
            expected[row, j] = (v * (w_dec[i] * norm.weight.detach()) @ unembed[t]
                                / scale[p]) if t >= 0 else math.nan
    return expected, following


def test_attribution_equals_the_formula_on_transformers_rows(tiny_llm, tiny_ref, dictionaries):
    """Every position's top features onto the token that follows it (prompt rows across
    chunks, generated rows, the sampled token of the last), for SAEs on resid_post (a middle
    layer and the last: the norm's own site), attn_out, a rescaling TopK and a transcoder;
    and onto one named token."""
    entries = [
        {"sae": str(dictionaries["resid"][0]), "top_k": 8, "attribution": True},
        {"sae": str(dictionaries["attn"][0]), "top_k": 4, "attribution": True,
         "reconstruction": True},
        {"sae": str(dictionaries["last"][0]), "top_k": 16, "attribution": True},
        {"sae": str(dictionaries["transcoder"][0]), "top_k": 8, "attribution": True,
         "reconstruction": True},
        {"sae": str(dictionaries["resid"][0]), "top_k": 8, "attribution": True,
         "attribution_token": 42, "positions": "generated"},
        {"sae": str(dictionaries["resid"][0]), "top_k": 5},  # no attribution beside
    ]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                        extra_args={"output_sae_features": entries})
    plain = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    out, other = tiny_llm.generate([PROMPT, PROMPT + " Then"], [sp, plain])
    assert out.lens_error is None and other.lens_error is None
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    n_rows = len(ids) - 1
    saes = [dictionaries[k][1] for k in ("resid", "attn", "last", "transcoder", "resid")]
    for found, sae, entry in zip(out.sae_features, saes, entries):
        expected, following = _reference(tiny_ref, ids, found, sae,
                                         entry.get("attribution_token"))
        assert found["logit_attribution"].dtype == torch.float32
        assert found["logit_attribution"].shape == found["values"].shape
        assert found["attribution_tokens"].tolist() == following
        assert (found["indices"] >= 0).any() and found["logit_attribution"].abs().sum() > 0
        torch.testing.assert_close(found["logit_attribution"], expected, rtol=1e-3, atol=1e-4)
    # The last position's token is the one sampled from it: every row has one.
    assert out.sae_features[0]["positions"].tolist() == list(range(n_rows))
    assert out.sae_features[0]["attribution_tokens"][-1].item() == ids[-1]
    assert "logit_attribution" not in out.sae_features[-1]
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_bad_attribution_requests_are_refused_by_field(tiny_llm, dictionaries):
    """Points whose decoder rows are not on the stream, token ids outside the vocabulary, a
    token without attribution, streaming, n > 1 without a token: each refused naming the
    field; the engine serves on."""
    resid, z = str(dictionaries["resid"][0]), str(dictionaries["z"][0])
    cases = [
        ({"output_sae_features": {"sae": z, "attribution": True}},
         "output_sae_features.attribution", "attn_z"),
        ({"output_sae_features": {"sae": resid, "attribution": True,
                                  "attribution_token": 10 ** 9}},
         "output_sae_features.attribution_token", "vocabulary"),
        ({"output_sae_features": {"sae": resid, "attribution_token": 3}},
         "output_sae_features.attribution_token", "attribution"),
        ({"output_sae_features": {"sae": resid, "attribution": "yes"}},
         "output_sae_features.attribution", "true or false"),
        ({"output_sae_features": {"sae": resid, "attribution": True},
          "stream_activations": True},
         "output_sae_features.attribution", "stream_activations"),
    ]
    for extra, field, words in cases:
        with pytest.raises(LensRequestError) as caught:
            tiny_llm.generate([PROMPT], SamplingParams(max_tokens=2, extra_args=extra))
        assert caught.value.field == field, (extra, caught.value)
        assert words in str(caught.value), (extra, caught.value)
    with pytest.raises(LensRequestError) as caught:
        tiny_llm.generate([PROMPT], SamplingParams(
            max_tokens=2, n=2, extra_args={"output_sae_features": {"sae": resid,
                                                                   "attribution": True}}))
    assert caught.value.field == "output_sae_features.attribution"
    # With a named token, n > 1 samples are attributed alike.
    outs = tiny_llm.generate([PROMPT], SamplingParams(
        max_tokens=2, n=2, temperature=1.0, extra_args={"output_sae_features": {
            "sae": resid, "attribution": True, "attribution_token": 7}}))
    assert outs[0].lens_error is None
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_component_attribution_sums_to_transformers_logits(tiny_llm, tiny_ref):
    """``output_logit_attribution`` over every layer: the embedding's and each layer's
    attn_out and mlp_out parts sum to the logit transformers computes for the token that
    follows each position (RMSNorm: no bias term), and each part equals the formula on
    transformers' own rows; a subset of layers, a named token and chosen positions give the
    same numbers for what they select, with each head's part (its attn_z through its columns
    of o_proj; the heads sum to attn_out's); a plain request beside is unchanged."""
    n_layers = tiny_ref.model.config.num_hidden_layers
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                        extra_args={"output_logit_attribution": True})
    part = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
        "output_logit_attribution": {"layers": [1, 3], "positions": "generated",
                                     "attribution_token": 42, "heads": True}})
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out, sub, other = tiny_llm.generate([PROMPT] * 3, [sp, part, plain])
    assert out.lens_error is None and sub.lens_error is None
    assert list(other.outputs[0].token_ids) == list(out.outputs[0].token_ids)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    n_rows, n_prompt = len(ids) - 1, len(out.prompt_token_ids)
    found = out.logit_attribution
    assert found["layers"] == list(range(n_layers))
    assert found["positions"].tolist() == list(range(n_rows))
    assert found["tokens"].tolist() == ids[1:]
    assert found["attn_out"].shape == found["mlp_out"].shape == (n_layers, n_rows)
    with torch.no_grad():
        logits = tiny_ref.model(torch.tensor([ids[:n_rows]])).logits[0]
    target = logits[torch.arange(n_rows), torch.tensor(ids[1:])]
    total = found["embed"] + found["attn_out"].sum(0) + found["mlp_out"].sum(0)
    torch.testing.assert_close(total, target, rtol=1e-3, atol=1e-3)

    rows = tiny_ref.points(ids[:n_rows])
    norm, unembed = tiny_ref.model.model.norm, tiny_ref.model.lm_head.weight.detach()
    stream = tiny_ref.residual_stream(ids[:n_rows], [n_layers - 1])[0]
    scale = (stream.pow(2).mean(-1) + norm.variance_epsilon).sqrt()

    def formula(x, tokens):
        u = unembed[tokens] * norm.weight.detach()
        return (x * u).sum(-1) / scale[: x.shape[0]] if x.shape[0] == scale.shape[0] else None

    following = torch.tensor(ids[1:])
    torch.testing.assert_close(found["embed"], formula(rows[("resid_pre", 0)], following),
                               rtol=1e-3, atol=1e-4)
    for layer in range(n_layers):
        for point in ("attn_out", "mlp_out"):
            torch.testing.assert_close(found[point][layer],
                                       formula(rows[(point, layer)], following),
                                       rtol=1e-3, atol=1e-4)
    picked = sub.logit_attribution
    assert picked["layers"] == [1, 3]
    assert picked["positions"].tolist() == list(range(n_prompt, n_rows))
    assert picked["tokens"].tolist() == [42] * (n_rows - n_prompt)
    gen = slice(n_prompt, n_rows)
    u = unembed[42] * norm.weight.detach()
    n_heads, head_dim = rows[("attn_z", 1)].shape[1:]
    assert picked["heads"].shape == (2, n_rows - n_prompt, n_heads)
    for j, layer in enumerate((1, 3)):
        want = (rows[("mlp_out", layer)][gen] * u).sum(-1) / scale[gen]
        torch.testing.assert_close(picked["mlp_out"][j], want, rtol=1e-3, atol=1e-4)
        # Each head: its attn_z through its columns of o_proj (no bias: they sum to attn_out's).
        w_o = tiny_ref.layers[layer].self_attn.o_proj.weight.detach()
        z = rows[("attn_z", layer)][gen]
        for h in range(n_heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            want = ((z[:, h] @ w_o[:, cols].T) * u).sum(-1) / scale[gen]
            torch.testing.assert_close(picked["heads"][j, :, h], want, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(picked["heads"][j].sum(-1), picked["attn_out"][j],
                                   rtol=1e-3, atol=1e-4)
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_over_http_attributions_by_name_equal_offline(smol_server, smol_llm, smol_transcoder):
    """Over HTTP (compiled SmolLM2, tied embeddings) a named transcoder's features with
    attribution and the components' attribution come back (JSON, through ``LensClient``) as
    the offline engine computes them for the same request."""
    from vllm_lens.client import LensClient

    path, _ = smol_transcoder
    prompt = "The capital of France is"
    ask = {"sae": "smol-t5", "top_k": 4, "attribution": True}
    dla = {"layers": [0, 5, 29], "positions": "prompt"}
    with LensClient(smol_server.base_url) as client:
        found = client.generate(prompt, max_tokens=4, sae_features=ask, logit_attribution=dla)
    offline = smol_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, extra_args={
        "output_sae_features": {**ask, "sae": str(path)}, "output_logit_attribution": dla}))[0]
    assert offline.lens_error is None
    assert found.token_ids == list(offline.outputs[0].token_ids)
    (got,), (want,) = found.sae_features, offline.sae_features
    assert torch.equal(got["attribution_tokens"], want["attribution_tokens"])
    assert torch.equal(got["indices"], want["indices"])
    torch.testing.assert_close(got["logit_attribution"], want["logit_attribution"],
                               rtol=1e-3, atol=1e-3)
    components = found.logit_attribution
    assert components["layers"] == [0, 5, 29]
    assert components["positions"].tolist() == list(range(len(found.prompt_token_ids)))
    for key in ("tokens", "positions"):
        assert torch.equal(components[key], offline.logit_attribution[key])
    for key in ("embed", "attn_out", "mlp_out"):
        torch.testing.assert_close(components[key], offline.logit_attribution[key],
                                   rtol=1e-3, atol=1e-3)
        assert torch.isfinite(components[key]).all()
