"""Stopping an engine this process started (runs in: the user's process — ``vllm-lens
extract``, its data parallel and Ray variants, and the test harness).

vLLM sends the engine processes SIGTERM, waits ``timeout`` seconds (5 by default), then
force-kills what is left, walking each process tree with psutil. A tensor parallel engine on
a busy machine can take longer than 5 s to exit, and the walk races with workers that exit
on their own while it runs: ``psutil.NoSuchProcess`` escapes vLLM's shutdown after the job's
work is done. A longer grace period makes the force-kill rare, and a process that vanished
while being killed has stopped, which is all stopping it asked for.
"""

from __future__ import annotations

from typing import Any

#: Seconds an engine may take to exit after SIGTERM before vLLM force-kills it.
GRACE_S = 60.0


def stop_engine(engine: Any) -> None:
    """Shut down ``engine``: an ``LLM``, an ``AsyncLLM`` or an engine-core client (anything
    whose ``shutdown`` takes ``timeout``)."""
    import psutil

    from vllm import LLM

    if isinstance(engine, LLM):
        engine = engine.llm_engine.engine_core
    try:
        engine.shutdown(timeout=GRACE_S)
    except psutil.NoSuchProcess:
        pass
