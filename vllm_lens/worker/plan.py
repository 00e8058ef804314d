"""Per-step request plan: which rows of the batched hidden states belong to which lens request
(runs in: worker).

vLLM packs the tokens of every scheduled request into one ``[num_tokens, hidden]`` tensor per
step. The plan maps each lens request to its rows and their absolute token positions, and
groups capture rows by layer so that each tap does one gather and one host copy for the whole
batch. It is built once per forward step (on the first tap of the step) from host-side runner
state only, so no tap ever waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_lens.spec import CaptureSpec, LensRequest

__all__ = [
    "CaptureGroup", "CaptureOwner", "RequestSlice", "StepPlan", "device_index", "select_rows",
]


def device_index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host row indices as an int64 tensor on ``device`` (asynchronous copy, never a sync)."""
    return torch.from_numpy(rows.astype(np.int64)).to(device, non_blocking=True)


@dataclass(frozen=True)
class RequestSlice:
    """One lens request's share of this step's batch."""

    req_id: str
    lens: LensRequest
    start: int
    """First row of the request in the batched hidden states."""
    end: int
    pos0: int
    """Absolute token position of row ``start`` (tokens already computed before this step)."""
    n_prompt: int


@dataclass(frozen=True)
class CaptureOwner:
    """Rows ``[lo, hi)`` of a capture group's gathered tensor belong to this request."""

    req_id: str
    key: str
    lo: int
    hi: int


@dataclass
class CaptureGroup:
    """All rows to capture at one layer, gathered in one go."""

    rows: torch.Tensor | slice
    """Row indices on the hidden states' device, or a slice when the rows are contiguous."""
    owners: list[CaptureOwner]


def select_rows(spec: CaptureSpec, pos0: int, n_rows: int, n_prompt: int) -> np.ndarray:
    """Offsets (within a request's slice) of the rows ``spec`` selects, ascending.

    The slice covers absolute positions ``pos0 .. pos0 + n_rows - 1``.

    >>> select_rows(CaptureSpec(layers=(0,), positions="prompt"), 3, 4, 5)
    array([0, 1])
    >>> select_rows(CaptureSpec(layers=(0,), positions=(0, 4, 6)), 3, 4, 5)
    array([1, 3])
    """
    positions = np.arange(pos0, pos0 + n_rows)
    sel = spec.positions
    if sel == "all":
        mask = np.ones(n_rows, dtype=bool)
    elif sel == "prompt":
        mask = positions < n_prompt
    elif sel == "generated":
        mask = positions >= n_prompt
    elif sel == "last_prompt":
        mask = positions == n_prompt - 1
    else:
        mask = np.isin(positions, np.asarray(sel, dtype=np.int64))
    return np.flatnonzero(mask)


@dataclass
class StepPlan:
    """Everything the taps of one forward step need; immutable once built."""

    slices: list[RequestSlice]
    capture: dict[int, CaptureGroup] = field(default_factory=dict)
    """Layer index -> rows to capture there (layers nobody captures are absent)."""
    captured_positions: dict[str, np.ndarray] = field(default_factory=dict)
    """Request id -> absolute positions of the rows it captures in this step."""
    steer: dict[int, Any] = field(default_factory=dict)
    """Layer index -> ``steer.SteerGroup`` (layers nobody steers are absent)."""
    hook_calls: list[Any] = field(default_factory=list)
    """``hooks.HookCall`` per request with hooks in this step."""
    hook_layers: frozenset[tuple[int, bool]] = frozenset()
    """(layer, pre) pairs where some hook of this step runs."""

    @property
    def empty(self) -> bool:
        return not self.slices and not self.hook_calls

    @classmethod
    def build(
        cls, slices: list[RequestSlice], device: torch.device, capture_layers: frozenset[int]
    ) -> StepPlan:
        """Group capture rows by layer, for the layers this rank captures (its pipeline
        stage's layers on TP rank 0, none elsewhere)."""
        plan = cls(slices=slices)
        if not capture_layers:
            return plan
        # Requests asking for the same layers share one gathered tensor per layer.
        by_layers: dict[tuple[int, ...], list[tuple[RequestSlice, np.ndarray]]] = {}
        for s in slices:
            spec = s.lens.capture
            if spec is None:
                continue
            layers = tuple(layer for layer in spec.layers if layer in capture_layers)
            offsets = select_rows(spec, s.pos0, s.end - s.start, s.n_prompt)
            if not layers or offsets.size == 0:
                continue
            plan.captured_positions[s.req_id] = offsets + s.pos0
            by_layers.setdefault(layers, []).append((s, offsets + s.start))
        # A layer may be wanted by several layer-sets: merge them per layer.
        per_layer: dict[int, list[tuple[RequestSlice, np.ndarray]]] = {}
        for layers, members in by_layers.items():
            for layer in layers:
                per_layer.setdefault(layer, []).extend(members)
        shared: dict[tuple[int, ...], CaptureGroup] = {}
        for layer, members in per_layer.items():
            ident = tuple(id(s) for s, _ in members)
            group = shared.get(ident)
            if group is None:
                group = _make_group(members, device)
                shared[ident] = group
            plan.capture[layer] = group
        return plan


def _make_group(members: list[tuple[RequestSlice, np.ndarray]], device: torch.device) -> CaptureGroup:
    owners = []
    lo = 0
    for s, rows in members:
        owners.append(CaptureOwner(s.req_id, s.lens.key, lo, lo + rows.size))
        lo += rows.size
    all_rows = np.concatenate([rows for _, rows in members])
    first, last = int(all_rows[0]), int(all_rows[-1])
    if last - first + 1 == all_rows.size and np.all(np.diff(all_rows) == 1):
        return CaptureGroup(rows=slice(first, last + 1), owners=owners)
    return CaptureGroup(rows=device_index(all_rows, device), owners=owners)
