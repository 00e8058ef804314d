"""Stopping an engine this process started (runs in: caller, front end).

Used by ``vllm-lens extract``, its data parallel and Ray variants, and the test harness.

vLLM sends the engine processes SIGTERM, waits ``timeout`` seconds (5 by default), then
force-kills what is left, walking each process tree with psutil. A tensor parallel engine on
a busy machine can take longer than 5 s to exit, and the walk races with workers that exit
on their own while it runs: ``psutil.NoSuchProcess`` escapes vLLM's shutdown after the job's
work is done, with the rest of the kill and of the clean-up (sockets, the coordinator, an
``AsyncLLM``'s output task) skipped. Then what is left is killed here and the clean-up run.
vLLM's grace period is kept: a longer one (60 s, tried) left an engine that never exits on
SIGTERM waiting the whole time (a test's teardown took 61 s).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

__all__ = ["GRACE_S", "stop_engine"]

#: Seconds an engine may take to exit after SIGTERM before vLLM force-kills it (vLLM's own
#: default).
GRACE_S = 5.0


def stop_engine(engine: Any) -> None:
    """Shut down ``engine``: an ``LLM``, an ``AsyncLLM`` or an engine-core client (anything
    whose ``shutdown`` takes ``timeout``)."""
    llm_engine = getattr(engine, "llm_engine", None)  # an LLM: stop its engine-core client
    target = llm_engine.engine_core if llm_engine is not None else engine
    try:
        target.shutdown(timeout=GRACE_S)
    except psutil.NoSuchProcess:
        handler = getattr(target, "output_handler", None)  # an AsyncLLM
        finish_shutdown(target.engine_core if hasattr(target, "output_handler") else target)
        if handler is not None:
            from vllm.utils.async_utils import cancel_task_threadsafe

            cancel_task_threadsafe(handler)


def finish_shutdown(client: Any) -> None:
    """After vLLM's shutdown of an engine-core ``client`` stopped part way: kill every
    process it started that is still alive (with their children), then release its sockets
    and background tasks (vLLM's process manager is already marked shut down, so this does
    not wait for it again)."""
    resources = getattr(client, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    for proc in getattr(manager, "processes", ()):
        if proc.is_alive() and proc.pid is not None:
            kill_tree(proc.pid)
            proc.join(GRACE_S)
    if resources is not None:
        resources()


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants; any of them may be gone already."""
    try:
        parent = psutil.Process(pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
