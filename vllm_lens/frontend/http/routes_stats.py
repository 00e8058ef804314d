"""What the server serves and holds: ``GET /v1/lens/model``, ``GET /v1/lens/saes`` and ``GET
/v1/lens/stats`` (runs in: front end).

The stats are the bytes waiting in the binary store, each worker's figures and the patching
sweeps running in this API process; the workers' figures are at most a second old, one worker
call serving every GET meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_lens.common.messages import StatsAnswer, read_all
from vllm_lens.frontend.async_engine import model_facts
from vllm_lens.frontend.http import routes_patching
from vllm_lens.frontend.http.blob_store import store
from vllm_lens.frontend.rpc import all_workers

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/lens/model")
async def lens_model(raw_request: Request) -> JSONResponse:
    """What a lens request can ask of the served model: its class, layers, widths, heads,
    dtype, the tap points its layout proved and those refused (with the reason), and
    whether every lens request is refused on this engine (``unsupported``)."""
    facts = await model_facts(raw_request.app.state.engine_client)
    return JSONResponse({
        "model_class": facts.model_class, "n_layers": facts.n_layers,
        "hidden_size": facts.hidden_size, "d_mlp": facts.d_mlp, "n_heads": facts.n_heads,
        "n_kv_heads": facts.n_kv_heads, "head_dim": facts.head_dim, "dtype": facts.dtype,
        "max_model_len": facts.max_model_len, "mapped": facts.mapped,
        "derived_layout": facts.derived_layout, "unsupported": facts.unsupported,
        "refused_points": dict(facts.refused_points)})


@router.get("/v1/lens/saes")
async def list_saes(raw_request: Request) -> JSONResponse:
    """The SAEs requests may name (``VLLM_LENS_SAES``): name, layout, architecture, hook
    point, widths and dtype; never a path or weights."""
    saes = await raw_request.app.state.engine_client.registered_saes()
    return JSONResponse({"object": "list", "data": saes})


@router.get("/v1/lens/stats")
async def lens_stats(raw_request: Request) -> JSONResponse:
    workers = read_all(StatsAnswer, await _worker_stats(raw_request.app.state.engine_client))
    return JSONResponse({"store": await asyncio.to_thread(store().stats),
                         "workers": [answer.as_json() for answer in workers],
                         "sweeps": routes_patching.running_sweeps()})


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
