"""Writing one shard's tensors as a safetensors file, with as little CPU time as the disk allows
(runs in: caller, worker).

A worker's sink writer thread, or the user's process for ``ShardWriter`` and ``vllm-lens extract
--server``.

A sink writes gigabytes on the cores the model computes on, so the CPU a shard costs is taken
from the engine. ``safetensors.torch.save_file`` needs each tensor whole (one ``torch.cat`` of
the examples' parts per tensor, into fresh memory the kernel must fault in) and then copies it
again into the page cache, whose pages the kernel later writes back and reclaims. Here the
file's bytes (header, then each tensor's parts in turn) are copied once, into a page-aligned
buffer the thread keeps from shard to shard (as large as the largest shard it wrote, at most
``MAX_BUFFER_BYTES``), and each full buffer goes to the disk with ``O_DIRECT``: no page-cache
copy, no writeback, no reclaim. Once the last bytes are in the buffer, the caller may let go of
the tensors (``copied``): a shard that fits the buffer holds its rows for the few milliseconds
of one copy, not for the time the disk takes. Measured alone, a 64 MiB shard took ~27-47 ms of
the writing thread's CPU through ``save_file`` and ~7-13 ms this way.

The file is plain safetensors (read by ``safetensors.safe_open``): the JSON header is padded
with spaces (JSON whitespace) so that the data starts at a multiple of the page size (4 KiB),
tensors lie end to end in order of decreasing item size (each aligned to its own), and the file
is cut to its exact length after the last write. Where ``O_DIRECT`` is unavailable (another OS)
or refused (a filesystem without it, such as tmpfs on older kernels), the same buffers are
written through the page cache.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["DTYPE_NAMES", "MAX_BUFFER_BYTES", "release_buffer", "write_shard_file"]

#: safetensors' names of the dtypes a shard may hold.
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}

#: The unit ``O_DIRECT`` transfers must be aligned to (offsets, lengths, memory): the page
#: size, a multiple of the logical block size of the disks this runs on.
_ALIGN = mmap.PAGESIZE
#: The most memory the buffer each writing thread keeps may take (a larger shard goes out in
#: pieces of this size).
MAX_BUFFER_BYTES = 256 << 20

_local = threading.local()


def write_shard_file(path: Path, tensors: Mapping[str, Sequence[torch.Tensor]],
                     copied: Callable[[], None] | None = None) -> None:
    """Write ``path`` (created or truncated): for each name, the parts of ``tensors[name]``
    joined along their first dimension, as one safetensors tensor. The parts of one name share
    dtype and trailing shape; they may be views of any layout. ``copied`` is called once
    every part has been copied out (before the last write): the tensors are not read again.
    Not synced: the caller fsyncs."""
    layout, data_bytes = _layout(tensors)
    header = json.dumps({name: {"dtype": DTYPE_NAMES[dtype], "shape": shape,
                                "data_offsets": [begin, end]}
                         for name, dtype, shape, begin, end in layout},
                        separators=(",", ":")).encode()
    start = -(-(8 + len(header)) // _ALIGN) * _ALIGN
    with _Output(path, start + data_bytes) as out:
        out.put_bytes(torch.frombuffer(bytearray(
            (start - 8).to_bytes(8, "little") + header.ljust(start - 8, b" ")),
            dtype=torch.uint8))
        for name, dtype, shape, _, _ in layout:
            out.put_parts([p for p in tensors[name] if p.numel()], dtype, shape[1:])
        if copied is not None:
            copied()
        out.finish(start + data_bytes)


def _layout(tensors: Mapping[str, Sequence[torch.Tensor]]
            ) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], int]:
    """(name, dtype, shape, begin, end) per tensor in file order, and the data's length."""
    found = []
    for name, parts in tensors.items():
        if not parts:
            raise ValueError(f"tensor {name!r} has no parts")
        first = parts[0]
        if first.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {first.dtype} has no safetensors name "
                             "this writer knows")
        tail = list(first.shape[1:])
        for p in parts:
            if p.dtype != first.dtype or list(p.shape[1:]) != tail or p.device.type != "cpu":
                raise ValueError(f"tensor {name!r}: parts differ in dtype, row shape or "
                                 f"device ({p.dtype} {list(p.shape)} on {p.device}, first "
                                 f"{first.dtype} {list(first.shape)})")
        found.append((name, first.dtype, [sum(int(p.shape[0]) for p in parts), *tail]))
    # Larger items first: every tensor starts at a multiple of its own item size.
    found.sort(key=lambda t: (-t[1].itemsize, t[0]))
    layout, offset = [], 0
    for name, dtype, shape in found:
        size = dtype.itemsize
        for n in shape:
            size *= n
        layout.append((name, dtype, shape, offset, offset + size))
        offset += size
    return layout, offset


class _Output:
    """The file being written: bytes go into the thread's buffer, and each full buffer to the
    disk (with ``O_DIRECT`` while the filesystem takes it)."""

    def __init__(self, path: Path, total: int) -> None:
        self.path = path
        wanted = min(_aligned(total), _aligned(MAX_BUFFER_BYTES))
        buf = getattr(_local, "buffer", None)
        if buf is None or len(buf) < wanted or len(buf) > _aligned(MAX_BUFFER_BYTES):
            # Page-aligned; private, so that a child forked later writes into a copy of its
            # own, never into its parent's.
            buf = _local.buffer = mmap.mmap(-1, wanted, flags=mmap.MAP_PRIVATE)
        self.size = len(buf)  # the bytes of one write
        self.view = memoryview(buf)
        self.buf = torch.frombuffer(self.view, dtype=torch.uint8)
        self.fill = 0  # bytes in the buffer
        self.written = 0  # bytes in the file
        self.direct = bool(getattr(os, "O_DIRECT", 0))
        self.fd = self._open()

    def __enter__(self) -> _Output:
        return self

    def __exit__(self, *_: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        return os.open(self.path, flags, 0o644)

    def put_parts(self, parts: list[torch.Tensor], dtype: torch.dtype,
                  tail: list[int]) -> None:
        """The parts' elements in turn: as many whole parts as fit joined by one
        ``torch.cat`` into the buffer, a part that does not fit copied in pieces."""
        i = 0
        while i < len(parts):
            room, size, j = self.size - self.fill, 0, i
            while j < len(parts) and size + _nbytes(parts[j]) <= room:
                size += _nbytes(parts[j])
                j += 1
            if j == i:
                self.put_bytes(parts[i].contiguous().view(-1).view(torch.uint8))
                i += 1
                continue
            dest = self.buf[self.fill:self.fill + size].view(dtype).view(-1, *tail)
            torch.cat(parts[i:j], out=dest)
            self.fill += size
            i = j
            if self.fill == self.size:
                self._write()

    def put_bytes(self, data: torch.Tensor) -> None:
        """``data`` (uint8), across as many buffers as it takes."""
        done = 0
        while done < len(data):
            n = min(len(data) - done, self.size - self.fill)
            self.buf[self.fill:self.fill + n].copy_(data[done:done + n])
            self.fill += n
            done += n
            if self.fill == self.size:
                self._write()

    def finish(self, total: int) -> None:
        """Write what the buffer holds; the file is ``total`` bytes long."""
        if self.fill:
            self._write()
        if self.written != total:
            os.ftruncate(self.fd, total)  # (an O_DIRECT write's padding cut off)

    def _write(self) -> None:
        """The buffer's bytes at the file's end (padded to the alignment with O_DIRECT)."""
        length = _aligned(self.fill) if self.direct else self.fill
        done = 0
        while done < length:
            try:
                done += os.pwrite(self.fd, self.view[done:length], self.written + done)
            except OSError as exc:
                # A filesystem that opens with O_DIRECT but does not write that way: the
                # file again, through the page cache (nothing of it is on disk yet).
                if not (self.direct and self.written == 0 and done == 0
                        and exc.errno == errno.EINVAL):
                    raise
                os.close(self.fd)
                self.fd = -1  # (not closed twice if the reopening fails)
                self.direct = False
                self.fd = self._open()
                length = self.fill
        self.written += length
        self.fill = 0


def release_buffer() -> None:
    """Let go of the calling thread's buffer (a writer going idle or closing); the next shard
    it writes maps a new one."""
    _local.buffer = None


def _aligned(n: int) -> int:
    return max(_ALIGN, -(-n // _ALIGN) * _ALIGN)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
