"""Capture sinks: where a request's rows go when it asks to write them instead of returning
them (runs in: worker; ``sinks.config`` also in the front end).

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

import torch

from vllm_lens.sinks.config import SinkConfig, SinkSpec, configured

__all__ = ["ENTRY_POINT_GROUP", "Example", "Sink", "SinkConfig", "SinkSpec", "check_sink",
           "configured", "load_kind"]

ENTRY_POINT_GROUP = "vllm_lens.sinks"


@dataclass
class Example:
    """One request's rows, as a sink receives them."""

    key: str
    rows: Mapping[str, torch.Tensor]
    """Point -> ``[n_layers, n_rows, *row]`` (a reduced capture has ``n_rows == 1``), on
    the host, in the model's dtype. They may view memory the worker reuses for later steps
    once nothing refers to it (``worker.staging_pool``): a sink keeps these tensors (or
    copies) for as long as it reads them, never only their storage's address."""
    positions: Sequence[int]
    """Token position of each row (a reduced capture: the positions reduced into its row)."""
    reduced: bool
    prompt_token_ids: Sequence[int]
    token_ids: Sequence[int]
    """The generated tokens (the last one has no rows: it was never run through the model)."""
    settings: Mapping[str, Any]
    """What a dataset of such examples holds, for its manifest: ``model``, ``points``,
    ``layers``, ``dtype``, ``row_shapes``, ``positions`` (the selector), ``reduce`` and, if
    it reads SAE features, ``sae_features`` (per SAE: ``sae``, ``point``, ``layer``,
    ``d_sae``, ``top_k``, ``reconstruction``); examples with other settings do not belong in
    the same dataset."""
    sae_features: Sequence[Mapping[str, torch.Tensor]] = ()
    """Per ``settings["sae_features"]`` entry, one value per row (the rows' positions; with
    no point captured, the positions above): ``indices`` int32 ``[n_rows, top_k]`` (-1 where
    fewer were active), ``values`` float32 ``[n_rows, top_k]``, and with ``reconstruction``
    ``nmse`` float32 and ``l0`` int32 ``[n_rows]``."""
    writer: str | None = None
    """Who writes it: ``None`` for the dataset's only writer, else a name of this process's
    own (a data-parallel engine, a pipeline stage, an engine given ``VLLM_LENS_SINK_WRITER``)
    that other writers of the same dataset do not share."""
    layers: Sequence[int] | None = None
    """A part of an example (a pipeline stage holds only its own layers): the settings'
    layers ``rows`` hold, in order; ``None``: all of them."""
    sae_entries: Sequence[int] | None = None
    """A part of an example: the numbers of the settings' ``sae_features`` entries
    ``sae_features`` holds, in order; ``None``: all of them."""


class Sink(Protocol):
    def write(self, dataset: str, example: Example) -> dict[str, Any]:
        """Store ``example`` in ``dataset`` (created on first use); returns the receipt.

        Raises to fail the request alone (its message reaches the caller)."""

    def flush(self) -> list[str]:
        """Make everything written so far durable; returns what failed (messages)."""

    def close(self) -> None:
        """Flush and let go of every dataset."""


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
