"""``monitors``: probes read while the model generates, that end the generation when they fire
(``action="stop"``) or report their scores (``"flag"``) (runs in: front end, worker).

A request's ``extra_args["monitors"]`` is a list (or its JSON string) of::

    {"name": "refusal", "probe": [hidden floats], "bias": 0.0, "layer": 12,
     "point": "resid_post", "threshold": 2.5, "action": "stop" | "flag",
     "positions": "all" | "generated"}

or, by an SAE feature (a ``standard`` or ``jumprelu`` SAE registered or, offline, a
directory), ``{"name", "sae": NAME, "hook_point": optional, "feature": i, "threshold",
"action", "positions"}``, read at the SAE's own point and layer; or by a named hook's score
(a hook that declares ``monitor_score``, ``named_hooks``: ``linear_probe``,
``attention_to_span``), ``{"name", "hook": NAME, "args": {...}, "layer": L, "point": the
hook's point (default ``resid_post``), "reduce": "max" | "min" | "mean" | "sum" (for a hook
whose score has several entries per position, such as one per head), "threshold", "action",
"positions"}``: the hook runs at that layer for the request alone (its results are the
monitor's, not ``hook_results``).

The score of a row is ``h · probe + bias`` (float32), or the feature's activation as
``output_sae_features`` reports it (the SAE's ``encode`` of ``h``, that feature's column,
float32), or the hook's score for the position (reduced over its entries in float32),
``h`` the point's value at ``layer`` (after any steering there, as a capture sees
it), for every position the engine computes (a hook may score fewer:
``attention_to_span`` scores its ``queries``):
the prompt's and each generated token's (``"positions": "all"``, the default), or the
generated tokens' alone (``"generated"``: a guard on what the model writes, not on what it
was asked). A monitor fires at the first position whose score
is above ``threshold``. ``stop``: when position ``p`` fires (in the step that computes it),
the next token sampled is the end-of-sequence token (not shown in the text), so no token
after ``p`` is generated and the request finishes in that step with ``finish_reason``
``"stop"`` and ``stop_reason`` the monitor's name; a monitor firing on the prompt ends the
request before any visible token. ``flag``: generation goes on. Either way the result holds
one record per monitor (``worker.monitors``, ``frontend.collator``).

Monitors by a TopK SAE's feature (which depends on every other feature) are not built yet:
refused by field. The front end parses and checks; the
workers decode ``MonitorSpec.from_payload``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lens.common import wire
from vllm_lens.errors import LensRequestError, UnsupportedConfigError, WireError
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import check_site, json_value, parse_write_point
from vllm_lens.spec.hooks import HookSpec, check_named_hook
from vllm_lens.spec.keys import MONITORS_KEY
from vllm_lens.spec.sae_steering import steering_sae_references
from vllm_lens.spec.saes import MAX_SAE_ENTRIES, Describe, described, named_sae

__all__ = ["ACTIONS", "MAX_MONITORS", "MONITOR_POINTS", "REDUCTIONS", "SAE_ARCHITECTURES",
           "MonitorSpec",
           "check_sampling", "monitor_sae_references", "parse_monitors"]

ACTIONS = ("stop", "flag")
#: Monitors one request may carry.
MAX_MONITORS = 16
#: Points a monitor reads: the stream and what the sublayers add to it, whole on every
#: tensor-parallel rank (each rank computes the scores it stops on).
MONITOR_POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FIELDS = {"name", "probe", "bias", "layer", "point", "threshold", "action", "positions"}
_SAE_FIELDS = {"name", "sae", "hook_point", "feature", "threshold", "action", "positions"}
_HOOK_FIELDS = {"name", "hook", "args", "layer", "point", "reduce", "threshold", "action",
                "positions"}
#: How a monitor by a hook's score makes one number of a position's several (float32).
REDUCTIONS = ("max", "min", "mean", "sum")
#: SAE architectures whose feature a monitor reads from its own encoder column.
SAE_ARCHITECTURES = ("standard", "jumprelu")
POSITIONS = ("all", "generated")


@dataclass(frozen=True)
class MonitorSpec:
    """One validated monitor, as the workers receive it."""

    name: str
    action: str
    threshold: float
    layer: int
    point: str
    probe: bytes
    """``wire.dumps`` of the ``(hidden,)`` float32 probe (empty for an SAE feature)."""
    bias: float = 0.0
    generated_only: bool = False
    """Scores the generated tokens' rows alone (``"positions": "generated"``)."""
    encoder: bytes = b""
    """By SAE feature: ``wire.dumps`` of the feature's slice of the SAE (``{"architecture",
    "W_enc" [d_in, 1], "b_enc" [1], "W_dec" [1, d_in], "b_dec" [d_in], "threshold" [1] or
    None, "apply_b_dec_to_input"}``); empty for a probe."""
    sae: str = ""
    """By SAE feature: the SAE's name as the request gave it, and the feature."""
    feature: int = -1
    hook: str = ""
    """By a named hook's score: the hook, its arguments (JSON), the key of ``saved`` its
    scores are under (``monitor_score``) and how a position's entries are reduced (empty: one
    number per position)."""
    hook_args: str = "{}"
    score_key: str = ""
    reduce: str = ""

    def hook_spec(self) -> HookSpec:
        """The hook this monitor runs (by a named hook's score only)."""
        return HookSpec(layers=(self.layer,), pre=self.point == "resid_pre", name=self.hook,
                        args=self.hook_args, point=self.point)

    @property
    def stops(self) -> bool:
        return self.action == "stop"

    def to_payload(self) -> dict[str, Any]:
        payload = {"name": self.name, "action": self.action, "threshold": self.threshold,
                   "layer": self.layer, "point": self.point, "probe": self.probe,
                   "bias": self.bias, "generated_only": self.generated_only}
        if self.encoder:
            payload.update(encoder=self.encoder, sae=self.sae, feature=self.feature)
        if self.hook:
            payload.update(hook=self.hook, hook_args=self.hook_args, score_key=self.score_key,
                           reduce=self.reduce)
        return payload

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> MonitorSpec:
        return cls(name=str(d["name"]), action=str(d["action"]),
                   threshold=float(d["threshold"]), layer=int(d["layer"]),
                   point=str(d["point"]), probe=bytes(d["probe"]), bias=float(d["bias"]),
                   generated_only=bool(d["generated_only"]),
                   encoder=bytes(d.get("encoder", b"")), sae=str(d.get("sae", "")),
                   feature=int(d.get("feature", -1)), hook=str(d.get("hook", "")),
                   hook_args=str(d.get("hook_args", "{}")),
                   score_key=str(d.get("score_key", "")), reduce=str(d.get("reduce", "")))


def parse_monitors(raw: Any, facts: ModelFacts, request_id: str | None = None,
                   saes: Describe | None = None) -> tuple[MonitorSpec, ...]:
    """Validate ``monitors`` against the served model. ``saes``: describes an SAE a monitor
    names and gives its feature's slice (``describe.sae_slice``, as for steering by feature);
    without it, monitors by SAE feature are refused.

    Raises:
        LensRequestError: naming the field (``monitors[i].<field>``).
        UnsupportedConfigError: monitors on an engine that cannot run them (pipeline
            parallelism, speculative decoding).
    """
    raw = json_value(raw, MONITORS_KEY, request_id)
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise LensRequestError(MONITORS_KEY, "expected a non-empty list of monitors ({\"name\", "
                               "\"probe\", \"layer\", \"threshold\", \"action\", ...})",
                               request_id=request_id)
    if len(raw) > MAX_MONITORS:
        raise LensRequestError(MONITORS_KEY, f"{len(raw)} monitors; at most {MAX_MONITORS} "
                               "per request", request_id=request_id)
    if facts.pp_size > 1:
        raise UnsupportedConfigError(MONITORS_KEY, "monitors do not run under pipeline "
                                     "parallelism yet (the stage that samples would need the "
                                     "scores of the others); use tensor parallelism",
                                     request_id=request_id)
    if facts.speculative:
        raise UnsupportedConfigError(MONITORS_KEY, "monitors are refused while speculative "
                                     "decoding is on (draft tokens the sampler may reject "
                                     "would be scored)", request_id=request_id)
    by_feature = sum(isinstance(m, Mapping) and "sae" in m for m in raw)
    if by_feature > MAX_SAE_ENTRIES:
        raise LensRequestError(MONITORS_KEY, f"{by_feature} monitors by SAE feature; at most "
                               f"{MAX_SAE_ENTRIES} per request", request_id=request_id)
    specs = [_parse_one(item, i, facts, request_id, saes) for i, item in enumerate(raw)]
    names = [s.name for s in specs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise LensRequestError(f"{MONITORS_KEY}[{i}].name", f"{name!r} names two monitors; "
                                   "each needs its own name", request_id=request_id)
    return tuple(specs)


def _parse_one(item: Any, i: int, facts: ModelFacts, request_id: str | None,
               saes: Describe | None) -> MonitorSpec:
    where = f"{MONITORS_KEY}[{i}]"
    if not isinstance(item, Mapping):
        raise LensRequestError(where, f"expected an object, got {type(item).__name__}",
                               request_id=request_id)
    by_hook = "hook" in item
    by_feature = not by_hook and ("sae" in item or "feature" in item)
    kind, allowed = (("a named hook's score", _HOOK_FIELDS) if by_hook
                     else ("SAE feature", _SAE_FIELDS) if by_feature else ("probe", _FIELDS))
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise LensRequestError(f"{where}.{unknown[0]}", f"unknown field; a monitor by {kind} "
                               f"has {', '.join(sorted(allowed))}", request_id=request_id)
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LensRequestError(f"{where}.name", f"{name!r} is not a monitor name (1 to 64 "
                               "letters, digits, '.', '_' or '-', starting with a letter or "
                               "digit)", request_id=request_id)
    action = item.get("action")
    if action not in ACTIONS:
        raise LensRequestError(f"{where}.action", f"{action!r}; use 'stop' (end the "
                               "generation when it fires) or 'flag' (report, go on)",
                               request_id=request_id)
    threshold = _number(item.get("threshold"), f"{where}.threshold", request_id)
    positions = item.get("positions", "all")
    if positions not in POSITIONS:
        raise LensRequestError(f"{where}.positions", f"{positions!r}; use 'all' (the prompt "
                               "and the generated tokens) or 'generated'",
                               request_id=request_id)
    common = dict(name=name, action=action, threshold=threshold,
                  generated_only=positions == "generated")
    if by_feature:
        return _sae_monitor(item, where, facts, request_id, saes, common)
    layer = _layer(item.get("layer"), facts, f"{where}.layer", request_id)
    if by_hook:
        return _hook_monitor(item, where, layer, facts, request_id, common)
    bias = _number(item.get("bias", 0.0), f"{where}.bias", request_id)
    point = item.get("point", "resid_post")
    if point not in MONITOR_POINTS:
        raise LensRequestError(f"{where}.point", f"{point!r}; a monitor reads one of "
                               f"{', '.join(MONITOR_POINTS)}", request_id=request_id)
    check_site(point, facts, f"{where}.point", request_id)
    probe = _probe(item.get("probe"), facts.hidden_size, f"{where}.probe", request_id)
    return MonitorSpec(layer=layer, point=point, probe=probe, bias=bias, **common)


def _layer(raw: Any, facts: ModelFacts, field: str, request_id: str | None) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not (
            -facts.n_layers <= raw < facts.n_layers):
        raise LensRequestError(field, f"{raw!r} is not a layer of the model "
                               f"(0..{facts.n_layers - 1}, or negative from the end)",
                               request_id=request_id)
    return raw % facts.n_layers


def _hook_monitor(item: Mapping[str, Any], where: str, layer: int, facts: ModelFacts,
                  request_id: str | None, common: dict[str, Any]) -> MonitorSpec:
    """A monitor by the score of a named hook that declares ``monitor_score``, run at
    ``layer`` and ``point`` for this request alone."""
    from vllm_lens import named_hooks

    name = item.get("hook")
    if not isinstance(name, str):
        raise LensRequestError(f"{where}.hook", f"a named hook's name, got {name!r}",
                               request_id=request_id)
    try:
        declared = getattr(named_hooks.load(name), "monitor_score", None)
    except KeyError as exc:
        raise LensRequestError(f"{where}.hook", exc.args[0], request_id=request_id) from None
    if declared is None:
        raise LensRequestError(f"{where}.hook", f"the named hook {name!r} does not publish a "
                               "score a monitor can read (its factory declares no "
                               "monitor_score)", request_id=request_id)
    score_key, columns = declared
    point = parse_write_point(item.get("point", "resid_post"), facts, f"{where}.point",
                              request_id, hook=True)
    args = check_named_hook(name, item.get("args", {}), point, facts, where, request_id,
                            name_field="hook", point_field="point")
    reduce = item.get("reduce")
    if columns is not None and reduce not in REDUCTIONS:
        raise LensRequestError(f"{where}.reduce", f"{reduce!r}; {name!r} scores a position "
                               f"with one number per {columns.rstrip('s')}: say how to make "
                               f"one of them ({', '.join(REDUCTIONS)})", request_id=request_id)
    if columns is None and reduce is not None:
        raise LensRequestError(f"{where}.reduce", f"{name!r} scores a position with one "
                               "number; there is nothing to reduce", request_id=request_id)
    return MonitorSpec(layer=layer, point=point, probe=b"", hook=name, hook_args=args,
                       score_key=str(score_key), reduce=reduce or "", **common)


def _sae_monitor(item: Mapping[str, Any], where: str, facts: ModelFacts,
                 request_id: str | None, saes: Describe | None,
                 common: dict[str, Any]) -> MonitorSpec:
    """A monitor by one feature of a standard or JumpReLU SAE, read at the SAE's point and
    layer from the feature's encoder column (``describe.sae_slice``)."""
    name, hook_point = named_sae(item, where, request_id)
    feature = item.get("feature")
    if isinstance(feature, bool) or not isinstance(feature, int):
        raise LensRequestError(f"{where}.feature", f"one feature index, got {feature!r}",
                               request_id=request_id)
    slice_of = getattr(saes, "sae_slice", None)
    info, point, layer, d_sae = described(saes if slice_of is not None else None, name,
                                          hook_point, facts, f"{where}.sae",
                                          "monitor an SAE feature", request_id)
    if not 0 <= feature < d_sae:
        raise LensRequestError(f"{where}.feature", f"{feature} is not a feature of this SAE "
                               f"(0 to {d_sae - 1})", request_id=request_id)
    architecture = str(info.get("architecture"))
    if architecture not in SAE_ARCHITECTURES:
        raise LensRequestError(f"{where}.sae", f"a {architecture} SAE; monitors read a feature "
                               f"of a {' or '.join(SAE_ARCHITECTURES)} SAE (one read from its "
                               "own encoder column; not built for this architecture yet)",
                               request_id=request_id)
    if point not in MONITOR_POINTS:
        raise LensRequestError(f"{where}.sae", f"the SAE reads {point}; a monitor reads one of "
                               f"{', '.join(MONITOR_POINTS)}", request_id=request_id)
    check_site(point, facts, f"{where}.sae", request_id)
    try:
        with wire.trusted():
            found = slice_of(name, hook_point, (feature,))
    except (ValueError, OSError) as exc:  # WireError included
        raise LensRequestError(f"{where}.sae", str(exc), request_id=request_id) from None
    encoder = {k: found[k] for k in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold",
                                     "apply_b_dec_to_input")}
    encoder["architecture"] = architecture
    return MonitorSpec(layer=layer, point=point, probe=b"", encoder=wire.dumps(encoder),
                       sae=name, feature=feature, **common)


def _number(raw: Any, field: str, request_id: str | None) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise LensRequestError(field, f"expected a finite number, got {raw!r}",
                               request_id=request_id)
    return float(raw)


def _probe(raw: Any, hidden: int, field: str, request_id: str | None) -> bytes:
    import torch

    try:
        if isinstance(raw, Mapping):
            tensor = wire.tensor_from_json(raw)
        elif isinstance(raw, torch.Tensor):
            tensor = raw.detach().cpu()
        elif hasattr(raw, "tolist") and not isinstance(raw, (str, bytes)):
            tensor = torch.tensor(raw.tolist(), dtype=torch.float32)  # numpy
        elif isinstance(raw, list) and all(isinstance(v, (int, float)) and
                                           not isinstance(v, bool) for v in raw):
            tensor = torch.tensor(raw, dtype=torch.float32)
        else:
            raise ValueError(f"expected {hidden} numbers (a list, tensor or JSON tensor "
                             f"record), got {type(raw).__name__}")
    except (TypeError, ValueError, RuntimeError, WireError) as exc:
        raise LensRequestError(field, str(exc), request_id=request_id) from None
    if tuple(tensor.shape) != (hidden,):
        raise LensRequestError(field, f"has shape {tuple(tensor.shape)}; the model's hidden "
                               f"size is {hidden}: one weight per unit, shape ({hidden},)",
                               request_id=request_id)
    tensor = tensor.to(torch.float32)
    if not bool(torch.isfinite(tensor).all()):
        raise LensRequestError(field, "contains NaN or inf", request_id=request_id)
    return wire.dumps(tensor.contiguous())


def monitor_sae_references(raw: Any) -> list[tuple[str, str | None, tuple[int, ...], bool]]:
    """The ``(sae, hook_point, (feature,), False)`` of the monitors by SAE feature in a
    ``monitors`` value, without checking anything else: what an asynchronous front end fetches
    the features' slices for before it parses (``frontend.sae_names``). Malformed values
    give nothing (the parse names the problem)."""
    if isinstance(raw, str):
        if '"sae"' not in raw:
            return []
        try:
            raw = json.loads(raw)
        except ValueError:
            return []
    items = [raw] if isinstance(raw, Mapping) else raw
    if not isinstance(items, (list, tuple)):
        return []
    return steering_sae_references([item for item in items[:MAX_MONITORS]
                                    if isinstance(item, Mapping) and "sae" in item
                                    and "clamp" not in item])


def check_sampling(monitors: tuple[MonitorSpec, ...], params: Any,
                   request_id: str | None = None) -> None:
    """Refuse sampling settings a request's monitors cannot work with (``params``: its
    ``SamplingParams``): one sample, and for a ``stop`` monitor an end-of-sequence token the
    sampler may produce at once.

    Raises:
        LensRequestError: naming the field.
    """
    if not monitors:
        return
    if params.n != 1:
        raise LensRequestError(MONITORS_KEY, f"monitors watch one sample; n={params.n} is not "
                               "supported with them (send n requests)", request_id=request_id)
    stop = next((m for m in monitors if m.stops), None)
    if stop is None:
        return
    field = f"{MONITORS_KEY}[{monitors.index(stop)}].action"
    if params.ignore_eos:
        raise LensRequestError(field, "'stop' ends the generation with the end-of-sequence "
                               "token, which this request ignores (ignore_eos=True); use "
                               "'flag', or drop ignore_eos", request_id=request_id)
    if params.min_tokens:
        raise LensRequestError(field, f"'stop' may end the generation before min_tokens="
                               f"{params.min_tokens} tokens (vLLM masks the end-of-sequence "
                               "token until then); drop min_tokens or use 'flag'",
                               request_id=request_id)
    for name in ("allowed_token_ids", "bad_words", "structured_outputs", "logits_processors"):
        if getattr(params, name, None):
            raise LensRequestError(field, f"'stop' samples the end-of-sequence token, which "
                                   f"{name} may mask; drop {name} or use 'flag'",
                                   request_id=request_id)
