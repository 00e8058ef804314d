"""Per-request capture buffers on the worker (runs in: worker).

Captured rows wait here, on the CPU, until the front end fetches them when the request
finishes. During a step the taps fill one staging tensor per capture group (``stage``); once
the step is over, ``settle`` copies each request's rows out of it into the request's own entry,
so that an entry does not keep other requests' rows alive. One exception saves that copy where
it matters most, a dataset job's prompts read and finished in one step: when the step settles
as its requests are fetched, the ones whose rows go to one capture sink's dataset keep views
of a host staging tensor if together they own at least half of its rows. The tensor then
holds at most twice the bytes counted for them, for as long as that dataset's shards hold them
(``_viewed``). (On the CPU backend the staging tensor views a pooled buffer up to 1/8 larger,
``staging_pool``: 2.25 times; a request owning a whole staging tensor keeps it, 1.125 times.)
On an accelerator the staging tensors are filled by asynchronous copies into pinned memory,
which is always copied out, and a group settles once its ``ready`` event has completed.

Entries are keyed by (lens key, vLLM request id, signal): the lens key is unique per user
request, a request sampled ``n > 1`` times runs as ``n`` engine requests that share it, and a
request capturing several signals (tap points, Q/K) keeps one entry per signal.

The total size is bounded by admission, not eviction: rows that would take the store past its
byte budget are refused, and the request they belong to fails (the caller is told), while rows
already held — a finished request's above all — stay until they are fetched. Only entries whose
request finished and was never fetched within the grace period (aborted, or a front end that
went away) are dropped, and those requests fail too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_lens.common.positions import ROLLING_SLACK, Selector
from vllm_lens.worker.plan import CaptureGroup

__all__ = ["CaptureStore", "Entry"]


@dataclass
class Entry:
    req_id: str
    layers: tuple[int, ...]
    reduce: str | None
    window: Selector | None = None
    """Re-applied at fetch time (see ``CaptureOwner.window``)."""
    n_prompt: int = 0
    signal: str = "residual_stream"
    floor: int = 0
    """Positions below this may have been trimmed (a rolling window: ``Selector.keep_last``)."""
    top: int = -1
    """Highest position filed so far."""
    positions: list[np.ndarray] = field(default_factory=list)
    """One array of absolute positions per step that captured rows."""
    chunks: list[torch.Tensor] = field(default_factory=list)
    """One ``[n_layers, rows, *row]`` CPU tensor per step, aligned with ``positions``."""
    nbytes: int = 0
    finished_at: float | None = None
    taken: int = 0
    """Positions below this were streamed already (``CaptureStore.take``): later copies of
    them (a preempted request recomputed) are dropped."""


class CaptureStore:
    """Bounded map (lens key, request id, signal) -> captured rows."""

    def __init__(self, max_bytes: int, finished_ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.finished_ttl_s = finished_ttl_s
        self._entries: dict[tuple[str, str, str], Entry] = {}
        self._pending: list[CaptureGroup] = []
        self._nbytes = 0
        # Lens keys already fetched or released -> when. Their requests may still run one
        # surplus step (the scheduler can schedule a step before it sees the stop), whose rows
        # must not open a new entry.
        self._closed: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stage(self, group: CaptureGroup) -> None:
        """Take ``group``'s rows once its step is over (see ``settle``)."""
        self._pending.append(group)

    def settle(self, wait: bool = False,
               destination: Callable[[str, str], Hashable | None] | None = None
               ) -> list[tuple[str, str, str]]:
        """File the rows of finished steps into their requests' entries.

        Called between steps: every staged group whose copies have completed (at once on the
        CPU; ``wait`` blocks for the accelerator) is split per request. A group that failed
        is dropped (its requests failed already); one whose step did not write every layer's
        rows (a tap did not run) fails its requests. ``destination(lens key, request id)``
        names the capture sink's dataset of a request being fetched now (see ``_viewed``).

        Returns (lens key, request id, problem) for each request whose rows could not be
        filed: their rows are gone and the caller fails those requests.
        """
        pending, self._pending = self._pending, []
        failed: list[tuple[str, str, str]] = []
        refused: set[tuple[str, str]] = set()
        for group in pending:
            if group.failed:
                continue
            if not group.complete:
                missing = [layer for i, layer in enumerate(group.layers)
                           if i not in group.filled]
                failed.extend((o.key, o.req_id, f"its {group.signal} rows of layers {missing} "
                               "were not produced in a step (their tap did not run)")
                              for o in group.owners)
                continue
            try:
                if group.ready is not None and not group.ready.query():
                    if not wait:
                        self._pending.append(group)
                        continue
                    group.ready.synchronize()
                failed.extend(self._file(group, refused, destination))
            except Exception:
                failed.extend((o.key, o.req_id, "its captured rows could not be filed")
                              for o in group.owners)
        return failed

    def _file(self, group: CaptureGroup, refused: set[tuple[str, str]],
              destination: Callable[[str, str], Hashable | None] | None
              ) -> list[tuple[str, str, str]]:
        """File ``group``'s rows; returns the owners refused for the byte budget."""
        staging = group.staging
        assert staging is not None
        pinned = staging.is_pinned()
        whole = len(group.owners) == 1 and not pinned
        row_bytes = staging[:, :1].numel() * staging.element_size()
        # First the byte budget: who is filed, and with how many rows.
        over, admitted, added = [], [], 0
        for owner in group.owners:
            ident = (owner.key, owner.req_id)
            if owner.key in self._closed or ident in refused:
                continue  # a surplus step after the fetch, or a request refused already
            size = (owner.hi - owner.lo) * row_bytes
            if self._nbytes + added + size > self.max_bytes:
                refused.add(ident)
                self.discard(*ident)
                over.append((*ident, self._over_budget(size)))
                continue
            entry = self._entries.get((*ident, group.signal))
            fresh = None
            positions = owner.positions
            if entry is not None and entry.taken and positions.size \
                    and int(positions.min()) < entry.taken:
                fresh = positions >= entry.taken  # streamed already: each position once
                size = int(fresh.sum()) * row_bytes
            added += size
            admitted.append((owner, fresh, size))
        viewed = set() if whole or pinned or destination is None \
            else _viewed(staging, admitted, destination)
        for owner, fresh, size in admitted:
            ident = (owner.key, owner.req_id)
            entry = self._entries.get((*ident, group.signal))
            if entry is None:
                entry = self._entries[(*ident, group.signal)] = Entry(
                    owner.req_id, group.layers, owner.reduce, owner.window, owner.n_prompt,
                    group.signal)
            # Copied out (unless the request owns the whole tensor, or is viewed: see
            # ``_viewed``): pinned memory is scarce, and a view would keep the other requests'
            # rows alive.
            rows = staging if whole else staging[:, owner.lo : owner.hi]
            positions = owner.positions
            if fresh is not None:
                rows, positions = rows[:, torch.from_numpy(fresh)], positions[fresh]
            elif not whole and id(owner) not in viewed:
                rows = rows.clone()
            entry.positions.append(positions)
            entry.chunks.append(rows)
            entry.nbytes += size
            self._nbytes += size
            if positions.size:
                entry.top = max(entry.top, int(positions.max()))
            if entry.window is not None and entry.window.keep_last is not None:
                self._trim(entry, entry.top + 1 - entry.window.keep_last - ROLLING_SLACK)
        return over

    def _trim(self, entry: Entry, below: int) -> None:
        """Drop the chunks whose positions all lie below ``below`` (a rolling window keeps
        only its last positions while the request runs)."""
        kept_positions, kept_chunks = [], []
        for positions, chunk in zip(entry.positions, entry.chunks):
            if positions.size and int(positions.max()) < below:
                size = chunk.numel() * chunk.element_size()
                entry.nbytes -= size
                self._nbytes -= size
                entry.floor = max(entry.floor, int(positions.max()) + 1)
            else:
                kept_positions.append(positions)
                kept_chunks.append(chunk)
        entry.positions, entry.chunks = kept_positions, kept_chunks

    def _over_budget(self, size: int) -> str:
        return (f"its captured rows would take this worker past VLLM_LENS_WORKER_MAX_BYTES "
                f"({self.max_bytes:,} bytes; {self._nbytes:,} held for {len(self._entries)} "
                f"requests, {size:,} more asked): capture stopped. Capture fewer layers or "
                "positions, fetch results sooner, or raise the setting")

    def pop(self, key: str) -> dict[str, dict[str, Entry]]:
        """Remove every entry of lens key ``key`` (request id -> signal -> entry) and ignore
        later rows."""
        found: dict[str, dict[str, Entry]] = {}
        for ident in [i for i in self._entries if i[0] == key]:
            entry = self._entries.pop(ident)
            self._nbytes -= entry.nbytes
            found.setdefault(ident[1], {})[ident[2]] = entry
        self._closed.pop(key, None)  # re-inserted at the end: the dict stays in time order
        self._closed[key] = time.monotonic()
        return found

    def take(self, below: Mapping[str, Mapping[str, int]]
             ) -> dict[str, dict[str, dict[str, Entry]]]:
        """Remove and return, for each lens key of ``below``, its rows at positions below
        ``below[key][prefix]`` (the request ids starting with ``prefix``), as entries of their
        own (lens key -> request id -> signal -> entry); the entries stay open for later rows
        (a streamed request).

        Rows of positions taken once are never returned again (a preempted request computes
        them anew): each position streams once."""
        found: dict[str, dict[str, dict[str, Entry]]] = {}
        for ident, entry in self._entries.items():
            prefixes = below.get(ident[0])
            if prefixes is None:
                continue
            upto = next((n for p, n in prefixes.items() if ident[1].startswith(p)), None)
            if upto is None or upto <= entry.taken:
                continue
            taken = Entry(entry.req_id, entry.layers, entry.reduce, entry.window,
                          entry.n_prompt, entry.signal, floor=entry.floor)
            kept_positions, kept_chunks = [], []
            for positions, chunk in zip(entry.positions, entry.chunks):
                fresh = positions >= entry.taken
                now = fresh & (positions < upto)
                later = fresh & (positions >= upto)
                if now.any():
                    taken.positions.append(positions[now])
                    taken.chunks.append(chunk if now.all() else chunk[:, torch.from_numpy(now)])
                if later.any():
                    kept_positions.append(positions[later])
                    kept_chunks.append(chunk if later.all()
                                       else chunk[:, torch.from_numpy(later)].clone())
            entry.taken = upto
            before = entry.nbytes
            entry.positions, entry.chunks = kept_positions, kept_chunks
            entry.nbytes = sum(c.numel() * c.element_size() for c in kept_chunks)
            self._nbytes -= before - entry.nbytes
            if taken.chunks:
                found.setdefault(ident[0], {}).setdefault(ident[1], {})[ident[2]] = taken
        return found

    def discard(self, key: str, req_id: str) -> None:
        """Drop one request's rows (it failed); rows a running step still files for it are
        dropped at fetch."""
        for ident in [i for i in self._entries if i[0] == key and i[1] == req_id]:
            self._nbytes -= self._entries.pop(ident).nbytes

    def mark_finished(self, live_req_ids: Container[str]) -> list[tuple[str, str]]:
        """Stamp entries whose request left the batch, then drop those that waited past the
        grace period without a fetch (never to make room: see ``_file``).

        Returns the (lens key, request id) of the entries dropped (once per request): their
        requests must fail rather than come back with fewer rows.
        """
        now = time.monotonic()
        ttl = self.finished_ttl_s
        while self._closed:
            key, closed_at = next(iter(self._closed.items()))
            if now - closed_at <= ttl:
                break
            del self._closed[key]
        dropped = []
        for ident, entry in list(self._entries.items()):
            if entry.finished_at is None:
                if entry.req_id not in live_req_ids:
                    entry.finished_at = now
            elif now - entry.finished_at > ttl:
                del self._entries[ident]
                self._nbytes -= entry.nbytes
                if ident[:2] not in dropped:
                    dropped.append(ident[:2])
        return dropped


def _viewed(staging: torch.Tensor, admitted: list[tuple[Any, Any, int]],
            destination: Callable[[str, str], Hashable | None]) -> set[int]:
    """Ids of the owners whose rows stay views of ``staging``: those of the one destination
    (a capture sink's dataset, ``destination(lens key, request id)``; ``None`` for a request
    not being fetched now or returning its rows) that holds at least half of its rows, so
    the tensor they keep alive is at most twice the bytes counted for them, in that
    dataset's shards until written. Rows already streamed in part are copied anyway."""
    by_destination: dict[Hashable, list[Any]] = {}
    for owner, fresh, _ in admitted:
        if fresh is None and (where := destination(owner.key, owner.req_id)) is not None:
            by_destination.setdefault(where, []).append(owner)
    best = max(by_destination.values(), key=lambda owners: sum(o.hi - o.lo for o in owners),
               default=[])
    if 2 * sum(o.hi - o.lo for o in best) < staging.shape[1]:
        return set()
    return {id(o) for o in best}
