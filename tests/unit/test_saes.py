"""SAEs read from each layout compute what the library that wrote them computes: sae-lens'
own ``SAE.load_from_disk(...).encode/decode`` for its architectures, sparsify's own
``SparseCoder.encode/decode``, and sae-lens' JumpReLU as it loads Gemma Scope; bad files are
refused naming the file and field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_lens.saes import LAYOUTS, SAEFormatError, load_sae


def _sae_lens(tmp_path, architecture: str, **cfg_fields):
    """A sae-lens SAE with random weights (some features active, some not), saved."""
    from sae_lens.saes.sae import SAE as SaeLensSAE
    from sae_lens import (
        AbsTopKSAEConfig,
        GatedSAEConfig,
        JumpReLUSAEConfig,
        StandardSAEConfig,
        TopKSAEConfig,
    )

    config = {"standard": StandardSAEConfig, "jumprelu": JumpReLUSAEConfig,
              "topk": TopKSAEConfig, "abstopk": AbsTopKSAEConfig,
              "gated": GatedSAEConfig}[architecture]
    hook = cfg_fields.pop("hook_name", "blocks.2.hook_resid_post")
    cfg = config(d_in=16, d_sae=64, dtype="float32", device="cpu", **cfg_fields)
    sae = SaeLensSAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    sae.cfg.metadata.hook_name = hook
    g = torch.Generator().manual_seed(len(architecture))
    with torch.no_grad():
        for name, param in sae.named_parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(64, generator=g))
    path = tmp_path / architecture
    sae.save_model(path)
    return path, SaeLensSAE.load_from_disk(path)


def _rows(n=12, dtype=torch.float32):
    return (torch.randn(n, 16, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)


@pytest.mark.parametrize("architecture, fields", [
    ("standard", {}), ("standard", {"apply_b_dec_to_input": False}), ("jumprelu", {}),
    ("topk", {"k": 8}), ("topk", {"k": 8, "rescale_acts_by_decoder_norm": True}),
    ("abstopk", {"k": 8}), ("abstopk", {"k": 8, "rescale_acts_by_decoder_norm": True}),
    ("gated", {}), ("gated", {"apply_b_dec_to_input": False}),
])
def test_sae_lens_architectures_encode_and_decode_as_sae_lens(tmp_path, architecture, fields):
    path, reference = _sae_lens(tmp_path, architecture, **fields)
    sae = load_sae(path)
    assert (sae.layout, sae.architecture, sae.point, sae.layer) == (
        "sae-lens", architecture, "resid_post", 2)
    assert_encodes_and_decodes_as_sae_lens(sae, reference, _rows())


def assert_encodes_and_decodes_as_sae_lens(sae, reference, x, *, decode_atol=1e-5):
    """``sae`` encodes rows ``x`` (some features active, some not) and decodes its features
    as sae-lens' ``reference`` does; bfloat16 rows are cast up, as sae-lens does with them."""
    with torch.no_grad():
        expected = reference.encode(x)
        features = sae.encode(x)
        torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
        assert (features != 0).any() and (features == 0).any()
        torch.testing.assert_close(sae.decode(features), reference.decode(expected),
                                   rtol=1e-5, atol=decode_atol)
        half = x.to(torch.bfloat16)
        torch.testing.assert_close(sae.encode(half), reference.encode(half.float()),
                                   rtol=1e-5, atol=1e-5)


def test_top_features_are_the_largest_activations_descending_and_padded(tmp_path):
    path, reference = _sae_lens(tmp_path, "jumprelu")
    sae = load_sae(path)
    x = _rows()
    with torch.no_grad():
        dense = reference.encode(x)
        out = sae.top_features(x, 40, reconstruction=True)
        reconstructed = reference.decode(dense)
    assert out["indices"].dtype == torch.int32 and out["values"].dtype == torch.float32
    for row in range(x.shape[0]):
        active = int((dense[row] > 0).sum())
        assert int(out["l0"][row]) == active
        values, indices = out["values"][row], out["indices"][row]
        if active < 40:  # fewer active than asked: padded with -1 / 0 at the end
            assert (indices[active:] == -1).all() and (values[active:] == 0).all()
        kept = min(active, 40)
        assert torch.equal(values[:kept], dense[row].sort(descending=True).values[:kept])
        torch.testing.assert_close(dense[row][indices[:kept].long()], values[:kept])
    nmse = (x - reconstructed).pow(2).sum(-1) / x.pow(2).sum(-1)
    torch.testing.assert_close(out["nmse"], nmse)
    with pytest.raises(ValueError, match="top_k must be between 1 and d_sae=64"):
        sae.top_features(x, 65)


def test_abstopk_top_features_rank_by_magnitude_and_keep_signs(tmp_path):
    """An AbsTopK SAE's features may be negative: the top features are the largest in
    magnitude, signed, and ``l0`` counts the non-zero ones; a gated SAE's gate zeroes
    features whose magnitude path alone would be positive."""
    path, reference = _sae_lens(tmp_path, "abstopk", k=8)
    sae = load_sae(path)
    x = _rows()
    with torch.no_grad():
        dense = reference.encode(x)
        out = sae.top_features(x, 5, reconstruction=True)
    assert (dense < 0).any()  # some kept feature is negative
    top = dense.abs().topk(5)
    torch.testing.assert_close(out["values"], dense.gather(-1, top.indices))
    assert out["indices"].tolist() == top.indices.to(torch.int32).tolist()
    assert out["l0"].tolist() == [8] * x.shape[0]
    gated_path, gated = _sae_lens(tmp_path, "gated")
    mine = load_sae(gated_path)
    with torch.no_grad():
        sae_in = x - gated.b_dec
        magnitude = (sae_in @ (gated.W_enc * gated.r_mag.exp()) + gated.b_mag).relu()
        gate_closed = (sae_in @ gated.W_enc + gated.b_gate) <= 0
        assert bool((gate_closed & (magnitude > 0)).any())  # the gate matters here
        assert bool((mine.encode(x)[gate_closed] == 0).all())


def test_a_matryoshka_batchtopk_sae_saved_for_inference_is_a_jumprelu_sae(tmp_path):
    """sae-lens saves a (Matryoshka) BatchTopK SAE for inference as JumpReLU with its
    threshold: it loads and encodes as sae-lens loads it."""
    from sae_lens.saes.matryoshka_batchtopk_sae import (
        MatryoshkaBatchTopKTrainingSAE,
        MatryoshkaBatchTopKTrainingSAEConfig,
    )
    from sae_lens.saes.sae import SAE as SaeLensSAE

    cfg = MatryoshkaBatchTopKTrainingSAEConfig(d_in=16, d_sae=64, k=8,
                                               matryoshka_widths=[16, 64], dtype="float32",
                                               device="cpu")
    training = MatryoshkaBatchTopKTrainingSAE(cfg)
    training.cfg.metadata.hook_name = "blocks.1.hook_resid_post"
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in training.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
        training.topk_threshold.fill_(0.4)
    training.save_inference_model(tmp_path / "matryoshka")
    reference = SaeLensSAE.load_from_disk(tmp_path / "matryoshka")
    sae = load_sae(tmp_path / "matryoshka")
    assert (sae.architecture, sae.point, sae.layer) == ("jumprelu", "resid_post", 1)
    assert_encodes_and_decodes_as_sae_lens(sae, reference, _rows())


def test_hook_z_saes_read_flattened_heads(tmp_path):
    path, reference = _sae_lens(tmp_path, "standard", hook_name="blocks.0.attn.hook_z",
                                reshape_activations="hook_z")
    sae = load_sae(path)
    assert (sae.point, sae.layer) == ("attn_z", 0)
    x = _rows()  # 4 heads of 4: sae-lens takes [n, heads, d_head], vllm-lens' rows flat
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(x), reference.encode(x.view(-1, 4, 4)))


def test_sparsify_saes_encode_and_decode_as_sparsify(tmp_path):
    from sparsify import SparseCoder, SparseCoderConfig
    from sparsify.utils import eager_decode

    torch.manual_seed(1)
    reference = SparseCoder(16, SparseCoderConfig(num_latents=64, k=8), device="cpu")
    with torch.no_grad():
        reference.b_dec.copy_(torch.randn(16) * 0.3)
        reference.encoder.bias.copy_(torch.randn(64) * 0.3)
    reference.save_to_disk(tmp_path / "layers.3")
    sae = load_sae(tmp_path / "layers.3")  # sparsify's folder name says the layer
    assert (sae.layout, sae.architecture, sae.k, sae.point, sae.layer) == (
        "sparsify", "topk", 8, "resid_post", 3)
    x = _rows()
    with torch.no_grad():
        top = reference.encode(x)
        dense = torch.zeros(x.shape[0], 64).scatter_(-1, top.top_indices, top.top_acts)
        torch.testing.assert_close(sae.encode(x), dense, rtol=1e-5, atol=1e-5)
        # SparseCoder.decode, with its eager kernel (its Triton one needs a GPU driver).
        decoded = eager_decode(top.top_indices, top.top_acts, reference.W_dec.mT)
        torch.testing.assert_close(sae.decode(dense), decoded + reference.b_dec,
                                   rtol=1e-5, atol=1e-5)
    assert load_sae(tmp_path / "layers.3", "blocks.5.hook_mlp_out").point == "mlp_out"


def test_gemma_scope_params_read_as_sae_lens_loads_them(tmp_path):
    """sae-lens loads Gemma Scope's params.npz as a JumpReLU SAE that does not subtract b_dec
    from its input: the same weights saved that way compute the same features."""
    path, _ = _sae_lens(tmp_path, "jumprelu", apply_b_dec_to_input=False)
    from sae_lens.saes.sae import SAE as SaeLensSAE

    reference = SaeLensSAE.load_from_disk(path)
    weights = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    (tmp_path / "gs").mkdir()
    np.savez(tmp_path / "gs" / "params.npz", **weights)
    with pytest.raises(SAEFormatError, match="does not say where it reads"):
        load_sae(tmp_path / "gs")
    sae = load_sae(tmp_path / "gs", "blocks.2.hook_resid_post")
    assert (sae.layout, sae.architecture, sae.apply_b_dec_to_input) == (
        "gemma-scope", "jumprelu", False)
    x = _rows()
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(x), reference.encode(x))


def test_files_that_are_not_an_sae_are_refused_by_name(tmp_path):
    with pytest.raises(SAEFormatError, match="holds no SAE layout") as info:
        load_sae(tmp_path)
    for layout, files in LAYOUTS.items():
        assert layout in str(info.value) and all(f in str(info.value) for f in files)
    path, _ = _sae_lens(tmp_path, "standard")
    cfg = json.loads((path / "cfg.json").read_text())
    for field, value, problem in [
            ("normalize_activations", "layer_norm", "normalize_activations='layer_norm'"),
            ("architecture", "batchtopk", "save it for inference"),
            ("architecture", "matryoshka_batchtopk", "save it for inference"),
            ("architecture", "matching_pursuit", "matching pursuit.*not served yet"),
            ("architecture", "temporal", "earlier rows of its sequence"),
            ("architecture", "jumprelu_skip_transcoder", "apply_b_dec_to_input=true"),
            ("architecture", "hybrid", "not one vllm-lens serves"),
            ("d_sae", 65, "d_sae=65 but the weights have 64")]:
        (path / "cfg.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(SAEFormatError, match=problem):
            load_sae(path)
    (path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEFormatError, match="'blocks.2.hook_nowhere'"):
        load_sae(path, "blocks.2.hook_nowhere")
    with pytest.raises(SAEFormatError, match="names no layer"):
        load_sae(path, "hook_resid_post")
    save_file({"W_enc": torch.zeros(16, 64)}, str(path / "sae_weights.safetensors"))
    with pytest.raises(SAEFormatError, match="lacks b_enc, W_dec, b_dec"):
        load_sae(path)


def test_a_cfg_without_architecture_is_said_or_refused(tmp_path, caplog):
    """A minimal cfg (d_in, d_sae, hook_name) reads as sae-lens' default, standard, and the
    log says so; where the weights hold another architecture's tensors (a JumpReLU
    threshold) it is refused, naming the tensor and the key to add."""
    import logging

    path, _ = _sae_lens(tmp_path / "standard", "standard")
    minimal = {"d_in": 16, "d_sae": 64, "hook_name": "blocks.1.hook_resid_post"}
    (path / "cfg.json").write_text(json.dumps(minimal))
    with caplog.at_level(logging.WARNING, logger="vllm_lens.saes.formats"):
        assert load_sae(path).architecture == "standard"
    assert "names no architecture" in caplog.text and "'standard'" in caplog.text
    path, _ = _sae_lens(tmp_path / "jumprelu", "jumprelu")
    (path / "cfg.json").write_text(json.dumps(minimal))
    with pytest.raises(SAEFormatError, match="holds 'threshold'.*\"architecture\": "
                       "\"jumprelu\""):
        load_sae(path)


def test_a_worker_keeps_saes_within_its_budget_and_never_unloads_a_held_one(tmp_path):
    from vllm_lens.worker.saes import SAERegistry

    paths = [_sae_lens(tmp_path / f"s{i}", "standard")[0] for i in range(3)]
    size = load_sae(paths[0]).nbytes  # 16 x 64 encoder and decoder, float32
    now = [0.0]
    registry = SAERegistry(max_bytes=2 * size, grace_s=60, clock=lambda: now[0])
    cpu = torch.device("cpu")
    # One asked for in the last minute was loaded for a request maybe not started yet: the
    # others go first, even more recently used ones (a running request's step used 0).
    registry.load(str(paths[0]), None, cpu, held=set())
    now[0] = 100.0
    registry.load(str(paths[1]), None, cpu, held=set())
    registry.get(str(paths[0]), None)  # least recently used: 1, but asked for at 100
    now[0] = 101.0
    registry.load(str(paths[2]), None, cpu, held=set())
    assert registry.get(str(paths[0]), None) is None
    # Only recently asked ones left: the least recently used goes rather than refusing.
    registry.load(str(paths[0]), None, cpu, held=set())
    assert registry.get(str(paths[1]), None) is None and len(registry) == 2
    registry = SAERegistry(max_bytes=2 * size, grace_s=0)
    first = registry.load(str(paths[0]), None, cpu, held=set())
    assert registry.load(str(paths[0]), None, cpu, held=set()) is first  # loaded once
    registry.load(str(paths[1]), None, cpu, held=set())
    # A third: the least recently used one no request holds is unloaded for it.
    registry.load(str(paths[2]), None, cpu, held={registry.key(str(paths[0]), None)})
    assert registry.get(str(paths[0]), None) is first and registry.get(str(paths[1]), None) is None
    held = {registry.key(str(p), None) for p in (paths[0], paths[2])}
    with pytest.raises(ValueError, match="VLLM_LENS_SAE_MAX_BYTES"):
        registry.load(str(paths[1]), None, cpu, held=held)
    assert len(registry) == 2 and registry.nbytes == 2 * size
    # A rank that does not capture the SAE's layer describes it without keeping it.
    other = SAERegistry(max_bytes=2 * size, grace_s=0)
    info = other.describe(str(paths[1]), None, cpu, held=set(), wanted=lambda sae: False)
    assert (info["d_in"], info["d_sae"], info["point"], info["layer"]) == (16, 64, "resid_post", 2)
    assert len(other) == 0
    assert other.describe(str(paths[1]), None, cpu, set(), lambda sae: False) is info
    # Wanted there later (a request clamps its TopK features): loaded then.
    kept = other.describe(str(paths[1]), None, cpu, set(), lambda info: info["layer"] == 2)
    assert len(other) == 1 and kept["hook_point"] is None
    assert tuple(kept["version"]) == other.version(*other.key(str(paths[1]), None))


def test_sae_feature_requests_parse_travel_and_are_admitted_by_size(monkeypatch, tmp_path):
    from vllm_lens.frontend.admission import capture_reservation, check_admission
    from vllm_lens.errors import LensRequestError
    from vllm_lens.spec import LensRequest, ModelFacts, parse_extra_args

    facts = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=128,
                       max_model_len=1024, mapped=True)
    info = {"path": "/saes/a", "point": "resid_post", "layer": 2, "d_in": 128, "d_sae": 512}
    asked = []

    def describe(sae, hook_point):
        asked.append((sae, hook_point))
        return info

    _, lens = parse_extra_args({"output_sae_features": json.dumps(
        {"sae": "a", "top_k": 8, "positions": "generated", "reconstruction": True})},
        lambda: facts, saes=describe)
    (spec,) = lens.saes
    assert asked == [("a", None)] and (spec.layer, spec.point, spec.width) == (2, "resid_post", 18)
    assert LensRequest.from_payload(lens.to_payload()).saes == lens.saes
    (capture,) = lens.sae_captures
    assert capture.signal.startswith("sae:") and capture.signal.endswith(":resid_post")
    assert capture.layers == (2,) and lens.captures == ()
    # Reserved and admitted as 18 float32 values per generated position, not 128.
    assert capture_reservation(lens, facts, prompt_len=10, max_tokens=100) == 100 * 18 * 4
    check_admission(lens, facts, 10, 100, 1)
    monkeypatch.setenv("VLLM_LENS_SINKS", json.dumps({"s": {"root": str(tmp_path)}}))
    sink = {"sink": "s", "dataset": "d", "key": "k"}
    # Written to a sink beside the rows (or alone), at the rows' positions, unreduced.
    assert parse_extra_args({"output_sae_features": {"sae": "a"}, "output_residual_stream": [1],
                             "capture_sink": sink}, lambda: facts, saes=describe)[1].sink
    assert parse_extra_args({"output_sae_features": {"sae": "a", "positions": "prompt"},
                             "capture_sink": sink}, lambda: facts, saes=describe)[1].saes
    with pytest.raises(LensRequestError, match=r"entry 0 \(a\) needs the rows' positions"):
        parse_extra_args({"output_sae_features": {"sae": "a", "positions": "prompt"},
                          "output_residual_stream": [1], "capture_sink": sink},
                         lambda: facts, saes=describe)
    with pytest.raises(LensRequestError, match="resid_post is reduced"):
        parse_extra_args({"output_sae_features": {"sae": "a"}, "capture_sink": sink,
                          "output_activations": {"resid_post": {"layers": [1], "reduce": "mean"}}},
                         lambda: facts, saes=describe)
    # Streamed alone (no dense capture); not from the end of the generation.
    assert parse_extra_args({"output_sae_features": {"sae": "a"}, "stream_activations": True},
                            lambda: facts, saes=describe)[1].stream
    with pytest.raises(LensRequestError, match=r"output_sae_features entry 0 \(a\)'s "
                       "positions 'generated.-2:.' are counted from the end"):
        parse_extra_args({"output_sae_features": {"sae": "a", "positions": "generated[-2:]"},
                          "stream_activations": True}, lambda: facts, saes=describe)
    with pytest.raises(LensRequestError, match="does not serve SAE features") as refused:
        parse_extra_args({"output_sae_features": {"sae": "a"}}, lambda: facts)
    assert refused.value.field == "output_sae_features.sae"
    with pytest.raises(LensRequestError, match="at most 8 SAEs") as refused:
        parse_extra_args({"output_sae_features": [{"sae": str(i)} for i in range(9)]},
                         lambda: facts, saes=describe)
    assert refused.value.field == "output_sae_features"
    import dataclasses

    from vllm_lens.errors import UnsupportedConfigError

    for parallel in ({"tp_size": 2}, {"pp_size": 2}):  # served (tests/integration)
        parse_extra_args({"output_sae_features": {"sae": "a"}},
                         lambda: dataclasses.replace(facts, **parallel), saes=describe)
    info.update(point="mlp_post", d_in=256)  # split across TP ranks: refused
    with_mlp = dataclasses.replace(facts, sites=("pre", "post", "act"), d_mlp=256)
    parse_extra_args({"output_sae_features": {"sae": "a"}}, lambda: with_mlp, saes=describe)
    with pytest.raises(UnsupportedConfigError, match="splits across ranks") as refused:
        parse_extra_args({"output_sae_features": {"sae": "a"}},
                         lambda: dataclasses.replace(with_mlp, tp_size=2), saes=describe)
    assert refused.value.field == "output_sae_features.sae"


def test_configs_from_before_sae_lens_6_read_as_sae_lens_reads_them(tmp_path):
    """A 4.x/5.x cfg (no metadata; hook_point; activation_fn_str) is a TopK SAE when its
    activation is topk, as sae-lens itself loads it."""
    from sae_lens.saes.sae import SAE as SaeLensSAE

    path, _ = _sae_lens(tmp_path, "standard")
    cfg = json.loads((path / "cfg.json").read_text())
    old = {k: v for k, v in cfg.items() if k not in ("metadata", "architecture")}
    old.update(hook_point="blocks.2.hook_resid_post", activation_fn_str="topk",
               activation_fn_kwargs={"k": 4}, sae_lens_training_version="4.0.0")
    (path / "cfg.json").write_text(json.dumps(old))
    reference = SaeLensSAE.load_from_disk(path)
    sae = load_sae(path)
    assert (sae.architecture, sae.k, sae.point, sae.layer) == ("topk", 4, "resid_post", 2)
    x = _rows()
    with torch.no_grad():
        expected = reference.encode(x)
        assert int((expected > 0).sum(-1).max()) <= 4
        torch.testing.assert_close(sae.encode(x), expected, rtol=1e-5, atol=1e-5)
    (path / "cfg.json").write_text(json.dumps({**old, "activation_fn_str": "tanh-relu"}))
    with pytest.raises(SAEFormatError, match="activation_fn='tanh-relu' is not supported"):
        load_sae(path)
    (path / "cfg.json").write_text(json.dumps(cfg))
    (path / "sae_weights.safetensors").write_bytes(b"\x00" * 40)  # damaged
    with pytest.raises(SAEFormatError, match="sae_weights|safetensors|Error"):
        load_sae(path)


def test_the_tap_encodes_in_chunks_with_the_same_result(tmp_path, monkeypatch):
    """``worker.capture.encode_top_features`` packs indices, values, NMSE and L0 per row,
    a chunk of rows at a time; chunking changes nothing."""
    from vllm_lens.worker import capture

    path, _ = _sae_lens(tmp_path, "jumprelu")
    sae = load_sae(path)
    x = _rows(50)
    whole = capture.encode_top_features((sae, 8, True), x, None)
    monkeypatch.setattr(capture, "_SAE_CHUNK_BYTES", 4 * 64 * 7)  # 7 rows a chunk
    chunked = capture.encode_top_features((sae, 8, True), x, None)
    assert chunked.shape == (50, 18) and torch.equal(chunked[:, :8], whole[:, :8])
    torch.testing.assert_close(chunked, whole)  # (matmuls of other sizes round differently)
    # A point read from a tap's two tensors (the stream plus the residual) is their sum.
    halves = capture.encode_top_features((sae, 8, True), x / 2, x / 2)
    torch.testing.assert_close(halves, whole)
    found = sae.top_features(x, 8, reconstruction=True)
    assert torch.equal(whole[:, :8].to(torch.int32), found["indices"])
    assert torch.equal(whole[:, 8:16], found["values"])
    assert torch.equal(whole[:, 16], found["nmse"]) and torch.equal(whole[:, 17].int(), found["l0"])


def test_sae_references_name_what_an_async_front_end_describes_first():
    from vllm_lens.spec.saes import MAX_SAE_ENTRIES, sae_references

    raw = json.dumps([{"sae": "a"}, {"sae": "b", "hook_point": "blocks.1.hook_mlp_out"},
                      {"sae": "a"}, {"sae": 3}, "junk", {"sae": "c", "hook_point": 4}])
    assert sae_references(raw) == [("a", None), ("b", "blocks.1.hook_mlp_out")]
    assert sae_references({"sae": "x"}) == [("x", None)]
    assert sae_references("{not json") == []
    many = [{"sae": str(i)} for i in range(MAX_SAE_ENTRIES + 5)]
    assert len(sae_references(many)) == MAX_SAE_ENTRIES


def test_the_operators_sae_file_names_paths_and_hook_points(tmp_path):
    from vllm_lens.frontend.sae_names import read_sae_file

    good = tmp_path / "saes.json"
    good.write_text(json.dumps({"a": "/saes/a", "b": {"path": "/saes/b",
                                                      "hook_point": "blocks.3.hook_resid_post"}}))
    assert read_sae_file(str(good)) == {"a": ("/saes/a", None),
                                        "b": ("/saes/b", "blocks.3.hook_resid_post")}
    for content, words in (("[1]", "JSON object"), ("{", "cannot read"),
                           ('{"a": {"path": "/x", "layer": 3}}', "unknown field 'layer'"),
                           ('{"a": 3}', "must be a path")):
        good.write_text(content)
        with pytest.raises(ValueError, match=words) as bad:
            read_sae_file(str(good))
        assert "VLLM_LENS_SAES" in str(bad.value)
    with pytest.raises(ValueError, match="cannot read"):
        read_sae_file(str(tmp_path / "missing.json"))


def test_a_bad_sae_file_names_every_bad_entry_at_once(tmp_path):
    """What needs no worker is checked by reading the file (before the server's engine
    starts): one error names each bad entry and its problem, and none of the good ones."""
    from vllm_lens.frontend.sae_names import read_sae_file

    listed = tmp_path / "saes.json"
    listed.write_text('''{"ok": "/saes/ok", "twice": "/saes/a", "twice": "/saes/b",
        "../up": "/saes/c", "odd": {"path": "/saes/d", "layer": 3}, "empty": {"path": ""},
        "no-path": {"hook_point": "blocks.1.hook_resid_post"}, "number": 3,
        "point": {"path": "/saes/e", "hook_point": 2},
        "fine": {"path": "/saes/f", "hook_point": null}}''')
    with pytest.raises(ValueError) as bad:
        read_sae_file(str(listed))
    head, *lines = str(bad.value).splitlines()
    assert head == (f"VLLM_LENS_SAES ({listed}): the server does not start: 7 of the 10 SAEs "
                    "listed cannot be served (fix or remove them):")
    shape = 'must be a path or {"path": ..., "hook_point": ...}'
    assert [line.strip() for line in lines] == [
        "SAE 'twice': is listed twice",
        "SAE '../up': is not an SAE name (1 to 64 letters, digits, '.', '_' or '-', starting "
        "with a letter or digit)",
        f"SAE 'odd': {shape} (unknown field 'layer')",
        f"SAE 'empty': {shape} (path: the directory holding the SAE)",
        f"SAE 'no-path': {shape} (path: the directory holding the SAE)",
        f"SAE 'number': {shape}",
        "SAE 'point': hook_point: a name such as 'blocks.3.hook_resid_post'"]


def test_the_server_registers_every_sae_of_its_file_or_names_each_that_does_not_fit(
        tmp_path, monkeypatch):
    """``register_sae_file`` tries every SAE the workers read (a directory that holds none,
    rows of the wrong width ...) and stops the server with one error naming each bad one;
    ``check_sae_file`` is the part the server runs before its engine starts."""
    import asyncio

    from vllm_lens import LensRequestError
    from vllm_lens.frontend.sae_names import check_sae_file, register_sae_file

    class Engine:
        def __init__(self):
            self.asked = []

        async def register_sae(self, name, path, hook_point):
            self.asked.append((name, path, hook_point))
            if path == "/saes/missing":
                raise LensRequestError("path", f"{path} is not a directory holding an SAE")
            if hook_point == "blocks.9.hook_resid_post":
                raise LensRequestError("path", "reads layer 9, but the model has 4 layers")
            return {"name": name}

    listed = tmp_path / "saes.json"
    monkeypatch.delenv("VLLM_LENS_SAES", raising=False)
    assert asyncio.run(register_sae_file(Engine())) == []
    check_sae_file()
    monkeypatch.setenv("VLLM_LENS_SAES", str(listed))
    listed.write_text(json.dumps({"a": "/saes/a", "b": {"path": "/saes/b",
                                                        "hook_point": "blocks.1.hook_mlp_out"}}))
    check_sae_file()
    engine = Engine()
    assert asyncio.run(register_sae_file(engine)) == ["a", "b"]
    assert engine.asked == [("a", "/saes/a", None), ("b", "/saes/b", "blocks.1.hook_mlp_out")]
    listed.write_text(json.dumps({
        "missing": "/saes/missing", "a": "/saes/a",
        "deep": {"path": "/saes/a", "hook_point": "blocks.9.hook_resid_post"}}))
    engine = Engine()
    with pytest.raises(ValueError) as bad:
        asyncio.run(register_sae_file(engine))
    assert [name for name, _, _ in engine.asked] == ["missing", "a", "deep"]  # each tried
    assert str(bad.value).splitlines()[1:] == [
        "  SAE 'missing': /saes/missing is not a directory holding an SAE",
        "  SAE 'deep': reads layer 9, but the model has 4 layers"]
    assert "2 of the 3 SAEs listed" in str(bad.value)
    listed.write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        check_sae_file()


def test_steering_by_feature_becomes_the_decoder_rows_as_a_steering_vector():
    from vllm_lens.common import wire
    from vllm_lens.errors import LensRequestError
    from vllm_lens.spec import ModelFacts, parse_extra_args
    from vllm_lens.spec.sae_steering import steering_sae_references

    facts = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=16,
                       max_model_len=64, mapped=True)
    W_dec = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))

    W_enc, b_enc = W_dec.T * 0.5, torch.zeros(32)
    architecture = ["jumprelu"]

    class Lookup:
        def __call__(self, sae, hook_point, clamp=False):
            return {"path": "/saes/a", "point": "resid_post", "layer": 2, "d_in": 16,
                    "d_sae": 32, "architecture": architecture[0], "hook_point": None,
                    "version": [5, 6]}

        def sae_slice(self, sae, hook_point, features):
            index = list(features)
            return {"W_dec": W_dec[index], "W_enc": W_enc[:, index], "b_enc": b_enc[index],
                    "b_dec": torch.zeros(16), "threshold": torch.full((len(index),), 0.1),
                    "apply_b_dec_to_input": False}

    def steer(*items):
        _, lens = parse_extra_args({"apply_steering_vectors": json.dumps(list(items))},
                                   lambda: facts, saes=Lookup())
        return lens.steer

    (one,) = steer({"sae": "a", "feature": 5, "scale": 4.0, "phase": "decode"})
    assert (one.layers, one.point, one.mode, one.phase, one.scale) == ((2,), "resid_post",
                                                                       "add", "decode", 4.0)
    assert torch.equal(wire.loads(one.vectors), W_dec[5:6])  # the row as stored
    (two,) = steer({"sae": "a", "feature": [1, 7], "scale": [2.0, -1.0],
                    "position_indices": [3, 1]})
    assert two.positions == (1, 3) and two.scale == 1.0
    expected = 2.0 * W_dec[1] - W_dec[7]
    torch.testing.assert_close(wire.loads(two.vectors), expected.expand(1, 2, 16))
    assert steering_sae_references(json.dumps([{"sae": "a", "feature": 5}, "preset:x",
                                               {"sae": "a", "feature": [1, 7]},
                                               {"sae": "a", "feature": 1, "clamp": 0.0}])) == [
        ("a", None, (5,), False), ("a", None, (1, 7), False), ("a", None, (1,), True)]
    (clamp,) = steer({"sae": "a", "feature": [4, 2], "clamp": [0.0, 5.0],
                      "position_indices": [7]})
    assert clamp.mode == "clamp" and clamp.clamp.targets == (0.0, 5.0)
    assert clamp.positions == (7,) and clamp.clamp.architecture == "jumprelu"
    assert torch.equal(wire.loads(clamp.vectors), W_dec[[4, 2]])
    assert torch.equal(wire.loads(clamp.clamp.encoder)["W_enc"], W_enc[:, [4, 2]])
    from vllm_lens.spec import LensRequest
    _, lens = parse_extra_args({"apply_steering_vectors": [{"sae": "a", "feature": 4,
                                                             "clamp": 2.0}]},
                               lambda: facts, saes=Lookup())
    assert LensRequest.from_payload(lens.to_payload()).steer == lens.steer
    with pytest.raises(LensRequestError, match="only clamp or replacement") as bad:
        steer({"sae": "a", "feature": 4, "clamp": 2.0}, {"sae": "a", "feature": 5, "clamp": 0.0})
    assert bad.value.field == "apply_steering_vectors[1]"
    from vllm_lens import SteeringVector

    replace = SteeringVector(activations=torch.zeros(1, 16), layer_indices=[2], mode="replace")
    with pytest.raises(LensRequestError, match="only clamp or replacement"):
        parse_extra_args({"apply_steering_vectors": [
            replace, {"sae": "a", "feature": 4, "clamp": 2.0}]}, lambda: facts, saes=Lookup())
    assert len(steer({"sae": "a", "feature": 4, "clamp": 2.0},
                     {"sae": "a", "feature": 4, "scale": 2.0})) == 2  # a clamp and an addition
    # A TopK clamp ships no encoder: it names the SAE the workers hold for it, and its salt
    # changes with the version of the SAE's files.
    architecture[0] = "topk"
    _, topk_lens = parse_extra_args({"apply_steering_vectors": [
        {"sae": "a", "feature": [9, 3], "clamp": [1.0, 0.0]}]}, lambda: facts, saes=Lookup())
    (topk,) = topk_lens.steer
    assert (topk.clamp.architecture, topk.clamp.path, topk.clamp.hook_point) == (
        "topk", "/saes/a", None)
    assert (topk.clamp.features, topk.clamp.version) == ((9, 3), (5, 6))
    assert topk.clamp.field == "apply_steering_vectors[0].sae"
    assert wire.loads(topk.clamp.encoder) == {}
    assert torch.equal(wire.loads(topk.vectors), W_dec[[9, 3]])
    assert LensRequest.from_payload(topk_lens.to_payload()).steer == topk_lens.steer
    import dataclasses

    from vllm_lens.spec.steer_records import steering_digest

    newer = dataclasses.replace(topk, clamp=dataclasses.replace(topk.clamp, version=(5, 7)))
    assert steering_digest([newer]) != steering_digest([topk])
    architecture[0] = "jumprelu"
    for item, field, words in (
            ({"sae": "a", "feature": 32}, ".feature", "0 to 31"),
            ({"sae": "a", "feature": [1, 1]}, ".feature", "twice"),
            ({"sae": "a", "feature": 1, "clamp": 3.0, "scale": 2.0}, ".clamp", "not both"),
            ({"sae": "a", "feature": [1, 2], "scale": [1.0]}, ".scale", "list of 2"),
            ({"sae": "a", "feature": 1, "phase": "later"}, ".phase", "'decode'"),
            ({"sae": "a", "feature": 1, "layers": [1]}, ".layers", "unknown field")):
        with pytest.raises(LensRequestError, match=words) as bad:
            steer(item)
        assert bad.value.field == "apply_steering_vectors[0]" + field
    with pytest.raises(LensRequestError, match="does not steer by SAE feature"):
        parse_extra_args({"apply_steering_vectors": [{"sae": "a", "feature": 1}]},
                         lambda: facts)


def test_a_clamp_sets_the_features_and_keeps_the_error_term():
    """The worker's clamp (``worker.steer``) adds ``(targets - f) @ W_dec[features]`` with
    ``f`` sae-lens' own encode of the full SAE: the SAE cut down to the clamped features'
    columns computes exactly their activations."""
    from sae_lens import JumpReLUSAEConfig
    from sae_lens.saes.sae import SAE as SaeLensSAE

    from vllm_lens.common import wire
    from vllm_lens.spec.steer_records import ClampSpec, SteerSpec
    from vllm_lens.worker.steer import prepare

    g = torch.Generator().manual_seed(5)
    reference = SaeLensSAE.get_sae_class_for_architecture("jumprelu")(
        JumpReLUSAEConfig(d_in=16, d_sae=64, dtype="float32", device="cpu"))
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        reference.threshold.copy_(torch.rand(64, generator=g) * 0.05)
    features, targets = [3, 40], [2.5, 0.0]
    index = torch.tensor(features)
    encoder = {"W_enc": reference.W_enc[:, index].detach(), "b_enc": reference.b_enc[index].detach(),
               "b_dec": reference.b_dec.detach(), "threshold": reference.threshold[index].detach(),
               "apply_b_dec_to_input": reference.cfg.apply_b_dec_to_input}
    spec = SteerSpec(layers=(0,), vectors=wire.dumps(reference.W_dec[index].detach()), scale=1.0,
                     norm_match=False, positions=None, mode="clamp",
                     clamp=ClampSpec("jumprelu", tuple(targets), wire.dumps(encoder)))
    prepared = prepare(spec, torch.device("cpu"), torch.float32)
    stream = torch.randn(6, 16, generator=g) * 3
    with torch.no_grad():
        before = reference.encode(stream)
        delta = prepared.clamp.delta(stream)
    assert (before[:, index] > 0).any()  # some rows have the features active
    torch.testing.assert_close(delta, (torch.tensor(targets) - before[:, index])
                               @ reference.W_dec[index].detach())


@pytest.mark.parametrize("rescale", [False, True])
def test_a_topk_clamp_adds_what_decoding_the_edited_features_adds(rescale):
    """A TopK clamp (``worker.steer``) encodes whole rows with the SAE the worker holds
    (sae-lens' TopK, ``rescale_acts_by_decoder_norm`` off and on) and adds
    ``decode(f') - decode(f)``, ``f'`` being ``f`` with the clamped features set: a feature
    outside a row's top k is raised, one inside it lowered, every other kept as it was."""
    from sae_lens import TopKSAEConfig
    from sae_lens.saes.sae import SAE as SaeLensSAE

    from vllm_lens.saes import SAE
    from vllm_lens.worker.steer import prepare

    g = torch.Generator().manual_seed(21)
    reference = SaeLensSAE.get_sae_class_for_architecture("topk")(TopKSAEConfig(
        d_in=16, d_sae=64, k=4, dtype="float32", device="cpu",
        rescale_acts_by_decoder_norm=rescale))
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        reference.W_dec.mul_(torch.rand(64, 1, generator=g) * 3)  # unequal decoder norms
    weights = {name: param.detach() for name, param in reference.named_parameters()}
    sae = SAE(architecture="topk", layout="sae-lens", k=4, rescale_acts_by_decoder_norm=rescale,
              **weights)
    stream = torch.randn(6, 16, generator=g) * 3
    with torch.no_grad():
        before = reference.encode(stream)
    top = set(sae.pre_activations(stream)[0].topk(4).indices.tolist())
    inside = int(before[0].argmax())  # in row 0's top k: lowered
    outside = next(i for i in range(64) if i not in top)  # not among row 0's k: raised
    assert inside in top and before[0, inside] > 0.5
    spec, prepared = _check_whole_clamp(sae, reference, stream, before, (inside, outside),
                                        (0.5, 4.0), "/saes/t")
    assert prepared.clamp.sae is sae and prepared.clamp.nbytes == 2 * 16 * 4  # not the SAE's
    from vllm_lens.spec import LensRequest
    from vllm_lens.worker.request_records import RequestRecord, RequestTable

    table = RequestTable(finished_ttl_s=60.0)
    table.records["r"] = RequestRecord("r", LensRequest(key="k", steer=(spec,)))
    assert table.held_saes() == {("/saes/t", None)}  # never unloaded while it runs
    # On a pipeline stage without the clamp's layer there is nothing to hold.
    elsewhere = prepare(spec, torch.device("cpu"), torch.float32, None)
    assert elsewhere.clamp.sae is None and elsewhere.clamp.nbytes == 0


@pytest.mark.parametrize(("architecture", "fields"), [
    ("abstopk", {"k": 4}), ("abstopk", {"k": 4, "rescale_acts_by_decoder_norm": True}),
    ("gated", {})])
def test_abstopk_and_gated_clamps_use_the_whole_sae(tmp_path, architecture, fields):
    """A clamp of an AbsTopK SAE (whose features depend on each other) or of a gated SAE
    (whose gate a column slice does not carry) names the whole SAE, as a TopK clamp does
    (``spec.sae_steering``), and adds ``decode(f') - decode(f)`` as sae-lens computes it."""
    from vllm_lens.saes.model import WHOLE_CLAMP

    assert architecture in WHOLE_CLAMP
    path, reference = _sae_lens(tmp_path, architecture, **fields)
    sae = load_sae(path)
    stream = _rows(6) * 1.5
    with torch.no_grad():
        before = reference.encode(stream)
    active = int(before[0].abs().argmax())
    quiet = int((before[0] == 0).nonzero()[0, 0])
    _check_whole_clamp(sae, reference, stream, before, (active, quiet), (0.25, 3.0), str(path))


def _check_whole_clamp(sae, reference, stream, before, features, targets, path):
    """A clamp of ``features`` to ``targets`` with the whole ``sae`` held by the worker adds
    ``decode(f') - decode(f)`` as sae-lens' ``reference`` computes it (``before`` = ``f``);
    returns the spec and the prepared clamp."""
    from vllm_lens.common import wire
    from vllm_lens.spec.steer_records import ClampSpec, SteerSpec
    from vllm_lens.worker.steer import prepare

    spec = SteerSpec(layers=(0,), vectors=wire.dumps(sae.W_dec[list(features)].detach()),
                     scale=1.0, norm_match=False, positions=None, mode="clamp",
                     clamp=ClampSpec(sae.architecture, targets, wire.dumps({}), path=path,
                                     version=(1,), features=features,
                                     field="apply_steering_vectors[0].sae"))
    prepared = prepare(spec, torch.device("cpu"), torch.float32, sae)
    edited = before.clone()
    edited[:, list(features)] = torch.tensor(targets)
    with torch.no_grad():
        expected = reference.decode(edited) - reference.decode(before)
    torch.testing.assert_close(prepared.clamp.delta(stream), expected, rtol=1e-5, atol=1e-5)
    return spec, prepared


def test_a_topk_clamp_is_kept_by_every_steering_rank_and_a_refusal_names_the_field():
    """Describing a TopK SAE a clamp names asks the workers to keep it where they steer its
    layer (``lens_load_sae`` with ``clamp``); one that cannot (its budget full) refuses the
    request by the item's ``sae`` field before anything runs."""
    from vllm_lens.common.messages import SaeAnswer, SaeSliceAnswer
    from vllm_lens.errors import LensRequestError
    from vllm_lens.frontend.session import LensSession
    from vllm_lens.frontend.engine_methods import drive
    from vllm_lens.frontend.sae_names import SaeNames, steering_described
    from vllm_lens.spec import ModelFacts, parse_steering

    info = {**_INFO, "architecture": "topk", "hook_point": None, "version": [1]}
    calls = []

    class Engine:  # rank 1 has no room left for it
        def collective_rpc(self, method, args):
            calls.append((method, args))
            if method == "lens_load_sae":
                return [SaeAnswer(description=dict(info), error=None),
                        SaeAnswer(description=None, error="the SAEs running requests read "
                                  "take 9 bytes of VLLM_LENS_SAE_MAX_BYTES (10)")]
            return [SaeSliceAnswer(data=None, error=None)] * 2

    session = LensSession()
    SaeNames.of(session).by_name["a"] = ("/saes/a", None, dict(info))
    vectors = [{"sae": "a", "feature": [4, 2], "clamp": [0.0, 5.0]},
               {"sae": "a", "feature": 5, "scale": 1.0}]
    saes = drive(Engine(), steering_described(session, vectors, paths=False))
    assert calls[0] == ("lens_load_sae", ("/saes/a", None, True))
    with pytest.raises(LensRequestError, match="VLLM_LENS_SAE_MAX_BYTES") as bad:
        parse_steering(vectors, ModelFacts(**_FACTS), "corrupt", saes)
    assert bad.value.field == "corrupt[0].sae"


def test_a_clamp_on_a_bfloat16_stream_computes_in_float32_and_writes_bfloat16():
    """A bfloat16 model with a float32 SAE: the clamp reads the rows cast up (never the SAE
    down), and the site's ``apply_steering`` adds the delta in the stream's dtype, on the
    chosen rows only."""
    from vllm_lens.common import wire
    from vllm_lens.spec.steer_records import ClampSpec, SteerSpec
    from vllm_lens.worker.steer import SteerGroup, apply_steering, prepare

    g = torch.Generator().manual_seed(9)
    W_enc, W_dec = torch.randn(16, 2, generator=g), torch.randn(2, 16, generator=g)
    encoder = {"W_enc": W_enc, "b_enc": torch.zeros(2), "b_dec": torch.zeros(16),
               "threshold": None, "apply_b_dec_to_input": False}
    spec = SteerSpec(layers=(0,), vectors=wire.dumps(W_dec), scale=1.0, norm_match=False,
                     positions=None, mode="clamp",
                     clamp=ClampSpec("standard", (1.0, 0.0), wire.dumps(encoder)))
    prepared = prepare(spec, torch.device("cpu"), torch.bfloat16)
    assert prepared.clamp.sae.dtype == torch.float32
    hidden = (torch.randn(4, 16, generator=g) * 2).to(torch.bfloat16)
    before = hidden.clone()
    rows = torch.tensor([1, 3])
    apply_steering(SteerGroup(clamped=[(rows, prepared.clamp, False)]), hidden, None)
    f = (before[rows].float() @ W_enc).relu()
    expected = (before[rows].float() + (torch.tensor([1.0, 0.0]) - f) @ W_dec).to(torch.bfloat16)
    torch.testing.assert_close(hidden[rows], expected, rtol=1e-2, atol=1e-2)
    assert torch.equal(hidden[[0, 2]], before[[0, 2]])


def test_streamed_parts_join_end_to_end_and_a_failed_end_returns_nothing():
    """``join_streamed``: the rows and SAE features of consecutive streamed outputs (empty
    ones included) laid along positions; other fields from the last; a final part that
    failed (``None``) stays ``None``."""
    from vllm_lens.frontend.merge import join_streamed

    def part(positions, **extra):
        n = len(positions)
        return {"activations": {"residual_stream": torch.full((2, n, 3), float(n)),
                                "positions": torch.tensor(positions, dtype=torch.int64)},
                "sae_features": [{"sae": "a", "layer": 1, "point": "resid_post",
                                  "positions": torch.tensor(positions, dtype=torch.int64),
                                  "indices": torch.ones(n, 4, dtype=torch.int32),
                                  "values": torch.rand(n, 4)}], **extra}

    parts = [part([0, 1, 2]), part([]), part([3]), part([4], lens_error=None)]
    joined = join_streamed(parts)
    assert joined["activations"]["positions"].tolist() == [0, 1, 2, 3, 4]
    assert joined["activations"]["residual_stream"].shape == (2, 5, 3)
    (features,) = joined["sae_features"]
    assert features["positions"].tolist() == [0, 1, 2, 3, 4] and features["sae"] == "a"
    assert features["indices"].shape == (5, 4) and features["indices"].dtype == torch.int32
    torch.testing.assert_close(features["values"],
                               torch.cat([p["sae_features"][0]["values"] for p in parts]))
    assert "lens_error" in joined
    failed = join_streamed([part([0, 1]), {"activations": None, "sae_features": None,
                                           "lens_error": RuntimeError("lost")}])
    assert failed["activations"] is None and failed["sae_features"] is None
    only_features = join_streamed([{"sae_features": p["sae_features"]} for p in parts[:3]])
    assert "activations" not in only_features
    assert only_features["sae_features"][0]["positions"].tolist() == [0, 1, 2, 3]


#: An SAE the tests below steer by: 32 features of layer 2's resid_post in a 4-layer,
#: 16-wide model.
_FACTS = dict(model_class="LlamaForCausalLM", n_layers=4, hidden_size=16, max_model_len=64,
              mapped=True)
_INFO = {"path": "/saes/a", "point": "resid_post", "layer": 2, "d_in": 16, "d_sae": 32,
         "architecture": "jumprelu"}


def _slice(features):
    """What a worker's ``lens_sae_slice`` selects of that SAE (random weights, seeded)."""
    g = torch.Generator().manual_seed(11)
    W_dec, W_enc = torch.randn(32, 16, generator=g), torch.randn(16, 32, generator=g)
    index = list(features)
    return {"W_dec": W_dec[index], "W_enc": W_enc[:, index], "b_enc": torch.zeros(len(index)),
            "b_dec": torch.zeros(16), "threshold": torch.full((len(index),), 0.1),
            "apply_b_dec_to_input": False}


class _Lookup:
    """``spec.saes``' describe for that SAE, as a front end would have it."""

    def __call__(self, sae, hook_point, clamp=False):
        return dict(_INFO)

    def sae_slice(self, sae, hook_point, features):
        return _slice(features)


def test_presets_and_sweeps_describe_the_saes_they_steer_by_before_parsing():
    """``steering_described``: the steps a preset's registration and a sweep take before
    parsing steering vectors outside a request. They ask the workers for each named SAE and
    the features it steers by, once; a directory is never opened where only names are
    served (it is refused naming the field); plain vectors ask nothing."""
    from vllm_lens import SteeringVector
    from vllm_lens.common import wire
    from vllm_lens.common.messages import SaeAnswer, SaeSliceAnswer
    from vllm_lens.errors import LensRequestError
    from vllm_lens.frontend.session import LensSession
    from vllm_lens.frontend.engine_methods import drive
    from vllm_lens.frontend.sae_names import SaeNames, steering_described
    from vllm_lens.spec import ModelFacts, parse_steering

    facts = ModelFacts(**_FACTS)
    calls = []

    class Engine:  # the workers' answers to the two RPCs (``worker.saes``)
        def collective_rpc(self, method, args):
            calls.append((method, args))
            if method == "lens_load_sae":
                return [SaeAnswer(description=dict(_INFO), error=None)]
            return [SaeSliceAnswer(data=wire.dumps(_slice(args[2])), error=None)]

    session = LensSession()
    SaeNames.of(session).by_name["a"] = ("/saes/a", None, dict(_INFO))
    vectors = [{"sae": "a", "feature": [4, 2], "clamp": [0.0, 5.0]},
               {"sae": "a", "feature": 5, "scale": 3.0}]
    saes = drive(Engine(), steering_described(session, vectors, paths=False))
    assert calls == [("lens_load_sae", ("/saes/a", None, True)),  # a clamp names it
                     ("lens_sae_slice", ("/saes/a", None, [4, 2])),
                     ("lens_sae_slice", ("/saes/a", None, [5]))]
    clamp, scale = parse_steering(vectors, facts, "presets.p", saes)
    assert (clamp.mode, clamp.layers, clamp.clamp.targets) == ("clamp", (2,), (0.0, 5.0))
    assert torch.equal(wire.loads(clamp.vectors), _slice([4, 2])["W_dec"])
    assert torch.equal(wire.loads(clamp.clamp.encoder)["W_enc"], _slice([4, 2])["W_enc"])
    assert (scale.mode, scale.scale) == ("add", 3.0)
    assert torch.equal(wire.loads(scale.vectors), _slice([5])["W_dec"])
    calls.clear()
    elsewhere = [{"sae": "saes/elsewhere", "feature": 1, "scale": 2.0}]
    saes = drive(Engine(), steering_described(session, elsewhere, paths=False))
    assert calls == []  # nothing was opened
    with pytest.raises(LensRequestError, match="cannot name a path") as bad:
        parse_steering(elsewhere, facts, "presets.p", saes)
    assert bad.value.field == "presets.p[0].sae"
    plain = [SteeringVector(activations=torch.ones(1, 16), layer_indices=[1])]
    assert drive(Engine(), steering_described(session, plain, paths=False)) is None
    assert calls == []
    with pytest.raises(LensRequestError, match="does not steer by SAE feature") as bad:
        parse_steering(vectors, facts, "corrupt")  # nothing described: refused by field
    assert bad.value.field == "corrupt[0].sae"


def test_a_presets_clamp_travels_with_the_request_and_counts_as_its_own(monkeypatch):
    """A preset keeps the clamp it was registered with (decoder rows, encoder columns,
    targets): a request selecting it carries the same spec, charged by decoded size (a
    clamp's shapes are its SAE's, not a steering vector's, so six features in a 4-layer model
    are fine), and its clamps count among the request's items steering by SAE feature."""
    from vllm_lens.errors import LensRequestError
    from vllm_lens.spec import ModelFacts, parse_extra_args, parse_steering
    from vllm_lens.spec.saes import MAX_SAE_ENTRIES

    facts = ModelFacts(**_FACTS)
    held = parse_steering([{"sae": "a", "feature": [0, 1, 2, 3, 4, 5], "clamp": 1.0}], facts,
                          "presets.p", _Lookup())
    presets = {"p": held}
    _, lens = parse_extra_args({"apply_steering_vectors": ["preset:p"]}, lambda: facts,
                               presets=presets)
    assert lens.steer == held
    # Rows 6 x 16 (384 bytes) fit; with the encoder columns and biases (496 more) they do not.
    monkeypatch.setenv("VLLM_LENS_MAX_DECODED_BYTES", "800")
    with pytest.raises(LensRequestError, match="VLLM_LENS_MAX_DECODED_BYTES") as bad:
        parse_extra_args({"apply_steering_vectors": ["preset:p"]}, lambda: facts,
                         presets=presets)
    assert bad.value.field == "apply_steering_vectors[0]"
    monkeypatch.delenv("VLLM_LENS_MAX_DECODED_BYTES")
    inline = [{"sae": "a", "feature": f, "scale": 1.0} for f in range(MAX_SAE_ENTRIES)]
    _, lens = parse_extra_args({"apply_steering_vectors": inline}, lambda: facts,
                               saes=_Lookup())
    assert len(lens.steer) == MAX_SAE_ENTRIES
    with pytest.raises(LensRequestError, match=f"beyond the {MAX_SAE_ENTRIES}") as bad:
        parse_extra_args({"apply_steering_vectors": [*inline, "preset:p"]}, lambda: facts,
                         presets=presets, saes=_Lookup())
    assert bad.value.field == f"apply_steering_vectors[{MAX_SAE_ENTRIES}]"


def test_a_sweeps_corruption_steers_by_feature_but_never_clamps_where_it_patches(
        monkeypatch):
    """A patching sweep's ``corrupt`` may steer by SAE feature: every variant carries the
    item as given (its parse finds the SAE described beforehand), charged with the clamp's
    encoder columns; a clamp at the (layer, site) the sweep writes its clean rows at would
    meet a replacement in those cells, and is refused naming the field before anything
    runs."""
    from vllm_lens.errors import LensRequestError
    from vllm_lens.frontend.patching_sweep import _plan
    from vllm_lens.spec import ModelFacts

    class Config:
        logprobs_mode = "raw_logprobs"

        def get_vocab_size(self):
            return 100

    facts = ModelFacts(**_FACTS)
    corrupt = [{"sae": "a", "feature": [1, 2], "clamp": 0.0},
               {"sae": "a", "feature": 5, "scale": 2.0}]

    def plan(layers, items=corrupt, positions=(1,)):
        clean = torch.ones(len(layers), len(positions), 16)
        return _plan(facts, None, Config(), [1, 2, 3, 4], clean, list(layers),
                     list(positions), {"prob": 7}, items, "resid_post", _Lookup())

    found = plan([1, 3])
    assert len(found.params) == 2 + 2
    for params in found.params[1:]:
        carried = params.extra_args["apply_steering_vectors"]
        assert carried[:2] == corrupt
    assert carried[2].mode == "replace" and carried[2].layer_indices == [3]
    with pytest.raises(LensRequestError, match="only clamp or replacement at its site") as bad:
        plan([1, 2])
    assert bad.value.field == "corrupt[0].clamp"
    assert len(plan([2], corrupt[1:]).params) == 3  # an addition beside a patch is fine
    # Six features: rows 384 bytes and encoder 496 per variant; two cells need 1,760.
    monkeypatch.setenv("VLLM_LENS_MAX_DECODED_BYTES", "1000")
    six = [{"sae": "a", "feature": [0, 1, 2, 3, 4, 5], "clamp": 0.0}]
    assert len(plan([1], six).params) == 3
    with pytest.raises(LensRequestError, match="VLLM_LENS_MAX_DECODED_BYTES") as bad:
        plan([1], six, positions=(1, 2))
    assert bad.value.field == "corrupt"


def test_to_sparse_refuses_indices_past_d_sae_and_detect_layout_takes_a_string(tmp_path):
    from vllm_lens.saes import detect_layout, to_sparse

    entry = {"indices": torch.tensor([[3, -1]], dtype=torch.int32), "values": torch.ones(1, 2)}
    assert to_sparse(entry, 4).to_dense().tolist() == [[0.0, 0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="feature index 3 is not below d_sae=3"):
        to_sparse(entry, 3)
    for name in ("cfg.json", "sae.safetensors"):
        (tmp_path / name).touch()
    assert detect_layout(str(tmp_path)) == detect_layout(tmp_path) == "sparsify"
