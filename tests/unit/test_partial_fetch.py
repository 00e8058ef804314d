"""The coalescer of streamed requests' fetches: requests that ask in the same turn of the
event loop share one RPC, each gets only its own rows, and a failure reaches all of them."""

import asyncio

import pytest

from vllm_lens.common.messages import FetchAnswer, FetchPart
from vllm_lens.frontend.partial_fetch import PartialFetcher


def _answer(parts):
    """A worker's ``lens_fetch_partial`` answer: lens key -> {request id: captures}."""
    return FetchAnswer(requests={key: {req_id: FetchPart.rows(captures)
                                       for req_id, captures in by_id.items()}
                                 for key, by_id in parts.items()})


def _mark(**values):
    """Captures that say where they came from."""
    return {name: str(value).encode() for name, value in values.items()}


def test_requests_asking_together_share_one_rpc_and_get_their_own_rows():
    calls = []

    async def rpc(requests):
        calls.append(requests)
        return [_answer({key: {"": _mark(rank=rank, key=key)} for key, _ in requests})
                for rank in range(2)]

    async def main():
        fetcher = PartialFetcher(rpc)
        first = await asyncio.gather(*(fetcher.fetch(k, {"": i}) for i, k in enumerate("abc")))
        later = await fetcher.fetch("d", {"": 9})
        return first, later

    first, later = asyncio.run(main())
    assert calls == [[("a", {"": 0}), ("b", {"": 1}), ("c", {"": 2})], [("d", {"": 9})]]
    assert first[1] == [_answer({"b": {"": _mark(rank=0, key="b")}}),
                        _answer({"b": {"": _mark(rank=1, key="b")}})]
    assert later == [_answer({"d": {"": _mark(rank=0, key="d")}}),
                     _answer({"d": {"": _mark(rank=1, key="d")}})]


def test_a_failed_rpc_fails_every_waiting_request():
    async def rpc(requests):
        raise RuntimeError("engine gone")

    async def main():
        fetcher = PartialFetcher(rpc)
        return await asyncio.gather(fetcher.fetch("a", {"": 1}), fetcher.fetch("b", {"": 1}),
                                    return_exceptions=True)

    results = asyncio.run(main())
    assert [str(r) for r in results] == ["engine gone", "engine gone"]


def test_a_cancelled_request_does_not_stop_the_others(monkeypatch):
    discarded = []
    monkeypatch.setattr("vllm_lens.common.handoff.discard_fetched", discarded.append)
    release = None

    async def rpc(requests):
        await release.wait()
        return [_answer({key: {"": {}} for key, _ in requests})]

    async def main():
        nonlocal release
        release = asyncio.Event()
        fetcher = PartialFetcher(rpc)
        a = asyncio.ensure_future(fetcher.fetch("a", {"": 1}))
        b = asyncio.ensure_future(fetcher.fetch("b", {"": 1}))
        await asyncio.sleep(0.01)
        a.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await a
        return await b

    assert asyncio.run(main()) == [_answer({"b": {"": {}}})]
    assert discarded == [_answer({"a": {"": {}}})]  # the cancelled request's rows are deleted


def test_a_request_cancelled_after_its_answer_arrived_discards_its_rows(monkeypatch):
    """The answer is set, then the waiter is cancelled before it runs again (a client gone
    right after its partial fetch): its hand-off files are deleted, not left until the next
    worker start."""
    discarded = []
    monkeypatch.setattr("vllm_lens.common.handoff.discard_fetched", discarded.append)
    waiter = []

    async def rpc(requests):
        # Runs before the answer is set and the waiter woken: the cancel lands in between.
        asyncio.get_running_loop().call_soon(waiter[0].cancel)
        return [_answer({key: {"": _mark(file=key)} for key, _ in requests})]

    async def main():
        fetcher = PartialFetcher(rpc)
        waiter.append(asyncio.ensure_future(fetcher.fetch("a", {"": 1})))
        with pytest.raises(asyncio.CancelledError):
            await waiter[0]

    asyncio.run(main())
    assert discarded == [_answer({"a": {"": _mark(file="a")}})]
