"""The completions and chat endpoints with lens keys: ``vllm_xargs`` validated before the
request is scheduled, and each choice of the answer given its lens results (runs in: front
end).

A request without lens keys goes to vLLM's endpoint untouched. A request with them is parsed
once here (the engine wrapper reuses the parsed ``LensRequest``), served inside a
``ResponseScope`` that collects its engine requests' results, and answered whole or as a
stream (``streaming``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from fastapi import Request
from vllm.entrypoints.serve.engine.protocol import ErrorResponse

from vllm_lens import envs
from vllm_lens.errors import (
    CapacityError,
    LensExecutionError,
    LensRequestError,
)
from vllm_lens.frontend.async_engine import model_facts
from vllm_lens.frontend.session import LensSession
from vllm_lens.frontend.http import preset_log
from vllm_lens.frontend.http.blob_store import store
from vllm_lens.frontend.http.errors import error_response
from vllm_lens.frontend.http.results import (
    Transport,
    transport,
    encode_results,
    with_partials,
)
from vllm_lens.frontend.http.streaming import Endpoint, Started, with_activation_chunks
from vllm_lens.frontend.presets import Presets
from vllm_lens.frontend.response_scope import ResponseScope
from vllm_lens.frontend.sae_names import async_describer
from vllm_lens.hooks import HookError
from vllm_lens.spec import (
    LENS_KEYS,
    SINK_KEY,
    STEER_KEY,
    TRANSPORT_KEY,
    LensRequest,
    has_lens_keys,
    parse_extra_args,
)

__all__ = ["wrap_endpoint"]


def wrap_endpoint(endpoint: Endpoint):
    """A wrapper of vLLM's ``create_completion`` / ``create_chat_completion``."""
    def make(original):
        async def serve(self: Any, request: Any, raw_request: Request | None = None) -> Any:
            xargs = request.vllm_xargs
            if not xargs:
                return await original(self, request, raw_request)
            try:
                validated = await _validate(self.engine_client, xargs)
            except LensRequestError as exc:
                return error_response(exc)
            if validated is None:
                return await original(self, request, raw_request)
            encode, lens = validated
            if lens.sink is not None and _several_prompts(request):
                return error_response(LensRequestError(
                    f"{SINK_KEY}.key", "names one example, but this request has several "
                    "prompts; send one request per prompt, each with its own key"))
            scope = ResponseScope(parsed_from=xargs, parsed=lens)
            with scope.active():
                try:
                    result = await original(self, request, raw_request)
                    if isinstance(result, AsyncGenerator):
                        # Start the stream here: a request the engine wrapper refuses
                        # (admission) then gets its 400 instead of an error event.
                        result = await Started(result).start()
                # Refused by the engine wrapper (admission); a client's hook raised; the
                # worker failed this request alone (a sink's conflict, a full worker budget):
                # answered, never crashing the route.
                except (LensRequestError, HookError, LensExecutionError) as exc:
                    return error_response(exc)
            if scope.refused is not None:
                if isinstance(result, Started):
                    await result.aclose()
                return error_response(scope.refused)
            if isinstance(result, ErrorResponse):
                return result
            n = request.n or 1
            if hasattr(result, "choices"):
                found = with_partials(scope, result.id, n)
                try:
                    for choice in result.choices:
                        if (results := found.get(choice.index)) is not None:
                            for name, value in (await asyncio.to_thread(
                                    encode_results, results, encode)).items():
                                setattr(choice, name, value)
                # Refused (a full store: not someone else's evicted; too many values for
                # the lists transport): nothing of the response is sent.
                except (CapacityError, LensRequestError) as exc:
                    for choice in result.choices:  # the choices stored already are freed
                        acts = getattr(choice, "activations", None)
                        if isinstance(acts, dict) and acts.get("transport") == "binary":
                            store().delete(acts["handle"])
                    return error_response(exc)
                return result
            return with_activation_chunks(result, scope, n, endpoint, encode, lens.stream)

        return serve

    return make


def _several_prompts(request: Any) -> bool:
    """A completions request with a batch of prompts (texts or token lists)."""
    prompt = getattr(request, "prompt", None)
    return (isinstance(prompt, list) and len(prompt) > 1
            and not all(isinstance(t, int) for t in prompt))


#: Lens values larger than this, and every steering value, are parsed on a worker thread.
_PARSE_INLINE_BYTES = 64 << 10
#: Requests whose lens values are parsed on threads at once (bounds the decoded bytes in
#: flight to this many times VLLM_LENS_MAX_DECODED_BYTES).
_PARSE_CONCURRENCY = 4
_slots: asyncio.Semaphore | None = None


def _parse_slots() -> asyncio.Semaphore:
    global _slots
    if _slots is None:
        _slots = asyncio.Semaphore(_PARSE_CONCURRENCY)
    return _slots


async def _validate(
    engine: Any, xargs: Mapping[str, Any]
) -> tuple[Transport, LensRequest] | None:
    """Check ``vllm_xargs`` as the engine would (raises LensRequestError, also for misspelt lens
    keys); returns the transport and the parsed request (which the engine wrapper
    reuses), or ``None`` when no lens key is set."""
    limit = envs.max_request_bytes()
    total = 0
    for key in LENS_KEYS:
        value = xargs.get(key)
        size = len(value) if isinstance(value, str) else len(json.dumps(value))
        if size > limit:
            raise LensRequestError(
                key, f"is {size} bytes, above this server's limit of {limit} bytes "
                "(VLLM_LENS_MAX_REQUEST_BYTES)")
        total += size
    facts = await model_facts(engine) if has_lens_keys(xargs) else None
    steer = xargs.get(STEER_KEY)
    if steer is not None and "preset:" in (steer if isinstance(steer, str) else json.dumps(steer)):
        await preset_log.sync(engine)  # what other API processes registered
    presets = dict(Presets.of(LensSession.of(engine)).specs)
    saes = await async_describer(engine, xargs, paths=False)  # a client names, never opens
    if total > _PARSE_INLINE_BYTES or xargs.get(STEER_KEY) is not None:
        # Tensors are decompressed on a worker thread (never the event loop), a few requests
        # at a time (each up to VLLM_LENS_MAX_DECODED_BYTES).
        async with _parse_slots():
            _, lens = await asyncio.to_thread(parse_extra_args, xargs, lambda: facts,
                                              presets=presets, saes=saes)
    else:
        _, lens = parse_extra_args(xargs, lambda: facts, presets=presets, saes=saes)
    if lens is None:
        return None
    return transport(xargs.get(TRANSPORT_KEY)), lens
