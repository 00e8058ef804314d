"""SAE features: ``output_sae_features`` -> ``SAEFeatureSpec`` (which SAE, which positions, how many
features per position) (runs in: front end, worker).

Workers decode it again from the payload.

A request names an SAE by a name registered with the front end (``frontend.sae_names``:
``llm.register_sae``, the operator's ``VLLM_LENS_SAES``) or, where the caller owns the
process (offline engines), by the directory it is in. The front end asks the workers to load
it (``describe``: they answer its layout, width and hook point) before the request is
admitted, so a bad SAE fails here, naming the field, and the forward pass never waits on a
disk. An asynchronous front end describes the SAEs a request names first
(``sae_references``), then parses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, UnsupportedConfigError
from vllm_lens.spec.capture import CaptureSpec, parse_positions
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import check_site, checked_flag, checked_item, json_value
from vllm_lens.spec.keys import SAE_KEY
from vllm_lens.spec.logit_attribution import checked_token

__all__ = ["MAX_SAE_ENTRIES", "SAEFeatureSpec", "check_description", "described", "named_sae",
           "parse_sae_features", "sae_references"]

_FIELDS = ("sae", "hook_point", "positions", "top_k", "reconstruction", "attribution",
           "attribution_token")
#: Points whose rows are a part of the residual stream, so that a feature's decoder row read
#: there is carried to the logits as it is (``attribution``); a transcoder writes ``mlp_out``.
ATTRIBUTABLE = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
#: Entries of one request's ``output_sae_features`` (each encodes every selected row with its
#: SAE in the shared forward pass).
MAX_SAE_ENTRIES = 8
#: What ``describe`` answers for an SAE: its layout, architecture, ``d_in``, ``d_sae``,
#: ``point``, ``layer`` and ``hook_name`` (and the workers' ``hook_point`` key and files'
#: ``version``). Steering by feature also calls it with ``clamp=True`` for a clamp: every
#: rank steering a TopK SAE's layer then keeps it (``spec.sae_steering``).
Describe = Callable[..., Mapping[str, Any]]


@dataclass(frozen=True)
class SAEFeatureSpec:
    """One entry of ``output_sae_features``: an SAE (loaded on the workers) read at its own
    point and layer."""

    sae: str
    """The SAE as the request named it."""
    path: str
    hook_point: str | None
    """The caller's override of where it reads, or ``None`` (its files say)."""
    point: str
    layer: int
    d_sae: int
    top_k: int = 32
    positions: str | tuple[int, ...] = "all"
    reconstruction: bool = False
    attribution: bool = False
    """Each returned feature's direct effect on one logit per position (``worker.readout``)."""
    attribution_token: int | None = None
    """The token whose logit (``None``: the token that follows each position)."""

    @property
    def width(self) -> int:
        """Values per position on the worker: ``top_k`` indices, ``top_k`` values, with
        ``reconstruction`` the NMSE and L0, and with ``attribution`` one more while the
        request runs (the final norm's scale) that fetching turns into ``top_k``
        attributions and the token id (``worker.attribution``): the wider is counted."""
        return 2 * self.top_k + (2 if self.reconstruction else 0) + (
            self.top_k + 1 if self.attribution else 0)

    @property
    def signal(self) -> str:
        key = (self.path, self.hook_point, self.top_k, self.reconstruction)
        if self.attribution:
            key += (self.attribution_token,)
        digest = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
        return f"{tap_points.SAE_PREFIX}{digest}:{self.point}"

    def capture(self) -> CaptureSpec:
        """The capture the workers run for it: its layer's rows at its positions."""
        return CaptureSpec(layers=(self.layer,), positions=self.positions, signal=self.signal)

    def entry(self, rows: Any, positions: Any) -> dict[str, Any]:
        """One ``sae_features`` entry from the packed rows the workers computed (``[n, width]``
        in float32, ``worker.plan``) and their positions: per position the top features'
        ``indices`` (int32, -1 where fewer were active) and ``values`` (float32), descending;
        with ``reconstruction`` also ``nmse`` (float32) and ``l0`` (int32); with
        ``attribution`` also ``logit_attribution`` (float32 ``[n, top_k]``, 0 for padding,
        NaN where the token is not known) and ``attribution_tokens`` (int32 ``[n]``, -1 where
        not known)."""
        k = self.top_k
        found: dict[str, Any] = {
            "sae": self.sae, "layer": self.layer, "point": self.point, "positions": positions,
            "indices": rows[:, :k].to(torch.int32), "values": rows[:, k:2 * k].contiguous()}
        end = 2 * k
        if self.reconstruction:
            found["nmse"] = rows[:, end].contiguous()
            found["l0"] = rows[:, end + 1].to(torch.int32)
            end += 2
        if self.attribution:
            found["logit_attribution"] = rows[:, end:end + k].contiguous()
            found["attribution_tokens"] = rows[:, end + k].to(torch.int32)
        return found

    def to_payload(self) -> dict[str, Any]:
        return {"sae": self.sae, "path": self.path, "hook_point": self.hook_point,
                "point": self.point, "layer": self.layer, "d_sae": self.d_sae,
                "top_k": self.top_k, "reconstruction": self.reconstruction,
                "attribution": self.attribution, "attribution_token": self.attribution_token,
                "positions": self.positions if isinstance(self.positions, str)
                else list(self.positions)}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> SAEFeatureSpec:
        positions = d["positions"]
        return cls(sae=str(d["sae"]), path=str(d["path"]), hook_point=d.get("hook_point"),
                   point=str(d["point"]), layer=int(d["layer"]), d_sae=int(d["d_sae"]),
                   top_k=int(d["top_k"]), reconstruction=bool(d["reconstruction"]),
                   attribution=bool(d.get("attribution", False)),
                   attribution_token=None if d.get("attribution_token") is None
                   else int(d["attribution_token"]),
                   positions=positions if isinstance(positions, str) else tuple(positions))


def parse_sae_features(raw: Any, facts: ModelFacts, describe: Describe | None,
                       request_id: str | None) -> tuple[SAEFeatureSpec, ...]:
    """``output_sae_features``: one ``{"sae", "positions", "top_k", "reconstruction",
    "hook_point"}`` or a list of them."""
    raw = json_value(raw, SAE_KEY, request_id)
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise LensRequestError(SAE_KEY, "an empty list asks for nothing", request_id=request_id)
    if len(items) > MAX_SAE_ENTRIES:
        raise LensRequestError(SAE_KEY, f"has {len(items)} entries; at most {MAX_SAE_ENTRIES} "
                               "SAEs are read per request", request_id=request_id)
    specs: list[SAEFeatureSpec] = []
    for i, item in enumerate(items):
        field = SAE_KEY if not isinstance(raw, list) else f"{SAE_KEY}[{i}]"
        specs.append(_parse_one(item, facts, describe, field, request_id))
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.signal in seen:
            raise LensRequestError(f"{SAE_KEY}[{i}]", f"asks for the same SAE, top_k and "
                                   f"reconstruction as entry {seen[spec.signal]}; merge their "
                                   "positions into one entry", request_id=request_id)
        seen[spec.signal] = i
    return tuple(specs)


def sae_references(raw: Any) -> list[tuple[str, str | None]]:
    """The ``(sae, hook_point)`` pairs an ``output_sae_features`` value names, without
    checking anything else (``parse_sae_features`` does, with their descriptions): what an
    asynchronous front end describes before it parses. Malformed values give no pairs (the
    parse names the problem), and at most ``MAX_SAE_ENTRIES`` are read."""
    try:
        raw = json_value(raw, SAE_KEY, None)
    except LensRequestError:
        return []
    items = raw if isinstance(raw, list) else [raw]
    found: list[tuple[str, str | None]] = []
    for item in items[:MAX_SAE_ENTRIES]:
        if not isinstance(item, Mapping):
            continue
        name, hook_point = item.get("sae"), item.get("hook_point")
        if (isinstance(name, str) and name and (hook_point is None or isinstance(hook_point, str))
                and (name, hook_point) not in found):
            found.append((name, hook_point))
    return found


def check_description(info: Mapping[str, Any], facts: ModelFacts, field: str,
                      request_id: str | None = None) -> tuple[str, int, int]:
    """An SAE's description checked against the served model: it reads a layer and point the
    model has (whole rows: not a point TP splits across ranks), rows of that point's width,
    and its feature indices are exact in float32.
    Returns (point, layer, d_sae)."""
    point, layer = str(info["point"]), int(info["layer"])
    if layer >= facts.n_layers:
        raise LensRequestError(field, f"reads layer {layer}, but the model has "
                               f"{facts.n_layers} layers", request_id=request_id)
    if point == tap_points.FINAL_POINT and layer != facts.n_layers - 1:
        raise LensRequestError(field, f"reads final_norm at layer {layer}, but final_norm is "
                               f"read once, after the last layer ({facts.n_layers - 1})",
                               request_id=request_id)
    check_site(point, facts, field, request_id)
    if facts.tp_size > 1 and point in tap_points.SHARDED:
        # Each rank holds a part of each row there; an SAE reads whole rows.
        raise UnsupportedConfigError(
            field, f"reads {point}, which tensor parallelism splits across ranks "
            f"(tensor_parallel_size={facts.tp_size}); under TP SAEs are served at points "
            "every rank holds whole (the residual stream, attn_out, mlp_out)",
            request_id=request_id)
    width = facts.row_width(point, (layer,))
    if int(info["d_in"]) != width:
        raise LensRequestError(field, f"reads {point} rows of {info['d_in']} values, but this "
                               f"model's {point} rows have {width}", request_id=request_id)
    out_point = info.get("out_point")
    if out_point is not None:  # a transcoder: what it predicts must be here too
        check_site(str(out_point), facts, field, request_id)
        out_width = facts.row_width(str(out_point), (layer,))
        if int(info.get("d_out", -1)) != out_width:
            raise LensRequestError(field, f"predicts {out_point} rows of {info.get('d_out')} "
                                   f"values, but this model's {out_point} rows have "
                                   f"{out_width}", request_id=request_id)
    d_sae = int(info["d_sae"])
    if d_sae >= 1 << 24:
        raise LensRequestError(field, f"has {d_sae:,} features; feature indices travel as "
                               "float32, exact below 2**24 (16,777,216)", request_id=request_id)
    return point, layer, d_sae


def named_sae(item: Mapping[str, Any], where: str, request_id: str | None,
              key: str = "sae") -> tuple[str, str | None]:
    """An item's ``sae`` (or ``key``: a replacement's ``transcoder``) and ``hook_point``,
    checked for their types; a problem is a ``LensRequestError`` naming ``where.sae`` /
    ``.hook_point``."""
    name, hook_point = item.get(key), item.get("hook_point")
    if not isinstance(name, str) or not name:
        what = "transcoder" if key == "transcoder" else "SAE"
        raise LensRequestError(f"{where}.{key}", f"a registered {what}'s name (offline, also "
                               "the directory holding one)", request_id=request_id)
    if hook_point is not None and not isinstance(hook_point, str):
        raise LensRequestError(f"{where}.hook_point", "a name such as "
                               "'blocks.3.hook_resid_post'", request_id=request_id)
    return name, hook_point


def described(describe: Describe | None, name: str, hook_point: str | None, facts: ModelFacts,
              field: str, what: str, request_id: str | None
              ) -> tuple[Mapping[str, Any], str, int, int]:
    """The SAE a request names, described by the workers and checked against the model:
    (description, point, layer, d_sae); every problem a ``LensRequestError`` naming
    ``field``. ``what``: what the engine would do with it (for the error without ``describe``)."""
    if describe is None:
        raise LensRequestError(field, f"this engine does not {what} here (no SAE could be "
                               "described for this request)", request_id=request_id)
    try:
        info = describe(name, hook_point)
    except (ValueError, OSError) as exc:
        raise LensRequestError(field, str(exc), request_id=request_id) from None
    return (info, *check_description(info, facts, field, request_id))


def _parse_one(item: Any, facts: ModelFacts, describe: Describe | None, field: str,
               request_id: str | None) -> SAEFeatureSpec:
    item = checked_item(item, _FIELDS, field, '{"sae": <name or directory>, "positions", '
                        '"top_k", "reconstruction", "hook_point"}', request_id)
    name, hook_point = named_sae(item, field, request_id)
    info, point, layer, d_sae = described(describe, name, hook_point, facts, f"{field}.sae",
                                          "serve SAE features", request_id)
    top_k = item.get("top_k", min(32, d_sae))
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= d_sae:
        raise LensRequestError(f"{field}.top_k", f"must be an integer from 1 to the SAE's "
                               f"d_sae ({d_sae}), got {top_k!r} (default: 32, or d_sae if "
                               "smaller)", request_id=request_id)
    reconstruction = checked_flag(item.get("reconstruction", False),
                                  f"{field}.reconstruction", request_id)
    positions = parse_positions(item.get("positions", "all"), facts, f"{field}.positions",
                                request_id)
    attribution, token = _attribution(item, info, point, facts, field, request_id)
    # The workers keep it under the hook point they were asked to read it at (a registered
    # name's, which the request need not repeat: Gemma Scope's files name none).
    return SAEFeatureSpec(sae=name, path=str(info["path"]),
                          hook_point=info.get("hook_point", hook_point), point=point,
                          layer=layer, d_sae=d_sae, top_k=top_k, positions=positions,
                          reconstruction=reconstruction, attribution=attribution,
                          attribution_token=token)


def _attribution(item: Mapping[str, Any], info: Mapping[str, Any], point: str,
                 facts: ModelFacts, field: str, request_id: str | None
                 ) -> tuple[bool, int | None]:
    """An entry's ``attribution`` and ``attribution_token``, checked against the SAE and the
    engine."""
    attribution = checked_flag(item.get("attribution", False), f"{field}.attribution",
                               request_id)
    token = item.get("attribution_token")
    if token is not None and not attribution:
        raise LensRequestError(f"{field}.attribution_token", "names the token of an "
                               "attribution; set \"attribution\": true with it",
                               request_id=request_id)
    if not attribution:
        return False, None
    token = checked_token(token, facts, f"{field}.attribution_token", request_id)
    writes = str(info.get("out_point") or point)
    if writes not in ATTRIBUTABLE:
        raise UnsupportedConfigError(
            f"{field}.attribution", f"its decoder writes {writes}, which is not a part of the "
            f"residual stream; attribution is served for SAEs at {', '.join(ATTRIBUTABLE)} "
            "and for transcoders", request_id=request_id)
    if refused := facts.attribution_refused:
        raise UnsupportedConfigError(f"{field}.attribution", f"this engine cannot carry "
                                     f"features to the logits: {refused}",
                                     request_id=request_id)
    return True, token
