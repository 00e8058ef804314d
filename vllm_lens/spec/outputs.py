"""Where captured rows go besides the final output: ``capture_sink`` (an operator's dataset)
and ``stream_activations`` (rows with every streamed output) (runs in: front end)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, SinkRefusedError, UnsupportedConfigError
from vllm_lens.common.positions import parse_selector
from vllm_lens.sinks import check_sink
from vllm_lens.sinks.config import SinkSpec
from vllm_lens.sinks.config import configured as configured_sinks
from vllm_lens.sinks.config import serves_http as sinks_serve_http
from vllm_lens.spec.capture import CaptureSpec
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.keys import ACTIVATIONS_KEY, CAPTURE_KEY, QK_KEY, SAE_KEY, SINK_KEY, STREAM_KEY


def parse_sink(raw: Any, captures: tuple[CaptureSpec, ...], facts: ModelFacts,
               request_id: str | None, saes: tuple[Any, ...] = ()) -> SinkSpec:
    """``capture_sink``: a configured sink, a valid dataset name and key; the captures and
    SAE features it writes must form one example (the same layers, positions and reduction
    for every point; features at the rows' positions, unreduced), and under tensor
    parallelism TP rank 0 must hold all of their rows (under pipeline parallelism each stage
    writes its own layers' part)."""
    if not captures and not saes:
        raise LensRequestError(SINK_KEY, f"asks for captured rows, but the request captures "
                               f"nothing (add {CAPTURE_KEY}, {ACTIVATIONS_KEY}, {SAE_KEY} or "
                               f"{QK_KEY})", request_id=request_id)
    try:
        sinks = configured_sinks()
    except ValueError as exc:
        raise LensRequestError(SINK_KEY, f"the operator's sink configuration is invalid: {exc}",
                               request_id=request_id) from None
    try:
        sink = SinkSpec.parse(raw, sinks)
    except ValueError as exc:
        sub, problem = exc.args
        raise LensRequestError(f"{SINK_KEY}.{sub}" if sub else SINK_KEY, problem,
                               request_id=request_id) from None
    config = sinks[sink.sink]
    if sinks_serve_http() and not config.clients:
        raise SinkRefusedError(
            f"{SINK_KEY}.sink", f"sink {sink.sink!r} is not open to HTTP clients (its operator "
            'sets "clients": true in its VLLM_LENS_SINKS entry to allow that)',
            request_id=request_id)
    try:
        check_sink(config)
    except (KeyError, ValueError, TypeError) as exc:
        raise LensRequestError(f"{SINK_KEY}.sink", f"sink {sink.sink!r} is misconfigured by "
                               f"the operator: {exc}", request_id=request_id) from None
    _check_one_example(captures, saes, request_id)
    sharded = [c.signal for c in captures if c.signal in tap_points.SHARDED]
    if sharded and facts.tp_size > 1:
        raise UnsupportedConfigError(
            SINK_KEY, f"is refused for {', '.join(sharded)} under tensor parallelism "
            f"(tensor_parallel_size={facts.tp_size}): their rows are split across the ranks "
            "and no rank writes the others'; return them instead", request_id=request_id)
    # Each data-parallel engine, and each pipeline stage (its own layers' rows), writes the
    # dataset as a named writer of its own (``worker.sink_writes.writer_name``).
    sink = dataclasses.replace(sink, shared=facts.dp_size > 1 or facts.pp_size > 1)
    if facts.pp_size > 1:
        sink = dataclasses.replace(sink, dtype=facts.dtype, row_shapes={
            c.signal: facts.row_shape(c.signal, c.layers) for c in captures})
    return sink


def _check_one_example(captures: tuple[CaptureSpec, ...], saes: tuple[Any, ...],
                       request_id: str | None) -> None:
    """A sink example has one set of rows: every point at the same layers, positions and
    reduction, and every SAE's features at those positions, one per row."""
    first = captures[0] if captures else None
    for other in captures[1:]:
        for name in ("layers", "positions", "reduce"):
            if getattr(other, name) != getattr(first, name):
                raise LensRequestError(
                    SINK_KEY, f"writes one example per request, so every captured point needs "
                    f"the same {name}: {first.signal} has {getattr(first, name)!r}, "
                    f"{other.signal} {getattr(other, name)!r}", request_id=request_id)
    if not saes:
        return
    if first is not None and first.reduce is not None:
        raise LensRequestError(
            SINK_KEY, f"writes SAE features per position, but {first.signal} is reduced "
            f"({first.reduce!r}) to one row; drop reduce, or write the features to another "
            "dataset", request_id=request_id)
    positions = first.positions if first is not None else saes[0].positions
    for i, spec in enumerate(saes):
        if spec.positions != positions:
            raise LensRequestError(
                SINK_KEY, f"writes one example per request, so {SAE_KEY} entry {i} "
                f"({spec.sae}) needs the rows' positions {positions!r}, not "
                f"{spec.positions!r}", request_id=request_id)


def parse_stream(raw: Any, captures: tuple[CaptureSpec, ...], sink: SinkSpec | None,
                 request_id: str | None, saes: tuple[Any, ...] = ()) -> bool:
    """``stream_activations``: ``true`` streams each capture's rows (and SAE features) as
    they are computed, which needs their final positions to be known then (no reduction, no
    window counted from the end of the generation)."""
    # vllm_xargs carries JSON true as 1 (its values are str | int | float), or "true".
    if raw is None or (not isinstance(raw, float) and raw in (False, "false", "0")):
        return False
    if isinstance(raw, float) or raw not in (True, "true", "1"):
        raise LensRequestError(STREAM_KEY, f"must be true or false, got {raw!r}",
                               request_id=request_id)
    if not captures and not saes:
        raise LensRequestError(STREAM_KEY, f"asks for captured rows, but the request captures "
                               f"nothing (add {CAPTURE_KEY}, {ACTIVATIONS_KEY}, {SAE_KEY} or "
                               f"{QK_KEY})", request_id=request_id)
    if sink is not None:
        raise LensRequestError(STREAM_KEY, f"cannot be combined with {SINK_KEY} (the rows go "
                               "to the sink, not to the caller)", request_id=request_id)
    named = [(c.signal, c) for c in captures]
    named += [(f"{SAE_KEY} entry {i} ({spec.sae})", spec.capture()) for i, spec in enumerate(saes)]
    for label, c in named:
        if c.reduce is not None:
            raise LensRequestError(STREAM_KEY, f"streams rows as they are computed, but "
                                   f"{label} is reduced ({c.reduce!r}) over positions only "
                                   "known at the end; drop reduce", request_id=request_id)
        if isinstance(c.positions, str):
            selector = parse_selector(c.positions)
            if selector is not None and selector.needs_end:
                raise LensRequestError(
                    STREAM_KEY, f"streams rows as they are computed, but {label}'s "
                    f"positions {c.positions!r} are counted from the end of the generation, "
                    "known only when it stops", request_id=request_id)
    return True
