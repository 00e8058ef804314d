"""``LensRequest`` and the parse entry: ``extra_args`` -> (the caller's other keys, one validated
``LensRequest``), plus the engine-wide checks every lens request passes first (runs in: front end,
worker).

Workers decode the payload with ``LensRequest.from_payload``.

The validated request travels *inside* the request as one reserved ``extra_args`` entry,
``"vllm_lens"``: a versioned map of plain msgpack types that vLLM's own serializer carries to
every worker.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lens import envs
from vllm_lens.common import faults
from vllm_lens.errors import LensRequestError, UnsupportedConfigError, UnsupportedModelError
from vllm_lens.sinks.config import SinkSpec
from vllm_lens.spec.capture import CaptureSpec, parse_capture, parse_points, parse_qk
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.fields import check_site
from vllm_lens.spec.hooks import HookSpec, parse_hooks
from vllm_lens.spec.attention_steering import AttentionEdit, parse_attention_steering
from vllm_lens.spec.keys import (
    ACTIVATIONS_KEY,
    ATTENTION_STEER_KEY,
    CAPTURE_KEY,
    HOOKS_KEY,
    LENS_KEYS,
    MONITORS_KEY,
    PAYLOAD_KEY,
    PAYLOAD_VERSION,
    QK_KEY,
    REPLACE_KEY,
    SAE_KEY,
    LOGIT_KEY,
    SINK_KEY,
    STEER_KEY,
    STREAM_KEY,
    TRANSPORT_KEY,
    TRANSPORTS,
)
from vllm_lens.spec.logit_attribution import LogitAttributionSpec, parse_logit_attribution
from vllm_lens.spec.monitors import MonitorSpec, parse_monitors
from vllm_lens.spec.outputs import parse_sink, parse_stream
from vllm_lens.spec.replacement import ReplaceSpec, parse_replacements, replacement_digest
from vllm_lens.spec.saes import Describe, SAEFeatureSpec, parse_sae_features
from vllm_lens.spec.steer_records import SteerSpec, steering_digest
from vllm_lens.spec.steering import parse_steering_key


@dataclass(frozen=True)
class LensRequest:
    """The validated lens part of one request, as carried in ``extra_args[PAYLOAD_KEY]``."""

    key: str
    """Unique per request: names its buffers on the workers."""
    capture: CaptureSpec | None = None
    steer: tuple[SteerSpec, ...] = ()
    hooks: tuple[HookSpec, ...] = ()
    fault: str | None = None
    """Test-only: the stage at which the worker fails this request (``vllm_lens.common.faults``)."""
    points: tuple[CaptureSpec, ...] = ()
    """Captures at tap points (``output_activations``) and Q/K (``output_qk``), one per
    signal."""
    sink: SinkSpec | None = None
    """Where the workers write the captured rows instead of returning them."""
    stream: bool = False
    """Rows travel with every streamed output, not only the last."""
    saes: tuple[SAEFeatureSpec, ...] = ()
    """SAE features (``output_sae_features``), each read at its SAE's point and layer."""
    monitors: tuple[MonitorSpec, ...] = ()
    """Probes that stop the generation or report (``monitors``, ``spec.monitors``)."""
    steer_attention: tuple[AttentionEdit, ...] = ()
    """Edits of chosen heads' attention (``steer_attention``, ``spec.attention_steering``)."""
    replace_mlp: tuple[ReplaceSpec, ...] = ()
    """MLPs replaced by transcoders (``replace_mlp``, ``spec.replacement``)."""
    logit_attribution: LogitAttributionSpec | None = None
    """Direct logit attribution of the components (``output_logit_attribution``)."""
    qk_heads: tuple[int, ...] | None = None
    """The query heads ``output_qk`` returns (``None``: every head). The workers capture
    every head of the layer; the front end keeps these when it collates."""
    attention_positions: int = 0
    """With ``steer_attention``: the model's context, which bounds the positions the request
    computes; set by the front end after admission, never read from the client."""
    attention_max_tokens: int = 0
    """With ``steer_attention``: its ``max_tokens`` (the context if unset); a worker reserves
    its history for ``min(context, prompt + max_tokens)`` positions, the prompt's length as
    the worker sees it (``worker.attention_steering``)."""
    reserve_bytes: int = 0
    """The most captured bytes one sample of the request can hold on a worker at once
    (``admission.capture_reservation``), set by the front end after admission, never read
    from the client: a worker reserves it from ``VLLM_LENS_WORKER_MAX_BYTES`` when the
    request first runs, or fails the request at once if it does not fit."""

    @property
    def wants_tokens(self) -> bool:
        """Its fetch needs the request's token ids: an SAE attribution to the tokens that
        follow the positions."""
        return (any(s.attribution and s.attribution_token is None for s in self.saes)
                or self.logit_attribution is not None and self.logit_attribution.token is None)

    @property
    def captures(self) -> tuple[CaptureSpec, ...]:
        """Every capture of the request: the residual stream's (if any) and the points'."""
        return self.points if self.capture is None else (self.capture, *self.points)

    @functools.cached_property
    def sae_captures(self) -> tuple[CaptureSpec, ...]:
        """The captures the workers run for the SAE features (``SAEFeatureSpec.capture``) and
        for a logit attribution (``LogitAttributionSpec.captures``): rows the request does not
        get as they are."""
        dla = () if self.logit_attribution is None else self.logit_attribution.captures()
        return (*(s.capture() for s in self.saes), *dla)

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
        if self.steer_attention:
            # Its steered rows are recomputed from the keys and values it saw itself: it
            # never reads cached blocks (``skip_reading_prefix_cache``), and nobody reads its.
            return f"vllm-lens:attention:{self.key}"
        if any(s.condition is not None and s.phase != "decode" for s in self.steer):
            # Gate values are reported for every steered position: compute them all.
            return f"vllm-lens:gated:{self.key}"
        salt = steering_digest([s for s in self.steer if s.phase != "decode"])
        replaced = replacement_digest(self.replace_mlp)  # every position, prompt included
        if replaced is not None:
            salt = f"{salt or 'vllm-lens'}|replace:{replaced}"
        return salt

    @functools.cached_property
    def decode_salt(self) -> str | None:
        """Salt of the blocks that reach past the prompt (``frontend.prefix_cache``), for
        steering that treats prompt and generated positions apart (``phase`` ``prefill`` or
        ``decode``): the KV of its generated tokens is not what a later request would compute
        for the same tokens in its prompt (the next turn of a chat), so those blocks are
        reused only by requests steered identically, phases included."""
        return steering_digest([s for s in self.steer if s.phase != "all"])

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
        if self.saes:
            payload["saes"] = [s.to_payload() for s in self.saes]
        if self.monitors:
            payload["monitors"] = [m.to_payload() for m in self.monitors]
        if self.steer_attention:
            payload["steer_attention"] = [e.to_payload() for e in self.steer_attention]
        if self.replace_mlp:
            payload["replace_mlp"] = [r.to_payload() for r in self.replace_mlp]
        if self.logit_attribution is not None:
            payload["logit_attribution"] = self.logit_attribution.to_payload()
        if self.qk_heads is not None:
            payload["qk_heads"] = list(self.qk_heads)
        if self.reserve_bytes:
            payload["reserve"] = self.reserve_bytes
        if self.attention_positions:
            payload["attn_positions"] = self.attention_positions
            payload["attn_max_tokens"] = self.attention_max_tokens
        return payload

    @classmethod
    def from_payload(cls, payload: Any) -> LensRequest:
        """Decode a payload written by `to_payload` (raises ``ValueError`` otherwise)."""
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
                   stream=bool(payload.get("stream", False)),
                   saes=tuple(SAEFeatureSpec.from_payload(d) for d in payload.get("saes", ())),
                   monitors=tuple(MonitorSpec.from_payload(d)
                                  for d in payload.get("monitors", ())),
                   steer_attention=tuple(AttentionEdit.from_payload(d)
                                         for d in payload.get("steer_attention", ())),
                   replace_mlp=tuple(ReplaceSpec.from_payload(d)
                                     for d in payload.get("replace_mlp", ())),
                   logit_attribution=None if payload.get("logit_attribution") is None
                   else LogitAttributionSpec.from_payload(payload["logit_attribution"]),
                   qk_heads=None if payload.get("qk_heads") is None
                   else tuple(int(h) for h in payload["qk_heads"]),
                   reserve_bytes=int(payload.get("reserve", 0)),
                   attention_positions=int(payload.get("attn_positions", 0)),
                   attention_max_tokens=int(payload.get("attn_max_tokens", 0)))


#: The keys that ask for lens work (the others only say how to return it).
_WORK_KEYS = (CAPTURE_KEY, ACTIVATIONS_KEY, QK_KEY, STEER_KEY, HOOKS_KEY, SINK_KEY, STREAM_KEY,
              SAE_KEY, MONITORS_KEY, ATTENTION_STEER_KEY, REPLACE_KEY, LOGIT_KEY)


def _asks_nothing(value: Any) -> bool:
    """``None`` or false: as Python, as a JSON string, or as vllm_xargs' number 0."""
    if value is None or value is False or (type(value) is int and value == 0):
        return True
    return isinstance(value, str) and value.strip().lower() in ("false", "0")


def asks_for_work(extra_args: Mapping[str, Any] | None) -> str | None:
    """The first key of ``extra_args`` that asks for lens work (capture, steering, hooks, a
    sink, streamed rows), or ``None``: ``activations_transport`` alone, or keys set to false,
    ask for nothing.

    >>> asks_for_work({"activations_transport": "binary", "output_residual_stream": False})
    >>> asks_for_work({"temperature": 0, "apply_hooks": "[]"})
    'apply_hooks'
    """
    return next((key for key in extra_args or () if key in _WORK_KEYS
                 and not _asks_nothing(extra_args[key])), None)


def has_lens_keys(extra_args: Mapping[str, Any] | None) -> bool:
    """Cheap check: does this request ask for anything vllm-lens does?"""
    return bool(extra_args) and any(extra_args.get(k) is not None for k in LENS_KEYS)


def parse_extra_args(
    extra_args: Mapping[str, Any] | None,
    facts: Callable[[], ModelFacts],
    *,
    request_id: str | None = None,
    presets: Mapping[str, tuple[SteerSpec, ...]] | None = None,
    saes: Describe | None = None,
) -> tuple[dict[str, Any], LensRequest | None]:
    """Split ``extra_args`` into (the caller's other keys, the validated lens request).

    ``facts`` is called only when a lens key is present, so plain requests never ask the
    workers anything. Returns the non-lens keys untouched and ``None`` when no lens key is set.
    ``presets``: the engine's named steering presets, which ``"preset:<name>"`` selects.
    ``saes``: loads an SAE on the workers and describes it (``spec.saes``), with
    ``sae_slice`` for steering by feature (``spec.sae_steering``); without it,
    ``output_sae_features`` and steering by feature are refused.

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
        raise LensRequestError(TRANSPORT_KEY, f"unknown transport {transport!r}; use 'json', "
                               "'binary' or 'lists'", request_id=request_id)
    raw_capture = rest.pop(CAPTURE_KEY, None)
    raw_points = rest.pop(ACTIVATIONS_KEY, None)
    raw_qk = rest.pop(QK_KEY, None)
    if raw_points is False:
        raw_points = None
    raw_steer = rest.pop(STEER_KEY, None)
    raw_hooks = rest.pop(HOOKS_KEY, None)
    raw_sink = rest.pop(SINK_KEY, None)
    raw_stream = rest.pop(STREAM_KEY, None)
    raw_saes = rest.pop(SAE_KEY, None)
    if raw_saes is False:
        raw_saes = None
    raw_monitors = rest.pop(MONITORS_KEY, None)
    raw_attention = rest.pop(ATTENTION_STEER_KEY, None)
    raw_replace = rest.pop(REPLACE_KEY, None)
    if raw_replace is False:
        raw_replace = None
    raw_logits = rest.pop(LOGIT_KEY, None)
    if raw_logits in (False, "false"):
        raw_logits = None
    fault = parse_fault(rest.pop(faults.FAULT_KEY, None), request_id)
    if raw_capture is False:
        raw_capture = None
    if raw_qk is False:
        raw_qk = None
    asked = [(k, v) for k, v in ((CAPTURE_KEY, raw_capture), (ACTIVATIONS_KEY, raw_points),
                                 (QK_KEY, raw_qk), (STEER_KEY, raw_steer), (HOOKS_KEY, raw_hooks),
                                 (SAE_KEY, raw_saes), (MONITORS_KEY, raw_monitors),
                                 (ATTENTION_STEER_KEY, raw_attention),
                                 (REPLACE_KEY, raw_replace), (LOGIT_KEY, raw_logits))
             if v is not None]
    if not asked:
        for key, value in ((SINK_KEY, raw_sink), (STREAM_KEY, raw_stream)):
            if value is not None and value not in (False, "false", "0"):
                raise LensRequestError(key, "asks for captured rows, but the request captures "
                                       f"nothing (add {CAPTURE_KEY}, {ACTIVATIONS_KEY}, "
                                       f"{SAE_KEY} or {QK_KEY})", request_id=request_id)
        return rest, None
    facts = facts()
    check_engine(facts, asked[0][0], hooks=raw_hooks is not None, request_id=request_id)
    capture = None
    if raw_capture is not None:  # the stream leaving each layer: resid_post's site and check
        check_site("resid_post", facts, CAPTURE_KEY, request_id)
        capture = parse_capture(raw_capture, facts, request_id)
    points = () if raw_points is None else parse_points(raw_points, facts, request_id)
    qk_heads = None
    if raw_qk is not None:
        qk, qk_heads = parse_qk(raw_qk, facts, request_id)
        points = (*points, *qk)
    steer = () if raw_steer is None else parse_steering_key(raw_steer, facts, request_id,
                                                          presets or {}, saes=saes)
    hooks = () if raw_hooks is None else parse_hooks(raw_hooks, facts, request_id)
    captures = points if capture is None else (capture, *points)
    features = () if raw_saes is None else parse_sae_features(raw_saes, facts, saes, request_id)
    sink = None if raw_sink is None else parse_sink(raw_sink, captures, facts, request_id,
                                                    saes=features)
    if qk_heads is not None and sink is not None:
        raise LensRequestError(f"{QK_KEY}.heads", f"chooses the heads a response returns; "
                               f"{SINK_KEY} writes every head of the layer (ask for all heads "
                               "there, or return the rows)", request_id=request_id)
    stream = parse_stream(raw_stream, captures, sink, request_id, saes=features)
    logits = None if raw_logits is None else parse_logit_attribution(raw_logits, facts,
                                                                     request_id)
    if logits is not None and (sink is not None or stream):
        raise LensRequestError(LOGIT_KEY, f"is computed when the request ends, not with "
                               f"{SINK_KEY if sink else STREAM_KEY}; send it in a request of "
                               "its own", request_id=request_id)
    for i, spec in enumerate(features):
        if spec.attribution and (sink is not None or stream):
            # Attributions are computed when the request's tokens are known, at its fetch.
            raise LensRequestError(
                f"{SAE_KEY}[{i}].attribution" if len(features) > 1 else f"{SAE_KEY}.attribution",
                f"is computed when the request ends, not with {SINK_KEY if sink else STREAM_KEY};"
                " send the attribution in a request of its own", request_id=request_id)
    monitors = () if raw_monitors is None else parse_monitors(raw_monitors, facts, request_id,
                                                              saes=saes)
    attention = () if raw_attention is None else parse_attention_steering(
        raw_attention, facts, request_id)
    replace = () if raw_replace is None else parse_replacements(raw_replace, facts, saes,
                                                                request_id)
    return rest, LensRequest(key=uuid.uuid4().hex, capture=capture, steer=steer, hooks=hooks,
                             fault=fault, points=points, sink=sink, stream=stream,
                             saes=features, monitors=monitors, steer_attention=attention,
                             replace_mlp=replace, logit_attribution=logits,
                             qk_heads=qk_heads)


def reuse_parsed(
    extra_args: Mapping[str, Any] | None, parsed_from: Mapping[str, Any], lens: LensRequest
) -> tuple[dict[str, Any], LensRequest] | None:
    """``parse_extra_args(extra_args)`` without parsing again, when its lens values are those
    ``lens`` was parsed from (``parsed_from``): the same spec under a fresh key. ``None`` if
    they differ."""
    own = (CAPTURE_KEY, ACTIVATIONS_KEY, QK_KEY, STEER_KEY, HOOKS_KEY, SINK_KEY, STREAM_KEY,
           SAE_KEY, MONITORS_KEY, ATTENTION_STEER_KEY, REPLACE_KEY, LOGIT_KEY, faults.FAULT_KEY)
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
            f"({facts.unmapped or 'its decoder layers are not mapped'}; see the docs' Model "
            "families page, docs/families.md); lens features are refused for it (plain "
            "requests still work)",
            request_id=request_id,
        )
    if facts.pp_size > 1 and facts.model_class not in PIPELINE_PROVEN:
        raise UnsupportedConfigError(
            field, f"pipeline parallelism (pipeline_parallel_size={facts.pp_size}) is proven "
            f"only on {', '.join(sorted(PIPELINE_PROVEN))}, not on {facts.model_class}; use "
            "tensor parallelism (tested on every family) or one stage", request_id=request_id)


#: Model classes whose lens features the suite runs under pipeline parallelism.
PIPELINE_PROVEN = frozenset({"LlamaForCausalLM"})


def parse_fault(raw: Any, request_id: str | None) -> str | None:
    if raw is None:
        return None
    if not envs.test_faults():
        raise LensRequestError(faults.FAULT_KEY, "fault injection is for the test suite only "
                               "(VLLM_LENS_TEST_FAULTS=1)", request_id=request_id)
    if raw not in faults.STAGES:
        raise LensRequestError(faults.FAULT_KEY, f"unknown stage {raw!r}; use one of "
                               f"{', '.join(faults.STAGES)}", request_id=request_id)
    return raw
