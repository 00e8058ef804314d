"""``steer_attention``: per-request edits of chosen heads' attention (runs in: front end,
worker).

A request's ``extra_args["steer_attention"]`` is a list (or its JSON string) of edits, each::

    {"layers": [3, 5] | "all", "heads": [0, 7] | null,
     "emphasize": [start, end], "alpha": 0.01}            # PASTA
    {"layers": [...], "heads": [...] | null,
     "key_positions": [4, 9], "bias": -2.0 | "-inf"}     # a bias on chosen keys' scores

Positions are absolute token positions (0 = the first prompt token), ``end`` exclusive;
``heads`` are query heads of the whole model (``null``: every head), whatever the tensor
parallelism; ``0 <= alpha <= 1e6``, a finite bias within ``±1e4``. In every query row of the
request (prompt and generated tokens alike) of the chosen heads at the chosen layers:

- ``emphasize`` (PASTA, Zhang et al. 2024): the attention probabilities of the keys outside
  ``[start, end)`` are multiplied by ``alpha`` and the row renormalised. A row that sees no
  key of the span is left as it is (renormalising a uniform scale is the identity; with
  ``alpha = 0`` the row would otherwise be empty).
- ``key_positions`` + ``bias``: ``bias`` is added to those keys' pre-softmax scores (after the
  model's scale and soft cap, before the softmax); ``-inf`` (JSON: the string ``"-inf"``)
  knocks the edges out. A row whose every visible key is knocked out attends to nothing: its
  output is zero.

Edits of one layer compose: every bias is added first, then the softmax, then the emphases
together (their weights multiply; the row is renormalised once, and left as it is where no key
keeps any weight). The workers recompute the steered heads' output rows from the Q, K and V the
kernel received (``worker.attention_steering``); other heads, requests and layers keep the
kernel's output. The front end parses and checks; the workers decode
``AttentionEdit.from_payload``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lens.errors import LensRequestError, UnsupportedConfigError, UnsupportedModelError
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import (
    check_site,
    json_value,
    parse_heads,
    position_rule,
    sorted_indices,
)
from vllm_lens.spec.keys import ATTENTION_STEER_KEY

__all__ = ["MAX_ALPHA", "MAX_BIAS", "MAX_EDITS", "MAX_KEY_POSITIONS", "AttentionEdit",
           "parse_attention_steering"]

#: Edits one request may carry.
MAX_EDITS = 32
#: Key positions one ``key_positions`` edit may name.
MAX_KEY_POSITIONS = 4096
#: Largest ``alpha`` and largest finite ``|bias|``: 32 biases sum far inside float32, and the
#: worker multiplies up to 32 alphas in float64.
MAX_ALPHA = 1e6
MAX_BIAS = 1e4
_COMMON = {"layers", "heads"}
_EMPHASIS = _COMMON | {"emphasize", "alpha"}
_BIAS = _COMMON | {"key_positions", "bias"}


@dataclass(frozen=True)
class AttentionEdit:
    """One validated edit, as the workers receive it."""

    layers: tuple[int, ...]
    heads: tuple[int, ...] | None
    """Query heads of the whole model, ascending; ``None``: every head."""
    span: tuple[int, int] | None = None
    """``emphasize``'s ``[start, end)``."""
    alpha: float = 1.0
    key_positions: tuple[int, ...] = ()
    bias: float = 0.0
    """Added to ``key_positions``' scores; may be ``-inf``."""

    @property
    def emphasis(self) -> bool:
        return self.span is not None

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"layers": list(self.layers),
                                   "heads": None if self.heads is None else list(self.heads)}
        if self.span is not None:
            payload.update(span=list(self.span), alpha=self.alpha)
        else:  # msgpack carries -inf as a float
            payload.update(key_positions=list(self.key_positions), bias=self.bias)
        return payload

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> AttentionEdit:
        heads = d.get("heads")
        span = d.get("span")
        return cls(layers=tuple(int(x) for x in d["layers"]),
                   heads=None if heads is None else tuple(int(h) for h in heads),
                   span=None if span is None else (int(span[0]), int(span[1])),
                   alpha=float(d.get("alpha", 1.0)),
                   key_positions=tuple(int(p) for p in d.get("key_positions", ())),
                   bias=float(d.get("bias", 0.0)))


def parse_attention_steering(raw: Any, facts: ModelFacts,
                             request_id: str | None = None) -> tuple[AttentionEdit, ...]:
    """Validate ``steer_attention`` against the served model.

    Raises:
        LensRequestError: naming the field (``steer_attention[i].<field>``).
        UnsupportedModelError: the model's attention is not one vllm-lens recomputes (no
            plain attention kernel, or attention sinks at a chosen layer).
        UnsupportedConfigError: speculative decoding is on.
    """
    key = ATTENTION_STEER_KEY
    raw = json_value(raw, key, request_id)
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise LensRequestError(key, "expected a non-empty list of edits ({\"layers\", "
                               "\"heads\", \"emphasize\" and \"alpha\", or \"key_positions\" "
                               "and \"bias\"})", request_id=request_id)
    if len(raw) > MAX_EDITS:
        raise LensRequestError(key, f"{len(raw)} edits; at most {MAX_EDITS} per request",
                               request_id=request_id)
    if facts.speculative:
        raise UnsupportedConfigError(key, "attention steering is refused while speculative "
                                     "decoding is on (untested: draft tokens' rows)",
                                     request_id=request_id)
    check_site("attn_q", facts, key, request_id)
    return tuple(_parse_one(item, i, facts, request_id) for i, item in enumerate(raw))


def _parse_one(item: Any, i: int, facts: ModelFacts, request_id: str | None) -> AttentionEdit:
    where = f"{ATTENTION_STEER_KEY}[{i}]"
    if not isinstance(item, Mapping):
        raise LensRequestError(where, f"expected an object, got {type(item).__name__}",
                               request_id=request_id)
    emphasis = "emphasize" in item
    if emphasis == ("key_positions" in item):
        raise LensRequestError(where, "give either \"emphasize\": [start, end] with \"alpha\" "
                               "(PASTA) or \"key_positions\": [...] with \"bias\"",
                               request_id=request_id)
    allowed = _EMPHASIS if emphasis else _BIAS
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise LensRequestError(f"{where}.{unknown[0]}", f"unknown field; this edit has "
                               f"{', '.join(sorted(allowed))}", request_id=request_id)
    layers = _layers(item.get("layers"), facts, f"{where}.layers", request_id)
    raw_heads = item.get("heads")
    heads = (None if raw_heads is None  # null: every head
             else parse_heads(raw_heads, facts, f"{where}.heads", request_id))
    if emphasis:
        span = _span(item["emphasize"], facts, f"{where}.emphasize", request_id)
        if "alpha" not in item:
            raise LensRequestError(f"{where}.alpha", "missing: the factor on the attention "
                                   "to keys outside the span (PASTA uses 0.01)",
                                   request_id=request_id)
        alpha = item["alpha"]
        if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                or not 0 <= alpha <= MAX_ALPHA):  # (NaN fails the comparison)
            raise LensRequestError(f"{where}.alpha", f"expected a number from 0 to {MAX_ALPHA:g}, "
                                   f"got {alpha!r}", request_id=request_id)
        return AttentionEdit(layers=layers, heads=heads, span=span, alpha=float(alpha))
    positions = item["key_positions"]
    if hasattr(positions, "tolist") and not isinstance(positions, (str, bytes)):
        positions = positions.tolist()
    if not isinstance(positions, (list, tuple)) or not positions:
        raise LensRequestError(f"{where}.key_positions", "expected a non-empty list of "
                               "absolute token positions", request_id=request_id)
    if len(positions) > MAX_KEY_POSITIONS:
        raise LensRequestError(f"{where}.key_positions", f"{len(positions)} positions; at "
                               f"most {MAX_KEY_POSITIONS}", request_id=request_id)
    positions = sorted_indices(positions, f"{where}.key_positions", position_rule(facts),
                               request_id)
    if "bias" not in item:
        raise LensRequestError(f"{where}.bias", "missing: the number added to those keys' "
                               "scores (\"-inf\" knocks the edges out)", request_id=request_id)
    return AttentionEdit(layers=layers, heads=heads, key_positions=positions,
                         bias=_bias(item["bias"], f"{where}.bias", request_id))


def _layers(raw: Any, facts: ModelFacts, field: str,
            request_id: str | None) -> tuple[int, ...]:
    if raw == "all" or raw is True:
        layers = tuple(range(facts.n_layers))
    else:
        if hasattr(raw, "tolist") and not isinstance(raw, (str, bytes)):
            raw = raw.tolist()
        if not isinstance(raw, (list, tuple)) or not raw:
            raise LensRequestError(field, f"expected a non-empty list of layers or \"all\", got "
                                   f"{raw!r}", request_id=request_id)
        found = []
        for j, layer in enumerate(raw):
            if isinstance(layer, bool) or not isinstance(layer, int) or not (
                    -facts.n_layers <= layer < facts.n_layers):
                raise LensRequestError(f"{field}[{j}]", f"{layer!r} is not a layer of the model "
                                       f"(0..{facts.n_layers - 1}, or negative from the end)",
                                       request_id=request_id)
            found.append(layer % facts.n_layers)
        layers = tuple(sorted(set(found)))
    for layer in layers:
        meta = facts.qk_meta[layer] if layer < len(facts.qk_meta) else None
        if not meta:
            raise UnsupportedModelError(field, f"the attention of layer {layer} cannot be "
                                        "described (scale, window ...), so it is not "
                                        "recomputed", request_id=request_id)
        if meta.get("kv_cache_dtype", "auto") != "auto":
            raise UnsupportedModelError(field, f"layer {layer} keeps a "
                                        f"{meta['kv_cache_dtype']} KV cache, which the kernel "
                                        "reads quantized: attention steering would not be exact "
                                        "(start the engine with kv_cache_dtype='auto')",
                                        request_id=request_id)
        if meta.get("sinks") is not None:
            raise UnsupportedModelError(field, f"layer {layer} has attention sinks, which "
                                        "attention steering does not handle yet (untested)",
                                        request_id=request_id)
    return layers


def _span(raw: Any, facts: ModelFacts, field: str, request_id: str | None) -> tuple[int, int]:
    if hasattr(raw, "tolist") and not isinstance(raw, (str, bytes)):
        raw = raw.tolist()
    if (not isinstance(raw, (list, tuple)) or len(raw) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in raw)):
        raise LensRequestError(field, f"expected [start, end] (absolute token positions, end "
                               f"exclusive), got {raw!r}", request_id=request_id)
    start, end = raw
    if not 0 <= start < end <= facts.max_model_len:
        raise LensRequestError(field, f"[{start}, {end}] is not a span of the model's context: "
                               f"0 <= start < end <= {facts.max_model_len}",
                               request_id=request_id)
    return int(start), int(end)


def _bias(raw: Any, field: str, request_id: str | None) -> float:
    if isinstance(raw, str) and raw.strip().lower() in ("-inf", "-infinity"):
        return -math.inf
    if (isinstance(raw, bool) or not isinstance(raw, (int, float))
            or not (raw == -math.inf or -MAX_BIAS <= raw <= MAX_BIAS)):
        raise LensRequestError(field, f"expected a number from {-MAX_BIAS:g} to {MAX_BIAS:g}, or "
                               f"-inf (the string \"-inf\" in JSON), got {raw!r}",
                               request_id=request_id)
    return float(raw)
