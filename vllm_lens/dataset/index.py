"""The index of an activation dataset: reading its lines, appending to it while other writers do,
and assembling examples from the parts several writers wrote (runs in: caller, worker).

Any process that reads or writes a dataset: a capture sink's worker, ``vllm-lens extract``, the
reader.

``index.jsonl`` has one line per part of an example: ``key``, ``rows``, ``positions``,
``prompt_token_ids``, ``token_ids``, ``shard``, ``offset``, and

- ``writer`` (absent for the single unnamed writer): the named writer whose shard
  (``shard-<writer>-NNNNN.safetensors``) holds the rows;
- ``layers`` and ``saes`` (absent when the line holds the whole example): the manifest layers
  and the numbers of the manifest's ``sae_features`` entries the line's rows cover. A pipeline
  stage holds only its own layers' rows (and the SAEs at them), so each stage writes its part
  of an example as a line of its own.

An example is complete once its lines together hold every manifest layer and SAE entry;
readers show only complete examples, in the order they became complete, and take each layer
from the first line holding it (a later line holding it again, e.g. two data-parallel
engines given the same key at once, is ignored). The parts joined are those of the first
part's run: a part of another run of the key (other tokens or positions: a pipeline job
killed between its stages' flushes, then run again) is ignored, and the example stays
incomplete until a part of that first run arrives.

Several named writers append to one index: each append is one ``os.write`` of complete
lines under an exclusive ``flock`` of ``.index.lock``, and a writer holding that lock cuts
back a last line without its newline (a writer killed while appending: its examples were
never acknowledged).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_lens.dataset.format import GENERATION_FIELDS, INDEX, INDEX_LOCK, MANIFEST

__all__ = ["IndexView", "append_lines", "check_writer", "complete_keys", "index_locked",
           "parse_line", "read_index", "rewrite_index", "same_generation"]

_WRITER = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_writer(name: str | None) -> str | None:
    """``name`` if it may name a writer (1 to 64 letters, digits, ``_``, ``.``, ``-``)."""
    if name is not None and (not isinstance(name, str) or not _WRITER.match(name)):
        raise ValueError(f"writer name {name!r} must be 1 to 64 letters, digits, '_', '.' "
                         "or '-'")
    return name


def parse_line(line: bytes, path: Path, where: str) -> dict[str, Any]:
    """One complete index line; ``ValueError`` names it (``where``) if it is not an entry."""
    try:
        entry = json.loads(line)
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise ValueError("not an example entry")
    except ValueError as exc:
        raise ValueError(f"{path}: {where} is not an index entry ({exc}); the "
                         "dataset is damaged") from None
    return entry


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
        entries.append(parse_line(line, path, f"line {number}"))
        starts.append(good)
        good += len(line)
    return entries, starts, good


@contextlib.contextmanager
def index_locked(root: Path, shared: bool) -> Iterator[None]:
    """Hold the exclusive index lock of ``root`` when several writers share it (``shared``);
    the single unnamed writer already holds the whole directory."""
    if not shared:
        yield
        return
    with open(root / INDEX_LOCK, "a") as lock:  # closing drops the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _trim_partial(fd: int, size: int) -> int:
    """Cut a last line without its newline off the file ``fd`` of ``size`` bytes; returns
    the new size."""
    end = size
    while end > 0:
        chunk = os.pread(fd, min(end, 1 << 16), end - min(end, 1 << 16))
        if end == size and chunk.endswith(b"\n"):
            return size
        found = chunk.rfind(b"\n")
        if found >= 0:
            end = end - len(chunk) + found + 1
            break
        end -= len(chunk)
    os.ftruncate(fd, end)
    return end


def append_lines(path: Path, data: bytes) -> None:
    """Append ``data`` (complete lines) to the index at ``path`` in one write, durably, after
    cutting back a partial last line; on failure the file is cut back to what it was. The
    caller holds the index (``index_locked``)."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = _trim_partial(fd, os.fstat(fd).st_size)
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"{path}: only {written} of {len(data)} bytes were appended")
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, before)
            raise
    finally:
        os.close(fd)


def rewrite_index(path: Path, keep: Iterable[Mapping[str, Any]], temp: Path) -> None:
    """Replace the index at ``path`` by the lines of ``keep`` (its entries, in order),
    atomically (the caller holds the index): every append reopens the file, so none goes to
    the old one."""
    temp.write_bytes(b"".join(json.dumps(dict(e)).encode() + b"\n" for e in keep))
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def same_generation(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two parts of an example come from the same run of it (a pipeline job killed
    between its stages' flushes may run the key again, and a sampled run may differ)."""
    return all(a.get(field) == b.get(field) for field in GENERATION_FIELDS)


class IndexView:
    """The examples index lines make up, fed line by line in index order.

    Args:
        layers: the manifest's layers.
        n_saes: the number of the manifest's ``sae_features`` entries.
        keep_lines: keep each example's lines (a reader); otherwise only which layers and
            SAE entries each key has in the index (a writer, for every key of the dataset),
            and the first line of an unfinished one (which run its parts must come from).
    """

    def __init__(self, layers: Sequence[int], n_saes: int, keep_lines: bool = False) -> None:
        self.whole = frozenset([*(("layer", int(x)) for x in layers),
                                *(("sae", i) for i in range(n_saes))])
        self.keep_lines = keep_lines
        self.complete: dict[str, tuple[dict[str, Any], ...]] = {}
        """Key -> its lines (with ``keep_lines``; else ``()``), in the order the examples
        became complete."""
        self._partial: dict[str, tuple[frozenset, tuple[dict[str, Any], ...]]] = {}
        self._interned: dict[frozenset, frozenset] = {self.whole: self.whole}

    def slots(self, entry: Mapping[str, Any]) -> frozenset:
        """The layers and SAE entries a line holds."""
        if "layers" not in entry and "saes" not in entry:
            return self.whole
        return frozenset([*(("layer", int(x)) for x in entry.get("layers", ())),
                          *(("sae", int(i)) for i in entry.get("saes", ()))])

    def held(self, key: str) -> frozenset:
        """What the index holds of ``key``'s example."""
        if key in self.complete:
            return self.whole
        return self._partial.get(key, (frozenset(), ()))[0]

    def add(self, entry: Mapping[str, Any]) -> None:
        key = entry["key"]
        if key in self.complete:
            return  # the first complete example stands
        held, lines = self._partial.get(key, (frozenset(), ()))
        slots = self.slots(entry)
        if slots <= held:
            return
        if lines and not same_generation(entry, lines[0]):
            return  # a part of another run of the same key: the first part's run stands
        if self.keep_lines or not lines:  # (a writer keeps an unfinished example's first)
            lines = (*lines, dict(entry))
        held = held | slots
        held = self._interned.setdefault(held, held)
        if held >= self.whole:
            self._partial.pop(key, None)
            self.complete[key] = lines if self.keep_lines else ()
        else:
            self._partial[key] = (held, lines)


def complete_keys(root: Path) -> list[str]:
    """The keys of the complete examples of the dataset at ``root``, in index order (none if
    it has no manifest yet)."""
    if not (root / MANIFEST).exists():
        return []
    manifest = json.loads((root / MANIFEST).read_text())
    view = IndexView(manifest["layers"], len(manifest.get("sae_features") or ()))
    for entry in read_index(root / INDEX)[0]:
        view.add(entry)
    return list(view.complete)
