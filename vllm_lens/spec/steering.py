"""Steering: ``apply_steering_vectors`` (vectors, presets, replacements, ablations and caps,
phases, conditions, SAE features through ``spec.sae_steering``) -> ``SteerSpec`` /
``GateSpec`` records (``spec.steer_records``) (runs in: front end).

Every tensor a client sends is sized against the model and charged to one decode budget
before it is decompressed."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_lens import envs
from vllm_lens.common import wire
from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, UnsupportedConfigError
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import (
    layer_rule,
    parse_write_point,
    position_rule,
    sorted_indices,
)
from vllm_lens.spec.keys import PRESET_PREFIX, STEER_KEY
from vllm_lens.spec.sae_steering import (
    check_clamps_alone,
    is_feature_item,
    parse_feature_steering,
)
from vllm_lens.spec.saes import MAX_SAE_ENTRIES
from vllm_lens.spec.steer_records import GateSpec, SteerSpec


def parse_steering_key(raw: Any, facts: ModelFacts, request_id: str | None,
                    presets: Mapping[str, tuple[SteerSpec, ...]] | None = None,
                    field: str = STEER_KEY, saes: Any = None) -> tuple[SteerSpec, ...]:
    """``apply_steering_vectors``: vectors, ``"preset:<name>"`` and steering by SAE feature
    (``spec.sae_steering``; ``saes`` describes the SAEs, as for ``output_sae_features``)."""
    from vllm_lens.steering import SteeringVector

    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("["):  # json.dumps([sv.model_dump(mode="json"), ...])
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise LensRequestError(field, f"not valid JSON ({exc.msg})",
                                       request_id=request_id) from None
        else:  # one SteeringVector.to_wire() string
            raw = [text]
    elif isinstance(raw, (SteeringVector, Mapping)):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise LensRequestError(
            field, "expected a non-empty list of SteeringVector objects, dicts or wire strings",
            request_id=request_id)
    specs = []
    # Every tensor a client sends is charged against one budget before it is decompressed.
    limit = wire.decode_limit(envs.max_decoded_bytes(),
                              "VLLM_LENS_MAX_DECODED_BYTES (one request's steering tensors)",
                              functools.partial(_check_steering_shape, facts))
    most = envs.max_steering_vectors()
    by_feature = 0
    with limit:
        for i, item in enumerate(raw):
            where = f"{field}[{i}]"
            if is_feature_item(item):
                by_feature += 1
                _check_features(by_feature, MAX_SAE_ENTRIES, where, request_id)
                _check_count(len(specs) + 1, most, where, request_id)
                specs.append(parse_feature_steering(item, facts, saes, where, request_id))
            elif isinstance(item, str) and item.startswith(PRESET_PREFIX):
                found = _preset(item, presets, where, request_id)
                # A preset's clamps were items steering by feature: they count as the request's.
                by_feature += sum(spec.mode == "clamp" for spec in found)
                _check_features(by_feature, MAX_SAE_ENTRIES, where, request_id)
                _check_count(len(specs) + len(found), most, where, request_id)
                for spec in found:  # a preset's tensors count as the request's own
                    _charge(spec, where, request_id)
                specs.extend(found)
            else:
                _check_count(len(specs) + 1, most, where, request_id)
                specs.append(_parse_one_vector(item, facts, where, request_id))
    _check_replacements_apart(specs, facts, field, request_id)
    check_clamps_alone(specs, facts, field, request_id)
    return tuple(specs)


def _check_features(count: int, most: int, where: str, request_id: str | None) -> None:
    """Refuse a request steering by SAE feature with more than ``most`` items (a preset's
    clamps included): each clamp encodes its features at every steered row."""
    if count > most:
        raise LensRequestError(where, f"steers by SAE feature beyond the {most} such items a "
                               "request may carry (a preset's clamps included); list several "
                               "features in one item", request_id=request_id)


def _check_count(count: int, most: int, where: str, request_id: str | None) -> None:
    """Refuse a request whose steering vectors (presets expanded) outnumber the setting:
    every vector is decoded on every worker and steers inside the shared forward pass."""
    if count > most:
        raise LensRequestError(
            where, f"brings the request to {count:,} steering vectors (presets expanded), "
            f"above this server's VLLM_LENS_MAX_STEERING_VECTORS ({most:,}); add vectors that "
            "share layers and positions into one, or raise the setting", request_id=request_id)


def _charge(spec: SteerSpec, where: str, request_id: str | None) -> None:
    try:
        # A clamp's decoder rows and encoder columns have its SAE's shapes (vetted when the
        # preset was registered), not a steering vector's.
        wire.charge(spec.vectors, check=spec.clamp is None)
        if spec.clamp is not None:
            wire.charge(spec.clamp.encoder, check=False)
        if spec.condition is not None:
            wire.charge(spec.condition.probe)
    except wire.WireError as exc:
        raise LensRequestError(where, str(exc), request_id=request_id) from None


def parse_steering(raw: Any, facts: ModelFacts, field: str,
                   saes: Any = None) -> tuple[SteerSpec, ...]:
    """Validate steering vectors against the model outside a request (a preset being
    registered, a patching sweep's corruption): the forms ``apply_steering_vectors`` takes,
    errors naming ``field``. ``saes`` describes the SAEs its items steer by (without it such
    an item is refused)."""
    return parse_steering_key(raw, facts, None, None, field, saes)


def _preset(item: str, presets: Mapping[str, tuple[SteerSpec, ...]] | None, where: str,
            request_id: str | None) -> tuple[SteerSpec, ...]:
    name = item.removeprefix(PRESET_PREFIX)
    if presets is None:
        raise LensRequestError(where, f"{item!r}: a preset cannot be selected here (a preset "
                               "holds vectors, not other presets)", request_id=request_id)
    found = presets.get(name)
    if found is None:
        known = ", ".join(sorted(presets)) or "none are registered"
        raise LensRequestError(where, f"unknown steering preset {name!r} ({known})",
                               request_id=request_id)
    return found


def _check_replacements_apart(specs: Sequence[SteerSpec], facts: ModelFacts, field: str,
                              request_id: str | None) -> None:
    """Two ``replace`` vectors may not write the same rows of one site of one layer (two
    points read at one site, e.g. ``mlp_out`` and ``resid_post``, write the same tensor):
    which one wins would be an accident of order. Linear in the positions named."""
    # (layer, site) -> phase -> [index of a vector writing every position, {position: index}]
    written: dict[tuple[int, str], dict[str, list[Any]]] = {}
    for i, spec in enumerate(specs):
        if spec.mode != "replace":
            continue
        site = tap_points.site_of(spec.point, split=facts.split)
        phases = ("all", "prefill", "decode") if spec.phase == "all" else ("all", spec.phase)
        for layer in spec.layers:
            by_phase = written.setdefault((layer, site), {})
            for phase in phases:
                everywhere, at = by_phase.get(phase, (None, {}))
                clash = everywhere if everywhere is not None else (
                    next(iter(at.values()), None) if spec.positions is None else
                    next((at[p] for p in spec.positions if p in at), None))
                if clash is not None:
                    raise LensRequestError(
                        f"{field}[{i}]", f"replaces rows of layer {layer} at the {site} site "
                        f"that {field}[{clash}] replaces too; give each (layer, position) one "
                        "replacement", request_id=request_id)
            mine = by_phase.setdefault(spec.phase, [None, {}])
            if spec.positions is None:
                mine[0] = i
            else:
                mine[1].update((p, i) for p in spec.positions)


def _check_steering_shape(facts: ModelFacts, shape: list[int]) -> None:
    """A steering tensor's declared shape, vetted against the model before decompression: the
    activations (2D or 3D) or a condition's probe (1D)."""
    if len(shape) == 1:
        if shape[0] != facts.hidden_size:
            raise wire.WireError(f"a probe of {shape[0]} values, but the model's hidden size "
                                 f"is {facts.hidden_size}")
        return
    if len(shape) not in (2, 3):
        raise wire.WireError(f"activations must be 2D or 3D, got shape {shape}")
    if shape[-1] != facts.hidden_size:
        raise wire.WireError(f"hidden size is {shape[-1]} but the model's is {facts.hidden_size}")
    if shape[0] > facts.n_layers:
        raise wire.WireError(f"{shape[0]} rows of layers, but the model has {facts.n_layers} "
                             "layers (and a layer may appear once)")
    if len(shape) == 3 and shape[1] > facts.max_model_len:
        raise wire.WireError(f"{shape[1]} positions, but the model's context is "
                             f"{facts.max_model_len}")


def _parse_one_vector(item: Any, facts: ModelFacts, where: str,
                      request_id: str | None) -> SteerSpec:
    from pydantic import ValidationError

    from vllm_lens.steering import SteeringVector

    try:
        if isinstance(item, SteeringVector):
            sv = item
        elif isinstance(item, Mapping):
            sv = SteeringVector.model_validate(dict(item))
        elif isinstance(item, str):
            sv = SteeringVector.from_wire(item)
        else:
            raise ValueError(f"expected a SteeringVector, dict or wire string, got "
                             f"{type(item).__name__}")
    except ValidationError as exc:
        err = exc.errors()[0]
        # A rule across fields names the one to fix (``steering._FieldError``).
        loc = getattr((err.get("ctx") or {}).get("error"), "field", None) or ".".join(
            str(x) for x in err["loc"])
        raise LensRequestError(f"{where}.{loc}" if loc else where,
                               err["msg"].removeprefix("Value error, "),
                               request_id=request_id) from None
    except ValueError as exc:  # WireError included
        raise LensRequestError(where, str(exc), request_id=request_id) from None
    return _check_against_model(sv, facts, where, request_id)


def _check_against_model(sv: Any, facts: ModelFacts, where: str,
                         request_id: str | None) -> SteerSpec:
    hidden = sv.activations.shape[-1]
    if hidden != facts.hidden_size:
        raise LensRequestError(
            f"{where}.activations",
            f"hidden size is {hidden} but the model's is {facts.hidden_size}",
            request_id=request_id)
    positions = sv.positions
    if positions is not None:
        sorted_indices(positions, f"{where}.position_indices", position_rule(facts), request_id)
    if sv.layer_indices == [-1]:  # the token embeddings: the stream entering layer 0
        layers = (0,)
        point = parse_write_point("resid_pre", facts, f"{where}.hook_point", request_id)
    elif sv.layer_indices == "all":  # one row, used at every decoder layer
        layers = tuple(range(facts.n_layers))
        point = parse_write_point(sv.hook_point, facts, f"{where}.hook_point", request_id)
    else:
        sorted_indices(sv.layer_indices, f"{where}.layer_indices", layer_rule(facts),
                        request_id)
        layers = tuple(sv.layer_indices)
        point = parse_write_point(sv.hook_point, facts, f"{where}.hook_point", request_id)
    condition = None
    if sv.condition is not None:
        condition = _parse_condition(sv.condition, layers, point, facts, f"{where}.condition",
                                     request_id)
    return SteerSpec(
        layers=layers, vectors=wire.dumps(sv.activations), scale=sv.scale,
        norm_match=sv.norm_match, positions=None if positions is None else tuple(positions),
        point=point, mode=sv.mode, phase=sv.phase, condition=condition,
        cap=None if sv.cap is None else tuple(sv.cap),
    )


def _parse_condition(cond: Any, layers: tuple[int, ...], point: str, facts: ModelFacts,
                     where: str, request_id: str | None) -> GateSpec:
    """A steering condition, checked against the model and against the layers it gates: it
    must be read before the earliest steered (layer, site) in the same forward pass."""
    if facts.pp_size > 1:
        raise UnsupportedConfigError(
            where, f"conditional steering under pipeline parallelism (pipeline_parallel_size="
            f"{facts.pp_size}) is not yet proven (the gate may be read on another stage than "
            "the one it steers); use pipeline_parallel_size=1", request_id=request_id)
    width = cond.probe.shape[-1]
    if width != facts.hidden_size:
        raise LensRequestError(f"{where}.probe", f"hidden size is {width} but the model's is "
                               f"{facts.hidden_size}", request_id=request_id)
    (layer,) = sorted_indices([cond.layer], f"{where}.layer", layer_rule(facts), request_id)
    read = parse_write_point(cond.point, facts, f"{where}.point", request_id)

    def order(at_layer: int, at_point: str) -> tuple[int, int]:
        return at_layer, tap_points.SITES.index(tap_points.site_of(at_point, split=facts.split))

    first = min(order(steered, point) for steered in layers)
    if order(layer, read) > first:
        raise LensRequestError(
            f"{where}.layer", f"the condition is read at layer {layer} {read}, after the "
            f"steering it gates (layer {first[0]} {point}); read it at or before the steered "
            "layer, in the same forward pass", request_id=request_id)
    return GateSpec(layer=layer, point=read, threshold=float(cond.threshold),
                    sharpness=float(cond.sharpness), probe=wire.dumps(cond.probe))
