"""Durable publication of a dataset's files: written beside their final name, synced, renamed
into place and the directory synced (runs in: caller, worker).

So a file appears under its final name only once complete, and a writer killed at any moment
leaves temp files that ``recovery`` recognises by name (its own, or every writer's).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "publish", "temp_name"]


def fsync_dir(path: Path) -> None:
    """Sync the directory ``path`` (a rename inside it is then durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path, writer: str | None = None) -> Path:
    """Where ``path`` is written before it is renamed into place (``+`` never occurs in a
    writer's name, so one writer's temp files are told from another's)."""
    if writer is None:
        return path.with_name(f".{path.name}.tmp-{os.getpid()}")
    return path.with_name(f".{path.name}.tmp+{writer}+{os.getpid()}")


def publish(tmp: Path, path: Path, *, uncache: bool = False) -> None:
    """Make the complete file ``tmp`` appear as ``path``, durably. ``uncache``: then let the
    kernel drop its pages from the page cache (a shard is written once and read later;
    gigabytes of written shards left cached would push everything else out of memory, and the
    reclaim that follows costs CPU time on the cores the engine computes on)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
        if uncache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    os.replace(tmp, path)
    fsync_dir(path.parent)
