"""The collator: puts what the workers sent for a finished or streamed request on its output
(runs in: front end).

vLLM's ``RequestOutput`` and ``CompletionOutput`` get the fields of ``OUTPUT_FIELDS``
(``install_output_fields``, once per process). When a lens request finishes, ``attach``
reads every rank's ``lens_fetch`` answer (``common.messages.FetchAnswer``), decides per
completion whether its results are whole (every requested layer back, a worker that vouches
for its steering and hooks, the sink's receipt) and attaches them, or a ``lens_error`` and
nothing partial; ``attach_partial`` does the same for the rows a streamed request computed
since its previous output. The merge of ranks and stages is ``frontend.merge``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.outputs import RequestOutput

from vllm_lens.common import handoff, wire
from vllm_lens.common.messages import FetchAnswer
from vllm_lens.common.points import DLA_PREFIX, RESIDUAL_SIGNAL, SHARDED
from vllm_lens.errors import LensExecutionError, SinkConflictError, WorkerCapacityError
from vllm_lens.frontend.merge import merge_hook_results, merge_rank_payloads
from vllm_lens.frontend.receipts import join_receipts, unwritten
from vllm_lens.saes.labels import labels_for, read_labels
from vllm_lens.spec import CaptureSpec, LensRequest, ModelFacts
from vllm_lens.spec.logit_attribution import LOGIT_SIGNAL
from vllm_lens.common import hook_results

logger = logging.getLogger(__name__)

__all__ = ["OUTPUT_FIELDS", "attach", "attach_partial", "chosen_experts", "discard_unread",
           "fail_output", "install_output_fields", "logit_attribution", "monitor_records",
           "sae_features"]

#: What vllm-lens attaches to ``RequestOutput`` and ``CompletionOutput``.
OUTPUT_FIELDS = ("activations", "hook_results", "hook_error", "lens_error", "capture_receipt",
                 "steering_gates", "sae_features", "monitors", "logit_attribution")


def install_output_fields() -> None:
    """Give vLLM's output classes these fields with the default ``None`` (class attributes:
    no per-request cost), so ``out.activations`` is ``None``, not an ``AttributeError``, on any
    output that asked for nothing."""
    from vllm.outputs import CompletionOutput

    for cls in (RequestOutput, CompletionOutput):
        for name in OUTPUT_FIELDS:
            if not hasattr(cls, name):
                setattr(cls, name, None)


def chosen_experts(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts each row was routed to, ``[..., top_k]`` (most weight first), recomputed
    from the captured logits: for ``Layout.routing == "softmax_topk"`` (the only routing
    whose ``moe_top_k`` the workers report) they are the top-k of the softmaxed logits, which
    are the top-k of the logits."""
    if top_k <= 0 or router_logits.shape[-1] == 0:
        return torch.empty((*router_logits.shape[:-1], 0), dtype=torch.int64)
    return router_logits.float().topk(min(top_k, router_logits.shape[-1]), dim=-1).indices


def sae_features(lens: LensRequest,
                 parts: Mapping[str, Sequence[tuple[Mapping[str, Any], torch.Tensor]]]
                 ) -> list[dict[str, Any]]:
    """``sae_features`` of one completion, parallel to ``output_sae_features``: per entry the
    positions read and, per position, the top features' ``indices`` (int32, -1 where fewer
    were active) and ``values`` (float32), descending; with ``reconstruction`` also ``nmse``
    and ``l0``; where the SAE's directory has labels (``saes.labels``), ``labels``: index ->
    label of the features the entry holds. The workers sent ``[1, n, width]`` rows
    (``worker.capture``)."""
    out = []
    for spec in lens.saes:
        found = parts.get(spec.signal)
        if found:
            tensor, positions = merge_rank_payloads(found)
            rows = tensor[0].float()
        else:  # no position selected
            rows, positions = torch.empty(0, spec.width), torch.empty(0, dtype=torch.int64)
        entry = spec.entry(rows, positions)
        try:
            labels = read_labels(spec.path)
        except (ValueError, OSError) as exc:  # changed since it was registered: rows still go
            logger.warning("vllm-lens: the labels of SAE %s are not attached: %s", spec.sae, exc)
            labels = None
        if labels is not None:
            entry["labels"] = labels_for(labels, entry["indices"])
        out.append(entry)
    return out


def logit_attribution(lens: LensRequest,
                      parts: Mapping[str, Sequence[tuple[Mapping[str, Any], torch.Tensor]]]
                      ) -> dict[str, Any]:
    """``logit_attribution`` of one completion (``LogitAttributionSpec.result``): the
    workers sent ``[1, n, 2 + 2 * layers]`` rows (``worker.attribution.component_rows``)."""
    spec = lens.logit_attribution
    assert spec is not None
    found = parts.get(LOGIT_SIGNAL)
    if not found:  # no position selected
        return spec.result(None, torch.empty(0, dtype=torch.int64))
    tensor, positions = merge_rank_payloads(found)
    return spec.result(tensor[0], positions)


def discard_unread(rank_results: Sequence[FetchAnswer] | None) -> None:
    """Delete the handoff files of ``lens_fetch`` answers that will not be (or were not all)
    received: a cancelled request, or an attach that failed part-way. Received ones are gone
    already, so calling this after a successful attach costs a few failed unlinks."""
    for result in rank_results or ():
        handoff.discard_fetched(result)


def _ended_early(output: RequestOutput, index: int) -> bool:
    """Whether vLLM itself ended the completion with an error or an abort (it may never have
    been scheduled, so no worker saw it: that is vLLM's failure to report, not lost rows)."""
    reason = next((c.finish_reason for c in output.outputs if c.index == index), None)
    return reason in ("abort", "error")


def _missing_rows(layers: Sequence[int],
                  parts: Sequence[tuple[Mapping[str, Any], torch.Tensor]] | None,
                  seen: bool, copies: int = 1) -> str | None:
    """Why a completion's capture is incomplete, or ``None``: every requested layer must come
    back, and "no rows" is an answer only from a worker that still held the request (then no
    position was selected)."""
    if parts is None:
        if seen:
            return None
        return ("vllm-lens lost this request's captured rows: no worker held them at fetch "
                "time (dropped past VLLM_LENS_WORKER_MAX_BYTES or VLLM_LENS_FINISHED_TTL_S)")
    got = sorted(layer for header, _ in parts for layer in header["layers"])
    if got != sorted(list(layers) * copies):
        lost = sorted(layer for layer in layers if got.count(layer) != copies)
        return (f"vllm-lens lost captured rows: layers {lost} did not come back from their "
                "pipeline stage" + (" (from every tensor-parallel rank)" if copies > 1 else ""))
    return None


@dataclasses.dataclass
class _Gathered:
    """Every rank's parts of one lens request, by engine request id."""

    captures: dict[str, dict[str, list[tuple[dict[str, Any], torch.Tensor]]]] = \
        dataclasses.field(default_factory=dict)
    hooks: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    conflicts: set[str] = dataclasses.field(default_factory=set)
    """Requests whose example the sink refused as conflicting with its dataset."""
    capacity: dict[str, str] = dataclasses.field(default_factory=dict)
    """Requests a worker's full budget refused -> the setting that sizes it."""
    seen: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    held: set[str] = dataclasses.field(default_factory=set)
    receipts: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    """Per request, the sink's receipts: one per pipeline stage that wrote a part."""
    gates: dict[str, dict[int, dict[str, torch.Tensor]]] = dataclasses.field(
        default_factory=dict)
    monitors: dict[str, list[dict[str, torch.Tensor]]] = dataclasses.field(default_factory=dict)
    """Per request, each monitor's positions and scores (TP rank 0)."""


def _gather(lens: LensRequest, rank_results: Sequence[FetchAnswer]) -> _Gathered:
    """Read every rank's ``FetchPart`` of ``lens`` (captures received, hooks decoded)."""
    got = _Gathered()
    trusted = any(h.pickled is not None for h in lens.hooks)
    for result in rank_results:
        for req_id, part in result.requests.get(lens.key, {}).items():
            if part.error is not None and req_id not in got.errors:
                got.errors[req_id] = part.error
                if part.conflict:  # (only when this is the error reported)
                    got.conflicts.add(req_id)
                if part.capacity:
                    got.capacity[req_id] = part.capacity
            got.seen.setdefault(req_id, set()).update(part.seen)
            if part.held:
                got.held.add(req_id)
            if part.receipt is not None:
                got.receipts.setdefault(req_id, []).append(part.receipt)
            for signal, sent in part.captures.items():
                got.captures.setdefault(req_id, {}).setdefault(signal, []).append(
                    handoff.receive(sent))
            if part.hooks is not None:
                got.hooks.setdefault(req_id, []).append(hook_results.decode(part.hooks, trusted))
            if part.gates is not None:
                got.gates[req_id] = {int(i): g for i, g in wire.loads(part.gates).items()}
            if part.monitors is not None:
                got.monitors[req_id] = wire.loads(part.monitors)
    return got


def _mine(by_id: Mapping[str, Any], prefix: str, default: Any = None) -> Any:
    """The value of the engine request whose id starts with ``prefix`` (one completion)."""
    return next((v for k, v in by_id.items() if k.startswith(prefix)), default)


def _incomplete(output: RequestOutput, lens: LensRequest, got: _Gathered, index: int,
                prefix: str, facts: ModelFacts | None) -> str | None:
    """Why completion ``index`` cannot be vouched for although no worker failed it, or
    ``None``."""
    if _ended_early(output, index):
        return None
    if not any(k.startswith(prefix) for k in got.held):
        return ("vllm-lens lost this request's lens state: no worker held it at fetch time "
                "(its steering, hooks or rows cannot be vouched for; dropped after "
                "VLLM_LENS_FINISHED_TTL_S?)")
    if lens.monitors and _mine(got.monitors, prefix) is None:
        return ("vllm-lens lost this request's monitor scores: no worker reported them at "
                "fetch time")
    if lens.sink is not None:
        receipts = _mine(got.receipts, prefix)
        if receipts is None:
            return ("vllm-lens wrote nothing to the sink: no position was selected"
                    if any(got.seen.values()) else
                    "vllm-lens lost this request's captured rows before they reached the "
                    "sink: no worker held them at fetch time")
        return unwritten(lens, receipts)
    mine = _mine(got.captures, prefix, {})
    signals_seen = set().union(*(v for k, v in got.seen.items() if k.startswith(prefix)))
    tp = facts.tp_size if facts is not None else 1
    if lens.logit_attribution is not None:  # its rows came back as one signal
        kept = any(s.startswith(DLA_PREFIX) for s in signals_seen)
        if (why := _missing_rows((0,), mine.get(LOGIT_SIGNAL), kept)) is not None:
            return why
    return next(filter(None, (
        _missing_rows(c.layers, mine.get(c.signal), c.signal in signals_seen,
                      tp if c.signal in SHARDED else 1)
        for c in (*lens.captures, *lens.sae_captures)
        if not c.signal.startswith(DLA_PREFIX))), None)


def _failed_fields(lens: LensRequest, error: LensExecutionError) -> dict[str, Any]:
    """A failed completion's fields: the error, and ``None`` for each result it asked for
    (nothing partial is returned)."""
    found: dict[str, Any] = {"lens_error": error}
    if lens.sink is not None:
        found["capture_receipt"] = None
    elif lens.captures:
        found["activations"] = None
    if lens.saes:
        found["sae_features"] = None
    if lens.logit_attribution is not None:
        found["logit_attribution"] = None
    if lens.hooks:
        found["hook_results"], found["hook_error"] = None, None
    if any(s.condition is not None for s in lens.steer):
        found["steering_gates"] = None
    if lens.monitors:
        found["monitors"] = None
    return found


def attach(output: RequestOutput, lens: LensRequest, rank_results: Sequence[FetchAnswer],
           n: int, facts: ModelFacts | None) -> dict[int, dict[str, Any]]:
    """Attach ``activations`` / ``hook_results`` / ``hook_error`` / ``lens_error`` to
    ``output`` (n == 1) and to each of its completions.

    ``lens_error`` is a ``LensExecutionError`` when some worker failed the completion's
    lens work (then ``activations`` and ``hook_results`` are ``None``: nothing partial is
    returned), else ``None``.

    Returns what was attached for all ``n`` completions, by index: a streamed (DELTA)
    final output holds only the completions that changed in its step, not all of them.
    """
    got = _gather(lens, rank_results)
    gated = any(s.condition is not None for s in lens.steer)
    by_index: dict[int, dict[str, Any]] = {}
    for index in range(n):
        prefix = "" if n == 1 else f"{index}_"
        failed = next((k for k in got.errors if k.startswith(prefix) or not k), None)
        error = (got.errors[failed] if failed is not None
                 else _incomplete(output, lens, got, index, prefix, facts))
        if error is not None:
            if failed in got.capacity:
                problem: LensExecutionError = WorkerCapacityError(
                    error, setting=got.capacity[failed], request_id=output.request_id)
            else:
                kind = SinkConflictError if failed in got.conflicts else LensExecutionError
                problem = kind(error, request_id=output.request_id)
            by_index[index] = _failed_fields(lens, problem)
            continue
        found: dict[str, Any] = {"lens_error": None}
        mine = _mine(got.captures, prefix, {})
        if lens.sink is not None:
            found["capture_receipt"] = join_receipts(_mine(got.receipts, prefix))
        elif lens.captures:
            found["activations"] = _activations(lens, mine, facts)
        if lens.saes:  # (a sink's receipt stands for them too)
            found["sae_features"] = None if lens.sink is not None else sae_features(lens, mine)
        if lens.logit_attribution is not None:
            found["logit_attribution"] = logit_attribution(lens, mine)
        if lens.hooks:
            found["hook_results"], found["hook_error"] = merge_hook_results(
                _mine(got.hooks, prefix, []))
        if gated:
            found["steering_gates"] = _mine(got.gates, prefix, {})
        if lens.monitors:
            found["monitors"] = monitor_records(lens, _mine(got.monitors, prefix))
        by_index[index] = found
    for completion in output.outputs:
        for name, value in by_index[completion.index].items():
            setattr(completion, name, value)
        stopped_by = _stopped_by(by_index[completion.index].get("monitors"))
        if stopped_by is not None and completion.finish_reason == "stop":
            completion.stop_reason = stopped_by
    if n == 1:
        for name, value in by_index[0].items():
            setattr(output, name, value)
    return by_index


def attach_partial(output: RequestOutput, lens: LensRequest,
                   rank_results: Sequence[FetchAnswer], facts: ModelFacts | None
                   ) -> dict[str, Any]:
    """Attach the rows of a streamed request (n == 1) that ``lens_fetch_partial`` returned
    to ``output`` and its completion: as ``activations`` the rows computed since the previous
    output, every captured signal present (with no rows if none are new), and as
    ``sae_features`` the features of those positions. Returns what it attached.

    Raises:
        LensExecutionError: a worker failed the request.
    """
    parts: dict[str, list[tuple[dict[str, Any], torch.Tensor]]] = {}
    for result in rank_results:
        for found in result.requests.get(lens.key, {}).values():
            if found.error is not None:
                raise LensExecutionError(found.error, request_id=output.request_id)
            for signal, sent in found.captures.items():
                parts.setdefault(signal, []).append(handoff.receive(sent))
    attached: dict[str, Any] = {}
    if lens.captures:
        attached["activations"] = _activations(lens, parts, facts)
    if lens.saes:
        attached["sae_features"] = sae_features(lens, parts)
    for target in (output, *output.outputs):
        for name, value in attached.items():
            setattr(target, name, value)
    return attached


def fail_output(output: RequestOutput, lens: LensRequest, exc: BaseException) -> None:
    """Mark every completion of ``output`` failed (its results could not be collated)."""
    error = LensExecutionError(f"vllm-lens failed at collation: {type(exc).__name__}: "
                               f"{exc}", request_id=output.request_id)
    fields: dict[str, Any] = {"lens_error": error}
    if lens.captures:
        fields["activations"] = None
    if lens.saes:
        fields["sae_features"] = None
    if lens.logit_attribution is not None:
        fields["logit_attribution"] = None
    if lens.hooks:
        fields["hook_results"] = fields["hook_error"] = None
    if any(s.condition is not None for s in lens.steer):
        fields["steering_gates"] = None
    if lens.monitors:
        fields["monitors"] = None
    for target in (output, *output.outputs):
        for name, value in fields.items():
            setattr(target, name, value)


def monitor_records(lens: LensRequest,
                    scored: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """One record per monitor of ``lens``, in its order: ``name``, ``action``, ``threshold``,
    ``fired``, the first ``position`` whose score is above the threshold and that ``score``
    (``None`` when it never fired), and every computed position's ``positions`` / ``scores``."""
    records = []
    for spec, found in zip(lens.monitors, scored, strict=True):
        positions, scores = found["positions"], found["scores"]
        above = (scores > spec.threshold).nonzero()
        first = int(above[0, 0]) if len(above) else None
        records.append({
            "name": spec.name, "action": spec.action, "threshold": spec.threshold,
            "fired": first is not None,
            "position": None if first is None else int(positions[first]),
            "score": None if first is None else float(scores[first]),
            "positions": positions, "scores": scores})
    return records


def _stopped_by(records: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The ``stop`` monitor that fired first (by position, then order), or ``None``."""
    fired = [(r["position"], i, r["name"]) for i, r in enumerate(records or ())
             if r["action"] == "stop" and r["fired"]]
    return min(fired)[2] if fired else None


def _facts(facts: ModelFacts | None) -> ModelFacts:
    assert facts is not None, "call the engine's lens_describe before collating"
    return facts


def _activations(lens: LensRequest,
                 parts: Mapping[str, list[tuple[dict[str, Any], torch.Tensor]]],
                 facts: ModelFacts | None) -> dict[str, Any]:
    """One completion's ``activations``: ``residual_stream`` and ``positions`` for
    ``output_residual_stream``; ``<point>`` and ``<point>_positions`` per tap point;
    ``attn_q``, ``attn_k``, ``qk_layers`` and ``qk_meta`` for ``output_qk`` (and
    ``qk_heads`` when it chose heads); ``router_experts`` beside unreduced ``router_logits``.
    ``positions`` is always there: without a residual-stream capture, the first
    signal's."""
    acts: dict[str, Any] = {}
    for spec in lens.captures:
        found = parts.get(spec.signal)
        tensor, positions = (merge_rank_payloads(found, _facts(facts).n_kv_heads)
                             if found is not None else _empty(spec, _facts(facts)))
        if spec.signal == RESIDUAL_SIGNAL:
            acts[RESIDUAL_SIGNAL], acts["positions"] = tensor, positions
        else:
            acts[spec.signal], acts[f"{spec.signal}_positions"] = tensor, positions
            acts.setdefault("positions", positions)
            if spec.signal == "router_logits" and spec.reduce is None:
                acts["router_experts"] = chosen_experts(tensor, _facts(facts).moe_top_k)
    if layers := lens.qk_layers:
        meta = _facts(facts).qk_meta
        acts["qk_layers"] = list(layers)
        acts["qk_meta"] = [dict(meta[layer]) if layer < len(meta) else {} for layer in layers]
        if lens.qk_heads is not None:
            _keep_heads(acts, lens.qk_heads)
    return acts


def _keep_heads(acts: dict[str, Any], heads: tuple[int, ...]) -> None:
    """``output_qk`` with ``heads``: Q of those query heads only, and beside each the key
    head it reads (a key head two chosen heads share is sent twice), so that query head ``i``
    of ``attn_q`` reads key head ``i`` of ``attn_k``; each layer's per-head values (ALiBi
    slopes, sinks) narrowed alike, its head counts those of the tensors sent (the layer's
    kept as ``layer_num_heads`` / ``layer_num_kv_heads``), and the heads listed in
    ``qk_heads``."""
    q, k = acts["attn_q"], acts["attn_k"]
    group = q.shape[2] // k.shape[2]
    chosen = torch.tensor(heads, dtype=torch.long)
    acts["attn_q"] = q.index_select(2, chosen)
    acts["attn_k"] = k.index_select(2, chosen // group)
    acts["qk_heads"] = list(heads)
    for meta in acts["qk_meta"]:
        for name in ("alibi_slopes", "sinks"):
            if meta.get(name) is not None:
                meta[name] = [meta[name][h] for h in heads]
        # The counts describe the tensors sent; the layer's own are kept beside them.
        meta["layer_num_heads"] = meta["num_heads"]
        meta["layer_num_kv_heads"] = meta["num_kv_heads"]
        meta["num_heads"] = meta["num_kv_heads"] = len(heads)
        meta["heads"] = list(heads)


def _empty(spec: CaptureSpec, facts: ModelFacts) -> tuple[torch.Tensor, torch.Tensor]:
    """A signal no position of which was selected."""
    dtype = getattr(torch, facts.dtype)
    row = facts.row_shape(spec.signal, spec.layers)
    n_layers = len(spec.layers)
    if spec.reduce is not None:  # a reduction over no position: NaN rows
        tensor = torch.full((n_layers, *row), float("nan"), dtype=dtype)
    else:
        tensor = torch.empty((n_layers, 0, *row), dtype=dtype)
    return tensor, torch.empty(0, dtype=torch.int64)
