"""The request session: one per engine, the input side of lens requests (runs in: front end).

One ``LensSession`` lives on each engine object (``LLMEngine`` or ``AsyncLLM``). It validates
lens requests before they enter the engine (``prepare``: parse, admission, the payload the
workers decode), remembers which requests carry one until they finish, and builds the
arguments of their fetch. What the workers send back is attached by ``frontend.collator``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Container, Mapping, Sequence
from typing import Any, TypeVar

from vllm import SamplingParams

from vllm_lens import envs
from vllm_lens.common import handoff
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.admission import capture_reservation, check_admission
from vllm_lens.sinks.config import SinkSpec
from vllm_lens.spec.monitors import check_sampling
from vllm_lens.spec import (
    LOGIT_KEY,
    PAYLOAD_KEY,
    SAE_KEY,
    SINK_KEY,
    STEER_KEY,
    STREAM_KEY,
    LensRequest,
    ModelFacts,
    SteerSpec,
    has_lens_keys,
    parse_extra_args,
    reuse_parsed,
)

__all__ = ["LensSession", "prompt_length"]

_SESSION_ATTR = "_vllm_lens_session"
_State = TypeVar("_State")


def prompt_length(prompt: Any) -> int | None:
    """Tokens in an engine input (a vLLM ``TokensInput`` dict or ``EngineCoreRequest``), or
    ``None`` when it is not tokenized yet."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else getattr(
        prompt, "prompt_token_ids", None)
    return len(ids) if ids is not None else None


class LensSession:
    """Per-engine front-end state: model facts, the lens requests in flight, and each feature's
    own state (``feature``)."""

    def __init__(self) -> None:
        self.facts: ModelFacts | None = None
        self.in_flight: dict[str, LensRequest] = {}
        """External request id -> its lens request, until it finishes or is aborted (changed
        only by ``prepare`` and ``forget``, which keep ``_sinks`` in step)."""
        self._sinks: collections.Counter[SinkSpec] = collections.Counter()
        """The examples the requests in flight write: a call of thousands of requests checks
        each against them in constant time, not against every request in flight."""
        self.model_names: tuple[str, ...] = ()
        """The served model's path or name and served names (set by ``frontend.engine_methods``
        when an engine method first runs; read by ``frontend.presets``)."""
        self._features: dict[type, Any] = {}

    def feature(self, kind: type[_State]) -> _State:
        """The state one feature keeps for this engine, made on first use.

        Each feature owns its state's class in its own module (``frontend.presets.Presets``,
        ``frontend.sae_names.SaeNames``, ``frontend.persistent_hooks.PersistentHooks``,
        ``frontend.offline.OfflineCall``): the session only holds it, so the request side
        above never changes for a feature's sake.
        """
        state = self._features.get(kind)
        if state is None:
            state = self._features[kind] = kind()
        return state

    @staticmethod
    def of(engine: object) -> LensSession:
        session = engine.__dict__.get(_SESSION_ATTR)
        if session is None:
            session = LensSession()
            setattr(engine, _SESSION_ATTR, session)
        return session

    def needs_facts(self, params: object) -> bool:
        return (
            self.facts is None
            and isinstance(params, SamplingParams)
            and has_lens_keys(params.extra_args)
        )

    def prepare(self, params: Any, request_id: str, prompt: Any = None,
                parsed: tuple[Mapping[str, Any], LensRequest] | None = None,
                saes: Any = None,
                presets: Mapping[str, tuple[SteerSpec, ...]] | None = None,
                ) -> tuple[Any, LensRequest | None]:
        """Validate ``params``' lens keys; return (params for the engine, lens request or None).

        A capture is admitted only if what it can hold fits ``VLLM_LENS_MAX_CAPTURE_BYTES``
        (``prompt``, the engine's input, gives the prompt length where it is tokenized).
        ``parsed``: (``vllm_xargs``, the ``LensRequest`` parsed from them) when the server
        validated this request already; it is reused if the values are the same. ``saes``:
        ``(sae, hook_point) -> description`` for the SAEs it names (``frontend.sae_names``);
        ``presets``: the steering presets it may select (``frontend.presets``).

        The caller's object is never mutated: a request with lens keys gets a clone whose
        ``extra_args`` carry the validated payload instead of the user's keys.

        vLLM accepts duplicate request ids, but outputs name only that id: while a lens
        request runs, no other request may reuse its id, or its results could be attached to
        the wrong output.
        """
        if request_id in self.in_flight:
            raise LensRequestError("request_id", f"{request_id!r} is already used by a running "
                                   "vllm-lens request; request ids must be unique while it runs")
        if not isinstance(params, SamplingParams) or not params.extra_args:
            return params, None
        reused = None if parsed is None else reuse_parsed(params.extra_args, *parsed)
        if reused is not None:
            rest, lens = reused
        else:
            rest, lens = parse_extra_args(params.extra_args, self._facts, request_id=request_id,
                                          presets=presets or {}, saes=saes)
        if lens is None:
            return params, None
        self.check_beside(lens, params.n, request_id)
        check_sampling(lens.monitors, params, request_id)
        facts = self._facts()
        check_admission(lens, facts, prompt_length(prompt), params.max_tokens, params.n,
                        request_id)
        if lens.captures or lens.saes or lens.logit_attribution is not None:
            lens = dataclasses.replace(lens, reserve_bytes=capture_reservation(
                lens, facts, prompt_length(prompt), params.max_tokens))
        if lens.steer_attention:
            context = facts.max_model_len
            lens = dataclasses.replace(
                lens, attention_positions=context,
                attention_max_tokens=context if params.max_tokens is None
                else min(params.max_tokens, context))
        engine_params = params.clone()
        engine_params.extra_args = {**rest, PAYLOAD_KEY: lens.to_payload()}
        if lens.hooks or lens.monitors or lens.steer_attention or any(
                c.wants_prompt_rows() for c in (*lens.captures, *lens.sae_captures)):
            # Prompt tokens served from the prefix cache never run through the layers (and
            # attention steering recomputes its rows from the keys it saw).
            engine_params.skip_reading_prefix_cache = True
        self.in_flight[request_id] = lens
        if lens.sink is not None:
            self._sinks[lens.sink] += 1
        return engine_params, lens

    def check_beside(self, lens: LensRequest, n: int, request_id: str | None = None,
                     added: Container[SinkSpec] = ()) -> None:
        """Refuse what ``lens`` cannot do with ``n`` samples, or beside the running requests
        and those of the same call added before it (``added``: their sinks, best a set):
        every sample streams, is gated or writes one example of its own, and no two requests
        write one key.

        Raises:
            LensRequestError: naming the field.
        """
        if lens.stream and n != 1:
            raise LensRequestError(STREAM_KEY, f"streams the rows of one sample; n={n} is not "
                                   "supported with it (send n requests)", request_id=request_id)
        if lens.sink is not None and (lens.sink in added or lens.sink in self._sinks):
            raise LensRequestError(
                f"{SINK_KEY}.key", f"{lens.sink.key!r} of dataset {lens.sink.dataset!r} is "
                "already being written by a running request or an earlier request of this "
                "call (several prompts with one capture_sink? give each its own key)",
                request_id=request_id)
        if n != 1 and any(s.condition is not None and s.phase != "decode" for s in lens.steer):
            raise LensRequestError(STEER_KEY, f"conditional steering reports a gate for every "
                                   f"steered prompt position, which n={n} samples compute once "
                                   "between them; send n requests, or use phase='decode'",
                                   request_id=request_id)
        if n != 1 and lens.logit_attribution is not None and lens.logit_attribution.token is None:
            raise LensRequestError(LOGIT_KEY, f"attributes each position to the token that "
                                   f"follows it, which n={n} samples do not share; name one "
                                   "with attribution_token, or send n requests",
                                   request_id=request_id)
        unnamed = [i for i, s in enumerate(lens.saes)
                   if s.attribution and s.attribution_token is None]
        if n != 1 and unnamed:
            raise LensRequestError(
                f"{SAE_KEY}[{unnamed[0]}].attribution" if len(lens.saes) > 1
                else f"{SAE_KEY}.attribution",
                f"attributes each position to the token that follows it, which n={n} samples "
                "do not share; name one with attribution_token, or send n requests",
                request_id=request_id)
        if lens.sink is not None and n != 1:
            raise LensRequestError(SINK_KEY, f"writes one example per request; n={n} samples "
                                   "would need one key each (send n requests)",
                                   request_id=request_id)

    def _facts(self) -> ModelFacts:
        assert self.facts is not None, "call the engine's lens_describe before prepare()"
        return self.facts

    @staticmethod
    def fetch_rpc_args(requests: list[tuple[str, dict[str, int]]]) -> tuple[Any, ...]:
        """``collective_rpc`` args of ``lens_fetch`` for these ``fetch_args`` results."""
        return (requests, handoff.host_id() if envs.shm_handoff() else None)

    def fetch_args(
        self, lens: LensRequest, n_prompt: int, generated: Mapping[int, int], n: int,
        tokens: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> tuple[Any, ...]:
        """Fetch arguments for one finished request (see ``LensWorkerExtension.lens_fetch``).

        ``generated`` maps completion index -> tokens generated; a request sampled once runs
        under one engine id, ``n > 1`` children under ids prefixed ``"{index}_"``. ``tokens``
        (prompt and generated token ids) travel along for a request writing to a sink or
        attributing features to the tokens that follow their positions.
        """
        if n == 1:
            valid = {"": n_prompt + generated.get(0, 0) - 1}
            if lens.sink is not None or lens.wants_tokens:
                prompt_ids, generated_ids = tokens or ((), ())
                return lens.key, valid, {"prompt_token_ids": [int(t) for t in prompt_ids],
                                         "token_ids": [int(t) for t in generated_ids]}
            return lens.key, valid
        return lens.key, {f"{i}_": n_prompt + generated.get(i, 0) - 1 for i in range(n)}

    def forget(self, request_ids: Sequence[str]) -> list[str]:
        """Stop tracking finished or aborted requests; returns their lens keys (whose worker
        buffers an aborted request should release)."""
        keys = []
        for rid in request_ids:
            lens = self.in_flight.pop(rid, None)
            if lens is None:
                continue
            keys.append(lens.key)
            if lens.sink is not None:
                self._sinks[lens.sink] -= 1
                if not self._sinks[lens.sink]:
                    del self._sinks[lens.sink]
        return keys
