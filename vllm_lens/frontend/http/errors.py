"""The one table of exceptions -> HTTP status, and the OpenAI-style error answers every route
and stream of vllm-lens builds from it (runs in: front end).

``STATUSES`` maps an exception class to its status and the ``param`` its answer names; an
exception is looked up along its MRO, so the most specific class listed wins (a
``SinkRefusedError`` is a 403 although it is a ``LensRequestError``, a 400). The split is the
one of ``vllm_lens.errors``: what the caller sent wrong is a 4xx, what failed on the server's
side a 5xx::

    RemoteCodeRefusedError, SinkRefusedError        403  param: the field
    LensRequestError (UnsupportedModelError,        400  param: the field
        UnsupportedConfigError)
    SinkConflictError, DatasetConflictError         409  param: capture_sink
    WireError, ValueError, KeyError                 400
    CapacityError, WorkerCapacityError              503  param: the setting
    HookError                                       500  param: apply_hooks
    LensExecutionError, LensError, Exception        500

``ERROR_TYPES`` names the OpenAI error type of each status (the SDK maps the status to its
exception class). A route catches what it caught before, and answers with
``error_response`` / ``answer`` (an exception) or ``error`` (a refusal that is no
exception: a route switched off, an unknown handle, a body too large).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

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
from vllm_lens.hooks import HookError
from vllm_lens.spec import HOOKS_KEY, SINK_KEY

__all__ = ["ERROR_TYPES", "STATUSES", "Status", "answer", "error", "error_event",
           "error_response", "status_of"]

#: OpenAI's error type name of each status this package answers with.
ERROR_TYPES: dict[HTTPStatus, str] = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.FORBIDDEN: "PermissionDeniedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.CONFLICT: "ConflictError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "BadRequestError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


@dataclass(frozen=True)
class Status:
    """How one kind of exception is answered."""

    code: HTTPStatus
    """The HTTP status."""
    param: Callable[[BaseException], str | None] = lambda exc: None
    """The ``param`` of the answer (the offending field or setting), from the exception."""

    @property
    def err_type(self) -> str:
        """The OpenAI error type of ``code``."""
        return ERROR_TYPES[self.code]


def _field(exc: Any) -> str | None:
    return exc.field


def _setting(exc: Any) -> str | None:
    return exc.setting


_FORBIDDEN = Status(HTTPStatus.FORBIDDEN, _field)
_BAD_FIELD = Status(HTTPStatus.BAD_REQUEST, _field)
_CONFLICT = Status(HTTPStatus.CONFLICT, lambda exc: SINK_KEY)
_BAD = Status(HTTPStatus.BAD_REQUEST)
_FULL = Status(HTTPStatus.SERVICE_UNAVAILABLE, _setting)
_FAILED = Status(HTTPStatus.INTERNAL_SERVER_ERROR)

#: Exception class -> its answer; ``status_of`` walks an exception's MRO through it.
STATUSES: dict[type[BaseException], Status] = {
    # the caller's to fix (4xx)
    RemoteCodeRefusedError: _FORBIDDEN,
    SinkRefusedError: _FORBIDDEN,
    UnsupportedModelError: _BAD_FIELD,
    UnsupportedConfigError: _BAD_FIELD,
    LensRequestError: _BAD_FIELD,
    SinkConflictError: _CONFLICT,
    DatasetConflictError: _CONFLICT,
    WireError: _BAD,
    ValueError: _BAD,  # vLLM's own validation; a body that is not what the route reads
    KeyError: _BAD,  # a name nothing is registered under
    # a budget every client shares, or the server's own failure (5xx)
    CapacityError: _FULL,
    WorkerCapacityError: _FULL,
    HookError: Status(HTTPStatus.INTERNAL_SERVER_ERROR, lambda exc: HOOKS_KEY),
    LensExecutionError: _FAILED,
    LensError: _FAILED,
    Exception: _FAILED,
}


def status_of(exc: BaseException) -> Status:
    """The answer to ``exc``: the entry of the first class of its MRO that ``STATUSES`` lists."""
    for cls in type(exc).__mro__:
        if cls in STATUSES:
            return STATUSES[cls]
    return _FAILED


_UNSET: Any = object()


def error_response(exc: BaseException, *, message: str | None = None,
                   param: str | None = _UNSET) -> ErrorResponse:
    """``exc`` as vLLM's ``ErrorResponse`` (what vLLM's own endpoints return), its status from
    ``STATUSES``; ``message`` and ``param`` replace ``str(exc)`` and the table's param."""
    status = status_of(exc)
    return create_error_response(str(exc) if message is None else message,
                                 err_type=status.err_type, status_code=status.code,
                                 param=status.param(exc) if param is _UNSET else param)


def answer(exc: BaseException, *, message: str | None = None,
           param: str | None = _UNSET) -> JSONResponse:
    """``exc`` as the JSON answer of one of vllm-lens's own routes (see ``error_response``)."""
    return _json(error_response(exc, message=message, param=param))


def error(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
          param: str | None = None) -> JSONResponse:
    """A refusal that is no exception (a route switched off, an unknown handle ...), with the
    error type of ``status``."""
    return _json(create_error_response(message, err_type=ERROR_TYPES[status],
                                       status_code=status, param=param))


def error_event(exc: BaseException) -> str:
    """``exc`` as a server-sent event, as vLLM's own streams send errors."""
    err = error_response(exc)
    return f"data: {json.dumps({'error': err.error.model_dump()})}\n\n"


def _json(err: ErrorResponse) -> JSONResponse:
    return JSONResponse(err.model_dump(), status_code=err.error.code)
