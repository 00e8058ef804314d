"""Writing activation datasets to disk: safetensors shards of bounded size, an index and a
manifest, each written atomically (runs in: the process that writes a dataset — the worker
holding a capture sink's rows, ``vllm-lens extract --server``, or any script).

A dataset is a directory::

    manifest.json            what was captured: model, versions, points, layers, dtype,
                             positions spec, row shapes (written once, first)
    index.jsonl              one line per example: key, shard, offset, rows, positions,
                             prompt token ids (appended after its shard is on disk)
    shard-00000.safetensors  per point and layer ``"<point>/<layer>"``: ``[rows, *row_shape]``,
    shard-00001.safetensors  the examples' rows one after the other; per SAE read (the
                             manifest's ``sae_features``, numbered from 0) its sparse features
                             at the same rows, ``"sae.<i>.indices"`` int32 and
                             ``"sae.<i>.values"`` float32 ``[rows, top_k]`` (-1 / 0 where
                             fewer were active), with ``reconstruction`` also ``"sae.<i>.nmse"``
                             float32 and ``"sae.<i>.l0"`` int32 ``[rows]``

Every file appears under its final name only once complete (written beside it, synced, then
renamed, and the directory synced), and an example enters the index only after the shard
holding its rows is on disk, so a job killed at any moment leaves a valid dataset: the
examples not yet in the index are absent. A failed index append is cut back; a writer
reopened on the directory (``ShardWriter(..., resume=True)``) drops a last line cut short, a
last shard whose lines did not all arrive and any orphan files, then skips the keys the index
has. One writer per directory at a time (a lock file). ``vllm_lens.datasets`` reads it back;
numpy or safetensors users can read the shards and the JSON files directly.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_lens.errors import DatasetConflictError

__all__ = ["FORMAT", "INDEX", "MANIFEST", "SAE_FIELDS", "VERSION_FIELDS", "ShardWriter",
           "jsonable", "read_index", "sae_column", "sae_fields", "shard_name", "tensor_name"]

FORMAT = "vllm-lens-activations/1"
MANIFEST = "manifest.json"
INDEX = "index.jsonl"
_SHARD = re.compile(r"^shard-(\d{5,})\.safetensors$")
#: Manifest fields that may differ between the runs that wrote one dataset.
VERSION_FIELDS = ("vllm_version", "vllm_lens_version")


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def tensor_name(point: str, layer: int) -> str:
    """The name of one point's rows at one layer inside a shard."""
    return f"{point}/{layer}"


#: The columns of one SAE's features, and their dtypes.
SAE_FIELDS = {"indices": torch.int32, "values": torch.float32, "nmse": torch.float32,
              "l0": torch.int32}


def sae_column(number: int, field: str) -> str:
    """The name of one field of the ``number``-th SAE's features inside a shard."""
    return f"sae.{number}.{field}"


def sae_fields(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """The fields a manifest's ``sae_features`` entry stores per row."""
    return ("indices", "values", "nmse", "l0") if entry.get("reconstruction") else (
        "indices", "values")


def read_index(path: Path) -> tuple[list[dict[str, Any]], list[int], int]:
    """The index's entries, the byte offset where each entry's line starts, and the length
    of its complete lines. Only a last line cut short (no newline: a job killed while
    appending) is tolerated; a bad line anywhere else raises ``ValueError``."""
    entries: list[dict[str, Any]] = []
    starts: list[int] = []
    good = 0
    if not path.exists():
        return entries, starts, good
    lines = path.read_bytes().splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        if not line.endswith(b"\n") and number == len(lines):
            break
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
                raise ValueError("not an example entry")
        except ValueError as exc:
            raise ValueError(f"{path}: line {number} is not an index entry ({exc}); the "
                             "dataset is damaged") from None
        entries.append(entry)
        starts.append(good)
        good += len(line)
    return entries, starts, good


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _publish(tmp: Path, path: Path) -> None:
    """Make the complete file ``tmp`` appear as ``path``, durably."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class ShardWriter:
    """Appends examples to a dataset directory, a shard at a time.

    Args:
        root: the dataset directory (created if missing).
        manifest: what the dataset holds: at least ``points`` (names), ``layers`` (ints),
            ``dtype`` (a torch dtype name) and ``row_shapes`` (point -> the shape of one row),
            optionally ``sae_features`` (per SAE read: ``top_k``, ``reconstruction`` and what
            names it), and anything else that describes it (model, positions spec ...);
            written on first use, and on ``resume`` equal to the existing one but for the
            versions. ``points`` may be empty when ``sae_features`` is not.
        rows_per_shard: a shard is written once this many rows are queued ...
        max_shard_bytes: ... or this many bytes (an example's rows never span two shards).
        resume: reopen an existing dataset and skip the keys its index has; otherwise an
            existing index is an error.
    """

    def __init__(self, root: str | os.PathLike, manifest: Mapping[str, Any], *,
                 rows_per_shard: int = 65536, max_shard_bytes: int = 1 << 30,
                 resume: bool = False) -> None:
        if rows_per_shard < 1 or max_shard_bytes < 1:
            raise ValueError("rows_per_shard and max_shard_bytes must be >= 1")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.manifest = jsonable({"format": FORMAT, **manifest})
        self.points: tuple[str, ...] = tuple(self.manifest["points"])
        self.layers: tuple[int, ...] = tuple(int(x) for x in self.manifest["layers"])
        self.dtype = getattr(torch, str(self.manifest["dtype"]))
        self.row_shapes = {p: tuple(self.manifest["row_shapes"][p]) for p in self.points}
        self.saes: tuple[dict[str, Any], ...] = tuple(self.manifest.get("sae_features") or ())
        if not self.points and not self.saes:
            raise ValueError("a dataset holds at least one point or SAE")
        self.rows_per_shard = rows_per_shard
        self.max_shard_bytes = max_shard_bytes
        self.written: set[str] = set()
        """Keys already in the index."""
        self._next_shard = 0
        self._pending: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
        self._pending_keys: set[str] = set()
        self._pending_rows = self._pending_bytes = 0
        self._lock = self._take_lock()
        try:
            self._open(resume)
        except BaseException:
            self._release()
            raise

    def _take_lock(self) -> Any:
        import fcntl

        lock = open(self.root / ".lock", "w")  # noqa: SIM115 - held until close
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise RuntimeError(f"{self.root}: another writer has this dataset open") from None
        return lock

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing drops the lock
            self._lock = None

    def _open(self, resume: bool) -> None:
        manifest_path, index_path = self.root / MANIFEST, self.root / INDEX
        if index_path.exists() and not resume:
            raise FileExistsError(f"{self.root} already holds a dataset; pass resume=True to "
                                  "add to it")
        for tmp in self.root.glob(".*.tmp-*"):  # left by a killed writer (we hold the lock)
            tmp.unlink()
        if manifest_path.exists():
            existing = json.loads(manifest_path.read_text())
            for field in sorted(set(existing) | set(self.manifest)):
                if field not in VERSION_FIELDS and existing.get(field) != self.manifest.get(field):
                    raise DatasetConflictError(
                        f"{self.root}: the dataset's manifest has {field}="
                        f"{existing.get(field)!r}, not {self.manifest.get(field)!r}")
        else:
            tmp = _temp_name(manifest_path)
            tmp.write_text(json.dumps(self.manifest, indent=1))
            _publish(tmp, manifest_path)
        entries, starts, good = read_index(index_path)
        if entries:  # the last shard's lines may not all have arrived
            last = entries[-1]["shard"]
            first = next(i for i, e in enumerate(entries) if e["shard"] == last)
            covered = sum(e["rows"] for e in entries[first:])
            if covered != self._shard_rows(last):
                entries, good = entries[:first], starts[first]
        if index_path.exists() and good < index_path.stat().st_size:
            with open(index_path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        for entry in entries:
            self.written.add(entry["key"])
            self._next_shard = max(self._next_shard, entry["shard"] + 1)
        for path in self.root.iterdir():  # shards of a killed job that never reached the index
            m = _SHARD.match(path.name)
            if m and int(m.group(1)) >= self._next_shard:
                path.unlink()

    def _shard_rows(self, number: int) -> int:
        """Rows in shard ``number`` (-1 if it is missing or unreadable)."""
        path = self.root / shard_name(number)
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            return int(header[self._first_column]["shape"][0])
        except (OSError, ValueError, KeyError, struct.error):
            return -1

    @property
    def _first_column(self) -> str:
        """A tensor every shard has, one row per example row."""
        if self.points:
            return tensor_name(self.points[0], self.layers[0])
        return sae_column(0, "indices")

    def add(self, key: str, rows: Mapping[str, torch.Tensor], positions: Sequence[int],
            prompt_token_ids: Sequence[int] = (), token_ids: Sequence[int] = (), *,
            reduced: bool = False,
            sae_features: Sequence[Mapping[str, torch.Tensor]] = ()) -> tuple[int, int]:
        """Queue one example: ``rows[point]`` is ``[n_layers, n_rows, *row_shape]`` (the
        manifest's layers, in order; the same ``n_rows`` for every point), ``positions`` the
        token positions of its rows (one per row; if ``reduced``, the positions reduced into
        its one row), ``token_ids`` the generated tokens, ``sae_features`` one entry per
        manifest ``sae_features`` entry (``indices`` / ``values`` ``[n_rows, top_k]``, and
        ``nmse`` / ``l0`` ``[n_rows]`` with ``reconstruction``). Written when the shard fills
        up (or at ``close``). Returns the shard and the row offset it will have there; a
        flush that fails raises, and the example stays queued with the others."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"example keys are non-empty strings, got {key!r}")
        if key in self.written or key in self._pending_keys:
            raise DatasetConflictError(f"example key {key!r} is already in the dataset")
        missing = [point for point in self.points if point not in rows]
        if missing:
            raise ValueError(f"example {key!r} has no rows of {', '.join(missing)}")
        if len(sae_features) != len(self.saes):
            raise ValueError(f"example {key!r} has {len(sae_features)} SAE feature entries, "
                             f"the dataset {len(self.saes)}")
        if reduced and self.saes:
            raise ValueError(f"example {key!r}: SAE features are per position, not reduced")
        if self.points:
            first = rows[self.points[0]]
            n_rows = int(first.shape[1]) if first.dim() > 1 else -1
        else:
            n_rows = int(sae_features[0]["indices"].shape[0])
        if reduced and n_rows != 1:
            raise ValueError(f"example {key!r}: a reduced example has one row, not {n_rows}")
        if not reduced and len(positions) != n_rows:
            raise ValueError(f"example {key!r}: {len(positions)} positions for {n_rows} rows")
        checked = {}
        for point in self.points:
            t = rows[point]
            expected = (len(self.layers), n_rows, *self.row_shapes[point])
            if tuple(t.shape) != expected:
                raise ValueError(f"example {key!r}: {point} has shape {tuple(t.shape)}, "
                                 f"expected {expected}")
            checked[point] = t.detach().to("cpu", self.dtype)
        for number, (spec, entry) in enumerate(zip(self.saes, sae_features)):
            for field in sae_fields(spec):
                t = entry.get(field)
                expected = (n_rows, int(spec["top_k"])) if field in ("indices", "values") \
                    else (n_rows,)
                if t is None or tuple(t.shape) != expected:
                    raise ValueError(f"example {key!r}: SAE entry {number}'s {field} has "
                                     f"shape {None if t is None else tuple(t.shape)}, "
                                     f"expected {expected}")
                checked[sae_column(number, field)] = t.detach().to("cpu", SAE_FIELDS[field])
        placed = (self._next_shard, self._pending_rows)
        entry = {"key": key, "rows": n_rows, "positions": [int(p) for p in positions],
                 "prompt_token_ids": [int(t) for t in prompt_token_ids],
                 "token_ids": [int(t) for t in token_ids]}
        self._pending.append((entry, checked))
        self._pending_keys.add(key)
        self._pending_rows += n_rows
        self._pending_bytes += sum(t.numel() * t.element_size() for t in checked.values())
        if (self._pending_rows >= self.rows_per_shard
                or self._pending_bytes >= self.max_shard_bytes):
            self.flush()
        return placed

    @property
    def pending_keys(self) -> list[str]:
        """Keys queued for the next shard, in order."""
        return [entry["key"] for entry, _ in self._pending]

    def abandon(self) -> list[str]:
        """Drop the queued examples without writing them and let go of the directory (after
        a failed flush); returns their keys. The dataset stays what its index lists."""
        dropped = self.pending_keys
        self._pending, self._pending_keys = [], set()
        self._pending_rows = self._pending_bytes = 0
        self._release()
        return dropped

    def flush(self) -> None:
        """Write the queued examples as one shard, then their index lines. On failure (a
        full disk ...) nothing of it is left behind, and the examples stay queued."""
        if not self._pending:
            return
        from safetensors.torch import save_file

        number = self._next_shard
        path = self.root / shard_name(number)
        tmp = _temp_name(path)
        index_path = self.root / INDEX
        size_before = index_path.stat().st_size if index_path.exists() else 0
        try:
            tensors = {}
            for point in self.points:
                for i, layer in enumerate(self.layers):
                    parts = [rows[point][i] for _, rows in self._pending]
                    tensors[tensor_name(point, layer)] = torch.cat(parts).contiguous()
            for i, spec in enumerate(self.saes):
                for field in sae_fields(spec):
                    name = sae_column(i, field)
                    tensors[name] = torch.cat([rows[name] for _, rows in self._pending])
            save_file(tensors, tmp)
            del tensors
            _publish(tmp, path)
            offset, lines = 0, []
            for entry, _ in self._pending:
                lines.append(json.dumps({**entry, "shard": number, "offset": offset}))
                offset += entry["rows"]
            with open(index_path, "a") as f:
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            if index_path.exists() and index_path.stat().st_size > size_before:
                with open(index_path, "r+b") as f:  # cut a partial append back
                    f.truncate(size_before)
            path.unlink(missing_ok=True)
            raise
        self.written.update(self._pending_keys)
        self._next_shard = number + 1
        self._pending, self._pending_keys = [], set()
        self._pending_rows = self._pending_bytes = 0

    def close(self) -> None:
        """Write what is queued and let go of the directory."""
        try:
            self.flush()
        finally:
            self._release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._release()


def jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON."""
    return json.loads(json.dumps(value))
