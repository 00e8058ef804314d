"""Host memory for capture staging tensors, kept from one step to the next (runs in: worker).

Each step that captures fills one staging tensor per capture group (``capture.capture_layer``).
On the CPU backend that was a fresh ``torch.empty`` per step: above glibc's mmap threshold, so
every step's tensor came from new pages that the kernel faulted in and zeroed on first touch,
and went back to the kernel when the last view of it died. For a dataset job capturing every
layer at every prompt position (~180 MB a step for SmolLM2) this cost 9x the copy the taps
make into it (``benchmarks/RESULTS.md``).

The pool keeps those buffers and hands one out again once nothing refers to it any more: not
the store (the rows it filed were copied out, or the requests that kept views of it have been
fetched and their rows written), not a sink's shard, not a fetch in flight. That is read from
the buffer's storage use count (as PyTorch's CUDA-graph trees check their pools); with a
PyTorch that lacks the count, every tensor is a fresh one, as before.

Pinned staging tensors (an accelerator's) are not pooled: PyTorch's host allocator caches
pinned blocks and tracks the streams that use them.

Bounds: a buffer is made 1/16 larger than the tensor that asked for it (a dataset job's steps
differ by a few percent) and serves only a tensor of at least 8/9 of its bytes, so a view of
the tensor keeps at most 1/8 more memory alive than it counts; free buffers are let go once
they exceed ``max_free_bytes`` together (least recently used first) or were last handed out
more than ``idle_s`` seconds ago, checked whenever a tensor is asked for and after every step
(``trim``).
``VLLM_LENS_STAGING_POOL_BYTES`` sets ``max_free_bytes`` for the workers (``0``: no pool).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["StagingPool"]

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)

MIN_POOLED_BYTES = 1 << 20
"""Smaller tensors come from the allocator as before (its own free lists serve them)."""


@dataclass
class _Buffer:
    tensor: torch.Tensor
    """Flat ``uint8``; the tensors handed out view its first bytes."""
    storage: int
    held: int
    """The storage's use count while nothing but the pool refers to it."""
    last_used: float

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def free(self) -> bool:
        assert _use_count is not None
        return _use_count(self.storage) <= self.held


class StagingPool:
    """Host tensors for staging, reused once every view of them has died."""

    def __init__(self, max_free_bytes: int = 512 << 20, idle_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_free_bytes = max_free_bytes
        self.idle_s = idle_s
        self._clock = clock
        self._buffers: list[_Buffer] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``, from a free buffer that
        fits if there is one."""
        nbytes = math.prod(shape) * dtype.itemsize
        if _use_count is None or nbytes < MIN_POOLED_BYTES or self.max_free_bytes <= 0:
            return torch.empty(shape, dtype=dtype)
        now = self._clock()
        fits = [b for b in self._buffers if nbytes <= b.nbytes <= nbytes + nbytes // 8]
        chosen = min((b for b in fits if b.free()), key=lambda b: b.nbytes, default=None)
        if chosen is None:  # with room for the next steps' slightly larger tensors
            chosen = self._new(nbytes + nbytes // 16, now)
        chosen.last_used = now
        self.trim(keep=chosen)
        return chosen.tensor[:nbytes].view(dtype).view(shape)

    def trim(self, keep: _Buffer | None = None) -> None:
        """Let go of free buffers unused for ``idle_s``, then of the least recently used
        free ones while the free ones take more than ``max_free_bytes``."""
        if not self._buffers:
            return
        now = self._clock()
        free = sorted((b for b in self._buffers if b is not keep and b.free()),
                      key=lambda b: b.last_used, reverse=True)
        dropped, total = set(), 0
        for b in free:
            if now - b.last_used > self.idle_s or total + b.nbytes > self.max_free_bytes:
                dropped.add(id(b))
            else:
                total += b.nbytes
        if dropped:
            self._buffers = [b for b in self._buffers if id(b) not in dropped]

    @property
    def nbytes(self) -> int:
        """Bytes of all the buffers the pool keeps, in use or free."""
        return sum(b.nbytes for b in self._buffers)

    def _new(self, nbytes: int, now: float) -> _Buffer:
        assert _use_count is not None
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        storage = tensor.untyped_storage()._cdata
        buffer = _Buffer(tensor, storage, _use_count(storage), now)
        self._buffers.append(buffer)
        return buffer
