"""Server-side store behind the binary transport (runs in: API server; every API server
process of one server shares it).

Activations sent by handle wait here until the client fetches them. The store is a directory,
one file per handle, so that a follow-up ``GET`` / ``DELETE`` that lands on another API server
process (``vllm serve --api-server-count N``, and ``--data-parallel-size N``, which starts N of
them by default) finds what the first one stored. The process that builds the server names the
directory (``VLLM_LENS_HTTP_STORE_DIR``, inherited by the API processes it starts; an
operator may set it, e.g. to a folder on ``/dev/shm``) and removes it when it exits.

The store is bounded in bytes and every entry expires; a new entry that does not fit is
refused (``CapacityError``, HTTP 503 naming the setting) rather than another client's entries
being evicted to make room: a handle a response named stays readable until it is fetched,
deleted or expired. Admission is serialized across processes by a lock file. Handles are
256-bit random tokens, so a client can only read what its own response named. Expired entries
are dropped lazily on every ``put`` and ``stats``, so an idle server holds at most what was
stored before it went idle until its next request.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from vllm_lens.errors import CapacityError

__all__ = ["BlobStore", "shared_root"]

#: The environment variable naming the store's directory for every process of one server.
DIR_VARIABLE = "VLLM_LENS_HTTP_STORE_DIR"
_LOCK = ".lock"


def shared_root() -> Path:
    """The directory the API server processes of this server share: ``VLLM_LENS_HTTP_STORE_DIR``
    if set (by the operator, or by the process that started this one); otherwise a new one in
    the system's temporary directory, named in this process's environment so that the API
    processes it starts inherit it, and removed when this process exits."""
    named = os.environ.get(DIR_VARIABLE)
    if named:
        return Path(named)
    root = Path(tempfile.mkdtemp(prefix=f"vllm-lens-http-{os.getpid()}-"))
    os.environ[DIR_VARIABLE] = str(root)
    import atexit

    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


class BlobStore:
    """Bounded, expiring map of unguessable handle -> bytes, kept in ``root``."""

    def __init__(self, root: str | os.PathLike, max_bytes: int, ttl_s: float) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.root.mkdir(parents=True, exist_ok=True)

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
        with self._locked():
            entries, nbytes = self._live()
            if nbytes + len(data) > self.max_bytes:
                raise CapacityError(
                    f"the binary store holds {nbytes:,} of its {self.max_bytes:,} bytes "
                    f"in {entries} responses not fetched yet, and these activations "
                    f"({len(data):,} bytes) do not fit (VLLM_LENS_HTTP_STORE_MAX_BYTES); fetch "
                    "or delete earlier handles, let them expire (VLLM_LENS_HTTP_STORE_TTL_S), "
                    "or use activations_transport 'json'",
                    setting="VLLM_LENS_HTTP_STORE_MAX_BYTES")
            tmp = self.root / f".{handle}.tmp"
            try:
                tmp.write_bytes(data)
                expires = time.time() + self.ttl_s
                os.utime(tmp, (expires, expires))  # the file's mtime is its expiry
                os.replace(tmp, self.root / handle)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise CapacityError(
                    f"the binary store could not keep these activations ({len(data):,} "
                    f"bytes) in {self.root}: {exc.strerror}; use activations_transport "
                    "'json', or give VLLM_LENS_HTTP_STORE_DIR more room",
                    setting="VLLM_LENS_HTTP_STORE_DIR") from None
        return handle

    def get(self, handle: str) -> bytes | None:
        path = self._path(handle)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_mtime <= time.time():
                    path.unlink(missing_ok=True)
                    return None
                return f.read()
        except FileNotFoundError:
            return None

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
        """The file of a well-formed handle (``token_urlsafe``: no separators, no dots)."""
        if not handle or len(handle) > 128 or not all(c.isalnum() or c in "-_" for c in handle):
            return None
        return self.root / handle

    def _live(self) -> tuple[int, int]:
        """(entries, bytes) of the entries not expired; expired ones are removed."""
        now, entries, nbytes = time.time(), 0, 0
        with os.scandir(self.root) as found:
            for entry in found:
                if entry.name.startswith("."):
                    continue
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # fetched and deleted meanwhile
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
