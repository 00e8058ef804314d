"""An ``extract`` job's output directory and exit status, shared by the local engine path
(``cli``) and the ``--server`` path (``remote_extract``) (runs in: the user's process).

A job records its settings beside the dataset (``extract.json``), refuses a dataset made with
other settings or locked by another writer, and resumes by skipping the keys already written.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def prepare_output(args: Any, examples: list[Any], output: Path,
                   points: list[str]) -> list[Any]:
    """Refuse an output made with other settings or being written by another job; record
    this job's settings; returns the examples not written yet."""
    from vllm_lens.shard_writer import MANIFEST

    job_settings = {"model": args.model, "max_tokens": args.max_tokens}
    if (output / MANIFEST).exists():
        _check_same_job(json.loads((output / MANIFEST).read_text()), args, points)
    if (output / JOB_FILE).exists():
        _check_job_file(json.loads((output / JOB_FILE).read_text()), job_settings, output)
    _check_unlocked(output)
    todo = not_written(examples, output)
    output.mkdir(parents=True, exist_ok=True)
    _write_job_file(output / JOB_FILE, job_settings)
    return todo


def finish(bad: list[str]) -> int:
    """The exit status: 1 if any input row or example failed (they were listed)."""
    if bad:
        print(f"vllm-lens extract: {len(bad)} bad input row(s) or failed example(s); the "
              "others were written", file=sys.stderr)
        return 1
    return 0


def fail(bad: list[str], example: Any, exc: Any) -> None:
    """List one failed example (on stderr, and in ``bad``)."""
    bad.append(f"key {example.key!r}: {exc}")
    print(f"vllm-lens extract: {bad[-1]}", file=sys.stderr)


def capture_spec(args: Any, points: list[str]) -> dict[str, Any]:
    """``output_activations`` for the job's points, layers, positions and reduction."""
    layers: Any = True if args.layers.strip() == "all" else [
        int(x) for x in args.layers.split(",") if x.strip()]
    capture = {"layers": layers, "positions": args.positions}
    if args.reduce:
        capture["reduce"] = args.reduce
    return {point: capture for point in points}


def not_written(examples: list[Any], output: Path) -> list[Any]:
    from vllm_lens.shard_writer import INDEX, read_index

    if not (output / INDEX).exists():
        return examples
    done = {entry["key"] for entry in read_index(output / INDEX)[0]}
    todo = [e for e in examples if e.key not in done]
    print(f"vllm-lens extract: resuming, {len(examples) - len(todo)} of {len(examples)} "
          "examples already written", file=sys.stderr)
    return todo


#: Settings of the job that are not in the dataset's manifest, checked on resume.
JOB_FILE = "extract.json"


def _check_same_job(manifest: dict[str, Any], args: Any, points: list[str]) -> None:
    """Refuse, before the engine starts, to add to a dataset made with other settings."""
    mine = {"points": points, "positions": args.positions, "reduce": args.reduce,
            "model": args.model}
    if args.layers.strip() != "all":
        mine["layers"] = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    for field, value in mine.items():
        if manifest.get(field) != value:
            raise SystemExit(f"vllm-lens extract: {args.output} holds a dataset made with "
                             f"{field}={manifest.get(field)!r}, not {value!r}; write to another "
                             "--output")


def _check_job_file(found: dict[str, Any], mine: dict[str, Any], output: Path) -> None:
    for field, value in mine.items():
        if found.get(field) != value:
            raise SystemExit(f"vllm-lens extract: {output} holds a dataset made with "
                             f"{field.replace('_', '-')}={found.get(field)!r}, not {value!r}; "
                             "write to another --output")


def _write_job_file(path: Path, settings: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(settings))
    os.replace(tmp, path)


def _check_unlocked(output: Path) -> None:
    """Refuse a dataset another job is writing (its writer holds the lock)."""
    import fcntl

    lock = output / ".lock"
    if not lock.exists():
        return
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SystemExit(f"vllm-lens extract: another job is writing {output}") from None
        fcntl.flock(f, fcntl.LOCK_UN)
