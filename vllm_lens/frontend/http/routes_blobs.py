"""The binary transport's routes: a response's activations fetched or deleted by handle
(runs in: front end).

``POST /v1/lens/activations/fetch`` (the handle in the body, kept out of URLs and access
logs), ``GET`` and ``DELETE /v1/lens/activations/{handle}``. The bytes are streamed from the
store's file, never read whole into the API process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_lens import envs
from vllm_lens.activations import ACTIVATIONS_PATH, FETCH_PATH, valid_handle
from vllm_lens.frontend.http.blob_store import store
from vllm_lens.frontend.http.bodies import answered_by, read_bounded
from vllm_lens.frontend.http.errors import error

__all__ = ["router"]

router = APIRouter()


def _not_found(handle: str) -> JSONResponse:
    return error(
        f"no activations under handle {handle!r}: it never existed, was deleted, or expired "
        f"(handles live {envs.http_store_ttl_s():g} s; VLLM_LENS_HTTP_STORE_TTL_S)",
        HTTPStatus.NOT_FOUND, param="handle")


_FETCH_BODY_MAX = 4096


@router.post(FETCH_PATH)
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
        return error(f"expected a JSON body {{\"handle\": <handle>, \"delete\": true}}: {exc}",
                     param="handle")
    return _served(handle, delete=delete)


@router.get(ACTIVATIONS_PATH + "/{handle}")
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


@router.delete(ACTIVATIONS_PATH + "/{handle}")
async def delete_activations(handle: str) -> Response:
    if not store().delete(handle):
        return _not_found(handle)
    return JSONResponse({"deleted": handle}, headers=answered_by())
