"""``POST /v1/lens/patching_sweep``: an activation-patching sweep over HTTP (runs in: front end).

The body has the names of ``patching_sweep`` (``frontend.patching_sweep``), tensors as JSON
tensor records; the answer is its result with the grid as nested lists (``null`` where a
metric is not finite). A body is bounded by ``VLLM_LENS_MAX_REQUEST_BYTES`` before it is
read, the sweeps one API process runs at once by ``VLLM_LENS_MAX_CONCURRENT_SWEEPS``, and a
client that disconnects cancels its sweep (vLLM aborts the variants' requests).
"""

from __future__ import annotations

import asyncio
import json
import math
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from vllm_lens import envs
from vllm_lens.errors import LensError
from vllm_lens.frontend.http.bodies import read_bounded
from vllm_lens.frontend.http.errors import answer, error

__all__ = ["router", "running_sweeps"]

router = APIRouter()

#: Sweeps running in this API process (``VLLM_LENS_MAX_CONCURRENT_SWEEPS`` bounds it).
_running = 0


def running_sweeps() -> int:
    """Sweeps this API process runs now (``/v1/lens/stats``)."""
    return _running


@router.post("/v1/lens/patching_sweep")
async def patching_sweep(raw_request: Request) -> Response:
    global _running
    limit = envs.max_request_bytes()
    try:  # bounded before it is read whole
        raw = await read_bounded(raw_request, limit)
    except ValueError as exc:
        return error(f"the sweep's {exc}, this server's limit (VLLM_LENS_MAX_REQUEST_BYTES)",
                     HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return error("expected a JSON object")
    most = envs.max_concurrent_sweeps()
    if _running >= most:
        return error(f"{_running} patching sweeps are running in this API process, its limit "
                     f"(VLLM_LENS_MAX_CONCURRENT_SWEEPS={most}); retry when one has finished",
                     HTTPStatus.TOO_MANY_REQUESTS)
    engine = raw_request.app.state.engine_client
    _running += 1
    try:
        sweep = asyncio.ensure_future(engine.patching_sweep(
            body.get("prompt"), body.get("clean"), body.get("layers"), body.get("positions"),
            body.get("metric"), body.get("corrupt"), body.get("point", "resid_post")))
        result = await _unless_client_leaves(sweep, raw_request)
    except (ValueError, LensError) as exc:  # a bad sweep or variant (4xx), a failed one (5xx)
        return answer(exc)
    finally:
        _running -= 1
    if result is None:  # the client went away: nobody reads this
        return Response(status_code=499)

    def finite(x: float) -> float | None:  # JSON has no NaN or infinity
        return x if math.isfinite(x) else None

    return JSONResponse({**result, "grid": [[finite(x) for x in row]
                                            for row in result["grid"].tolist()],
                         "corrupted": finite(result["corrupted"]),
                         "uncorrupted": finite(result["uncorrupted"])})


async def _unless_client_leaves(sweep: asyncio.Future, raw_request: Request) -> Any:
    """The sweep's result, or ``None`` once the client has disconnected, which cancels the
    sweep: its variants' engine requests are aborted, not run to the end for nobody (vLLM's
    own routes do this with ``with_cancellation``)."""
    async def disconnected() -> None:  # the body was read whole: only a disconnect is left
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([sweep, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not sweep.done():
            sweep.cancel()
            await asyncio.wait([sweep])  # its aborts are sent before the route returns
    if sweep.cancelled():
        return None
    return sweep.result()
