"""Moving large captures from a worker to the front end on the same host (runs in: worker and
front end).

``collective_rpc`` results travel worker -> engine core -> front end, serialized and copied at
each hop; for captures of hundreds of MB that dominated the cost of a fetch. When the front end
runs on the worker's host (vLLM's usual multiprocess executor), the worker instead writes the
compressed payload to a private file in shared memory (``/dev/shm``, mode 0600, random name)
and returns only its path; the front end reads the file and deletes it at once. Small payloads,
and workers on another host (e.g. Ray), use the RPC result itself.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path

__all__ = ["Handoff", "host_id", "receive", "send"]

#: Payloads at least this large go through a file when the front end shares the host.
INLINE_MAX_BYTES = 1 << 20
_PREFIX = "vllm_lens_"

#: What ``send`` returns: the payload itself, or ``{"path": ...}`` of a file holding it.
Handoff = bytes | dict[str, str]


def _directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def host_id() -> str:
    """Identifies this machine's boot: equal ids mean the two processes share ``/dev/shm``."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def send(blob: bytes, receiver_host: str | None) -> Handoff:
    """Package ``blob`` for a front end on ``receiver_host`` (``None``: unknown host)."""
    if len(blob) < INLINE_MAX_BYTES or receiver_host != host_id():
        return blob
    path = _directory() / f"{_PREFIX}{uuid.uuid4().hex}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    return {"path": str(path)}


def receive(handoff: Handoff) -> bytes:
    """The payload behind ``handoff``; a file is deleted once read."""
    if isinstance(handoff, (bytes, bytearray)):
        return bytes(handoff)
    path = Path(handoff["path"])
    if path.parent != _directory() or not path.name.startswith(_PREFIX):
        raise ValueError(f"vllm-lens: refusing to read unexpected handoff path {path}")
    try:
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)
