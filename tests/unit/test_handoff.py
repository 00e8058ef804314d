"""Worker -> front end handoff of large payloads through shared memory."""

import os
from pathlib import Path

import pytest

from vllm_lens import handoff


def test_small_payloads_and_other_hosts_travel_inline():
    assert handoff.send(b"small", handoff.host_id()) == b"small"
    big = os.urandom(handoff.INLINE_MAX_BYTES)
    assert handoff.send(big, "another-host/boot") == big
    assert handoff.send(big, None) == big
    assert handoff.receive(b"x") == b"x"


def test_large_payload_goes_through_a_private_file_read_once():
    big = os.urandom(handoff.INLINE_MAX_BYTES + 5)
    sent = handoff.send(big, handoff.host_id())
    path = Path(sent["path"])
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    assert handoff.receive(sent) == big
    assert not path.exists()


def test_receive_refuses_paths_it_did_not_write(tmp_path):
    victim = tmp_path / "vllm_lens_secret"
    victim.write_bytes(b"do not read")
    with pytest.raises(ValueError, match="unexpected handoff path"):
        handoff.receive({"path": str(victim)})
    assert victim.exists()
