"""Response collator: turns the workers' buffers into ``activations`` on the outputs (runs in: front
end).

One ``LensSession`` lives on each engine object (``LLMEngine`` or ``AsyncLLM``). It validates
lens requests before they enter the engine, remembers which requests carry one, and when such a
request finishes builds the fetch arguments and attaches the merged result. The sync and async
engines differ only in how they call ``collective_rpc``, so everything else lives here once.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Container, Mapping, Sequence
from typing import Any

import torch
from vllm import SamplingParams
from vllm.outputs import RequestOutput

from vllm_lens import envs
from vllm_lens.common import handoff, wire
from vllm_lens.common.messages import FetchAnswer
from vllm_lens.frontend.admission import capture_reservation, check_admission
from vllm_lens.errors import (
    LensExecutionError,
    LensRequestError,
    SinkConflictError,
    WorkerCapacityError,
)
from vllm_lens.frontend.receipts import join_receipts, unwritten
from vllm_lens.hooks import HookError
from vllm_lens.common.points import RESIDUAL_SIGNAL, SHARDED, shard_dim
from vllm_lens.sinks.config import SinkSpec
from vllm_lens.spec.facts import facts_from_describe  # noqa: F401 - moved; split follows
from vllm_lens.spec import (
    PAYLOAD_KEY,
    SINK_KEY,
    STEER_KEY,
    STREAM_KEY,
    CaptureSpec,
    LensRequest,
    ModelFacts,
    SteerSpec,
    has_lens_keys,
    parse_extra_args,
    reuse_parsed,
)
from vllm_lens.worker.hooks import decode_results

__all__ = [
    "OUTPUT_FIELDS", "LensSession", "install_output_fields",
    "join_features", "join_rows", "join_streamed", "merge_hook_results", "merge_rank_payloads",
]

#: What vllm-lens attaches to ``RequestOutput`` and ``CompletionOutput``.
OUTPUT_FIELDS = ("activations", "hook_results", "hook_error", "lens_error", "capture_receipt",
                 "steering_gates", "sae_features")


def install_output_fields() -> None:
    """Give vLLM's output classes these fields with the default ``None`` (class attributes:
    no per-request cost), so ``out.activations`` is ``None``, not an ``AttributeError``, on any
    output that asked for nothing."""
    from vllm.outputs import CompletionOutput

    for cls in (RequestOutput, CompletionOutput):
        for name in OUTPUT_FIELDS:
            if not hasattr(cls, name):
                setattr(cls, name, None)

_SESSION_ATTR = "_vllm_lens_session"


def prompt_length(prompt: Any) -> int | None:
    """Tokens in an engine input (a vLLM ``TokensInput`` dict or ``EngineCoreRequest``), or
    ``None`` when it is not tokenized yet."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else getattr(
        prompt, "prompt_token_ids", None)
    return len(ids) if ids is not None else None


def chosen_experts(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts each row was routed to, ``[..., top_k]`` (most weight first), recomputed
    from the captured logits: for ``Layout.routing == "softmax_topk"`` (the only routing
    whose ``moe_top_k`` the workers report) they are the top-k of the softmaxed logits, which
    are the top-k of the logits."""
    if top_k <= 0 or router_logits.shape[-1] == 0:
        return torch.empty((*router_logits.shape[:-1], 0), dtype=torch.int64)
    return router_logits.float().topk(min(top_k, router_logits.shape[-1]), dim=-1).indices


def merge_rank_payloads(
    parts: Sequence[tuple[Mapping[str, Any], torch.Tensor]], n_kv_heads: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one signal of one request (``handoff.receive`` results) from the ranks that
    captured it: pipeline stages in layer order; the tensor-parallel parts of a sharded
    signal (``points.SHARDED``) joined in rank order along their heads or columns (a key head
    that several ranks hold, when there are fewer key heads than ranks, is kept once).
    Returns (tensor, positions)."""
    ordered = sorted(parts, key=lambda part: (part[0]["layers"][0], part[0].get("tp_rank", 0)))
    stages: dict[tuple[int, ...], list[tuple[Mapping[str, Any], torch.Tensor]]] = {}
    for header, tensor in ordered:
        stages.setdefault(tuple(header["layers"]), []).append((header, tensor))
    tensors = []
    for shards in stages.values():
        first = shards[0][0]["positions"]
        if any(not torch.equal(h["positions"], first) for h, _ in shards[1:]):
            raise ValueError("tensor-parallel ranks returned different positions for one "
                             "signal")
        if len(shards) == 1:
            tensors.append(shards[0][1])
            continue
        signal = shards[0][0]["signal"]
        if signal == "attn_k" and 0 < n_kv_heads < len(shards):
            replicas = len(shards) // n_kv_heads  # ranks r holds key head r // replicas
            shards = shards[::replicas]
        tensors.append(torch.cat([t for _, t in shards], dim=shard_dim(signal)))
    tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return tensor, ordered[0][0]["positions"]


def sae_features(lens: LensRequest,
                 parts: Mapping[str, Sequence[tuple[Mapping[str, Any], torch.Tensor]]]
                 ) -> list[dict[str, Any]]:
    """``sae_features`` of one completion, parallel to ``output_sae_features``: per entry the
    positions read and, per position, the top features' ``indices`` (int32, -1 where fewer
    were active) and ``values`` (float32), descending; with ``reconstruction`` also ``nmse``
    and ``l0``. The workers sent ``[1, n, width]`` rows (``worker.capture``)."""
    out = []
    for spec in lens.saes:
        found = parts.get(spec.signal)
        if found:
            tensor, positions = merge_rank_payloads(found)
            rows = tensor[0].float()
        else:  # no position selected
            rows, positions = torch.empty(0, spec.width), torch.empty(0, dtype=torch.int64)
        out.append(spec.entry(rows, positions))
    return out


def join_rows(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Lay the ``activations`` of consecutive streamed outputs end to end: tensors of rows
    along positions (``[n_layers, n_rows, ...]``: dim 1; position lists: dim 0); other
    values (``qk_meta`` ...) from the first."""
    joined = dict(parts[0])
    for name, first in parts[0].items():
        if isinstance(first, torch.Tensor) and len(parts) > 1:
            dim = 0 if first.dim() == 1 else 1
            joined[name] = torch.cat([part[name] for part in parts], dim=dim)
    return joined


def join_features(parts: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Lay the ``sae_features`` of consecutive streamed outputs end to end: per entry, every
    per-position tensor (``positions``, ``indices``, ``values``, ``nmse``, ``l0``) along
    positions."""
    return [{name: torch.cat([part[i][name] for part in parts])
             if isinstance(value, torch.Tensor) else value for name, value in entry.items()}
            for i, entry in enumerate(parts[0])]


def join_streamed(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Lay consecutive streamed results (``attach_partial``, then possibly a final one)
    end to end: their ``activations`` (``join_rows``) and ``sae_features``
    (``join_features``); the other fields from the last. A field the last one has as
    ``None`` (the request failed) stays ``None``: nothing partial is returned."""
    joined = dict(parts[-1])
    for name, join in (("activations", join_rows), ("sae_features", join_features)):
        found = [part[name] for part in parts if part.get(name) is not None]
        failed = name in parts[-1] and parts[-1][name] is None
        if found and not failed:
            joined[name] = join(found)
    return joined


def discard_unread(rank_results: Sequence[FetchAnswer] | None) -> None:
    """Delete the handoff files of ``lens_fetch`` answers that will not be (or were not all)
    received: a cancelled request, or an attach that failed part-way. Received ones are gone
    already, so calling this after a successful attach costs a few failed unlinks."""
    for result in rank_results or ():
        handoff.discard_fetched(result)


def merge_hook_results(
    stages: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, Any] | None, HookError | None]:
    """Merge one request's hook results from its pipeline stages (each reported by its TP rank
    0, so nothing is duplicated): per hook, the ``saved`` dicts are united, and dict values
    (e.g. per-layer entries) are united one level down. Returns (results, first error)."""
    merged: dict[str, dict[str, Any]] = {}
    error = None
    for stage in stages:
        if stage.get("error") and error is None:
            error = HookError(stage["error"]["message"], stage["error"]["traceback"])
        for index, saved in stage.get("results", {}).items():
            into = merged.setdefault(index, {})
            for name, value in saved.items():
                if isinstance(value, dict) and isinstance(into.get(name), dict):
                    into[name] = {**into[name], **value}
                else:
                    into[name] = value
    if error is not None:
        return None, error
    return merged, None


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


class LensSession:
    """Per-engine front-end state: model facts, in-flight lens requests, collation."""

    def __init__(self) -> None:
        self.facts: ModelFacts | None = None
        self.in_flight: dict[str, LensRequest] = {}
        """External request id -> its lens request, until it finishes or is aborted (changed
        only by ``prepare`` and ``forget``, which keep ``_sinks`` in step)."""
        self._sinks: collections.Counter[SinkSpec] = collections.Counter()
        """The examples the requests in flight write: a call of thousands of requests checks
        each against them in constant time, not against every request in flight."""
        self.parsed_by_params: dict[int, tuple[Mapping[str, Any], LensRequest]] = {}
        """During one ``LLM.generate`` call: ``id(SamplingParams)`` -> (its ``extra_args``, the
        lens request parsed from them), so each request's values are parsed once."""
        self.persistent_trusted = False
        """Some registered persistent hook was pickled, i.e. registered by a trusted caller
        (their results may come back pickled)."""
        self.presets: dict[str, tuple[SteerSpec, ...]] = {}
        """Named steering presets (``frontend.presets``), validated against the model."""
        self.preset_info: dict[str, dict[str, Any]] = {}
        """What ``steering_presets`` lists for each preset (computed at registration)."""
        self.model_names: tuple[str, ...] = ()
        """The served model's path or name and served names (set by the engine methods)."""
        self.describe_sae: Any = None
        """``(sae, hook_point) -> description``: loads an SAE on the workers (``spec.saes``);
        set for offline engines (an ``AsyncLLM`` describes each request's SAEs first and
        passes its own to ``prepare``)."""
        self.sae_names: dict[str, tuple[str, str | None, dict[str, Any]]] = {}
        """Registered SAEs (``frontend.sae_names``): name -> (directory, hook point, the
        workers' description)."""

    @staticmethod
    def of(engine: object) -> LensSession:
        session = engine.__dict__.get(_SESSION_ATTR)
        if session is None:
            session = LensSession()
            setattr(engine, _SESSION_ATTR, session)
        return session

    def needs_facts(self, params: object) -> bool:
        return (
            self.facts is None
            and isinstance(params, SamplingParams)
            and has_lens_keys(params.extra_args)
        )

    def prepare(self, params: Any, request_id: str, prompt: Any = None,
                parsed: tuple[Mapping[str, Any], LensRequest] | None = None,
                saes: Any = None) -> tuple[Any, LensRequest | None]:
        """Validate ``params``' lens keys; return (params for the engine, lens request or None).

        A capture is admitted only if what it can hold fits ``VLLM_LENS_MAX_CAPTURE_BYTES``
        (``prompt``, the engine's input, gives the prompt length where it is tokenized).
        ``parsed``: (``vllm_xargs``, the ``LensRequest`` parsed from them) when the server
        validated this request already; it is reused if the values are the same. ``saes``:
        the describe for the SAEs it names, instead of ``describe_sae``.

        The caller's object is never mutated: a request with lens keys gets a clone whose
        ``extra_args`` carry the validated payload instead of the user's keys.

        vLLM accepts duplicate request ids, but outputs name only that id: while a lens
        request runs, no other request may reuse its id, or its results could be attached to
        the wrong output.
        """
        if request_id in self.in_flight:
            raise LensRequestError("request_id", f"{request_id!r} is already used by a running "
                                   "vllm-lens request; request ids must be unique while it runs")
        if not isinstance(params, SamplingParams) or not params.extra_args:
            return params, None
        reused = None if parsed is None else reuse_parsed(params.extra_args, *parsed)
        if reused is not None:
            rest, lens = reused
        else:
            rest, lens = parse_extra_args(params.extra_args, self._facts, request_id=request_id,
                                          presets=self.presets,
                                          saes=saes if saes is not None else self.describe_sae)
        if lens is None:
            return params, None
        self.check_beside(lens, params.n, request_id)
        facts = self._facts()
        check_admission(lens, facts, prompt_length(prompt), params.max_tokens, params.n,
                        request_id)
        if lens.captures or lens.saes:
            lens = dataclasses.replace(lens, reserve_bytes=capture_reservation(
                lens, facts, prompt_length(prompt), params.max_tokens))
        engine_params = params.clone()
        engine_params.extra_args = {**rest, PAYLOAD_KEY: lens.to_payload()}
        if lens.hooks or any(c.wants_prompt_rows()
                             for c in (*lens.captures, *lens.sae_captures)):
            # Prompt tokens served from the prefix cache never run through the layers.
            engine_params.skip_reading_prefix_cache = True
        self.in_flight[request_id] = lens
        if lens.sink is not None:
            self._sinks[lens.sink] += 1
        return engine_params, lens

    def check_beside(self, lens: LensRequest, n: int, request_id: str | None = None,
                     added: Container[SinkSpec] = ()) -> None:
        """Refuse what ``lens`` cannot do with ``n`` samples, or beside the running requests
        and those of the same call added before it (``added``: their sinks, best a set):
        every sample streams, is gated or writes one example of its own, and no two requests
        write one key.

        Raises:
            LensRequestError: naming the field.
        """
        if lens.stream and n != 1:
            raise LensRequestError(STREAM_KEY, f"streams the rows of one sample; n={n} is not "
                                   "supported with it (send n requests)", request_id=request_id)
        if lens.sink is not None and (lens.sink in added or lens.sink in self._sinks):
            raise LensRequestError(
                f"{SINK_KEY}.key", f"{lens.sink.key!r} of dataset {lens.sink.dataset!r} is "
                "already being written by a running request or an earlier request of this "
                "call (several prompts with one capture_sink? give each its own key)",
                request_id=request_id)
        if n != 1 and any(s.condition is not None and s.phase != "decode" for s in lens.steer):
            raise LensRequestError(STEER_KEY, f"conditional steering reports a gate for every "
                                   f"steered prompt position, which n={n} samples compute once "
                                   "between them; send n requests, or use phase='decode'",
                                   request_id=request_id)
        if lens.sink is not None and n != 1:
            raise LensRequestError(SINK_KEY, f"writes one example per request; n={n} samples "
                                   "would need one key each (send n requests)",
                                   request_id=request_id)

    def _facts(self) -> ModelFacts:
        assert self.facts is not None, "call the engine's lens_describe before prepare()"
        return self.facts

    @staticmethod
    def fetch_rpc_args(requests: list[tuple[str, dict[str, int]]]) -> tuple[Any, ...]:
        """``collective_rpc`` args of ``lens_fetch`` for these ``fetch_args`` results."""
        return (requests, handoff.host_id() if envs.shm_handoff() else None)

    def fetch_args(
        self, lens: LensRequest, n_prompt: int, generated: Mapping[int, int], n: int,
        tokens: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> tuple[Any, ...]:
        """Fetch arguments for one finished request (see ``LensWorkerExtension.lens_fetch``).

        ``generated`` maps completion index -> tokens generated; a request sampled once runs
        under one engine id, ``n > 1`` children under ids prefixed ``"{index}_"``. ``tokens``
        (prompt and generated token ids) travel along for a request writing to a sink.
        """
        if n == 1:
            valid = {"": n_prompt + generated.get(0, 0) - 1}
            if lens.sink is not None:
                prompt_ids, generated_ids = tokens or ((), ())
                return lens.key, valid, {"prompt_token_ids": [int(t) for t in prompt_ids],
                                         "token_ids": [int(t) for t in generated_ids]}
            return lens.key, valid
        return lens.key, {f"{i}_": n_prompt + generated.get(i, 0) - 1 for i in range(n)}

    def attach(
        self,
        output: RequestOutput,
        lens: LensRequest,
        rank_results: Sequence[FetchAnswer],
        n: int,
    ) -> dict[int, dict[str, Any]]:
        """Attach ``activations`` / ``hook_results`` / ``hook_error`` / ``lens_error`` to
        ``output`` (n == 1) and to each of its completions.

        ``lens_error`` is a ``LensExecutionError`` when some worker failed the completion's
        lens work (then ``activations`` and ``hook_results`` are ``None``: nothing partial is
        returned), else ``None``.

        Returns what was attached for all ``n`` completions, by index: a streamed (DELTA)
        final output holds only the completions that changed in its step, not all of them.
        """
        captures: dict[str, dict[str, list[tuple[dict[str, Any], torch.Tensor]]]] = {}
        hooks: dict[str, list[dict[str, Any]]] = {}
        errors: dict[str, str] = {}
        conflicts: set[str] = set()
        """Requests whose example the sink refused as conflicting with its dataset."""
        capacity: dict[str, str] = {}
        """Requests a worker's full budget refused -> the setting that sizes it."""
        seen: dict[str, set[str]] = {}
        held: set[str] = set()
        receipts: dict[str, list[dict[str, Any]]] = {}
        """Per request, the sink's receipts: one per pipeline stage that wrote a part."""
        gates: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        trusted = any(h.pickled is not None for h in lens.hooks)
        for result in rank_results:
            for req_id, part in result.requests.get(lens.key, {}).items():
                if part.error is not None and req_id not in errors:
                    errors[req_id] = part.error
                    if part.conflict:  # (only when this is the error reported)
                        conflicts.add(req_id)
                    if part.capacity:
                        capacity[req_id] = part.capacity
                seen.setdefault(req_id, set()).update(part.seen)
                if part.held:
                    held.add(req_id)
                if part.receipt is not None:
                    receipts.setdefault(req_id, []).append(part.receipt)
                for signal, sent in part.captures.items():
                    captures.setdefault(req_id, {}).setdefault(signal, []).append(
                        handoff.receive(sent))
                if part.hooks is not None:
                    hooks.setdefault(req_id, []).append(decode_results(part.hooks, trusted))
                if part.gates is not None:
                    gates[req_id] = {int(i): g for i, g in wire.loads(part.gates).items()}
        gated = any(s.condition is not None for s in lens.steer)
        by_index: dict[int, dict[str, Any]] = {}
        for index in range(n):
            prefix = "" if n == 1 else f"{index}_"
            found: dict[str, Any] = {"lens_error": None}
            failed = next((k for k in errors if k.startswith(prefix) or not k), None)
            error = None if failed is None else errors[failed]
            if error is None and not _ended_early(output, index):
                if not any(k.startswith(prefix) for k in held):
                    error = ("vllm-lens lost this request's lens state: no worker held it at "
                             "fetch time (its steering, hooks or rows cannot be vouched for; "
                             "dropped after VLLM_LENS_FINISHED_TTL_S?)")
                elif lens.sink is not None:
                    if not any(k.startswith(prefix) for k in receipts):
                        error = ("vllm-lens wrote nothing to the sink: no position was "
                                 "selected" if any(seen.values()) else
                                 "vllm-lens lost this request's captured rows before they "
                                 "reached the sink: no worker held them at fetch time")
                    else:
                        error = unwritten(lens, next(
                            v for k, v in receipts.items() if k.startswith(prefix)))
                else:
                    mine = next((v for k, v in captures.items() if k.startswith(prefix)), {})
                    signals_seen = set().union(
                        *(v for k, v in seen.items() if k.startswith(prefix)))
                    tp = self.facts.tp_size if self.facts is not None else 1
                    error = next(filter(None, (
                        _missing_rows(c.layers, mine.get(c.signal), c.signal in signals_seen,
                                      tp if c.signal in SHARDED else 1)
                        for c in (*lens.captures, *lens.sae_captures))), None)
            if error is not None:
                if failed in capacity:
                    found["lens_error"] = WorkerCapacityError(
                        error, setting=capacity[failed], request_id=output.request_id)
                else:
                    kind = SinkConflictError if failed in conflicts else LensExecutionError
                    found["lens_error"] = kind(error, request_id=output.request_id)
                if lens.sink is not None:
                    found["capture_receipt"] = None
                elif lens.captures:
                    found["activations"] = None
                if lens.saes:
                    found["sae_features"] = None
                if lens.hooks:
                    found["hook_results"], found["hook_error"] = None, None
                if gated:
                    found["steering_gates"] = None
                by_index[index] = found
                continue
            if lens.sink is not None:
                found["capture_receipt"] = join_receipts(next(
                    v for k, v in receipts.items() if k.startswith(prefix)))
            elif lens.captures:
                mine = next((v for k, v in captures.items() if k.startswith(prefix)), {})
                found["activations"] = self._activations(lens, mine)
            if lens.saes:  # (a sink's receipt stands for them too)
                mine = next((v for k, v in captures.items() if k.startswith(prefix)), {})
                found["sae_features"] = None if lens.sink is not None else sae_features(
                    lens, mine)
            if lens.hooks:
                stages = next((v for k, v in hooks.items() if k.startswith(prefix)), [])
                found["hook_results"], found["hook_error"] = merge_hook_results(stages)
            if gated:
                found["steering_gates"] = next(
                    (v for k, v in gates.items() if k.startswith(prefix)), {})
            by_index[index] = found
        for completion in output.outputs:
            for name, value in by_index[completion.index].items():
                setattr(completion, name, value)
        if n == 1:
            for name, value in by_index[0].items():
                setattr(output, name, value)
        return by_index

    def attach_partial(self, output: RequestOutput, lens: LensRequest,
                       rank_results: Sequence[FetchAnswer]) -> dict[str, Any]:
        """Attach the rows of a streamed request (n == 1) that ``lens_fetch_partial``
        returned to ``output`` and its completion: as ``activations`` the rows computed since
        the previous output, every captured signal present (with no rows if none are new),
        and as ``sae_features`` the features of those positions. Returns what it attached.

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
            attached["activations"] = self._activations(lens, parts)
        if lens.saes:
            attached["sae_features"] = sae_features(lens, parts)
        for target in (output, *output.outputs):
            for name, value in attached.items():
                setattr(target, name, value)
        return attached

    @staticmethod
    def fail_output(output: RequestOutput, lens: LensRequest, exc: BaseException) -> None:
        """Mark every completion of ``output`` failed (its results could not be collated)."""
        error = LensExecutionError(f"vllm-lens failed at collation: {type(exc).__name__}: "
                                   f"{exc}", request_id=output.request_id)
        fields = {"lens_error": error}
        if lens.captures:
            fields["activations"] = None
        if lens.saes:
            fields["sae_features"] = None
        if lens.hooks:
            fields["hook_results"] = fields["hook_error"] = None
        if any(s.condition is not None for s in lens.steer):
            fields["steering_gates"] = None
        for target in (output, *output.outputs):
            for name, value in fields.items():
                setattr(target, name, value)

    def _activations(self, lens: LensRequest,
                     parts: Mapping[str, list[tuple[dict[str, Any], torch.Tensor]]]
                     ) -> dict[str, Any]:
        """One completion's ``activations``: ``residual_stream`` and ``positions`` for
        ``output_residual_stream``; ``<point>`` and ``<point>_positions`` per tap point;
        ``attn_q``, ``attn_k``, ``qk_layers`` and ``qk_meta`` for ``output_qk``;
        ``router_experts`` beside unreduced ``router_logits``.
        ``positions`` is always there: without a residual-stream capture, the first
        signal's."""
        acts: dict[str, Any] = {}
        for spec in lens.captures:
            found = parts.get(spec.signal)
            tensor, positions = (merge_rank_payloads(found, self._facts().n_kv_heads)
                                 if found is not None else self._empty(spec))
            if spec.signal == RESIDUAL_SIGNAL:
                acts[RESIDUAL_SIGNAL], acts["positions"] = tensor, positions
            else:
                acts[spec.signal], acts[f"{spec.signal}_positions"] = tensor, positions
                acts.setdefault("positions", positions)
                if spec.signal == "router_logits" and spec.reduce is None:
                    acts["router_experts"] = chosen_experts(tensor, self._facts().moe_top_k)
        if layers := lens.qk_layers:
            meta = self._facts().qk_meta
            acts["qk_layers"] = list(layers)
            acts["qk_meta"] = [dict(meta[layer]) if layer < len(meta) else {}
                               for layer in layers]
        return acts

    def _empty(self, spec: CaptureSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """A signal no position of which was selected."""
        facts = self._facts()
        dtype = getattr(torch, facts.dtype)
        row = facts.row_shape(spec.signal)
        n_layers = len(spec.layers)
        if spec.reduce is not None:  # a reduction over no position: NaN rows
            tensor = torch.full((n_layers, *row), float("nan"), dtype=dtype)
        else:
            tensor = torch.empty((n_layers, 0, *row), dtype=dtype)
        return tensor, torch.empty(0, dtype=torch.int64)

    def forget(self, request_ids: Sequence[str]) -> list[str]:
        """Stop tracking finished or aborted requests; returns their lens keys (whose worker
        buffers an aborted request should release)."""
        keys = []
        for rid in request_ids:
            lens = self.in_flight.pop(rid, None)
            if lens is None:
                continue
            keys.append(lens.key)
            if lens.sink is not None:
                self._sinks[lens.sink] -= 1
                if not self._sinks[lens.sink]:
                    del self._sinks[lens.sink]
        return keys
