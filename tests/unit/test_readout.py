"""The linearised readout for direct logit attribution (no engine): vLLM's own RMSNorm and
GemmaRMSNorm and torch's LayerNorm are recognised from their outputs, their effective weights
read (Gemma's ``1 + w``), and the attribution of a component equals TransformerLens'
``apply_ln_to_stack`` formula; a head that does not reproduce ``compute_logits``, a norm of
another form and an engine without the whole head are refused with the reason."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_lens.worker.attribution import following_tokens
from vllm_lens.worker.readout import Readout, build_readout

D, VOCAB = 16, 40


class _Model(nn.Module):
    """A decoder's tail as vLLM builds it: ``model.norm`` beside the layers, ``lm_head`` and
    a logits processor that caps then scales (``LogitsProcessor.forward``'s order)."""

    def __init__(self, norm: nn.Module, scale: float = 1.0, soft_cap: float | None = None,
                 skew: float = 0.0) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.norm = norm
        self.model.layers = nn.ModuleList()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.logits_processor = SimpleNamespace(scale=scale, soft_cap=soft_cap,
                                                vocab_size=VOCAB)
        self.skew = skew

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden) + self.skew * hidden[:, :1]
        cap = self.logits_processor.soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits * self.logits_processor.scale


INFO = SimpleNamespace(layers_path="model.layers", n_layers=3)


def _vllm_norm(kind: str) -> nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    with set_current_vllm_config(VllmConfig()):
        norm = (RMSNorm if kind == "rms" else GemmaRMSNorm)(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=torch.Generator().manual_seed(1)))
    return norm


def _built(norm, **kw) -> Readout:
    torch.manual_seed(0)
    readout = build_readout(_Model(norm, **kw), INFO, tp_size=1, last_stage=True)
    assert isinstance(readout, Readout), readout
    return readout


@pytest.mark.parametrize("kind", ["rms", "gemma"])
def test_vllm_rms_norms_are_recognised_with_their_effective_weight(kind):
    norm = _vllm_norm(kind)
    readout = _built(norm, scale=0.5, soft_cap=30.0)
    assert readout.form == "rms" and readout.eps == pytest.approx(1e-5)
    expected = norm.weight.detach() + (1.0 if kind == "gemma" else 0.0)
    torch.testing.assert_close(readout.weight, expected, rtol=1e-5, atol=1e-5)
    assert (readout.scale, readout.soft_cap, readout.last_layer) == (0.5, 30.0, 2)


def test_layer_norm_attribution_equals_apply_ln_to_stack():
    """The component is centred, divided by the cached scale, times the weight, onto the
    unembedding row: TransformerLens' formula, written out here."""
    norm = nn.LayerNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D) + 0.5)
        norm.bias.copy_(torch.randn(D))
    readout = _built(norm, scale=2.0)
    assert readout.form == "layer"
    g = torch.Generator().manual_seed(3)
    stream, directions = torch.randn(5, D, generator=g) * 4 + 1, torch.randn(5, 3, D, generator=g)
    values, tokens = torch.rand(5, 3, generator=g), torch.tensor([0, 7, 39, -1, 12])
    scales = readout.norm_scale(stream)
    found = readout.attribute(directions, values, scales, tokens)
    w_u = readout.unembed.detach()
    for n in range(5):
        for k in range(3):
            c = values[n, k] * directions[n, k]
            centred = c - c.mean()
            want = 2.0 * (centred / stream[n].var(unbiased=False).add(1e-5).sqrt()
                          * norm.weight.detach()) @ w_u[tokens[n]]
            if tokens[n] < 0:
                assert math.isnan(found[n, k])
            else:
                torch.testing.assert_close(found[n, k], want.detach(), rtol=1e-4, atol=1e-5)


def test_refusals_name_the_reason():
    norm = _vllm_norm("rms")
    assert "tensor parallelism" in build_readout(_Model(norm), INFO, tp_size=2, last_stage=True)
    assert "pipeline stage" in build_readout(_Model(norm), INFO, tp_size=1, last_stage=False)
    assert "compute_logits" in build_readout(_Model(norm, skew=1.0), INFO, tp_size=1,
                                             last_stage=True)

    class Scaled(nn.Module):  # x * w / max|x|: neither form
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(D)), 1e-5

        def forward(self, x):
            return x * self.weight / x.abs().amax(-1, keepdim=True)

    assert "neither an RMSNorm nor a LayerNorm" in build_readout(
        _Model(Scaled()), INFO, tp_size=1, last_stage=True)

    class NoEps(nn.Module):
        def forward(self, x):
            return x

    assert "epsilon" in build_readout(_Model(NoEps()), INFO, tp_size=1, last_stage=True)


def test_following_tokens():
    tokens = {"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9]}
    assert following_tokens(torch.tensor([0, 2, 3, 4]), tokens, None).tolist() == [6, 8, 9, -1]
    assert following_tokens(torch.tensor([1, 2]), None, 11).tolist() == [11, 11]
    with pytest.raises(ValueError, match="token ids"):
        following_tokens(torch.tensor([1]), None, None)
