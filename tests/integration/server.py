"""A real vLLM OpenAI server in a subprocess on 127.0.0.1, with the engine settings of
``engines.DEFAULTS`` (so its results are comparable to the in-process engines')."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from tests.integration.engines import DEFAULTS


@dataclass(frozen=True)
class Server:
    base_url: str
    pid: int
    log_path: str

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: How the server is started: vLLM's module entry point (one API process), or
#: ``vllm-lens serve`` (vLLM's serve command: ``--api-server-count`` and the rest).
MODULE = ("-m", "vllm.entrypoints.openai.api_server", "--model")
LENS_SERVE = ("-m", "vllm_lens.cli", "serve")


def server_args(model: str, port: int, launcher: tuple[str, ...] = MODULE) -> list[str]:
    return [
        sys.executable, *launcher, model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", DEFAULTS["dtype"],
        "--max-model-len", str(DEFAULTS["max_model_len"]),
        "--kv-cache-memory-bytes", str(DEFAULTS["kv_cache_memory_bytes"]),
        "--seed", str(DEFAULTS["seed"]), "--disable-log-stats",
    ]


@contextlib.contextmanager
def running_server(model: str, *extra_args: str, env: dict[str, str] | None = None,
                   start_timeout_s: float = 900,
                   launcher: tuple[str, ...] = MODULE) -> Iterator[Server]:
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="vllm_lens_server_", suffix=".log",
                                      delete=False)
    proc = subprocess.Popen(
        [*server_args(model, port, launcher), *extra_args], stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    server = Server(f"http://127.0.0.1:{port}", proc.pid, log.name)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in time:\n{server.log_tail()}")
            time.sleep(1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
