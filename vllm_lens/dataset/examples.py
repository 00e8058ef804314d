"""One example, or a pipeline stage's part of one, checked against its dataset's manifest
before a writer queues it: what it holds, how many rows, of which shapes (runs in: caller,
worker).

Everything here raises ``ValueError`` naming the example's key and what is wrong with it;
nothing is written or queued by it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_lens.dataset.format import SAE_FIELDS, sae_column, sae_fields

__all__ = ["Part", "checked_rows", "part_of"]

#: The manifest layers and SAE entries (their numbers) an example's rows hold.
Part = tuple[tuple[int, ...], tuple[int, ...]]


def part_of(key: str, manifest_layers: tuple[int, ...], n_saes: int,
            layers: Sequence[int] | None, saes: Sequence[int] | None) -> Part:
    """The manifest layers and SAE entries an example's rows hold, in manifest order
    (``None``: all of them)."""
    part_layers = manifest_layers if layers is None else tuple(int(x) for x in layers)
    part_saes = tuple(range(n_saes)) if saes is None else tuple(int(i) for i in saes)
    if [x for x in manifest_layers if x in part_layers] != list(part_layers):
        raise ValueError(f"example {key!r}: its layers {list(part_layers)} are not the "
                         f"manifest's {list(manifest_layers)} or some of them, in order")
    if sorted(set(part_saes)) != list(part_saes) or not set(part_saes) <= set(range(n_saes)):
        raise ValueError(f"example {key!r}: its SAE entries {list(part_saes)} are not "
                         f"some of the manifest's 0..{n_saes - 1}, in order")
    if not part_layers and not part_saes:
        raise ValueError(f"example {key!r} holds no layer and no SAE entry")
    return part_layers, part_saes


def checked_rows(key: str, part: Part, rows: Mapping[str, torch.Tensor],
                 positions: Sequence[int], sae_features: Sequence[Mapping[str, torch.Tensor]],
                 *, points: tuple[str, ...], row_shapes: Mapping[str, tuple[int, ...]],
                 dtype: torch.dtype, saes: tuple[Mapping[str, Any], ...], reduced: bool,
                 part_named: bool) -> tuple[int, dict[str, torch.Tensor]]:
    """The example's row count and its tensors by name in the shard (on the CPU, in the
    dataset's dtype), once each matches the manifest (``ShardWriter.add`` describes the
    arguments; ``part_named``: the caller named the SAE entries it holds)."""
    part_layers, part_saes = part
    missing = [point for point in points if part_layers and point not in rows]
    if missing:
        raise ValueError(f"example {key!r} has no rows of {', '.join(missing)}")
    if len(sae_features) != len(part_saes):
        raise ValueError(f"example {key!r} has {len(sae_features)} SAE feature entries, "
                         f"the {'part' if part_named else 'dataset'} {len(part_saes)}")
    if reduced and saes:
        raise ValueError(f"example {key!r}: SAE features are per position, not reduced")
    if points and part_layers:
        first = rows[points[0]]
        n_rows = int(first.shape[1]) if first.dim() > 1 else -1
    else:
        n_rows = int(sae_features[0]["indices"].shape[0])
    if reduced and n_rows != 1:
        raise ValueError(f"example {key!r}: a reduced example has one row, not {n_rows}")
    if not reduced and len(positions) != n_rows:
        raise ValueError(f"example {key!r}: {len(positions)} positions for {n_rows} rows")
    checked = {}
    for point in points if part_layers else ():
        t = rows[point]
        expected = (len(part_layers), n_rows, *row_shapes[point])
        if tuple(t.shape) != expected:
            raise ValueError(f"example {key!r}: {point} has shape {tuple(t.shape)}, "
                             f"expected {expected}")
        checked[point] = t.detach().to("cpu", dtype)
    for number, entry in zip(part_saes, sae_features):
        spec = saes[number]
        for field in sae_fields(spec):
            t = entry.get(field)
            expected = (n_rows, int(spec["top_k"])) if field in ("indices", "values") \
                else (n_rows,)
            if t is None or tuple(t.shape) != expected:
                raise ValueError(f"example {key!r}: SAE entry {number}'s {field} has "
                                 f"shape {None if t is None else tuple(t.shape)}, "
                                 f"expected {expected}")
            checked[sae_column(number, field)] = t.detach().to("cpu", SAE_FIELDS[field])
    return n_rows, checked
