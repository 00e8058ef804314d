"""Streamed completions and chat answers with their lens results: rows on each chunk, the
rest in one extra chunk per choice before ``[DONE]`` (runs in: front end)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lens.errors import CapacityError, LensRequestError
from vllm_lens.frontend.merge import join_streamed
from vllm_lens.frontend.http.errors import error_event
from vllm_lens.frontend.http.results import (
    Transport,
    check_size,
    encode_results,
    tensors_in,
    with_partials,
)
from vllm_lens.frontend.response_scope import ResponseScope

__all__ = ["CHAT", "COMPLETIONS", "DONE", "Endpoint", "Started", "with_activation_chunks"]

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Endpoint:
    """What differs between the completions and chat endpoints' streamed chunks."""

    empty_choice: Mapping[str, Any]


COMPLETIONS = Endpoint(empty_choice={"text": "", "logprobs": None})
CHAT = Endpoint(empty_choice={"delta": {}, "logprobs": None})


class Started:
    """A stream whose first item was already produced; the same items, in order. ``aclose``
    closes the underlying stream whether or not iteration resumed."""

    _NOTHING = object()

    def __init__(self, stream: AsyncGenerator[str, None]) -> None:
        self._stream = stream
        self._first: Any = self._NOTHING

    async def start(self) -> Started:
        try:
            self._first = await self._stream.__anext__()
        except StopAsyncIteration:
            pass
        return self

    def __aiter__(self) -> Started:
        return self

    async def __anext__(self) -> str:
        if self._first is not self._NOTHING:
            item, self._first = self._first, self._NOTHING
            return item
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def with_activation_chunks(
    stream: Started, scope: ResponseScope, n: int, endpoint: Endpoint,
    encode: Transport, stream_rows: bool = False,
) -> AsyncGenerator[str, None]:
    """Pass the stream through, adding one activations chunk per choice before ``[DONE]``;
    with ``stream_rows`` (``stream_activations``), each chunk of a choice also carries the
    rows computed since its previous chunk."""
    header: dict[str, Any] | None = None
    with scope.active():  # the engine requests report their results into this scope
        async with contextlib.aclosing(stream):  # a client gone mid-stream closes vLLM's
            async for item in stream:
                if header is None and item.startswith("data: {"):
                    header = _chunk_header(item)
                if (stream_rows and scope.partial and header is not None
                        and item.startswith("data: {")):
                    try:
                        item = await _with_rows(item, scope, header["id"], encode)
                    # Rows it cannot hold, or too many values for the lists transport: say
                    # so and stop.
                    except (CapacityError, LensRequestError) as exc:
                        yield error_event(exc)
                        yield DONE
                        return  # closing vLLM's stream aborts the request
                if item == DONE and header is not None:
                    for index, results in sorted(with_partials(scope, header["id"],
                                                               n).items()):
                        try:
                            fields = await asyncio.to_thread(encode_results, results, encode)
                        except (CapacityError, LensRequestError) as exc:
                            yield error_event(exc)
                            continue
                        choice = {"index": index, **endpoint.empty_choice,
                                  "finish_reason": None, **fields}
                        yield f"data: {json.dumps({**header, 'choices': [choice]})}\n\n"
                yield item


#: Streamed rows up to this size are encoded on the event loop (a thread hop costs more).
_ENCODE_INLINE_BYTES = 256 << 10


async def _with_rows(item: str, scope: ResponseScope, response_id: str,
                     encode: Transport) -> str:
    """``item`` (one ``data:`` chunk) with the streamed rows of its choices not sent yet."""
    chunk = json.loads(item.removeprefix("data: "))
    added = False
    for choice in chunk.get("choices") or ():
        early = scope.take_partial(response_id, choice.get("index", 0))
        if early:
            joined = join_streamed(early)
            check_size(joined, encode)
            for name, encoder in (("activations", encode.activations),
                                  ("sae_features", encode.results)):
                if (value := joined.get(name)) is not None:
                    # A token's rows: no thread hop; a long prompt's: off the event loop.
                    choice[name] = (encoder(value) if _nbytes(value) <= _ENCODE_INLINE_BYTES
                                    else await asyncio.to_thread(encoder, value))
            added = True
    return f"data: {json.dumps(chunk)}\n\n" if added else item


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a dict of them, or a list of such dicts)."""
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def _chunk_header(item: str) -> dict[str, Any] | None:
    chunk = json.loads(item.removeprefix("data: "))
    if "id" not in chunk:  # an error event
        return None
    return {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
