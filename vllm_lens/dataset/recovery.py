"""Reopening a dataset a writer may have been killed writing: temp files removed, the manifest
written or compared, a torn index mended (runs in: caller, worker).

Called under the index lock (``index.index_locked``) when a ``ShardWriter`` opens its
directory. A writer removes only its own leftovers, or every writer's when it holds the
directory alone (the unnamed writer): a last line cut short, the lines of a last shard whose
lines did not all arrive, and shards no line names past a writer's last indexed one.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_lens.dataset.format import INDEX, MANIFEST, SHARD_FILE, VERSION_FIELDS, shard_name
from vllm_lens.dataset.index import read_index, rewrite_index
from vllm_lens.dataset.publish import publish, temp_name
from vllm_lens.errors import DatasetConflictError

__all__ = ["check_manifest", "recover", "remove_temp_files"]


def remove_temp_files(root: Path, writer: str | None) -> None:
    """Temp files left by a killed writer: ours, or anyone's when we hold the directory."""
    found = ({*root.glob(".*.tmp-*"), *root.glob(".*.tmp+*")}
             if writer is None else set(root.glob(f".*.tmp+{writer}+*")))
    for tmp in found:  # (a shard's staging directory, or a file)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def check_manifest(root: Path, manifest: Mapping[str, Any], writer: str | None) -> None:
    """Write the manifest if it is missing (under the index lock: only one writer
    does), else refuse one that differs from ``manifest`` but for the versions."""
    manifest_path = root / MANIFEST
    if not manifest_path.exists():
        tmp = temp_name(manifest_path, writer)
        tmp.write_text(json.dumps(manifest, indent=1))
        publish(tmp, manifest_path)
        return
    existing = json.loads(manifest_path.read_text())
    for field in sorted(set(existing) | set(manifest)):
        if field not in VERSION_FIELDS and existing.get(field) != manifest.get(field):
            raise DatasetConflictError(
                f"{root}: the dataset's manifest has {field}="
                f"{existing.get(field)!r}, not {manifest.get(field)!r}")


def recover(root: Path, writer: str | None) -> tuple[list[dict[str, Any]], int]:
    """After a killed writer: cut a partial last line, drop the lines of a last shard
    whose lines did not all arrive, and remove the shards no line names past a
    writer's last indexed one — ``writer``'s only, or every writer's when it holds the
    directory alone. Returns the index's entries as they then are, and the number of
    ``writer``'s next shard."""
    index_path = root / INDEX
    entries, _, good = read_index(index_path)
    if index_path.exists() and good < index_path.stat().st_size:
        with open(index_path, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    on_disk: dict[str | None, list[int]] = {}
    for path in root.iterdir():
        m = SHARD_FILE.match(path.name)
        if m:
            on_disk.setdefault(m.group(1), []).append(int(m.group(2)))
    writers = {writer} if writer is not None else {
        None, *on_disk, *(e.get("writer") for e in entries)}
    torn = set()
    for name in writers:
        own = [e for e in entries if e.get("writer") == name]
        if own:
            last = own[-1]["shard"]
            covered = sum(e["rows"] for e in own if e["shard"] == last)
            if covered != shard_rows(root, last, name):
                torn.add((name, last))
    if torn:
        entries = [e for e in entries if (e.get("writer"), e["shard"]) not in torn]
        rewrite_index(index_path, entries, temp_name(index_path, writer))
    next_shard = 0
    for name in writers:
        following = 1 + max((e["shard"] for e in entries if e.get("writer") == name),
                            default=-1)
        for number in on_disk.get(name, ()):
            if number >= following:  # a killed job's shard that never reached the index
                (root / shard_name(number, name)).unlink()
        if name == writer:
            next_shard = following
    return entries, next_shard


def shard_rows(root: Path, number: int, writer: str | None) -> int:
    """Rows in shard ``number`` of ``writer`` (-1 if it is missing or its header is cut
    short or damaged). Any other error reading it (permissions, I/O) is raised: a shard
    that cannot be read now is not a torn one, and its lines must not be dropped."""
    path = root / shard_name(number, writer)
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        return int(next(v for k, v in header.items() if k != "__metadata__")["shape"][0])
    except FileNotFoundError:
        return -1
    except OSError as exc:
        raise OSError(exc.errno, f"{path}: cannot read the shard's header to check it "
                      f"before resuming ({exc.strerror}); the resume stopped, leaving "
                      "the shard and its index lines as they were") from exc
    except (ValueError, KeyError, TypeError, IndexError, StopIteration, struct.error):
        return -1
