"""Apply steering vectors to this rank's rows of a stream point (runs in: worker, every TP rank;
under PP each stage steers the layers it owns).

Each rank holds the full residual stream after the all-reduce, so every rank adds the same
vectors and the ranks stay in agreement. Steering adds to ``hidden``: for fused-residual layers
the stream is ``hidden + residual`` and the next layer sums them, so adding to either is the
same; ``norm_match`` measures the full ``hidden + residual``. A replacement (``mode="replace"``)
of a full-stream point sets ``hidden = v - residual`` there, so that the sum the next layer
forms is ``v`` (exact up to the rounding of that subtraction and the later addition); the tap
op may mutate ``hidden`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_lens import wire
from vllm_lens.points import POINTS, site_of
from vllm_lens.spec import SteerSpec
from vllm_lens.worker.plan import RequestSlice, device_index

__all__ = ["PreparedSteer", "SteerGroup", "apply_steering", "build_steer_groups", "phase_boundary",
           "prepare"]


@dataclass(frozen=True)
class PreparedSteer:
    """One steering vector, decoded once per request onto the model's device and dtype."""

    spec: SteerSpec
    vectors: torch.Tensor
    """``[n_layers, hidden]`` or ``[n_layers, n_pos, hidden]``, ready to use: already scaled
    for plain vectors, unit length for norm-matched ones (scaled per token at apply time)."""
    positions_sorted: np.ndarray | None
    position_rows: np.ndarray | None  # row of ``vectors[:, j]`` for each sorted position


def prepare(spec: SteerSpec, device: torch.device, dtype: torch.dtype) -> PreparedSteer:
    vectors = wire.loads(spec.vectors).to(device=device, dtype=torch.float32)
    if spec.norm_match:
        vectors = vectors / vectors.norm(dim=-1, keepdim=True)
    else:
        vectors = vectors * spec.scale
    vectors = vectors.to(dtype)
    if spec.positions is None:
        return PreparedSteer(spec, vectors, None, None)
    positions = np.asarray(spec.positions, dtype=np.int64)
    order = np.argsort(positions, kind="stable")
    return PreparedSteer(spec, vectors, positions[order], order)


@dataclass
class SteerGroup:
    """All steering at one layer in one step."""

    rows: torch.Tensor | None = None
    """Rows receiving a plain (not norm-matched) addition, with ``delta`` the additions."""
    delta: torch.Tensor | None = None
    norm_matched: list[tuple[torch.Tensor, torch.Tensor, float, bool]] = field(
        default_factory=list)
    """(rows, unit vectors per row, scale, whether the norm is of ``hidden + residual``) for
    norm-matched vectors."""
    replaced: list[tuple[torch.Tensor, torch.Tensor, bool]] = field(default_factory=list)
    """(rows, values, whether the point is ``hidden + residual``) for ``replace`` vectors,
    written before any addition."""
    req_ids: list[str] = field(default_factory=list)
    """The requests steered here (they fail together if this layer's steering raises)."""


def build_steer_groups(
    slices: list[tuple[RequestSlice, list[PreparedSteer]]], device: torch.device, *,
    split: bool,
) -> dict[tuple[int, str], SteerGroup]:
    """Per (layer, site), the rows to steer and what to add, for every steered request of the
    step."""
    plain: dict[tuple[int, str], tuple[list[np.ndarray], list[torch.Tensor]]] = {}
    groups: dict[tuple[int, str], SteerGroup] = {}
    for s, prepared in slices:
        for p in prepared:
            offsets, vector_rows = _rows_for(p, s)
            if offsets.size == 0:
                continue
            rows = offsets + s.start
            point = POINTS[p.spec.point]
            for i, layer in enumerate(p.spec.layers):
                where = (layer, site_of(point.name, split=split))
                owners = groups.setdefault(where, SteerGroup()).req_ids
                if not owners or owners[-1] != s.req_id:
                    owners.append(s.req_id)
                vecs = _vectors_for(p, i, vector_rows, offsets.size)
                if p.spec.mode == "replace":
                    groups[where].replaced.append(
                        (device_index(rows, device), vecs, point.with_residual))
                elif p.spec.norm_match:
                    groups[where].norm_matched.append(
                        (device_index(rows, device), vecs, p.spec.scale, point.with_residual))
                else:
                    row_lists, deltas = plain.setdefault(where, ([], []))
                    row_lists.append(rows)
                    deltas.append(vecs)
    for where, (row_lists, deltas) in plain.items():
        group = groups[where]
        group.rows = device_index(np.concatenate(row_lists), device)
        group.delta = torch.cat(deltas)
    return groups


def phase_boundary(s: RequestSlice) -> int:
    """Offset of the slice's first generated position (``0``: all generated; the slice's
    length: all in the prompt)."""
    return min(max(s.n_prompt - s.pos0, 0), s.end - s.start)


def _rows_for(p: PreparedSteer, s: RequestSlice) -> tuple[np.ndarray, np.ndarray | None]:
    """Offsets within the slice to steer, and (3D) which vector row each one gets."""
    n = s.end - s.start
    lo, hi = {"all": (0, n), "prefill": (0, phase_boundary(s)),
              "decode": (phase_boundary(s), n)}[p.spec.phase]
    if p.positions_sorted is None:
        return np.arange(lo, hi), None
    positions = np.arange(s.pos0 + lo, s.pos0 + hi)
    if positions.size == 0:
        return positions, None
    idx = np.searchsorted(p.positions_sorted, positions)
    idx_clipped = np.minimum(idx, p.positions_sorted.size - 1)
    hit = p.positions_sorted[idx_clipped] == positions
    return np.flatnonzero(hit) + lo, p.position_rows[idx_clipped[hit]]


def _vectors_for(p: PreparedSteer, i: int, vector_rows: np.ndarray | None, n: int) -> torch.Tensor:
    layer_vectors = p.vectors[i]
    if vector_rows is None:
        return layer_vectors.expand(n, -1)
    return layer_vectors.index_select(0, device_index(vector_rows, layer_vectors.device))


def apply_steering(group: SteerGroup, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Write this layer's replacements into ``hidden``, then add its steering, in place (norms
    taken after the replacements, before any addition)."""
    for rows, values, with_residual in group.replaced:
        if with_residual and residual is not None:
            values = values - residual.index_select(0, rows)
        hidden.index_copy_(0, rows, values)
    norm_deltas = []
    if group.norm_matched:
        full = hidden if residual is None else None
        for rows, unit, scale, with_residual in group.norm_matched:
            if with_residual and full is None:
                full = hidden + residual
            stream = full if with_residual else hidden
            norms = stream.index_select(0, rows).float().norm(dim=-1, keepdim=True)
            norm_deltas.append((rows, (scale * norms * unit.float()).to(hidden.dtype)))
    if group.rows is not None:
        hidden.index_add_(0, group.rows, group.delta)
    for rows, delta in norm_deltas:
        hidden.index_add_(0, rows, delta)
