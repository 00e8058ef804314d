"""Lens support in vLLM's OpenAI-compatible server (runs in: front end).

Nothing to configure: when the plugin loads in a process that builds the API server, it

- wraps ``/v1/completions`` and ``/v1/chat/completions``: lens keys in ``vllm_xargs`` are
  validated *before* the request is scheduled (a bad one gets HTTP 400 naming the field, also
  for ``stream: true``), and each choice of the response gets its own ``activations``;
- with ``stream: true``, activations arrive in one extra chunk per choice, sent after the
  choice's last token and before ``data: [DONE]`` (a chunk with empty text / delta, no
  finish reason, and ``activations``);
- with ``stream: true`` and ``stream_activations``, every chunk of a choice also carries the
  rows computed since its previous chunk (``activations``), and the extra chunk the rest:
  laid end to end they are the whole capture;
- with ``"activations_transport": "binary"`` a choice carries a handle instead of the tensors
  (see ``vllm_lens.activations``); the bytes are served by ``GET /v1/lens/activations/{handle}``
  and freed by ``DELETE`` on the same path or when they expire;
- adds ``GET /v1/lens/stats`` (bytes waiting in the binary store and on each worker; the
  workers' figures are at most a second old, one worker call serving every GET meanwhile) and the
  persistent-hook routes ``/v1/hooks/{register, collect, clear, clear_results, prefetch,
  clear_prefetched}`` (``frontend.persistent_hooks``), which answer 403 unless the operator
  set ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (they see every client's traffic);
- refuses lens keys on routes that would drop their results (``/v1/responses``,
  ``/v1/messages``, transcriptions ...) with HTTP 400 naming the key;
- refuses pickled hooks (per request or registered) with 403 unless the operator set
  ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1``; named hooks need no opt-in. A hook that raises fails its
  HTTP request with a 500 whose message carries the hook's error and traceback summary.

All routes live under ``/v1``, so ``--api-key`` guards them like vLLM's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import (
    create_error_response,
)
from vllm.logger import init_logger

from vllm_lens import envs
from vllm_lens.common import wire
from vllm_lens.common.wrapping import wrap_attribute
from vllm_lens.activations import (
    ACTIVATIONS_PATH,
    FETCH_PATH,
    activations_to_json,
    binary_descriptor,
    hook_results_to_json,
    valid_handle,
)
from vllm_lens.errors import (
    CapacityError,
    LensExecutionError,
    LensRequestError,
    RemoteCodeRefusedError,
    SinkConflictError,
    SinkRefusedError,
    WorkerCapacityError,
)
from vllm_lens.frontend import patching_sweep
from vllm_lens.frontend.http import preset_log, routes_steering, shared_dir
from vllm_lens.frontend.async_engine import OFF_ROUTE, model_facts
from vllm_lens.frontend.http.blob_store import BlobStore
from vllm_lens.frontend.collate import LensSession, join_streamed
from vllm_lens.frontend.http.bodies import answered_by, json_object, read_bounded
from vllm_lens.frontend.response_scope import ResponseScope
from vllm_lens.frontend.rpc import all_workers
from vllm_lens.frontend.sae_names import async_describer, check_sae_file, register_sae_file
from vllm_lens.hooks import HookError
from vllm_lens.sinks.config import mark_http_process
from vllm_lens.spec import (
    HOOKS_KEY,
    LENS_KEYS,
    SINK_KEY,
    STEER_KEY,
    TRANSPORT_KEY,
    LensRequest,
    asks_for_work,
    has_lens_keys,
    parse_extra_args,
)

__all__ = ["install", "store"]

_DONE = "data: [DONE]\n\n"

_store: BlobStore | None = None


def store() -> BlobStore:
    """The binary-transport store this server's API processes share (opened on first use)."""
    global _store
    if _store is None:
        _store = BlobStore(shared_dir.server_dir() / "blobs", envs.http_store_max_bytes(),
                           envs.http_store_ttl_s())
    return _store


@dataclass(frozen=True)
class _Endpoint:
    """What differs between the completions and chat endpoints' streamed chunks."""

    empty_choice: Mapping[str, Any]


_COMPLETIONS = _Endpoint(empty_choice={"text": "", "logprobs": None})
_CHAT = _Endpoint(empty_choice={"delta": {}, "logprobs": None})


def install() -> None:
    from vllm.entrypoints.cli import serve as serve_module
    from vllm.entrypoints.launchers import app as app_module
    from vllm.entrypoints.launchers.api_server import entry as entry_module
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    wrap_attribute(OpenAIServingCompletion, "create_completion", _wrap_endpoint(_COMPLETIONS))
    wrap_attribute(OpenAIServingChat, "create_chat_completion", _wrap_endpoint(_CHAT))
    # Routes that take vllm_xargs but would drop what lens keys return: refused up front
    # (400 naming the key). Any other route is refused by the engine wrapper (async_engine).
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    wrap_attribute(OpenAIServingResponses, "create_responses", _refuse_lens_keys)
    wrap_attribute(AnthropicServingMessages, "create_messages", _refuse_lens_keys)
    wrap_attribute(app_module, "register_api_routers", _wrap_register_api_routers)
    wrap_attribute(entry_module, "build_async_engine_client", _wrap_build_engine_client)
    wrap_attribute(entry_module, "init_app_state", _wrap_init_app_state)
    wrap_attribute(serve_module, "run_multi_api_server", _wrap_run_multi_api_server)
    serve_command = sys.modules.get("vllm.entrypoints.cli.serve")
    if serve_command is not None:  # ``vllm serve`` / ``vllm-lens serve``: all its launchers
        wrap_attribute(serve_command.ServeSubcommand, "validate", _wrap_validate)


def _wrap_register_api_routers(original):
    def register_api_routers(args: Any, app: Any, *rest: Any, **kwargs: Any) -> None:
        mark_http_process()  # sinks not open to clients are refused on completions and chat
        original(args, app, *rest, **kwargs)
        app.include_router(_router)
        app.include_router(routes_steering.router)
        app.include_router(patching_sweep.router)

    return register_api_routers


# Before the engine starts, a VLLM_LENS_SAES file that cannot be read, or an entry of the
# wrong shape, stops the server in seconds instead of after the model loaded: when the serve
# command checks its flags, and (one API process: ``python -m
# vllm.entrypoints.openai.api_server``) before the API process builds its engine. What needs
# the workers (each SAE against the model) is checked in init_app_state.
def _wrap_validate(original):
    def validate(self: Any, args: Any) -> None:
        original(self, args)
        check_sae_file()

    return validate


def _wrap_build_engine_client(original):
    def build_async_engine_client(*args: Any, **kwargs: Any) -> Any:
        check_sae_file()
        return original(*args, **kwargs)

    return build_async_engine_client


def _wrap_run_multi_api_server(original):
    def run_multi_api_server(args: Any, *rest: Any, **kwargs: Any) -> Any:
        # The API processes it starts share one directory (``http.shared_dir``).
        shared_dir.create()
        return original(args, *rest, **kwargs)

    return run_multi_api_server


def _wrap_init_app_state(original):
    async def init_app_state(engine_client: Any, state: Any, args: Any, *rest: Any,
                             **kwargs: Any) -> None:
        shared_dir.for_api_process(getattr(args, "api_server_count", None))
        await original(engine_client, state, args, *rest, **kwargs)
        names = await register_sae_file(engine_client)
        if names:
            logger.info("vllm-lens: serving SAEs %s", ", ".join(names))
        # Before serving, and after the SAEs: a preset may steer by their features.
        await routes_steering.register_preset_file(
            engine_client, getattr(args, "api_server_count", None))

    return init_app_state


def _wrap_endpoint(endpoint: _Endpoint):
    def make(original):
        async def serve(self: Any, request: Any, raw_request: Request | None = None) -> Any:
            xargs = request.vllm_xargs
            if not xargs:
                return await original(self, request, raw_request)
            try:
                validated = await _validate(self.engine_client, xargs)
            except LensRequestError as exc:
                return _request_error(exc)
            if validated is None:
                return await original(self, request, raw_request)
            encode, lens = validated
            if lens.sink is not None and _several_prompts(request):
                return _request_error(LensRequestError(
                    f"{SINK_KEY}.key", "names one example, but this request has several "
                    "prompts; send one request per prompt, each with its own key"))
            scope = ResponseScope(parsed_from=xargs, parsed=lens)
            with scope.active():
                try:
                    result = await original(self, request, raw_request)
                    if isinstance(result, AsyncGenerator):
                        # Start the stream here: a request the engine wrapper refuses
                        # (admission) then gets its 400 instead of an error event.
                        result = await _Started(result).start()
                except LensRequestError as exc:  # refused by the engine wrapper (admission)
                    return _request_error(exc)
                except HookError as exc:  # a client's hook raised: answer, don't crash the route
                    return create_error_response(
                        str(exc), err_type="InternalServerError",
                        status_code=HTTPStatus.INTERNAL_SERVER_ERROR, param=HOOKS_KEY)
                except SinkConflictError as exc:  # the key or settings clash with the dataset
                    return create_error_response(str(exc), err_type="ConflictError",
                                                 status_code=HTTPStatus.CONFLICT,
                                                 param=SINK_KEY)
                except WorkerCapacityError as exc:  # a worker's shared budget was full
                    return create_error_response(
                        str(exc), err_type="ServiceUnavailableError",
                        status_code=HTTPStatus.SERVICE_UNAVAILABLE, param=exc.setting)
                except LensExecutionError as exc:  # the worker failed this request alone
                    return create_error_response(
                        str(exc), err_type="InternalServerError",
                        status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
            if scope.refused is not None:
                if isinstance(result, _Started):
                    await result.aclose()
                return _request_error(scope.refused)
            if isinstance(result, ErrorResponse):
                return result
            n = request.n or 1
            if hasattr(result, "choices"):
                found = _with_partials(scope, result.id, n)
                try:
                    for choice in result.choices:
                        if (results := found.get(choice.index)) is not None:
                            for name, value in (await asyncio.to_thread(
                                    _encode_results, results, encode)).items():
                                setattr(choice, name, value)
                except CapacityError as exc:  # refused, not someone else's evicted
                    for choice in result.choices:  # the choices stored already are freed
                        acts = getattr(choice, "activations", None)
                        if isinstance(acts, dict) and acts.get("transport") == "binary":
                            store().delete(acts["handle"])
                    return _capacity_error(exc)
                return result
            return _with_activation_chunks(result, scope, n, endpoint, encode, lens.stream)

        return serve

    return make


def _refuse_lens_keys(original):
    async def serve(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        key = asks_for_work(getattr(request, "vllm_xargs", None))
        if key is not None:
            return _request_error(LensRequestError(key, OFF_ROUTE))
        return await original(self, request, *args, **kwargs)

    return serve


def _several_prompts(request: Any) -> bool:
    """A completions request with a batch of prompts (texts or token lists)."""
    prompt = getattr(request, "prompt", None)
    return (isinstance(prompt, list) and len(prompt) > 1
            and not all(isinstance(t, int) for t in prompt))


class _Started:
    """A stream whose first item was already produced; the same items, in order. ``aclose``
    closes the underlying stream whether or not iteration resumed."""

    _NOTHING = object()

    def __init__(self, stream: AsyncGenerator[str, None]) -> None:
        self._stream = stream
        self._first: Any = self._NOTHING

    async def start(self) -> _Started:
        try:
            self._first = await self._stream.__anext__()
        except StopAsyncIteration:
            pass
        return self

    def __aiter__(self) -> _Started:
        return self

    async def __anext__(self) -> str:
        if self._first is not self._NOTHING:
            item, self._first = self._first, self._NOTHING
            return item
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        await self._stream.aclose()


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
) -> tuple[Callable[[Any], dict[str, Any]], LensRequest] | None:
    """Check ``vllm_xargs`` as the engine would (raises LensRequestError, also for misspelt lens
    keys); returns the activations encoder and the parsed request (which the engine wrapper
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
    presets = dict(LensSession.of(engine).presets)
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
    encode = _encode_binary if xargs.get(TRANSPORT_KEY) == "binary" else activations_to_json
    return encode, lens


def _request_error(exc: LensRequestError) -> ErrorResponse:
    if isinstance(exc, (RemoteCodeRefusedError, SinkRefusedError)):
        return create_error_response(str(exc), err_type="PermissionDeniedError",
                                     status_code=HTTPStatus.FORBIDDEN, param=exc.field)
    return create_error_response(str(exc), param=exc.field)


def _capacity_error(exc: CapacityError) -> ErrorResponse:
    return create_error_response(str(exc), err_type="ServiceUnavailableError",
                                 status_code=HTTPStatus.SERVICE_UNAVAILABLE, param=exc.setting)


def _error_event(err: ErrorResponse) -> str:
    """An error as a server-sent event, as vLLM's own streams send them."""
    return f"data: {json.dumps({'error': err.error.model_dump()})}\n\n"


def _json_error(err: ErrorResponse) -> JSONResponse:
    return JSONResponse(err.model_dump(), status_code=err.error.code)


def _encode_results(results: Mapping[str, Any],
                    encode: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """One choice's lens results as the JSON fields it gets."""
    fields = {}
    if results.get("activations") is not None:
        fields["activations"] = encode(results["activations"])
    if results.get("hook_results") is not None:
        fields["hook_results"] = hook_results_to_json(results["hook_results"])
    if results.get("capture_receipt") is not None:
        fields["capture_receipt"] = results["capture_receipt"]
    if results.get("steering_gates") is not None:
        fields["steering_gates"] = hook_results_to_json(results["steering_gates"])
    if results.get("sae_features") is not None:  # sparse: JSON in both transports
        fields["sae_features"] = hook_results_to_json(results["sae_features"])
    return fields


def _encode_binary(acts: Mapping[str, Any]) -> dict[str, Any]:
    blob = wire.dumps(dict(acts))
    return binary_descriptor(acts, store().put(blob), len(blob))


def _with_partials(scope: ResponseScope, response_id: str, n: int) -> dict[int, Any]:
    """Each choice's final results, with the streamed rows not sent yet (if any) in front of
    the final output's rows."""
    found = scope.by_choice(response_id, n)
    for index, results in found.items():
        early = scope.take_partial(response_id, index)
        if early:
            found[index] = join_streamed([*early, results])
    return found


async def _with_activation_chunks(
    stream: _Started, scope: ResponseScope, n: int, endpoint: _Endpoint,
    encode: Callable[[Any], dict[str, Any]], stream_rows: bool = False,
) -> AsyncGenerator[str, None]:
    """Pass the stream through, adding one activations chunk per choice before ``[DONE]``;
    with ``stream_rows`` (``stream_activations``), each chunk of a choice also carries the
    rows computed since its previous chunk."""
    header: dict[str, Any] | None = None
    with scope.active():  # the engine requests report their results into this scope
        async with contextlib.aclosing(stream):  # a client gone mid-stream closes vLLM's
            async for item in stream:
                if header is None and item.startswith("data: {"):
                    header = _chunk_header(item)
                if (stream_rows and scope.partial and header is not None
                        and item.startswith("data: {")):
                    try:
                        item = await _with_rows(item, scope, header["id"], encode)
                    except CapacityError as exc:  # rows it cannot hold: say so and stop
                        yield _error_event(_capacity_error(exc))
                        yield _DONE
                        return  # closing vLLM's stream aborts the request
                if item == _DONE and header is not None:
                    for index, results in sorted(_with_partials(scope, header["id"],
                                                                n).items()):
                        try:
                            fields = await asyncio.to_thread(_encode_results, results, encode)
                        except CapacityError as exc:
                            yield _error_event(_capacity_error(exc))
                            continue
                        choice = {"index": index, **endpoint.empty_choice,
                                  "finish_reason": None, **fields}
                        yield f"data: {json.dumps({**header, 'choices': [choice]})}\n\n"
                yield item


#: Streamed rows up to this size are encoded on the event loop (a thread hop costs more).
_ENCODE_INLINE_BYTES = 256 << 10


async def _with_rows(item: str, scope: ResponseScope, response_id: str,
                     encode: Callable[[Any], dict[str, Any]]) -> str:
    """``item`` (one ``data:`` chunk) with the streamed rows of its choices not sent yet."""
    chunk = json.loads(item.removeprefix("data: "))
    added = False
    for choice in chunk.get("choices") or ():
        early = scope.take_partial(response_id, choice.get("index", 0))
        if early:
            joined = join_streamed(early)
            for name, encoder in (("activations", encode),
                                  ("sae_features", hook_results_to_json)):
                if (value := joined.get(name)) is not None:
                    # A token's rows: no thread hop; a long prompt's: off the event loop.
                    choice[name] = (encoder(value) if _nbytes(value) <= _ENCODE_INLINE_BYTES
                                    else await asyncio.to_thread(encoder, value))
            added = True
    return f"data: {json.dumps(chunk)}\n\n" if added else item


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a dict of them, or a list of such dicts)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_nbytes(v) for v in value)
    return 0


def _chunk_header(item: str) -> dict[str, Any] | None:
    chunk = json.loads(item.removeprefix("data: "))
    if "id" not in chunk:  # an error event
        return None
    return {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}


_router = APIRouter()
logger = init_logger(__name__)


def _not_found(handle: str) -> JSONResponse:
    return _json_error(create_error_response(
        f"no activations under handle {handle!r}: it never existed, was deleted, or expired "
        f"(handles live {envs.http_store_ttl_s():g} s; VLLM_LENS_HTTP_STORE_TTL_S)",
        err_type="NotFoundError", status_code=HTTPStatus.NOT_FOUND, param="handle"))


_FETCH_BODY_MAX = 4096


@_router.post(FETCH_PATH)
async def fetch_activations(raw_request: Request) -> Response:
    """The bytes of a handle named in the body (kept out of URLs and access logs); with
    ``"delete": true`` (the default) they are freed as they are served."""
    try:
        body = await read_bounded(raw_request, _FETCH_BODY_MAX)
        request = json.loads(body)
        handle = valid_handle(request.get("handle"))
        delete = request.get("delete", True)
        if not isinstance(delete, bool):
            raise ValueError("'delete' must be true or false")
    except (ValueError, AttributeError) as exc:
        return _json_error(create_error_response(
            f"expected a JSON body {{\"handle\": <handle>, \"delete\": true}}: {exc}",
            err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST, param="handle"))
    return _served(handle, delete=delete)


@_router.get(ACTIVATIONS_PATH + "/{handle}")
async def get_activations(handle: str) -> Response:
    return _served(handle, delete=False)


def _served(handle: str, *, delete: bool) -> Response:
    """The entry's bytes, streamed from its file (never read whole into this process)."""
    f = store().open(handle, delete=delete)
    if f is None:
        return _not_found(handle)
    size = os.fstat(f.fileno()).st_size

    def chunks() -> Iterator[bytes]:  # iterated on a worker thread, off the event loop
        with f:
            while chunk := f.read(1 << 20):
                yield chunk

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={**answered_by(), "content-length": str(size)})


@_router.delete(ACTIVATIONS_PATH + "/{handle}")
async def delete_activations(handle: str) -> Response:
    if not store().delete(handle):
        return _not_found(handle)
    return JSONResponse({"deleted": handle}, headers=answered_by())


@_router.get("/v1/lens/saes")
async def list_saes(raw_request: Request) -> JSONResponse:
    """The SAEs requests may name (``VLLM_LENS_SAES``): name, layout, architecture, hook
    point, widths and dtype; never a path or weights."""
    saes = await raw_request.app.state.engine_client.registered_saes()
    return JSONResponse({"object": "list", "data": saes})


@_router.get("/v1/lens/stats")
async def lens_stats(raw_request: Request) -> JSONResponse:
    workers = await _worker_stats(raw_request.app.state.engine_client)
    return JSONResponse({"store": await asyncio.to_thread(store().stats), "workers": workers,
                         "sweeps": patching_sweep.running_sweeps()})


#: The last ``lens_stats`` call to the workers: GETs while it runs, and within
#: ``_STATS_INTERVAL_S`` after it answered, share it, so polling the route costs the workers
#: at most one call a second however many clients poll.
_stats_call: asyncio.Future | None = None
_stats_answered = 0.0
_STATS_INTERVAL_S = 1.0


async def _worker_stats(engine: Any) -> list[Any]:
    global _stats_call, _stats_answered
    loop = asyncio.get_running_loop()
    call = _stats_call
    stale = (call is None or call.get_loop() is not loop
             or (call.done() and (call.cancelled() or call.exception() is not None
                                  or loop.time() - _stats_answered > _STATS_INTERVAL_S)))
    if stale:
        call = _stats_call = asyncio.ensure_future(all_workers(engine, "lens_stats"))

        def answered(_: asyncio.Future) -> None:
            global _stats_answered
            _stats_answered = loop.time()

        call.add_done_callback(answered)
    return await asyncio.shield(call)


async def _hooks_call(raw_request: Request, name: str, *args: Any) -> JSONResponse:
    if not envs.allow_persistent_hooks():
        return _json_error(create_error_response(
            "persistent hooks run on every client's requests and collect returns their results, "
            "so /v1/hooks/* is off; the operator may start the server with "
            "VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1 (only where all clients may see each other's "
            "traffic)", err_type="PermissionDeniedError", status_code=HTTPStatus.FORBIDDEN))
    engine = raw_request.app.state.engine_client
    try:
        result = await getattr(engine, name)(*args)
    except LensRequestError as exc:
        return _json_error(_request_error(exc))
    except KeyError as exc:
        return _json_error(create_error_response(str(exc.args[0]), param="names"))
    return JSONResponse({"ok": True, "result": hook_results_to_json(result)})


@_router.post("/v1/hooks/register")
async def register_hooks(raw_request: Request) -> JSONResponse:
    """Body: ``{"hooks": [named hook or {"pickle": ...}, ...], "prefetch_params": [...]}``."""
    body = await json_object(raw_request) or {}
    return await _hooks_call(raw_request, "register_hooks", body.get("hooks"),
                             body.get("prefetch_params"))


@_router.get("/v1/hooks/collect")
async def collect_hook_results(raw_request: Request) -> JSONResponse:
    return await _hooks_call(raw_request, "collect_hook_results")


@_router.post("/v1/hooks/prefetch")
async def prefetch_params(raw_request: Request) -> JSONResponse:
    body = await json_object(raw_request) or {}
    names = body.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return _json_error(create_error_response("names must be a list of parameter names",
                                                 param="names"))
    return await _hooks_call(raw_request, "prefetch_params", names)


def _simple_hooks_route(path: str, name: str) -> None:
    async def route(raw_request: Request) -> JSONResponse:
        return await _hooks_call(raw_request, name)

    route.__name__ = name
    _router.post(path)(route)


for _path, _name in (("/v1/hooks/clear", "clear_hooks"),
                     ("/v1/hooks/clear_results", "clear_hook_results"),
                     ("/v1/hooks/clear_prefetched", "clear_prefetched")):
    _simple_hooks_route(_path, _name)
