"""Reading request bodies and writing errors for vllm-lens's own HTTP routes (runs in: front
end, the API server process)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

__all__ = ["error", "json_object"]


async def json_object(raw_request: Request) -> dict[str, Any] | None:
    """The body as a JSON object; ``None`` when it is not one."""
    try:
        body = await raw_request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def error(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
          param: str | None = None) -> JSONResponse:
    """An OpenAI-style error response (``PermissionDeniedError`` for 403)."""
    err = create_error_response(message, status_code=status, param=param,
                                err_type="PermissionDeniedError"
                                if status == HTTPStatus.FORBIDDEN else "BadRequestError")
    return JSONResponse(err.model_dump(), status_code=err.error.code)
