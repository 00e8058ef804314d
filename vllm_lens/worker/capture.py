"""Copy requested rows of a signal (the residual stream, a tap point, Q/K) to the host, and assemble
a request's rows into one tensor when the front end fetches them (runs in: worker).

TP rank 0 of each pipeline stage; every TP rank for the signals split across ranks.

During a step each capturing layer does one gather and one copy into its capture group's staging
tensor (on the CPU backend, memory kept from earlier steps: ``staging_pool``); after the step
the store splits the staging tensor per request (one copy per request per step, or none for
the requests fetched for one sink's dataset that own most of it: ``CaptureStore``). At fetch
time a request's per-step chunks are concatenated once (a request whose rows came in one step
keeps its chunk as it is).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_lens.common.points import operands
from vllm_lens.common.positions import ROLLING_SLACK
from vllm_lens.worker.plan import CaptureGroup
from vllm_lens.worker.staging_pool import StagingPool
from vllm_lens.worker.capture_store import Entry

__all__ = ["READOUT", "assemble", "capture_layer", "encode_top_features", "pick_rows",
           "sae_chunk_rows"]

#: The index a group with a readout (attribution) is planned under at the last layer's
#: ``post`` site: its encoded rows get their final-norm scale there and are staged.
READOUT = -1


def pick_rows(tensor: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """``tensor``'s ``rows``: a view for a slice, a copy for indices."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def _pick(rows: torch.Tensor | slice, hidden: torch.Tensor, residual: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return pick_rows(hidden, rows), None if residual is None else pick_rows(residual, rows)


def capture_layer(group: CaptureGroup, index: int, a: torch.Tensor,
                  b: torch.Tensor | None, pool: StagingPool | None = None, *,
                  site: str | None = None) -> None:
    """Write ``group``'s signal (from a tap's two tensors, see ``points.operands``) at its
    rows into ``group.staging[index]`` (on the CPU a tensor from ``pool`` if given).

    A transcoder's features with ``reconstruction`` are read at two sites (``site``: the
    tap's): at its input the rows are kept (``group.pending``), at the point it predicts
    (``group.target_site``) they are encoded and its prediction compared with that point's
    rows. With a readout (attribution) the encoded rows wait for the last layer's ``post``
    site (``index`` ``READOUT``), where each gets its final-norm scale as one more column."""
    if index == READOUT:
        encoded, group.encoded = group.encoded, None
        if encoded is None:
            raise RuntimeError("the SAE's layer did not run before the model's last layer")
        stream, residual = _pick(group.rows, *operands("resid_post", a, b))
        if residual is not None:
            stream = stream + residual
        picked, extra = torch.cat([encoded, group.readout.norm_scale(stream)[:, None]], 1), None
        index, hidden = 0, a
    elif group.target_site is not None and site != group.target_site:  # the transcoder's input
        picked, extra = _pick(group.rows, *operands(group.signal, a, b))
        if extra is not None:
            picked = picked + extra
        elif isinstance(group.rows, slice):  # a view of the stream: kept as it is now
            picked = picked.clone()
        group.pending[index] = picked
        return
    elif group.target_site is not None:
        target, _ = _pick(group.rows, *operands("mlp_out", a, b))
        x = group.pending.pop(index, None)
        if x is None:
            raise RuntimeError("the transcoder's input site did not run in this step")
        picked, extra = encode_top_features(group.sae, x, None, target=target), None
        hidden = a
        if group.readout is not None:
            group.encoded = picked
            return
    else:
        hidden, residual = operands(group.signal, a, b)
        picked, extra = _pick(group.rows, hidden, residual)
        if group.sae is not None:  # only the SAE's top features leave the device
            picked, extra = encode_top_features(group.sae, picked, extra), None
            if group.readout is not None:
                group.encoded = picked
                return
    if group.staging is None:
        shape = (len(group.layers), group.n_rows, *picked.shape[1:])
        if hidden.device.type == "cpu" and pool is not None:
            group.staging = pool.empty(shape, picked.dtype)
        else:  # (an accelerator's: pinned, cached by PyTorch's host allocator)
            group.staging = torch.empty(shape, dtype=picked.dtype,
                                        pin_memory=hidden.device.type != "cpu")
    dest = group.staging[index]
    group.filled.add(index)
    last = len(group.filled) == len(group.layers)
    if hidden.device.type == "cpu":
        if extra is None:
            dest.copy_(picked)
        else:
            torch.add(picked, extra, out=dest)
        group.complete = last
        return
    # Asynchronous device->host copy; the store waits for ``ready`` before reading it.
    dest.copy_(picked if extra is None else picked + extra, non_blocking=True)
    if last:
        group.ready = torch.Event(device=hidden.device)
        group.ready.record()
        group.complete = True


def encode_top_features(sae: Any, rows: torch.Tensor, extra: torch.Tensor | None, *,
                        target: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, width]`` float32 per row of ``rows`` (+ ``extra``): the top features'
    indices, their values, and with reconstruction the NMSE and L0 (``spec.saes``; a
    transcoder's against ``target``, the rows of the point it predicts)."""
    model, top_k, reconstruction = sae
    x = (rows if extra is None else rows + extra).flatten(1)  # attn_z: heads flattened
    out = []
    step = sae_chunk_rows(model.d_sae)
    targets = (None,) * len(range(0, x.shape[0], step)) if target is None else target.split(step)
    for chunk, goal in zip(x.split(step), targets):
        found = model.top_features(chunk, top_k, reconstruction=reconstruction, target=goal)
        parts = [found["indices"].to(torch.float32), found["values"]]
        if reconstruction:
            parts += [found["nmse"][:, None], found["l0"][:, None].to(torch.float32)]
        out.append(torch.cat(parts, dim=1))
    if not out:
        return x.new_zeros((0, 2 * top_k + (2 if reconstruction else 0)), dtype=torch.float32)
    return torch.cat(out) if len(out) > 1 else out[0]


def sae_chunk_rows(d_sae: int) -> int:
    """Rows an SAE of ``d_sae`` features encodes at a time: a chunk's dense [rows, d_sae]
    activations stay in cache for the threshold and top-k that read them after the product
    (128 rows of a 9216-wide SAE: 1100 rows in 128-row chunks encode 1.8x faster than at
    once), and within 64 MiB."""
    return max(1, min(_SAE_CHUNK_ROWS, _SAE_CHUNK_BYTES // (4 * d_sae)))


_SAE_CHUNK_ROWS, _SAE_CHUNK_BYTES = 128, 64 << 20


def assemble(entry: Entry, valid_len: int) -> dict[str, Any]:
    """Stack an entry's chunks into ``[n_layers, n_positions, *row]`` (or reduce them over
    positions to ``[n_layers, *row]``).

    Rows at positions ``>= valid_len`` come from steps the scheduler ran past the stop and are
    dropped; a position captured twice (a preempted request recomputed) keeps its last copy;
    a selector whose window depends on the request's end (``"generated[-5:]"``) is applied
    now. A reduction over no position gives NaN rows (and no positions).
    """
    if not entry.chunks:
        raise ValueError(f"request {entry.req_id} has no captured rows on this rank")
    first = entry.chunks[0]
    positions = np.concatenate(entry.positions)
    # Last occurrence of each valid position, in ascending position order.
    order = np.arange(positions.size)
    keep_rev = np.unique(positions[::-1], return_index=True)[1]
    keep = order[::-1][keep_rev]
    keep = keep[positions[keep] < valid_len]
    if entry.window is not None:
        lo, hi = entry.window.bounds(entry.n_prompt, valid_len)
        if lo < entry.floor:
            raise ValueError(
                f"the rows of positions {lo}..{entry.floor - 1} were trimmed while the request "
                f"ran: it ran more than {ROLLING_SLACK} positions past its end (a stop string "
                "the engine learned of late), so its rolling window cannot be served")
        kept = positions[keep]
        keep = keep[(kept >= lo) & (kept < (valid_len if hi is None else hi))]
    kept_positions = torch.from_numpy(positions[keep].astype(np.int64))
    tail = tuple(first.shape[2:])
    if entry.reduce is not None and not keep.size:
        stream = torch.full((first.shape[0], *tail), float("nan"), dtype=first.dtype)
    elif entry.reduce == "last":
        stream = _rows_at(entry.chunks, positions.size, int(keep[-1])).clone()
        kept_positions = kept_positions[-1:]
    else:
        stream = _concat_rows(entry.chunks, keep)
        if entry.reduce == "mean":
            stream = stream.float().mean(dim=1).to(first.dtype)
    return {"layers": list(entry.layers), "positions": kept_positions, "signal": entry.signal,
            "tensor": stream}


def _concat_rows(chunks: list[torch.Tensor], keep: np.ndarray) -> torch.Tensor:
    """``rows[:, keep]`` of the chunks laid end to end, each row copied at most once: where
    the first chunk holds exactly the kept rows (a prompt read in one step, the usual case
    for a dataset job), that chunk itself, which the store handed over."""
    first = chunks[0]
    if keep.size == 0:
        return first.new_empty((first.shape[0], 0, *first.shape[2:]))
    if np.array_equal(keep, np.arange(keep.size)):
        # The usual case: rows arrived in order, only a surplus tail (if any) to drop.
        if first.shape[1] == keep.size:
            return first
        parts, total = [], 0
        for chunk in chunks:
            if total >= keep.size:
                break
            parts.append(chunk[:, : keep.size - total])
            total += parts[-1].shape[1]
        return torch.cat(parts, dim=1)
    index = torch.from_numpy(keep.astype(np.int64))
    return torch.index_select(torch.cat(chunks, dim=1), 1, index)


def _rows_at(chunks: list[torch.Tensor], total: int, row: int) -> torch.Tensor:
    """Row ``row`` (of ``total``, counted across the chunks) of every layer."""
    for chunk in reversed(chunks):
        total -= chunk.shape[1]
        if row >= total:
            return chunk[:, row - total]
    raise IndexError(row)
