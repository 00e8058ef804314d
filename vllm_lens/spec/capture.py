"""Captures: ``output_residual_stream``, ``output_activations`` and ``output_qk`` -> ``CaptureSpec``
(which signal, layers, positions, reduction) (runs in: front end, worker).

Workers decode it again from the payload."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, UnsupportedModelError
from vllm_lens.common.positions import parse_selector
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import (
    check_site,
    checked_item,
    json_value,
    parse_heads,
    parse_layers,
    position_rule,
    sorted_indices,
)
from vllm_lens.spec.keys import ACTIVATIONS_KEY, CAPTURE_KEY, QK_KEY, REDUCTIONS


_CAPTURE_FIELDS = ("layers", "positions", "reduce")


@dataclass(frozen=True)
class CaptureSpec:
    """Which residual-stream rows a request wants.

    ``positions`` is a selector (``"prompt"``, ``"prompt[1:]"``, ``"generated[-5:]"`` ...;
    see ``vllm_lens.common.positions``) or a sorted tuple of absolute token positions; ``reduce``
    collapses the selected positions per layer (``"mean"`` or ``"last"``).

    This is the validated form of one capture: the front end builds it from a request's
    ``output_residual_stream``, each entry of ``output_activations`` and ``output_qk`` (a Q
    and a K spec), checking the layers, positions and reduction against the model (bad
    values raise ``LensRequestError`` naming the field), and sends it to the workers inside
    the request. Requests are written as those dicts, not as ``CaptureSpec`` objects;
    constructing one directly checks nothing.

    Args:
        layers: decoder layer indices, sorted and distinct (``0 .. n_layers - 1``).
        positions: a selector string or a sorted tuple of absolute positions; default
            ``"all"`` (every position of the prompt and the generated tokens).
        reduce: ``None`` (default: one row per selected position), ``"mean"`` or
            ``"last"`` (one row per layer).
        signal: what is captured (see the attribute below); default ``"residual_stream"``.

    Examples:
        >>> from vllm_lens import CaptureSpec
        >>> spec = CaptureSpec(layers=(1, 3), positions="prompt[-2:]", reduce="mean")
        >>> spec.to_payload()
        {'layers': [1, 3], 'signal': 'residual_stream', 'reduce': 'mean',
         'positions': 'prompt[-2:]'}
        >>> CaptureSpec.from_payload(spec.to_payload()) == spec, spec.wants_prompt_rows()
        (True, True)
    """

    layers: tuple[int, ...]
    positions: str | tuple[int, ...] = "all"
    reduce: str | None = None
    signal: str = tap_points.RESIDUAL_SIGNAL
    """What is captured: ``residual_stream`` (``output_residual_stream``), a tap point
    (``output_activations``), or ``attn_q`` / ``attn_k`` (``output_qk``)."""

    def to_payload(self) -> dict[str, Any]:
        """Plain msgpack types, as the spec travels to the workers inside the request.

        Returns:
            ``{"layers": [int, ...], "signal": str, "reduce": str | None, "positions":
            str | [int, ...]}`` (a tuple of positions becomes a list); the inverse of
            ``from_payload``.
        """
        return {"layers": list(self.layers), "signal": self.signal, "reduce": self.reduce,
                "positions": self.positions if isinstance(self.positions, str)
                else list(self.positions)}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> CaptureSpec:
        """Inverse of ``to_payload`` (run on the workers); it re-checks nothing.

        Args:
            d: a ``to_payload`` dict; ``signal`` may be missing (then
                ``"residual_stream"``).

        Returns:
            The ``CaptureSpec`` the payload describes (a list of positions becomes a tuple).

        Raises:
            KeyError: ``d`` lacks ``layers``, ``positions`` or ``reduce``.
        """
        positions = d["positions"]
        return cls(layers=tuple(int(x) for x in d["layers"]),
                   positions=positions if isinstance(positions, str) else tuple(positions),
                   reduce=d["reduce"], signal=str(d.get("signal", tap_points.RESIDUAL_SIGNAL)))

    def wants_prompt_rows(self) -> bool:
        """True if any prompt position may be selected (so prefix-cache hits must be recomputed).

        Returns:
            ``True`` for explicit positions and for selectors that may read the prompt
            (``"all"``, ``"prompt..."``, ``"last_prompt"``, or one that does not parse);
            ``False`` for ``"generated"`` and its slices.
        """
        if isinstance(self.positions, tuple):
            return True
        selector = parse_selector(self.positions)
        return selector is None or selector.may_read_prompt


def parse_capture(raw: Any, facts: ModelFacts, request_id: str | None,
                   field: str = CAPTURE_KEY) -> CaptureSpec:
    if isinstance(raw, str):  # HTTP's vllm_xargs carries structured values as JSON strings
        text = raw
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise LensRequestError(field, f"not valid JSON ({exc.msg})", request_id=request_id) from None
        if not isinstance(raw, (list, Mapping)) and raw is not True:
            # Offline a str is the caller's mistake ('12' for [12]); over HTTP a JSON text.
            raise LensRequestError(
                field, f"expected a list of layer indices, true, or an object with "
                f"\"layers\"; got the string {text!r} (JSON for {type(raw).__name__} {raw!r}); "
                "send a list such as [12]", request_id=request_id)
    if isinstance(raw, Mapping):
        unknown = [k for k in raw if k not in _CAPTURE_FIELDS]
        if unknown:
            raise LensRequestError(
                f"{field}.{unknown[0]}",
                f"unknown field; allowed fields are {', '.join(_CAPTURE_FIELDS)}",
                request_id=request_id,
            )
        if "layers" not in raw:
            raise LensRequestError(f"{field}.layers", "missing (a list of layer indices, or true)",
                                   request_id=request_id)
        return CaptureSpec(
            layers=parse_layers(raw["layers"], facts, f"{field}.layers", request_id),
            positions=parse_positions(raw.get("positions", "all"), facts, f"{field}.positions",
                                       request_id),
            reduce=parse_reduce(raw.get("reduce"), f"{field}.reduce", request_id),
        )
    return CaptureSpec(layers=parse_layers(raw, facts, field, request_id))


def parse_points(raw: Any, facts: ModelFacts, request_id: str | None) -> tuple[CaptureSpec, ...]:
    """``output_activations``: ``{point: layers | true | {"layers", "positions", "reduce"}}``;
    a ``blocks.{L}.`` name fixes the layer (then its value is ``true`` or a dict without
    ``layers``). Names that resolve to the same point merge their layers if their positions
    and reduction agree."""
    field = ACTIVATIONS_KEY
    raw = json_value(raw, field, request_id)
    if not isinstance(raw, Mapping) or not raw:
        raise LensRequestError(field, "expected a non-empty object {point: layers | true | "
                               f"{{layers, positions, reduce}}}}; points: "
                               f"{', '.join(tap_points.POINTS)}", request_id=request_id)
    merged: dict[str, CaptureSpec] = {}
    for name, value in raw.items():
        where = f"{field}.{name}"
        try:
            point, layer = tap_points.resolve(name)
        except KeyError as exc:
            raise LensRequestError(where, exc.args[0], request_id=request_id) from None
        check_site(point, facts, where, request_id)
        if layer is not None:
            if value is True or value == "true":
                value = {}
            if not isinstance(value, Mapping) or "layers" in value:
                raise LensRequestError(where, "a blocks.<layer>. name fixes the layer: give true "
                                       "or {positions, reduce}", request_id=request_id)
            value = {**value, "layers": [layer]}
        spec = dataclasses.replace(parse_capture(value, facts, request_id, field=where),
                                   signal=point)
        if point == tap_points.FINAL_POINT:
            spec = _after_the_last_layer(spec, facts, where, request_id)
        if (old := merged.get(point)) is not None:
            if (old.positions, old.reduce) != (spec.positions, spec.reduce):
                raise LensRequestError(where, f"names the point {point} again with other "
                                       "positions or reduce; use one entry per point",
                                       request_id=request_id)
            spec = dataclasses.replace(old, layers=tuple(sorted(set(old.layers + spec.layers))))
        merged[point] = spec
        if point in HEAD_POINTS:  # (on the merged layers: names of one point join)
            check_one_head_size(spec.layers, facts, where, request_id)
    return tuple(merged.values())


#: Points read per attention head (rows ``[heads, head_dim]``).
HEAD_POINTS = ("attn_z", "value", *tap_points.QK_NORM_POINTS)


def check_one_head_size(layers: tuple[int, ...], facts: ModelFacts, where: str,
                        request_id: str | None) -> None:
    """Refuse per-head captures over layers whose heads differ in size (Gemma 4: 64 on its
    sliding-window layers, 512 on its global ones): one capture is one ``[layers, rows,
    heads, head_dim]`` tensor."""
    sizes: dict[int, list[int]] = {}
    for layer in layers:
        meta = facts.qk_meta[layer] if layer < len(facts.qk_meta) else {}
        if meta.get("head_size"):
            sizes.setdefault(int(meta["head_size"]), []).append(layer)
    if len(sizes) > 1:
        found = "; ".join(f"{size} at layers {found}" for size, found in sorted(sizes.items()))
        raise LensRequestError(where, f"these layers' attention heads differ in size ({found}): "
                               "one capture holds heads of one size; capture the layers of "
                               "each size in a request of their own", request_id=request_id)


def _after_the_last_layer(spec: CaptureSpec, facts: ModelFacts, where: str,
                          request_id: str | None) -> CaptureSpec:
    """``final_norm`` is read once, after the last layer: ``true`` (every layer) means that
    one, and any other layer is refused."""
    last = facts.n_layers - 1
    if spec.layers == tuple(range(facts.n_layers)):
        return dataclasses.replace(spec, layers=(last,))
    if spec.layers != (last,):
        raise LensRequestError(where, f"final_norm is read once, after the last layer: give "
                               f"true or [{last}], not {list(spec.layers)}",
                               request_id=request_id)
    return spec


def parse_qk(raw: Any, facts: ModelFacts, request_id: str | None
             ) -> tuple[tuple[CaptureSpec, ...], tuple[int, ...] | None]:
    """``output_qk``: ``true``, a list of layers, or ``{"layers", "heads"}`` -> the ``attn_q``
    and ``attn_k`` captures (every position: an attention pattern needs all keys) and the
    query heads the response keeps (``None``: all of them)."""
    raw = json_value(raw, QK_KEY, request_id)
    check_site("attn_q", facts, QK_KEY, request_id)
    heads = None
    if isinstance(raw, Mapping):
        item = checked_item(raw, ("layers", "heads"), QK_KEY,
                            "true, a list of layers or {\"layers\", \"heads\"}", request_id)
        if "layers" not in item:
            raise LensRequestError(f"{QK_KEY}.layers", "is required (a list of layers, or "
                                   "true)", request_id=request_id)
        raw = json_value(item["layers"], f"{QK_KEY}.layers", request_id)
        if item.get("heads") is not None:
            heads = parse_heads(item["heads"], facts, f"{QK_KEY}.heads", request_id)
        layers = parse_layers(raw, facts, f"{QK_KEY}.layers", request_id)
    else:
        layers = parse_layers(raw, facts, QK_KEY, request_id)
    blind = [layer for layer in layers
             if layer >= len(facts.qk_meta) or not facts.qk_meta[layer]]
    if blind:
        raise UnsupportedModelError(QK_KEY, f"the attention of layers {blind} cannot be "
                                    "described (scale, window ...), so their Q/K are not "
                                    "captured", request_id=request_id)
    check_one_head_size(layers, facts, QK_KEY, request_id)
    return (CaptureSpec(layers=layers, signal="attn_q"),
            CaptureSpec(layers=layers, signal="attn_k")), heads


def parse_positions(
    raw: Any, facts: ModelFacts, field: str, request_id: str | None
) -> str | tuple[int, ...]:
    forms = ("'all', 'prompt', 'generated', 'last_prompt', a slice of one of the first three "
             "such as 'prompt[1:]', 'generated[-5:]' or 'all[-1]', or a list of absolute "
             "positions")
    if isinstance(raw, str):
        if parse_selector(raw) is None:
            raise LensRequestError(field, f"unknown selector {raw!r}; use {forms}",
                                   request_id=request_id)
        return raw.replace(" ", "")
    if hasattr(raw, "tolist"):
        raw = raw.tolist()  # a numpy array or tensor of positions
    if not isinstance(raw, (list, tuple)):
        raise LensRequestError(field, f"expected {forms}; got {type(raw).__name__} {raw!r}",
                               request_id=request_id)
    if not raw:
        raise LensRequestError(field, f"a non-empty list is needed; or use {forms}",
                               request_id=request_id)
    return sorted_indices(raw, field, position_rule(facts), request_id)


def parse_reduce(raw: Any, field: str, request_id: str | None) -> str | None:
    if raw not in REDUCTIONS:
        raise LensRequestError(field, f"unknown reduction {raw!r}; use null, 'mean' or 'last'",
                               request_id=request_id)
    return raw
