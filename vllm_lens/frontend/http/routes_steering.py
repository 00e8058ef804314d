"""The OpenAI server's steering-preset routes and its start-up registration of
``VLLM_LENS_STEERING_PRESETS`` (runs in: front end).

- ``GET /v1/steering``: the registered presets (names, layers, points, modes, shapes; never
  the vectors), open to every client, since selecting a preset needs no opt-in.
- ``POST /v1/steering/register`` ``{"name", "vectors": [SteeringVector JSON, ...], "model"?}``
  and ``POST /v1/steering/unregister`` ``{"name"}``: 403 unless the operator set
  ``VLLM_LENS_ALLOW_STEERING_ROUTES=1``, since a preset steers every client that selects it.
  A vector may steer by feature (``{"sae", "feature", "scale" | "clamp"}``) of an SAE the
  server serves by name (``VLLM_LENS_SAES``); a directory is refused, naming the field.

The presets file is registered after ``VLLM_LENS_SAES`` (``http.install``), so its presets
may steer by those SAEs' features too.

With several API server processes (``--api-server-count N``) a route call is applied by the
process it reaches and shared with the others through ``http.preset_log``.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from vllm_lens import envs
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.session import LensSession
from vllm_lens.frontend.http import preset_log
from vllm_lens.frontend.http.bodies import answered_by, json_object
from vllm_lens.frontend.http.errors import answer, error
from vllm_lens.frontend.presets import Presets, read_preset_file

logger = logging.getLogger(__name__)

__all__ = ["register_preset_file", "router"]

router = APIRouter()


async def register_preset_file(engine: Any, api_server_count: int | None = None) -> None:
    """Register every preset of ``VLLM_LENS_STEERING_PRESETS`` on ``engine`` (an ``AsyncLLM``);
    a preset that does not fit the model stops the server from starting, naming it."""
    preset_log.configure(api_server_count)
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
    await preset_log.sync(raw_request.app.state.engine_client)
    presets = await raw_request.app.state.engine_client.steering_presets()
    return JSONResponse({"object": "list", "data": presets}, headers=answered_by())


async def _changing(raw_request: Request, method: str, *args: Any) -> JSONResponse:
    if not envs.allow_steering_routes():
        return error("a steering preset steers every client that selects it, so "
                      "/v1/steering/register and /unregister are off; the operator may start "
                      "the server with VLLM_LENS_ALLOW_STEERING_ROUTES=1, or register presets "
                      "from a file with VLLM_LENS_STEERING_PRESETS", HTTPStatus.FORBIDDEN)
    engine = raw_request.app.state.engine_client
    name = args[0]
    async with preset_log.held() as log:
        if log is not None:
            await preset_log.replay(engine, log)
        presets = Presets.of(LensSession.of(engine))
        before = presets.snapshot(name) if isinstance(name, str) else (None, None)
        try:
            result = await getattr(engine, method)(*args)
        except LensRequestError as exc:
            return answer(exc)
        if log is not None:  # the other processes apply it before they next use presets
            try:
                preset_log.append(log, method, args)
            except OSError as exc:  # not shared: undone here too, so all processes agree
                presets.restore(name, before)
                return error(f"the preset change could not be shared with this server's "
                             f"other API processes ({exc.strerror}); nothing changed",
                             HTTPStatus.SERVICE_UNAVAILABLE)
    return JSONResponse({"ok": True, "result": result})


@router.post("/v1/steering/register")
async def register_preset(raw_request: Request) -> JSONResponse:
    body = await json_object(raw_request) or {}
    return await _changing(raw_request, "register_steering", body.get("name"),
                           body.get("vectors"), body.get("model"))


@router.post("/v1/steering/unregister")
async def unregister_preset(raw_request: Request) -> JSONResponse:
    body = await json_object(raw_request) or {}
    return await _changing(raw_request, "unregister_steering", body.get("name"))

