"""Writing activation datasets to disk: fixed-size safetensors shards, an index and a
manifest, each written atomically (runs in: whatever process writes a dataset — a capture
sink in a worker, or a script).

A dataset is a directory::

    manifest.json            what was captured: model, versions, points, layers, dtype,
                             positions spec, row shapes (written once, first)
    index.jsonl              one line per example: key, shard, offset, rows, positions,
                             prompt token ids (appended after its shard is on disk)
    shard-00000.safetensors  per point and layer ``"<point>/<layer>"``: ``[rows, *row_shape]``,
    shard-00001.safetensors  the examples' rows one after the other

Every file appears under its final name only once complete (written beside it, then renamed),
and an example enters the index only after the shard holding its rows is complete, so a job
killed at any moment leaves a valid dataset: the examples not yet in the index are simply
absent, and a writer reopened on the directory (``ShardWriter(..., resume=True)``) skips the
keys the index already has. ``vllm_lens.datasets`` reads it back; numpy or safetensors users
can read the shards and the JSON files directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "INDEX", "MANIFEST", "ShardWriter", "read_index", "shard_name",
           "tensor_name"]

FORMAT = "vllm-lens-activations/1"
MANIFEST = "manifest.json"
INDEX = "index.jsonl"


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def tensor_name(point: str, layer: int) -> str:
    """The name of one point's rows at one layer inside a shard."""
    return f"{point}/{layer}"


def read_index(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The index's entries, and the length in bytes of its complete lines (a job killed
    while appending may leave a partial last line, which is not an entry)."""
    entries, good = [], 0
    if not path.exists():
        return entries, good
    data = path.read_bytes()
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            entries.append(json.loads(line))
        except ValueError:
            break
        good += len(line)
    return entries, good


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Appends examples to a dataset directory, ``rows_per_shard`` rows to a shard.

    Args:
        root: the dataset directory (created if missing).
        manifest: what the dataset holds: at least ``points`` (names), ``layers`` (ints),
            ``dtype`` (a torch dtype name) and ``row_shapes`` (point -> the shape of one row);
            written on first use, and checked against the existing one on ``resume``.
        rows_per_shard: rows (positions) per shard; the last shard may hold fewer.
        resume: reopen an existing dataset and skip the keys its index has; otherwise an
            existing index is an error.
    """

    def __init__(self, root: str | os.PathLike, manifest: Mapping[str, Any], *,
                 rows_per_shard: int = 65536, resume: bool = False) -> None:
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.manifest = {"format": FORMAT, **manifest}
        self.points: tuple[str, ...] = tuple(self.manifest["points"])
        self.layers: tuple[int, ...] = tuple(int(x) for x in self.manifest["layers"])
        self.dtype = getattr(torch, str(self.manifest["dtype"]))
        self.row_shapes = {p: tuple(self.manifest["row_shapes"][p]) for p in self.points}
        self.rows_per_shard = rows_per_shard
        self.written: set[str] = set()
        """Keys already in the index."""
        self._next_shard = 0
        self._pending: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
        self._pending_rows = 0
        self._open(resume)

    def _open(self, resume: bool) -> None:
        manifest_path, index_path = self.root / MANIFEST, self.root / INDEX
        if index_path.exists() and not resume:
            raise FileExistsError(f"{self.root} already holds a dataset; pass resume=True to "
                                  "add to it")
        if manifest_path.exists():
            existing = json.loads(manifest_path.read_text())
            for field in ("format", "points", "layers", "dtype", "row_shapes"):
                if _jsonable(existing.get(field)) != _jsonable(self.manifest.get(field)):
                    raise ValueError(f"{self.root}: the dataset's manifest has {field}="
                                     f"{existing.get(field)!r}, not {self.manifest.get(field)!r}")
        else:
            _atomic_write(manifest_path, json.dumps(self.manifest, indent=1).encode())
        entries, good = read_index(index_path)
        if index_path.exists() and good < index_path.stat().st_size:
            with open(index_path, "r+b") as f:  # drop a partial last line
                f.truncate(good)
        for entry in entries:
            self.written.add(entry["key"])
            self._next_shard = max(self._next_shard, entry["shard"] + 1)
        # Shards of a killed job that never reached the index are dropped, not reused.
        for stale in self.root.glob("shard-*.safetensors"):
            if int(stale.stem.split("-")[1]) >= self._next_shard:
                stale.unlink()

    def add(self, key: str, rows: Mapping[str, torch.Tensor], positions: Sequence[int],
            prompt_token_ids: Sequence[int] = ()) -> None:
        """Queue one example: ``rows[point]`` is ``[n_layers, n_rows, *row_shape]`` (the
        manifest's layers, in order; the same ``n_rows`` for every point), ``positions`` the
        token positions its rows come from (one per row; for a reduction, those reduced into
        its one row). Written when a shard fills up (or at ``close``)."""
        if key in self.written or any(entry["key"] == key for entry, _ in self._pending):
            raise ValueError(f"example key {key!r} is already in the dataset")
        missing = [point for point in self.points if point not in rows]
        if missing:
            raise ValueError(f"example {key!r} has no rows of {', '.join(missing)}")
        n_rows = rows[self.points[0]].shape[1] if rows[self.points[0]].dim() > 1 else -1
        checked = {}
        for point in self.points:
            t = rows[point]
            expected = (len(self.layers), n_rows, *self.row_shapes[point])
            if tuple(t.shape) != expected:
                raise ValueError(f"example {key!r}: {point} has shape {tuple(t.shape)}, "
                                 f"expected {expected}")
            checked[point] = t.detach().to("cpu", self.dtype)
        entry = {"key": key, "rows": n_rows, "positions": [int(p) for p in positions],
                 "prompt_token_ids": [int(t) for t in prompt_token_ids]}
        self._pending.append((entry, checked))
        self._pending_rows += n_rows
        if self._pending_rows >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        """Write the queued examples as one shard, then their index lines."""
        if not self._pending:
            return
        from safetensors.torch import save

        number = self._next_shard
        tensors = {}
        for point in self.points:
            for i, layer in enumerate(self.layers):
                parts = [rows[point][i] for _, rows in self._pending]
                tensors[tensor_name(point, layer)] = torch.cat(parts).contiguous()
        _atomic_write(self.root / shard_name(number), save(tensors))
        offset, lines = 0, []
        for entry, _ in self._pending:
            lines.append(json.dumps({**entry, "shard": number, "offset": offset}))
            offset += entry["rows"]
        with open(self.root / INDEX, "a") as f:  # one write: whole lines or none
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        self.written.update(entry["key"] for entry, _ in self._pending)
        self._next_shard = number + 1
        self._pending, self._pending_rows = [], 0

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        if exc_type is None:
            self.close()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))
