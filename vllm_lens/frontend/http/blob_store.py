"""Server-side store behind the binary transport (runs in: front end).

Every API server process of one server shares it.

Activations sent by handle wait here until the client fetches them. The store is a directory
(``blobs/`` in the server's shared directory, ``http.shared_dir``), one file per handle,
so that a follow-up ``GET`` / ``DELETE`` landing on another API server process finds what the
first one stored. Only files named like a handle are ever read, counted or removed.

The store is bounded in bytes and every entry expires (its file's mtime is its expiry); a new
entry that does not fit is refused (``CapacityError``, HTTP 503 naming the setting) rather
than another client's entries being evicted to make room: a handle a response named stays
readable until it is fetched, deleted or expired. An entry is written beside the store first
and admitted under a lock file (the other processes wait only for the check and the rename,
never for a write). Handles are 256-bit random tokens, so a client can only read what its own
response named. Expired entries, and files of writes that never finished, are removed lazily
on every ``put`` and ``stats``, so an idle server holds at most what was stored before it went
idle until its next request. Reads hand out an open file, which the caller streams.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from vllm_lens import envs
from vllm_lens.errors import CapacityError
from vllm_lens.frontend.http import shared_dir

__all__ = ["BlobStore", "store"]

_LOCK = ".lock"
#: ``secrets.token_urlsafe(32)``: 43 characters of the URL-safe base64 alphabet.
_HANDLE = re.compile(r"^[A-Za-z0-9_-]{43}$")
_PARTIAL = re.compile(r"^\.([A-Za-z0-9_-]{43})\.tmp$")


class BlobStore:
    """Bounded, expiring map of unguessable handle -> bytes, kept in the directory ``root``."""

    def __init__(self, root: str | os.PathLike, max_bytes: int, ttl_s: float) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def put(self, data: bytes) -> str:
        """Store ``data``; returns its handle.

        Raises:
            ValueError: ``data`` is larger than the whole store.
            CapacityError: it does not fit beside the entries held now (or the directory's
                file system is full).
        """
        if len(data) > self.max_bytes:
            raise ValueError(
                f"activations of {len(data)} bytes exceed the binary store's capacity of "
                f"{self.max_bytes} bytes (VLLM_LENS_HTTP_STORE_MAX_BYTES)"
            )
        handle = secrets.token_urlsafe(32)
        tmp = self.root / f".{handle}.tmp"
        try:
            try:
                tmp.write_bytes(data)
            except OSError as exc:
                raise CapacityError(
                    f"the binary store could not keep these activations ({len(data):,} "
                    f"bytes): {exc.strerror}; use activations_transport 'json', or give "
                    "VLLM_LENS_HTTP_STORE_DIR more room",
                    setting="VLLM_LENS_HTTP_STORE_DIR") from None
            with self._locked():
                entries, nbytes = self._live()
                if nbytes + len(data) > self.max_bytes:
                    raise CapacityError(
                        f"the binary store holds {nbytes:,} of its {self.max_bytes:,} bytes "
                        f"in {entries} responses not fetched yet, and these activations "
                        f"({len(data):,} bytes) do not fit (VLLM_LENS_HTTP_STORE_MAX_BYTES); "
                        "fetch or delete earlier handles, let them expire "
                        "(VLLM_LENS_HTTP_STORE_TTL_S), or use activations_transport 'json'",
                        setting="VLLM_LENS_HTTP_STORE_MAX_BYTES")
                expires = time.time() + self.ttl_s
                os.utime(tmp, (expires, expires))
                os.replace(tmp, self.root / handle)
        finally:
            tmp.unlink(missing_ok=True)
        return handle

    def open(self, handle: str, *, delete: bool = False) -> BinaryIO | None:
        """An open file of the entry's bytes (the caller reads and closes it), or ``None`` for
        a missing, expired or malformed handle; with ``delete`` the entry is removed at once
        (the open file still reads it)."""
        path = self._path(handle)
        if path is None:
            return None
        try:
            f = open(path, "rb")  # noqa: SIM115 - handed to the caller
        except FileNotFoundError:
            return None
        if os.fstat(f.fileno()).st_mtime <= time.time():
            f.close()
            path.unlink(missing_ok=True)
            return None
        if delete:
            path.unlink(missing_ok=True)
        return f

    def get(self, handle: str) -> bytes | None:
        """The entry's bytes (``open`` for large ones: this reads them into memory)."""
        f = self.open(handle)
        if f is None:
            return None
        with f:
            return f.read()

    def delete(self, handle: str) -> bool:
        path = self._path(handle)
        if path is None:
            return False
        try:
            expired = path.stat().st_mtime <= time.time()
            path.unlink()
        except FileNotFoundError:
            return False
        return not expired

    def stats(self) -> dict[str, int]:
        with self._locked():
            entries, nbytes = self._live()
        return {"entries": entries, "bytes": nbytes}

    def _path(self, handle: str) -> Path | None:
        return self.root / handle if isinstance(handle, str) and _HANDLE.match(handle) else None

    def _live(self) -> tuple[int, int]:
        """(entries, bytes) of the entries not expired; expired ones, and partial writes older
        than an entry lives, are removed."""
        now, entries, nbytes = time.time(), 0, 0
        with os.scandir(self.root) as found:
            for entry in found:
                partial = _PARTIAL.match(entry.name)
                if not _HANDLE.match(entry.name) and partial is None:
                    continue
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # fetched and deleted meanwhile
                    continue
                if partial is not None:  # a write that never finished (a killed process)
                    if stat.st_mtime < now - self.ttl_s:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                    continue
                if stat.st_mtime <= now:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    continue
                entries += 1
                nbytes += stat.st_size
        return entries, nbytes

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Admission across the API server processes sharing the directory."""
        with open(self.root / _LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


_store: BlobStore | None = None


def store() -> BlobStore:
    """The binary-transport store this server's API processes share (opened on first use)."""
    global _store
    if _store is None:
        _store = BlobStore(shared_dir.server_dir() / "blobs", envs.http_store_max_bytes(),
                           envs.http_store_ttl_s())
    return _store
