"""The folder a server's API processes share: a new 0700 one per server inside the
operator's parent, named for the processes it starts; folders of servers that were killed
are removed, nobody else's."""

import os
import stat

import pytest

from vllm_lens.frontend.http import shared_dir


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


def test_several_api_processes_share_their_launchers_folder_or_are_refused(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("VLLM_LENS_HTTP_STORE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_LENS_SERVER_DIR", "")
    # Started by a launcher vllm-lens did not wrap: each would keep a folder of its own.
    with pytest.raises(RuntimeError, match=r"runs 2 API processes.*--api-server-count 1"):
        shared_dir.for_api_process(2)
    assert list(tmp_path.iterdir()) == []
    launcher = shared_dir.create()  # vLLM's run_multi_api_server, wrapped
    assert shared_dir.for_api_process(2) == launcher == shared_dir.for_api_process(2)
    alone = shared_dir.for_api_process(1)  # a server of one API process: a new folder
    assert alone != launcher and alone.parent == tmp_path
