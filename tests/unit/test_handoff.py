"""Worker -> front end handoff of captures: inline bytes, or a shared-memory file."""

import os
import time
from pathlib import Path

import pytest
import torch

from vllm_lens.common import handoff
from vllm_lens.common.messages import FetchAnswer, FetchPart
from vllm_lens.errors import WireError

HEADER = {"layers": [3, 7], "positions": torch.arange(5)}


def _send(tensor, host):
    return handoff.send(HEADER, tensor, host)


def _check(received, tensor):
    header, got = received
    assert header["layers"] == [3, 7] and torch.equal(header["positions"], HEADER["positions"])
    assert got.dtype == tensor.dtype and torch.equal(got, tensor)


def test_small_payloads_and_other_hosts_travel_inline():
    small = torch.randn(2, 5, 8)
    sent = _send(small, handoff.host_id())
    assert isinstance(sent, bytes)
    _check(handoff.receive(sent), small)
    big = torch.randn(2, 5, handoff.INLINE_MAX_BYTES // 40 + 1)
    for host in ("another-host/boot", None):
        sent = _send(big, host)
        assert isinstance(sent, bytes)
        _check(handoff.receive(sent), big)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_capture_goes_through_a_private_file_read_once(dtype):
    big = torch.randn(3, 7, handoff.INLINE_MAX_BYTES // 21 + 3).to(dtype)
    sent = _send(big, handoff.host_id())
    path = Path(sent["path"])
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    header, got = handoff.receive(sent)
    assert not path.exists()
    _check((header, got), big)
    got.add_(1)  # the tensor is the caller's to change
    assert torch.equal(got, big + 1)


def test_full_shared_memory_falls_back_to_inline(monkeypatch):
    def no_space(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", no_space)
    before = set(os.listdir(handoff._directory()))
    big = torch.randn(2, handoff.INLINE_MAX_BYTES // 8 + 1)
    sent = _send(big, handoff.host_id())
    assert isinstance(sent, bytes)
    _check(handoff.receive(sent), big)
    assert set(os.listdir(handoff._directory())) == before  # nothing left behind


def test_receive_refuses_paths_it_did_not_write(tmp_path):
    victim = tmp_path / "vllm_lens_secret"
    victim.write_bytes(b"do not read")
    with pytest.raises(ValueError, match="unexpected handoff path"):
        handoff.receive({"path": str(victim)})
    assert victim.exists()


def test_a_corrupt_file_is_a_clear_error():
    path = handoff._directory() / f"{handoff._PREFIX}corrupt-test"
    path.write_bytes(b"not a capture at all")
    with pytest.raises(WireError, match="not a vllm-lens capture"):
        handoff.receive({"path": str(path)})
    assert not path.exists()


def test_a_truncated_file_is_a_clear_error():
    sent = _send(torch.randn(2, handoff.INLINE_MAX_BYTES // 8 + 1), handoff.host_id())
    path = Path(sent["path"])
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(WireError, match="holds .* bytes of data"):
        handoff.receive(sent)
    assert not path.exists()


def test_the_file_route_leaves_a_quarter_of_shared_memory_free(monkeypatch):
    monkeypatch.setattr(handoff, "_KEEP_FREE", 1.0)  # as if /dev/shm were nearly full
    assert isinstance(_send(torch.randn(2, handoff.INLINE_MAX_BYTES // 8 + 1),
                            handoff.host_id()), bytes)


def test_unread_results_are_discarded_and_orphans_swept():
    big = torch.randn(2, handoff.INLINE_MAX_BYTES // 8 + 1)
    fetched = FetchAnswer(requests={"key": {
        "req-0": FetchPart.rows({"residual_stream": _send(big, handoff.host_id()),
                                 "attn_out": _send(big, handoff.host_id())}),
        "req-1": FetchPart.rows({"residual_stream": _send(big[:, :4], handoff.host_id())})}})
    paths = [Path(h["path"]) for h in fetched.requests["key"]["req-0"].captures.values()]
    handoff.discard_fetched(fetched)
    assert not any(path.exists() for path in paths)

    orphan = Path(_send(big, handoff.host_id())["path"])
    recent = Path(_send(big, handoff.host_id())["path"])
    hour_ago = time.time() - 3601
    os.utime(orphan, (hour_ago, hour_ago))
    try:
        assert handoff.sweep() >= 1
        assert not orphan.exists() and recent.exists()  # a file in flight is left alone
    finally:
        handoff.discard({"path": str(recent)})
    with pytest.raises(ValueError, match="unexpected handoff path"):
        handoff.discard({"path": "/etc/passwd"})
