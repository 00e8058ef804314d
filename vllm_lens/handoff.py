"""Moving a fetched capture from a worker to the front end (runs in: worker and front end).

A capture is a small header (layers, positions) and one large tensor. ``collective_rpc``
results travel worker -> engine core -> front end, serialized and copied at each hop, and
compressing nearly incompressible float activations costs more CPU than it saves; for captures
of hundreds of MB that dominated the cost of a fetch. So there are two routes:

- **Inline** (small captures, or a front end on another host, e.g. Ray): ``wire.dumps`` bytes
  (msgpack + zstd) in the RPC result.
- **Shared memory** (the front end shares the worker's host and ``/dev/shm``, vLLM's usual
  multiprocess setup): the worker writes the raw tensor to a private file there (mode 0600,
  random name) laid out as ``magic | header length | header | raw tensor bytes``, and returns
  only its path. The front end maps the file copy-on-write and deletes it at once; the tensor
  it returns is backed by that mapping, so the front end copies nothing. A full ``/dev/shm``
  (small in containers) means falling back to the inline route, never a crash.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from vllm_lens import wire
from vllm_lens.errors import WireError

logger = logging.getLogger(__name__)

__all__ = ["Handoff", "host_id", "receive", "send"]

#: Tensors at least this large go through a file when the front end shares the host.
INLINE_MAX_BYTES = 1 << 20
_PREFIX = "vllm_lens_"
_MAGIC = b"VLLMLENS"
_LENGTH = struct.Struct("<Q")
_DATA_ALIGN = 64

#: What ``send`` returns: ``wire`` bytes, or ``{"path": ...}`` of a file holding the capture.
Handoff = bytes | dict[str, str]


def _directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


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
    if nbytes >= INLINE_MAX_BYTES and receiver_host == host_id():
        try:
            return {"path": str(_write_file(header, tensor))}
        except OSError as exc:
            logger.warning("vllm-lens: cannot hand %d bytes over through %s (%s); sending them "
                           "inline instead", nbytes, _directory(), exc)
    return wire.dumps({"header": header, "tensor": tensor})


def receive(handoff: Handoff) -> tuple[dict[str, Any], torch.Tensor]:
    """The header and tensor behind ``handoff``; a file is deleted once mapped."""
    if isinstance(handoff, (bytes, bytearray)):
        obj = wire.loads(handoff)
        return obj["header"], obj["tensor"]
    path = Path(handoff["path"])
    if path.parent != _directory() or not path.name.startswith(_PREFIX):
        raise ValueError(f"vllm-lens: refusing to read unexpected handoff path {path}")
    try:
        fd = os.open(path, os.O_RDONLY)
    finally:
        path.unlink(missing_ok=True)
    try:
        # Private mapping: the caller may write to its tensor without touching the file.
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return _parse(mapped)


def _write_file(header: dict[str, Any], tensor: torch.Tensor) -> Path:
    meta = wire.dumps({"header": header, "dtype": _dtype_name(tensor.dtype),
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


def _parse(mapped: mmap.mmap) -> tuple[dict[str, Any], torch.Tensor]:
    start = len(_MAGIC) + _LENGTH.size
    if len(mapped) < start or mapped[: len(_MAGIC)] != _MAGIC:
        raise WireError("handoff file is not a vllm-lens capture")
    (meta_len,) = _LENGTH.unpack(mapped[len(_MAGIC) : start])
    meta = wire.loads(mapped[start : start + meta_len])
    try:
        dtype, shape = wire.DTYPES[meta["dtype"]], tuple(int(s) for s in meta["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed handoff header: {exc!r}") from None
    offset = _data_offset(meta_len)
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if len(mapped) < offset + nbytes:
        raise WireError(f"handoff file holds {len(mapped) - offset} bytes of data, but dtype "
                        f"{meta['dtype']} and shape {list(shape)} need {nbytes}")
    return meta["header"], _tensor_in(mapped, offset, shape, dtype)


def _tensor_in(mapped: mmap.mmap, offset: int, shape: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``mapped[offset:]`` (it keeps the mapping alive)."""
    count = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=count, offset=offset)
    return raw.view(dtype).reshape(shape)


def _data_offset(meta_len: int) -> int:
    end = len(_MAGIC) + _LENGTH.size + meta_len
    return -(-end // _DATA_ALIGN) * _DATA_ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in wire.DTYPES.items() if d == dtype)
