"""One table of exceptions -> HTTP status (``frontend/http/errors.py``): every error of
``vllm_lens.errors`` has its status there, and the routes and the streaming path answer through
it (each kind raised where a route catches it, the answer compared with the table's)."""

import asyncio
import json
from http import HTTPStatus
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_lens import errors
from vllm_lens.common import wire
from vllm_lens.errors import (
    CapacityError,
    DatasetConflictError,
    LensError,
    LensExecutionError,
    LensRequestError,
    RemoteCodeRefusedError,
    SinkConflictError,
    SinkRefusedError,
    UnsupportedConfigError,
    UnsupportedModelError,
    WireError,
    WorkerCapacityError,
)
from vllm_lens.frontend.http import routes_patching
from vllm_lens.frontend.http import endpoints, routes_hooks, routes_steering, streaming
from vllm_lens.frontend.http.results import Transport
from vllm_lens.frontend.http.errors import STATUSES, error_response, status_of
from vllm_lens.frontend.response_scope import report
from vllm_lens.hooks import HookError

#: The status, OpenAI error type and ``param`` each error is answered with over HTTP (the
#: statuses the server gave before the table: 400 a bad lens request, 403 a refusal by the
#: operator's settings, 409 a sink's conflict, 503 a full shared budget, 500 a failure).
EXPECTED = {
    LensRequestError: (400, "BadRequestError", "apply_hooks[0]"),
    UnsupportedModelError: (400, "BadRequestError", "apply_hooks[0]"),
    UnsupportedConfigError: (400, "BadRequestError", "apply_hooks[0]"),
    RemoteCodeRefusedError: (403, "PermissionDeniedError", "apply_hooks[0]"),
    SinkRefusedError: (403, "PermissionDeniedError", "apply_hooks[0]"),
    LensExecutionError: (500, "InternalServerError", None),
    SinkConflictError: (409, "ConflictError", "capture_sink"),
    WorkerCapacityError: (503, "ServiceUnavailableError", "VLLM_LENS_WORKER_MAX_BYTES"),
    CapacityError: (503, "ServiceUnavailableError", "VLLM_LENS_HTTP_STORE_MAX_BYTES"),
    DatasetConflictError: (409, "ConflictError", "capture_sink"),
    WireError: (400, "BadRequestError", None),
    LensError: (500, "InternalServerError", None),
    HookError: (500, "InternalServerError", "apply_hooks"),
}


def _sample(cls: type[Exception]) -> Exception:
    """An instance of ``cls`` as the package raises it."""
    if issubclass(cls, LensRequestError):
        return cls("apply_hooks[0]", "refused")
    if cls is WorkerCapacityError:
        return cls("no room", setting="VLLM_LENS_WORKER_MAX_BYTES")
    if cls is CapacityError:
        return cls("the store is full", setting="VLLM_LENS_HTTP_STORE_MAX_BYTES")
    return cls("it failed")


def test_every_error_of_the_package_is_in_the_table():
    public = {getattr(errors, name) for name in errors.__all__}
    assert public | {HookError} == set(EXPECTED), "a new error needs a decided status"
    assert set(EXPECTED) <= set(STATUSES), "listed in the table itself, not only by a base"


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_each_error_is_answered_with_its_status_type_and_param(cls):
    err = error_response(_sample(cls)).error
    assert (err.code, err.type, err.param) == EXPECTED[cls]
    assert err.message == str(_sample(cls))


def test_the_table_is_walked_along_the_mro():
    class Narrower(SinkRefusedError):
        pass

    assert status_of(Narrower("f", "p")).code == HTTPStatus.FORBIDDEN  # not LensRequestError's
    assert status_of(ValueError("vLLM's own validation")).code == HTTPStatus.BAD_REQUEST
    assert status_of(KeyError("no such hook")).code == HTTPStatus.BAD_REQUEST
    assert status_of(RuntimeError("anything else")).code == HTTPStatus.INTERNAL_SERVER_ERROR


# -- the routes answer through the table ----------------------------------------------------

_CAUGHT_BY_ENDPOINTS = [c for c in EXPECTED
                        if issubclass(c, (LensRequestError, HookError, LensExecutionError))]


@pytest.mark.parametrize("cls", _CAUGHT_BY_ENDPOINTS, ids=lambda c: c.__name__)
def test_the_completions_wrapper_answers_what_the_engine_raised_from_the_table(cls, monkeypatch):
    async def validated(engine, xargs):
        return (lambda acts: {}), SimpleNamespace(sink=None, stream=False)

    async def original(self, request, raw_request=None):
        raise _sample(cls)

    monkeypatch.setattr(endpoints, "_validate", validated)
    serve = endpoints.wrap_endpoint(streaming.COMPLETIONS)(original)
    request = SimpleNamespace(vllm_xargs={"output_residual_stream": [0]}, n=1)
    answer = asyncio.run(serve(SimpleNamespace(engine_client=None), request))
    assert (answer.error.code, answer.error.type, answer.error.param) == EXPECTED[cls]


def _full_store(acts):
    raise _sample(CapacityError)


#: A transport whose activations never fit the store.
_full = Transport(_full_store, wire.tensor_to_json)


def test_a_full_store_refuses_the_whole_response_from_the_table(monkeypatch):
    async def validated(engine, xargs):
        return _full, SimpleNamespace(sink=None, stream=False)

    async def original(self, request, raw_request=None):
        report("cmpl-1", {0: {"activations": {"resid_post": []}}})
        return SimpleNamespace(id="cmpl-1", choices=[SimpleNamespace(index=0)])

    monkeypatch.setattr(endpoints, "_validate", validated)
    serve = endpoints.wrap_endpoint(streaming.CHAT)(original)
    request = SimpleNamespace(vllm_xargs={"output_residual_stream": [0]}, n=1)
    answer = asyncio.run(serve(SimpleNamespace(engine_client=None), request))
    assert (answer.error.code, answer.error.param) == EXPECTED[CapacityError][::2]


def test_the_stream_sends_the_tables_answer_as_an_error_event():
    from vllm_lens.frontend.response_scope import ResponseScope

    async def chunks():
        yield 'data: {"id": "cmpl-1", "object": "text_completion", "choices": []}\n\n'
        yield streaming.DONE

    async def run() -> list[str]:
        scope = ResponseScope()
        scope.found["cmpl-1"] = {0: {"activations": {"resid_post": []}}}
        stream = await streaming.Started(chunks()).start()
        return [item async for item in streaming.with_activation_chunks(
            stream, scope, 1, streaming.COMPLETIONS, _full)]

    items = asyncio.run(run())
    events = [json.loads(i.removeprefix("data: ")) for i in items if '"error"' in i]
    assert [(e["error"]["code"], e["error"]["type"]) for e in events] == [
        EXPECTED[CapacityError][:2]]
    assert items[-1] == streaming.DONE


class _Raising:
    """An engine whose every method raises ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def _raise(self, *args):
        raise self.exc

    register_hooks = collect_hook_results = register_steering = patching_sweep = _raise


def _client(exc: Exception, monkeypatch) -> TestClient:
    monkeypatch.setenv("VLLM_LENS_ALLOW_PERSISTENT_HOOKS", "1")
    monkeypatch.setenv("VLLM_LENS_ALLOW_STEERING_ROUTES", "1")
    app = FastAPI()
    for router in (routes_hooks.router, routes_steering.router, routes_patching.router):
        app.include_router(router)
    app.state.engine_client = _Raising(exc)
    return TestClient(app)


_REQUEST_ERRORS = [c for c in EXPECTED if issubclass(c, LensRequestError)]


@pytest.mark.parametrize("cls", _REQUEST_ERRORS, ids=lambda c: c.__name__)
def test_the_hooks_and_steering_routes_answer_from_the_table(cls, monkeypatch):
    client = _client(_sample(cls), monkeypatch)
    for method, path, body in (("post", "/v1/hooks/register", {"hooks": []}),
                               ("get", "/v1/hooks/collect", None),
                               ("post", "/v1/steering/register", {"name": "p"})):
        got = getattr(client, method)(path, **({"json": body} if body is not None else {}))
        code, kind, param = EXPECTED[cls]
        assert got.status_code == code, (path, got.text)
        assert (got.json()["error"]["type"], got.json()["error"]["param"]) == (kind, param)


def test_an_unknown_hook_name_is_the_tables_400_naming_names(monkeypatch):
    got = _client(KeyError("no parameter 'x'"), monkeypatch).get("/v1/hooks/collect")
    assert got.status_code == 400
    assert got.json()["error"]["message"] == "no parameter 'x'"
    assert got.json()["error"]["param"] == "names"


_SWEEP_ERRORS = [c for c in EXPECTED if issubclass(c, (ValueError, LensError))]


@pytest.mark.parametrize("cls", [*_SWEEP_ERRORS, ValueError], ids=lambda c: c.__name__)
def test_the_sweep_route_answers_from_the_table(cls, monkeypatch):
    exc = _sample(cls)
    got = _client(exc, monkeypatch).post("/v1/lens/patching_sweep", json={"prompt": "x"})
    status = status_of(exc)
    assert got.status_code == status.code, got.text
    assert got.json()["error"]["type"] == status.err_type
