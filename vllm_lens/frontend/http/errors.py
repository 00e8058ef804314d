"""vllm-lens's errors as the OpenAI-style error answers of its HTTP routes (runs in: front
end)."""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi.responses import JSONResponse
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

from vllm_lens.errors import (
    CapacityError,
    LensRequestError,
    RemoteCodeRefusedError,
    SinkRefusedError,
)

__all__ = ["capacity_error", "error", "error_event", "json_error", "request_error"]


def request_error(exc: LensRequestError) -> ErrorResponse:
    if isinstance(exc, (RemoteCodeRefusedError, SinkRefusedError)):
        return create_error_response(str(exc), err_type="PermissionDeniedError",
                                     status_code=HTTPStatus.FORBIDDEN, param=exc.field)
    return create_error_response(str(exc), param=exc.field)


def capacity_error(exc: CapacityError) -> ErrorResponse:
    return create_error_response(str(exc), err_type="ServiceUnavailableError",
                                 status_code=HTTPStatus.SERVICE_UNAVAILABLE, param=exc.setting)


def error_event(err: ErrorResponse) -> str:
    """An error as a server-sent event, as vLLM's own streams send them."""
    return f"data: {json.dumps({'error': err.error.model_dump()})}\n\n"


def json_error(err: ErrorResponse) -> JSONResponse:
    return JSONResponse(err.model_dump(), status_code=err.error.code)


#: OpenAI's error type names by status (the SDK maps the status to its exception class).
_ERROR_TYPES = {HTTPStatus.FORBIDDEN: "PermissionDeniedError",
                HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError"}


def error(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
          param: str | None = None) -> JSONResponse:
    """An OpenAI-style error response (``PermissionDeniedError`` for 403, ``RateLimitError``
    for 429, ``BadRequestError`` otherwise)."""
    err = create_error_response(message, status_code=status, param=param,
                                err_type=_ERROR_TYPES.get(status, "BadRequestError"))
    return JSONResponse(err.model_dump(), status_code=err.error.code)
