"""Per-step request plan: which rows of the batched hidden states belong to which lens request
(runs in: worker).

vLLM packs the tokens of every scheduled request into one ``[num_tokens, hidden]`` tensor per
step. The plan maps each lens request to its rows and their absolute token positions, and
groups capture rows so that each tap does one gather and one copy for the whole batch. It is
built once per forward step (on the first tap of the step) from host-side runner state only, so
no tap ever waits on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_lens.common.points import SHARDED, base_signal, tap_key
from vllm_lens.common.positions import Selector, parse_selector
from vllm_lens.spec import CaptureSpec, LensRequest

__all__ = [
    "CaptureGroup", "CaptureOwner", "RequestSlice", "StepPlan", "device_index", "final_window",
    "select_rows",
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
    """Rows ``[lo, hi)`` of a capture group's staging tensor belong to this request."""

    req_id: str
    key: str
    lo: int
    hi: int
    positions: np.ndarray
    """Absolute token positions of those rows."""
    reduce: str | None
    window: Selector | None = None
    """The request's position selector, when its exact rows are known only at fetch time
    (``generated`` / ``all`` with a negative index): the rows kept meanwhile are a superset."""
    n_prompt: int = 0
    signal: str = "residual_stream"


@dataclass
class CaptureGroup:
    """One step's capture for the requests that want the same layers (of this rank).

    Each of those layers' taps gathers the group's rows into its slice of ``staging``; the
    store hands each owner its rows once the step is over (``CaptureStore.settle``).
    """

    layers: tuple[int, ...]
    """Ascending; ``staging[i]`` holds layer ``layers[i]``."""
    signal: str
    """What is captured (``CaptureSpec.signal``); every owner shares it."""
    rows: torch.Tensor | slice
    """Row indices on the hidden states' device, or a slice when the rows are contiguous."""
    owners: list[CaptureOwner]
    n_rows: int
    staging: torch.Tensor | None = None
    """``[len(layers), n_rows, *row shape]`` on the host; allocated by the first tap that
    fills it."""
    filled: set[int] = field(default_factory=set)
    """Indices (into ``layers``) whose rows were written this step."""
    complete: bool = False
    """Set when every layer's rows were written: a group that is not complete when its step is
    over fails its requests (a tap that did not run never yields partial rows)."""
    ready: Any = None
    """On an accelerator: a ``torch.Event`` recorded after the last layer's copy to the host."""
    failed: bool = False
    """A layer's capture raised: later layers skip the group and nothing is filed."""
    sae: Any = None
    """For an SAE feature capture (``points.SAE_PREFIX``): ``(SAE on the device, top_k,
    reconstruction)``; its rows are encoded and only the top features staged."""
    target_site: str | None = None
    """A transcoder's reconstruction: the site of the point it predicts, where its rows are
    encoded (``capture.capture_layer``); they are kept at its input site until then."""
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    """Layer index -> the transcoder's input rows of this step, until ``target_site``."""
    readout: Any = None
    """An SAE feature capture with ``attribution``: the model's ``worker.readout.Readout``.
    Its encoded rows wait in ``encoded`` for the last layer's ``post`` site, where each row's
    final-norm scale is appended before they are staged (``capture.READOUT``)."""
    encoded: torch.Tensor | None = None


def select_rows(spec: CaptureSpec, pos0: int, n_rows: int, n_prompt: int) -> np.ndarray:
    """Offsets (within a request's slice) of the rows ``spec`` selects, ascending.

    The slice covers absolute positions ``pos0 .. pos0 + n_rows - 1``. For selectors whose end
    is not known yet (``"generated[-5:]"``) this is a superset, trimmed at fetch time.

    >>> select_rows(CaptureSpec(layers=(0,), positions="prompt"), 3, 4, 5)
    array([0, 1])
    >>> select_rows(CaptureSpec(layers=(0,), positions=(0, 4, 6)), 3, 4, 5)
    array([1, 3])
    >>> select_rows(CaptureSpec(layers=(0,), positions="prompt[1:-1]"), 0, 6, 5)
    array([1, 2, 3])
    """
    sel = spec.positions
    if sel == "all":
        return np.arange(n_rows)
    if isinstance(sel, tuple):
        positions = np.arange(pos0, pos0 + n_rows)
        return np.flatnonzero(np.isin(positions, np.asarray(sel, dtype=np.int64)))
    selector = parse_selector(sel)
    assert selector is not None, sel  # validated in the front end
    lo, hi = selector.bounds(n_prompt)
    if selector.keep_last is not None and selector.base == "all":
        # A window at the end: the request ends at or after the last prompt position of this
        # step, so rows more than keep_last before it can never be selected.
        lo = max(lo, min(pos0 + n_rows, n_prompt) - selector.keep_last)
    first = max(lo - pos0, 0)
    last = n_rows if hi is None else min(hi - pos0, n_rows)
    return np.arange(first, max(first, last))


def final_window(spec: CaptureSpec) -> Selector | None:
    """The selector to re-apply at fetch time, or ``None`` when the rows kept are exact."""
    if isinstance(spec.positions, tuple):
        return None
    selector = parse_selector(spec.positions)
    if selector is None or selector.base == "prompt":
        return None
    if (selector.start or 0) >= 0 and (selector.stop is None or selector.stop >= 0):
        return None
    return selector


@dataclass
class StepPlan:
    """Everything the taps of one forward step need; only the capture groups' staging
    fields change after it is built (the taps fill them)."""

    slices: list[RequestSlice]
    groups: list[CaptureGroup] = field(default_factory=list)
    """This step's capture groups (disjoint sets of requests)."""
    capture: dict[tuple[int, str], list[tuple[CaptureGroup, int]]] = field(
        default_factory=dict)
    """(layer, tap key) -> (group, index of the layer in ``group.layers``) for every group
    capturing there (``points.tap_key``; places nobody captures at are absent)."""
    steer: dict[tuple[int, str], Any] = field(default_factory=dict)
    """(layer, site) -> ``steer.SteerGroup`` (places nobody steers at are absent)."""
    hook_calls: list[Any] = field(default_factory=list)
    """``hooks.HookCall`` per request with hooks in this step."""
    hook_layers: frozenset[tuple[int, str]] = frozenset()
    """(layer, site) pairs where some hook of this step runs."""
    monitors: dict[tuple[int, str], list[Any]] = field(default_factory=dict)
    """(layer, site) -> (slice, ``monitors.MonitorState``) per request monitored there."""
    attention: dict[int, list[tuple[RequestSlice, Any]]] = field(default_factory=dict)
    """Layer -> (slice, ``attention_steering.RequestAttentionSteer``) per request whose
    attention is steered there."""
    replace_in: dict[tuple[int, str], list[Any]] = field(default_factory=dict)
    """(layer, site) -> ``replacement.ReplacementGroup`` per group of requests whose MLP a
    transcoder replaces alike, at the transcoder's input site."""
    replace_out: dict[tuple[int, str], list[Any]] = field(default_factory=dict)
    """The same at the MLP's output site."""
    stops: list[tuple[str, Any]] = field(default_factory=list)
    """(request id, ``monitors.MonitorState``) of the requests a ``stop`` monitor may end."""
    faults: bool = False
    """Some request of this step asked for an injected fault (test suite only)."""

    @property
    def empty(self) -> bool:
        return not self.slices and not self.hook_calls and not self.replace_in

    @functools.cached_property
    def slice_by_req(self) -> dict[str, RequestSlice]:
        return {s.req_id: s for s in self.slices}

    @classmethod
    def build(
        cls, slices: list[RequestSlice], device: torch.device, capture_layers: frozenset[int],
        shard_layers: frozenset[int] | None = None, *, split: bool,
    ) -> StepPlan:
        """Group capture rows by the set of layers wanted, for the layers this rank captures:
        ``capture_layers`` (its pipeline stage's layers on TP rank 0, none elsewhere), and
        for signals each TP rank holds a part of (``points.SHARDED``) ``shard_layers`` (its
        stage's layers on every rank; default: ``capture_layers``). ``split``: the model's layout
        (``points``)."""
        plan = cls(slices=slices)
        if shard_layers is None:
            shard_layers = capture_layers
        if not capture_layers and not shard_layers:
            return plan
        by_layers: dict[tuple[str, tuple[int, ...]],
                        list[tuple[RequestSlice, CaptureSpec, np.ndarray]]] = {}
        for s in slices:
            for spec in (*s.lens.captures, *s.lens.sae_captures):
                sharded = base_signal(spec.signal) in SHARDED
                layers = _local_layers(spec.layers, shard_layers if sharded else capture_layers)
                offsets = select_rows(spec, s.pos0, s.end - s.start, s.n_prompt)
                if layers and offsets.size:
                    by_layers.setdefault((spec.signal, layers), []).append((s, spec, offsets))
        for (signal, layers), members in by_layers.items():
            group = _make_group(signal, layers, members, device)
            plan.groups.append(group)
            key = tap_key(signal, split=split)
            for index, layer in enumerate(layers):
                plan.capture.setdefault((layer, key), []).append((group, index))
        return plan


@functools.lru_cache(maxsize=1024)
def _local_layers(layers: tuple[int, ...], capture_layers: frozenset[int]) -> tuple[int, ...]:
    """The requested layers this rank captures (asked for every request in every step)."""
    return tuple(layer for layer in layers if layer in capture_layers)


def _make_group(signal: str, layers: tuple[int, ...],
                members: list[tuple[RequestSlice, CaptureSpec, np.ndarray]],
                device: torch.device) -> CaptureGroup:
    owners = []
    lo = 0
    for s, spec, offsets in members:
        owners.append(CaptureOwner(s.req_id, s.lens.key, lo, lo + offsets.size,
                                   offsets + s.pos0, spec.reduce, final_window(spec),
                                   s.n_prompt, signal))
        lo += offsets.size
    all_rows = np.concatenate([offsets + s.start for s, _, offsets in members])
    first, last = int(all_rows[0]), int(all_rows[-1])
    if last - first + 1 == all_rows.size and np.all(np.diff(all_rows) == 1):
        rows: torch.Tensor | slice = slice(first, last + 1)
    else:
        rows = device_index(all_rows, device)
    return CaptureGroup(layers=layers, signal=signal, rows=rows, owners=owners,
                        n_rows=all_rows.size)
