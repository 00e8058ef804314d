"""The model's readout, linearised: what a vector added to the last layer's stream does to one
logit, for direct logit attribution (runs in: worker).

vLLM computes a logit as ``cap(norm(x) @ W_U[t]) * scale``: the final norm, the unembedding
row of token ``t``, the logits processor's soft cap and scale. A component ``c`` of the stream
``x`` (an SAE feature's ``value * W_dec[i]``) is carried straight to the logit by freezing the
norm's scale at the position's own, as TransformerLens' ``apply_ln_to_stack`` does with a
cached scale:

- RMSNorm, ``x / s * w`` with ``s = sqrt(mean(x**2) + eps)``: ``c . (w * W_U[t]) / s``;
- LayerNorm, ``(x - mean(x)) / s * w + b`` with ``s = sqrt(var(x) + eps)``: the component is
  centred first, ``(c - mean(c)) . (w * W_U[t]) / s``;

times the processor's ``scale``; a soft cap is not applied (it is not linear): with one, the
attribution is onto the logit before the cap. The norm's bias belongs to no component; an LM
head with a bias fails the proof below (it is not read).

Nothing is taken on trust (``build_readout``): the norm's form, weight and epsilon are read
from the loaded module and proven on it (its outputs for rows with a large mean must equal the
form's), and the head's weight, scale and cap must reproduce ``compute_logits``. A model where
either fails, or on an engine where the rank does not hold the whole vocabulary (tensor
parallelism) or the final norm (a pipeline stage before the last), has no readout, and
attribution is refused naming why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from vllm_lens.worker.layout_check import final_norm, tolerance

__all__ = ["Readout", "build_readout"]

logger = logging.getLogger(__name__)

_EPS_NAMES = ("variance_epsilon", "eps", "variance_eps", "epsilon")
_HEAD_NAMES = ("lm_head", "embed_out", "output", "head")


@dataclass(frozen=True)
class Readout:
    """A proven linearised readout (``build_readout``)."""

    form: str
    """``"rms"`` or ``"layer"`` (LayerNorm)."""
    weight: torch.Tensor
    """The norm's effective weight ``w``, float32 ``[d]`` (Gemma's ``1 + w`` included)."""
    eps: float
    unembed: torch.Tensor
    """The LM head's weight ``W_U`` ``[vocab (padded), d]``, on the device, in its dtype."""
    scale: float
    """The logits processor's scale."""
    soft_cap: float | None
    vocab_size: int
    last_layer: int
    """The layer whose ``resid_post`` the final norm reads."""

    @torch.inference_mode()
    def norm_scale(self, stream: torch.Tensor) -> torch.Tensor:
        """The norm's scale ``s`` of each row of the last layer's stream ``[n, d]``, float32
        ``[n]``."""
        x = stream.float()
        if self.form == "layer":
            x = x - x.mean(dim=-1, keepdim=True)
        return (x.pow(2).mean(dim=-1) + self.eps).sqrt()

    @torch.inference_mode()
    def directions(self, scales: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Per row, the vector whose dot product with a stream component is its direct effect
        on the logit of ``tokens[n]`` at a position of norm scale ``scales[n]``: float32
        ``[n, d]``, ``scale * w * W_U[t] / s`` (centred for a LayerNorm), NaN where the token
        is below 0 (unknown). On this readout's device."""
        u = self.unembed.index_select(0, tokens.clamp(min=0).long()).float() * self.weight
        if self.form == "layer":
            u = u - u.mean(dim=-1, keepdim=True)
        u = u * (self.scale / scales.float())[:, None]
        return u.masked_fill((tokens < 0)[:, None], float("nan"))

    @torch.inference_mode()
    def attribute(self, directions: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                  tokens: torch.Tensor) -> torch.Tensor:
        """Direct effect on the logit of ``tokens[n]`` of ``values[n, k]`` units of
        ``directions[n, k, d]`` added to the stream at rows whose norm scale is
        ``scales[n]``: float32 ``[n, k]``, NaN where the token is below 0 (unknown).
        Every argument on this readout's device."""
        u = self.directions(scales, tokens)
        return values.float() * torch.einsum("nkd,nd->nk", directions.float(), u)


def build_readout(model: torch.nn.Module, info: Any, *, tp_size: int,
                  last_stage: bool) -> Readout | str:
    """The readout of ``model`` (its ``TapInfo`` ``info``), proven on its own modules, or why
    there is none. Never raises."""
    if tp_size > 1:
        return (f"tensor parallelism ({tp_size} ranks) splits the LM head's vocabulary across "
                "ranks")
    if not last_stage:
        return "this pipeline stage does not hold the final norm and the LM head"
    try:
        return _build(model, info)
    except Exception as exc:  # noqa: BLE001 -- describe must answer
        logger.warning("vllm-lens: the readout could not be proven: %r", exc)
        return f"the readout could not be proven ({exc!r})"


def _build(model: torch.nn.Module, info: Any) -> Readout | str:
    norm = final_norm(model, info)
    if norm is None:
        return "no final norm was found beside the layers"
    eps = next((float(getattr(norm, n)) for n in _EPS_NAMES
                if isinstance(getattr(norm, n, None), (int, float))), None)
    if eps is None:
        return f"the final norm ({type(norm).__name__}) names no epsilon"
    head = next((getattr(model, n) for n in _HEAD_NAMES
                 if isinstance(getattr(model, n, None), torch.nn.Module)), None)
    unembed = getattr(head, "weight", None)
    processor = getattr(model, "logits_processor", None)
    if not isinstance(unembed, torch.Tensor) or not unembed.is_floating_point() \
            or processor is None or not hasattr(model, "compute_logits"):
        return "no unquantised LM head and logits processor were found"
    param = next(norm.parameters(), unembed)
    dtype, device, d = param.dtype, unembed.device, unembed.shape[1]
    if d % 2:
        return f"the hidden size ({d}) is odd"
    with torch.inference_mode():
        zero = torch.zeros(1, d, dtype=dtype, device=device)
        bias = _call(norm, zero).float()[0]
        probe = torch.ones(1, d, dtype=dtype, device=device)
        probe[:, 1::2] = -1  # mean 0, mean square 1: the same scale under both forms
        weight = (_call(norm, probe).float()[0] - bias) * probe[0].float() * (1.0 + eps) ** 0.5
        gen = torch.Generator(device="cpu").manual_seed(0)
        rows = (torch.randn(4, d, generator=gen) * 3 + 2).to(device=device, dtype=dtype)
        actual = _call(norm, rows).float()
        x = rows.float()
        form = None
        for name in ("rms", "layer"):
            centred = x - x.mean(dim=-1, keepdim=True) if name == "layer" else x
            s = (centred.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()
            if _close(centred / s * weight + bias, actual, dtype):
                form = name
                break
        if form is None:
            return (f"the final norm ({type(norm).__name__}) is neither an RMSNorm nor a "
                    "LayerNorm on its own weights")
        scale = float(getattr(processor, "scale", 1.0))
        soft_cap = getattr(processor, "soft_cap", None)
        logits = model.compute_logits(actual.to(dtype))
        vocab = int(getattr(processor, "vocab_size", 0) or logits.shape[-1])
        width = min(vocab, logits.shape[-1], unembed.shape[0])
        # A spread of at most 8,192 tokens (not a float32 copy of the whole head).
        sample = torch.linspace(0, width - 1, min(width, 8192), device=device).long()
        ours = actual @ unembed.index_select(0, sample).float().t()
        if soft_cap is not None:
            ours = torch.tanh(ours / soft_cap) * soft_cap
        ours = ours * scale
        if not _close(ours, logits.float().index_select(1, sample), unembed.dtype):
            return ("the LM head's weight, scale and soft cap do not reproduce compute_logits "
                    "(an LM head with a bias, or logits computed another way)")
    return Readout(form=form, weight=weight.contiguous(), eps=eps, unembed=unembed,
                   scale=scale, soft_cap=None if soft_cap is None else float(soft_cap),
                   vocab_size=width, last_layer=int(info.n_layers) - 1)


def _call(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = norm(x)
    return out[0] if isinstance(out, tuple) else out


def _close(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to ``dtype``'s rounding, relative to the largest value of each row."""
    span = theirs.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    return bool(((ours - theirs).abs() / span).amax() <= tolerance(dtype))
