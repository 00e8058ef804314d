"""Steering by SAE feature: an ``apply_steering_vectors`` item ``{"sae", "feature", "scale"}``
or ``{"sae", "feature", "clamp"}`` -> a ``SteerSpec`` at the SAE's point and layer (runs in:
front end).

``scale`` adds ``scale * W_dec[feature]`` (the row as stored; a transcoder's at the point it
predicts, ``mlp_out``): an ordinary steering vector made from the decoder rows, so
positions, phases and the prefix-cache salt (the vector's
bytes) work as they do for vectors a client sends. Several features may be listed
(``"feature": [i, j]``, ``"scale"`` a number or a list); the vector is then
``sum_j scale_j * W_dec[j]`` computed in float32.

``clamp`` sets each listed feature to its target at every steered row: the worker computes
the features ``f`` from the stream before any steering at that site and adds
``decode(f') - decode(f)`` (``f'``: ``f`` with the features set), keeping the SAE's error
term (``worker.steer``). For SAEs whose features each depend on their own column
(``standard``, ``jumprelu``) that is ``(clamp - f) @ W_dec[features]``, and the request ships
the features' encoder columns. A TopK feature depends on every other (whether it is among the
top k), so a TopK clamp ships no encoder: every rank that steers the SAE's layer (every TP
rank of the stage holding it) loads the whole SAE (``describe(..., clamp=True)``, counted in
``VLLM_LENS_SAE_MAX_BYTES``), keeps it while the request runs, and encodes each steered row
in full; with ``rescale_acts_by_decoder_norm`` the difference divides each row by its norm.

A transcoder's features are clamped by ``replace_mlp`` (``spec.replacement``), which reads
them at its input and writes at its output; a steering ``clamp`` of one is refused, naming it.

The rows and columns come from the workers that loaded the SAE (``describe.sae_slice``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_lens.common import points as tap_points
from vllm_lens.common import wire
from vllm_lens.errors import LensRequestError
from vllm_lens.saes.model import WHOLE_CLAMP
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import (
    parse_write_point,
    position_rule,
    sorted_indices,
)
from vllm_lens.spec.saes import MAX_SAE_ENTRIES, Describe, described, named_sae
from vllm_lens.spec.steer_records import ClampSpec, SteerSpec

__all__ = ["MAX_FEATURES", "check_clamps_alone", "is_feature_item", "parse_feature_steering",
           "steering_sae_references"]

_FIELDS = ("sae", "hook_point", "feature", "scale", "clamp", "position_indices", "phase")
#: Features one steering item may list.
MAX_FEATURES = 64


def is_feature_item(item: Any) -> bool:
    """An ``apply_steering_vectors`` item that steers by SAE feature."""
    return isinstance(item, Mapping) and "sae" in item


def steering_sae_references(raw: Any
                            ) -> list[tuple[str, str | None, tuple[int, ...], bool]]:
    """The ``(sae, hook_point, features, clamps)`` an ``apply_steering_vectors`` value steers
    by, without checking anything else: what an asynchronous front end fetches decoder rows
    for (and, for a clamp, has every steering rank load a TopK SAE) before it parses.
    Malformed items give nothing (the parse names the problem); at most ``MAX_SAE_ENTRIES``
    are read."""
    if isinstance(raw, str):
        if '"sae"' not in raw or not raw.lstrip().startswith("["):
            return []
        try:
            raw = json.loads(raw)
        except ValueError:
            return []
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    found: list[tuple[str, str | None, tuple[int, ...], bool]] = []
    for item in items:
        if not is_feature_item(item):
            continue
        name, hook_point, features = item.get("sae"), item.get("hook_point"), item.get("feature")
        features = [features] if isinstance(features, int) else features
        if (isinstance(name, str) and (hook_point is None or isinstance(hook_point, str))
                and isinstance(features, list) and 0 < len(features) <= MAX_FEATURES
                and all(isinstance(f, int) and not isinstance(f, bool) for f in features)):
            ref = (name, hook_point, tuple(features), item.get("clamp") is not None)
            if ref not in found:
                found.append(ref)
        if len(found) == MAX_SAE_ENTRIES:
            break
    return found


def parse_feature_steering(item: Mapping[str, Any], facts: ModelFacts, describe: Describe | None,
                           where: str, request_id: str | None) -> SteerSpec:
    """One steering-by-feature item as the steering vector it adds."""
    unknown = [k for k in item if k not in _FIELDS]
    if unknown:
        raise LensRequestError(f"{where}.{unknown[0]}", "unknown field; steering by SAE feature "
                               f"takes {', '.join(_FIELDS)}", request_id=request_id)
    name, hook_point = named_sae(item, where, request_id)
    clamping = item.get("clamp") is not None
    if clamping and item.get("scale") is not None:
        raise LensRequestError(f"{where}.clamp", "give \"scale\" (add the decoder rows) or "
                               "\"clamp\" (set the features), not both", request_id=request_id)
    features = item.get("feature")
    features = [features] if isinstance(features, int) and not isinstance(features, bool) \
        else features
    if (not isinstance(features, list) or not 0 < len(features) <= MAX_FEATURES
            or not all(isinstance(f, int) and not isinstance(f, bool) for f in features)):
        raise LensRequestError(f"{where}.feature", f"a feature index or a list of 1 to "
                               f"{MAX_FEATURES} of them", request_id=request_id)
    if len(set(features)) != len(features):
        raise LensRequestError(f"{where}.feature", "lists a feature twice",
                               request_id=request_id)
    if clamping:
        scales = _scales(item["clamp"], len(features), f"{where}.clamp", request_id)
    else:
        scales = _scales(item.get("scale", 1.0), len(features), f"{where}.scale", request_id)
    phase = item.get("phase", "all")
    if phase not in ("all", "prefill", "decode"):
        raise LensRequestError(f"{where}.phase", "'all', 'prefill' or 'decode'",
                               request_id=request_id)
    slice_of = getattr(describe, "sae_slice", None)
    if slice_of is not None and clamping:  # a TopK SAE is kept by every rank clamping it
        describe = functools.partial(describe, clamp=True)
    info, point, layer, d_sae = described(describe if slice_of is not None else None, name,
                                          hook_point, facts, f"{where}.sae",
                                          "steer by SAE feature", request_id)
    if info.get("out_point") is not None:  # a transcoder: its decoder writes what it predicts
        if clamping:
            raise LensRequestError(
                f"{where}.clamp", f"{name!r} is a transcoder: its features are read at "
                f"{point} and written at {info['out_point']}; clamp them with "
                '"replace_mlp": [{"transcoder": ..., "keep_error": true, "clamp": '
                '{feature: value}}] (keep_error: the layer keeps what the transcoder misses)',
                request_id=request_id)
        point = str(info["out_point"])
    whole = clamping and info.get("architecture") in WHOLE_CLAMP
    bad = next((f for f in features if not 0 <= f < d_sae), None)
    if bad is not None:
        raise LensRequestError(f"{where}.feature", f"{bad} is not a feature of this SAE "
                               f"(0 to {d_sae - 1})", request_id=request_id)
    point = parse_write_point(point, facts, f"{where}.sae", request_id)
    positions = item.get("position_indices")
    if positions is not None:
        positions = sorted_indices(positions, f"{where}.position_indices",
                                   position_rule(facts), request_id)
    width = facts.row_width(point)
    k = len(features)
    # What the request brings to the workers, charged before it is built: a clamp's decoder
    # rows and encoder columns (and biases; a TopK clamp's rows alone); a scale's vector (3D
    # with positions).
    shape = ([k if whole else 2 * k + 3, width] if clamping else
             [1, width] if positions is None else [1, len(positions), width])
    try:
        wire.reserve(4 * math.prod(shape), shape, "float32")
        with wire.trusted():
            found = slice_of(name, hook_point, tuple(features))
    except (ValueError, OSError) as exc:  # WireError included
        raise LensRequestError(f"{where}.sae", str(exc), request_id=request_id) from None
    rows = found["W_dec"]
    common = dict(layers=(layer,), norm_match=False, point=point, phase=phase,
                  positions=None if positions is None else tuple(positions))
    if clamping:
        clamp = (_whole_sae_clamp(info, features, scales, f"{where}.sae") if whole
                 else _column_clamp(info, found, scales))
        return SteerSpec(vectors=wire.dumps(rows), scale=1.0, mode="clamp", **common,
                         clamp=clamp)
    if len(features) == 1:  # the row as stored, scaled on the worker like any vector
        vector, scale = rows[:1], scales[0]
    else:
        vector = (torch.tensor(scales, dtype=torch.float32)[:, None] * rows.float()).sum(
            0, keepdim=True)
        scale = 1.0
    if positions is not None:
        vector = vector[:, None, :].expand(1, len(positions), width).contiguous()
    return SteerSpec(vectors=wire.dumps(vector), scale=scale, **common)


def _column_clamp(info: Mapping[str, Any], found: Mapping[str, Any],
                  targets: list[float]) -> ClampSpec:
    """A standard or JumpReLU clamp: it brings its features' encoder columns."""
    encoder = {k: found[k] for k in ("W_enc", "b_enc", "b_dec", "threshold",
                                     "apply_b_dec_to_input")}
    return ClampSpec(architecture=str(info["architecture"]), targets=tuple(targets),
                     encoder=wire.dumps(encoder))


def _whole_sae_clamp(info: Mapping[str, Any], features: list[int], targets: list[float],
                     field: str) -> ClampSpec:
    """A clamp of a ``WHOLE_CLAMP`` SAE (TopK, AbsTopK, gated): it names the SAE every
    steering rank loaded for it (the key its description gives) and the version of its files,
    for the prefix-cache salt."""
    return ClampSpec(architecture=str(info["architecture"]), targets=tuple(targets), encoder=wire.dumps({}),
                     path=str(info["path"]), hook_point=info.get("hook_point"),
                     version=tuple(int(v) for v in info.get("version", ())),
                     features=tuple(features), field=field)


def _scales(raw: Any, n: int, field: str, request_id: str | None) -> list[float]:
    values = raw if isinstance(raw, list) else [raw] * n
    if len(values) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                   and math.isfinite(v) for v in values):
        raise LensRequestError(field, f"a finite number, or a list of {n} (one per feature)",
                               request_id=request_id)
    return [float(v) for v in values]


def check_clamps_alone(specs: Sequence[SteerSpec], facts: ModelFacts, field: str,
                        request_id: str | None) -> None:
    """A clamp reads its features before anything at its site is written, so another clamp
    or a replacement at the same (layer, site) would make its targets an accident of order:
    one clamp per site (it may list several features), and none where a vector replaces."""
    seen: dict[tuple[int, str], int] = {}
    for i, spec in enumerate(specs):
        if spec.mode not in ("clamp", "replace"):
            continue
        for layer in spec.layers:
            where = (layer, tap_points.site_of(spec.point, split=facts.split))
            other = seen.get(where)
            if other is not None and "clamp" in (spec.mode, specs[other].mode):
                raise LensRequestError(
                    f"{field}[{i}]", f"{spec.mode}s at layer {layer}'s {where[1]} site, where "
                    f"{field}[{other}] {specs[other].mode}s too; a clamp must be the only "
                    "clamp or replacement at its site (list several features in one clamp)",
                    request_id=request_id)
            if other is None or spec.mode == "clamp":
                seen[where] = i

