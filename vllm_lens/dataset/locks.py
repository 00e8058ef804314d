"""Who may write a dataset directory: one unnamed writer alone, or named writers side by side
(runs in: caller, worker).

A writer without a name takes ``.lock`` exclusive; a named writer takes ``.lock`` shared and
``.lock-<writer>`` exclusive, so two writers of one name, or a named writer beside an unnamed
one, are refused with a message saying which. The locks are ``flock`` locks on open files:
closing them (or the process ending) lets go.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from vllm_lens.dataset.format import WRITER_LOCK, writer_lock

__all__ = ["release_locks", "take_locks"]


def take_locks(root: Path, writer: str | None) -> list[IO[str]]:
    """The locks ``writer`` (``None``: the unnamed writer) holds ``root`` by; ``RuntimeError``
    naming the clash when another writer holds them."""
    import fcntl

    taken: list[IO[str]] = []
    wanted = [(WRITER_LOCK, fcntl.LOCK_EX if writer is None else fcntl.LOCK_SH)]
    if writer is not None:
        wanted.append((writer_lock(writer), fcntl.LOCK_EX))
    for name, mode in wanted:
        lock = open(root / name, "w")  # noqa: SIM115 - held until close
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            for held in taken:
                held.close()
            raise RuntimeError(_lock_problem(root, writer, name)) from None
        taken.append(lock)
    return taken


def _lock_problem(root: Path, writer: str | None, name: str) -> str:
    if writer is None:
        return (f"{root}: another writer has this dataset open (a writer without a "
                "name holds a dataset alone)")
    if name == WRITER_LOCK:
        return (f"{root}: a writer without a name has this dataset open; writer "
                f"{writer!r} shares a dataset only with other named writers")
    return (f"{root}: another process is writing this dataset as writer "
            f"{writer!r}; give each writer its own name")


def release_locks(locks: list[IO[str]]) -> None:
    """Let go of ``locks`` (closing drops a lock), the last taken first."""
    for lock in reversed(locks):
        lock.close()
