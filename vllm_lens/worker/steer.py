"""Apply steering vectors to this rank's rows of a stream point (runs in: worker).

Every TP rank; under PP each stage steers the layers it owns.

Each rank holds the full residual stream after the all-reduce, so every rank adds the same
vectors and the ranks stay in agreement. Steering adds to ``hidden``: for fused-residual layers
the stream is ``hidden + residual`` and the next layer sums them, so adding to either is the
same; ``norm_match`` measures the full ``hidden + residual``. A replacement (``mode="replace"``)
of a full-stream point sets ``hidden = v - residual`` there, so that the sum the next layer
forms is ``v`` (exact up to the rounding of that subtraction and the later addition); the tap
op may mutate ``hidden`` only. An ablation or a cap (``mode`` ``ablate`` / ``cap``) of such a
point measures the projection of ``hidden + residual`` and adds its correction to ``hidden``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_lens.common import faults, wire
from vllm_lens.common.points import POINTS, site_of
from vllm_lens.saes import SAE
from vllm_lens.saes.model import RESCALED
from vllm_lens.spec import SteerSpec
from vllm_lens.worker.capture import sae_chunk_rows
from vllm_lens.worker.plan import RequestSlice, device_index

__all__ = [
    "PROJECTIONS", "GateSlot", "PreparedClamp", "PreparedSteer", "Projection", "SteerGroup",
    "apply_steering", "build_steer_groups", "pack_gates", "phase_boundary", "prepare",
]

#: Modes that act on the projection of the stream onto each row's direction.
PROJECTIONS = ("ablate", "cap")


@dataclass(frozen=True)
class PreparedSteer:
    """One steering vector, decoded once per request onto the model's device and dtype."""

    spec: SteerSpec
    vectors: torch.Tensor
    """``[n_layers, hidden]`` or ``[n_layers, n_pos, hidden]``, ready to use: already scaled
    for plain vectors, unit length for norm-matched ones (scaled per token at apply time),
    unit length in float32 for ablations and caps (one row expanded to every layer for
    ``layer_indices="all"``)."""
    positions_sorted: np.ndarray | None
    position_rows: np.ndarray | None  # row of ``vectors[:, j]`` for each sorted position
    probe: torch.Tensor | None = None
    """The condition's probe (float32, on the device), for a gated vector."""
    clamp: PreparedClamp | None = None


@dataclass(frozen=True)
class PreparedClamp:
    """Clamped SAE features. A standard or JumpReLU clamp brings the SAE cut down to them
    (their encoder columns and decoder rows: each one's activation depends on its column
    alone); a TopK clamp encodes whole rows with the SAE this worker holds for the request
    (whether a feature is among the top k depends on every other), ``features`` picking
    the clamped ones."""

    sae: SAE | None
    """``None`` for a TopK clamp on a pipeline stage without its layer (it never runs
    there)."""
    targets: torch.Tensor
    directions: torch.Tensor
    """``[k, d_in]``: what one unit of each feature decodes to (its decoder row, divided by
    the row's norm for a TopK SAE that rescales by it), so that ``(targets - f) @ directions``
    is ``decode(f') - decode(f)``, ``f'`` being ``f`` with the features set."""
    features: torch.Tensor | None = None
    """TopK: the clamped features' indices among the SAE's (``None``: ``sae`` is the
    clamp's own, cut down to them)."""
    key: tuple = ()
    """Equal for clamps that compute the same delta from the same row (the same SAE
    weights, features and targets, in the same dtype on the same device): requests clamping
    alike are encoded together, one product per site and step instead of one per request."""

    @property
    def nbytes(self) -> int:
        """Device bytes the request owns: the cut-down SAE, or a TopK clamp's directions (its
        SAE is the worker's, counted in ``VLLM_LENS_SAE_MAX_BYTES``)."""
        if self.features is None:
            return self.sae.nbytes
        return self.directions.numel() * self.directions.element_size()

    def delta(self, stream: torch.Tensor) -> torch.Tensor:
        """``(targets - f(stream)) @ directions`` for rows ``stream`` ``[n, d_in]``, in the
        wider of the SAE's and the rows' dtypes."""
        features = self._encode(stream)
        return ((self.targets.to(features.dtype) - features)
                @ self.directions.to(features.dtype))

    def _encode(self, stream: torch.Tensor) -> torch.Tensor:
        """The clamped features' activations ``[n, k]``; a TopK SAE's whole rows a chunk at
        a time (``capture.sae_chunk_rows``)."""
        if self.features is None:
            return self.sae.encode(stream)
        per_chunk = sae_chunk_rows(self.sae.d_sae)
        return torch.cat([self.sae.encode(chunk).index_select(1, self.features)
                          for chunk in stream.split(per_chunk)])


def _prepare_clamp(spec: SteerSpec, device: torch.device, dtype: torch.dtype,
                   held: SAE | None) -> PreparedClamp:
    clamp = spec.clamp
    assert clamp is not None
    targets = torch.tensor(clamp.targets, dtype=torch.float64)
    if clamp.path is not None:
        return _held_clamp(held, targets, clamp.features)
    parts = wire.loads(clamp.encoder)
    sae = SAE(architecture=clamp.architecture,
              W_enc=parts["W_enc"], b_enc=parts["b_enc"], W_dec=wire.loads(spec.vectors),
              b_dec=parts["b_dec"], layout="slice", threshold=parts["threshold"],
              apply_b_dec_to_input=bool(parts["apply_b_dec_to_input"]))
    wide = torch.promote_types(sae.dtype, dtype)
    sae = sae.to(device, wide)
    key = ("slice", clamp.architecture, hashlib.blake2b(clamp.encoder).digest(),
           hashlib.blake2b(spec.vectors).digest(), clamp.targets, str(wide), str(device))
    return PreparedClamp(sae, targets.to(device, wide), sae.W_dec, key=key)


def _held_clamp(sae: SAE | None, targets: torch.Tensor,
                features: tuple[int, ...]) -> PreparedClamp:
    """A TopK clamp with the SAE this worker holds (``None`` on a stage without its layer);
    the SAE was widened to the rows' dtype when it was loaded (``worker.saes``)."""
    if sae is None:
        return PreparedClamp(None, targets, targets.new_empty(0),
                             torch.empty(0, dtype=torch.long))
    index = torch.as_tensor(features, dtype=torch.long, device=sae.W_dec.device)
    rows = sae.W_dec.index_select(0, index)
    if sae.rescale_acts_by_decoder_norm and sae.architecture in RESCALED:
        rows = rows / rows.norm(dim=-1, keepdim=True)
    # (``id``: the SAE object is the worker's, held by each request keyed here while it runs.)
    key = ("held", id(sae), tuple(features), tuple(targets.tolist()))
    return PreparedClamp(sae, targets.to(rows.device, rows.dtype), rows, index, key=key)


def prepare(spec: SteerSpec, device: torch.device, dtype: torch.dtype,
            held: SAE | None = None) -> PreparedSteer:
    """``spec`` on ``device`` in ``dtype``; ``held``: for a TopK clamp, the SAE this worker
    holds for it (``None`` on a pipeline stage without its layer)."""
    if spec.clamp is not None:
        clamp = _prepare_clamp(spec, device, dtype, held)
        positions = None
        if spec.positions is not None:
            positions = np.sort(np.asarray(spec.positions, dtype=np.int64))
        return PreparedSteer(spec, clamp.directions, positions,
                             None if positions is None else np.arange(positions.size),
                             clamp=clamp)
    vectors = wire.loads(spec.vectors).to(device=device, dtype=torch.float32)
    if spec.mode in PROJECTIONS:  # directions, kept in float32 (the front end refused zeros)
        vectors = vectors / vectors.norm(dim=-1, keepdim=True)
    elif spec.norm_match:
        vectors = (vectors / vectors.norm(dim=-1, keepdim=True)).to(dtype)
    else:
        vectors = (vectors * spec.scale).to(dtype)
    if vectors.shape[0] != len(spec.layers):  # one row for every layer: a view of it
        vectors = vectors.expand(len(spec.layers), *vectors.shape[1:])
    probe = None
    if spec.condition is not None:
        probe = wire.loads(spec.condition.probe).to(device=device, dtype=torch.float32)
    if spec.positions is None:
        return PreparedSteer(spec, vectors, None, None, probe)
    positions = np.asarray(spec.positions, dtype=np.int64)
    order = np.argsort(positions, kind="stable")
    return PreparedSteer(spec, vectors, positions[order], order, probe)


@dataclass
class GateSlot:
    """One gated vector's per-token gate in one step: computed at the condition's site, used
    at the steered layers' sites later in the same forward pass."""

    req_id: str
    index: int
    """The vector's index in the request's steering list."""
    offsets: np.ndarray
    """Rows of the request's slice the vector steers (host), for the gates' positions."""
    rows: torch.Tensor
    probe: torch.Tensor
    threshold: float
    sharpness: float
    with_residual: bool
    """The condition's point is ``hidden + residual``."""
    values: torch.Tensor | None = None
    """``sigmoid(sharpness * (h · probe - threshold))`` per row (float32), once computed."""

    def compute(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        h = hidden.index_select(0, self.rows).float()
        if self.with_residual and residual is not None:
            h = h + residual.index_select(0, self.rows).float()
        self.values = torch.sigmoid(self.sharpness * (h @ self.probe - self.threshold))


@dataclass(frozen=True)
class Projection:
    """Rows whose projection onto a direction is clamped: ``x <- x + (clamp(x . r, lower,
    upper) - x . r) r``; an ablation is the clamp into ``[0, 0]``."""

    rows: torch.Tensor
    directions: torch.Tensor
    """``[n, hidden]`` unit vectors (float32), one per row (a view of one for 2D vectors)."""
    lower: float | None
    upper: float | None
    with_residual: bool
    """The point is ``hidden + residual``."""

    def apply(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Correct ``hidden`` in place (no host synchronisation: the bounds are Python
        floats)."""
        x = hidden.index_select(0, self.rows).float()
        if self.with_residual and residual is not None:
            x = x + residual.index_select(0, self.rows).float()
        projection = (x * self.directions).sum(dim=-1, keepdim=True)
        target = projection.clamp(min=self.lower, max=self.upper)
        hidden.index_add_(0, self.rows,
                          ((target - projection) * self.directions).to(hidden.dtype))


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
    conditions: list[GateSlot] = field(default_factory=list)
    """Gates read at this site (before any steering here)."""
    gated_rows: torch.Tensor | None = None
    """Rows receiving a gated addition, every gated vector's rows in turn, with
    ``gated_delta`` their additions and ``gated`` the gates, in the same order: row ``i``
    gets ``gated_delta[i]`` times its gate's value for it."""
    gated_delta: torch.Tensor | None = None
    gated: list[GateSlot] = field(default_factory=list)
    replaced: list[tuple[torch.Tensor, torch.Tensor, bool]] = field(default_factory=list)
    """(rows, values, whether the point is ``hidden + residual``) for ``replace`` vectors,
    written before any addition."""
    clamped: list[tuple[torch.Tensor, PreparedClamp, bool]] = field(default_factory=list)
    """(rows, clamp, whether the point is ``hidden + residual``) for clamped SAE features,
    read before anything here is written."""
    projections: list[Projection] = field(default_factory=list)
    """Ablations and caps, applied after everything else here, one after the other: those of
    a point without the residual (``attn_out``, ``mlp_out``) first, as the model adds that
    part before the full stream exists, then those of the full stream; in list order
    within each."""
    req_ids: list[str] = field(default_factory=list)
    """The requests steered here (they fail together if this layer's steering raises)."""


def build_steer_groups(
    slices: list[tuple[RequestSlice, list[PreparedSteer]]], device: torch.device, *,
    split: bool,
) -> dict[tuple[int, str], SteerGroup]:
    """Per (layer, site), the rows to steer and what to add, for every steered request of the
    step."""
    plain: dict[tuple[int, str], tuple[list[np.ndarray], list[torch.Tensor]]] = {}
    gated: dict[tuple[int, str], tuple[list[np.ndarray], list[torch.Tensor]]] = {}
    groups: dict[tuple[int, str], SteerGroup] = {}
    # (site, clamp key, with_residual) -> the rows of every request clamping alike, and the
    # first such request's clamp (``PreparedClamp.key``).
    clamped: dict[tuple, tuple[list[np.ndarray], PreparedClamp]] = {}
    for s, prepared in slices:
        faults.check(s.lens.fault, "steer_groups")
        # A request's plain 2D vectors at one site and phase steer the same rows: summed
        # first, they are expanded to those rows once, however many there are.
        flat: dict[tuple[tuple[int, str], str], tuple[np.ndarray, torch.Tensor]] = {}
        for index, p in enumerate(prepared):
            offsets, vector_rows = _rows_for(p, s)
            if offsets.size == 0:
                continue
            rows = offsets + s.start
            point = POINTS[p.spec.point]
            gate = None
            if p.spec.condition is not None:
                cond = p.spec.condition
                gate = GateSlot(s.req_id, index, offsets, device_index(rows, device), p.probe,
                                cond.threshold, cond.sharpness, POINTS[cond.point].with_residual)
                _owned(groups, (cond.layer, site_of(cond.point, split=split)),
                       s.req_id).conditions.append(gate)
            for i, layer in enumerate(p.spec.layers):
                where = (layer, site_of(point.name, split=split))
                _owned(groups, where, s.req_id)
                if p.clamp is not None:
                    alike = (where, p.clamp.key or id(p.clamp), point.with_residual)
                    clamped.setdefault(alike, ([], p.clamp))[0].append(rows)
                    continue
                vecs = _vectors_for(p, i, vector_rows, offsets.size)
                if gate is not None:
                    row_lists, deltas = gated.setdefault(where, ([], []))
                    row_lists.append(rows)
                    deltas.append(vecs)
                    groups[where].gated.append(gate)
                elif p.spec.mode in PROJECTIONS:
                    lower, upper = p.spec.cap if p.spec.mode == "cap" else (0.0, 0.0)
                    groups[where].projections.append(Projection(
                        device_index(rows, device), vecs, lower, upper, point.with_residual))
                elif p.spec.mode == "replace":
                    groups[where].replaced.append(
                        (device_index(rows, device), vecs, point.with_residual))
                elif p.spec.norm_match:
                    groups[where].norm_matched.append(
                        (device_index(rows, device), vecs, p.spec.scale, point.with_residual))
                elif vector_rows is None:
                    summed = flat.get((where, p.spec.phase))
                    vector = p.vectors[i].float()
                    flat[(where, p.spec.phase)] = (
                        rows, vector if summed is None else summed[1] + vector)
                else:
                    row_lists, deltas = plain.setdefault(where, ([], []))
                    row_lists.append(rows)
                    deltas.append(vecs)
        for (where, _), (rows, vector) in flat.items():
            row_lists, deltas = plain.setdefault(where, ([], []))
            row_lists.append(rows)
            dtype = next(p.vectors.dtype for p in prepared if p.spec.mode == "add")
            deltas.append(vector.to(dtype).expand(rows.size, -1))
    for (where, _, with_residual), (row_lists, clamp) in clamped.items():
        groups[where].clamped.append(
            (device_index(np.concatenate(row_lists), device), clamp, with_residual))
    for where, parts in plain.items():
        groups[where].rows, groups[where].delta = _joined(*parts, device)
    for group in groups.values():
        group.projections.sort(key=lambda projection: projection.with_residual)
    for where, parts in gated.items():
        groups[where].gated_rows, groups[where].gated_delta = _joined(*parts, device)
    return groups


def _joined(row_lists: list[np.ndarray], deltas: list[torch.Tensor],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every vector's rows and additions at one site as one index and one tensor."""
    return device_index(np.concatenate(row_lists), device), torch.cat(deltas)


def _owned(groups: dict[tuple[int, str], SteerGroup], where: tuple[int, str],
           req_id: str) -> SteerGroup:
    """The group at ``where``, with ``req_id`` among its owners."""
    group = groups.setdefault(where, SteerGroup())
    if not group.req_ids or group.req_ids[-1] != req_id:
        group.req_ids.append(req_id)
    return group


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
    """Read this site's gates and clamped features, write its replacements into ``hidden``,
    then add its steering, then ablate and cap, in place (norms taken after the
    replacements, before any addition; projections after every addition)."""
    for gate in group.conditions:
        gate.compute(hidden, residual)
    clamp_deltas = []
    for rows, clamp, with_residual in group.clamped:
        stream = hidden.index_select(0, rows)
        if with_residual and residual is not None:
            stream = stream + residual.index_select(0, rows)
        clamp_deltas.append((rows, clamp.delta(stream).to(hidden.dtype)))
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
    for rows, delta in (*norm_deltas, *clamp_deltas):
        hidden.index_add_(0, rows, delta)
    if group.gated:
        values = (group.gated[0].values if len(group.gated) == 1
                  else torch.cat([gate.values for gate in group.gated]))
        hidden.index_add_(0, group.gated_rows,
                          (group.gated_delta.float() * values[:, None]).to(hidden.dtype))
    for projection in group.projections:
        projection.apply(hidden, residual)


def pack_gates(gates: dict[int, list[tuple[np.ndarray, torch.Tensor]]],
               valid: int | None = None) -> bytes:
    """``wire`` bytes of ``{vector index: {"positions", "gates"}}``, one gate per position in
    position order (a position computed again after a preemption keeps its last value), below
    ``valid`` (positions of the returned tokens; a step run past the stop is left out)."""
    packed = {}
    for index, steps in gates.items():
        positions = np.concatenate([p for p, _ in steps])
        values = torch.cat([v.float() for _, v in steps]).to("cpu")
        last = {int(pos): i for i, pos in enumerate(positions)
                if valid is None or pos < valid}
        order = sorted(last)
        packed[str(index)] = {"positions": torch.tensor(order, dtype=torch.int64),
                              "gates": values[[last[pos] for pos in order]]}
    return wire.dumps(packed, compress=False)
