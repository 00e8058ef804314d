"""The worker's pool of host staging tensors: a buffer is handed out again only once nothing
refers to it, within its size rules and memory bounds."""

import os
import signal
import time

import numpy as np
import pytest
import torch

from vllm_lens.worker.staging_pool import MIN_POOLED_BYTES, StagingPool

MIB = 1 << 20
SHAPE = (2, 4, MIB // 16)  # 2 MiB of float32


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_buffer_is_handed_out_again_once_every_tensor_viewing_it_died():
    pool = StagingPool()
    first = pool.empty(SHAPE, torch.float32)
    assert first.shape == SHAPE and first.dtype == torch.float32 and first.is_contiguous()
    ptr = first.data_ptr()
    row = first[1, 2:3]
    del first
    assert pool.empty(SHAPE, torch.float32).data_ptr() != ptr  # a view of it is alive
    del row
    again = pool.empty(SHAPE, torch.float32)
    assert again.data_ptr() == ptr
    assert pool.nbytes < 3 * 2 * MIB  # the two buffers, each with 1/16 of room


@pytest.mark.parametrize("holder", [
    lambda t: t[0],                                       # a view
    lambda t: t.numpy(),                                  # an array over its memory
    lambda t: memoryview(t.reshape(-1).numpy()),          # a buffer over its memory
    lambda t: t.view(torch.uint8),                        # a view of another dtype
    lambda t: t.untyped_storage(),                        # its storage alone
])
def test_what_still_reads_a_buffer_keeps_it_out_of_the_pool(holder):
    pool = StagingPool()
    staged = pool.empty(SHAPE, torch.float32)
    staged.copy_(torch.arange(staged.numel(), dtype=torch.float32).view(SHAPE))
    expected = staged.clone()
    kept = holder(staged)
    del staged
    other = pool.empty(SHAPE, torch.float32)
    other.fill_(-1.0)
    want = _bytes(holder(expected))
    assert _bytes(kept)[: len(want)] == want


def _bytes(kept):
    if isinstance(kept, torch.UntypedStorage):
        kept = torch.empty(0, dtype=torch.uint8).set_(kept)
    return np.asarray(kept).tobytes()


def test_a_buffer_serves_only_tensors_close_to_its_size():
    pool = StagingPool()
    big = pool.empty((4, MIB), torch.float32)  # 16 MiB (+1 MiB of room)
    ptr = big.data_ptr()
    del big
    small = pool.empty((2, MIB), torch.float32)  # 8 MiB: would keep twice its bytes alive
    assert small.data_ptr() != ptr
    del small
    larger = pool.empty((4, MIB + MIB // 32), torch.float32)  # 3% larger: fits the room
    assert larger.data_ptr() == ptr
    del larger
    too_large = pool.empty((5, MIB), torch.float32)  # 25% larger: a new buffer
    assert too_large.data_ptr() != ptr


def test_small_tensors_and_other_dtypes():
    pool = StagingPool()
    small = pool.empty((MIN_POOLED_BYTES // 8,), torch.float32)
    assert pool.nbytes == 0 and small.numel() == MIN_POOLED_BYTES // 8
    halves = pool.empty((3, MIB), torch.bfloat16)
    assert halves.dtype == torch.bfloat16 and halves.shape == (3, MIB)
    halves.fill_(1.5)
    assert float(halves.sum()) == 1.5 * 3 * MIB


def test_free_buffers_are_let_go_past_the_byte_bound_least_recently_used_first():
    clock = Clock()
    pool = StagingPool(max_free_bytes=5 * MIB, clock=clock, sweep_s=3600)  # trims: ours
    held = []
    for i in range(3):  # three 2 MiB tensors (~2.1 MiB buffers), all in use
        clock.now = float(i)
        held.append(pool.empty(SHAPE, torch.float32))
    ptrs = [t.data_ptr() for t in held]
    assert pool.nbytes > 6 * MIB
    held.clear()
    pool.trim()  # the most recent two stay: 4.25 MiB <= 5 MiB
    assert 4 * MIB < pool.nbytes < 5 * MIB
    assert pool.empty(SHAPE, torch.float32).data_ptr() in ptrs[1:]


def test_free_buffers_unused_for_idle_s_are_let_go():
    clock = Clock()
    pool = StagingPool(idle_s=10.0, clock=clock, sweep_s=3600)
    staged = pool.empty(SHAPE, torch.float32)
    clock.now = 60.0
    pool.trim()
    assert pool.nbytes > 0  # in use: kept, however old
    del staged
    pool.trim()  # free from now on
    clock.now = 69.0
    pool.trim()
    assert pool.nbytes > 0
    clock.now = 70.0
    pool.trim()
    assert pool.nbytes == 0


def test_an_idle_engine_lets_go_of_free_buffers_without_another_step():
    pool = StagingPool(idle_s=0.05, sweep_s=0.01)
    staged = pool.empty(SHAPE, torch.float32)
    assert pool.nbytes > 0
    del staged
    deadline = time.monotonic() + 30
    while (pool.nbytes or pool._sweeper is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.nbytes == 0 and pool._sweeper is None  # the sweeper stopped too
    again = pool.empty(SHAPE, torch.float32)  # ... and a new buffer starts another one
    assert pool._sweeper is not None and again.shape == SHAPE


def test_a_tensor_larger_than_the_free_bound_is_not_pooled():
    pool = StagingPool(max_free_bytes=4 * MIB)
    big = pool.empty((MIB,), torch.float32)  # 4 MiB, and its buffer would be 4.25 MiB
    assert pool.nbytes == 0 and big.numel() == MIB
    none = StagingPool(max_free_bytes=0)
    assert none.empty(SHAPE, torch.float32).shape == SHAPE and none.nbytes == 0


def test_a_child_forked_while_the_pool_was_locked_can_use_it():
    pool = StagingPool()
    held = pool.empty(SHAPE, torch.float32)  # (a sweeper runs in the parent)
    with pool._lock:  # as if the sweeper were trimming at the fork
        pid = os.fork()
        if pid == 0:  # the child: a fresh lock, no sweeper yet
            ok = False
            try:
                ok = pool._sweeper is None and pool.empty(SHAPE, torch.float32).shape == SHAPE
            finally:
                os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the pool's lock")
    assert os.waitstatus_to_exitcode(status) == 0
    assert held.shape == SHAPE
