"""Direct logit attribution of the model's components: ``output_logit_attribution`` ->
``LogitAttributionSpec`` (runs in: front end, worker).

Workers decode it again from the payload.

``extra_args["output_logit_attribution"] = {"layers", "positions", "attribution_token",
"heads"}`` (``true``: every layer, every position): per selected position, how much the
embedding (``resid_pre`` of layer 0) and each chosen layer's ``attn_out`` and ``mlp_out`` (with
``heads``, each attention head: its ``attn_z`` through its columns of the output projection,
``worker.head_projection``) add directly to one logit — the token that follows the position (the next prompt token, or the token
sampled from it), or ``attribution_token`` — through the final norm frozen at the position's
own scale (``worker.readout``). With every layer, the parts sum to the logit itself (before a
soft cap; for a LayerNorm less the norm's bias term), which the tests check against
transformers' logits.

The workers capture those points' rows like ``output_activations`` (signals
``dla:<point>``, counted by admission) and the last layer's stream, and compute the
attributions when the request is fetched; only ``[layers, positions]`` leave the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, UnsupportedConfigError
from vllm_lens.spec.capture import CaptureSpec, check_one_head_size, parse_positions
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import (
    check_site,
    checked_flag,
    checked_item,
    json_value,
    parse_layers,
)
from vllm_lens.spec.keys import LOGIT_KEY

__all__ = ["LOGIT_SIGNAL", "LogitAttributionSpec", "checked_token", "parse_logit_attribution"]

_FIELDS = ("layers", "positions", "attribution_token", "heads")
#: The signal the workers send the attributions under (one ``[1, n, 2 + 2 * layers (+ layers
#: * heads)]`` tensor: the token, the embedding's, each layer's attn_out, its mlp_out, then
#: with ``heads`` each layer's heads).
LOGIT_SIGNAL = "logit_attribution"


@dataclass(frozen=True)
class LogitAttributionSpec:
    layers: tuple[int, ...]
    positions: str | tuple[int, ...] = "all"
    token: int | None = None
    """The token whose logit (``None``: the token that follows each position)."""
    n_layers: int = 0
    """The model's layers: the last one's stream gives each position's norm scale."""
    heads: int = 0
    """With ``heads``: the model's attention heads (``0``: not asked)."""

    def captures(self) -> tuple[CaptureSpec, ...]:
        """What the workers capture for it (signals ``dla:<point>``)."""
        def at(point: str, layers: tuple[int, ...]) -> CaptureSpec:
            return CaptureSpec(layers=layers, positions=self.positions,
                               signal=f"{tap_points.DLA_PREFIX}{point}")
        found = (at("resid_pre", (0,)), at("attn_out", self.layers), at("mlp_out", self.layers),
                 at("resid_post", (self.n_layers - 1,)))
        return (*found, at("attn_z", self.layers)) if self.heads else found

    def result(self, rows: torch.Tensor | None, positions: torch.Tensor) -> dict[str, Any]:
        """``logit_attribution`` of one completion from the workers' ``[n, 2 + 2L (+ L * H)]``
        rows: ``{"layers", "positions", "tokens", "embed", "attn_out", "mlp_out"}`` —
        ``tokens`` int32 ``[n]`` (-1 where the following token is not known, its row NaN),
        ``embed`` float32 ``[n]``, ``attn_out`` and ``mlp_out`` float32 ``[layers, n]``, and with
        ``heads`` ``"heads"`` float32 ``[layers, n, heads]``."""
        n_layers = len(self.layers)
        if rows is None:
            rows = torch.empty(0, 2 + 2 * n_layers + n_layers * self.heads)
        rows = rows.float()
        end = 2 + 2 * n_layers
        found = {"layers": list(self.layers), "positions": positions,
                 "tokens": rows[:, 0].to(torch.int32), "embed": rows[:, 1].contiguous(),
                 "attn_out": rows[:, 2:2 + n_layers].t().contiguous(),
                 "mlp_out": rows[:, 2 + n_layers:end].t().contiguous()}
        if self.heads:
            found["heads"] = rows[:, end:].reshape(-1, n_layers, self.heads).transpose(
                0, 1).contiguous()
        return found

    def to_payload(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "token": self.token, "n_layers": self.n_layers,
                "heads": self.heads, "positions": self.positions if isinstance(self.positions, str)
                else list(self.positions)}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> LogitAttributionSpec:
        positions = d["positions"]
        return cls(layers=tuple(int(x) for x in d["layers"]),
                   positions=positions if isinstance(positions, str) else tuple(positions),
                   token=None if d.get("token") is None else int(d["token"]),
                   n_layers=int(d["n_layers"]), heads=int(d.get("heads", 0)))


def checked_token(token: Any, facts: ModelFacts, field: str,
                  request_id: str | None) -> int | None:
    """An ``attribution_token``: ``None`` or a token id of the model's vocabulary."""
    vocab = facts.vocab_size
    if token is None:
        return None
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < max(vocab, 1):
        raise LensRequestError(field, f"a token id from 0 to {vocab - 1} (the model's "
                               f"vocabulary), got {token!r}", request_id=request_id)
    return token


def parse_logit_attribution(raw: Any, facts: ModelFacts,
                            request_id: str | None) -> LogitAttributionSpec:
    """``output_logit_attribution``: ``true`` or ``{"layers", "positions",
    "attribution_token", "heads"}``."""
    raw = json_value(raw, LOGIT_KEY, request_id)
    if raw is True or raw == "true":
        raw = {}
    raw = checked_item(raw, _FIELDS, LOGIT_KEY, 'true or {"layers", "positions", '
                       '"attribution_token", "heads"}', request_id)
    layers = raw.get("layers", True)
    layers = parse_layers(True if layers == "true" else layers, facts, f"{LOGIT_KEY}.layers",
                          request_id)
    positions = parse_positions(raw.get("positions", "all"), facts, f"{LOGIT_KEY}.positions",
                                request_id)
    token = checked_token(raw.get("attribution_token"), facts,
                          f"{LOGIT_KEY}.attribution_token", request_id)
    for point in ("resid_pre", "attn_out", "mlp_out"):
        check_site(point, facts, LOGIT_KEY, request_id)
    if refused := facts.attribution_refused:
        raise UnsupportedConfigError(LOGIT_KEY, f"this engine cannot carry the components to "
                                     f"the logits: {refused}", request_id=request_id)
    heads = checked_flag(raw.get("heads", False), f"{LOGIT_KEY}.heads", request_id)
    if heads:
        check_site("attn_z", facts, f"{LOGIT_KEY}.heads", request_id)
        if facts.heads_refused:
            raise UnsupportedConfigError(f"{LOGIT_KEY}.heads", f"per-head attribution is "
                                         f"refused on this engine: {facts.heads_refused}",
                                         request_id=request_id)
        check_one_head_size(layers, facts, f"{LOGIT_KEY}.heads", request_id)
    return LogitAttributionSpec(layers=layers, positions=positions, token=token,
                                n_layers=facts.n_layers, heads=facts.n_heads if heads else 0)
