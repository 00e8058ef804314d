"""Writing a finished request's rows to the capture sink it named (runs in: worker).

TP rank 0 of each pipeline stage, which holds the rows of the stage's layers and its SAEs'.

Sinks are opened on first use from this process's ``VLLM_LENS_SINKS`` (the engine's
environment) and live as long as the worker. Where several processes write one dataset (the
front end says so: data-parallel engines, pipeline stages; or the operator names the engine,
``VLLM_LENS_SINK_WRITER``), each writes as a named writer of its own, ``dp<rank>-pp<rank>``
(prefixed with ``VLLM_LENS_SINK_WRITER`` and ``-`` when it is set), and a stage writes only
its part of the example.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import logging
import multiprocessing.util
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from vllm_lens import envs
from vllm_lens.sinks import Example, Sink, configured, load_kind
from vllm_lens.spec import LensRequest

__all__ = ["close_all", "flush_all", "write", "writer_name"]

logger = logging.getLogger(__name__)

_open: dict[str, Sink] = {}
_lock = threading.Lock()


def _sink(name: str) -> Sink:
    with _lock:
        found = _open.get(name)
        if found is None:
            config = configured().get(name)
            if config is None:  # the front end checked its own environment, not ours
                raise ValueError(f"sink {name!r} is not configured on this worker "
                                 "(VLLM_LENS_SINKS of the engine's processes)")
            found = _open[name] = load_kind(config.kind)(config)
            if len(_open) == 1:
                # vLLM's worker processes end through multiprocessing, which runs its own
                # finalizers but not atexit's; an in-process worker ends with the interpreter.
                multiprocessing.util.Finalize(None, close_all, exitpriority=100)
                atexit.register(close_all)
        return found


@functools.cache  # reading a distribution's metadata costs ~0.5 ms: not once per example
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "source"


def writer_name(parallel_config: Any, pp_rank: int, shared: bool) -> str | None:
    """This worker's name as a writer of shared datasets, or ``None`` to write alone.

    ``shared`` is the front end's word that the engine writes with several processes. A
    data-parallel engine of a dense model sees ``data_parallel_size`` 1 (vLLM runs its ranks
    independently) but keeps its rank in ``data_parallel_index``; with external load
    balancing each server's front end sees one engine, so its own configuration counts too.
    """
    prefix = envs.sink_writer()
    several = shared or parallel_config.pipeline_parallel_size > 1 or (
        parallel_config.data_parallel_size > 1 or parallel_config.data_parallel_index > 0
        or parallel_config.data_parallel_external_lb or parallel_config.data_parallel_hybrid_lb)
    ranks = f"dp{parallel_config.data_parallel_index}-pp{pp_rank}" if several else None
    return "-".join(filter(None, (prefix, ranks))) or None


def write(lens: LensRequest, captures: Mapping[str, Mapping[str, Any]], model: str,
          prompt_token_ids: Sequence[int], token_ids: Sequence[int], *,
          local_layers: Collection[int] | None = None,
          writer: str | None = None) -> dict[str, Any]:
    """Write one request's assembled captures (signal -> ``capture.assemble`` result), SAE
    features included, as one example (as ``writer``); returns the sink's receipt.

    ``local_layers``: the layers this worker captures (a pipeline stage's), which makes the
    example the stage's part: the requested layers among them, and the SAEs at them.
    ``None``: every layer (the rows of all must be here).
    """
    assert lens.sink is not None
    here = (lambda layers: True) if local_layers is None else (
        lambda layers: bool(set(layers) & set(local_layers)))
    specs = [c for c in lens.captures if here(c.layers)]
    saes = [(i, s) for i, s in enumerate(lens.saes) if here((s.layer,))]
    missing = [c.signal for c in (*specs, *(s.capture() for _, s in saes))
               if c.signal not in captures]
    if missing:
        raise ValueError(f"no position of {', '.join(missing)} was selected: nothing was "
                         "written (a sink example needs rows)")
    if not specs and not saes:
        raise ValueError("this worker holds none of the example's layers: nothing to write")
    first = specs[0] if specs else saes[0][1].capture()
    reduced = first.reduce is not None
    rows: dict[str, torch.Tensor] = {}
    for spec in specs:
        tensor = captures[spec.signal]["tensor"]
        rows[spec.signal] = tensor[:, None] if reduced else tensor
    positions = captures[first.signal]["positions"]
    features = []
    for _, sae in saes:
        found = captures[sae.signal]
        if not torch.equal(found["positions"], positions):  # (the parse made them equal)
            raise ValueError(f"SAE {sae.sae}'s features were read at other positions than "
                             "the rows: nothing was written")
        entry = sae.entry(found["tensor"][0].float(), positions)
        features.append({field: entry[field] for field in ("indices", "values", "nmse", "l0")
                         if field in entry})
    n_rows = positions.numel() if not specs else rows[first.signal].shape[1]
    if n_rows == 0 or positions.numel() == 0:  # (a reduction over none: NaN rows)
        raise ValueError("no position was selected: nothing was written (a sink example "
                         "needs rows)")
    import vllm

    # The settings describe the whole example, also where this stage holds a part of it:
    # what no row here shows comes from the front end (``SinkSpec.row_shapes``, ``dtype``).
    whole = lens.captures[0] if lens.captures else None
    held = [int(x) for x in captures[first.signal]["layers"]] if specs else []
    part = (held != (list(whole.layers) if whole else [])) or len(saes) < len(lens.saes)
    if whole and lens.sink.row_shapes is not None:
        # Every stage writes the front end's dtype and shapes, so that all stages' manifests
        # agree (rows of a point computed in another dtype are cast to it when written, as
        # without pipeline parallelism).
        dtype = str(lens.sink.dtype)
        row_shapes = {c.signal: list(lens.sink.row_shapes[c.signal]) for c in lens.captures}
    else:
        dtype = str(rows[first.signal].dtype).removeprefix("torch.") if specs else "float32"
        row_shapes = {c.signal: list(rows[c.signal].shape[2:]) for c in lens.captures}
    settings = {
        "model": model,
        "vllm_version": vllm.__version__,
        "vllm_lens_version": _version("vllm-lens"),
        "points": [c.signal for c in lens.captures],
        "layers": list(whole.layers) if whole else [],
        "dtype": dtype,
        "row_shapes": row_shapes,
        "positions": first.positions if isinstance(first.positions, str)
        else list(first.positions),
        "reduce": first.reduce,
    }
    if lens.saes:
        settings["sae_features"] = [
            {"sae": s.sae, "point": s.point, "layer": s.layer, "d_sae": s.d_sae,
             "top_k": s.top_k, "reconstruction": s.reconstruction} for s in lens.saes]
    example = Example(key=lens.sink.key, rows=rows, positions=positions.tolist(),
                      reduced=reduced, prompt_token_ids=list(prompt_token_ids),
                      token_ids=list(token_ids), settings=settings, sae_features=features,
                      writer=writer, layers=held if part else None,
                      sae_entries=[i for i, _ in saes] if part else None)
    return _sink(lens.sink.sink).write(lens.sink.dataset, example)


def flush_all() -> list[str]:
    """Flush every open sink; returns what failed."""
    with _lock:
        sinks = list(_open.values())
    return [problem for sink in sinks for problem in sink.flush()]


def close_all() -> None:
    """Flush and close every open sink (at the worker's exit)."""
    with _lock:
        sinks = list(_open.values())
        _open.clear()
    for sink in sinks:
        try:
            sink.close()
        except Exception:  # noqa: BLE001 - at exit: log, and close the others
            logger.exception("vllm-lens: closing a capture sink failed")
