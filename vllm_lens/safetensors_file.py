"""The safetensors file format, as the datasets use it: writing a file whose tensors come in
parts, and the dtype names (runs in: whichever process writes or reads a dataset's shards).

A shard holds, per point and layer, the rows of many examples one after the other. Joining
each column's parts into one tensor before ``safetensors.torch.save_file`` copies every byte
once more than writing the parts where they lie, which is what ``write`` does: a 64 MiB shard
is then one pass over memory (into the kernel's page cache), not two. The file is the format
the safetensors library reads (a little-endian u64 header length, the JSON header padded with
spaces to a multiple of 8 bytes, then the data, each tensor's bytes at its ``data_offsets``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = ["DTYPES", "write"]

#: safetensors dtype names -> (numpy dtype to map the bytes as, torch dtype to view them as)
DTYPES = {
    "F64": (np.float64, torch.float64), "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16), "BF16": (np.uint16, torch.bfloat16),
    "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32),
    "I16": (np.int16, torch.int16), "I8": (np.int8, torch.int8),
    "U8": (np.uint8, torch.uint8), "BOOL": (np.bool_, torch.bool),
}
_NAMES = {torch_dtype: name for name, (_, torch_dtype) in DTYPES.items()}
_NUMPY_DTYPES = frozenset(t for name, (_, t) in DTYPES.items() if name not in ("BF16", "BOOL"))
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16


def write(path: str | os.PathLike, columns: Mapping[str, Sequence[torch.Tensor]]) -> int:
    """Write ``columns`` (name -> parts: CPU tensors of one dtype and one row shape, joined
    along their first dimension) to ``path`` as one safetensors file; returns its size.

    Raises:
        ValueError: a column without parts, with a part of no dimension, whose parts differ
            in dtype or row shape, or of a dtype safetensors has no name for.
    """
    if any(not parts for parts in columns.values()):
        raise ValueError(f"column {next(n for n, p in columns.items() if not p)!r} has no parts")
    # Wider elements first, as safetensors itself lays them out: every tensor then starts at
    # a multiple of its element size (the data starts at a multiple of 8), and a reader may
    # map it in place.
    order = sorted(columns, key=lambda name: -columns[name][0].element_size())
    header: dict[str, dict[str, object]] = {}
    offset = 0
    for name in order:
        parts = columns[name]
        first = parts[0]
        if first.dim() == 0:
            raise ValueError(f"column {name!r}: parts need a first dimension to be joined along")
        name_of_dtype = _NAMES.get(first.dtype)
        if name_of_dtype is None:
            raise ValueError(f"column {name!r}: safetensors has no dtype {first.dtype}")
        rows = 0
        for part in parts:
            if part.dtype != first.dtype or part.shape[1:] != first.shape[1:]:
                raise ValueError(f"column {name!r}: parts of {first.dtype} "
                                 f"{list(first.shape[1:])} and {part.dtype} "
                                 f"{list(part.shape[1:])} cannot be joined")
            rows += part.shape[0]
        size = rows * int(np.prod(first.shape[1:], dtype=np.int64)) * first.element_size()
        header[name] = {"dtype": name_of_dtype, "shape": [rows, *first.shape[1:]],
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    buffers = [memoryview(struct.pack("<Q", len(encoded))), memoryview(encoded)]
    buffers += [_bytes_of(part) for name in order for part in columns[name] if part.numel()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_all(fd, buffers)
    finally:
        os.close(fd)
    return 8 + len(encoded) + offset


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """Write ``buffers`` one after the other, in as few system calls as the kernel takes
    (``writev``): each call releases the GIL once, where a ``write`` per part would wait for
    it again thousands of times per shard beside a busy engine thread."""
    i = 0
    while i < len(buffers):
        written = os.writev(fd, buffers[i : i + _IOV_MAX])
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        while written:  # (a short write leaves the rest of a buffer for the next call)
            if written >= len(buffers[i]):
                written -= len(buffers[i])
                i += 1
            else:
                buffers[i] = buffers[i][written:]
                written = 0


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in row-major order, without a copy where it is contiguous (in
    one call where numpy has its dtype: a shard has thousands of parts, and this runs beside
    the engine's thread, which waits for the GIL while it does)."""
    if tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous() and not tensor.requires_grad:
        return memoryview(tensor.numpy()).cast("B")
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
