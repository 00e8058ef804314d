"""Steering-preset route calls shared by the API server processes of one server (runs in: front
end).

Each API server process (``--api-server-count N``) keeps its presets in memory, and a
``/v1/steering/register`` or ``/unregister`` call reaches one of them. With several, such a
call is applied where it lands and appended to a log in the server's shared directory
(``http.shared_dir``); every process applies the calls it has not seen, in the log's
order, before it lists presets, changes them or parses a request that selects one. The log
is held under a lock file while a call is applied and appended, so calls made through
different processes are applied in one order everywhere. A line is taken only once complete;
a call that fails where it is replayed (it succeeded where it was made) is logged and
skipped, never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, BinaryIO

from vllm_lens.frontend.http.shared_dir import server_dir

__all__ = ["append", "configure", "held", "replay", "sync"]

logger = logging.getLogger(__name__)

_NAME = "steering-presets.jsonl"
_processes = 1
_replayed = 0
"""Bytes of the log this process has applied."""
_local = asyncio.Lock()


def configure(api_server_count: int | None) -> None:
    """How many API server processes this server runs (from its arguments)."""
    global _processes
    _processes = api_server_count or 1


@contextlib.asynccontextmanager
async def held() -> AsyncIterator[BinaryIO | None]:
    """The log, held against the other processes (``None`` with one API process)."""
    if _processes <= 1:
        yield None
        return
    async with _local:
        with open(server_dir() / _NAME, "a+b") as log:
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


async def replay(engine: Any, log: BinaryIO) -> None:
    """Apply the complete lines past what this process applied."""
    global _replayed
    log.seek(_replayed)
    data = log.read()
    for line in data[:data.rfind(b"\n") + 1].splitlines(keepends=True):
        try:
            call = json.loads(line)
            await getattr(engine, call["method"])(*call["args"])
        except Exception as exc:  # noqa: BLE001 - skipped here, applied where it was made
            logger.warning("vllm-lens: a steering preset change made through another API "
                           "process could not be applied here (skipped): %s", exc)
        finally:
            # Counted once applied: until then a request's ``sync`` does not take the log
            # for seen (it waits for this replay instead of parsing without the preset).
            _replayed += len(line)


def append(log: BinaryIO, method: str, args: Sequence[Any]) -> None:
    """Log a call this process applied (raises ``OSError`` if it cannot be written)."""
    global _replayed
    log.seek(0, 2)
    log.write(json.dumps({"method": method, "args": list(args)}).encode() + b"\n")
    log.flush()
    _replayed = log.tell()


async def sync(engine: Any) -> None:
    """Apply what the other processes logged since this one last looked (nothing with one
    API process, and a ``stat`` when nothing changed)."""
    if _processes <= 1:
        return
    path = server_dir() / _NAME
    if not _local.locked() and (not path.exists() or path.stat().st_size == _replayed):
        return  # (a replay or a change in progress here: wait for it below)
    async with held() as log:
        await replay(engine, log)
