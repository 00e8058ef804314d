"""An ``extract`` job's request, output directory and exit status, shared by the local engine path
(``cli.main``) and the ``--server`` path (``extract.remote``) (runs in: caller).

A job records its settings beside the dataset (``extract.json``), refuses a dataset made with
other settings or locked by another writer, and resumes by skipping the keys already written.
With ``--format sae-lens`` the dataset is kept in ``SAE_LENS_ROWS`` inside ``--output`` and
written out in sae-lens' layout (``vllm_lens.dataset.sae_lens_cache``) when the job ends.
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
    from vllm_lens.dataset.format import MANIFEST

    job_settings = {"model": args.model, "max_tokens": args.max_tokens}
    if (output / MANIFEST).exists():
        _check_same_job(json.loads((output / MANIFEST).read_text()), args, points)
    if (output / JOB_FILE).exists():
        _check_job_file(json.loads((output / JOB_FILE).read_text()), job_settings, output)
    output.mkdir(parents=True, exist_ok=True)
    _hold_job_lock(output)
    _check_unlocked(output)
    todo = not_written(examples, output)
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


def lens_spec(args: Any, points: list[str]) -> dict[str, Any]:
    """The job's lens keys: ``output_activations`` for its points, layers, positions and
    reduction, and ``output_sae_features`` for its SAEs at the same positions."""
    spec: dict[str, Any] = {}
    if points:
        layers: Any = True if args.layers.strip() == "all" else [
            int(x) for x in args.layers.split(",") if x.strip()]
        capture = {"layers": layers, "positions": args.positions}
        if args.reduce:
            capture["reduce"] = args.reduce
        spec["output_activations"] = {point: capture for point in points}
    if args.sae:
        spec["output_sae_features"] = [
            {"sae": sae, "top_k": args.top_k, "positions": args.positions,
             "reconstruction": args.sae_reconstruction} for sae in args.sae]
    return spec


#: With ``--format sae-lens``: the folder inside ``--output`` that keeps the job's rows as a
#: vllm-lens dataset (resumable; sae-lens reads ``--output`` itself).
SAE_LENS_ROWS = "vllm-lens-rows"


def check_sae_lens_format(args: Any, points: list[str]) -> None:
    """``--format sae-lens`` writes the rows of one point at one layer, one per token."""
    layers = [] if args.layers is None else [x for x in args.layers.split(",") if x.strip()]
    if len(points) != 1 or len(layers) != 1 or not layers[0].strip().isdigit():
        raise SystemExit("vllm-lens extract: --format sae-lens writes one point at one layer "
                         "(sae-lens trains an SAE on one hook): give one of each in --points "
                         "and --layers")
    args.layers = layers[0].strip()
    try:
        import datasets  # noqa: F401 - the layout is a Hugging Face dataset
    except ImportError:
        raise SystemExit("vllm-lens extract: --format sae-lens writes a Hugging Face dataset: "
                         "install the `datasets` package (pip install datasets)") from None
    if args.reduce:
        raise SystemExit("vllm-lens extract: --format sae-lens writes a row per token; drop "
                         "--reduce")
    if args.sae:
        raise SystemExit("vllm-lens extract: --format sae-lens holds rows only; write SAE "
                         "features (--sae) to a vllm-lens dataset")
    if args.context_size < 1:
        raise SystemExit("vllm-lens extract: --context-size must be >= 1")


def export_sae_lens(args: Any, rows: Path, output: Path, points: list[str],
                    status: int) -> int:
    """With ``--format sae-lens``: write the dataset at ``rows`` to ``output`` in sae-lens'
    layout; returns the job's exit status."""
    if args.format != "sae-lens" or not (rows / "manifest.json").exists():
        return status
    from vllm_lens.dataset import reader as datasets
    from vllm_lens.dataset.sae_lens_cache import write_sae_lens_cache

    made = write_sae_lens_cache(datasets.open(rows), output, args.context_size,
                                point=points[0], layer=int(args.layers))
    print(f"vllm-lens extract: {output}: sae-lens cached activations, hook "
          f"{made['hook_name']}, {made['contexts']} contexts of {args.context_size} tokens "
          f"(d_in {made['d_in']}, {made['dtype']}; {made['dropped']} rows after the last full "
          f"context left out); the rows stay in {rows}", file=sys.stderr)
    return status


def summary(output: Path) -> tuple[int, int, int] | None:
    """(complete examples, their rows, bytes on disk) of the dataset at ``output``; ``None``
    if there is none."""
    from vllm_lens.dataset.format import INDEX
    from vllm_lens.dataset.index import complete_keys, read_index

    if not (output / INDEX).exists():
        return None
    complete = set(complete_keys(output))
    rows: dict[str, int] = {}
    for entry in read_index(output / INDEX)[0]:  # (a pipeline stage's part: the same rows)
        if entry["key"] in complete:
            rows[entry["key"]] = max(rows.get(entry["key"], 0), int(entry["rows"]))
    size = sum(f.stat().st_size for f in output.iterdir() if f.is_file())
    return len(complete), sum(rows.values()), size


def not_written(examples: list[Any], output: Path) -> list[Any]:
    """The examples whose key is not yet a complete example of the dataset (all of its
    writers' parts in the index)."""
    from vllm_lens.dataset.format import INDEX
    from vllm_lens.dataset.index import complete_keys

    if not (output / INDEX).exists():
        return examples
    done = set(complete_keys(output))
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
    if args.layers is None:
        mine["layers"] = []
    elif args.layers.strip() != "all":
        mine["layers"] = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    found_saes = [(e.get("sae"), e.get("top_k"), e.get("reconstruction"))
                  for e in manifest.get("sae_features") or ()]
    my_saes = [(sae, args.top_k, args.sae_reconstruction) for sae in args.sae or ()]
    if found_saes != my_saes:
        raise SystemExit(f"vllm-lens extract: {args.output} holds a dataset made with SAEs "
                         f"(sae, top_k, reconstruction) {found_saes!r}, not {my_saes!r}; "
                         "write to another --output")
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


#: The job lock this process holds (open until it exits): ``_hold_job_lock``.
_job_locks: list[Any] = []


def _hold_job_lock(output: Path) -> None:
    """Refuse a dataset another ``extract`` job is preparing or writing, and hold it for this
    one until the process exits (the engines' writers take their own locks only once they
    start, minutes later)."""
    import fcntl

    lock = open(output / ".job.lock", "w")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise SystemExit(f"vllm-lens extract: another job is writing {output}") from None
    _job_locks.append(lock)


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
