"""The ``safetensors`` capture sink: each dataset is a ``vllm_lens.dataset.writer`` directory under
the sink's root (runs in: worker).

Its shards are written on a thread of its own.

Examples are queued per dataset and cut into shards (``rows_per_shard`` rows or
``max_shard_bytes``, options of the sink's entry in ``VLLM_LENS_SINKS``), at the latest
``flush_s`` seconds (default 10) after the oldest queued one arrived, when the front end asks
(``vllm_lens.flush_sinks``), and when the worker exits. A shard cut is handed to the sink's
writer thread, which writes the shards one after the other (temp file, fsync, rename, then the
index lines; ``vllm_lens.dataset.shard_file`` copies a shard into a buffer the thread keeps while it has
shards to write, as large as its largest shard up to 256 MiB, and writes it past the page cache
where it can), and ``write`` returns at once: the engine's step does not wait for the disk. At
most ``max_queued_shards`` (default 2) shards hold their rows in memory, waiting or being
written (a shard lets go of its rows once they are copied into that buffer, while the disk takes
them; one larger than 256 MiB once all but its last 256 MiB are on disk); a ``write`` whose
example cuts one more waits for room (back-pressure: the engine goes at the disk's pace instead
of piling rows up in memory); with ``max_queued_shards`` 0 a ``write`` waits until the shard its
example completed is written (the engine's step waits for the disk, and that request's receipt
says ``durable``). At most ``max_open_datasets`` (default 16) datasets are open at once, so the
rows in memory are bounded by ``max_queued_shards`` (at least one) + ``max_open_datasets``
shards, and the writer thread's buffer. To open another dataset, the least recently written is
flushed and closed (once its shards are written); on a sink open to HTTP clients (``"clients":
true``) only a dataset with nothing queued or being written and no write for ``idle_close_s``
(default 300) is, and a write to a new dataset when none is idle is refused (``CapacityError``
naming the option): a client rotating over many names then cannot make every request flush and
reopen datasets (re-reading their index) between engine steps, and an open dataset keeps its
written keys in memory for as long as it is in use.

An example is in the dataset once its key is in ``index.jsonl``; the receipt says whether that
was so when the request finished (``durable``, false for an example queued or in a shard not
yet written; only then does it name the shard and offset), so a process killed with shards
queued loses only examples whose receipts said ``durable: false``. A process writing beside
others (data or pipeline parallelism: ``Example.writer``) opens its datasets as that named
writer (``vllm_lens.dataset.writer``), and its receipts name it; a pipeline stage's receipt
names the part it wrote (``layers``, ``saes``). A shard that cannot be written (a full disk)
is dropped with its examples alone (not in the index: a resumed job writes them again; the
shards before and after it stay valid) and its error, naming the dropped keys, is reported
twice: by the next ``flush`` (every failure since the last one), and to one request: the one
whose example completed the shard if it failed before that request's write returned (always so
with ``max_queued_shards`` 0), otherwise the next request that writes to its dataset, which
fails with it without its own example being written.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_lens.errors import CapacityError, DatasetConflictError
from vllm_lens.dataset.shard_file import release_buffer
from vllm_lens.dataset.format import VERSION_FIELDS, sae_column
from vllm_lens.dataset.writer import Shard, ShardWriter, jsonable
from vllm_lens.sinks.config import SinkConfig
from vllm_lens.sinks.interface import Example

__all__ = ["ShardSink"]

logger = logging.getLogger(__name__)

#: Failed shard writes kept for the next ``flush`` (and per dataset for its next request);
#: more are logged only.
_MAX_FAILURES = 100
#: Seconds the writer thread waits for a shard before it lets go of its buffer.
_IDLE_RELEASE_S = 30.0
_OPTIONS = ("rows_per_shard", "max_shard_bytes", "flush_s", "max_open_datasets", "idle_close_s",
            "max_queued_shards")


class ShardSink:
    """A sink writing safetensors shard datasets under ``config.root``.

    Lock discipline: ``_lock`` (taken by ``write``, ``flush``, ``close`` and the flush timer)
    guards the open datasets and what they queue; ``_queue_changed`` guards the shards handed
    to the writer thread and the failures it found. The writer thread takes only the latter
    (and each ``ShardWriter``'s own), so a ``write`` holding ``_lock`` may wait for room in
    the queue.
    """

    def __init__(self, config: SinkConfig) -> None:
        unknown = sorted(set(config.options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"sink {config.name!r}: unknown option {unknown[0]!r}; the "
                             f"safetensors sink takes {', '.join(_OPTIONS)}")
        self.config = config
        self.root = Path(config.root)
        self.rows_per_shard = _option(config, "rows_per_shard", int, 65536, 1)
        self.max_shard_bytes = _option(config, "max_shard_bytes", int, 1 << 30, 1)
        self.flush_s = _option(config, "flush_s", float, 10.0, 0)
        self.max_open_datasets = _option(config, "max_open_datasets", int, 16, 1)
        self.idle_close_s = _option(config, "idle_close_s", float, 300.0, 0)
        self.max_queued_shards = _option(config, "max_queued_shards", int, 2, 0)
        self._queue_bound = max(1, self.max_queued_shards)
        self._last_write: dict[str, float] = {}
        """Dataset -> when it was last written (its writer is open)."""
        self._accepted: weakref.WeakKeyDictionary[ShardWriter, Any] = \
            weakref.WeakKeyDictionary()
        """Open dataset's writer -> the last example settings found to agree with its
        manifest."""
        self._writers: dict[str, ShardWriter] = {}
        """Open datasets, least recently written first (at most ``max_open_datasets``)."""
        self._oldest: dict[str, float] = {}
        """Dataset -> when its oldest queued example arrived."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._queue: collections.deque[tuple[ShardWriter, Shard]] = collections.deque()
        """Shards handed to the writer thread, oldest first; the first is being written. At
        most ``max_queued_shards`` of them hold rows (or the one a ``write`` waits for, if
        that is 0), and the first may be being synced without its rows besides."""
        self._failures: list[str] = []
        """Shard writes that failed since the last ``flush``, which reports them."""
        self._unheard: dict[str, list[tuple[str, list[str]]]] = {}
        """Dataset -> its failed shard writes (message, dropped keys) that no request writing
        to it was told of."""
        self._queue_changed = threading.Condition()
        self._released = 0
        """1 while the first queued shard, being written, holds its rows no longer."""
        self._writer_thread: threading.Thread | None = None

    def write(self, dataset: str, example: Example) -> dict[str, Any]:
        with self._lock:
            unheard = self._told(dataset, lambda keys: True)
            if unheard:
                raise RuntimeError(f"{unheard}; this request's example was not written (send "
                                   "it again)")
            writer = self._writer(dataset, example.settings, example.writer)
            self._writers[dataset] = self._writers.pop(dataset)  # most recently written
            self._last_write[dataset] = time.monotonic()
            # A shard this example fills is handed to the writer thread (waiting for room).
            shard, offset = writer.add(example.key, example.rows, example.positions,
                                       example.prompt_token_ids, example.token_ids,
                                       reduced=example.reduced, sae_features=example.sae_features,
                                       layers=example.layers, saes=example.sae_entries)
            if writer.pending_keys:
                self._oldest.setdefault(dataset, time.monotonic())
            else:
                self._oldest.pop(dataset, None)
            self._start_timer()
            # The shard this example completed failed before the write returned (always
            # seen here with max_queued_shards 0, whose writes wait for their shard).
            dropped = self._told(dataset, lambda keys: example.key in keys)
            if dropped:
                raise RuntimeError(dropped)
            durable = writer.durable(example.key)
        numbers = range(len(example.sae_features)) if example.sae_entries is None \
            else example.sae_entries
        shapes = {point: list(t.shape) for point, t in example.rows.items()}
        shapes.update({f"{sae_column(i, name)}": list(t.shape)
                       for i, entry in zip(numbers, example.sae_features)
                       for name, t in entry.items()})
        # Where a queued example will land is known only once its shard is written.
        receipt = {
            "sink": self.config.name, "dataset": dataset, "key": example.key,
            "shard": shard if durable else None, "offset": offset if durable else None,
            "rows": len(example.positions) if not example.reduced else 1,
            "shapes": shapes, "durable": durable,
        }
        if example.writer is not None:
            receipt["writer"] = example.writer
        if example.layers is not None or example.sae_entries is not None:
            receipt["layers"] = list(example.settings["layers"] if example.layers is None
                                     else example.layers)
            receipt["saes"] = list(numbers)
        return receipt

    def _writer(self, dataset: str, settings: Any, name: str | None) -> ShardWriter:
        writer = self._writers.get(dataset)
        if writer is not None and writer.writer != name:
            raise ValueError(f"dataset {dataset!r} of sink {self.config.name!r} is open here "
                             f"as writer {writer.writer!r}, not {name!r} (for the sink's "
                             "operator to resolve, not the request)")
        if writer is not None:
            if self._accepted.get(writer) == settings:
                return writer  # (compared with the manifest once, not once per example)
            for field in sorted(set(writer.manifest) | set(settings)):
                if field in VERSION_FIELDS or field == "format":
                    continue
                if writer.manifest.get(field) != jsonable(settings.get(field)):
                    raise DatasetConflictError(
                        f"dataset {dataset!r} of sink {self.config.name!r} holds examples with "
                        f"{field}={writer.manifest.get(field)!r}, not "
                        f"{jsonable(settings.get(field))!r}; write these to another dataset")
            self._accepted[writer] = copy.deepcopy(settings)
            return writer
        while len(self._writers) >= self.max_open_datasets:
            oldest = self._closable(dataset)
            self._writers.pop(oldest).close()  # (waits until its shards are written)
            self._oldest.pop(oldest, None)
            self._last_write.pop(oldest, None)
        path = self.root / dataset
        try:
            writer = ShardWriter(path, settings, rows_per_shard=self.rows_per_shard,
                                 max_shard_bytes=self.max_shard_bytes, resume=True,
                                 writer=name, hand_off=self._hand_off)
        except (ValueError, RuntimeError, OSError) as exc:  # another manifest, writer, ...
            problem = str(exc).replace(f"{path}: ", "").replace(str(path), dataset)
            # Examples with other settings are the caller's to resolve; another writer of the
            # directory, or a damaged manifest or index, the operator's.
            if isinstance(exc, DatasetConflictError):
                raise DatasetConflictError(
                    f"dataset {dataset!r} of sink {self.config.name!r}: {problem}; write these "
                    "to another dataset") from None
            raise ValueError(f"dataset {dataset!r} of sink {self.config.name!r}: {problem} "
                             "(for the sink's operator to resolve, not the request)") from None
        self._writers[dataset] = writer
        return writer

    def _closable(self, newcomer: str) -> str:
        """The open dataset to close so that ``newcomer`` can open: the least recently
        written; on a sink open to clients, the least recently written idle one, or a
        ``CapacityError`` for the newcomer when every open dataset is in use."""
        if not self.config.clients:
            return next(iter(self._writers))
        now = time.monotonic()
        for dataset, writer in self._writers.items():  # least recently written first
            if (not writer.pending_keys and not writer.sealed_keys
                    and now - self._last_write.get(dataset, 0.0) >= self.idle_close_s):
                return dataset
        raise CapacityError(
            f"sink {self.config.name!r} has {len(self._writers)} datasets open, its "
            f"max_open_datasets, each written in the last {self.idle_close_s:g} s or with "
            f"examples queued; dataset {newcomer!r} was not opened and this example not "
            "written. Write to a dataset that is open, retry later, or the operator may raise "
            "the sink's max_open_datasets or lower its idle_close_s",
            setting=f"VLLM_LENS_SINKS[{self.config.name!r}].max_open_datasets")

    def _told(self, dataset: str, concerns: Callable[[list[str]], bool]) -> str:
        """The failures of ``dataset`` not yet told to a request whose dropped keys
        ``concerns`` it, joined (``""``: none); each is told once."""
        with self._queue_changed:
            unheard = self._unheard.pop(dataset, [])
            told = [message for message, keys in unheard if concerns(keys)]
            left = [(message, keys) for message, keys in unheard if not concerns(keys)]
            if left:
                self._unheard[dataset] = left
        return "; ".join(told)

    def _hand_off(self, writer: ShardWriter, shard: Shard) -> None:
        """Queue a sealed shard for the writer thread, first waiting while
        ``max_queued_shards`` queued shards hold rows (the caller holds ``_lock``); with 0,
        until the writer thread has written or dropped it."""
        with self._queue_changed:
            while self._holding_rows() >= self._queue_bound:
                self._queue_changed.wait()
            self._queue.append((writer, shard))
            self._queue_changed.notify_all()
            if self._writer_thread is None:
                self._writer_thread = threading.Thread(
                    target=self._write_queued, daemon=True,
                    name=f"vllm-lens-sink-writer-{self.config.name}")
                self._writer_thread.start()
            while self.max_queued_shards == 0 and any(s is shard for _, s in self._queue):
                self._queue_changed.wait()

    def _write_queued(self) -> None:
        """The writer thread: writes the queued shards in order until ``close`` stops it
        with none left."""
        while True:
            with self._queue_changed:
                while not self._queue and self._writer_thread is threading.current_thread():
                    if not self._queue_changed.wait(_IDLE_RELEASE_S):
                        release_buffer()  # idle: its shard buffer goes back to the system
                if self._writer_thread is not threading.current_thread():
                    return  # (``close`` drained the queue first)
                writer, shard = self._queue[0]
            try:
                writer.write_shard(shard, rows_written=self._rows_written)
            except BaseException as exc:  # noqa: BLE001 - reported; the next shards go on
                self._lost(writer, shard, exc)
            finally:
                with self._queue_changed:
                    self._queue.popleft()
                    self._released = 0
                    self._queue_changed.notify_all()

    def _holding_rows(self) -> int:
        """Queued shards whose rows are in memory (the one being synced has none)."""
        return len(self._queue) - self._released

    def _rows_written(self) -> None:
        """The shard being written let go of its rows (they are copied out for its file):
        room for the next one while the disk takes this one."""
        with self._queue_changed:
            self._released = 1
            self._queue_changed.notify_all()

    def _lost(self, writer: ShardWriter, shard: Shard, exc: BaseException) -> None:
        """Record a shard that could not be written, for the next ``flush`` and the next
        request writing to its dataset."""
        dataset, keys = writer.root.name, shard.keys
        message = (f"sink {self.config.name!r} could not write a shard of dataset {dataset!r} "
                   f"({type(exc).__name__}: {exc}); the {len(keys)} example(s) queued for it "
                   f"were dropped (keys {keys[:10]}{' ...' if len(keys) > 10 else ''}); the "
                   "dataset holds what its index lists, and a resumed job writes them again")
        logger.error("vllm-lens: %s", message)
        with self._queue_changed:
            if len(self._failures) < _MAX_FAILURES:  # (until a flush reports them)
                self._failures.append(message)
            elif len(self._failures) == _MAX_FAILURES:
                self._failures.append("... and more shard writes failed since (see the "
                                      "worker's log)")
            unheard = self._unheard.setdefault(dataset, [])
            if len(unheard) < _MAX_FAILURES:
                unheard.append((message, keys))

    def _drain(self) -> None:
        """Wait until the writer thread has written (or dropped) every queued shard."""
        with self._queue_changed:
            while self._queue:
                self._queue_changed.wait()

    def flush(self) -> list[str]:
        with self._lock:
            for dataset, writer in self._writers.items():
                writer.flush()  # (to the writer thread)
                self._oldest.pop(dataset, None)
            self._drain()
            with self._queue_changed:
                problems, self._failures = self._failures, []
        return problems

    def close(self) -> None:
        self._stop.set()
        self.flush()  # (what failed was logged)
        with self._lock:
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()
            with self._queue_changed:
                thread, self._writer_thread = self._writer_thread, None
                self._queue_changed.notify_all()
        if thread is not None:
            thread.join()

    def _start_timer(self) -> None:
        if self._timer is None and self.flush_s > 0:
            self._timer = threading.Thread(target=self._flush_when_due, daemon=True,
                                           name=f"vllm-lens-sink-{self.config.name}")
            self._timer.start()

    def _flush_when_due(self) -> None:
        while not self._stop.wait(min(1.0, self.flush_s)):
            now = time.monotonic()
            with self._lock:
                for dataset, since in list(self._oldest.items()):
                    if now - since < self.flush_s:
                        continue
                    with self._queue_changed:
                        if self._holding_rows() >= self._queue_bound:
                            break  # no room: next time (the timer waits for no room)
                    self._writers[dataset].flush()  # (to the writer thread)
                    self._oldest.pop(dataset, None)


def _option(config: SinkConfig, name: str, kind: type, default: Any, least: float) -> Any:
    value = config.options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
        raise ValueError(f"sink {config.name!r}: option {name!r} must be a number >= {least}, "
                         f"got {value!r}")
    return kind(value)
