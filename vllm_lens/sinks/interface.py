"""What a capture sink receives and what it must do: ``Example`` and the ``Sink`` protocol, shared
by the sinks vllm-lens ships and any installed package's (runs in: front end, worker).

The package ``vllm_lens.sinks`` hands both names on; a sink module imports them from here, so
that the package may load the sinks it ships without an import running back into itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["Example", "Sink"]


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
