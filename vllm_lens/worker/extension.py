"""The worker extension: the only worker entry points the front end calls (runs in: worker).

vLLM mixes this class into its worker class (``worker_extension_cls``) and the front end
reaches every TP/PP rank through ``collective_rpc("lens_...")``. All names carry the ``lens_``
prefix so they can never collide with the worker's own attributes (vLLM asserts this).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_lens.common import faults, handoff, wire
from vllm_lens.common.messages import (
    DescribeAnswer,
    FetchAnswer,
    FetchPart,
    FlushAnswer,
    HookResultsAnswer,
    ParamsAnswer,
    SaeAnswer,
    SaeSliceAnswer,
    StatsAnswer,
)
from vllm_lens.errors import CapacityError, DatasetConflictError
from vllm_lens.common.points import DLA_PREFIX, SAE_PREFIX, SHARDED, base_signal
from vllm_lens.spec import HookSpec
from vllm_lens.spec.logit_attribution import LOGIT_SIGNAL
from vllm_lens.worker.attribution import attribute_rows, component_rows
from vllm_lens.worker.capture_store import Entry
from vllm_lens.worker.readout import Readout
from vllm_lens.worker.capture import assemble
from vllm_lens.worker.describe import check_blocker, describe_rank
from vllm_lens.worker.hooks import encode_results
from vllm_lens.worker.layout_check import LayoutCheck, check_layout
from vllm_lens.worker.readout import build_readout
from vllm_lens.worker.request_records import describe
from vllm_lens.worker.runner import unsupported_reason
from vllm_lens.saes.model import WHOLE_CLAMP
from vllm_lens.worker import sink_writes
from vllm_lens.worker.tap_handler import LensRuntime
from vllm_lens.worker.monitors import pack_scores
from vllm_lens.worker.steer import pack_gates
from vllm_lens.worker.taps import set_tap_handler, tap_info

__all__ = ["LensWorkerExtension"]

logger = logging.getLogger(__name__)

_runtime: LensRuntime | None = None
_check: LayoutCheck | None = None
"""The layout check of the model ``_runtime`` serves (run when ``_runtime`` was made)."""


def _ranks() -> tuple[int, int, int]:
    from vllm.distributed import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
            get_pp_group().rank_in_group)


def _last_stage() -> bool:
    from vllm.distributed import get_pp_group

    return get_pp_group().is_last_rank


class LensWorkerExtension:
    """RPC surface of vllm-lens on each worker (mixed into vLLM's worker class).

    Every method answers with a record of ``common.messages`` (or ``None``).
    """

    def lens_describe(self) -> DescribeAnswer:
        """Check this engine's configuration, attach the tap handler (once, when supported)
        and report what this rank's model looks like (``unsupported``: why lens requests
        are refused here, or ``None``).

        Never raises: whatever cannot be inspected is reported as ``unsupported`` so that the
        front end refuses lens requests with the reason.
        """
        try:
            return _describe(self)
        except Exception as exc:  # e.g. a runner without the attributes read here
            return DescribeAnswer.refused(f"vllm-lens cannot inspect this worker ({exc!r})")

    def lens_fetch(
        self, requests: list[tuple[Any, ...]], front_end_host: str | None = None
    ) -> FetchAnswer:
        """Pop what this rank holds for finished requests.

        Args:
            requests: ``(lens key, {request id prefix: valid positions})`` per finished request;
                positions at or past the valid count come from surplus steps and are dropped.
                The prefix is ``""`` for ``n == 1`` and ``"{index}_"`` for sampled children.
                A request writing to a capture sink has a third item, ``{"prompt_token_ids",
                "token_ids"}``, stored with its rows.
            front_end_host: the caller's ``handoff.host_id()``; on the same host large payloads
                are handed over through shared memory instead of the RPC result. ``None``
                (another host, or hand-off turned off) sends everything inline.

        Returns:
            A ``FetchAnswer``, one ``FetchPart`` per engine request: each capture handoff
            carries ``{"layers", "positions", "signal"}`` and the signal's tensor
            (``handoff.receive``), trimmed and reduced here so that rows nobody asked for never
            leave the worker; ``hooks`` holds ``hooks.encode_results`` (TP rank 0 of each
            stage only: the other TP ranks ran the same hooks on the same rows); ``error`` says
            why this rank failed the request; ``held`` is set by every rank that still held
            the request's record, ``seen`` (the signals) by those of them that capture some of
            its layers. A request writing to a capture sink gets ``receipt`` (the sink's) from
            the rank that wrote its rows (from each pipeline stage that wrote its part), in
            place of ``captures``. A failure while fetching one request fails that request only.
        """
        if _runtime is None:
            return FetchAnswer(requests={})
        fetched = {key for key, *_ in requests}
        records = _runtime.requests.records

        def sink_dataset(key: str, req_id: str) -> tuple[str, str] | None:
            record = records.get(req_id) if key in fetched else None
            sink = None if record is None else record.lens.sink
            return None if sink is None else (sink.sink, sink.dataset)

        try:
            # Finishes the asynchronous device->host copies; the rows of requests fetched
            # now for a sink may stay views of their staging tensor (``CaptureStore``).
            _runtime.settle(wait=True, destination=sink_dataset)
        except Exception as exc:  # fail the requests this rank holds, nobody else's
            problem = FetchPart.failed(f"vllm-lens failed at fetch: {describe(exc)}")
            failed: dict[str, dict[str, FetchPart]] = {}
            for key, *_ in requests:
                _runtime.store.pop(key)
                held = _runtime.pop_records(key)
                if held:
                    failed[key] = {req_id: problem for req_id in held}
            return FetchAnswer(requests=failed)
        out: dict[str, dict[str, FetchPart]] = {}
        for key, valid_lens, *tokens in requests:
            found: dict[str, dict[str, Any]] = {}
            try:
                _fetch_one(_runtime, key, valid_lens, front_end_host, found,
                           tokens[0] if tokens else None)
            except Exception as exc:
                for fields in found.values():
                    for sent in fields["captures"].values():
                        handoff.discard(sent)
                stage, cause = (("handoff", exc.__cause__) if isinstance(exc, _HandoffFailed)
                                else ("fetch", exc))
                error = FetchPart.failed(f"vllm-lens failed at {stage}: {cause!r}")
                out[key] = {req_id: error for req_id in found} or {"": error}
                continue
            if found:
                out[key] = {req_id: FetchPart(**fields) for req_id, fields in found.items()}
        return FetchAnswer(requests=out)

    def lens_fetch_partial(
        self, requests: list[tuple[str, dict[str, int]]], front_end_host: str | None = None
    ) -> FetchAnswer:
        """The rows of running streamed requests (``stream_activations``) computed so far.

        Args:
            requests: ``(lens key, {request id prefix: positions})``: rows at positions below
                that are taken (each position once; later ones stay for the next call).

        Returns:
            A ``FetchAnswer`` as ``lens_fetch``'s with only ``captures`` (``FetchPart.rows``),
            or ``error`` for a request this rank failed; a request with no new rows is left
            out.
        """
        if _runtime is None:
            return FetchAnswer(requests={})
        out: dict[str, dict[str, FetchPart]] = {}
        try:
            _runtime.settle(wait=True)
        except Exception as exc:  # noqa: BLE001 - the final fetch reports the failure
            logger.warning("vllm-lens: settling rows for a streamed fetch failed: %r", exc)
            return FetchAnswer(requests=out)
        errors: dict[str, dict[str, str]] = {}
        for req_id, record in _runtime.requests.records.items():
            if record.error is not None:
                errors.setdefault(record.lens.key, {})[req_id] = record.error
        below_by_key = dict(requests)
        try:
            taken = _runtime.store.take(below_by_key)
        except Exception as exc:  # noqa: BLE001 - these requests fail, not the engine
            problem = FetchPart.failed(f"vllm-lens failed at stream: {describe(exc)}")
            return FetchAnswer(requests={key: {"": problem} for key in below_by_key})
        for key, below in below_by_key.items():
            found: dict[str, FetchPart] = {
                req_id: FetchPart.failed(error) for req_id, error in errors.get(key, {}).items()}
            rows: dict[str, dict[str, Any]] = {}
            try:
                for req_id, by_signal in taken.get(key, {}).items():
                    if req_id in found:
                        continue
                    upto = next(n for p, n in below.items() if req_id.startswith(p))
                    for signal, entry in by_signal.items():
                        capture = assemble(entry, upto)
                        capture["tp_rank"] = _runtime.tp_rank
                        tensor = capture.pop("tensor")
                        sent = handoff.send(capture, tensor, front_end_host)
                        rows.setdefault(req_id, {})[signal] = sent
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                for captures in rows.values():
                    for sent in captures.values():
                        handoff.discard(sent)
                rows = {}
                found = {"": FetchPart.failed(f"vllm-lens failed at stream: {describe(exc)}")}
            found.update((req_id, FetchPart.rows(captures)) for req_id, captures in rows.items())
            if found:
                out[key] = found
        return FetchAnswer(requests=out)

    def lens_flush_sinks(self) -> FlushAnswer:
        """Make every example written to a capture sink so far durable; answers what failed
        (TP rank 0 writes; the other ranks answer with nothing)."""
        return FlushAnswer(problems=sink_writes.flush_all())

    def lens_release(self, keys: list[str]) -> None:
        """Drop the buffers of requests that will never be fetched (aborted, failed)."""
        if _runtime is not None:
            for key in keys:
                _runtime.store.pop(key)
                _runtime.pop_records(key)

    def lens_load_sae(self, path: str, hook_point: str | None = None,
                      clamp: bool = False) -> SaeAnswer:
        """Load the SAE in directory ``path`` on this rank, if it captures the SAE's layer
        (once: a loaded one is shared), and describe it (``spec.saes``; never the weights);
        ``error`` if it cannot be read or kept. ``clamp``: a request clamps its
        features, so a TopK SAE is kept by every TP rank of the stage holding its layer (each
        encodes whole rows with it: ``worker.steer``), or replaces an MLP by it, so a
        transcoder is (``worker.replacement``)."""
        if _runtime is None:
            return SaeAnswer(description=None,
                             error="this worker serves no lens requests (unsupported engine)")
        runtime = _runtime

        def wanted(info: dict[str, Any]) -> bool:
            if info["layer"] in runtime.capture_layers:
                return True
            return (clamp and (info["architecture"] in WHOLE_CLAMP
                               or info.get("out_point") is not None)
                    and info["layer"] in runtime.shard_layers)

        held = {runtime.saes.key(*key) for key in runtime.requests.held_saes()}
        device = next(runtime.runner.get_model().parameters()).device
        try:
            return SaeAnswer(description=runtime.saes.describe(
                path, hook_point, device, held, wanted=wanted,
                dtype=runtime.runner.model_config.dtype, pin=clamp), error=None)
        except (ValueError, OSError) as exc:
            return SaeAnswer(description=None, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - e.g. out of device memory: refuse, serve on
            return SaeAnswer(description=None,
                             error=f"it could not be loaded on this worker: {describe(exc)}")

    def lens_sae_slice(self, path: str, hook_point: str | None,
                       features: list[int]) -> SaeSliceAnswer:
        """``wire`` bytes of some features of an SAE this rank keeps (``lens_load_sae``
        first), for steering by feature: their decoder rows ``W_dec`` and encoder columns
        (``W_enc``, ``b_enc``, ``threshold``), its ``b_dec`` and ``apply_b_dec_to_input``;
        ``data`` is ``None`` where it is not kept here; ``error`` for a feature it lacks."""
        import torch

        absent = SaeSliceAnswer(data=None, error=None)
        if _runtime is None:
            return absent
        sae = _runtime.saes.get(path, hook_point)
        if sae is None:
            return absent
        if not all(0 <= f < sae.d_sae for f in features):
            return SaeSliceAnswer(data=None, error=f"features must be 0 to {sae.d_sae - 1}")
        index = torch.as_tensor(features, dtype=torch.long, device=sae.W_dec.device)
        return SaeSliceAnswer(error=None, data=wire.dumps({
            "W_dec": sae.W_dec[index].cpu(), "W_enc": sae.W_enc[:, index].cpu(),
            "b_enc": sae.b_enc[index].cpu(), "b_dec": sae.b_dec.cpu(),
            "threshold": None if sae.threshold is None else sae.threshold[index].cpu(),
            "apply_b_dec_to_input": sae.apply_b_dec_to_input}))

    def lens_stats(self) -> StatsAnswer:
        """What this rank holds for lens requests (for tests and monitoring): captured
        ``entries`` and their host ``bytes``, request ``records`` and the ``device_bytes`` of
        their steering vectors; the SAEs it keeps loaded (``saes``) and their weights'
        ``sae_bytes`` (``VLLM_LENS_SAE_MAX_BYTES``); and the host memory its staging pool
        keeps for the next steps' captures, in use or free (``staging_bytes``)."""
        if _runtime is None:
            return StatsAnswer(entries=0, bytes=0, records=0, device_bytes=0, saes=0,
                               sae_bytes=0, staging_bytes=0)
        _runtime.settle(wait=True)
        return StatsAnswer(
            entries=len(_runtime.store), bytes=_runtime.store.nbytes,
            records=len(_runtime.requests), device_bytes=_runtime.requests.device_bytes,
            saes=len(_runtime.saes), sae_bytes=_runtime.saes.nbytes,
            staging_bytes=_runtime.staging.nbytes)

    # -- persistent hooks ------------------------------------------------------------------------
    def lens_register_hooks(self, payloads: list[dict[str, Any]]) -> None:
        """Run these hooks (``HookSpec`` payloads) on every request from the next step on."""
        _require_runtime().persistent_specs = tuple(HookSpec.from_payload(p) for p in payloads)

    def lens_clear_hooks(self) -> None:
        if _runtime is not None:
            _runtime.persistent_specs = ()

    def lens_collect_hook_results(self) -> HookResultsAnswer:
        """Every kept request's persistent-hook results (non-destructive), TP rank 0 only."""
        if _runtime is None or _runtime.tp_rank != 0:
            return HookResultsAnswer(results={})
        return HookResultsAnswer(results={
            req_id: encode_results(state)
            for req_id, state in _runtime.persistent_results.items()})

    def lens_clear_hook_results(self) -> None:
        if _runtime is not None:
            _runtime.persistent_results.clear()

    def lens_prefetch_params(self, names: list[str]) -> ParamsAnswer:
        """Full parameters this stage owns (every TP rank joins the gather; rank 0 returns)."""
        runtime = _require_runtime()
        found = {name: runtime.params.local(name) for name in names}
        if runtime.tp_rank != 0:
            return ParamsAnswer(params={})
        return ParamsAnswer(params={name: wire.dumps(t.to("cpu"))
                                    for name, t in found.items() if t is not None})

    def lens_set_prefetched(self, blobs: dict[str, bytes]) -> None:
        """Make parameters fetched from other stages available to ``ctx.get_parameter``."""
        params = _require_runtime().params
        device = next(params.model.parameters()).device
        params.prefetched = {name: wire.loads(b).to(device) for name, b in blobs.items()}

    def lens_clear_prefetched(self) -> None:
        if _runtime is not None:
            _runtime.params.prefetched = {}


def _require_runtime() -> LensRuntime:
    if _runtime is None:
        raise RuntimeError("vllm-lens: lens_describe has not run on this worker (or the model's "
                           "layers could not be mapped)")
    return _runtime


class _HandoffFailed(Exception):
    """Packaging a capture for the front end raised (the cause is chained)."""


def _fields(**given: Any) -> dict[str, Any]:
    """The keyword arguments of one ``FetchPart`` being filled in (``FetchPart(**fields)``)."""
    return {"error": None, "conflict": False, "capacity": None, "held": False, "seen": [],
            "captures": {}, "hooks": None, "gates": None, "monitors": None, "receipt": None,
            **given}


def _fetch_one(runtime: LensRuntime, key: str, valid_lens: dict[str, int],
               front_end_host: str | None, out: dict[str, dict[str, Any]],
               tokens: dict[str, list[int]] | None = None) -> None:
    """Fill ``out`` (request id -> ``FetchPart`` fields) with what this rank holds for lens
    key ``key``."""
    records = runtime.pop_records(key)
    entries = runtime.store.pop(key)
    for req_id, record in records.items():
        faults.check(record.lens.fault, "fetch")
        if record.error is not None or record.refused is not None:
            out[req_id] = _fields(error=record.error or record.refused, capacity=(
                record.capacity if record.error is None else None))
            continue
        part = out[req_id] = _fields(held=True)  # its lens work ran here (steering, hooks)
        if runtime.tp_rank == 0 and record.hooks is not None:
            part["hooks"] = encode_results(record.hooks)
        if runtime.tp_rank == 0 and record.gates:
            valid = next((n for p, n in valid_lens.items() if req_id.startswith(p)), None)
            part["gates"] = pack_gates(record.gates, valid)
        if runtime.tp_rank == 0 and record.monitors is not None:
            valid = next((n for p, n in valid_lens.items() if req_id.startswith(p)), None)
            part["monitors"] = pack_scores(record.monitors, valid)
        # The signals whose rows this rank kept (if any position was selected): a front end
        # that hears from no such rank knows rows were lost, not merely unselected.
        part["seen"] = [c.signal for c in (*record.lens.captures, *record.lens.sae_captures)
                        if (runtime.shard_layers if base_signal(c.signal) in SHARDED
                            else runtime.capture_layers).intersection(c.layers)]
    for req_id, by_signal in entries.items():
        if req_id in out and out[req_id]["error"] is not None:
            continue
        valid = next((n for p, n in valid_lens.items() if req_id.startswith(p)), None)
        if valid is None:
            continue
        record = records.get(req_id)
        if record is not None and record.lens.sink is not None:
            _write_to_sink(runtime, record, by_signal, valid, tokens or {}, out)
            continue
        if record is not None and record.lens.logit_attribution is not None:
            by_signal = _with_logit_attribution(runtime, record, by_signal, valid, tokens)
        elif record is None:  # (its lens state is gone: the front end fails it) kept rows
            by_signal = {s: e for s, e in by_signal.items() if not s.startswith(DLA_PREFIX)}
        for signal, entry in by_signal.items():
            if not isinstance(entry, Entry):  # computed here already
                capture, tensor = entry
                _send(runtime, record, req_id, signal, capture, tensor, front_end_host, out)
                continue
            if not entry.chunks:
                continue  # every row was streamed already (``lens_fetch_partial``)
            capture = assemble(entry, valid)
            capture["tp_rank"] = runtime.tp_rank
            tensor = capture.pop("tensor")
            spec = _attributed(record, signal)
            if spec is not None:
                tensor = _attribute(runtime, spec, tensor, capture["positions"], tokens)
            _send(runtime, record, req_id, signal, capture, tensor, front_end_host, out)


def _send(runtime: LensRuntime, record: Any, req_id: str, signal: str, capture: dict,
          tensor: Any, front_end_host: str | None, out: dict[str, dict[str, Any]]) -> None:
    """Hand one signal's rows to the front end (``handoff.send``)."""
    try:
        if record is not None:
            faults.check(record.lens.fault, "handoff")
        sent = handoff.send(capture, tensor, front_end_host)
    except Exception as exc:
        raise _HandoffFailed() from exc
    out.setdefault(req_id, _fields())["captures"][signal] = sent


def _with_logit_attribution(runtime: LensRuntime, record: Any, by_signal: dict[str, Any],
                            valid: int, tokens: dict[str, list[int]] | None) -> dict[str, Any]:
    """``by_signal`` with the rows kept for a logit attribution (``dla:<point>``) replaced by
    the attributions computed from them (``LOGIT_SIGNAL``: ``(capture, tensor)``)."""
    kept = {signal[len(DLA_PREFIX):]: assemble(entry, valid)
            for signal, entry in by_signal.items() if signal.startswith(DLA_PREFIX)}
    rest = {s: e for s, e in by_signal.items() if not s.startswith(DLA_PREFIX)}
    if not kept:
        return rest
    if not isinstance(runtime.readout, Readout):
        raise ValueError(f"no readout for attribution on this worker: {runtime.readout}")
    spec = record.lens.logit_attribution
    rows, positions = component_rows(kept, spec, runtime.readout, tokens,
                                     runtime.projection_matrices(spec.layers) if spec.heads
                                     else None)
    rest[LOGIT_SIGNAL] = ({"layers": [0], "positions": positions, "signal": LOGIT_SIGNAL,
                           "tp_rank": runtime.tp_rank}, rows[None])
    return rest


def _attributed(record: Any, signal: str) -> Any:
    """The ``output_sae_features`` entry with ``attribution`` whose rows ``signal`` holds, or
    ``None``."""
    if record is None or not signal.startswith(SAE_PREFIX):
        return None
    return next((s for s in record.lens.saes if s.signal == signal and s.attribution), None)


def _attribute(runtime: LensRuntime, spec: Any, tensor: Any, positions: Any,
               tokens: dict[str, list[int]] | None) -> Any:
    """An attribution entry's rows ``[1, n, width + 1]`` with their attributions
    (``worker.attribution``)."""
    sae = runtime.saes.get(spec.path, spec.hook_point, resolved=True)
    if sae is None:
        raise ValueError(f"SAE {spec.sae!r} was unloaded before its attributions were "
                         "computed; retry the request")
    return attribute_rows(tensor[0], positions, spec, sae, runtime.readout, tokens)[None]


def _write_to_sink(runtime: LensRuntime, record: Any, by_signal: dict[str, Any], valid: int,
                   tokens: dict[str, list[int]], out: dict[str, dict[str, Any]]) -> None:
    """Write one finished request's rows to its capture sink; its ``receipt`` (or ``error``)
    goes back to the front end instead of the rows."""
    try:
        captures = {signal: assemble(entry, valid) for signal, entry in by_signal.items()}
        writer = sink_writes.writer_name(runtime.runner.vllm_config.parallel_config,
                                         _ranks()[2], record.lens.sink.shared)
        receipt = sink_writes.write(record.lens, captures, str(runtime.runner.model_config.model),
                                    tokens.get("prompt_token_ids", ()), tokens.get("token_ids", ()),
                                    local_layers=runtime.capture_layers, writer=writer)
    except Exception as exc:  # noqa: BLE001 - this request fails alone
        out[record.req_id] = _fields(
            error=f"vllm-lens failed at sink: {describe(exc)}",
            conflict=isinstance(exc, DatasetConflictError),
            capacity=exc.setting if isinstance(exc, CapacityError) else None)
        return
    out.setdefault(record.req_id, _fields())["receipt"] = receipt


def _describe(worker: Any) -> DescribeAnswer:
    """``lens_describe`` of ``worker`` (may raise; the RPC turns that into a refusal)."""
    global _runtime, _check
    runner = worker.model_runner
    vllm_config = worker.vllm_config
    reason = unsupported_reason(vllm_config, runner)
    model = runner.get_model()
    info = tap_info(model)
    tp_rank, tp_size, pp_rank = _ranks()
    if (reason is None and info is not None and info.tapped
            and (_runtime is None or _runtime.runner is not runner)):
        # Every TP rank holds the full residual stream; rank 0 alone captures it. Heads and
        # MLP columns are split across the ranks: each captures its part.
        capture_layers = frozenset(info.local_layers) if tp_rank == 0 else frozenset()
        # Every rank runs the check's forward pass together (its collectives need all TP
        # ranks), before the tap handler serves lens requests.
        _check = check_layout(runner, model, info, derived=info.derived,
                              can_run=check_blocker(vllm_config))
        _runtime = LensRuntime(runner, capture_layers=capture_layers, tp_rank=tp_rank,
                               tp_size=tp_size, attention=info.attention,
                               shard_layers=frozenset(info.local_layers), split=info.split)
        _runtime.readout = (
            build_readout(model, info, tp_size=tp_size, last_stage=_last_stage())
            if "final norm" in _check.passed else
            "the layout check did not prove that the last layer's stream is what the final "
            f"norm reads ('final norm' invariant: {_check.error or 'not passed'})")
        _runtime.projections = _check.projections
        set_tap_handler(_runtime.on_tap)
        _runtime.view.wrap_sample(_runtime.before_sample)
        handoff.sweep()  # files orphaned by front ends that died before reading them
    readout = "this rank serves no lens requests" if _runtime is None else _runtime.readout
    return describe_rank(vllm_config, runner.model_config, model, info, reason,
                         (tp_rank, tp_size, pp_rank), _check,
                         readout if isinstance(readout, str) else None)
