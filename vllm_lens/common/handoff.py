"""Moving a fetched capture from a worker to the front end (runs in: front end, worker).

A capture is a small header (layers, positions) and one large tensor. ``collective_rpc``
results travel worker -> engine core -> front end, serialized and copied at each hop, and
compressing nearly incompressible float activations costs more CPU than it saves; for captures
of hundreds of MB that dominated the cost of a fetch. So there are two routes:

- **Inline** (small captures, or a front end on another host, e.g. Ray): ``wire.dumps`` bytes
  (msgpack, tensors uncompressed) in the RPC result.
- **Shared memory** (the front end shares the worker's host and ``/dev/shm``, vLLM's usual
  multiprocess setup): the worker writes the raw tensor to a private file there (mode 0600,
  random name) laid out as ``magic | header length | header | raw tensor bytes``, and returns
  only its path. The front end opens the file, deletes it, and reads it straight into the
  tensor it returns: one copy, no decompression. Reading rather than mapping matters:
  a mapping would hold tmpfs pages for as long as the caller keeps the tensor, and
  ``/dev/shm`` is small in containers and shared with vLLM's own queues. For the same reason
  the worker only takes this route while it leaves a quarter of ``/dev/shm`` free, and a write
  that fails (a full ``/dev/shm``) falls back to the inline route, never a crash.

Files are deleted on every path the front end takes (``discard`` for results it will not
read, e.g. of a cancelled request); files orphaned by a process that died in between are
swept by the next worker that starts (``sweep``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import struct
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from vllm_lens.common import wire
from vllm_lens.common.messages import FetchAnswer
from vllm_lens.errors import WireError

logger = logging.getLogger(__name__)

__all__ = ["Handoff", "discard", "discard_fetched", "host_id", "receive", "send", "sweep"]

#: Tensors at least this large go through a file when the front end shares the host.
INLINE_MAX_BYTES = 1 << 20
_PREFIX = "vllm_lens_"
_MAGIC = b"VLLMLENS"
_LENGTH = struct.Struct("<Q")
_DATA_ALIGN = 64
#: The file route is taken only if at least this share of the directory stays free after it.
_KEEP_FREE = 0.25

#: What ``send`` returns: ``wire`` bytes, or ``{"path": ...}`` of a file holding the capture.
Handoff = bytes | dict[str, str]


def _directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@functools.cache
def host_id() -> str:
    """Equal ids mean the two processes see the same handoff directory (same machine boot,
    same mount: containers on one host have their own ``/dev/shm``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    directory = _directory()
    try:
        stat = directory.stat()
        mount = f"{stat.st_dev}:{stat.st_ino}"
    except OSError:
        mount = ""
    return f"{socket.gethostname()}/{boot}/{directory}/{mount}"


def send(header: dict[str, Any], tensor: torch.Tensor, receiver_host: str | None) -> Handoff:
    """Package a capture (``header``: plain msgpack values and small tensors; ``tensor``: the
    large one, on the CPU) for a front end on ``receiver_host`` (``None``: unknown host)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= INLINE_MAX_BYTES and receiver_host == host_id() and _room_for(nbytes):
        try:
            return {"path": str(_write_file(header, tensor))}
        except OSError as exc:
            logger.warning("vllm-lens: cannot hand %d bytes over through %s (%s); sending them "
                           "inline instead", nbytes, _directory(), exc)
    return wire.dumps({"header": header, "tensor": tensor}, compress=False)


def receive(handoff: Handoff) -> tuple[dict[str, Any], torch.Tensor]:
    """The header and tensor behind ``handoff``; a file is deleted once opened."""
    if isinstance(handoff, (bytes, bytearray)):
        obj = wire.loads(handoff)
        return obj["header"], obj["tensor"]
    path = _own_path(handoff)
    try:
        fd = os.open(path, os.O_RDONLY)
    finally:
        path.unlink(missing_ok=True)
    with os.fdopen(fd, "rb", buffering=0) as file:
        return _read(file, os.fstat(fd).st_size)


def discard(handoff: Handoff) -> None:
    """Delete the file behind ``handoff``, if any (a result the front end will not read)."""
    if isinstance(handoff, dict):
        _own_path(handoff).unlink(missing_ok=True)


def discard_fetched(fetched: FetchAnswer) -> None:
    """``discard`` every capture of one rank's ``lens_fetch`` answer."""
    for handoff in fetched.handoffs():
        discard(handoff)


def sweep(max_age_s: float = 3600.0) -> int:
    """Delete this user's handoff files older than ``max_age_s``; returns how many.

    A front end reads a file within moments of its writing, so an old one was orphaned by a
    process that died in between, and would otherwise hold memory until the machine reboots.
    """
    directory, cutoff, removed = _directory(), time.time() - max_age_s, 0
    for path in directory.glob(f"{_PREFIX}*"):
        try:
            stat = path.stat()
            if stat.st_uid == os.getuid() and stat.st_mtime < cutoff:
                path.unlink()
                removed += 1
        except OSError:
            continue  # another process removed it first, or it is not ours to remove
    return removed


def _own_path(handoff: dict[str, str]) -> Path:
    path = Path(handoff["path"])
    if path.parent != _directory() or not path.name.startswith(_PREFIX):
        raise ValueError(f"vllm-lens: refusing to touch unexpected handoff path {path}")
    return path


def _room_for(nbytes: int) -> bool:
    try:
        fs = os.statvfs(_directory())
    except OSError:
        return False
    return (fs.f_bavail * fs.f_frsize - nbytes) >= _KEEP_FREE * fs.f_blocks * fs.f_frsize


def _write_file(header: dict[str, Any], tensor: torch.Tensor) -> Path:
    meta = wire.dumps({"header": header, "dtype": wire.dtype_name(tensor.dtype),
                       "shape": list(tensor.shape)})
    prefix = _MAGIC + _LENGTH.pack(len(meta)) + meta
    prefix += bytes(_data_offset(len(meta)) - len(prefix))
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    path = _directory() / f"{_PREFIX}{uuid.uuid4().hex}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # write(), not a shared mapping: a full tmpfs then fails with ENOSPC, not SIGBUS.
        _write_all(fd, memoryview(prefix))
        _write_all(fd, memoryview(data))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return path


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        view = view[os.write(fd, view):]


def _read(file: Any, size: int) -> tuple[dict[str, Any], torch.Tensor]:
    start = len(_MAGIC) + _LENGTH.size
    lead = _read_exactly(file, start) if size >= start else b""
    if lead[: len(_MAGIC)] != _MAGIC:
        raise WireError("handoff file is not a vllm-lens capture")
    (meta_len,) = _LENGTH.unpack(lead[len(_MAGIC) :])
    offset = _data_offset(meta_len)
    if size < offset:
        raise WireError(f"handoff file of {size} bytes cannot hold a {meta_len}-byte header")
    meta = wire.loads(_read_exactly(file, offset - start)[:meta_len])
    try:
        header, dtype = meta["header"], wire.DTYPES[meta["dtype"]]
        shape = tuple(int(s) for s in meta["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed handoff header: {exc!r}") from None
    if any(s < 0 for s in shape):
        raise WireError(f"malformed handoff header: negative shape {list(shape)}")
    tensor = torch.empty(shape, dtype=dtype)
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    if size - offset != data.nbytes:
        raise WireError(f"handoff file holds {size - offset} bytes of data, but dtype "
                        f"{meta['dtype']} and shape {list(shape)} need {data.nbytes}")
    _read_into(file, memoryview(data))
    return header, tensor


def _read_exactly(file: Any, n: int) -> bytes:
    buffer = bytearray(n)
    _read_into(file, memoryview(buffer))
    return bytes(buffer)


def _read_into(file: Any, view: memoryview) -> None:
    """Fill ``view`` from ``file`` (``readinto`` may return fewer bytes than asked)."""
    done = 0
    while done < view.nbytes:
        got = file.readinto(view[done:])
        if not got:
            raise WireError(f"handoff file ended after {done} of {view.nbytes} bytes")
        done += got


def _data_offset(meta_len: int) -> int:
    end = len(_MAGIC) + _LENGTH.size + meta_len
    return -(-end // _DATA_ALIGN) * _DATA_ALIGN
