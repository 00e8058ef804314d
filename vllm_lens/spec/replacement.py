"""Replacing a layer's MLP by a transcoder: ``replace_mlp`` -> ``ReplaceSpec`` (runs in: front end,
worker).

Workers decode it again from the payload.

``extra_args["replace_mlp"] = [{"transcoder": NAME, "keep_error": bool, "clamp": {i: v},
"hook_point": ...}]``: at every position of the request, the layer's MLP output (``mlp_out``)
becomes the transcoder's prediction from what it reads (``mlp_in``, or ``resid_mid``):
``y' = decode(f') + x @ W_skip.T`` with ``f = encode(x)`` and ``f'`` the features with the
``clamp``'s set to their values. With ``keep_error`` the transcoder's error on the unedited
features, ``y - decode(f) - x @ W_skip.T``, is added back: ``y' = y + decode(f') - decode(f)``
— the local replacement model of circuit tracing, which without a clamp is the MLP's own
output (nothing is computed then). ``keep_error`` has no default: it decides whether the model
still computes what it did.

The transcoder is a registered name (offline also a directory), described by the workers
before the request is admitted; every rank that runs the layer (every TP rank of its
pipeline stage) keeps it while the request runs, as for a TopK clamp. The prefix-cache salt
names each replacement (the transcoder's files' version, ``keep_error``, the clamp): requests
share KV blocks only with requests replacing identically.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lens.errors import LensRequestError
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import checked_flag, checked_item, json_value
from vllm_lens.spec.keys import REPLACE_KEY
from vllm_lens.spec.saes import MAX_SAE_ENTRIES, Describe, described, named_sae

__all__ = ["MAX_CLAMPED", "ReplaceSpec", "parse_replacements", "replacement_digest",
           "replacement_references"]

_FIELDS = ("transcoder", "keep_error", "clamp", "hook_point")
#: Features one replacement may clamp.
MAX_CLAMPED = 64
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class ReplaceSpec:
    """One layer's MLP replaced by a transcoder for one request."""

    transcoder: str
    """As the request named it."""
    path: str
    """The real path the workers keep it under."""
    hook_point: str | None
    """The workers' key for it (a registered name's override, or the request's)."""
    point: str
    """Where it reads (``mlp_in`` or ``resid_mid``)."""
    layer: int
    keep_error: bool
    version: tuple[int, ...] = ()
    """Its files' version when described (the salt names it; the worker checks its copy)."""
    clamp: tuple[tuple[int, float], ...] = ()
    """(feature, value) pairs, features ascending."""

    def digest_into(self, digest: Any) -> None:
        """Add what the prefix-cache salt must tell apart to ``digest`` (a ``hashlib``
        hash)."""
        digest.update(repr(("replace_mlp", self.path, self.hook_point, self.layer,
                            self.keep_error, self.version, self.clamp)).encode())

    @property
    def idle(self) -> bool:
        """``keep_error`` without a clamp: the layer computes what it did (nothing is
        computed, nothing salted)."""
        return self.keep_error and not self.clamp

    def to_payload(self) -> dict[str, Any]:
        """Plain msgpack types, as the payload carries it to the workers."""
        return {"transcoder": self.transcoder, "path": self.path, "hook_point": self.hook_point,
                "point": self.point, "layer": self.layer, "keep_error": self.keep_error,
                "version": list(self.version), "clamp": [list(c) for c in self.clamp]}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> ReplaceSpec:
        """The spec `to_payload` wrote."""
        return cls(transcoder=str(d["transcoder"]), path=str(d["path"]),
                   hook_point=d.get("hook_point"), point=str(d["point"]), layer=int(d["layer"]),
                   keep_error=bool(d["keep_error"]),
                   version=tuple(int(v) for v in d.get("version", ())),
                   clamp=tuple((int(f), float(v)) for f, v in d.get("clamp", ())))


def replacement_digest(specs: tuple[ReplaceSpec, ...]) -> str | None:
    """What the prefix-cache salt adds for ``specs`` (``None`` when each leaves its layer as
    it is: ``keep_error`` without a clamp)."""
    specs = tuple(s for s in specs if not s.idle)
    if not specs:
        return None
    digest = hashlib.sha256()
    for spec in specs:
        spec.digest_into(digest)
    return digest.hexdigest()[:32]


def replacement_references(raw: Any) -> list[tuple[str, str | None, tuple[int, ...], bool]]:
    """The ``(transcoder, hook_point, (), True)`` a ``replace_mlp`` value names, without
    checking anything else: what an asynchronous front end has every rank running the layer
    load (as for a clamp) before it parses. Malformed values give nothing (the parse names
    the problem); at most ``MAX_SAE_ENTRIES`` are read."""
    try:
        raw = json_value(raw, REPLACE_KEY, None)
    except LensRequestError:
        return []
    items = raw if isinstance(raw, list) else [raw]
    found: list[tuple[str, str | None, tuple[int, ...], bool]] = []
    for item in items[:MAX_SAE_ENTRIES]:
        if not isinstance(item, Mapping):
            continue
        name, hook_point = item.get("transcoder"), item.get("hook_point")
        if (isinstance(name, str) and name and (hook_point is None or isinstance(hook_point, str))
                and (name, hook_point, (), True) not in found):
            found.append((name, hook_point, (), True))
    return found


def parse_replacements(raw: Any, facts: ModelFacts, describe: Describe | None,
                       request_id: str | None) -> tuple[ReplaceSpec, ...]:
    """``replace_mlp``: one ``{"transcoder", "keep_error", "clamp", "hook_point"}`` or a list
    of them, at most one per layer."""
    raw = json_value(raw, REPLACE_KEY, request_id)
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise LensRequestError(REPLACE_KEY, "an empty list asks for nothing",
                               request_id=request_id)
    if len(items) > MAX_SAE_ENTRIES:
        raise LensRequestError(REPLACE_KEY, f"has {len(items)} entries; at most "
                               f"{MAX_SAE_ENTRIES} MLPs are replaced per request",
                               request_id=request_id)
    specs: list[ReplaceSpec] = []
    layers: dict[int, int] = {}
    for i, item in enumerate(items):
        field = REPLACE_KEY if not isinstance(raw, list) else f"{REPLACE_KEY}[{i}]"
        spec = _parse_one(item, facts, describe, field, request_id)
        if spec.layer in layers:
            raise LensRequestError(f"{field}.transcoder", f"replaces layer {spec.layer}'s MLP, "
                                   f"as entry {layers[spec.layer]} does; one transcoder per "
                                   "layer", request_id=request_id)
        layers[spec.layer] = i
        specs.append(spec)
    return tuple(specs)


def _parse_one(item: Any, facts: ModelFacts, describe: Describe | None, field: str,
               request_id: str | None) -> ReplaceSpec:
    item = checked_item(item, _FIELDS, field, '{"transcoder": <name>, "keep_error": true or '
                        'false, "clamp": {feature: value}}', request_id)
    name, hook_point = named_sae(item, field, request_id, key="transcoder")
    keep_error = checked_flag(item.get("keep_error"), f"{field}.keep_error", request_id,
                              "true (the layer keeps the transcoder's error: without a clamp "
                              "it computes what it did) or false (the MLP's output becomes the "
                              "transcoder's prediction); required")
    if describe is not None and getattr(describe, "sae_slice", None) is not None:
        describe = functools.partial(describe, clamp=True)  # every rank running it keeps it
    info, point, layer, d_sae = described(describe, name, hook_point, facts,
                                          f"{field}.transcoder", "replace an MLP", request_id)
    out_point = info.get("out_point")
    if out_point is None:
        raise LensRequestError(f"{field}.transcoder", f"is a {info.get('architecture')} SAE, "
                               "not a transcoder (it predicts no other point)",
                               request_id=request_id)
    # (check_description proved its output point is here, d_out wide)
    clamp = _clamp(item.get("clamp"), d_sae, f"{field}.clamp", request_id)
    return ReplaceSpec(transcoder=name, path=str(info["path"]),
                       hook_point=info.get("hook_point", hook_point), point=point, layer=layer,
                       keep_error=keep_error,
                       version=tuple(int(v) for v in info.get("version", ())), clamp=clamp)


def _clamp(raw: Any, d_sae: int, field: str, request_id: str | None
           ) -> tuple[tuple[int, float], ...]:
    """``{feature: value}`` (JSON's string keys, or ints) -> sorted (feature, value) pairs."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or not raw:
        raise LensRequestError(field, "a map of feature index to the value it is set to, e.g. "
                               '{"12": 0.0, "40": 5.0}', request_id=request_id)
    if len(raw) > MAX_CLAMPED:
        raise LensRequestError(field, f"clamps {len(raw)} features; at most {MAX_CLAMPED}",
                               request_id=request_id)
    pairs: dict[int, float] = {}
    for key, value in raw.items():
        index = key if isinstance(key, int) and not isinstance(key, bool) else (
            int(key) if isinstance(key, str) and key.strip().isascii()
            and key.strip().isdecimal() else None)
        if index is None or not 0 <= index < d_sae:
            raise LensRequestError(field, f"{key!r} is not a feature of this transcoder (0 to "
                                   f"{d_sae - 1})", request_id=request_id)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or abs(value) > _FLOAT32_MAX):
            raise LensRequestError(f"{field}.{key}", f"a finite number within float32's range, "
                                   f"got {value!r}", request_id=request_id)
        if index in pairs:
            raise LensRequestError(field, f"names feature {index} twice", request_id=request_id)
        pairs[index] = float(value)
    return tuple(sorted(pairs.items()))
