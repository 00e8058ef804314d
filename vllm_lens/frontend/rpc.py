"""Reaching every worker of an ``AsyncLLM``, data-parallel engines included (runs in: front end).

``AsyncLLM.collective_rpc`` answers with one engine's workers only when vLLM balances
requests over several data-parallel engines itself (``DPLBAsyncMPClient``: it calls every
engine and keeps engine 0's answer). A request's rows live on the engine that served it, so
vllm-lens asks every engine and joins their workers' answers.

``pipelined`` is the same call routed through the engine core's ``lens_pipelined_rpc``
(``vllm_lens.engine_core.pipelined_rpc``), which does not make the engine wait for the answer before its
next step: for calls made once per step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_lens.engine_core import pipelined_rpc

__all__ = ["all_workers", "pipelined"]


async def all_workers(engine: Any, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
    """``collective_rpc(method, args=args)`` on every worker of every engine of ``engine``."""
    core = getattr(engine, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    if call_all is not None and len(getattr(core, "core_engines", ())) > 1:
        per_engine = await call_all("collective_rpc", method, None, args, None)
        return [answer for answers in per_engine for answer in answers]
    return await engine.collective_rpc(method, args=args)


async def pipelined(engine: Any, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
    """``all_workers(engine, method, args)`` without holding up the engines' next steps.

    Its answer waits for the engine's next step, and vLLM does not fail a pending utility call
    when its engine dies: so the wait also ends, with vLLM's ``EngineDeadError``, once the
    engine is found dead (checked every ``_DEAD_CHECK_S``).
    """
    core = engine.engine_core
    several = len(getattr(core, "core_engines", ())) > 1
    call = core.call_utility_all_async if several else core.call_utility_async
    task = asyncio.ensure_future(call(pipelined_rpc.METHOD, method, args))
    try:
        while not (await asyncio.wait((task,), timeout=_DEAD_CHECK_S))[0]:
            if getattr(engine, "errored", False):
                raise engine.dead_error
    finally:
        task.cancel()  # a no-op once it is done
    answers = task.result()
    return [answer for per_engine in answers for answer in per_engine] if several else answers


_DEAD_CHECK_S = 1.0

