"""Stopping an engine when vLLM's own shutdown stops part way (``psutil.NoSuchProcess`` from
its force-kill racing with a process that exits by itself). The race cannot be provoked on
demand, so a stand-in client raises it, holding a real engine-like process tree."""

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import psutil

from vllm_lens.cli.extract.engine_stop import GRACE_S, stop_engine


def _stubborn(ready):
    """An 'engine' that ignores SIGTERM and has a child of its own."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    ready.put(child.pid)
    time.sleep(600)


class _Resources:
    def __init__(self, proc):
        self.engine_manager = SimpleNamespace(processes=[proc])
        self.calls = 0

    def __call__(self):
        self.calls += 1


class _Client:
    """Shaped like vLLM's engine-core client where ``stop_engine`` reads it."""

    def __init__(self, proc):
        self.resources = _Resources(proc)
        self.timeouts = []

    def shutdown(self, timeout=None):
        self.timeouts.append(timeout)
        raise psutil.NoSuchProcess(12345)


def test_a_shutdown_cut_short_kills_what_is_left_and_cleans_up():
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    proc = ctx.Process(target=_stubborn, args=(ready,))
    proc.start()
    grandchild = ready.get(timeout=30)
    client = _Client(proc)
    stop_engine(client)
    assert client.timeouts == [GRACE_S]
    assert not proc.is_alive() and proc.exitcode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and time.monotonic() < deadline:
        try:
            if psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        assert not psutil.pid_exists(grandchild)
    assert client.resources.calls == 1


def test_a_clean_shutdown_is_left_alone():
    calls = []
    stop_engine(SimpleNamespace(shutdown=lambda timeout=None: calls.append(timeout)))
    assert calls == [GRACE_S]
    assert os.getpid()  # (nothing else to do)
