"""Hooks: ``apply_hooks`` (live ``Hook`` / ``NamedHook`` objects, named hooks' JSON, pickled hooks
where the operator allows code) -> ``HookSpec`` (runs in: front end, worker).

Workers decode it again from the payload."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lens import envs
from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, RemoteCodeRefusedError
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import (
    check_site,
    json_value,
    layer_rule,
    parse_write_point,
    sorted_indices,
)
from vllm_lens.spec.keys import HOOKS_KEY, MAX_HOOK_ARGS_BYTES


@dataclass(frozen=True)
class HookSpec:
    """One validated hook, in the form that travels to the workers."""

    layers: tuple[int, ...]
    pre: bool
    pickled: bytes | None = None
    """``cloudpickle`` of a ``Hook`` (offline, or over HTTP with the operator's opt-in)."""
    name: str | None = None
    """A named hook (entry-point group ``vllm_lens.hooks``) and its JSON arguments."""
    args: str = "{}"
    point: str = ""
    """The tap point the hook runs at (``points.STEERABLE``); empty: ``resid_pre`` if ``pre``,
    else ``resid_post``."""

    def __post_init__(self) -> None:
        if not self.point:
            object.__setattr__(self, "point", "resid_pre" if self.pre else "resid_post")

    def to_payload(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "pre": self.pre, "pickled": self.pickled,
                "name": self.name, "args": self.args, "point": self.point}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> HookSpec:
        pickled = d.get("pickled")
        return cls(layers=tuple(int(x) for x in d["layers"]), pre=bool(d["pre"]),
                   pickled=None if pickled is None else bytes(pickled), name=d.get("name"),
                   args=str(d.get("args", "{}")), point=str(d.get("point", "")))


def parse_hooks(raw: Any, facts: ModelFacts, request_id: str | None = None) -> tuple[HookSpec, ...]:
    """Validate ``apply_hooks`` (also the hooks of ``register_hooks``).

    Items: live ``Hook`` / ``NamedHook`` objects, or their JSON forms (``hook_to_json``): a
    named hook's fields, or ``{"pickle": base64}`` — refused with ``RemoteCodeRefusedError``
    unless the operator set ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1``.
    """
    from vllm_lens.hooks import Hook, NamedHook

    field = HOOKS_KEY
    raw = json_value(raw, field, request_id)
    if isinstance(raw, (Hook, NamedHook, Mapping)):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise LensRequestError(field, "expected a non-empty list of Hook or NamedHook objects "
                               "(or their JSON forms)", request_id=request_id)
    most = envs.max_hooks()
    if len(raw) > most:  # before any is parsed: each runs inside the shared forward pass
        raise LensRequestError(field, f"{len(raw):,} hooks, above this server's "
                               f"VLLM_LENS_MAX_HOOKS ({most:,}); give one hook more layers "
                               "instead of one hook per layer, or raise the setting",
                               request_id=request_id)
    return tuple(_parse_hook(item, facts, f"{field}[{i}]", request_id)
                 for i, item in enumerate(raw))


def _parse_hook(item: Any, facts: ModelFacts, where: str, request_id: str | None) -> HookSpec:
    import base64

    import cloudpickle

    from vllm_lens.hooks import Hook, NamedHook

    if isinstance(item, Mapping) and "pickle" in item:
        if not envs.allow_pickled_hooks():
            raise RemoteCodeRefusedError(
                where, "pickled hooks are code and this server does not run code sent by "
                "clients; use a named hook (vllm_lens.hooks entry points), or the operator may "
                "start the server with VLLM_LENS_ALLOW_PICKLED_HOOKS=1 (lets every client run "
                "arbitrary code on it)", request_id=request_id)
        try:
            item = cloudpickle.loads(base64.b64decode(item["pickle"], validate=True))
        except Exception as exc:  # unpickling runs arbitrary code: report whatever it raised
            raise LensRequestError(where, f"cannot unpickle the hook: {exc!r}",
                                   request_id=request_id) from None
    if isinstance(item, Mapping):
        unknown = set(item) - {"name", "layer_indices", "args", "pre", "hook_point"}
        if unknown or "name" not in item or "layer_indices" not in item:
            raise LensRequestError(where, "a named hook needs name and layer_indices (and "
                                   "optional args, pre, hook_point) only", request_id=request_id)
        item = NamedHook(name=item["name"], layer_indices=item["layer_indices"],
                         args=item.get("args") or {}, pre=item.get("pre", False),
                         hook_point=item.get("hook_point"))
    if not isinstance(item, (Hook, NamedHook)):
        raise LensRequestError(where, f"expected a Hook or NamedHook, got {type(item).__name__}",
                               request_id=request_id)
    if not isinstance(item.layer_indices, (list, tuple)) or not item.layer_indices:
        raise LensRequestError(f"{where}.layer_indices", "expected a non-empty list of layers",
                               request_id=request_id)
    layers = sorted_indices(item.layer_indices, f"{where}.layer_indices", layer_rule(facts),
                             request_id)
    if not isinstance(item.pre, bool):
        raise LensRequestError(f"{where}.pre", "expected true or false", request_id=request_id)
    if item.pre and not facts.pre_hooks:
        raise LensRequestError(f"{where}.pre", f"the decoder layers of {facts.model_class} "
                               "have no tappable input; use pre=False (a hook on the previous "
                               "layer's output sees the same stream)", request_id=request_id)
    point = "resid_pre" if item.pre else "resid_post"
    if item.hook_point is not None:
        point = parse_write_point(item.hook_point, facts, f"{where}.hook_point", request_id,
                                   hook=True)
        if item.pre and point != "resid_pre":
            raise LensRequestError(f"{where}.pre", f"pre=True means hook_point='resid_pre', "
                                   f"not {point!r}; give one of them", request_id=request_id)
    else:  # the default point is checked like a named one (e.g. refused by the layout check)
        check_site(point, facts, where, request_id)
    if isinstance(item, Hook):
        if not callable(item.fn):
            raise LensRequestError(f"{where}.fn", "is not callable", request_id=request_id)
        return HookSpec(layers=layers, pre=item.pre, pickled=cloudpickle.dumps(item.fn),
                        point=point)
    args_json = check_named_hook(item.name, item.args, point, facts, where, request_id)
    return HookSpec(layers=layers, pre=item.pre, name=str(item.name), args=args_json,
                    point=point)


def check_named_hook(name: Any, args: Any, point: str, facts: ModelFacts, where: str,
                     request_id: str | None, *, name_field: str = "name",
                     point_field: str = "hook_point") -> str:
    """Validate a named hook's arguments at ``point`` (the factory runs once, and its
    ``check`` against the served model's rows); returns them as JSON. ``name_field`` and
    ``point_field``: what the item calls the hook's name and point (a monitor by a hook's
    score says ``hook`` and ``point``).

    Raises:
        LensRequestError: naming ``{where}.{field}``.
    """
    from vllm_lens import named_hooks

    if not isinstance(args, Mapping):
        raise LensRequestError(f"{where}.args", "expected a JSON object", request_id=request_id)
    try:
        args_json = json.dumps(dict(args))
    except (TypeError, ValueError) as exc:
        raise LensRequestError(f"{where}.args", f"not JSON-serialisable ({exc})",
                               request_id=request_id) from None
    if len(args_json) > MAX_HOOK_ARGS_BYTES:
        raise LensRequestError(f"{where}.args", f"is {len(args_json):,} bytes of JSON; named "
                               f"hook arguments are limited to {MAX_HOOK_ARGS_BYTES:,}",
                               request_id=request_id)
    try:
        factory = named_hooks.load(str(name))
        factory(args)
        check = getattr(factory, "check", None)
        if check is not None:  # what depends on the model: before anything is scheduled
            check(args, point, None if point in tap_points.SHARDED
                  or point == tap_points.QK_HOOK_POINT else facts.row_shape(point))
    except KeyError as exc:
        raise LensRequestError(f"{where}.{name_field}", exc.args[0],
                               request_id=request_id) from None
    except named_hooks.HookArgumentError as exc:
        field = point_field if exc.field == "hook_point" else exc.field
        raise LensRequestError(f"{where}.{field}", str(exc), request_id=request_id) from None
    except (ValueError, TypeError) as exc:
        raise LensRequestError(f"{where}.args", str(exc), request_id=request_id) from None
    return args_json
