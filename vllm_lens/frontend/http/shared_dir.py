"""The directory every API server process of one server shares (runs in: front end).

The process that builds the OpenAI server, and each API server process it starts.

``vllm serve --api-server-count N`` (and ``--data-parallel-size N``, which starts N API
processes by default) answers a client's follow-up call from whichever process the connection
reaches, so what one process keeps for later calls lives here: the binary-transport store
(``http.blob_store``, in ``blobs/``) and the log of steering-preset route calls
(``http.preset_log``).

Each server gets a new directory (mode 0700) inside ``VLLM_LENS_HTTP_STORE_DIR`` (default: the
system's temporary directory), made where the server starts: by ``vllm serve``'s launcher
before it starts several API processes (they inherit it through ``VLLM_LENS_SERVER_DIR``), or
by a server's single API process itself; the process that made it removes it when it exits.
So nothing of an earlier server's, or of another server sharing the parent, is ever read;
directories left by servers that were killed are removed when the next one starts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = ["PARENT_VARIABLE", "create", "for_api_process", "server_dir"]

#: Where the operator wants servers' directories made (a parent: each server makes its own).
PARENT_VARIABLE = "VLLM_LENS_HTTP_STORE_DIR"
#: The server's own directory, inherited by the processes it starts (not for operators).
_SERVER_VARIABLE = "VLLM_LENS_SERVER_DIR"
_PREFIX = "vllm-lens-http-"
_NAMED = re.compile(rf"^{_PREFIX}(\d+)-[A-Za-z0-9_]+$")


def create() -> Path:
    """Make a new directory for the server this process starts, and name it for the
    processes it starts."""
    parent = Path(os.environ.get(PARENT_VARIABLE) or tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(parent)
    root = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent))  # 0700
    os.environ[_SERVER_VARIABLE] = str(root)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def server_dir() -> Path:
    """This server's shared directory (made by ``create``; made here if no process did)."""
    named = os.environ.get(_SERVER_VARIABLE)
    return Path(named) if named else create()


def for_api_process(api_server_count: int | None) -> Path:
    """The directory of the API process being set up: its own, when it is the server's only
    one; otherwise the one its launcher made. Several API processes that no wrapped launcher
    started (none made a directory for them to share) would each keep their own, and a
    client's follow-up call reaching another process would find nothing: refused instead."""
    if (api_server_count or 1) <= 1:
        return create()
    if not os.environ.get(_SERVER_VARIABLE):
        raise RuntimeError(
            f"vllm-lens: this server runs {api_server_count} API processes, but they were not "
            "started through vLLM's run_multi_api_server (which vllm-lens wraps to give them "
            "a directory they share), so a binary-transport handle or a steering preset one "
            "process keeps would be lost to the others; start the server with `vllm serve` or "
            "`vllm-lens serve`, or with --api-server-count 1")
    return server_dir()


def _remove_orphans(parent: Path) -> None:
    """Remove the directories of servers whose process is gone (killed before ``atexit``)."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            found = _NAMED.match(entry.name)
            if found is None or not entry.is_dir() or _alive(int(found.group(1))):
                continue
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == os.getuid():  # only ever our own
                    shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
