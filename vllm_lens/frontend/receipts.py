"""One request's capture-sink receipt from the receipts of the workers that wrote its example (runs
in: front end).

One worker writes a request's example (TP rank 0), and its receipt is the request's as the
sink returned it. Under pipeline parallelism each stage writes the part it holds (its layers'
rows, the features of the SAEs at them) and returns a receipt naming that part (``layers``,
``saes``, ``writer``); the request's receipt then joins them: ``rows``, the whole example's
``shapes``, ``durable`` only if every part is, and the parts themselves in ``parts`` (each
with its own ``shard`` and ``offset``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_lens.spec import LensRequest

__all__ = ["join_receipts", "unwritten"]


def unwritten(lens: LensRequest, receipts: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the receipts do not cover the request's whole example (a stage's part that never
    reached the sink), or ``None``."""
    layers = set(lens.captures[0].layers) if lens.captures else set()
    saes = set(range(len(lens.saes)))
    for receipt in receipts:
        if "layers" not in receipt:  # the whole example
            return None
        layers -= set(receipt["layers"])
        saes -= set(receipt.get("saes", ()))
    if not layers and not saes:
        return None
    lost = [f"layers {sorted(layers)}"] if layers else []
    lost += [f"SAE entries {sorted(saes)}"] if saes else []
    return (f"vllm-lens lost part of this request's rows before they reached the sink: no "
            f"pipeline stage wrote {' and '.join(lost)} (the stages that did keep their part in "
            "the dataset, which shows the example only once every part is in)")


def join_receipts(receipts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The request's receipt: the one worker's, or the stages' joined."""
    if len(receipts) == 1:
        return dict(receipts[0])
    parts = sorted((dict(r) for r in receipts),
                   key=lambda r: (min(r.get("layers") or [1 << 30]), r.get("saes") or []))
    shapes: dict[str, list[int]] = {}
    for part in parts:
        for name, shape in part["shapes"].items():
            if name in shapes and not name.startswith("sae."):  # rows: [n_layers, n, *row]
                shapes[name] = [shapes[name][0] + shape[0], *shape[1:]]
            else:
                shapes[name] = list(shape)
    first = parts[0]
    return {"sink": first["sink"], "dataset": first["dataset"], "key": first["key"],
            "rows": first["rows"], "shapes": shapes,
            "durable": all(part["durable"] for part in parts), "parts": parts}
