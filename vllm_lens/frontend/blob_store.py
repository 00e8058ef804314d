"""Server-side store behind the binary transport (runs in: API server).

Activations sent by handle wait here until the client fetches them. The store is bounded in
bytes and every entry expires; when a new entry would not fit, the oldest ones are evicted
first (a client that fetches promptly never notices). Handles are 256-bit random tokens, so a
client can only read what its own response named. Expired entries are dropped lazily on every
access, so an idle server holds at most what was stored before it went idle until its next
request.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["BlobStore"]


@dataclass
class _Blob:
    data: bytes
    expires_at: float


class BlobStore:
    """Bounded, expiring map of unguessable handle -> bytes."""

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._blobs: OrderedDict[str, _Blob] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes) -> str:
        """Store ``data``; returns its handle. Raises ``ValueError`` if it can never fit."""
        if len(data) > self.max_bytes:
            raise ValueError(
                f"activations of {len(data)} bytes exceed the binary store's capacity of "
                f"{self.max_bytes} bytes (VLLM_LENS_HTTP_STORE_MAX_BYTES)"
            )
        handle = secrets.token_urlsafe(32)
        with self._lock:
            self._expire(time.monotonic())
            while self._nbytes + len(data) > self.max_bytes:
                self._drop(next(iter(self._blobs)))
            self._blobs[handle] = _Blob(data, time.monotonic() + self.ttl_s)
            self._nbytes += len(data)
        return handle

    def get(self, handle: str) -> bytes | None:
        with self._lock:
            self._expire(time.monotonic())
            blob = self._blobs.get(handle)
            return None if blob is None else blob.data

    def delete(self, handle: str) -> bool:
        with self._lock:
            if handle not in self._blobs:
                return False
            self._drop(handle)
            return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._expire(time.monotonic())
            return {"entries": len(self._blobs), "bytes": self._nbytes}

    def _expire(self, now: float) -> None:
        # Entries are in insertion order and share one TTL, so expired ones come first.
        while self._blobs:
            handle, blob = next(iter(self._blobs.items()))
            if blob.expires_at > now:
                break
            self._drop(handle)

    def _drop(self, handle: str) -> None:
        self._nbytes -= len(self._blobs.pop(handle).data)
