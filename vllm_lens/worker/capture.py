"""Copy requested residual-stream rows to the per-request CPU buffers (runs in: worker, TP
rank 0 of each pipeline stage), and assemble them into one tensor when the front end fetches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_lens.worker.plan import CaptureGroup
from vllm_lens.worker.store import CaptureStore, Entry

__all__ = ["assemble", "capture_rows"]


def capture_rows(
    group: CaptureGroup,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    layer: int,
    store: CaptureStore,
) -> None:
    """Gather ``group``'s rows of the residual stream (one gather, one host copy per layer)."""
    rows = group.rows
    if isinstance(rows, slice):
        picked = hidden[rows]
        fresh = False  # a view of ``hidden``, which later layers overwrite
        if residual is not None:
            picked = picked + residual[rows]
            fresh = True
    else:
        picked = hidden.index_select(0, rows)
        if residual is not None:
            picked = picked + residual.index_select(0, rows)
        fresh = True
    host = _to_host(picked, fresh)  # [n_rows, hidden]
    for owner in group.owners:
        store.add_rows(owner.key, owner.req_id, layer, host[owner.lo : owner.hi])


def _to_host(t: torch.Tensor, fresh: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t if fresh else t.clone()
    # Asynchronous device->host copy: the fetch RPC synchronizes before reading it.
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def assemble(entry: Entry, valid_len: int) -> dict[str, Any]:
    """Stack an entry's chunks into ``[n_layers, n_positions, hidden]`` (or reduce them).

    Rows at positions ``>= valid_len`` come from steps the scheduler ran past the stop and are
    dropped; a position captured twice (a preempted request recomputed) keeps its last copy.
    """
    layers = sorted(entry.chunks)
    if not layers:
        raise ValueError(f"request {entry.req_id} has no captured layer on this rank")
    positions = np.concatenate(entry.positions) if entry.positions else np.zeros(0, np.int64)
    # Last occurrence of each valid position, in ascending position order.
    order = np.arange(positions.size)
    keep_rev = np.unique(positions[::-1], return_index=True)[1]
    keep = order[::-1][keep_rev]
    keep = keep[positions[keep] < valid_len]
    stacked = _stack_rows(entry, layers, keep)
    kept_positions = torch.from_numpy(positions[keep].astype(np.int64))
    if entry.reduce == "mean" and kept_positions.numel():
        stacked = stacked.float().mean(dim=1).to(stacked.dtype)
    elif entry.reduce == "last" and kept_positions.numel():
        stacked = stacked[:, -1]
    return {"layers": layers, "positions": kept_positions, "residual_stream": stacked}


def _stack_rows(entry: Entry, layers: list[int], keep: np.ndarray) -> torch.Tensor:
    """``[n_layers, len(keep), hidden]`` from the per-step chunks, copying each row once."""
    first = entry.chunks[layers[0]][0]
    out = torch.empty((len(layers), keep.size, first.shape[-1]), dtype=first.dtype)
    if keep.size == 0:
        return out
    if np.array_equal(keep, np.arange(keep.size)):
        # The usual case: rows arrived in order, only a surplus tail (if any) to drop.
        for i, layer in enumerate(layers):
            parts, total = [], 0
            for chunk in entry.chunks[layer]:
                if total >= keep.size:
                    break
                parts.append(chunk[: keep.size - total])
                total += parts[-1].shape[0]
            torch.cat(parts, out=out[i])
        return out
    index = torch.from_numpy(keep.astype(np.int64))
    for i, layer in enumerate(layers):
        torch.index_select(torch.cat(entry.chunks[layer]), 0, index, out=out[i])
    return out
