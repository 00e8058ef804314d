"""Asking an engine's workers to flush their capture sinks (runs in: front end).

Sinks queue examples and write them a shard at a time (``vllm_lens.sinks.shards``); a job
that wants everything on disk before it exits (``vllm-lens extract`` does) calls
``flush_sinks(llm)`` (offline ``LLM`` or ``LLMEngine``) or ``await flush_sinks_async(engine)``
(``AsyncLLM``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_lens.common.messages import FlushAnswer, read_all
from vllm_lens.errors import LensExecutionError

__all__ = ["flush_sinks", "flush_sinks_async"]


def _raise_problems(answers: Sequence[Any]) -> None:
    problems = [p for answer in read_all(FlushAnswer, answers) for p in answer.problems]
    if problems:
        raise LensExecutionError("vllm-lens: flushing the capture sinks failed: "
                                 + "; ".join(problems))


def flush_sinks(llm: Any) -> None:
    """Write every example queued in the engine's capture sinks; returns once it is on disk.

    Sinks are the operator's (``VLLM_LENS_SINKS``, read when the workers start); requests
    name one in ``extra_args["capture_sink"]``. On an engine without sinks this does
    nothing.

    Args:
        llm: an offline ``vllm.LLM`` or ``LLMEngine`` with vllm-lens loaded (anything with
            ``collective_rpc``); every worker flushes.

    Returns:
        ``None``, once every worker's queued examples are written.

    Raises:
        LensExecutionError: a shard could not be written since the last flush (in the
            background or now; its message names the dataset and the keys that were dropped).

    Examples:
        >>> from vllm_lens import flush_sinks
        >>> flush_sinks(llm) is None  # this engine has no sinks: nothing to write
        True
    """
    _raise_problems(llm.collective_rpc("lens_flush_sinks"))


async def flush_sinks_async(engine: Any) -> None:
    """``flush_sinks`` for an ``AsyncLLM`` (every data-parallel engine's workers).

    Args:
        engine: a running ``vllm.v1.engine.async_llm.AsyncLLM`` with vllm-lens loaded; with
            data parallelism every engine's workers flush.

    Returns:
        ``None``, once every worker's queued examples are written.

    Raises:
        LensExecutionError: a shard could not be written since the last flush (its message
            names the dataset and the keys that were dropped).

    Examples:
        >>> from vllm_lens.frontend.sink_control import flush_sinks_async
        >>> # Skipped: it needs an AsyncLLM (a second engine); run inside its event loop:
        >>> await flush_sinks_async(engine)  # doctest: +SKIP
    """
    from vllm_lens.frontend.rpc import all_workers

    _raise_problems(await all_workers(engine, "lens_flush_sinks"))
