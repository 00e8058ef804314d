"""``vllm-lens extract --ray``: one dataset written by many engines, each a Ray Data actor (runs in:
caller, front end).

The user's process drives the job; ``EngineActor`` holds an engine in each actor process.

The prompts are read and checked here as for one engine (``extract.prompts``; the keys already
written skipped), handed to Ray Data, and run by ``--num-engines`` actors, each a vLLM engine
with the command's engine options (tensor and pipeline parallelism inside it) that writes its
examples through the job's capture sink (``extract.job``) into the one dataset at ``--output``
as a writer of its own (``VLLM_LENS_SINK_WRITER``: shards of its own, one index and manifest;
``dataset.writer``). An actor takes the first free writer name ``ray<i>`` (a lock file in the
dataset directory it holds while it runs), so that a job re-run after a crash resumes each
writer where it stopped. Each batch is on disk before the actor returns it; the driver lists
the examples that failed and checks every accepted one is in the index.

The driver starts a local Ray instance, or joins ``--ray-address`` (or ``RAY_ADDRESS``); on a
cluster ``--output`` must be a folder every node mounts at the same path, on a filesystem
whose ``flock`` works across nodes (the writers' names and the shared index are taken under
locks). The actors get the environment vLLM's own Ray executor would carry over
(``actor_environment``). An actor asks Ray for ``tensor x pipeline`` GPUs where the cluster
has GPUs, and as many CPUs otherwise, all on one node; an actor that fails is not restarted:
the job fails, and a re-run resumes it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

from vllm_lens.cli.extract.engine_stop import stop_engine

__all__ = ["EngineActor", "MAX_ENGINES", "check_ray_args", "claim_writer", "extract_over_ray"]

#: Writer names an actor may claim (``ray0`` ... ): engines of one job.
MAX_ENGINES = 1024
#: How long the actors may take to start their engines (weights loaded, memory profiled).
_ENGINE_START_S = 3600
#: Settings of the driver's host or process that must not reach engines on other nodes.
_HOST_SPECIFIC = ("VLLM_HOST_IP", "VLLM_PORT", "VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL",
                  "VLLM_DP_SIZE", "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT",
                  "VLLM_LENS_SINK_WRITER", "VLLM_LENS_SERVER_DIR", "CUDA_VISIBLE_DEVICES")


def check_ray_args(args: Any) -> None:
    """Refuse, before anything starts, flags ``--ray`` cannot honour, and a missing Ray."""
    if not args.ray:
        raise SystemExit("vllm-lens extract: --num-engines and --ray-address go with --ray")
    if args.server is not None:
        raise SystemExit("vllm-lens extract: --ray runs engines of its own; drop --server")
    if args.num_engines is None:
        args.num_engines = 1
    if not 1 <= args.num_engines <= MAX_ENGINES:
        raise SystemExit(f"vllm-lens extract: --num-engines must be 1 to {MAX_ENGINES}")
    if getattr(args, "data_parallel_size", 1) > 1:
        raise SystemExit("vllm-lens extract: --ray runs --num-engines engines; give it "
                         "instead of --data-parallel-size")
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise SystemExit("vllm-lens extract: --ray needs Ray Data: pip install "
                         "'vllm-lens[ray]' (or 'ray[data]')") from None


def extract_over_ray(args: Any, engine: dict[str, Any], sp: Any, todo: list[Any],
                     bad: list[str], output: Path) -> None:
    """Run ``todo`` over ``args.num_engines`` engine actors writing ``output``; failures are
    listed in ``bad``."""
    import ray
    from tqdm import tqdm

    from vllm_lens.cli.extract.job import check_written, sink_settings

    env = actor_environment()
    env["VLLM_LENS_SINKS"] = sink_settings(output, args.rows_per_shard)
    per_engine = (engine.get("tensor_parallel_size") or 1) * (
        engine.get("pipeline_parallel_size") or 1)
    address = args.ray_address or os.environ.get("RAY_ADDRESS") or None
    started_here = not ray.is_initialized()
    if started_here:
        local = {} if address else {
            # A CPU per rank of every engine, even on a machine with fewer cores (they then
            # share them) rather than actors that never start.
            "num_cpus": max(os.cpu_count() or 1, args.num_engines * per_engine)}
        ray.init(address=address, runtime_env={"env_vars": env}, include_dashboard=False,
                 log_to_driver=True, **local)
    try:
        on_gpus = ray.cluster_resources().get("GPU", 0) > 0
        _check_room(ray.nodes(), args, per_engine, on_gpus, joined=address is not None)
        # Every engine up before the first batch is handed out (an actor that cannot start
        # fails the job now, and the batches are spread over all of them).
        ray.data.DataContext.get_current().wait_for_min_actors_s = _ENGINE_START_S
        items = ray.data.from_items([{"example": json.dumps(asdict(e))} for e in todo])
        results = items.map_batches(
            EngineActor, batch_size=args.batch_size, concurrency=args.num_engines,
            num_cpus=1 if on_gpus else per_engine, num_gpus=per_engine if on_gpus else None,
            fn_constructor_kwargs={"engine": engine, "max_tokens": sp.max_tokens,
                                   "extra_args": sp.extra_args, "output": str(output)},
            runtime_env={"env_vars": env}, batch_format="pyarrow",
            # An actor that failed (its engine refused the set-up, or died) fails the job,
            # which a re-run resumes; restarted, it would load the model again and again.
            max_restarts=0, max_task_retries=0)
        accepted, n_tokens, began = [], 0, time.monotonic()
        with tqdm(total=len(todo), unit="ex", desc="extract", file=sys.stderr) as bar:
            for row in results.iter_rows():
                if row["error"]:
                    bad.append(row["error"])
                    print(f"vllm-lens extract: {row['error']}", file=sys.stderr)
                else:
                    accepted.append(row["key"])
                n_tokens += row["tokens"]
                bar.set_postfix(tok_s=f"{n_tokens / (time.monotonic() - began):.0f}")
                bar.update(1)
    except ray.exceptions.RayError as exc:
        raise SystemExit(f"vllm-lens extract: the Ray job failed: {_first_line(exc)}") from None
    finally:
        if started_here:
            ray.shutdown()
    check_written(output, accepted, bad)


def _check_room(nodes: list[dict[str, Any]], args: Any, per_engine: int, on_gpus: bool,
                joined: bool) -> None:
    """Refuse a job the cluster has no room for (its actors would wait forever): an engine's
    ranks all on one node, and every engine somewhere. An autoscaling cluster may have room
    only later, so a cluster the job joined is only warned about."""
    kind = "GPU" if on_gpus else "CPU"
    per_node = [int(n.get("Resources", {}).get(kind, 0)) for n in nodes if n.get("Alive")]
    largest, total = max(per_node, default=0), sum(per_node)
    problem = None
    if largest < per_engine:
        problem = (f"an engine of {per_engine} rank(s) needs {per_engine} {kind}s on one node; "
                   f"the largest node of the Ray cluster has {largest}")
    elif total < args.num_engines * per_engine:
        problem = (f"{args.num_engines} engine(s) of {per_engine} rank(s) need "
                   f"{args.num_engines * per_engine} {kind}s; the Ray cluster has {total}")
    if problem is None:
        return
    if not joined:
        raise SystemExit(f"vllm-lens extract: {problem}")
    print(f"vllm-lens extract: warning: {problem} (now)", file=sys.stderr)


def actor_environment() -> dict[str, str]:
    """What of the driver's environment the actors get: what vLLM's own Ray executor carries
    over (``VLLM_*``, ``HF_*`` ... and what ``VLLM_RAY_EXTRA_ENV_*`` adds, less
    ``RAY_NON_CARRY_OVER_ENV_VARS``), without the settings that name this host or this
    process's place in a data-parallel group."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    names = get_env_vars_to_copy(exclude_vars=set(_HOST_SPECIFIC), destination="vllm-lens")
    return {name: os.environ[name] for name in sorted(names) if name in os.environ}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def claim_writer(output: Path) -> tuple[str, IO[str]]:
    """The first writer name ``ray<i>`` no running actor holds, and the open lock file that
    holds it (for as long as it stays open)."""
    import errno
    import fcntl

    for i in range(MAX_ENGINES):
        lock = open(output / f".ray{i}.engine", "w")  # noqa: SIM115 - held while it runs
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            lock.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                continue  # another actor holds it
            raise RuntimeError(f"{output}: cannot lock a file there ({exc}); the dataset's "
                               "writers need a filesystem whose flock works across every "
                               "node (NFSv4, CephFS, Lustre mounted with -o flock)") from None
        return f"ray{i}", lock
    raise RuntimeError(f"{output}: {MAX_ENGINES} engines are writing it already")


class EngineActor:
    """One engine of the job, called with batches of examples (a Ray Data actor).

    Returns, per example: ``key``, ``error`` (empty if written) and the ``tokens`` it ran
    (for the progress bar; a batch's total on its first example).
    """

    def __init__(self, engine: dict[str, Any], max_tokens: int, extra_args: dict[str, Any],
                 output: str) -> None:
        from vllm import LLM, SamplingParams

        from vllm_lens.cli.extract.job import ExtractJob

        self.output = Path(output)
        if not self.output.is_dir():
            raise RuntimeError(f"--output {output} is not a folder on this Ray node; on a "
                               "cluster it must be mounted at the same path on every node")
        self.writer, self._claim = claim_writer(self.output)
        os.environ["VLLM_LENS_SINK_WRITER"] = self.writer
        self.llm = LLM(**engine)
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=extra_args)
        self.job = ExtractJob(SimpleNamespace(batch_size=1 << 30), self.llm, sp, self.output)

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        from vllm_lens.cli.extract.prompts import Example

        examples = [Example(**json.loads(x)) for x in batch.column("example").to_pylist()]
        bad: list[str] = []
        self.job.receipts = {}  # this batch's only: the driver keeps the job's
        try:
            tokens = self.job.run_batch(examples, bad)
        except SystemExit as exc:  # the engine refused the job's set-up: no row can run
            raise RuntimeError(str(exc)) from None  # (SystemExit would end the actor)
        errors = {}
        for message in bad:  # "key 'k': problem" (``extract.output.fail``)
            for example in examples:
                if message.startswith(f"key {example.key!r}:"):
                    errors.setdefault(example.key, message)
        for example in examples:
            if example.key not in errors and example.key not in self.job.receipts:
                errors[example.key] = f"key {example.key!r}: not written ({'; '.join(bad)})"
        return {"key": [e.key for e in examples],
                "error": [errors.get(e.key, "") for e in examples],
                "tokens": [tokens if i == 0 else 0 for i in range(len(examples))]}

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            stop_engine(llm)
