"""Lens request keys -> validated, typed specs (runs in: front end; decoded again in workers).

Users put lens keys in ``SamplingParams.extra_args`` (offline) or ``vllm_xargs`` (HTTP). The
front end validates them here, before the request reaches the engine, so a bad request fails
alone with an error naming the key. The validated spec then travels *inside* the request as one
reserved ``extra_args`` entry, ``"vllm_lens"``: a versioned map of plain msgpack types that
vLLM's own serializer carries to every worker.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import numbers
import math
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_lens import envs, faults, wire
from vllm_lens.errors import (
    LensRequestError,
    RemoteCodeRefusedError,
    SinkRefusedError,
    UnsupportedConfigError,
    UnsupportedModelError,
)
from vllm_lens import points as tap_points
from vllm_lens.positions import NAMED as POSITION_SELECTORS
from vllm_lens.positions import parse_selector
from vllm_lens.sinks import check_sink
from vllm_lens.sinks.config import SinkSpec
from vllm_lens.sinks.config import configured as configured_sinks
from vllm_lens.sinks.config import serves_http as sinks_serve_http

__all__ = [
    "ACTIVATIONS_KEY",
    "CAPTURE_KEY",
    "QK_KEY",
    "LENS_KEYS",
    "SINK_KEY",
    "STREAM_KEY",
    "STEER_KEY",
    "SteerSpec",
    "TRANSPORT_KEY",
    "TRANSPORTS",
    "PAYLOAD_KEY",
    "PRESET_PREFIX",
    "POSITION_SELECTORS",
    "REDUCTIONS",
    "CaptureSpec",
    "HOOKS_KEY",
    "HookSpec",
    "LensRequest",
    "ModelFacts",
    "check_engine",
    "has_lens_keys",
    "parse_extra_args",
    "parse_steering",
    "reuse_parsed",
]

CAPTURE_KEY = "output_residual_stream"
#: Capture at any tap point: ``{point: layers | true | {"layers", "positions", "reduce"}}``.
ACTIVATIONS_KEY = "output_activations"
#: Post-RoPE Q and K of chosen layers (vllm-lens 1.3.0's key): ``true`` or a list of layers.
QK_KEY = "output_qk"
STEER_KEY = "apply_steering_vectors"
#: An ``apply_steering_vectors`` item selecting a named preset the operator registered.
PRESET_PREFIX = "preset:"
#: How the OpenAI server returns activations (``"json"`` inline, ``"binary"`` by handle).
#: Offline engines return tensors and only validate it.
TRANSPORT_KEY = "activations_transport"
TRANSPORTS = ("json", "binary")
#: Every key vllm-lens reads from ``extra_args``; near-misses of these are reported as typos.
HOOKS_KEY = "apply_hooks"
#: Write the captured rows to an operator's sink (``vllm_lens.sinks``) instead of returning
#: them: ``{"sink", "dataset", "key"}``.
SINK_KEY = "capture_sink"
#: Return the rows computed so far with every streamed output (``AsyncLLM``, SSE).
STREAM_KEY = "stream_activations"
LENS_KEYS = (CAPTURE_KEY, ACTIVATIONS_KEY, QK_KEY, STEER_KEY, HOOKS_KEY, TRANSPORT_KEY,
             SINK_KEY, STREAM_KEY)
#: The reserved ``extra_args`` entry that carries the validated spec to the workers.
PAYLOAD_KEY = "vllm_lens"
PAYLOAD_VERSION = 1
REDUCTIONS = (None, "mean", "last")
#: Largest JSON form of one named hook's arguments (a probe's weights for hidden 65536 fit);
#: they travel to every worker with the request.
MAX_HOOK_ARGS_BYTES = 4 << 20
_CAPTURE_FIELDS = ("layers", "positions", "reduce")


@dataclass(frozen=True)
class ModelFacts:
    """What the front end must know about the served model to validate lens requests."""

    model_class: str
    n_layers: int
    hidden_size: int
    max_model_len: int
    mapped: bool
    """False when the workers could not find the model's decoder layers, or found them in a
    model class without a layout (``worker.layouts``)."""
    dtype: str = "float32"
    """The model's dtype name (``torch.<dtype>``): the dtype of captured activations."""
    pre_hooks: bool = True
    """False when the decoder layers' inputs cannot be tapped (their ``forward`` takes no
    ``hidden_states``): ``pre=True`` hooks are refused."""
    unsupported: str | None = None
    """Why this engine's configuration refuses every lens request (it names the setting),
    or ``None`` (see ``worker.runner.unsupported_reason``)."""
    speculative: bool = False
    """Speculative decoding is on: hooks are refused (they would see draft tokens that the
    sampler may reject)."""
    sites: tuple[str, ...] = ("pre", "post")
    """Tap sites the workers installed (``points.SITES``): points at other sites are refused."""
    d_mlp: int = 0
    """Width of ``mlp_post`` (the MLP's intermediate size), 0 if unknown."""
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    tp_size: int = 1
    qk_meta: tuple[Mapping[str, Any], ...] = ()
    """Per layer: what ``vllm_lens.attention`` needs to rebuild the attention pattern
    (``scale``, ``logits_soft_cap``, ``sliding_window``, ``alibi_slopes``, ``sinks``)."""
    split: bool = False
    """The layers add to the stream themselves (GPT-2, GPT-NeoX, OLMo 2): ``attn_out`` and
    ``mlp_out`` are read at sites of their own (``points``)."""
    block: str = "sequential"
    """``sequential`` or ``parallel`` (attention and MLP both read ``resid_pre``)."""
    n_experts: int = 0
    """Width of ``router_logits`` (MoE models), 0 without a router."""
    moe_top_k: int = 0
    """Experts each token is routed to, where they follow from the logits (``softmax_topk``
    routing); 0 otherwise (then no ``router_experts``)."""
    unmapped: str | None = None
    """Why the model class is not mapped (when ``mapped`` is False)."""
    inner_taps: bool = True
    """False when the engine was started with ``VLLM_LENS_INNER_TAPS=0``."""
    pp_size: int = 1
    """Pipeline-parallel stages."""
    dp_size: int = 1
    """Data-parallel engines."""

    def row_shape(self, signal: str) -> tuple[int, ...]:
        """The shape of one captured row (one position, one layer) of ``signal``."""
        if signal == "attn_k":
            return (self.n_kv_heads, self.head_dim)
        if signal in ("attn_q", "attn_z"):
            return (self.n_heads, self.head_dim)
        if signal == "router_logits":
            return (self.n_experts,)
        return (self.d_mlp if signal == "mlp_post" else self.hidden_size,)

    def row_width(self, signal: str) -> int:
        """Elements per captured row of ``signal``."""
        return math.prod(self.row_shape(signal))


@dataclass(frozen=True)
class CaptureSpec:
    """Which residual-stream rows a request wants.

    ``positions`` is a selector (``"prompt"``, ``"prompt[1:]"``, ``"generated[-5:]"`` ...;
    see ``vllm_lens.positions``) or a sorted tuple of absolute token positions; ``reduce``
    collapses the selected positions per layer (``"mean"`` or ``"last"``).
    """

    layers: tuple[int, ...]
    positions: str | tuple[int, ...] = "all"
    reduce: str | None = None
    signal: str = tap_points.RESIDUAL_SIGNAL
    """What is captured: ``residual_stream`` (``output_residual_stream``), a tap point
    (``output_activations``), or ``attn_q`` / ``attn_k`` (``output_qk``)."""

    def to_payload(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "signal": self.signal, "reduce": self.reduce,
                "positions": self.positions if isinstance(self.positions, str)
                else list(self.positions)}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> CaptureSpec:
        positions = d["positions"]
        return cls(layers=tuple(int(x) for x in d["layers"]),
                   positions=positions if isinstance(positions, str) else tuple(positions),
                   reduce=d["reduce"], signal=str(d.get("signal", tap_points.RESIDUAL_SIGNAL)))

    def wants_prompt_rows(self) -> bool:
        """True if any prompt position may be selected (so prefix-cache hits must be recomputed)."""
        if isinstance(self.positions, tuple):
            return True
        selector = parse_selector(self.positions)
        return selector is None or selector.may_read_prompt


@dataclass(frozen=True)
class GateSpec:
    """A steering vector's condition: its scale is multiplied per token by
    ``sigmoid(sharpness * (h · probe - threshold))``, ``h`` read at (``layer``, ``point``)."""

    layer: int
    point: str
    threshold: float
    sharpness: float
    probe: bytes
    """``wire.dumps`` of the ``(hidden,)`` probe."""

    def to_payload(self) -> dict[str, Any]:
        return {"layer": self.layer, "point": self.point, "threshold": self.threshold,
                "sharpness": self.sharpness, "probe": self.probe}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> GateSpec:
        return cls(layer=int(d["layer"]), point=str(d["point"]), threshold=float(d["threshold"]),
                   sharpness=float(d["sharpness"]), probe=bytes(d["probe"]))


@dataclass(frozen=True)
class SteerSpec:
    """One validated steering vector, in the form that travels to the workers."""

    layers: tuple[int, ...]
    vectors: bytes
    """``wire.dumps`` of the activations: ``[n_layers, hidden]`` or ``[n_layers, n_pos, hidden]``
    in the caller's dtype (the worker casts to the model dtype)."""
    scale: float
    norm_match: bool
    positions: tuple[int, ...] | None
    """Absolute positions of 3D rows; ``None`` for 2D vectors, which apply at every position."""
    point: str = "resid_post"
    """The tap point the vectors are added at (``points.STEERABLE``)."""
    mode: str = "add"
    """``add`` or ``replace`` (the stream at those rows becomes the vector)."""
    phase: str = "all"
    """``all``, ``prefill`` (prompt positions) or ``decode`` (generated positions)."""
    condition: GateSpec | None = None
    """Per-token gate of the addition, computed in the same forward pass."""

    def to_payload(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers), "vectors": self.vectors, "scale": self.scale,
            "norm_match": self.norm_match, "point": self.point,
            "positions": None if self.positions is None else list(self.positions),
            "mode": self.mode, "phase": self.phase,
            "condition": None if self.condition is None else self.condition.to_payload(),
        }

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> SteerSpec:
        positions = d["positions"]
        return cls(
            layers=tuple(int(x) for x in d["layers"]), vectors=bytes(d["vectors"]),
            scale=float(d["scale"]), norm_match=bool(d["norm_match"]),
            positions=None if positions is None else tuple(int(p) for p in positions),
            point=str(d.get("point", "resid_post")), mode=str(d.get("mode", "add")),
            phase=str(d.get("phase", "all")),
            condition=None if d.get("condition") is None else GateSpec.from_payload(
                d["condition"]),
        )

    def digest_into(self, digest: Any) -> None:
        """Feed everything that decides what this vector does into ``digest``."""
        digest.update(repr((self.layers, self.scale, self.norm_match, self.positions,
                            self.point, self.mode, self.phase)).encode())
        digest.update(self.vectors)
        if self.condition is not None:
            digest.update(repr(dataclasses.astuple(self.condition)).encode())


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


@dataclass(frozen=True)
class LensRequest:
    """The validated lens part of one request, as carried in ``extra_args[PAYLOAD_KEY]``."""

    key: str
    """Unique per request: names its buffers on the workers."""
    capture: CaptureSpec | None = None
    steer: tuple[SteerSpec, ...] = ()
    hooks: tuple[HookSpec, ...] = ()
    fault: str | None = None
    """Test-only: the stage at which the worker fails this request (``vllm_lens.faults``)."""
    points: tuple[CaptureSpec, ...] = ()
    """Captures at tap points (``output_activations``) and Q/K (``output_qk``), one per
    signal."""
    sink: SinkSpec | None = None
    """Where the workers write the captured rows instead of returning them."""
    stream: bool = False
    """Rows travel with every streamed output, not only the last."""

    @property
    def captures(self) -> tuple[CaptureSpec, ...]:
        """Every capture of the request: the residual stream's (if any) and the points'."""
        return self.points if self.capture is None else (self.capture, *self.points)

    @property
    def qk_layers(self) -> tuple[int, ...]:
        return next((c.layers for c in self.points if c.signal == "attn_q"), ())

    @property
    def needs_fetch(self) -> bool:
        """Whether the front end asks the workers about this request when it finishes:
        always, since even a steering-only request must learn whether its steering ran."""
        return True

    @functools.cached_property
    def cache_salt(self) -> str | None:
        """Prefix-cache salt of every block: requests share KV blocks only with identically
        steered ones.

        Steering that may touch a prompt position changes the KV of that position and every
        later one, so such a request is salted from its first block. Steering of generated
        positions only (``phase="decode"``) leaves the prompt's KV as an unsteered request's:
        its prompt blocks stay shared (``decode_salt`` keeps its generated ones apart).
        """
        if self.hooks:
            # A hook may change the stream in ways no digest can name: never share blocks.
            return f"vllm-lens:hooks:{self.key}"
        if any(s.condition is not None and s.phase != "decode" for s in self.steer):
            # Gate values are reported for every steered position: compute them all.
            return f"vllm-lens:gated:{self.key}"
        return _steering_digest([s for s in self.steer if s.phase != "decode"])

    @functools.cached_property
    def decode_salt(self) -> str | None:
        """Salt of the blocks that reach past the prompt (``frontend.prefix_cache``), for
        steering that treats prompt and generated positions apart (``phase`` ``prefill`` or
        ``decode``): the KV of its generated tokens is not what a later request would compute
        for the same tokens in its prompt (the next turn of a chat), so those blocks are
        reused only by requests steered identically, phases included."""
        return _steering_digest([s for s in self.steer if s.phase != "all"])

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"v": PAYLOAD_VERSION, "key": self.key}
        if self.steer:
            payload["steer"] = [s.to_payload() for s in self.steer]
        if self.cache_salt is not None:
            payload["salt"] = self.cache_salt
        if self.decode_salt is not None:
            payload["decode_salt"] = self.decode_salt
        if self.hooks:
            payload["hooks"] = [h.to_payload() for h in self.hooks]
        if self.fault is not None:
            payload["fault"] = self.fault
        if self.capture is not None:
            payload["capture"] = self.capture.to_payload()
        if self.points:
            payload["points"] = [c.to_payload() for c in self.points]
        if self.sink is not None:
            payload["sink"] = self.sink.to_payload()
        if self.stream:
            payload["stream"] = True
        return payload

    @classmethod
    def from_payload(cls, payload: Any) -> LensRequest:
        """Decode a payload written by :meth:`to_payload` (raises ``ValueError`` otherwise)."""
        if not isinstance(payload, Mapping) or payload.get("v") != PAYLOAD_VERSION:
            raise ValueError(f"not a vllm-lens v{PAYLOAD_VERSION} payload")
        capture = None
        if (c := payload.get("capture")) is not None:
            capture = CaptureSpec.from_payload(c)
        points = tuple(CaptureSpec.from_payload(c) for c in payload.get("points", ()))
        steer = tuple(SteerSpec.from_payload(d) for d in payload.get("steer", ()))
        hooks = tuple(HookSpec.from_payload(d) for d in payload.get("hooks", ()))
        fault = payload.get("fault")
        sink = payload.get("sink")
        return cls(key=str(payload["key"]), capture=capture, steer=steer, hooks=hooks,
                   fault=None if fault is None else str(fault), points=points,
                   sink=None if sink is None else SinkSpec.from_payload(sink),
                   stream=bool(payload.get("stream", False)))


def has_lens_keys(extra_args: Mapping[str, Any] | None) -> bool:
    """Cheap check: does this request ask for anything vllm-lens does?"""
    return bool(extra_args) and any(extra_args.get(k) is not None for k in LENS_KEYS)


def parse_extra_args(
    extra_args: Mapping[str, Any] | None,
    facts: Callable[[], ModelFacts],
    *,
    request_id: str | None = None,
    presets: Mapping[str, tuple[SteerSpec, ...]] | None = None,
) -> tuple[dict[str, Any], LensRequest | None]:
    """Split ``extra_args`` into (the caller's other keys, the validated lens request).

    ``facts`` is called only when a lens key is present, so plain requests never ask the
    workers anything. Returns the non-lens keys untouched and ``None`` when no lens key is set.
    ``presets``: the engine's named steering presets, which ``"preset:<name>"`` selects.

    Raises:
        LensRequestError: a lens key is malformed, misspelt, or unusable on this model.
    """
    rest = dict(extra_args or {})
    if PAYLOAD_KEY in rest:
        raise LensRequestError(
            PAYLOAD_KEY, "this extra_args key is reserved for vllm-lens itself", request_id=request_id
        )
    for name in rest:
        if name not in LENS_KEYS and (close := difflib.get_close_matches(name, LENS_KEYS, 1, 0.8)):
            raise LensRequestError(
                name, f"unknown key; did you mean '{close[0]}'?", request_id=request_id
            )
    transport = rest.get(TRANSPORT_KEY)
    if transport is not None and transport not in TRANSPORTS:
        raise LensRequestError(TRANSPORT_KEY, f"unknown transport {transport!r}; use 'json' or "
                               "'binary'", request_id=request_id)
    raw_capture = rest.pop(CAPTURE_KEY, None)
    raw_points = rest.pop(ACTIVATIONS_KEY, None)
    raw_qk = rest.pop(QK_KEY, None)
    if raw_points is False:
        raw_points = None
    raw_steer = rest.pop(STEER_KEY, None)
    raw_hooks = rest.pop(HOOKS_KEY, None)
    raw_sink = rest.pop(SINK_KEY, None)
    raw_stream = rest.pop(STREAM_KEY, None)
    fault = _parse_fault(rest.pop(faults.FAULT_KEY, None), request_id)
    if raw_capture is False:
        raw_capture = None
    if raw_qk is False:
        raw_qk = None
    asked = [(k, v) for k, v in ((CAPTURE_KEY, raw_capture), (ACTIVATIONS_KEY, raw_points),
                                 (QK_KEY, raw_qk), (STEER_KEY, raw_steer), (HOOKS_KEY, raw_hooks))
             if v is not None]
    if not asked:
        for key, value in ((SINK_KEY, raw_sink), (STREAM_KEY, raw_stream)):
            if value is not None and value not in (False, "false", "0"):
                raise LensRequestError(key, "asks for captured rows, but the request captures "
                                       f"nothing (add {CAPTURE_KEY}, {ACTIVATIONS_KEY} or "
                                       f"{QK_KEY})", request_id=request_id)
        return rest, None
    facts = facts()
    check_engine(facts, asked[0][0], hooks=raw_hooks is not None, request_id=request_id)
    capture = None if raw_capture is None else _parse_capture(raw_capture, facts, request_id)
    points = () if raw_points is None else _parse_points(raw_points, facts, request_id)
    if raw_qk is not None:
        points = (*points, *_parse_qk(raw_qk, facts, request_id))
    steer = () if raw_steer is None else _parse_steering(raw_steer, facts, request_id,
                                                          presets or {})
    hooks = () if raw_hooks is None else parse_hooks(raw_hooks, facts, request_id)
    captures = points if capture is None else (capture, *points)
    sink = None if raw_sink is None else _parse_sink(raw_sink, captures, facts, request_id)
    stream = _parse_stream(raw_stream, captures, sink, facts, request_id)
    return rest, LensRequest(key=uuid.uuid4().hex, capture=capture, steer=steer, hooks=hooks,
                             fault=fault, points=points, sink=sink, stream=stream)


def reuse_parsed(
    extra_args: Mapping[str, Any] | None, parsed_from: Mapping[str, Any], lens: LensRequest
) -> tuple[dict[str, Any], LensRequest] | None:
    """``parse_extra_args(extra_args)`` without parsing again, when its lens values are those
    ``lens`` was parsed from (``parsed_from``): the same spec under a fresh key. ``None`` if
    they differ."""
    own = (CAPTURE_KEY, ACTIVATIONS_KEY, QK_KEY, STEER_KEY, HOOKS_KEY, SINK_KEY, STREAM_KEY,
           faults.FAULT_KEY)
    extra_args = extra_args or {}
    if any(extra_args.get(k) != parsed_from.get(k) for k in own) or PAYLOAD_KEY in extra_args:
        return None
    rest = {k: v for k, v in extra_args.items() if k not in own}
    return rest, dataclasses.replace(lens, key=uuid.uuid4().hex)


def check_engine(facts: ModelFacts, field: str, *, hooks: bool,
                 request_id: str | None = None) -> None:
    """Refuse lens work this engine cannot do (``field`` names the key that asked for it).

    Raises:
        UnsupportedConfigError: the engine's configuration is not supported, or hooks were
            asked for under speculative decoding.
        UnsupportedModelError: the model class is not supported.
    """
    if facts.unsupported is not None:
        raise UnsupportedConfigError(
            field, f"lens requests are refused on this engine: {facts.unsupported} "
            "(plain requests still work)", request_id=request_id)
    if hooks and facts.speculative:
        raise UnsupportedConfigError(
            HOOKS_KEY, "hooks are refused while speculative decoding is on (they would run on "
            "draft tokens the sampler may reject); capture and steering work; start the "
            "engine without speculative_config to use hooks", request_id=request_id)
    if not facts.mapped:
        raise UnsupportedModelError(
            field,
            f"vllm-lens does not support model class {facts.model_class} "
            f"({facts.unmapped or 'its decoder layers are not mapped'}; see 'Model families' "
            "in the README); lens features are refused for it (plain requests still work)",
            request_id=request_id,
        )
    if facts.pp_size > 1 and facts.model_class not in PIPELINE_PROVEN:
        raise UnsupportedConfigError(
            field, f"pipeline parallelism (pipeline_parallel_size={facts.pp_size}) is proven "
            f"only on {', '.join(sorted(PIPELINE_PROVEN))}, not on {facts.model_class}; use "
            "tensor parallelism (tested on every family) or one stage", request_id=request_id)


#: Model classes whose lens features the suite runs under pipeline parallelism.
PIPELINE_PROVEN = frozenset({"LlamaForCausalLM"})


def _parse_sink(raw: Any, captures: tuple[CaptureSpec, ...], facts: ModelFacts,
                request_id: str | None) -> SinkSpec:
    """``capture_sink``: a configured sink, a valid dataset name and key; the captures it
    writes must form one example (the same layers, positions and reduction for every point),
    and one worker must hold all of their rows."""
    if not captures:
        raise LensRequestError(SINK_KEY, f"asks for captured rows, but the request captures "
                               f"nothing (add {CAPTURE_KEY}, {ACTIVATIONS_KEY} or {QK_KEY})",
                               request_id=request_id)
    try:
        sinks = configured_sinks()
    except ValueError as exc:
        raise LensRequestError(SINK_KEY, f"the operator's sink configuration is invalid: {exc}",
                               request_id=request_id) from None
    try:
        sink = SinkSpec.parse(raw, sinks)
    except ValueError as exc:
        sub, problem = exc.args
        raise LensRequestError(f"{SINK_KEY}.{sub}" if sub else SINK_KEY, problem,
                               request_id=request_id) from None
    config = sinks[sink.sink]
    if sinks_serve_http() and not config.clients:
        raise SinkRefusedError(
            f"{SINK_KEY}.sink", f"sink {sink.sink!r} is not open to HTTP clients (its operator "
            'sets "clients": true in its VLLM_LENS_SINKS entry to allow that)',
            request_id=request_id)
    try:
        check_sink(config)
    except (KeyError, ValueError, TypeError) as exc:
        raise LensRequestError(f"{SINK_KEY}.sink", f"sink {sink.sink!r} is misconfigured by "
                               f"the operator: {exc}", request_id=request_id) from None
    first = captures[0]
    for other in captures[1:]:
        for name in ("layers", "positions", "reduce"):
            if getattr(other, name) != getattr(first, name):
                raise LensRequestError(
                    SINK_KEY, f"writes one example per request, so every captured point needs "
                    f"the same {name}: {first.signal} has {getattr(first, name)!r}, "
                    f"{other.signal} {getattr(other, name)!r}", request_id=request_id)
    if facts.pp_size > 1:
        raise UnsupportedConfigError(
            SINK_KEY, f"is refused under pipeline parallelism (pipeline_parallel_size="
            f"{facts.pp_size}): each stage holds its own layers' rows and no stage writes the "
            "others'; return the rows instead, or use one stage", request_id=request_id)
    if facts.dp_size > 1:
        raise UnsupportedConfigError(
            SINK_KEY, f"is refused under data parallelism (data_parallel_size={facts.dp_size}"
            "): each engine's worker would open the same dataset, and only one may write it; "
            "return the rows instead, or use one engine", request_id=request_id)
    sharded = [c.signal for c in captures if c.signal in tap_points.SHARDED]
    if sharded and facts.tp_size > 1:
        raise UnsupportedConfigError(
            SINK_KEY, f"is refused for {', '.join(sharded)} under tensor parallelism "
            f"(tensor_parallel_size={facts.tp_size}): their rows are split across the ranks "
            "and no rank writes the others'; return them instead", request_id=request_id)
    return sink


def _parse_stream(raw: Any, captures: tuple[CaptureSpec, ...], sink: SinkSpec | None,
                  facts: ModelFacts, request_id: str | None) -> bool:
    """``stream_activations``: ``true`` streams each capture's rows as they are computed,
    which needs their final positions to be known then (no reduction, no window counted
    from the end of the generation)."""
    # vllm_xargs carries JSON true as 1 (its values are str | int | float), or "true".
    if raw is None or (not isinstance(raw, float) and raw in (False, "false", "0")):
        return False
    if isinstance(raw, float) or raw not in (True, "true", "1"):
        raise LensRequestError(STREAM_KEY, f"must be true or false, got {raw!r}",
                               request_id=request_id)
    if not captures:
        raise LensRequestError(STREAM_KEY, f"asks for captured rows, but the request captures "
                               f"nothing (add {CAPTURE_KEY}, {ACTIVATIONS_KEY} or {QK_KEY})",
                               request_id=request_id)
    if sink is not None:
        raise LensRequestError(STREAM_KEY, f"cannot be combined with {SINK_KEY} (the rows go "
                               "to the sink, not to the caller)", request_id=request_id)
    if facts.tp_size > 1 or facts.pp_size > 1:
        raise UnsupportedConfigError(
            STREAM_KEY, f"is not yet proven under tensor or pipeline parallelism "
            f"(tensor_parallel_size={facts.tp_size}, pipeline_parallel_size={facts.pp_size}); "
            "the rows come with the final output without it", request_id=request_id)
    for c in captures:
        if c.reduce is not None:
            raise LensRequestError(STREAM_KEY, f"streams rows as they are computed, but "
                                   f"{c.signal} is reduced ({c.reduce!r}) over positions only "
                                   "known at the end; drop reduce", request_id=request_id)
        if isinstance(c.positions, str):
            selector = parse_selector(c.positions)
            if selector is not None and selector.needs_end:
                raise LensRequestError(
                    STREAM_KEY, f"streams rows as they are computed, but {c.signal}'s "
                    f"positions {c.positions!r} are counted from the end of the generation, "
                    "known only when it stops", request_id=request_id)
    return True


def _parse_fault(raw: Any, request_id: str | None) -> str | None:
    if raw is None:
        return None
    if not envs.test_faults():
        raise LensRequestError(faults.FAULT_KEY, "fault injection is for the test suite only "
                               "(VLLM_LENS_TEST_FAULTS=1)", request_id=request_id)
    if raw not in faults.STAGES:
        raise LensRequestError(faults.FAULT_KEY, f"unknown stage {raw!r}; use one of "
                               f"{', '.join(faults.STAGES)}", request_id=request_id)
    return raw


def _parse_capture(raw: Any, facts: ModelFacts, request_id: str | None,
                   field: str = CAPTURE_KEY) -> CaptureSpec:
    if isinstance(raw, str):  # HTTP's vllm_xargs carries structured values as JSON strings
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise LensRequestError(field, f"not valid JSON ({exc.msg})", request_id=request_id) from None
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
            layers=_parse_layers(raw["layers"], facts, f"{field}.layers", request_id),
            positions=_parse_positions(raw.get("positions", "all"), facts, f"{field}.positions",
                                       request_id),
            reduce=_parse_reduce(raw.get("reduce"), f"{field}.reduce", request_id),
        )
    return CaptureSpec(layers=_parse_layers(raw, facts, field, request_id))


def _parse_points(raw: Any, facts: ModelFacts, request_id: str | None) -> tuple[CaptureSpec, ...]:
    """``output_activations``: ``{point: layers | true | {"layers", "positions", "reduce"}}``;
    a ``blocks.{L}.`` name fixes the layer (then its value is ``true`` or a dict without
    ``layers``). Names that resolve to the same point merge their layers if their positions
    and reduction agree."""
    field = ACTIVATIONS_KEY
    raw = _json_value(raw, field, request_id)
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
        _check_site(point, facts, where, request_id)
        if layer is not None:
            if value is True or value == "true":
                value = {}
            if not isinstance(value, Mapping) or "layers" in value:
                raise LensRequestError(where, "a blocks.<layer>. name fixes the layer: give true "
                                       "or {positions, reduce}", request_id=request_id)
            value = {**value, "layers": [layer]}
        spec = dataclasses.replace(_parse_capture(value, facts, request_id, field=where),
                                   signal=point)
        if (old := merged.get(point)) is not None:
            if (old.positions, old.reduce) != (spec.positions, spec.reduce):
                raise LensRequestError(where, f"names the point {point} again with other "
                                       "positions or reduce; use one entry per point",
                                       request_id=request_id)
            spec = dataclasses.replace(old, layers=tuple(sorted(set(old.layers + spec.layers))))
        merged[point] = spec
    return tuple(merged.values())


def _check_site(point: str, facts: ModelFacts, where: str, request_id: str | None) -> None:
    """Refuse a point whose site this model's taps do not have."""
    site = tap_points.site_of(point, split=facts.split)
    if site not in facts.sites:
        if site == "mid" and facts.block == "parallel":
            raise UnsupportedModelError(
                where, f"{facts.model_class} runs attention and the MLP in parallel on "
                f"resid_pre, so there is no {point} (use resid_pre, attn_out, mlp_out or "
                "resid_post)", request_id=request_id)
        if not facts.inner_taps and site not in ("pre", "post", "attn"):
            why = "the engine was started with VLLM_LENS_INNER_TAPS=0"
        else:
            why = _MISSING_SITE.get(site, "its layers have no tap there")
        raise UnsupportedModelError(
            where, f"the tap point {point} is not available on {facts.model_class} ({why})",
            request_id=request_id)


#: Why a model offers no tap at a site (the engine's inner taps on).
_MISSING_SITE = {
    "router": "its layers have no MoE router",
    "act": "its layers have no single MLP activation to read: MoE experts, or a down "
           "projection taking quantized input",
    "attn": "its attention is not vLLM's plain attention kernel (MLA, shared KV, or a query "
            "quantized first)",
    "pre": "its layers' inputs cannot be tapped",
}


def _parse_qk(raw: Any, facts: ModelFacts, request_id: str | None) -> tuple[CaptureSpec, ...]:
    """``output_qk``: ``true`` or a list of layers -> the ``attn_q`` and ``attn_k`` captures
    (every position: an attention pattern needs all keys)."""
    raw = _json_value(raw, QK_KEY, request_id)
    _check_site("attn_q", facts, QK_KEY, request_id)
    layers = _parse_layers(raw, facts, QK_KEY, request_id)
    blind = [layer for layer in layers
             if layer >= len(facts.qk_meta) or not facts.qk_meta[layer]]
    if blind:
        raise UnsupportedModelError(QK_KEY, f"the attention of layers {blind} cannot be "
                                    "described (scale, window ...), so their Q/K are not "
                                    "captured", request_id=request_id)
    return (CaptureSpec(layers=layers, signal="attn_q"),
            CaptureSpec(layers=layers, signal="attn_k"))


def _parse_layers(raw: Any, facts: ModelFacts, field: str, request_id: str | None) -> tuple[int, ...]:
    if raw is True:
        return tuple(range(facts.n_layers))
    if hasattr(raw, "tolist") and not isinstance(raw, (str, bytes)):
        raw = raw.tolist()  # a numpy array or tensor of indices
    if not isinstance(raw, (list, tuple)):
        hint = ""
        if isinstance(raw, int) and not isinstance(raw, bool) and raw in (0, 1):
            hint = ("; over HTTP, vllm_xargs turns JSON true into 1: send the string \"true\" "
                    "for every layer, or a list such as \"[3, 7]\"")
        raise LensRequestError(
            field, f"expected a list of layer indices or true, got {type(raw).__name__} "
            f"{raw!r}{hint}", request_id=request_id,
        )
    if not raw:
        raise LensRequestError(field, "empty list; name at least one layer", request_id=request_id)
    return _sorted_indices(raw, field, _layer_rule(facts), request_id)


def _layer_rule(facts: ModelFacts) -> tuple[str, int, str]:
    return ("layer index", facts.n_layers,
            f"is out of range; the model has layers 0..{facts.n_layers - 1}")


def _position_rule(facts: ModelFacts) -> tuple[str, int, str]:
    return ("position", facts.max_model_len,
            f"is outside the model's context (0..{facts.max_model_len - 1})")


def _sorted_indices(
    raw: list | tuple, field: str, rule: tuple[str, int, str], request_id: str | None
) -> tuple[int, ...]:
    """Check every item is an int in ``[0, upper)``; ``rule`` is (what, upper, complaint)."""
    what, upper, complaint = rule
    raw = [int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v
           for v in raw]  # numpy integers count
    for i, value in enumerate(raw):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LensRequestError(f"{field}[{i}]", f"expected an integer {what}, got {value!r}",
                                   request_id=request_id)
        if not 0 <= value < upper:
            raise LensRequestError(f"{field}[{i}]", f"{what} {value} {complaint}",
                                   request_id=request_id)
    return tuple(sorted(set(raw)))


def _parse_positions(
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
    return _sorted_indices(raw, field, _position_rule(facts), request_id)


def _parse_reduce(raw: Any, field: str, request_id: str | None) -> str | None:
    if raw not in REDUCTIONS:
        raise LensRequestError(field, f"unknown reduction {raw!r}; use null, 'mean' or 'last'",
                               request_id=request_id)
    return raw


def _steering_digest(specs: Sequence[SteerSpec]) -> str | None:
    if not specs:
        return None
    digest = hashlib.sha256()
    for spec in specs:
        spec.digest_into(digest)
    return "vllm-lens:" + digest.hexdigest()[:32]


def _parse_steering(raw: Any, facts: ModelFacts, request_id: str | None,
                    presets: Mapping[str, tuple[SteerSpec, ...]] | None = None,
                    field: str = STEER_KEY) -> tuple[SteerSpec, ...]:
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
    with limit:
        for i, item in enumerate(raw):
            if isinstance(item, str) and item.startswith(PRESET_PREFIX):
                specs.extend(_preset(item, presets, f"{field}[{i}]", request_id))
            else:
                specs.append(_parse_one_vector(item, facts, f"{field}[{i}]", request_id))
    _check_replacements_apart(specs, facts, field, request_id)
    return tuple(specs)


def parse_steering(raw: Any, facts: ModelFacts, field: str) -> tuple[SteerSpec, ...]:
    """Validate steering vectors against the model outside a request (a preset being
    registered): the forms ``apply_steering_vectors`` takes, errors naming ``field``."""
    return _parse_steering(raw, facts, None, None, field)


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
        loc = ".".join(str(x) for x in err["loc"])
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
        _sorted_indices(positions, f"{where}.position_indices", _position_rule(facts), request_id)
    if sv.layer_indices == [-1]:  # the token embeddings: the stream entering layer 0
        layers = (0,)
        point = _parse_write_point("resid_pre", facts, f"{where}.hook_point", request_id)
    else:
        _sorted_indices(sv.layer_indices, f"{where}.layer_indices", _layer_rule(facts),
                        request_id)
        layers = tuple(sv.layer_indices)
        point = _parse_write_point(sv.hook_point, facts, f"{where}.hook_point", request_id)
    condition = None
    if sv.condition is not None:
        condition = _parse_condition(sv.condition, layers, point, facts, f"{where}.condition",
                                     request_id)
    return SteerSpec(
        layers=layers, vectors=wire.dumps(sv.activations), scale=sv.scale,
        norm_match=sv.norm_match, positions=None if positions is None else tuple(positions),
        point=point, mode=sv.mode, phase=sv.phase, condition=condition,
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
    (layer,) = _sorted_indices([cond.layer], f"{where}.layer", _layer_rule(facts), request_id)
    read = _parse_write_point(cond.point, facts, f"{where}.point", request_id)

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


def _parse_write_point(raw: Any, facts: ModelFacts, where: str, request_id: str | None,
                       *, hook: bool = False) -> str:
    """A point steering or a hook writes to: one of ``points.STEERABLE`` (or an alias); for
    a hook also ``points.QK_HOOK_POINT`` (read-only)."""
    if hook and raw == tap_points.QK_HOOK_POINT:
        _check_site("attn_q", facts, where, request_id)
        if facts.tp_size > 1:
            raise UnsupportedConfigError(
                where, f"hooks at {raw} would see each tensor-parallel rank's heads apart "
                f"(tensor_parallel_size={facts.tp_size}); use output_qk, or "
                "tensor_parallel_size=1", request_id=request_id)
        return raw
    try:
        point, layer = tap_points.resolve(raw)
    except KeyError as exc:
        raise LensRequestError(where, exc.args[0], request_id=request_id) from None
    if layer is not None or point not in tap_points.STEERABLE:
        raise LensRequestError(where, f"{raw!r} cannot be written to; use one of "
                               f"{', '.join(tap_points.STEERABLE)} (layers go in "
                               "layer_indices)", request_id=request_id)
    _check_site(point, facts, where, request_id)
    return point


def parse_hooks(raw: Any, facts: ModelFacts, request_id: str | None = None) -> tuple[HookSpec, ...]:
    """Validate ``apply_hooks`` (also the hooks of ``register_hooks``).

    Items: live ``Hook`` / ``NamedHook`` objects, or their JSON forms (``hook_to_json``): a
    named hook's fields, or ``{"pickle": base64}`` — refused with ``RemoteCodeRefusedError``
    unless the operator set ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1``.
    """
    from vllm_lens.hooks import Hook, NamedHook

    field = HOOKS_KEY
    raw = _json_value(raw, field, request_id)
    if isinstance(raw, (Hook, NamedHook, Mapping)):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise LensRequestError(field, "expected a non-empty list of Hook or NamedHook objects "
                               "(or their JSON forms)", request_id=request_id)
    return tuple(_parse_hook(item, facts, f"{field}[{i}]", request_id)
                 for i, item in enumerate(raw))


def _json_value(raw: Any, field: str, request_id: str | None) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LensRequestError(field, f"not valid JSON ({exc.msg})", request_id=request_id) from None


def _parse_hook(item: Any, facts: ModelFacts, where: str, request_id: str | None) -> HookSpec:
    import base64

    import cloudpickle

    from vllm_lens import named_hooks
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
    layers = _sorted_indices(item.layer_indices, f"{where}.layer_indices", _layer_rule(facts),
                             request_id)
    if not isinstance(item.pre, bool):
        raise LensRequestError(f"{where}.pre", "expected true or false", request_id=request_id)
    if item.pre and not facts.pre_hooks:
        raise LensRequestError(f"{where}.pre", f"the decoder layers of {facts.model_class} "
                               "have no tappable input; use pre=False (a hook on the previous "
                               "layer's output sees the same stream)", request_id=request_id)
    point = "resid_pre" if item.pre else "resid_post"
    if item.hook_point is not None:
        point = _parse_write_point(item.hook_point, facts, f"{where}.hook_point", request_id,
                                   hook=True)
        if item.pre and point != "resid_pre":
            raise LensRequestError(f"{where}.pre", f"pre=True means hook_point='resid_pre', "
                                   f"not {point!r}; give one of them", request_id=request_id)
    if isinstance(item, Hook):
        if not callable(item.fn):
            raise LensRequestError(f"{where}.fn", "is not callable", request_id=request_id)
        return HookSpec(layers=layers, pre=item.pre, pickled=cloudpickle.dumps(item.fn),
                        point=point)
    if not isinstance(item.args, Mapping):
        raise LensRequestError(f"{where}.args", "expected a JSON object", request_id=request_id)
    try:
        args_json = json.dumps(dict(item.args))
    except (TypeError, ValueError) as exc:
        raise LensRequestError(f"{where}.args", f"not JSON-serialisable ({exc})",
                               request_id=request_id) from None
    if len(args_json) > MAX_HOOK_ARGS_BYTES:
        raise LensRequestError(f"{where}.args", f"is {len(args_json):,} bytes of JSON; named "
                               f"hook arguments are limited to {MAX_HOOK_ARGS_BYTES:,}",
                               request_id=request_id)
    try:
        named_hooks.load(str(item.name))(item.args)
    except KeyError as exc:
        raise LensRequestError(f"{where}.name", exc.args[0], request_id=request_id) from None
    except (ValueError, TypeError) as exc:
        raise LensRequestError(f"{where}.args", str(exc), request_id=request_id) from None
    return HookSpec(layers=layers, pre=item.pre, name=str(item.name), args=args_json,
                    point=point)
