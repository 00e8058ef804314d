"""The persistent-hook routes ``/v1/hooks/{register, collect, clear, clear_results,
prefetch, clear_prefetched}`` (runs in: front end).

They call the methods ``frontend.persistent_hooks`` adds to ``AsyncLLM``, and answer 403
unless the operator set ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (they see every client's
traffic).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_lens import envs
from vllm_lens.activations import hook_results_to_json
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.http.bodies import json_object
from vllm_lens.frontend.http.errors import answer, error

__all__ = ["router"]

router = APIRouter()


async def _hooks_call(raw_request: Request, name: str, *args: Any) -> JSONResponse:
    if not envs.allow_persistent_hooks():
        return error(
            "persistent hooks run on every client's requests and collect returns their results, "
            "so /v1/hooks/* is off; the operator may start the server with "
            "VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1 (only where all clients may see each other's "
            "traffic)", HTTPStatus.FORBIDDEN)
    engine = raw_request.app.state.engine_client
    try:
        result = await getattr(engine, name)(*args)
    except LensRequestError as exc:
        return answer(exc)
    except KeyError as exc:  # a name nothing is registered under
        return answer(exc, message=str(exc.args[0]), param="names")
    return JSONResponse({"ok": True, "result": hook_results_to_json(result)})


@router.post("/v1/hooks/register")
async def register_hooks(raw_request: Request) -> JSONResponse:
    """Body: ``{"hooks": [named hook or {"pickle": ...}, ...], "prefetch_params": [...]}``."""
    body = await json_object(raw_request) or {}
    return await _hooks_call(raw_request, "register_hooks", body.get("hooks"),
                             body.get("prefetch_params"))


@router.get("/v1/hooks/collect")
async def collect_hook_results(raw_request: Request) -> JSONResponse:
    return await _hooks_call(raw_request, "collect_hook_results")


@router.post("/v1/hooks/prefetch")
async def prefetch_params(raw_request: Request) -> JSONResponse:
    body = await json_object(raw_request) or {}
    names = body.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return error("names must be a list of parameter names", param="names")
    return await _hooks_call(raw_request, "prefetch_params", names)


def _simple_hooks_route(path: str, name: str) -> None:
    async def route(raw_request: Request) -> JSONResponse:
        return await _hooks_call(raw_request, name)

    route.__name__ = name
    router.post(path)(route)


for _path, _name in (("/v1/hooks/clear", "clear_hooks"),
                     ("/v1/hooks/clear_results", "clear_hook_results"),
                     ("/v1/hooks/clear_prefetched", "clear_prefetched")):
    _simple_hooks_route(_path, _name)
