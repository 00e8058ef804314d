"""The folder a server's API processes share: a new 0700 one per server inside the
operator's parent, named for the processes it starts; folders of servers that were killed
are removed, nobody else's."""

import os
import stat

from vllm_lens.frontend import shared_dir


def test_each_server_gets_a_new_private_folder_and_orphans_go(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_HTTP_STORE_DIR", str(tmp_path))
    # Set here so that it is undone after the test: servers the suite starts later must not
    # inherit this test's folder.
    monkeypatch.setenv("VLLM_LENS_SERVER_DIR", "")
    dead = tmp_path / "vllm-lens-http-999999999-abc"  # no such process
    live = tmp_path / f"vllm-lens-http-{os.getpid()}-old"
    other = tmp_path / "someone-elses"
    for folder in (dead, live, other):
        folder.mkdir()
    first = shared_dir.create()
    assert first.parent == tmp_path and stat.S_IMODE(first.stat().st_mode) == 0o700
    assert os.environ["VLLM_LENS_SERVER_DIR"] == str(first) == str(shared_dir.server_dir())
    assert not dead.exists() and live.exists() and other.exists()
    second = shared_dir.create()  # another server: never the first one's folder
    assert second != first and shared_dir.server_dir() == second
