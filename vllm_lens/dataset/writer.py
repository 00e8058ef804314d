"""Writing activation datasets to disk: safetensors shards of bounded size, an index and a manifest,
each written atomically, by one writer or by several at once (runs in: caller, worker).

The worker holding a capture sink's rows, ``vllm-lens extract --server``, or any script.

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

Every file appears under its final name only once complete (written beside it, a shard in a
staging directory of its writer's and past the page cache where the filesystem allows,
``vllm_lens.dataset.shard_file``; synced, then renamed, and the directory synced; pages of a shard still
cached are then dropped), and an example enters the index only after the shard holding its rows
is on disk, so a job killed at any moment leaves a valid dataset: the examples not yet in the
index are absent. A failed index append is cut back; a writer reopened on the directory
(``ShardWriter(..., resume=True)``) drops a last line cut short, a last shard whose lines did
not all arrive and any orphan files, then skips the keys the index has. ``vllm_lens.dataset.reader``
reads it back; numpy or safetensors users can read the shards and the JSON files directly.

**One writer or several.** A writer without a name (``writer=None``) holds the directory
alone (an exclusive ``flock`` of ``.lock``) and writes the files above. Several *named*
writers may write one dataset at once — the engines of a data-parallel job, the stages of a
pipeline-parallel one, independent engines given ``VLLM_LENS_SINK_WRITER`` — each taking
``.lock`` shared and ``.lock-<writer>`` exclusive (the same name twice, or a named writer
beside an unnamed one, is refused). Each writes its own shards,
``shard-<writer>-NNNNN.safetensors``, and its index lines carry ``"writer"``; they share the
one ``index.jsonl`` (appended under ``.index.lock``: ``vllm_lens.dataset.index``) and the one
``manifest.json`` (created under that lock by whichever comes first, then compared by every
other as a resumed writer's is). A pipeline stage's writer holds only its layers' rows (and
the SAEs at them): it writes its *part* of each example, and its lines say which
(``"layers"``, ``"saes"``); readers show an example once all its parts are in. A named writer
resumes on its own: it removes only its own temp files and its own shards past its last
indexed one, and if its last shard's lines did not all arrive it rewrites the index without
them (under the lock). A key whose example is complete is refused; a part the index already
holds (a resumed job sending an incomplete example again) is not written twice.

Beside this module: ``publish`` (a file made durable under its final name), ``locks`` (who
may write a directory), ``recovery`` (reopening one a writer was killed writing) and
``index`` (the shared index), ``examples`` (an example checked against the manifest).

**Writing on another thread.** A writer given ``hand_off`` does not write a shard when it
fills: it seals the shard (its number and examples fixed, its keys no longer queued but not
yet in the index) and hands it over; the callee writes it with ``write_shard``, on a thread
of its own, in the order handed over, while ``add`` goes on filling the next one (a capture
sink's writer thread: ``vllm_lens.sinks.shards``). ``add`` and ``write_shard`` share only
what a lock guards (the keys being written, the keys written, the view of the index), and a
failed ``write_shard`` drops its shard's examples alone.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_lens.dataset.examples import Part, checked_rows, part_of
from vllm_lens.dataset.format import FORMAT, INDEX, sae_column, sae_fields, shard_name, tensor_name
from vllm_lens.dataset.index import (
    IndexView, append_lines, check_writer, index_locked, parse_line, read_index)
from vllm_lens.dataset.locks import release_locks, take_locks
from vllm_lens.dataset.publish import publish, temp_name
from vllm_lens.dataset.recovery import check_manifest, recover, remove_temp_files
from vllm_lens.dataset.shard_file import DTYPE_NAMES, release_buffer, write_shard_file
from vllm_lens.errors import DatasetConflictError

__all__ = ["Shard", "ShardWriter", "jsonable"]


@dataclass(eq=False)
class Shard:
    """Examples sealed into one shard, waiting to be written (``ShardWriter.write_shard``)."""

    number: int
    examples: list[tuple[dict[str, Any], dict[str, torch.Tensor]]]
    """Each example's index line (without shard and offset) and its tensors by name."""
    part: Part
    """The manifest layers and SAE entries its examples hold."""
    rows: int
    nbytes: int

    @property
    def keys(self) -> list[str]:
        """Its examples' keys, in order."""
        return [entry["key"] for entry, _ in self.examples]


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
            existing index is an error (named writers sharing a dataset all pass ``True``).
        writer: ``None`` to hold the directory alone, or this writer's name (1 to 64
            letters, digits, ``_``, ``.``, ``-``) to write it beside other named writers.
        hand_off: called with this writer and each shard as it is sealed (full, or at
            ``flush``) instead of writing it there: the callee writes the shards with
            ``write_shard``, in the order handed over, from any thread, and may block to hold
            back the next ``add``. ``None``: ``add`` and ``flush`` write it themselves.
    """

    def __init__(self, root: str | os.PathLike, manifest: Mapping[str, Any], *,
                 rows_per_shard: int = 65536, max_shard_bytes: int = 1 << 30,
                 resume: bool = False, writer: str | None = None,
                 hand_off: Callable[[ShardWriter, Shard], None] | None = None) -> None:
        if rows_per_shard < 1 or max_shard_bytes < 1:
            raise ValueError("rows_per_shard and max_shard_bytes must be >= 1")
        self.writer = check_writer(writer)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.manifest = jsonable({"format": FORMAT, **manifest})
        self.points: tuple[str, ...] = tuple(self.manifest["points"])
        self.layers: tuple[int, ...] = tuple(int(x) for x in self.manifest["layers"])
        self.dtype = getattr(torch, str(self.manifest["dtype"]))
        if self.dtype not in DTYPE_NAMES:
            known = sorted(str(d).removeprefix("torch.") for d in DTYPE_NAMES)
            raise ValueError(f"manifest dtype {self.manifest['dtype']!r} is not one a shard "
                             f"holds ({', '.join(known)})")
        self.row_shapes = {p: tuple(self.manifest["row_shapes"][p]) for p in self.points}
        self.saes: tuple[dict[str, Any], ...] = tuple(self.manifest.get("sae_features") or ())
        if not self.points and not self.saes:
            raise ValueError("a dataset holds at least one point or SAE")
        self.rows_per_shard = rows_per_shard
        self.max_shard_bytes = max_shard_bytes
        self._view = IndexView(self.layers, len(self.saes))
        """What the index holds of each key (other writers' lines read as they come)."""
        self._seen = (0, 0)
        """The index's inode and how many of its bytes ``_view`` has read."""
        self._seen_tail = b""
        """The last line ``_view`` read (its bytes end at ``_seen``'s offset): still there
        at the next read, or lines read were cut back since."""
        self._mine: set[str] = set()
        self._placements: dict[str, list[tuple[frozenset, int, int]]] | None = None
        """Key -> (what a line holds, its shard, its offset), for ``_placed``."""
        """Keys whose part this writer writes is in the index (written or found there)."""
        self._next_shard = 0
        self._pending: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
        self._pending_keys: set[str] = set()
        self._pending_part: Part | None = None
        self._pending_rows = self._pending_bytes = 0
        self._hand_off = hand_off
        self._sealed: dict[str, None] = {}
        """The keys of the shards sealed and not yet written, in order."""
        self._state = threading.Condition()
        """Guards what ``add`` and ``write_shard`` (maybe on another thread) share: ``_view``,
        ``_seen``, ``_mine``, ``_sealed``; notified when a shard is written or dropped."""
        self._locks = take_locks(self.root, self.writer)
        try:
            self._open(resume)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        release_locks(self._locks)
        self._locks = []

    def _open(self, resume: bool) -> None:
        index_path = self.root / INDEX
        if index_path.exists() and not resume:
            raise FileExistsError(f"{self.root} already holds a dataset; pass resume=True to "
                                  "add to it")
        with index_locked(self.root, self.writer is not None):
            remove_temp_files(self.root, self.writer)
            check_manifest(self.root, self.manifest, self.writer)
            entries, self._next_shard = recover(self.root, self.writer)
            for entry in entries:
                self._view.add(entry)
            if index_path.exists():
                with open(index_path, "rb") as f:
                    stat = os.fstat(f.fileno())
                    end = f.seek(0, os.SEEK_END)
                    tail = os.pread(f.fileno(), min(end, 1 << 16), end - min(end, 1 << 16))
                self._seen = (stat.st_ino, end)
                self._seen_tail = tail[tail.rfind(b"\n", 0, len(tail) - 1) + 1:]

    def _catch_up(self) -> None:
        """Read the index lines appended since we last looked (other writers', and our own
        after a flush; all of it again if a writer rewrote it), complete lines only."""
        try:
            fd = os.open(self.root / INDEX, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            inode, seen = self._seen
            stat = os.fstat(fd)
            tail = self._seen_tail
            # Read it all again if a resuming writer rewrote it (another file), or if lines
            # read before were cut back since (an append that failed is rolled back: the file
            # shrank, or grew again with other lines, so the last line read is no longer
            # where it was; a line written again there byte for byte is the same line).
            if (stat.st_ino != inode or stat.st_size < seen
                    or (tail and os.pread(fd, len(tail), seen - len(tail)) != tail)):
                self._view = IndexView(self.layers, len(self.saes))
                inode, seen, tail = stat.st_ino, 0, b""
            if stat.st_size > seen:
                data = os.pread(fd, stat.st_size - seen, seen)
                data = data[:data.rfind(b"\n") + 1]
                for line in data.splitlines(keepends=True):
                    self._view.add(parse_line(line, self.root / INDEX, f"the line at byte {seen}"))
                    seen += len(line)
                    tail = line
            self._seen = (inode, seen)
            self._seen_tail = tail
        finally:
            os.close(fd)

    def durable(self, key: str) -> bool:
        """Whether ``key``'s rows this writer holds are in the index."""
        with self._state:
            return key in self._mine or self._view.held(key) >= self._view.whole

    def add(self, key: str, rows: Mapping[str, torch.Tensor], positions: Sequence[int],
            prompt_token_ids: Sequence[int] = (), token_ids: Sequence[int] = (), *,
            reduced: bool = False,
            sae_features: Sequence[Mapping[str, torch.Tensor]] = (),
            layers: Sequence[int] | None = None,
            saes: Sequence[int] | None = None) -> tuple[int, int]:
        """Queue one example: ``rows[point]`` is ``[n_layers, n_rows, *row_shape]`` (the
        manifest's layers, in order; the same ``n_rows`` for every point), ``positions`` the
        token positions of its rows (one per row; if ``reduced``, the positions reduced into
        its one row), ``token_ids`` the generated tokens, ``sae_features`` one entry per
        manifest ``sae_features`` entry (``indices`` / ``values`` ``[n_rows, top_k]``, and
        ``nmse`` / ``l0`` ``[n_rows]`` with ``reconstruction``). A part of an example (a
        pipeline stage's) names the manifest ``layers`` its rows hold and the numbers of the
        ``saes`` entries its features are. Written when the shard fills up (or at
        ``close``; with ``hand_off``, handed over instead). Returns the shard and the row
        offset it will have there; a flush that fails raises, and the example stays queued
        with the others."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"example keys are non-empty strings, got {key!r}")
        part = part_of(key, self.layers, len(self.saes), layers, saes)
        with self._state:
            if key in self._pending_keys or key in self._sealed:
                raise DatasetConflictError(f"example key {key!r} is already in the dataset")
            if self.writer is not None:  # (the unnamed writer is alone)
                self._catch_up()
            held = self._view.held(key)
            written = self._view.slots(self._line_fields(part)) <= held
        if held >= self._view.whole:
            raise DatasetConflictError(f"example key {key!r} is already in the dataset")
        n_rows, checked = checked_rows(
            key, part, rows, positions, sae_features, points=self.points,
            row_shapes=self.row_shapes, dtype=self.dtype, saes=self.saes, reduced=reduced,
            part_named=saes is not None)
        if written:  # (a resumed job sent an incomplete example again)
            with self._state:
                self._mine.add(key)
            return self._placed(key, part)
        if self._pending and self._pending_part != part:
            self.flush()  # a shard holds one part of its examples
        placed = (self._next_shard, self._pending_rows)
        entry = {"key": key, "rows": n_rows, "positions": [int(p) for p in positions],
                 "prompt_token_ids": [int(t) for t in prompt_token_ids],
                 "token_ids": [int(t) for t in token_ids], **self._line_fields(part)}
        self._pending.append((entry, checked))
        self._pending_keys.add(key)
        self._pending_part = part
        self._pending_rows += n_rows
        self._pending_bytes += sum(t.numel() * t.element_size() for t in checked.values())
        if (self._pending_rows >= self.rows_per_shard
                or self._pending_bytes >= self.max_shard_bytes):
            self.flush()
        return placed

    def _line_fields(self, part: Part) -> dict[str, Any]:
        """What an index line says beside the example: its writer, and a part's holdings."""
        fields: dict[str, Any] = {}
        if self.writer is not None:
            fields["writer"] = self.writer
        if part != (self.layers, tuple(range(len(self.saes)))):
            fields["layers"], fields["saes"] = list(part[0]), list(part[1])
        return fields

    def _placed(self, key: str, part: Part) -> tuple[int, int]:
        """The shard and offset of the line that already holds ``key``'s ``part``. (A
        resumed pipeline job sends many such parts: the index is read once into
        ``_placements``, and again only for a key it did not hold then.)"""
        slots = self._view.slots(self._line_fields(part))
        for fresh in (False, True):
            if fresh or self._placements is None:
                self._placements = {}
                for entry in read_index(self.root / INDEX)[0]:
                    self._placements.setdefault(entry["key"], []).append(
                        (self._view.slots(entry), entry["shard"], entry["offset"]))
            for held, shard, offset in self._placements.get(key, ()):
                if slots & held:
                    return shard, offset
        raise DatasetConflictError(f"example key {key!r}: its part left the index while it "
                                   "was written")

    @property
    def pending_keys(self) -> list[str]:
        """Keys queued for the next shard, in order."""
        return [entry["key"] for entry, _ in self._pending]

    @property
    def sealed_keys(self) -> list[str]:
        """Keys of the shards handed off and not yet written (or dropped)."""
        with self._state:
            return list(self._sealed)

    def seal(self) -> Shard | None:
        """Take the queued examples out as the next shard (``None`` if none are queued): its
        number is taken, its keys stay refused until it is written or dropped."""
        if not self._pending:
            return None
        assert self._pending_part is not None
        shard = Shard(self._next_shard, self._pending, self._pending_part,
                      self._pending_rows, self._pending_bytes)
        with self._state:
            self._sealed.update(dict.fromkeys(shard.keys))
        self._next_shard += 1
        self._pending, self._pending_keys = [], set()
        self._pending_rows = self._pending_bytes = 0
        return shard

    def flush(self) -> None:
        """Write the queued examples as one shard, then their index lines (with
        ``hand_off``: hand them over as a shard). On failure (a full disk ...) nothing of it
        is left behind, and the examples stay queued."""
        shard = self.seal()
        if shard is None:
            return
        if self._hand_off is not None:
            self._hand_off(self, shard)
            return
        try:
            self.write_shard(shard)
        except BaseException:
            # Queued again as they were (nothing was added meanwhile: one thread).
            self._pending, self._pending_keys = shard.examples, set(shard.keys)
            self._pending_part = shard.part
            self._pending_rows, self._pending_bytes = shard.rows, shard.nbytes
            self._next_shard = shard.number
            raise

    def write_shard(self, shard: Shard, rows_written: Callable[[], None] | None = None) -> None:
        """Write a sealed shard, then its examples' index lines (from any thread, the shards
        in the order they were sealed). On failure nothing of it is left behind, its
        examples are dropped (their keys may be added again), and the error is raised.

        ``rows_written``: called once the shard's rows are copied out for its file (the last
        of them may still be on their way to the disk; nothing is synced yet), after the
        shard has let go of them: a handed-off shard waits for the disk without its rows in
        memory (its examples are dropped if the rest fails, never written again from
        memory)."""
        path = self.root / shard_name(shard.number, self.writer)
        # Written in a staging directory named like our temp files, then renamed into place:
        # a killed writer's is told from another writer's, and removed when it resumes.
        staging = temp_name(path, self.writer)
        tmp = staging / path.name
        part_layers, part_saes = shard.part
        try:
            staging.mkdir(exist_ok=True)
            tensors = {}
            for point in self.points if part_layers else ():
                for i, layer in enumerate(part_layers):
                    tensors[tensor_name(point, layer)] = [
                        rows[point][i] for _, rows in shard.examples]
            for sae in part_saes:
                for field in sae_fields(self.saes[sae]):
                    name = sae_column(sae, field)
                    tensors[name] = [rows[name] for _, rows in shard.examples]

            def release() -> None:
                assert rows_written is not None
                tensors.clear()
                shard.examples = [(entry, {}) for entry, _ in shard.examples]
                rows_written()

            write_shard_file(tmp, tensors, copied=None if rows_written is None else release)
            publish(tmp, path, uncache=True)
            shutil.rmtree(staging, ignore_errors=True)  # (published: tidying cannot fail it)
            offset, lines = 0, []
            for entry, _ in shard.examples:
                lines.append(json.dumps({**entry, "shard": shard.number, "offset": offset}))
                offset += entry["rows"]
            with index_locked(self.root, self.writer is not None):
                append_lines(self.root / INDEX, "".join(line + "\n" for line in lines).encode())
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            path.unlink(missing_ok=True)
            self._unseal(shard)
            raise
        with self._state:
            for entry, _ in shard.examples:  # (as the index now reads; other writers' lines
                self._view.add(entry)        # are read by the next ``add``)
            self._mine.update(shard.keys)
            self._unseal(shard)

    def _unseal(self, shard: Shard) -> None:
        with self._state:
            for key in shard.keys:
                self._sealed.pop(key, None)
            self._state.notify_all()

    def wait_written(self) -> None:
        """Wait until every shard handed off was written or dropped."""
        with self._state:
            while self._sealed:
                self._state.wait()

    def close(self) -> None:
        """Write what is queued (with ``hand_off``: hand it over, and wait until every shard
        handed off is written or dropped) and let go of the directory."""
        try:
            self.flush()
            self.wait_written()
        finally:
            self._release()
            release_buffer()  # (the calling thread's, if it wrote shards)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            try:  # (shards handed off are written under this writer's locks, or dropped)
                self.wait_written()
            finally:
                self._release()


def jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON."""
    return json.loads(json.dumps(value))
