"""Which lens results (activations, hook results) belong to which choice of one HTTP response (runs
in: front end).

vLLM's serving classes turn ``RequestOutput`` objects into OpenAI responses deep inside their
own code, and a completions request with several prompts runs one engine request per prompt.
Rather than re-implement those classes, the server wrapper opens a ``ResponseScope`` around one
HTTP request; the ``AsyncLLM.generate`` wrapper, which attaches lens results to each finished
output, also reports them to the scope that is current in its context (``contextvars`` follow
the tasks vLLM spawns). The wrapper then places them on the response's choices.

Engine request ids are what vLLM's serving code makes of the response id ``R``: ``R`` itself
(chat), ``f"{R}-{i}"`` (completions, prompt ``i``) or ``f"{R}_{i}"``. Choice ``i * n + c``
belongs to completion ``c`` of prompt ``i``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

__all__ = ["ResponseScope", "current", "lens_route", "on_lens_route", "report",
           "report_partial"]

#: What ``LensSession.attach`` found for one completion: ``activations``, ``hook_results``.
Results = Mapping[str, Any]

_current: ContextVar[ResponseScope | None] = ContextVar("vllm_lens_response_scope", default=None)
#: Set while a route that returns what lens keys ask for is served without a scope of its own
#: (``patching_sweep``). In an API process, lens keys reaching the engine on any other route
#: (``/v1/responses``, transcriptions ...) are refused: the route would drop their results.
_lens_route: ContextVar[bool] = ContextVar("vllm_lens_route", default=False)


@contextlib.contextmanager
def lens_route() -> Iterator[None]:
    """Mark the requests sent inside the block as coming from a lens-aware route."""
    token = _lens_route.set(True)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _lens_route.reset(token)


def on_lens_route() -> bool:
    """Whether the request being served came by a route that returns lens results."""
    return _lens_route.get() or _current.get() is not None


def current() -> ResponseScope | None:
    """The scope of the HTTP request being served in this context, if any."""
    return _current.get()


def report(request_id: str, by_index: Mapping[int, Results]) -> None:
    """Record a finished request's lens results (completion index -> dict) in the current
    scope, if any."""
    scope = _current.get()
    if scope is not None:
        scope.found[request_id] = dict(by_index)


def report_partial(request_id: str, rows: Results) -> None:
    """Record rows of a streamed request (``stream_activations``, n == 1: its
    ``activations`` and ``sae_features``) in the current scope, if any; the server sends
    them with the next chunk of its choice."""
    scope = _current.get()
    if scope is not None:
        scope.partial.setdefault(request_id, []).append(rows)


class ResponseScope:
    """The lens results reported while one HTTP request was being served."""

    def __init__(self, parsed_from: Mapping[str, Any] | None = None,
                 parsed: Any = None) -> None:
        self.found: dict[str, dict[int, Results]] = {}
        """Engine request id -> completion index -> results."""
        self.parsed_from = parsed_from
        """The ``vllm_xargs`` the server validated, and ``parsed``, the ``LensRequest`` made of
        them: the engine wrapper reuses it instead of parsing the same values again."""
        self.parsed = parsed
        self.partial: dict[str, list[Results]] = {}
        """Engine request id -> streamed rows not sent yet, oldest first."""
        self.refused: Exception | None = None
        """A ``LensRequestError`` the engine wrapper raised for one of this response's
        requests (admission needs the tokenized prompt, which only the engine sees)."""

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the scope that ``report`` writes to, in this context and tasks it spawns."""
        token = _current.set(self)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):  # reset from another context (a stream)
                _current.reset(token)

    def take_partial(self, response_id: str, choice: int) -> list[Results]:
        """Remove and return the streamed rows not sent yet of ``choice`` (``n == 1``, so
        choice ``i`` is prompt ``i``)."""
        for request_id in list(self.partial):
            if _prompt_index(response_id, request_id) == choice:
                return self.partial.pop(request_id)
        return []

    def by_choice(self, response_id: str, n: int) -> dict[int, Results]:
        """Map the response's choice indices to their results (``n`` choices per prompt)."""
        choices: dict[int, Results] = {}
        for request_id, per_completion in self.found.items():
            prompt = _prompt_index(response_id, request_id)
            if prompt is None:
                continue
            for index, acts in per_completion.items():
                choices[prompt * n + index] = acts
        return choices


def _prompt_index(response_id: str, request_id: str) -> int | None:
    if request_id == response_id:
        return 0
    head, suffix = request_id[: len(response_id)], request_id[len(response_id):]
    if head != response_id or suffix[:1] not in ("-", "_") or not suffix[1:].isdigit():
        return None
    return int(suffix[1:])

