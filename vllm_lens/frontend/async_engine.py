"""Lens support for ``AsyncLLM.generate`` (runs in: front end).

The OpenAI server uses it too.

The wrapper validates lens keys before the request enters the engine and, when the final
output arrives, awaits the workers' buffers and attaches ``activations`` to it. A request with
``stream_activations`` gets, on every output, the rows (and SAE features) computed since the
previous one (``lens_fetch_partial``, one RPC per step for all of them, which the engine does
not wait for: ``partial_fetch``, ``engine_core.pipelined_rpc``; the final output carries the rest), so
that the outputs' rows laid end to end are the whole capture.
A request that ends any other way (client gone, cancelled, failed) has its buffers released.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_lens.common.messages import FetchAnswer, read_all
from vllm_lens.common.wrapping import wrap_attribute
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend import response_scope
from vllm_lens.frontend import collator
from vllm_lens.frontend.collator import discard_unread
from vllm_lens.frontend.partial_fetch import PartialFetcher
from vllm_lens.frontend.rpc import all_workers, pipelined
from vllm_lens.frontend.session import LensSession
from vllm_lens.frontend.presets import Presets
from vllm_lens.frontend.sae_names import async_describer
from vllm_lens.sinks.config import serves_http
from vllm_lens.spec import ModelFacts, asks_for_work
from vllm_lens.spec.facts import facts_from_describe

__all__ = ["install", "model_facts"]

_background: set[asyncio.Task] = set()

logger = init_logger(__name__)


def install() -> None:
    wrap_attribute(AsyncLLM, "generate", _wrap_generate)
    wrap_attribute(AsyncLLM, "shutdown", _wrap_shutdown)


async def model_facts(engine: AsyncLLM) -> ModelFacts:
    """The served model's facts, asked of the workers once per engine."""
    session = LensSession.of(engine)
    if session.facts is None:
        session.facts = facts_from_describe(await all_workers(engine, "lens_describe"))
    return session.facts


def _wrap_generate(original):
    async def generate(
        self: AsyncLLM, prompt: Any, sampling_params: Any, request_id: str, *args, **kwargs
    ) -> AsyncGenerator[RequestOutput, None]:
        session = LensSession.of(self)
        is_core_request = isinstance(prompt, EngineCoreRequest)
        target = prompt.sampling_params if is_core_request else sampling_params
        if session.needs_facts(target):
            await model_facts(self)
        scope = response_scope.current()
        if serves_http() and not response_scope.on_lens_route():
            _refuse_off_route(target)
        parsed = None if scope is None or scope.parsed is None else (scope.parsed_from,
                                                                      scope.parsed)
        saes = None
        if parsed is None:  # the server describes its requests' SAEs when it validates them
            saes = await async_describer(self, getattr(target, "extra_args", None),
                                         paths=not serves_http())
        try:
            engine_params, lens = session.prepare(target, request_id, prompt, parsed, saes,
                                                  Presets.of(session).specs)
        except LensRequestError as exc:
            if scope is not None:
                scope.refused = exc  # the server answers 400, also for a stream
            raise
        if is_core_request:
            prompt.sampling_params = engine_params
        else:
            sampling_params = engine_params
        stream = original(self, prompt, sampling_params, request_id, *args, **kwargs)
        if lens is None:
            async for out in stream:
                yield out
            return

        # DELTA outputs carry only new tokens; the trim length needs the running total.
        delta = engine_params.output_kind == RequestOutputKind.DELTA
        generated: dict[int, int] = {}
        generated_ids: list[int] = []  # for a sink or an attribution (n == 1)
        completed = False
        try:
            async for out in stream:
                for c in out.outputs:
                    earlier = generated.get(c.index, 0) if delta else 0
                    generated[c.index] = earlier + len(c.token_ids)
                    if lens.sink is not None or lens.wants_tokens:
                        generated_ids[len(generated_ids) if delta else 0:] = c.token_ids
                if lens.stream and not out.finished:
                    upto = len(out.prompt_token_ids or ()) + generated.get(0, 0) - 1
                    results = await _partial_fetcher(self).fetch(lens.key, {"": upto})
                    try:
                        rows = collator.attach_partial(out, lens, results, session.facts)
                    finally:
                        discard_unread(results)
                    response_scope.report_partial(request_id, rows)
                if out.finished:
                    session.forget([request_id])
                if out.finished and lens.needs_fetch:
                    args_ = session.fetch_args(
                        lens, len(out.prompt_token_ids or ()), generated, engine_params.n,
                        (out.prompt_token_ids or (), generated_ids))
                    results = await _fetch(self, session.fetch_rpc_args([args_]))
                    try:
                        by_index = collator.attach(out, lens, results, engine_params.n,
                                                    session.facts)
                    finally:
                        discard_unread(results)
                    response_scope.report(request_id, by_index)
                    failed = next((f[name] for f in by_index.values()
                                   for name in ("lens_error", "hook_error")
                                   if f.get(name) is not None), None)
                    if failed is not None:
                        completed = True  # its buffers are gone; nothing to release
                        raise failed
                completed = out.finished
                yield out
        except EngineDeadError:
            if shut_down(self):
                # Stopped on purpose while this request ran (a server's Ctrl-C): it ends as
                # vLLM's own waiting requests end then, cancelled, not as an engine failure.
                raise asyncio.CancelledError("the engine was shut down") from None
            raise
        finally:
            if not completed:
                keys = session.forget([request_id])
                if keys and not (self.errored or shut_down(self)):  # else no worker holds them
                    # Not awaited: this may run while the caller is being cancelled.
                    task = asyncio.ensure_future(all_workers(self, "lens_release", (keys,)))
                    _background.add(task)
                    task.add_done_callback(_released)

    return generate


def _wrap_shutdown(original):
    def shutdown(self: AsyncLLM, *args: Any, **kwargs: Any) -> None:
        self.__dict__[_STOPPED] = True  # before the core goes: lens calls then see it
        return original(self, *args, **kwargs)

    return shutdown


#: Set on an ``AsyncLLM`` whose ``shutdown`` was called (a server's Ctrl-C, a caller's own
#: stop). vLLM also shuts the core client down itself when an engine process dies, but not
#: through ``AsyncLLM.shutdown``: a died engine is never taken for a stopped one.
_STOPPED = "_vllm_lens_stopped"


def shut_down(engine: AsyncLLM) -> bool:
    """Whether ``engine`` was shut down on purpose (``AsyncLLM.shutdown`` was called)."""
    return bool(engine.__dict__.get(_STOPPED, False))


def _released(task: asyncio.Task) -> None:
    """A background ``lens_release`` ended: its failure is logged (an engine that stopped
    meanwhile holds nothing to release), never left for asyncio to print at exit."""
    _background.discard(task)
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, EngineDeadError):
        logger.warning("vllm-lens: releasing a request's rows failed: %r", exc)


def _refuse_off_route(params: Any) -> None:
    """Refuse lens keys that reached the engine by a route that does not return lens results
    (the server's own routes refuse them first where they can: ``frontend.http``)."""
    key = asks_for_work(getattr(params, "extra_args", None))
    if key is not None:
        raise LensRequestError(key, OFF_ROUTE)


#: Why lens keys are refused outside the routes that return their results.
OFF_ROUTE = ("lens keys are served on /v1/completions and /v1/chat/completions (and "
             "vllm-lens's own /v1/lens routes); this route would run them and drop what they "
             "return")


def _partial_fetcher(engine: AsyncLLM) -> PartialFetcher:
    """The engine's coalescer of streamed requests' fetches (one pipelined RPC per step)."""
    fetcher = engine.__dict__.get("_vllm_lens_partial_fetcher")
    if fetcher is None:
        session = LensSession.of(engine)

        async def rpc(requests: list[tuple[str, dict[str, int]]]) -> list[FetchAnswer]:
            return read_all(FetchAnswer, await pipelined(engine, "lens_fetch_partial",
                                                         session.fetch_rpc_args(requests)))

        fetcher = engine._vllm_lens_partial_fetcher = PartialFetcher(rpc)
    return fetcher


async def _fetch(engine: AsyncLLM, args: tuple[Any, ...]) -> list[FetchAnswer]:
    """``lens_fetch`` that cleans up after itself when the caller is cancelled meanwhile (a
    client disconnecting): the workers have popped the rows already, so the call is let
    finish and any handoff files it produced are deleted."""
    task = asyncio.ensure_future(_fetch_answers(engine, args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _background.add(task)
        task.add_done_callback(_discard_fetched)
        raise


async def _fetch_answers(engine: AsyncLLM, args: tuple[Any, ...]) -> list[FetchAnswer]:
    return read_all(FetchAnswer, await all_workers(engine, "lens_fetch", args))


def _discard_fetched(task: asyncio.Task) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is None:
        discard_unread(task.result())
