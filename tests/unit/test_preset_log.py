"""Steering-preset route calls shared by several API server processes through the log in the
server's shared directory: applied in one order everywhere, a line only once complete, a
call that fails where it is replayed skipped (and never retried), and the binary store beside
it never touching the log."""

import asyncio

import pytest

from vllm_lens.frontend.http import preset_log
from vllm_lens.frontend.http.blob_store import BlobStore


class _Engine:
    """What a process's ``AsyncLLM`` does with preset calls: here, records them."""

    def __init__(self):
        self.presets = {}

    async def register_steering(self, name, vectors, model=None):
        if vectors == "bad":
            raise ValueError("does not fit this process")
        self.presets[name] = vectors

    async def unregister_steering(self, name):
        del self.presets[name]


@pytest.fixture
def shared(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_SERVER_DIR", str(tmp_path))
    monkeypatch.setattr(preset_log, "_replayed", 0)
    preset_log.configure(2)
    yield tmp_path
    preset_log.configure(1)


def _as_process(engine, replayed):
    """Run ``preset_log`` as another process would: with its own ``_replayed``."""
    class Process:
        offset = replayed

        async def call(self, method, *args):
            saved, preset_log._replayed = preset_log._replayed, self.offset
            try:
                async with preset_log.held() as log:
                    await preset_log.replay(engine, log)
                    await getattr(engine, method)(*args)
                    preset_log.append(log, method, args)
            finally:
                self.offset, preset_log._replayed = preset_log._replayed, saved

        async def sync(self):
            saved, preset_log._replayed = preset_log._replayed, self.offset
            try:
                await preset_log.sync(engine)
            finally:
                self.offset, preset_log._replayed = preset_log._replayed, saved
    return Process()


def test_every_process_applies_the_calls_in_the_order_they_were_made(shared):
    a_engine, b_engine = _Engine(), _Engine()
    a, b = _as_process(a_engine, 0), _as_process(b_engine, 0)

    async def scenario():
        await a.call("register_steering", "up", [1])
        await b.sync()
        assert b_engine.presets == {"up": [1]}
        BlobStore(shared / "blobs", 100, 60).stats()  # the store beside the log
        await b.call("register_steering", "up", [2])  # replaces it
        await a.call("unregister_steering", "up")
        await b.sync()
        await a.sync()
        assert a_engine.presets == b_engine.presets == {}
        # A line still being written is left for later; a bad one is skipped, not retried.
        log = shared / "steering-presets.jsonl"
        with open(log, "ab") as f:
            f.write(b'{"method": "register_steering", "args": ["x", "bad"]}\n')
            f.write(b'{"method": "register_steering", "ar')
        await b.sync()
        assert b_engine.presets == {}
        with open(log, "ab") as f:
            f.write(b'gs": ["down", [3]]}\nnot json\n')
        await b.sync()
        await b.sync()
        assert b_engine.presets == {"down": [3]}

    asyncio.run(scenario())


def test_one_api_process_keeps_no_log(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_SERVER_DIR", str(tmp_path))
    preset_log.configure(1)

    async def scenario():
        async with preset_log.held() as log:
            assert log is None
        await preset_log.sync(_Engine())

    asyncio.run(scenario())
    assert not list(tmp_path.iterdir())


def test_requests_arriving_while_a_change_is_replayed_wait_for_it(shared):
    """Several requests selecting a preset reach a process at once, just after another
    process registered it: the first replays the registration (which takes a while: it asks
    the workers), and the others wait for it instead of taking the log for seen and parsing
    without the preset (measured: 'unknown steering preset' on one of six requests)."""
    class _SlowEngine(_Engine):
        async def register_steering(self, name, vectors, model=None):
            await asyncio.sleep(0.2)
            await super().register_steering(name, vectors, model)

    a, slow = _as_process(_Engine(), 0), _SlowEngine()

    async def scenario():
        await a.call("register_steering", "up", [1])
        # The process whose requests these are: its own _replayed, shared by its requests.
        preset_log._replayed = 0

        async def request():
            await preset_log.sync(slow)
            return dict(slow.presets)

        seen = await asyncio.gather(*(request() for _ in range(4)))
        assert seen == [{"up": [1]}] * 4

    asyncio.run(scenario())
