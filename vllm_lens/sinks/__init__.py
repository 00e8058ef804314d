"""Capture sinks: where a request's rows go when it asks to write them instead of returning them
(runs in: front end, worker).

The front end checks sinks; the workers write to them.

A sink kind is a factory published in the entry-point group ``vllm_lens.sinks``, called with
the operator's ``SinkConfig`` and returning a ``Sink``. vllm-lens ships ``safetensors``
(``sinks.shards``: the dataset format of ``vllm_lens.dataset.writer``); any installed package
can add one for its storage::

    [project.entry-points."vllm_lens.sinks"]
    my_store = "my_package.sinks:make_sink"

The worker that holds a finished request's rows (TP rank 0; under pipeline parallelism, TP
rank 0 of each stage, with its part of the example) calls ``Sink.write`` with one ``Example``
and hands the returned receipt (small, JSON-able) back to the front end, which attaches it
(the stages' joined) to the response in place of the rows. Under data or pipeline
parallelism several processes write one dataset at once, each as its own ``Example.writer``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from vllm_lens.sinks.config import SinkConfig, SinkSpec, configured
from vllm_lens.sinks.interface import Example, Sink

__all__ = ["ENTRY_POINT_GROUP", "Example", "Sink", "SinkConfig", "SinkSpec", "check_sink",
           "configured", "load_kind"]

ENTRY_POINT_GROUP = "vllm_lens.sinks"


@functools.cache
def _kinds() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_kind(kind: str) -> Callable[[SinkConfig], Sink]:
    """The factory of sink kind ``kind``; ``KeyError`` lists the installed kinds."""
    found = _kinds().get(kind)
    if found is None:
        if kind == "safetensors":  # running from a source tree without entry points
            from vllm_lens.sinks.shards import ShardSink

            return ShardSink
        raise KeyError(f"no sink kind {kind!r}; installed: {', '.join(sorted(_kinds()))}")
    return found.load()


_checked: set[str] = set()


def check_sink(config: SinkConfig) -> None:
    """Check that ``config``'s kind is installed and accepts its options (by building the sink
    once, in the front end, before a request is sent to it; a sink does nothing until its
    first write). Raises ``KeyError`` / ``ValueError`` / ``TypeError`` naming the problem."""
    import json

    ident = json.dumps([config.name, config.kind, config.root, dict(config.options)],
                       sort_keys=True, default=str)
    if ident not in _checked:
        sink = load_kind(config.kind)(config)
        close = getattr(sink, "close", None)
        if close is not None:
            close()
        _checked.add(ident)
