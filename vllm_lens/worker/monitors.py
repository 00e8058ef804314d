"""Monitors on the worker: each monitored request's probe scores where its monitors read, and
the sampled token forced to end-of-sequence once a ``stop`` monitor fired (runs in: worker).

At a tap (after steering and hooks there, as a capture sees the signal) ``score`` computes
``h · probe + bias`` in float32 for the request's rows, keeps the scores on the device (TP
rank 0 reports them at fetch) and, for ``stop`` monitors, ORs ``any(score > threshold)`` into
the request's ``fired`` flag, a device boolean: nothing waits on the device. Before the step
samples, ``force_stops`` replaces the logits row of every request whose flag is set by one
that puts all its mass on the request's end-of-sequence token; every tensor-parallel rank
computes the same scores from the whole stream, so every rank forces the same rows. vLLM's
scheduler then finishes the request in that step (``finish_reason`` ``"stop"``); the front end
names the monitor (``frontend.collator``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_lens.common import wire
from vllm_lens.common.points import hook_site, operands
from vllm_lens.spec.monitors import MonitorSpec

__all__ = ["MonitorState", "force_stops", "pack_scores"]


@dataclass
class MonitorState:
    """One request's monitors on this worker, built when it first runs."""

    specs: tuple[MonitorSpec, ...]
    probes: list[torch.Tensor]
    """Each monitor's probe, float32 on the model's device."""
    eos: int | None
    """The request's end-of-sequence token (``None``: a ``stop`` monitor cannot end it)."""
    steps: list[list[tuple[int, torch.Tensor]]] = field(default_factory=list)
    """Per monitor: (absolute position of the first row, scores on the device) per step."""
    fired: torch.Tensor | None = None
    """Some ``stop`` monitor's score crossed its threshold (a device boolean)."""

    @classmethod
    def build(cls, specs: tuple[MonitorSpec, ...], device: torch.device,
              eos: int | None) -> MonitorState:
        if eos is None and any(s.stops for s in specs):
            raise ValueError("monitors: action 'stop' ends the generation with the "
                             "end-of-sequence token, and this request has none")
        probes = [wire.loads(s.probe).to(device=device, dtype=torch.float32) for s in specs]
        return cls(specs=specs, probes=probes, eos=eos, steps=[[] for _ in specs])

    def sites(self, split: bool) -> dict[tuple[int, str], list[int]]:
        """(layer, site) -> the indices of the monitors read there."""
        found: dict[tuple[int, str], list[int]] = {}
        for i, spec in enumerate(self.specs):
            found.setdefault((spec.layer, hook_site(spec.point, split=split)), []).append(i)
        return found

    def score(self, indices: list[int], hidden: torch.Tensor, residual: torch.Tensor | None,
              start: int, end: int, pos0: int, keep: bool) -> None:
        """Score rows ``start:end`` (positions from ``pos0``) for the monitors ``indices``
        at this tap; ``keep``: this rank reports the scores."""
        for i in indices:
            spec = self.specs[i]
            a, b = operands(spec.point, hidden, residual)
            rows = a.reshape(-1, a.shape[-1])[start:end].float()
            if b is not None:
                rows = rows + b.reshape(-1, b.shape[-1])[start:end].float()
            scores = rows @ self.probes[i] + spec.bias
            if keep:
                self.steps[i].append((pos0, scores))
            if spec.stops:
                crossed = (scores > spec.threshold).any()
                self.fired = crossed if self.fired is None else self.fired | crossed

    def free(self) -> None:
        """Drop the device tensors that only the running request needs."""
        self.probes = []
        self.fired = None


def force_stops(logits: torch.Tensor, rows: list[tuple[int, MonitorState]]) -> None:
    """In place: each ``(row, state)`` whose ``fired`` flag is set samples its EOS token."""
    for row, state in rows:
        if state.fired is None:
            continue
        forced = torch.full_like(logits[row], float("-inf"))
        forced[state.eos] = 0.0
        logits[row] = torch.where(state.fired, forced, logits[row])


def pack_scores(state: MonitorState, last: int) -> bytes:
    """``wire`` bytes of ``[{"positions" int64, "scores" float32}]``, one per monitor in the
    request's order: every position up to ``last`` once (a recomputed one, after a
    preemption, keeps its last score)."""
    out: list[dict[str, Any]] = []
    for steps in state.steps:
        by_position: dict[int, float] = {}
        for pos0, scores in steps:
            for k, value in enumerate(scores.detach().cpu().tolist()):
                if pos0 + k <= last:
                    by_position[pos0 + k] = value
        order = sorted(by_position)
        out.append({"positions": torch.tensor(order, dtype=torch.int64),
                    "scores": torch.tensor([by_position[p] for p in order],
                                           dtype=torch.float32)})
    return wire.dumps(out)
