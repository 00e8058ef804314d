"""Host memory for capture staging tensors, kept from one step to the next (runs in: worker).

Each step that captures fills one staging tensor per capture group (``capture.capture_layer``).
On the CPU backend that was a fresh ``torch.empty`` per step: above glibc's mmap threshold, so
every step's tensor came from new pages that the kernel faulted in and zeroed on first touch,
and gave back to the kernel when the last view of it died. For a dataset job capturing every
layer at every prompt position (~180 MB a step for SmolLM2) that cost about eight times the
copy the taps make into it (``benchmarks/RESULTS.md``, "Staging memory kept between steps").

The pool keeps those buffers and hands one out again once nothing refers to it any more: not
the store (the rows it filed were copied out, or the requests that kept views of it have been
fetched and their rows written), not a sink's shard, not a fetch in flight. That is read from
the buffer's storage use count (as PyTorch's CUDA-graph trees check their pools) and from the
references to its Python storage object (which holds the storage without counting in it);
with a PyTorch that lacks the count, every tensor is a fresh one, as before. Whoever reads a
staging tensor's memory must hold a tensor, array or buffer over it while reading (raw
pointers kept past that would now read a later step's rows).

Pinned staging tensors (an accelerator's) are not pooled: PyTorch's host allocator caches
pinned blocks and tracks the streams that use them.

Bounds: a buffer is made 1/16 larger than the tensor that asked for it (a dataset job's steps
differ by a few percent) and serves only a tensor of at least 8/9 of its bytes, so a view of
the tensor keeps at most 1/8 more memory alive than it counts; a tensor whose buffer would
exceed ``max_free_bytes`` is not pooled. Free buffers are let go once they exceed
``max_free_bytes`` together (least recently used first) or have been free for ``idle_s``
seconds: checked when a tensor is asked for, when a step starts (``LensRuntime.settle``) and
by a sweeper thread every ``sweep_s`` seconds while the pool holds buffers (an engine with
no more steps). ``VLLM_LENS_STAGING_POOL_BYTES`` sets ``max_free_bytes`` for the workers
(``0``: no pool).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["StagingPool"]

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)

MIN_POOLED_BYTES = 1 << 20
"""Smaller tensors come from the allocator as before (its own free lists serve them)."""


@dataclass(eq=False)
class _Buffer:
    tensor: torch.Tensor
    """Flat ``uint8``; the tensors handed out view its first bytes."""
    storage: torch.UntypedStorage
    held_count: int
    """The storage's use count while nothing but the pool refers to it."""
    held_refs: int
    """References to ``storage`` then (a view's ``untyped_storage()`` is the same object)."""
    last_used: float
    free_since: float | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def free(self) -> bool:
        # The engine thread reads counts that another thread (a sink's writer) lowers once it
        # is done with the rows; CPython's reference counting orders the two. ``held_refs``
        # was measured with this same expression, so the attribute load and the call's own
        # reference cancel out (exact under the GIL; vLLM does not run free-threaded).
        assert _use_count is not None
        return (_use_count(self.storage._cdata) <= self.held_count
                and sys.getrefcount(self.storage) <= self.held_refs)


class StagingPool:
    """Host tensors for staging, reused once nothing refers to them."""

    def __init__(self, max_free_bytes: int = 512 << 20, idle_s: float = 10.0,
                 sweep_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_free_bytes = max_free_bytes
        self.idle_s = idle_s
        self.sweep_s = sweep_s
        self._clock = clock
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None
        pool = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := pool()) is not None and p._forked())

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``, from a free buffer that
        fits if there is one."""
        nbytes = math.prod(shape) * dtype.itemsize
        size = nbytes + nbytes // 16  # room for the next steps' slightly larger tensors
        if _use_count is None or nbytes < MIN_POOLED_BYTES or size > self.max_free_bytes:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            fits = [b for b in self._buffers if nbytes <= b.nbytes <= nbytes + nbytes // 8]
            chosen = min((b for b in fits if b.free()), key=lambda b: b.nbytes, default=None)
            if chosen is None:
                chosen = self._new(size)
            chosen.last_used, chosen.free_since = self._clock(), None
            self._trim(keep=chosen)
            return chosen.tensor[:nbytes].view(dtype).view(shape)

    def trim(self) -> None:
        """Let go of the free buffers past the pool's bounds."""
        with self._lock:
            self._trim()

    @property
    def nbytes(self) -> int:
        """Bytes of all the buffers the pool keeps, in use or free."""
        with self._lock:
            return sum(b.nbytes for b in self._buffers)

    def _trim(self, keep: _Buffer | None = None) -> None:
        if not self._buffers:
            return
        now = self._clock()
        free = []
        for b in self._buffers:
            if b is not keep and b.free():
                b.free_since = now if b.free_since is None else b.free_since
                free.append(b)
            else:
                b.free_since = None
        dropped, total = set(), 0
        for b in sorted(free, key=lambda b: b.last_used, reverse=True):
            assert b.free_since is not None
            if now - b.free_since >= self.idle_s or total + b.nbytes > self.max_free_bytes:
                dropped.add(id(b))
            else:
                total += b.nbytes
        if dropped:
            self._buffers = [b for b in self._buffers if id(b) not in dropped]

    def _new(self, nbytes: int) -> _Buffer:
        assert _use_count is not None
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        buffer = _Buffer(tensor, tensor.untyped_storage(), 0, 0, self._clock())
        buffer.held_count = _use_count(buffer.storage._cdata)
        buffer.held_refs = sys.getrefcount(buffer.storage)  # as ``free`` counts them
        self._buffers.append(buffer)
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, daemon=True,
                                             name="vllm-lens-staging-pool")
            self._sweeper.start()
        return buffer

    def _sweep(self) -> None:
        """Trims every ``sweep_s`` until the pool holds nothing (then a new buffer starts
        another sweeper)."""
        try:
            while True:
                time.sleep(self.sweep_s)
                with self._lock:
                    self._trim()
                    if not self._buffers:
                        return
        finally:  # (also if a trim raised: the next new buffer starts a sweeper again)
            with self._lock:
                self._sweeper = None

    def _forked(self) -> None:
        """In a forked child: the parent's lock may have been held and its sweeper is
        gone."""
        self._lock = threading.Lock()
        self._sweeper = None
