"""The ``safetensors`` capture sink: each dataset is a ``vllm_lens.shard_writer`` directory
under the sink's root (runs in: worker).

Examples are queued per dataset and written a shard at a time (``rows_per_shard`` rows or
``max_shard_bytes``, options of the sink's entry in ``VLLM_LENS_SINKS``), and at the latest
``flush_s`` seconds (default 10) after the oldest queued one arrived, when the front end
asks (``vllm_lens.flush_sinks``), and when the worker exits. At most ``max_open_datasets``
(default 16) datasets are open at once, which bounds the rows queued in memory. To open
another, the least recently written is flushed and closed; on a sink open to HTTP clients
(``"clients": true``) only a dataset with nothing queued and no write for ``idle_close_s``
(default 300) is, and a write to a new dataset when none is idle is refused (``CapacityError``
naming the option): a client rotating over many names then cannot make every request flush
and reopen datasets (re-reading their index) between engine steps, and an open dataset keeps
its written keys in memory for as long as it is in use. An example is in the dataset once its
key is in ``index.jsonl``; the receipt says whether that was so when the request finished
(``durable``; only then does it name the shard and offset). A process writing beside others
(data or pipeline parallelism: ``Example.writer``) opens its datasets as that named writer
(``vllm_lens.shard_writer``), and its receipts name it; a pipeline stage's receipt names the
part it wrote (``layers``, ``saes``). A shard that cannot be written
(a full disk) fails the request whose write triggered it, with the keys it took down with it
(a failure of the timer's write is reported by the next ``flush``); the examples queued with
it are dropped (they are not in the index: a resumed job writes them again), the shards
already written stay valid, and the next write to the dataset starts afresh. Writes run on
the worker between engine steps: a shard's write delays the engine's next step.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from vllm_lens.errors import CapacityError, DatasetConflictError
from vllm_lens.shard_writer import VERSION_FIELDS, ShardWriter, jsonable, sae_column
from vllm_lens.sinks import Example
from vllm_lens.sinks.config import SinkConfig

__all__ = ["ShardSink"]

logger = logging.getLogger(__name__)

_OPTIONS = ("rows_per_shard", "max_shard_bytes", "flush_s", "max_open_datasets", "idle_close_s")


class ShardSink:
    """A sink writing safetensors shard datasets under ``config.root``."""

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
        self._last_write: dict[str, float] = {}
        """Dataset -> when it was last written (its writer is open)."""
        self._writers: dict[str, ShardWriter] = {}
        """Open datasets, least recently written first (at most ``max_open_datasets``: the
        queued rows in memory are bounded by that many shards)."""
        self._failures: list[str] = []
        """Shard writes that failed outside a request (the timer): reported by ``flush``."""
        self._oldest: dict[str, float] = {}
        """Dataset -> when its oldest queued example arrived."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    def write(self, dataset: str, example: Example) -> dict[str, Any]:
        with self._lock:
            writer = self._writer(dataset, example.settings, example.writer)
            self._writers[dataset] = self._writers.pop(dataset)  # most recently written
            self._last_write[dataset] = time.monotonic()
            try:
                shard, offset = writer.add(example.key, example.rows, example.positions,
                                           example.prompt_token_ids, example.token_ids,
                                           reduced=example.reduced,
                                           sae_features=example.sae_features,
                                           layers=example.layers, saes=example.sae_entries)
            except ValueError:  # a bad example (duplicate key ...): nothing was queued
                raise
            except Exception as exc:  # the shard it filled could not be written
                raise RuntimeError(self._abandon(dataset, exc)) from None
            if writer.pending_keys:
                self._oldest.setdefault(dataset, time.monotonic())
            else:
                self._oldest.pop(dataset, None)
            self._start_timer()
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
            for field in sorted(set(writer.manifest) | set(settings)):
                if field in VERSION_FIELDS or field == "format":
                    continue
                if writer.manifest.get(field) != jsonable(settings.get(field)):
                    raise DatasetConflictError(
                        f"dataset {dataset!r} of sink {self.config.name!r} holds examples with "
                        f"{field}={writer.manifest.get(field)!r}, not "
                        f"{jsonable(settings.get(field))!r}; write these to another dataset")
            return writer
        while len(self._writers) >= self.max_open_datasets:
            oldest = self._closable(dataset)
            try:
                self._writers[oldest].flush()
            except Exception as exc:  # noqa: BLE001 - reported at the next flush
                self._failures.append(self._abandon(oldest, exc))
                continue
            self._writers.pop(oldest).close()
            self._oldest.pop(oldest, None)
            self._last_write.pop(oldest, None)
        path = self.root / dataset
        try:
            writer = ShardWriter(path, settings, rows_per_shard=self.rows_per_shard,
                                 max_shard_bytes=self.max_shard_bytes, resume=True,
                                 writer=name)
        except (ValueError, RuntimeError) as exc:  # another manifest, another writer, ...
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
            if (not writer.pending_keys
                    and now - self._last_write.get(dataset, 0.0) >= self.idle_close_s):
                return dataset
        raise CapacityError(
            f"sink {self.config.name!r} has {len(self._writers)} datasets open, its "
            f"max_open_datasets, each written in the last {self.idle_close_s:g} s or with "
            f"examples queued; dataset {newcomer!r} was not opened and this example not "
            "written. Write to a dataset that is open, retry later, or the operator may raise "
            "the sink's max_open_datasets or lower its idle_close_s",
            setting=f"VLLM_LENS_SINKS[{self.config.name!r}].max_open_datasets")

    def _abandon(self, dataset: str, exc: BaseException) -> str:
        """Drop ``dataset``'s writer after a failed shard write; returns the message."""
        writer = self._writers.pop(dataset)
        self._oldest.pop(dataset, None)
        self._last_write.pop(dataset, None)
        dropped = writer.abandon()
        message = (f"sink {self.config.name!r} could not write a shard of dataset {dataset!r} "
                   f"({type(exc).__name__}: {exc}); the {len(dropped)} example(s) queued for "
                   f"it were dropped (keys {dropped[:10]}{' ...' if len(dropped) > 10 else ''}"
                   "); the dataset holds what its index lists, and a resumed job writes them "
                   "again")
        logger.error("vllm-lens: %s", message)
        return message

    def flush(self) -> list[str]:
        with self._lock:
            problems, self._failures = self._failures, []
            for dataset in list(self._writers):
                try:
                    self._writers[dataset].flush()
                    self._oldest.pop(dataset, None)
                except Exception as exc:  # noqa: BLE001 - reported, the others still flush
                    problems.append(self._abandon(dataset, exc))
        return problems

    def close(self) -> None:
        self._stop.set()
        self.flush()
        with self._lock:
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()

    def _start_timer(self) -> None:
        if self._timer is None and self.flush_s > 0:
            self._timer = threading.Thread(target=self._flush_when_due, daemon=True,
                                           name=f"vllm-lens-sink-{self.config.name}")
            self._timer.start()

    def _flush_when_due(self) -> None:
        while not self._stop.wait(min(1.0, self.flush_s)):
            now = time.monotonic()
            with self._lock:
                due = [d for d, t in self._oldest.items() if now - t >= self.flush_s]
                for dataset in due:
                    try:
                        self._writers[dataset].flush()
                        self._oldest.pop(dataset, None)
                    except Exception as exc:  # noqa: BLE001 - reported at the next flush
                        self._failures.append(self._abandon(dataset, exc))


def _option(config: SinkConfig, name: str, kind: type, default: Any, least: float) -> Any:
    value = config.options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
        raise ValueError(f"sink {config.name!r}: option {name!r} must be a number >= {least}, "
                         f"got {value!r}")
    return kind(value)
