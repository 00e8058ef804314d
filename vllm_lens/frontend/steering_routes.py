"""The OpenAI server's steering-preset routes and its start-up registration of
``VLLM_LENS_STEERING_PRESETS`` (runs in: front end, the API server process).

- ``GET /v1/steering``: the registered presets (names, layers, points, modes, shapes; never
  the vectors), open to every client, since selecting a preset needs no opt-in.
- ``POST /v1/steering/register`` ``{"name", "vectors": [SteeringVector JSON, ...], "model"?}``
  and ``POST /v1/steering/unregister`` ``{"name"}``: 403 unless the operator set
  ``VLLM_LENS_ALLOW_STEERING_ROUTES=1``, since a preset steers every client that selects it.
  A vector may steer by feature (``{"sae", "feature", "scale" | "clamp"}``) of an SAE the
  server serves by name (``VLLM_LENS_SAES``); a directory is refused, naming the field.

The presets file is registered after ``VLLM_LENS_SAES`` (``frontend.server``), so its presets
may steer by those SAEs' features too.

Several API server processes (``--api-server-count N``) each hold their presets in memory. A
route call there is applied by the process it reaches and appended to a log in the server's
shared directory (``frontend.blob_store.shared_root``); every process replays the log, in
order, before it lists presets, changes them or parses a request that selects one, so a
preset registered through one process steers requests that reach any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from vllm_lens import envs
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.blob_store import shared_root
from vllm_lens.frontend.http_io import answered_by, error, json_object
from vllm_lens.frontend.presets import read_preset_file

logger = logging.getLogger(__name__)

__all__ = ["register_preset_file", "router", "sync_presets"]

router = APIRouter()
#: API server processes of this server (``--api-server-count``): with several, route calls go
#: through the shared log.
_processes = 1
_LOG = "steering-presets.jsonl"
_replayed = 0
"""Bytes of the shared log this process has applied."""
_local = asyncio.Lock()


async def register_preset_file(engine: Any, api_server_count: int | None = None) -> None:
    """Register every preset of ``VLLM_LENS_STEERING_PRESETS`` on ``engine`` (an ``AsyncLLM``);
    a preset that does not fit the model stops the server from starting, naming it."""
    global _processes
    _processes = api_server_count or 1
    path = envs.steering_presets_path()
    if path is None:
        return
    for name, (vectors, model) in read_preset_file(path).items():
        try:
            await engine.register_steering(name, vectors, model)
        except LensRequestError as exc:
            raise ValueError(f"VLLM_LENS_STEERING_PRESETS ({path}): {exc}") from None
    logger.info("vllm-lens: registered steering presets from %s: %s", path,
                ", ".join(p["name"] for p in await engine.steering_presets()))


@router.get("/v1/steering")
async def list_presets(raw_request: Request) -> JSONResponse:
    await sync_presets(raw_request.app.state.engine_client)
    presets = await raw_request.app.state.engine_client.steering_presets()
    return JSONResponse({"object": "list", "data": presets}, headers=answered_by())


async def _changing(raw_request: Request, method: str, *args: Any) -> JSONResponse:
    if not envs.allow_steering_routes():
        return error("a steering preset steers every client that selects it, so "
                      "/v1/steering/register and /unregister are off; the operator may start "
                      "the server with VLLM_LENS_ALLOW_STEERING_ROUTES=1, or register presets "
                      "from a file with VLLM_LENS_STEERING_PRESETS", HTTPStatus.FORBIDDEN)
    engine = raw_request.app.state.engine_client
    async with _shared_log() as log:
        if log is not None:
            await _replay(engine, log)
        try:
            result = await getattr(engine, method)(*args)
        except LensRequestError as exc:
            return error(str(exc), param=exc.field)
        if log is not None:  # the other processes apply it before they next use presets
            log.write(json.dumps({"method": method, "args": list(args)}) + "\n")
            log.flush()
            global _replayed
            _replayed = log.tell()
    return JSONResponse({"ok": True, "result": result})


async def sync_presets(engine: Any) -> None:
    """Apply the route calls other API processes of this server logged since this one last
    looked (a no-op with one API process, and a ``stat`` when nothing changed)."""
    if _processes <= 1:
        return
    path = shared_root() / _LOG
    if not path.exists() or path.stat().st_size == _replayed:
        return
    async with _shared_log() as log:
        await _replay(engine, log)


@contextlib.asynccontextmanager
async def _shared_log() -> AsyncIterator[Any]:
    """The shared log, held against the other API processes (``None`` with one process)."""
    if _processes <= 1:
        yield None
        return
    async with _local:
        with open(shared_root() / _LOG, "a+") as log:
            while True:  # without blocking the event loop while another process holds it
                try:
                    fcntl.flock(log, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.01)
            try:
                yield log
            finally:
                fcntl.flock(log, fcntl.LOCK_UN)


async def _replay(engine: Any, log: Any) -> None:
    """Apply the log's calls past ``_replayed`` (each was applied, so checked, where it was
    made; one that fails here is logged and skipped)."""
    global _replayed
    log.seek(_replayed)
    for line in log.read().splitlines():
        call = json.loads(line)
        try:
            await getattr(engine, call["method"])(*call["args"])
        except LensRequestError as exc:
            logger.warning("vllm-lens: a steering preset change made through another API "
                           "process failed here: %s", exc)
    _replayed = log.tell()


@router.post("/v1/steering/register")
async def register_preset(raw_request: Request) -> JSONResponse:
    body = await json_object(raw_request) or {}
    return await _changing(raw_request, "register_steering", body.get("name"),
                           body.get("vectors"), body.get("model"))


@router.post("/v1/steering/unregister")
async def unregister_preset(raw_request: Request) -> JSONResponse:
    body = await json_object(raw_request) or {}
    return await _changing(raw_request, "unregister_steering", body.get("name"))
