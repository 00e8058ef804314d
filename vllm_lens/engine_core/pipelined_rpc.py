"""A worker RPC that does not hold up the engine's next step (runs in: engine core).

The front end calls it by name through vLLM's utility channel.

``AsyncLLM.collective_rpc`` makes the engine core send the call to its workers and wait for
their answers before it schedules the next step. For a call made once per step
(``lens_fetch_partial`` for streamed rows) that wait sits on the engine's critical path: two
message-queue round trips per step instead of one. ``lens_pipelined_rpc`` sends the call the
same way but hands vLLM's utility handler the executor's future, which answers the front end
once the workers' reply has been read: the engine core goes straight on to its next step, and
the workers, which take calls in order, run this one before that step, exactly where the
blocking call would have run.

A multiprocess executor resolves such a future when the engine core next reads a reply (the
next step's; vLLM steps, and reads the reply, whenever it has requests, even for a step that
schedules nothing): so the call is pipelined only while the engine has requests and is neither
paused nor asleep. Should the engine go idle first anyway, the idle callback vLLM runs before
it waits for input reads the reply. Otherwise the call blocks as ``collective_rpc`` does, and
so it does with any other executor: the in-process one (vLLM's default for one GPU) runs the
call in the engine core's thread, with no message-queue round trip to save; Ray's executors,
including the one built on the multiprocess executor, were not tested.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["METHOD", "install"]

#: The engine-core method's name, for ``call_utility_async``.
METHOD = "lens_pipelined_rpc"


def install() -> None:
    """Give vLLM's ``EngineCore`` the method (only where vLLM's engine core is loaded)."""
    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None and not hasattr(core.EngineCore, METHOD):
        setattr(core.EngineCore, METHOD, _pipelined_rpc)


def _pipelined_rpc(self: Any, method: str, args: list[Any]) -> Any:
    """``collective_rpc(method, args)`` on this engine's workers, answered without blocking
    the engine's loop where that is safe (see the module docstring)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    executor = self.model_executor
    steps_ahead = (self.scheduler.has_requests() and not self.is_scheduler_paused()
                   and not executor.is_sleeping)
    # Exactly vLLM's multiprocess executor: its subclasses (Ray's V2 executor) are untested.
    if not (steps_ahead and type(executor) is MultiprocExecutor):
        return executor.collective_rpc(method, args=tuple(args))
    future = executor.collective_rpc(method, args=tuple(args), non_block=True)
    if not self.__dict__.get(_WATCHING):
        self._idle_state_callbacks.append(_read_pending)  # vLLM drops it once it has run
        setattr(self, _WATCHING, True)
    # Reading the latest reply reads every earlier one first; once read, it is let go.
    setattr(self, _PENDING, future)
    future.add_done_callback(lambda done: _let_go(self, done))
    return future


_PENDING = "_vllm_lens_pipelined_future"
_WATCHING = "_vllm_lens_pipelined_watch"


def _let_go(core: Any, future: Any) -> None:
    if core.__dict__.get(_PENDING) is future:
        core.__dict__.pop(_PENDING, None)


def _read_pending(core: Any) -> None:
    """Idle callback: read the reply of the latest pipelined call, if no step has."""
    core.__dict__[_WATCHING] = False
    future = core.__dict__.pop(_PENDING, None)
    if future is not None and not future.done():
        try:
            future.result()
        except Exception:  # noqa: BLE001 - the call's own utility callback reports it
            pass
