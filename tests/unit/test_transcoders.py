"""Transcoders read from sae-lens' files and Gemma Scope 2's compute what sae-lens computes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.saes import saved_transcoder
from vllm_lens.saes import SAE, SAEFormatError, load_sae

ARCHITECTURES = ("transcoder", "skip_transcoder", "jumprelu_transcoder",
                 "jumprelu_skip_transcoder")


def _rows(n=12, d=16, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_sae_lens_transcoders_encode_decode_and_predict_as_sae_lens(tmp_path, architecture):
    reference = saved_transcoder(tmp_path / "t", architecture, layer=3, d_in=16, d_sae=64,
                                 scale=0.5)
    tc = load_sae(tmp_path / "t")
    assert (tc.layout, tc.architecture, tc.point, tc.layer, tc.out_point, tc.d_out) == (
        "sae-lens", architecture, "mlp_in", 3, "mlp_out", 16)
    assert tc.is_transcoder and tc.hook_name_out == "blocks.3.hook_mlp_out"
    x = _rows()
    with torch.no_grad():
        expected = reference.encode(x)
        features = tc.encode(x)
        torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
        assert (features != 0).any() and (features == 0).any()
        torch.testing.assert_close(tc.decode(features), reference.decode(expected))
        torch.testing.assert_close(tc.forward(x), reference.forward(x), rtol=1e-5, atol=1e-5)
        y = _rows(seed=1)
        found = tc.top_features(x, 8, reconstruction=True, target=y)
        predicted = reference.forward(x)
        nmse = (y - predicted).pow(2).sum(-1) / y.pow(2).sum(-1)
        torch.testing.assert_close(found["nmse"], nmse, rtol=1e-5, atol=1e-6)
        assert found["l0"].tolist() == (expected > 0).sum(-1).tolist()
        top = expected.topk(8)
        torch.testing.assert_close(found["values"], top.values * (top.values > 0))
    with pytest.raises(ValueError, match="pass its rows as target"):
        tc.top_features(x, 8, reconstruction=True)


def test_gemma_scope_2_transcoders_read_as_sae_lens_loads_them(tmp_path):
    """Gemma Scope 2's own files (config.json + params.safetensors, lower-case names, the skip
    connection stored [d_in, d_out]) give what sae-lens computes from them."""
    reference = saved_transcoder(tmp_path / "t", "jumprelu_skip_transcoder", layer=5, d_in=16,
                                 d_sae=64, scale=0.5)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    folder = tmp_path / "layer_5_width_64"
    folder.mkdir()
    save_file({"w_enc": state["W_enc"], "w_dec": state["W_dec"], "b_enc": state["b_enc"],
               "b_dec": state["b_dec"], "threshold": state["threshold"],
               "affine_skip_connection": state["W_skip"].T.contiguous()},
              folder / "params.safetensors")
    cfg = {"architecture": "jump_relu", "model_name": "gemma-v3-270m-pt",
           "hf_hook_point_in": "model.layers.5.pre_feedforward_layernorm.output",
           "hf_hook_point_out": "model.layers.5.post_feedforward_layernorm.output",
           "affine_connection": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    tc = load_sae(folder)
    assert (tc.layout, tc.architecture, tc.point, tc.layer, tc.out_point) == (
        "gemma-scope-2", "jumprelu_skip_transcoder", "mlp_in", 5, "mlp_out")
    x = _rows()
    with torch.no_grad():
        torch.testing.assert_close(tc.forward(x), reference.forward(x), rtol=1e-5, atol=1e-5)
    # A Gemma Scope 2 SAE (no output point) is a JumpReLU SAE at its point.
    del cfg["hf_hook_point_out"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEFormatError, match="affine_skip_connection without"):
        load_sae(folder)
    save_file({"w_enc": state["W_enc"], "w_dec": torch.randn(64, 16), "b_enc": state["b_enc"],
               "b_dec": torch.zeros(16), "threshold": state["threshold"]},
              folder / "params.safetensors")
    cfg["hf_hook_point_in"] = "model.layers.5.output"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEFormatError, match="affine_connection=True but params.safetensors "
                                             "lacks affine_skip_connection"):
        load_sae(folder)
    cfg["affine_connection"] = False
    (folder / "config.json").write_text(json.dumps(cfg))
    sae = load_sae(folder)
    assert (sae.architecture, sae.point, sae.layer, sae.is_transcoder) == (
        "jumprelu", "resid_post", 5, False)


def test_transcoders_that_do_not_stand_in_for_one_mlp_are_refused_by_name(tmp_path):
    saved_transcoder(tmp_path / "t", "transcoder", layer=2, d_in=16, d_sae=32)
    cfg_path = tmp_path / "t" / "cfg.json"
    cfg = json.loads(cfg_path.read_text())
    for metadata, problem in [
            ({"hook_name_out": "blocks.3.hook_mlp_out"}, "stand in for one layer's MLP"),
            ({"hook_name_out": "blocks.2.hook_resid_post"}, "stand in for one layer's MLP"),
            ({"hook_name": "blocks.2.hook_resid_post"}, "stand in for one layer's MLP"),
            ({"hook_name_out": None}, "must say which point it predicts"),
            ({"hook_name_out": None, "hf_hook_name_out": "model.layers.2.mlp.output"},
             "not a module output vllm-lens reads")]:
        cfg_path.write_text(json.dumps({**cfg, "metadata": {**cfg["metadata"], **metadata}}))
        with pytest.raises(SAEFormatError, match=problem):
            load_sae(tmp_path / "t")
    # The Hugging Face form of the names reads as the TransformerLens form.
    cfg_path.write_text(json.dumps({**cfg, "metadata": {
        "hf_hook_name": "model.layers.2.mlp.input",
        "hf_hook_name_out": "model.layers.2.post_feedforward_layernorm.output"}}))
    tc = load_sae(tmp_path / "t")
    assert (tc.hook_name, tc.hook_name_out) == ("blocks.2.hook_mlp_in", "blocks.2.hook_mlp_out")
    # Shapes that disagree, and the flag sae-lens refuses for transcoders.
    cfg_path.write_text(json.dumps({**cfg, "d_out": 17}))
    with pytest.raises(SAEFormatError, match="d_out=17 but the weights have 16"):
        load_sae(tmp_path / "t")
    with pytest.raises(ValueError, match="apply_b_dec_to_input must be false"):
        SAE(architecture="transcoder", W_enc=torch.zeros(4, 8), b_enc=torch.zeros(8),
            W_dec=torch.zeros(8, 6), b_dec=torch.zeros(6), layout="mine")
    with pytest.raises(ValueError, match="needs W_skip"):
        SAE(architecture="skip_transcoder", W_enc=torch.zeros(4, 8), b_enc=torch.zeros(8),
            W_dec=torch.zeros(8, 6), b_dec=torch.zeros(6), layout="mine",
            apply_b_dec_to_input=False)


def test_feature_labels_read_from_either_form_and_bad_files_are_named(tmp_path):
    from vllm_lens.saes.labels import label_file, labels_for, read_labels

    assert read_labels(tmp_path) is None and label_file(tmp_path) is None
    (tmp_path / "explanations.json").write_text(json.dumps([
        {"index": "4", "description": "first"}, {"index": 9, "description": "nine"},
        {"index": "4", "description": "second"}]))
    assert read_labels(tmp_path) == {4: "first", 9: "nine"}  # a feature's first description
    (tmp_path / "labels.json").write_text(json.dumps({"2": "two", "9": "plain nine"}))
    assert read_labels(tmp_path) == {2: "two", 9: "plain nine"}  # labels.json first
    assert labels_for({2: "two", 9: "nine"}, torch.tensor([[9, -1], [3, 9]])) == {9: "nine"}
    for text, problem in (("{", "not a JSON labels file"), ("[1, 2]", "Neuronpedia"),
                          ('{"x": "a"}', "'x' is not a feature index"),
                          ('{"1": 3}', "label of feature 1 is not a string")):
        (tmp_path / "labels.json").write_text(text)
        with pytest.raises(ValueError, match=problem) as info:
            read_labels(tmp_path)
        assert "labels.json" in str(info.value)


def test_a_transcoder_asked_for_to_replace_is_not_unloaded_within_the_grace_period(tmp_path):
    """A transcoder loaded for a replacement (``pin``) is kept for ten minutes: a load
    that needs its room is refused instead (its admitted request's salt promises the
    replacement); an SAE pinned for a column clamp is not kept so."""
    from tests.integration.saes import saved_sae
    from vllm_lens.worker.saes import SAERegistry

    saved_transcoder(tmp_path / "t", "transcoder", layer=1, d_in=16, d_sae=64)
    saved_sae(tmp_path / "s", "standard", "blocks.1.hook_resid_post", d_in=16)
    saved_sae(tmp_path / "u", "standard", "blocks.2.hook_resid_post", d_in=16)
    size = max(load_sae(tmp_path / name).nbytes for name in "tsu")
    now = [0.0]
    registry = SAERegistry(max_bytes=size + 1, grace_s=60, clock=lambda: now[0])
    cpu = torch.device("cpu")
    registry.load(str(tmp_path / "t"), None, cpu, held=set(), pin=True)
    with pytest.raises(ValueError, match="just admitted"):
        registry.load(str(tmp_path / "s"), None, cpu, held=set())
    assert registry.get(str(tmp_path / "t"), None) is not None
    now[0] = 61.0  # past the admission grace, still pinned
    with pytest.raises(ValueError, match="just admitted"):
        registry.load(str(tmp_path / "s"), None, cpu, held=set())
    now[0] = 601.0  # its request has started (and holds it) or is long gone
    registry.load(str(tmp_path / "s"), None, cpu, held=set(), pin=True)  # a column clamp
    assert registry.get(str(tmp_path / "t"), None) is None
    now[0] = 700.0  # (past s's admission grace)
    registry.load(str(tmp_path / "u"), None, cpu, held=set())
    assert registry.get(str(tmp_path / "s"), None) is None


def test_replace_mlp_parses_travels_and_salts_by_what_it_changes():
    """``replace_mlp`` against a described transcoder: its spec travels to the workers
    unchanged; the prefix-cache salt tells replaced requests from plain ones, and apart by
    transcoder version, ``keep_error`` and clamp; ``keep_error`` without a clamp changes
    nothing, so it is not salted; bad clamps are refused by field."""
    from vllm_lens.errors import LensRequestError
    from vllm_lens.spec import LensRequest, ModelFacts, parse_extra_args

    facts = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=128,
                       max_model_len=1024, mapped=True, sites=("pre", "mid", "mlp_in", "post"))
    info = {"path": "/t/a", "point": "mlp_in", "layer": 1, "d_in": 128, "d_sae": 512,
            "architecture": "transcoder", "out_point": "mlp_out", "d_out": 128,
            "version": [5]}

    def describe(sae, hook_point, clamp=False):
        return info

    describe.sae_slice = None  # (an offline describer has it; the parse asks clamp=True)

    def lens(value, **changed):
        info.update(changed)
        return parse_extra_args({"replace_mlp": value}, lambda: facts, saes=describe)[1]

    replaced = lens([{"transcoder": "a", "keep_error": False}])
    (spec,) = replaced.replace_mlp
    assert (spec.point, spec.layer, spec.keep_error, spec.version) == ("mlp_in", 1, False, (5,))
    assert LensRequest.from_payload(replaced.to_payload()).replace_mlp == replaced.replace_mlp
    salts = {replaced.cache_salt,
             lens({"transcoder": "a", "keep_error": True, "clamp": {"3": 1.0}}).cache_salt,
             lens({"transcoder": "a", "keep_error": True, "clamp": {"3": 2.0}}).cache_salt,
             lens({"transcoder": "a", "keep_error": False}, version=[6]).cache_salt}
    assert len(salts) == 4 and None not in salts
    assert lens({"transcoder": "a", "keep_error": True}).cache_salt is None
    clamped = lens({"transcoder": "a", "keep_error": True, "clamp": {"40": 0.5, "3": 1}})
    assert clamped.replace_mlp[0].clamp == ((3, 1.0), (40, 0.5))
    for clamp, problem in (({"²": 1.0}, "not a feature"), ({"512": 1.0}, "not a feature"),
                           ({"3": 1e39}, "float32's range"), ({}, "a map of feature")):
        with pytest.raises(LensRequestError, match=problem):
            lens({"transcoder": "a", "keep_error": True, "clamp": clamp})
