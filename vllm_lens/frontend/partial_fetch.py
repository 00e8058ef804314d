"""One ``lens_fetch_partial`` per engine step for every streamed request (runs in: front end).

On the ``AsyncLLM`` event loop.

A request with ``stream_activations`` needs the rows computed since its previous output with
each output. vLLM hands the outputs of one step to their requests' generators in one pass of
its output handler, so the generators asking for rows wake in the same turn of the event
loop: the first one to ask schedules a fetch that waits one turn, and every request that asked
by then is fetched in that one collective RPC instead of one each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from vllm_lens.common import handoff
from vllm_lens.common.messages import FetchAnswer

__all__ = ["PartialFetcher"]


class PartialFetcher:
    """Coalesces the partial fetches of one engine's streamed requests.

    ``rpc(requests)`` runs ``lens_fetch_partial`` on every worker with these
    ``(lens key, {request id prefix: positions})`` and returns the workers' answers, read
    (``common.messages.read_all``).
    """

    def __init__(self, rpc: Callable[[list[tuple[str, dict[str, int]]]],
                                     Awaitable[list[FetchAnswer]]]) -> None:
        self._rpc = rpc
        self._waiting: list[tuple[str, dict[str, int], asyncio.Future]] = []
        self._scheduled = False

    async def fetch(self, key: str, below: dict[str, int]) -> list[FetchAnswer]:
        """The workers' answers for lens key ``key`` alone (one per worker)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((key, below, future))
        if not self._scheduled:
            self._scheduled = True
            task = asyncio.ensure_future(self._run())
            _background.add(task)
            task.add_done_callback(_background.discard)
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled after its answer arrived but before it ran again: nobody reads the
            # rows, so their hand-off files go now rather than at the next worker start.
            if future.done() and not future.cancelled() and future.exception() is None:
                for part in future.result():
                    handoff.discard_fetched(part)
            raise

    async def _run(self) -> None:
        await asyncio.sleep(0)  # the other generators woken by this step ask meanwhile
        waiting, self._waiting, self._scheduled = self._waiting, [], False
        try:
            answers = await self._rpc([(key, below) for key, below, _ in waiting])
        except BaseException as exc:  # noqa: BLE001 - each waiting request fails with it
            for _, _, future in waiting:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception)
                                         else RuntimeError(repr(exc)))
            return
        for key, _, future in waiting:
            mine = [answer.only(key) for answer in answers]
            if future.done():  # its request was cancelled meanwhile: nobody reads its rows
                for part in mine:
                    handoff.discard_fetched(part)
            else:
                future.set_result(mine)


_background: set[asyncio.Task] = set()
