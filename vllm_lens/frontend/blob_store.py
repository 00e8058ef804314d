"""Server-side store behind the binary transport (runs in: API server).

Activations sent by handle wait here until the client fetches them. The store is bounded in
bytes and every entry expires; a new entry that does not fit is refused (``CapacityError``,
HTTP 503 naming the setting) rather than another client's entries being evicted to make room:
a handle a response named stays readable until it is fetched, deleted or expired. Handles are 256-bit random tokens, so a
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

from vllm_lens.errors import CapacityError

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
        """Store ``data``; returns its handle.

        Raises:
            ValueError: ``data`` is larger than the whole store.
            CapacityError: it does not fit beside the entries held now.
        """
        if len(data) > self.max_bytes:
            raise ValueError(
                f"activations of {len(data)} bytes exceed the binary store's capacity of "
                f"{self.max_bytes} bytes (VLLM_LENS_HTTP_STORE_MAX_BYTES)"
            )
        handle = secrets.token_urlsafe(32)
        with self._lock:
            self._expire(time.monotonic())
            if self._nbytes + len(data) > self.max_bytes:
                raise CapacityError(
                    f"the binary store holds {self._nbytes:,} of its {self.max_bytes:,} bytes "
                    f"in {len(self._blobs)} responses not fetched yet, and these activations "
                    f"({len(data):,} bytes) do not fit (VLLM_LENS_HTTP_STORE_MAX_BYTES); fetch "
                    "or delete earlier handles, let them expire (VLLM_LENS_HTTP_STORE_TTL_S), "
                    "or use activations_transport 'json'",
                    setting="VLLM_LENS_HTTP_STORE_MAX_BYTES")
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
