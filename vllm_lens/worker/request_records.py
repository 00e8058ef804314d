"""One record per lens request on the worker, with an explicit lifecycle (runs in: worker).

A record is created when the request is first scheduled with a lens payload, holds what the
worker keeps for it (the decoded spec, steering vectors on the device, hook state, the first
error), and ends in one of two places:

- **finished** — vLLM's runner dropped the request (the scheduler reported it finished or
  aborted): its device vectors are freed at once; the record (hook results, error) waits for
  the front end's fetch or release;
- **removed** — fetched or released by the front end, or unclaimed for
  ``VLLM_LENS_FINISHED_TTL_S`` after finishing (a front end that went away).

A preempted request stays in the runner's table and keeps its record; its recomputed
positions are captured again and ``capture.assemble`` keeps one row per position.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from vllm_lens.spec import LensRequest
from vllm_lens.worker.hooks import HookState
from vllm_lens.worker.monitors import MonitorState

logger = logging.getLogger(__name__)

__all__ = ["RequestRecord", "RequestTable", "describe"]


def describe(exc: BaseException | str) -> str:
    """``"Type: message"`` for an exception, even one whose ``__str__`` raises."""
    if isinstance(exc, str):
        return exc
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:
        return f"{type(exc).__name__} (its message could not be formatted)"


@dataclass
class RequestRecord:
    req_id: str
    lens: LensRequest
    steer: list[Any] | None = None
    """``steer.PreparedSteer`` per vector, on the model's device; freed when it finishes."""
    hooks: HookState | None = None
    gates: dict[int, list[tuple[Any, Any]]] = field(default_factory=dict)
    """Gated steering vector index -> (positions on the host, gate values on the device) per
    step, reported at fetch (``steering_gates``)."""
    monitors: MonitorState | None = None
    """Its monitors' probes, scores and stop flag (``worker.monitors``), built when it first
    runs; the probes are freed when it finishes, the scores wait for the fetch."""
    attention: Any = None
    """Its attention steering (``worker.attention_steering.RequestAttentionSteer``) with the
    keys and values it keeps, built when it first runs; freed when it finishes."""
    replacements: list[Any] | None = None
    """``replacement.PreparedReplacement`` per layer of this stage whose MLP a transcoder
    replaces for it, built when it first runs."""
    replacement_lost: bool = False
    """Some step ran without its replacement (it could not be prepared, planned or
    computed): its prefix-cache salt no longer holds, so it is ended."""
    error: str | None = None
    """The first failure of the lens path for this request (its message)."""
    refused: str | None = None
    """Why its captures were refused when it first ran (a full capture budget): it runs with
    its steering and hooks only (its cached KV stays what its salt says), and fails with
    this message at fetch."""
    capacity: str | None = None
    """With ``refused``: the setting that sizes the full budget."""

    @functools.cached_property
    def running_lens(self) -> LensRequest:
        """What runs for it: the request, without its captures if they were refused (which
        happens before its first step, so this never changes once read)."""
        if self.refused is None:
            return self.lens
        return dataclasses.replace(self.lens, capture=None, points=(), saes=())
    finished_at: float | None = None

    @property
    def device_bytes(self) -> int:
        # (a vector of ``layer_indices="all"`` is one row's storage, viewed at every layer)
        return sum(p.clamp.nbytes if p.clamp is not None
                   else p.vectors.untyped_storage().nbytes() for p in self.steer or ()) + (
            0 if self.attention is None else self.attention.nbytes)

    def lose_replacements(self) -> None:
        """A step ran without its replacements: they stop (``replacement_lost``)."""
        self.replacement_lost = True
        for replacement in self.replacements or ():
            replacement.failed = True

    def fail(self, exc: BaseException | str, stage: str) -> None:
        if self.error is None:
            self.error = f"vllm-lens failed at {stage}: {describe(exc)}"


@dataclass
class RequestTable:
    """The records of this worker, keyed by vLLM request id.

    A request with captures reserves its ``LensRequest.reserve_bytes`` (the most its rows can
    take at once) from ``max_bytes`` when its record is created, until the record is removed
    (fetched, released, expired; a failed one too, so that every rank counts the same
    records); one that does not fit beside the others' reservations has its captures refused
    at once (``RequestRecord.refused``), so a worker's capture budget never fails a request
    that is already running. Every rank sees the same requests in the same order and decides
    alike."""

    finished_ttl_s: float
    max_bytes: int = 1 << 62
    """``VLLM_LENS_WORKER_MAX_BYTES``."""
    records: dict[str, RequestRecord] = field(default_factory=dict)
    _closed: dict[str, float] = field(default_factory=dict)
    """Lens keys fetched or released -> when: a surplus step the scheduler ran before it saw
    the stop must not open a new record for them."""

    def __len__(self) -> int:
        return len(self.records)

    @property
    def device_bytes(self) -> int:
        return sum(r.device_bytes for r in self.records.values())

    def held_saes(self) -> set[tuple[str, str | None]]:
        """(real path, hook point) of the SAEs the records read on the workers, never to be
        unloaded while they are held: those whose features they capture, those whose
        TopK features they clamp and the transcoders replacing their MLPs (``worker.saes``)."""
        held = set()
        for record in self.records.values():
            held.update((s.path, s.hook_point) for s in record.lens.saes)
            held.update((s.clamp.path, s.clamp.hook_point) for s in record.lens.steer
                        if s.clamp is not None and s.clamp.path is not None)
            held.update((r.path, r.hook_point) for r in record.lens.replace_mlp)
        return held

    @property
    def reserved_bytes(self) -> int:
        """Capture bytes reserved by the records held (those refused reserve nothing)."""
        return sum(r.lens.reserve_bytes for r in self.records.values() if r.refused is None)

    def lookup(self, req_id: str, payload: Any) -> RequestRecord | None:
        """The record of a scheduled request, created on its first step; ``None`` for a
        request without a lens payload (or one already fetched)."""
        record = self.records.get(req_id)
        if record is not None:
            return record
        if payload is None:
            return None
        try:
            lens = LensRequest.from_payload(payload)
        except (ValueError, KeyError, TypeError) as exc:
            # The front end validated it; anything else did not come from vllm-lens.
            logger.warning("vllm-lens: ignoring malformed payload of %s: %s", req_id, exc)
            return None
        if lens.key in self._closed:
            return None
        reserved = self.reserved_bytes
        if lens.reserve_bytes and reserved + lens.reserve_bytes > self.max_bytes:
            holders = sum(1 for r in self.records.values()
                          if r.refused is None and r.lens.reserve_bytes)
            record = self.records[req_id] = RequestRecord(req_id, lens)
            record.refused = (
                f"vllm-lens refused its capture: it could hold up to {lens.reserve_bytes:,} "
                f"bytes on this worker, and the {holders} request(s) held here have reserved "
                f"{reserved:,} of VLLM_LENS_WORKER_MAX_BYTES ({self.max_bytes:,} bytes); it "
                "ran without its captures (its steering and hooks ran), and nobody else's "
                "rows were dropped for it. Retry later, capture fewer layers or positions (or "
                "lower max_tokens), or raise the setting")
            record.capacity = "VLLM_LENS_WORKER_MAX_BYTES"
            return record
        record = self.records[req_id] = RequestRecord(req_id, lens)
        return record

    def finish_gone(self, live: Container[str]) -> None:
        """Mark the records whose request the runner dropped as finished (freeing their device
        memory), and remove finished records unclaimed past the TTL."""
        now = time.monotonic()
        ttl = self.finished_ttl_s
        for req_id, record in list(self.records.items()):
            if record.finished_at is None:
                if req_id not in live:
                    record.finished_at = now
                    record.steer = None
                    if record.attention is not None:
                        record.attention.free()
                    if record.monitors is not None:
                        try:  # its monitors' hooks' rows wait for the fetch on the host
                            record.monitors.free()
                        except Exception as exc:  # noqa: BLE001 -- fail it, not the step
                            record.fail(exc, "monitors")
                    if record.hooks is not None:
                        try:  # what its hooks saved waits for the fetch on the host
                            record.hooks.to_host()
                        except Exception as exc:  # noqa: BLE001 -- fail it, not the step
                            record.fail(exc, "hooks")
            elif now - record.finished_at > ttl:
                del self.records[req_id]
        while self._closed:
            key, closed_at = next(iter(self._closed.items()))
            if now - closed_at <= ttl:
                break
            del self._closed[key]

    def pop(self, key: str) -> dict[str, RequestRecord]:
        """Remove every record of lens key ``key`` (request id -> record); later steps of its
        requests are ignored."""
        found = {r: rec for r, rec in self.records.items() if rec.lens.key == key}
        for req_id, record in found.items():
            del self.records[req_id]
            if record.attention is not None:  # (fetched before the runner dropped it)
                record.attention.free()
        self._closed.pop(key, None)  # re-inserted at the end: the dict stays in time order
        self._closed[key] = time.monotonic()
        return found
