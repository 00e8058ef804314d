"""Monitors on the worker: each monitored request's probe scores where its monitors read, and
the sampled token forced to end-of-sequence once a ``stop`` monitor fired (runs in: worker).

At a tap (after steering and hooks there, as a capture sees the signal) ``score`` computes
``h · probe + bias`` in float32 for the request's rows (the monitors read at one site in one
product, a block of rows at a time), or for a monitor by SAE feature the feature's
activation (the SAE cut down to that feature, ``encode`` in float32 of the float32 sum),
or for a monitor by a named hook's score the rows its hook (run just before, at the same tap,
as one of the request's hooks) saved for these positions, reduced to one number each; it
keeps the scores on the device (TP rank 0 reports them at fetch, one copy per monitor) and,
for ``stop`` monitors, ORs ``any(score > threshold)`` into the request's ``fired`` flag, a
device boolean: nothing waits on the device. Before the step samples, ``force_stops``
(through ``StopControl``) replaces the logits row of every request whose flag is set by one
that puts all its mass on the request's end-of-sequence token; every tensor-parallel rank
computes the same scores from the whole stream, so every rank forces the same rows. vLLM's
scheduler then finishes the request in that step (``finish_reason`` ``"stop"``); the front end
names the monitor (``frontend.collator``). A request with a ``stop`` monitor whose lens work
failed (its monitors, or anything else that stops its lens work) is ended the same way from
then on by tensor-parallel rank 0, whose tokens vLLM's scheduler reads (a guardrail fails
closed; ``StopControl.on_failure``), and reports the failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_lens.common import wire
from vllm_lens.common.points import hook_site, operands
from vllm_lens.saes import SAE
from vllm_lens.spec.monitors import MonitorSpec
from vllm_lens.worker.hooks import HookState

__all__ = ["MonitorState", "StopControl", "force_stops", "pack_scores"]


#: Rows scored at once: bounds the float32 copy a long prefill chunk makes.
_BLOCK_ROWS = 2048
#: Steps whose scores a monitor keeps apart before they are joined into one tensor.
_JOIN_EVERY = 64


@dataclass
class MonitorState:
    """One request's monitors on this worker, built when it first runs."""

    specs: tuple[MonitorSpec, ...]
    eos: int | None
    """The request's end-of-sequence token (``None``: a ``stop`` monitor cannot end it)."""
    by_site: dict[tuple[int, str], list[tuple[Any, ...]]] = field(default_factory=dict)
    """(layer, site) -> per point read there (``resid_post`` and ``mlp_out`` may share a
    site) and prompt rule: (point, generated only, monitor indices, their probes
    ``[hidden, k]`` float32 on the device, their biases ``[k]``, ``None``); for a monitor by
    SAE feature (point, generated only, ``[index]``, ``None``, ``None``, the SAE cut down to
    its feature, float32 on the device)."""
    hooks: HookState | None = None
    """The hooks of its monitors by a named hook's score, one run each in their order (run
    with the request's hooks; their ``saved`` holds the scores)."""
    by_hook: dict[tuple[int, str], list[tuple[int, int]]] = field(default_factory=dict)
    """(layer, site) -> (monitor index, index of its run in ``hooks``) per monitor by a
    hook's score read there."""
    hook_run: dict[int, int] = field(default_factory=dict)
    """Monitor index -> index of its run in ``hooks`` (monitors by a hook's score)."""
    n_prompt: int | None = None
    """The request's prompt length, once scored."""
    ranges: list[list[list[int]]] = field(default_factory=list)
    """Per monitor: the positions its kept scores cover, in order, as ``[first, count]`` runs
    (consecutive steps extend one run)."""
    chunks: list[list[torch.Tensor]] = field(default_factory=list)
    """Per monitor: its kept scores on the device, a step each, joined every ``_JOIN_EVERY``
    steps (so a long generation keeps a few tensors, 4 bytes a position)."""
    fired: torch.Tensor | None = None
    """Some ``stop`` monitor's score crossed its threshold (a device boolean)."""
    stops: bool = False
    """Some monitor's action is ``stop``."""
    failed: bool = False
    """Scoring raised on this rank: a ``stop`` request is ended (fails closed)."""

    @classmethod
    def build(cls, specs: tuple[MonitorSpec, ...], device: torch.device, eos: int | None,
              split: bool) -> MonitorState:
        stops = any(s.stops for s in specs)
        if eos is None and stops:
            i = next(i for i, s in enumerate(specs) if s.stops)
            raise ValueError(f"monitors[{i}].action: 'stop' ends the generation with the "
                             "end-of-sequence token, and this request has none")
        grouped: dict[tuple[int, str, str, bool], list[int]] = {}
        by_site: dict[tuple[int, str], list[Any]] = {}
        by_hook: dict[tuple[int, str], list[tuple[int, int]]] = {}
        hook_run = {i: run for run, i in enumerate(
            i for i, spec in enumerate(specs) if spec.hook)}
        hooks = (HookState.build((specs[i].hook_spec() for i in hook_run), read_only=True)
                 if hook_run else None)
        if hooks is not None and hooks.error is not None:
            raise RuntimeError(f"monitors: a hook could not be built: {hooks.error['message']}")
        for i, spec in enumerate(specs):
            site = hook_site(spec.point, split=split)
            if spec.hook:
                by_hook.setdefault((spec.layer, site), []).append((i, hook_run[i]))
                continue
            if spec.encoder:
                by_site.setdefault((spec.layer, site), []).append(
                    (spec.point, spec.generated_only, [i], None, None,
                     _feature_sae(spec.encoder, device)))
                continue
            grouped.setdefault((spec.layer, site, spec.point, spec.generated_only), []).append(i)
        for (layer, site, point, generated_only), indices in grouped.items():
            probes = torch.stack([wire.loads(specs[i].probe).float() for i in indices], dim=1)
            biases = torch.tensor([specs[i].bias for i in indices], dtype=torch.float32)
            by_site.setdefault((layer, site), []).append(
                (point, generated_only, indices, probes.to(device), biases.to(device), None))
        return cls(specs=specs, eos=eos, by_site=by_site, hooks=hooks, by_hook=by_hook,
                   hook_run=hook_run,
                   ranges=[[] for _ in specs], chunks=[[] for _ in specs], stops=stops)

    @property
    def sites(self) -> set[tuple[int, str]]:
        """The (layer, site) pairs its monitors read at."""
        return {*self.by_site, *self.by_hook}

    def score(self, where: tuple[int, str], hidden: torch.Tensor,
              residual: torch.Tensor | None, start: int, end: int, pos0: int,
              n_prompt: int, keep: bool) -> None:
        """Score rows ``start:end`` (positions from ``pos0``; the prompt has ``n_prompt``)
        for the monitors read at ``where``; ``keep``: this rank reports the scores."""
        self.n_prompt = n_prompt
        try:
            for i, run in self.by_hook.get(where, ()):
                self._score_hook(i, run, start, end, pos0, n_prompt)
            for point, generated_only, indices, probes, biases, sae in self.by_site.get(
                    where, ()):
                lo = max(start, start + n_prompt - pos0) if generated_only else start
                if lo >= end:
                    continue  # prompt rows only, and these monitors skip them
                a, b = operands(point, hidden, residual)
                scores = (_scores(a, b, lo, end, probes, biases) if sae is None
                          else _feature_scores(a, b, lo, end, sae))
                first = pos0 + lo - start
                for column, i in enumerate(indices):
                    if keep:
                        self._keep(i, first, scores[:, column])
                    spec = self.specs[i]
                    if spec.stops:
                        crossed = (scores[:, column] > spec.threshold).any()
                        self.fired = crossed if self.fired is None else self.fired | crossed
        except BaseException:
            self.failed = True
            raise

    def _score_hook(self, i: int, run: int, start: int, end: int, pos0: int,
                    n_prompt: int) -> None:
        """Monitor ``i`` by its hook's score: the rows the hook saved for positions
        ``pos0 .. pos0 + end - start`` (those it scored: every one, or its own selection), so
        the stop flag. They stay in the hook's ``saved`` for the report (``kept``)."""
        spec = self.specs[i]
        assert self.hooks is not None
        if self.hooks.error is not None:  # the hook raised (its rows are incomplete)
            raise RuntimeError(f"the hook {spec.hook!r} of monitor {spec.name!r} failed: "
                               f"{self.hooks.error['message']}")
        if not spec.stops:
            return  # a flag monitor's rows are read once, at fetch
        lo = max(pos0, n_prompt) if spec.generated_only else pos0
        positions, scores = self._hook_rows(i, run, lo, pos0 + end - start)
        if positions is None or not len(positions):
            return  # no position of these rows scored (or only prompt ones, skipped)
        crossed = (scores > spec.threshold).any()
        self.fired = crossed if self.fired is None else self.fired | crossed

    def _hook_rows(self, i: int, run: int, lo: int | None = None, hi: int | None = None
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Monitor ``i``'s hook rows (those of positions ``lo`` to ``hi``, or all): positions
        (host, int64) and one float32 score each (on the hook's device), reduced over the
        entries of a position as the monitor says (``spec.monitors.REDUCTIONS``). The hook
        keeps its positions on the host, ascending (``named_hooks``): the rows of a step are
        found by bisection, and only they are read."""
        spec = self.specs[i]
        assert self.hooks is not None
        saved, layer = self.hooks.runs[run].saved, str(spec.layer)
        values = saved.get(spec.score_key, {}).get(layer)
        if values is None:
            return None, torch.zeros(0, dtype=torch.float32)
        positions = saved["positions"][layer].to("cpu", torch.int64)
        if values.shape[0] != positions.shape[0]:
            raise ValueError(f"the hook {spec.hook!r} saved {values.shape[0]} scores for "
                             f"{positions.shape[0]} positions")
        if lo is not None:
            a, b = torch.searchsorted(positions, torch.tensor([lo, hi])).tolist()
            positions, values = positions[a:b], values[a:b]
        values = values.float()
        if spec.reduce:
            flat = values.reshape(values.shape[0], -1)
            values = (flat.amax(1) if spec.reduce == "max" else flat.amin(1)
                      if spec.reduce == "min" else flat.mean(1) if spec.reduce == "mean"
                      else flat.sum(1))
        elif values.dim() != 1:
            raise ValueError(f"the hook {spec.hook!r} saved {tuple(values.shape[1:])} numbers "
                             "per position under monitor_score, declared as one")
        return positions, values

    def _keep(self, i: int, first: int, scores: torch.Tensor) -> None:
        runs, chunks = self.ranges[i], self.chunks[i]
        if runs and runs[-1][0] + runs[-1][1] == first:
            runs[-1][1] += len(scores)
        else:
            runs.append([first, len(scores)])
        chunks.append(scores)
        if len(chunks) >= _JOIN_EVERY:
            chunks[:] = [torch.cat(chunks)]

    def kept(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Monitor ``i``'s kept (positions on the host, scores on the host), in the order
        they were computed (a position computed again appears again)."""
        spec = self.specs[i]
        if spec.hook:
            positions, scores = self._hook_rows(i, self.hook_run[i])
            if positions is None:
                return torch.zeros(0, dtype=torch.int64), scores
            if spec.generated_only and self.n_prompt is not None:
                keep = positions >= self.n_prompt
                positions, scores = positions[keep], scores.cpu()[keep]
            return positions, scores.cpu()
        if not self.chunks[i]:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
        positions = torch.cat([torch.arange(f, f + n) for f, n in self.ranges[i]])
        return positions, torch.cat(self.chunks[i]).cpu()  # one copy per monitor

    def free(self) -> None:
        """Drop the device tensors that only the running request needs (what its monitors'
        hooks saved goes to the host, for the report)."""
        self.by_site, self.by_hook = {}, {}
        self.fired = None
        if self.hooks is not None:
            self.hooks.to_host()


def _scores(a: torch.Tensor, b: torch.Tensor | None, lo: int, end: int,
            probes: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """``(a + b)[lo:end] @ probes + biases`` in float32 (``[end - lo, k]``), as two products
    (the score is linear in the stream, so the sum is never made), a block of rows at a
    time."""
    rows_a = a.reshape(-1, a.shape[-1])
    rows_b = None if b is None else b.reshape(-1, b.shape[-1])
    parts = []
    for s in range(lo, end, _BLOCK_ROWS):
        e = min(s + _BLOCK_ROWS, end)
        part = torch.addmm(biases, rows_a[s:e].float(), probes)
        if rows_b is not None:
            part.addmm_(rows_b[s:e].float(), probes)
        parts.append(part)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _feature_sae(encoder: bytes, device: torch.device) -> SAE:
    """A monitor's SAE, cut down to its feature, float32 on ``device``."""
    parts = wire.loads(encoder)
    return SAE(architecture=str(parts["architecture"]), W_enc=parts["W_enc"],
               b_enc=parts["b_enc"], W_dec=parts["W_dec"], b_dec=parts["b_dec"],
               layout="slice", threshold=parts["threshold"],
               apply_b_dec_to_input=bool(parts["apply_b_dec_to_input"])).to(device,
                                                                             torch.float32)


def _feature_scores(a: torch.Tensor, b: torch.Tensor | None, lo: int, end: int,
                    sae: SAE) -> torch.Tensor:
    """The feature's activation ``[end - lo, 1]`` of rows ``(a + b)[lo:end]``, float32, a
    block of rows at a time."""
    rows_a = a.reshape(-1, a.shape[-1])
    rows_b = None if b is None else b.reshape(-1, b.shape[-1])
    parts = []
    for s in range(lo, end, _BLOCK_ROWS):
        e = min(s + _BLOCK_ROWS, end)
        rows = rows_a[s:e].float()
        if rows_b is not None:
            rows = rows + rows_b[s:e].float()
        parts.append(sae.encode(rows).float())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class StopControl:
    """Which rows of the logits a step forces to end-of-sequence: the requests a ``stop``
    monitor fired for, and those whose lens work failed while a ``stop`` monitor guarded them
    (their monitors no longer run: they end at every step until they finish)."""

    closing: dict[str, MonitorState] = field(default_factory=dict)
    on_failure: bool = True
    """Whether a failure ends the request here. Only the rank whose sampled tokens vLLM's
    scheduler reads (tensor-parallel rank 0) acts on one: a failure may be this rank's alone,
    and a token forced on another rank only would leave the ranks' inputs apart; on rank 0
    the end-of-sequence token ends the request for every rank. A fired monitor's flag is the
    same on every rank, so every rank forces that."""

    def close(self, req_id: str, state: MonitorState) -> None:
        if self.on_failure:
            self.closing[req_id] = state

    def force(self, logits: torch.Tensor, stops: list[tuple[str, MonitorState]],
              records: dict[str, Any], view: Any) -> None:
        """Before the step samples: ``stops`` are this step's (request id, state) with a
        ``stop`` monitor; ``records`` the worker's request records; ``view`` the runner's
        (``runner.RunnerView``: live requests, each one's row of the logits)."""
        for req_id, state in stops:
            record = records.get(req_id)
            if self.on_failure and (state.failed or record is None
                                    or record.error is not None):
                # Its lens work failed in this step, so its monitors stop running: it ends
                # now and at every later step (a guardrail fails closed).
                self.closing[req_id] = state
        if self.closing:
            live = view.live()
            self.closing = {r: st for r, st in self.closing.items() if r in live}
        rows = [(row, state, req_id in self.closing)
                for req_id, state in [*stops, *self.closing.items()]
                if (row := view.logits_row(req_id)) is not None and state.eos is not None]
        force_stops(logits, rows)


def force_stops(logits: torch.Tensor, rows: list[tuple[int, MonitorState, bool]]) -> None:
    """In place: each ``(row, state, failed)`` whose ``fired`` flag is set, or whose monitors
    failed (``failed``: a guardrail fails closed), samples its end-of-sequence token."""
    live = [(row, state, failed) for row, state, failed in rows
            if failed or state.fired is not None]
    if not live:
        return
    device = logits.device
    index = torch.tensor([row for row, _, _ in live], device=device)
    eos = torch.tensor([state.eos for _, state, _ in live], device=device)
    fired = torch.stack([torch.ones((), dtype=torch.bool, device=device) if failed
                         else state.fired for _, state, failed in live])
    forced = torch.full((len(live), logits.shape[-1]), float("-inf"), dtype=logits.dtype,
                        device=device)
    forced[torch.arange(len(live), device=device), eos] = 0.0
    logits[index] = torch.where(fired[:, None], forced, logits[index])


def pack_scores(state: MonitorState, valid: int | None) -> bytes:
    """``wire`` bytes of ``[{"positions" int64, "scores" float32}]``, one per monitor in the
    request's order: each of the ``valid`` positions the request's rows cover (all if
    ``None``) once (a position computed again after a preemption keeps its last score)."""
    out: list[dict[str, Any]] = []
    for i in range(len(state.specs)):
        positions, scores = state.kept(i)
        by_position = dict(zip(positions.tolist(), scores.tolist()))
        order = sorted(p for p in by_position if valid is None or p < valid)
        out.append({"positions": torch.tensor(order, dtype=torch.int64),
                    "scores": torch.tensor([by_position[p] for p in order],
                                           dtype=torch.float32)})
    return wire.dumps(out)
