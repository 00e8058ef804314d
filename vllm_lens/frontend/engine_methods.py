"""Methods vllm-lens adds to ``vllm.LLM`` and ``AsyncLLM`` (runs in: front end).

Each operation is written once as a generator of ``(worker RPC name, args)`` steps that gets
each RPC's per-rank results sent back in and returns the method's result; ``LLM`` drives it
with its blocking ``collective_rpc`` and ``AsyncLLM`` with its awaitable one.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

from vllm_lens.frontend.session import LensSession
from vllm_lens.frontend.rpc import all_workers

__all__ = ["Steps", "drive", "drive_async", "install_methods"]

#: One step: (worker RPC name, args); the RPC's per-rank results are sent back in.
Steps = Generator[tuple[str, tuple[Any, ...]], list[Any], Any]


def _session(engine: Any) -> LensSession:
    session = LensSession.of(engine)
    if not session.model_names:
        config = engine.model_config
        served = config.served_model_name
        session.model_names = (config.model, *([served] if isinstance(served, str)
                                               else served or ()))
    return session


def drive(engine: Any, steps: Steps) -> Any:
    """Run ``steps`` on an offline engine (``LLMEngine``), each RPC by its
    ``collective_rpc``; returns what they return."""
    try:
        rpc, rpc_args = next(steps)
        while True:
            rpc, rpc_args = steps.send(engine.collective_rpc(rpc, args=rpc_args))
    except StopIteration as stop:
        return stop.value


async def drive_async(engine: Any, steps: Steps) -> Any:
    """Run ``steps`` on an ``AsyncLLM``, each RPC on every worker of every engine."""
    try:
        rpc, rpc_args = next(steps)
        while True:
            rpc, rpc_args = steps.send(await all_workers(engine, rpc, tuple(rpc_args)))
    except StopIteration as stop:
        return stop.value


def _sync_method(name: str, steps_fn: Callable[..., Steps], doc: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self.llm_engine
        return drive(engine, steps_fn(_session(engine), *args, **kwargs))

    method.__name__ = name
    method.__doc__ = doc
    return method


def _async_method(name: str, steps_fn: Callable[..., Steps], doc: str) -> Any:
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await drive_async(self, steps_fn(_session(self), *args, **kwargs))

    method.__name__ = name
    method.__doc__ = doc
    return method


def install_methods(methods: Mapping[str, Callable[..., Steps]], where: str) -> None:
    """Add each ``name -> steps function(session, *args)`` to ``LLM`` and ``AsyncLLM`` (unless
    present); ``where`` names the module documenting them."""
    from vllm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM

    for name, steps_fn in methods.items():
        doc = f"vllm-lens: {name} (see {where})."
        if not hasattr(LLM, name):
            setattr(LLM, name, _sync_method(name, steps_fn, doc))
        if not hasattr(AsyncLLM, name):
            setattr(AsyncLLM, name, _async_method(name, steps_fn, doc))
