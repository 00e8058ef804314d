"""The SAE arithmetic's fast paths compute what the plain arithmetic computes: an SAE large
enough for oneDNN's reordered weights (``vllm_lens.saes.linear``) encodes, decodes and picks its
top features as sae-lens does, and as the plain product does up to the products' rounding (the
product itself follows its weight, autograd and pickling); the JumpReLU mask written straight
into the activations' dtype gives the very same bits and gradients."""

from __future__ import annotations

import pickle

import pytest
import torch

from vllm_lens.saes import SAE, load_sae
from vllm_lens.saes import linear as linear_module
from vllm_lens.saes.linear import MIN_REORDERED_ELEMENTS, Linear

from tests.unit.test_saes import assert_encodes_and_decodes_as_sae_lens

D_IN, D_SAE = 64, 4096  # W_enc has MIN_REORDERED_ELEMENTS elements: the smallest it reorders

needs_onednn = pytest.mark.skipif(
    Linear(torch.zeros(D_IN, D_SAE), torch.zeros(D_SAE))._reordered is None,
    reason="this torch has no oneDNN linear: every product is the plain one")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(D_IN, D_SAE, generator=g) * 0.1,
            "b_enc": torch.randn(D_SAE, generator=g) * 0.2 - 1.0,
            "W_dec": torch.randn(D_SAE, D_IN, generator=g) * 0.2,
            "b_dec": torch.randn(D_IN, generator=g) * 0.2,
            "threshold": torch.rand(D_SAE, generator=g) * 0.8}


def _sae_lens(tmp_path, architecture: str, **cfg_fields):
    """A sae-lens SAE of ``D_IN x D_SAE`` with ``_weights``, saved; with its reference."""
    from sae_lens import JumpReLUSAEConfig, StandardSAEConfig, TopKSAEConfig
    from sae_lens.saes.sae import SAE as SaeLensSAE

    config = {"standard": StandardSAEConfig, "jumprelu": JumpReLUSAEConfig,
              "topk": TopKSAEConfig}[architecture]
    cfg = config(d_in=D_IN, d_sae=D_SAE, dtype="float32", device="cpu", **cfg_fields)
    sae = SaeLensSAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    sae.cfg.metadata.hook_name = "blocks.1.hook_resid_post"
    with torch.no_grad():
        for name, value in _weights(len(architecture)).items():
            if hasattr(sae, name):
                getattr(sae, name).copy_(value)
    path = tmp_path / architecture
    sae.save_model(path)
    return path, SaeLensSAE.load_from_disk(path)


def _rows(n: int = 40) -> torch.Tensor:
    """Rows with every amount of activity, from none to a few hundred features active (more
    than a top 32, fewer than a top 32, none at all)."""
    g = torch.Generator().manual_seed(7)
    scale = torch.linspace(0.05, 1.2, n)[:, None]
    return torch.randn(n, D_IN, generator=g) * scale


def _plain(sae: SAE, monkeypatch) -> SAE:
    """The same SAE, computing with torch's plain product."""
    with monkeypatch.context() as m:
        m.setattr(linear_module, "MIN_REORDERED_ELEMENTS", 1 << 62)
        plain = SAE(**{f.name: getattr(sae, f.name) for f in sae.__dataclass_fields__.values()})
        plain.prepare()
        plain._product("dec", plain.dtype)
    assert plain._product("enc", plain.dtype)._reordered is None
    return plain


@needs_onednn
@pytest.mark.parametrize("architecture, fields", [
    ("standard", {}), ("jumprelu", {}), ("jumprelu", {"apply_b_dec_to_input": False}),
    ("topk", {"k": 24}), ("topk", {"k": 24, "rescale_acts_by_decoder_norm": True}),
])
def test_reordered_saes_encode_and_decode_as_sae_lens(tmp_path, architecture, fields):
    path, reference = _sae_lens(tmp_path, architecture, **fields)
    sae = load_sae(path)
    sae.prepare()
    assert sae._product("enc", torch.float32)._reordered is not None
    # (a decoded row sums hundreds of products: rounding in another order differs more)
    assert_encodes_and_decodes_as_sae_lens(sae, reference, _rows(), decode_atol=5e-5)
    assert sae._product("dec", torch.float32)._reordered is not None


@needs_onednn
@pytest.mark.parametrize("top_k", [1, 32, D_SAE])
def test_reordered_top_features_are_the_plain_ones(tmp_path, monkeypatch, top_k):
    """Same indices (where no two features tie), values, NMSE and L0 as the plain product's,
    the values descending, padded with -1 / 0 past the active features; and consistent with
    the SAE's own dense ``encode`` to the bit."""
    path, reference = _sae_lens(tmp_path, "jumprelu")
    sae = load_sae(path)
    sae.prepare()
    plain = _plain(sae, monkeypatch)
    x = torch.cat([_rows(), sae.b_dec[None]])
    with torch.no_grad():
        out = sae.top_features(x, top_k, reconstruction=True)
        expected = plain.top_features(x, top_k, reconstruction=True)
        dense = sae.encode(x)
        nmse = (x - reference.decode(reference.encode(x))).pow(2).sum(-1) / x.pow(2).sum(-1)
    l0 = (dense > 0).sum(-1)
    assert torch.equal(out["l0"], l0.to(torch.int32)) and torch.equal(out["l0"], expected["l0"])
    assert int(l0.min()) < min(top_k, 32) and int(l0.max()) > 32  # padded rows and full ones
    torch.testing.assert_close(out["values"], expected["values"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out["indices"], expected["indices"])
    torch.testing.assert_close(out["nmse"], expected["nmse"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["nmse"], nmse, rtol=1e-5, atol=1e-5)
    for row in range(x.shape[0]):
        kept = min(int(l0[row]), top_k)
        values, indices = out["values"][row], out["indices"][row]
        assert (indices[kept:] == -1).all() and (values[kept:] == 0).all()
        assert torch.equal(values[:kept], dense[row].sort(descending=True).values[:kept])
        assert torch.equal(dense[row][indices[:kept].long()], values[:kept])


@needs_onednn
def test_tied_features_are_each_returned_once_with_their_value():
    """Features with the same encoder column tie: the top features hold each tied one at
    most once, with its value, wherever the ties fall."""
    w = _weights(3)
    w["W_enc"][:, 1::2] = w["W_enc"][:, 0::2]  # feature 2i+1 copies feature 2i
    w["b_enc"][1::2] = w["b_enc"][0::2]
    w["threshold"][1::2] = w["threshold"][0::2]
    sae = SAE("jumprelu", layout="test", **w)
    sae.prepare()
    x = _rows()
    with torch.no_grad():
        dense = sae.encode(x)
        out = sae.top_features(x, 33)  # an odd k: the cut falls inside a tied pair
    for row in range(x.shape[0]):
        kept = min(int((dense[row] > 0).sum()), 33)
        indices = out["indices"][row, :kept].long()
        assert len(set(indices.tolist())) == kept
        values = out["values"][row, :kept]
        assert torch.equal(dense[row][indices], values)
        assert torch.equal(values, dense[row].sort(descending=True).values[:kept])


@needs_onednn
def test_the_reordered_product_follows_its_weight_autograd_and_pickling():
    w = _weights(4)
    product = Linear(w["W_enc"], w["b_enc"])
    assert product.nbytes == D_IN * D_SAE * 4
    for n in (0, 1, 7, 300):
        x = torch.randn(n, D_IN)
        torch.testing.assert_close(product(x), x @ w["W_enc"] + w["b_enc"], rtol=1e-5, atol=1e-5)
    x = torch.randn(5, D_IN)
    w["W_enc"].mul_(2)  # changed in place: reordered again
    torch.testing.assert_close(product(x), x @ w["W_enc"] + w["b_enc"], rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)  # autograd sees the plain product
    product(x).sum().backward()
    torch.testing.assert_close(x.grad, w["W_enc"].sum(1).expand(5, D_IN), rtol=1e-5, atol=5e-5)
    with torch.inference_mode():  # weights without a version counter: taken as fixed
        fixed = Linear(w["W_enc"].clone(), w["b_enc"].clone())
    x = x.detach()
    torch.testing.assert_close(fixed(x), x @ w["W_enc"] + w["b_enc"], rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(product(x), x @ w["W_enc"] + w["b_enc"], rtol=1e-5, atol=1e-5)
    small = Linear(torch.zeros(D_IN, MIN_REORDERED_ELEMENTS // D_IN - 1), torch.zeros(1))
    assert small._reordered is None and small.nbytes == 0

    sae = SAE("jumprelu", layout="test", **_weights(5))
    before = sae.nbytes
    sae.prepare()
    assert sae.nbytes == before + D_IN * D_SAE * 4  # the reordered encoder is counted
    assert sae.to(sae.W_enc.device) is sae  # nothing to move: the same SAE, copies kept
    x = _rows(3)
    copy = pickle.loads(pickle.dumps(sae))  # without the copies, made again at need
    assert copy.nbytes == before
    with torch.no_grad():
        assert torch.equal(copy.encode(x), sae.encode(x))


@needs_onednn
def test_a_worker_makes_the_reordered_encoder_at_load_and_counts_it(tmp_path):
    from vllm_lens.worker.saes import SAERegistry

    path, _ = _sae_lens(tmp_path, "jumprelu")
    weights = load_sae(path).nbytes
    cpu = torch.device("cpu")
    registry = SAERegistry(max_bytes=4 * weights)
    sae = registry.load(str(path), None, cpu, held=set(), dtype=torch.bfloat16)
    assert sae._product("enc", torch.float32)._reordered is not None
    assert registry.nbytes == sae.nbytes == weights + D_IN * D_SAE * 4
    with pytest.raises(ValueError, match="VLLM_LENS_SAE_MAX_BYTES"):
        SAERegistry(max_bytes=weights).load(str(path), None, cpu, held=set())


def test_the_jumprelu_mask_gives_the_bits_and_gradients_of_the_cast_bool_mask():
    """``relu(h) * (h > threshold)``: negative and positive thresholds, active and inactive
    features, a NaN row; computed in place without autograd, out of place with it."""
    w = _weights(6)
    w["threshold"] = torch.linspace(-0.5, 0.8, D_SAE)
    sae = SAE("jumprelu", layout="test", **w)
    x = torch.cat([_rows(), w["b_dec"][None], torch.full((1, D_IN), float("nan"))])
    with torch.no_grad():
        h = sae.pre_activations(x)
        expected = h.relu() * (h > w["threshold"]).to(h.dtype)
        features = sae.encode(x)
    assert torch.equal(features[:-1], expected[:-1]) and features[-1].isnan().all()
    assert torch.equal(features.signbit(), expected.signbit())
    x.requires_grad_(True)
    h = sae.pre_activations(x)
    expected = h.relu() * (h > w["threshold"]).to(h.dtype)
    features = sae.encode(x)
    assert torch.equal(features[:-1], expected[:-1]) and features[-1].isnan().all()
    assert torch.equal(features.signbit(), expected.signbit())
    (grad,) = torch.autograd.grad(features[:-1].sum(), x)
    (expected_grad,) = torch.autograd.grad(expected[:-1].sum(), x)
    assert torch.equal(grad, expected_grad) and grad.abs().sum() > 0


def test_a_sparse_decode_equals_the_dense_one():
    """Rows with few active features (a trained dictionary's) decode by a sparse product, to
    what the dense product gives; rescaling TopK included; many active features take the
    dense product."""
    w = _weights(5)
    sae = SAE(architecture="jumprelu", layout="sae-lens", **w)
    g = torch.Generator().manual_seed(6)
    few = torch.zeros(9, D_SAE)
    few[torch.arange(9)[:, None], torch.randint(0, D_SAE, (9, 12), generator=g)] = torch.rand(
        9, 12, generator=g) + 0.1
    dense = few @ w["W_dec"] + w["b_dec"]
    torch.testing.assert_close(sae.decode(few), dense, rtol=1e-5, atol=1e-5)
    assert ("dec", torch.float32) not in sae.__dict__.get("_linear", {})  # no dense product
    many = torch.rand(3, D_SAE, generator=g)
    torch.testing.assert_close(sae.decode(many), many @ w["W_dec"] + w["b_dec"],
                               rtol=1e-4, atol=1e-4)
    assert ("dec", torch.float32) in sae.__dict__["_linear"]
    topk = SAE(architecture="topk", layout="sae-lens", k=12, rescale_acts_by_decoder_norm=True,
               **{k: v for k, v in w.items() if k != "threshold"})
    norms = w["W_dec"].norm(dim=-1)
    torch.testing.assert_close(topk.decode(few), (few / norms) @ w["W_dec"] + w["b_dec"],
                               rtol=1e-5, atol=1e-5)
    assert sae.decode(torch.zeros(0, D_SAE)).shape == (0, D_IN)
