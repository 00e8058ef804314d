"""Per-request capture buffers on the worker (runs in: worker).

Captured rows wait here, on the CPU, until the front end fetches them when the request
finishes. Entries are keyed by (lens key, vLLM request id): the lens key is unique per user
request, and a request sampled ``n > 1`` times runs as ``n`` engine requests that share it.
Entries whose request finished without being fetched (aborted, failed, or a front end that went
away) are dropped after a grace period, and the total size is bounded: past the byte budget the
oldest finished entries are evicted first.
"""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["CaptureStore", "Entry"]


@dataclass
class Entry:
    req_id: str
    reduce: str | None
    positions: list[np.ndarray] = field(default_factory=list)
    """One array of absolute positions per step that captured rows."""
    chunks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Layer -> one ``[rows, hidden]`` CPU tensor per step, aligned with ``positions``."""
    nbytes: int = 0
    finished_at: float | None = None


class CaptureStore:
    """Bounded map (lens key, request id) -> captured rows."""

    def __init__(self, max_bytes: int, finished_ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.finished_ttl_s = finished_ttl_s
        self._entries: dict[tuple[str, str], Entry] = {}
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

    def begin_step(self, key: str, req_id: str, positions: np.ndarray, reduce: str | None) -> None:
        """Open this step's chunk; the layers' ``add_rows`` calls fill it."""
        if key in self._closed:
            return
        entry = self._entries.get((key, req_id))
        if entry is None:
            entry = self._entries[(key, req_id)] = Entry(req_id=req_id, reduce=reduce)
        entry.positions.append(positions)

    def add_rows(self, key: str, req_id: str, layer: int, rows: torch.Tensor) -> None:
        entry = self._entries.get((key, req_id))
        if entry is None:  # closed: a surplus step after the fetch
            return
        entry.chunks.setdefault(layer, []).append(rows)
        size = rows.numel() * rows.element_size()
        entry.nbytes += size
        self._nbytes += size

    def pop(self, key: str) -> dict[str, Entry]:
        """Remove every entry of lens key ``key`` (request id -> entry) and ignore later rows."""
        found = {req_id: e for (k, req_id), e in self._entries.items() if k == key}
        for req_id, entry in found.items():
            del self._entries[(key, req_id)]
            self._nbytes -= entry.nbytes
        self._closed[key] = time.monotonic()
        return found

    def mark_finished(self, live_req_ids: Container[str]) -> None:
        """Stamp entries whose request left the batch, then apply the TTL and byte budget."""
        now = time.monotonic()
        ttl = self.finished_ttl_s
        self._closed = {k: t for k, t in self._closed.items() if now - t <= ttl}
        for entry in self._entries.values():
            if entry.finished_at is None and entry.req_id not in live_req_ids:
                entry.finished_at = now
        finished = sorted(
            (e.finished_at, ident) for ident, e in self._entries.items() if e.finished_at is not None
        )
        for finished_at, ident in finished:
            if now - finished_at <= ttl and self._nbytes <= self.max_bytes:
                break
            entry = self._entries.pop(ident)
            self._nbytes -= entry.nbytes
