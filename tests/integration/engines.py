"""Starting and stopping real vLLM CPU engines for tests, with settings that fit the CI box."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm import LLM

from vllm_lens.cli.extract.engine_stop import stop_engine
from vllm_lens.common.messages import TAG_FIELD, StatsAnswer, read

#: Small, deterministic engines: float32 for exact comparisons, a bounded KV cache so that
#: two or three engines fit in memory at once.
DEFAULTS: dict[str, Any] = dict(
    dtype="float32",
    max_model_len=1024,
    kv_cache_memory_bytes=256 << 20,
    seed=0,
)


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    return {**DEFAULTS, **overrides}


@contextlib.contextmanager
def running_llm(model: str, **overrides: Any) -> Iterator[LLM]:
    llm = LLM(model, **engine_kwargs(**overrides))
    try:
        yield llm
    finally:
        stop_engine(llm)
        del llm
        gc.collect()


@contextlib.contextmanager
def running_async_llm(model: str, **overrides: Any) -> Iterator[tuple[Any, Any]]:
    """An ``AsyncLLM`` on its own event loop: yields (engine, run), ``run(coro)`` runs a
    coroutine on that loop to completion."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model,
                                                       **engine_kwargs(**overrides)))
    try:
        yield engine, loop.run_until_complete
    finally:
        stop_engine(engine)
        # Let the engine's background tasks finish in their own loop, or their zmq sockets
        # stay open and block interpreter exit.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """Set environment variables for engines started inside the block (workers inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cores_of_rank_0() -> list[int]:
    """The cores a multiprocess CPU engine's rank-0 worker pins its threads to: those
    ``VLLM_CPU_OMP_THREADS_BIND`` names for it, or with "auto" (vLLM's default) every core
    but one, which vLLM keeps for the front end."""
    available = sorted(os.sched_getaffinity(0))
    mask = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if mask == "nobind":
        return available
    if mask == "auto":
        return available[:-1] or available
    cores: list[int] = []
    for part in mask.split("|")[0].split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def generate_without_plugin(model: str, prompts: list[str], max_tokens: int,
                            **overrides: Any) -> list[list[int]]:
    """Greedy token ids from a separate process started with ``VLLM_LENS_DISABLE=1``.

    The same engine configuration (model, dtype, chunking, compiled or eager) in one process:
    vLLM's engine core and its worker run inside the script (``VLLM_ENABLE_V1_MULTIPROCESSING
    =0``, the uniprocess executor), which saves two process starts, ~13 s alone, per baseline.
    The script runs on the cores, and with the thread count, that a multiprocess engine's
    worker would pin itself to, so the arithmetic is the same."""
    script = Path(__file__).with_name("plain_generate.py")
    kwargs = engine_kwargs(**overrides)
    one_process = all(kwargs.get(k, 1) == 1 for k in (
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    if one_process:
        kwargs.setdefault("distributed_executor_backend", "uni")
    environment = {**os.environ, "VLLM_LENS_DISABLE": "1"}
    cores = None
    if one_process:
        cores = cores_of_rank_0()
        environment.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(len(cores)))
    request = json.dumps({"model": model, "prompts": prompts, "max_tokens": max_tokens,
                          "engine": kwargs, "cores": cores})
    proc = subprocess.run(
        [sys.executable, str(script)], input=request, capture_output=True, text=True,
        env=environment, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


#: ``lens_stats`` of a worker that holds nothing for any request.
IDLE = {"entries": 0, "bytes": 0, "records": 0, "device_bytes": 0}


def held(stats: list[Any]) -> list[dict[str, Any]]:
    """Each rank's ``lens_stats`` without the SAEs it keeps loaded (``saes``, ``sae_bytes``:
    shared by requests, kept after they finish) and its staging pool (``staging_bytes``, kept
    for later steps): what it holds for requests, to compare with ``IDLE``. ``stats``: the
    workers' answers (``StatsAnswer``), or the ``workers`` of ``GET /v1/lens/stats``."""
    public = [s if isinstance(s, dict) and TAG_FIELD not in s else read(StatsAnswer, s).as_json()
              for s in stats]
    return [{k: v for k, v in s.items() if k not in ("saes", "sae_bytes", "staging_bytes")}
            for s in public]
