"""Writing a finished request's rows to the capture sink it named (runs in: worker, the rank
that holds all of them: TP rank 0 of a single pipeline stage, which the front end checks).

Sinks are opened on first use from this process's ``VLLM_LENS_SINKS`` (the engine's
environment) and live as long as the worker.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import logging
import multiprocessing.util
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_lens.sinks import Example, Sink, configured, load_kind
from vllm_lens.spec import LensRequest

__all__ = ["close_all", "flush_all", "write"]

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


def write(lens: LensRequest, captures: Mapping[str, Mapping[str, Any]], model: str,
          prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> dict[str, Any]:
    """Write one request's assembled captures (signal -> ``capture.assemble`` result), SAE
    features included, as one example; returns the sink's receipt."""
    assert lens.sink is not None
    specs = lens.captures
    missing = [c.signal for c in (*specs, *lens.sae_captures) if c.signal not in captures]
    if missing:
        raise ValueError(f"no position of {', '.join(missing)} was selected: nothing was "
                         "written (a sink example needs rows)")
    first = specs[0] if specs else lens.sae_captures[0]
    reduced = first.reduce is not None
    rows: dict[str, torch.Tensor] = {}
    for spec in specs:
        tensor = captures[spec.signal]["tensor"]
        rows[spec.signal] = tensor[:, None] if reduced else tensor
    positions = captures[first.signal]["positions"]
    features = []
    for sae in lens.saes:
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

    settings = {
        "model": model,
        "vllm_version": vllm.__version__,
        "vllm_lens_version": _version("vllm-lens"),
        "points": [c.signal for c in specs],
        "layers": list(first.layers) if specs else [],
        "dtype": str(rows[first.signal].dtype).removeprefix("torch.") if specs else "float32",
        "row_shapes": {signal: list(t.shape[2:]) for signal, t in rows.items()},
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
                      token_ids=list(token_ids), settings=settings, sae_features=features)
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
