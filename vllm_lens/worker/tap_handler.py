"""The per-process tap handler: builds the step plan, then at each tap site of each layer
(``points.SITES``) steers, runs hooks and captures, in that order, so captures show the steered
and hooked signal (runs in: worker).

One ``LensRuntime`` exists per worker process once the front end has asked for lens features
(``lens_describe``); until then the taps have no handler and cost one Python call each (six
per layer on Llama-style layers, eight where attention and the MLP are tapped apart).

Nothing raised here may leave the tap: the tap runs inside the model's forward pass, and an
exception there would kill the engine. A failure while handling a request fails that request
(its record keeps the message, the front end raises it when the request finishes); a failure
that cannot be pinned on fewer requests fails every lens request of the step. The engine, and
every request without lens keys, carries on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_lens import envs
from vllm_lens.common import faults
from vllm_lens.common.points import (
    ATTENTION_TAP_KEYS,
    SAE_PREFIX,
    hook_site,
    site_of,
    tap_key,
)
from vllm_lens.saes import SAE
from vllm_lens.spec import HookSpec, SteerSpec
from vllm_lens.worker.attention_steering import AttentionSteering
from vllm_lens.worker.attention_taps import AttentionTaps
from vllm_lens.worker.capture import READOUT, capture_layer
from vllm_lens.worker.hooks import HookCall, HookState, ParameterSource, run_hook_calls
from vllm_lens.worker.monitors import MonitorState, StopControl
from vllm_lens.worker.plan import RequestSlice, StepPlan
from vllm_lens.worker import head_projection
from vllm_lens.worker.readout import Readout
from vllm_lens.worker.replacement import (
    PreparedReplacement,
    ReplacementGroup,
    held_transcoder,
    prepare_replacement,
)
from vllm_lens.worker.request_records import RequestRecord, RequestTable, describe
from vllm_lens.worker.runner import RunnerView
from vllm_lens.worker.steer import (
    PreparedSteer,
    SteerGroup,
    apply_steering,
    build_steer_groups,
    phase_boundary,
    prepare,
)
from vllm_lens.worker.saes import SAERegistry
from vllm_lens.worker.staging_pool import StagingPool
from vllm_lens.worker.capture_store import CaptureStore

logger = logging.getLogger(__name__)

__all__ = ["LensRuntime"]

_EMPTY_PLAN = StepPlan(slices=[])


class LensRuntime:
    """Reads the runner's batch (through ``RunnerView``); one plan per forward step, shared by
    all taps."""

    def __init__(self, runner, *, capture_layers: frozenset[int], tp_rank: int,
                 tp_size: int, attention: tuple = (),
                 shard_layers: frozenset[int] | None = None, split: bool = False) -> None:
        self.runner = runner
        self.view = RunnerView(runner)
        self.capture_layers = capture_layers
        """Layers whose rows this rank captures: its stage's layers on TP rank 0, else none."""
        self.shard_layers = capture_layers if shard_layers is None else shard_layers
        """Layers whose part of a sharded signal (``points.SHARDED``) this rank captures: its
        stage's layers on every TP rank."""
        self.tp_rank = tp_rank
        self.split = split
        """The model's layers add to the stream themselves (``points``: split layouts)."""
        self.store = CaptureStore(envs.worker_max_bytes(), envs.finished_ttl_s())
        self.staging = StagingPool(envs.staging_pool_bytes())
        """Host memory for the capture groups' staging tensors, reused between steps."""
        self.requests = RequestTable(envs.finished_ttl_s(), envs.worker_max_bytes())
        self.saes = SAERegistry(envs.sae_max_bytes())
        self.params = ParameterSource(runner.get_model(), tp_size)
        self.persistent_specs: tuple[HookSpec, ...] = ()
        self.persistent_results: OrderedDict[str, HookState] = OrderedDict()
        """Request id -> state of the persistent hooks for it (bounded, oldest dropped)."""
        self._persistent_running: set[str] = set()
        """Requests whose persistent-hook results may still be on the device."""
        self._plan_ctx: object | None = None
        self._plan: StepPlan = _EMPTY_PLAN
        self._steer_layout: tuple[tuple[str, int, int, int | None], ...] = ()
        self._steer_groups: dict[tuple[int, str], SteerGroup] = {}
        self._stops = StopControl(on_failure=tp_rank == 0)
        """The requests ``stop`` monitors end, and those ending because their lens work
        failed (a guardrail fails closed)."""
        self.attention = AttentionTaps(attention, self.on_tap, self.on_attention)
        """Wrappers around the attention kernels, on only for steps that read Q/K, value or
        attn_z, or steer attention."""
        self.attention_steering = AttentionSteering(
            self.attention.meta, tp_rank, self.shard_layers, envs.attention_steer_max_bytes())
        """Attention-steered requests' states and the edit after each kernel."""
        self.readout: Readout | str = "not built"
        """The model's proven linearised readout for attribution (``worker.readout``), or why
        there is none; set when the workers are described."""
        self.projections: dict[int, torch.nn.Module] = {}
        """Layer -> its proven attention output projection (``worker.head_projection``), for
        per-head attribution; set when the workers are described."""
        self._projection_matrices: dict[int, torch.Tensor] = {}

    def projection_matrices(self, layers: Iterable[int]) -> dict[int, torch.Tensor]:
        """``W_O`` (float32) of each of ``layers`` that has a proven projection
        (``head_projection.matrix``): the weight's copy, made for this fetch, or where vLLM's
        CPU build packed the weight away, read back from the module once and kept."""
        found = {}
        for layer in layers:
            module = self.projections.get(layer)
            if module is None:
                continue
            packed = not module.weight.numel()
            if packed and layer in self._projection_matrices:
                found[layer] = self._projection_matrices[layer]
                continue
            found[layer] = head_projection.matrix(module, head_projection.sizes(module)[0])
            if packed:
                self._projection_matrices[layer] = found[layer]
        return found

    # -- tap handler ---------------------------------------------------------------------------
    def on_tap(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: int,
               site: str) -> None:
        try:
            self._tap(hidden, residual, layer, site)
        except Exception as exc:  # not pinned on fewer requests by the stages below
            self._plan = _EMPTY_PLAN  # the rest of the step does no lens work
            try:
                self._fail_step(exc)
            except Exception:  # never into the forward pass
                logger.exception("vllm-lens: cannot fail the step's lens requests")

    def _tap(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: int,
             site: str) -> None:
        """At one site of one layer: steer, then run hooks, then capture (``site`` is a
        ``points.tap_key``: the attention sites only capture)."""
        plan = self._plan_for_step(hidden)
        if plan.empty:
            return
        if plan.faults:
            for s in plan.slices:
                faults.check(s.lens.fault, "step")
        where = (layer, site)
        for group in plan.replace_out.get(where, ()):  # before the site's steering
            # (Whatever else of its requests failed: every rank keeps replacing alike.)
            if group.pending is not None or not group.failed:
                self._replace(group, group.write, hidden, residual)
        steering = plan.steer.get(where)
        if steering is not None:
            self._guarded("steer", steering.req_ids, self._steer, plan, steering, hidden,
                          residual)
        if where in plan.hook_layers:
            self._guarded("hooks", (c.req_id for c in plan.hook_calls), self._run_hooks,
                          plan, layer, site, hidden, residual)
        for group in plan.replace_in.get(where, ()):  # what the MLP reads, steered
            if not group.failed:
                self._replace(group, group.read, hidden, residual)
        for group, index in plan.capture.get(where, ()):
            if not group.failed:
                self._guarded_capture(plan, group, index, hidden, residual, site)
        for s, state in plan.monitors.get(where, ()):
            self._guarded("monitors", (s.req_id,), state.score, where, hidden, residual,
                          s.start, s.end, s.pos0, s.n_prompt, self.tp_rank == 0)

    def on_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     out: torch.Tensor | None, layer: int) -> None:
        """After one layer's attention kernel: the attention-steered requests' rows of its
        output (``worker.attention_steering``)."""
        try:
            steered = self._plan_for_step(query).attention.get(layer)
        except Exception:  # noqa: BLE001 -- on_tap reports a step that cannot be planned
            return
        if not steered:
            return
        records = self.requests.records
        try:
            self.attention_steering.edit(
                steered, layer, query, key, value, out,
                alive=lambda r: r in records and records[r].error is None,
                fail=lambda r, exc: self._fail([r], exc, "steer_attention"))
        except Exception:  # never into the forward pass
            logger.exception("vllm-lens: cannot report an attention-steering failure")

    def _steer(self, plan: StepPlan, group: SteerGroup, hidden: torch.Tensor,
               residual: torch.Tensor | None) -> None:
        """Steer at one site; the gates read here are kept for their requests (TP rank 0
        reports them: every rank computes the same)."""
        apply_steering(group, hidden, residual)
        if self.tp_rank != 0:
            return
        for gate in group.conditions:
            record = self.requests.records.get(gate.req_id)
            s = plan.slice_by_req.get(gate.req_id)
            if record is not None and s is not None:
                record.gates.setdefault(gate.index, []).append((gate.offsets + s.pos0,
                                                                gate.values))

    def _replace(self, group: ReplacementGroup, stage, hidden: torch.Tensor,
                 residual: torch.Tensor | None) -> None:
        """One site of a replaced MLP (``worker.replacement``); if it raises, the group's
        replacements stop and their requests fail (and end: ``_close_guarded``)."""
        try:
            stage(hidden, residual)
        except Exception as exc:
            group.pending = None
            self._lose_replacements([s.req_id for s, _ in group.members], exc)

    def _lose_replacements(self, req_ids: list[str], exc: BaseException) -> None:
        """These requests' replacements did not run in this step: they stop, and the
        requests fail and end (``_close_guarded``)."""
        for req_id in req_ids:
            record = self.requests.records.get(req_id)
            if record is not None:
                record.lose_replacements()
        self._fail(req_ids, exc, "replace_mlp")

    def _guarded(self, stage: str, req_ids: Iterable[str], fn, *args) -> None:
        """``fn(*args)``; if it raises, ``req_ids`` (evaluated only then) fail at ``stage``."""
        try:
            fn(*args)
        except Exception as exc:
            self._fail(req_ids, exc, stage)

    def _guarded_capture(self, plan: StepPlan, group, index: int, hidden: torch.Tensor,
                         residual: torch.Tensor | None, site: str) -> None:
        try:
            if plan.faults:
                for owner in group.owners:
                    faults.check(self._fault_of(owner.req_id), "capture")
            capture_layer(group, index, hidden, residual, self.staging, site=site)
        except Exception as exc:
            group.failed = True  # its staging tensor is incomplete: nothing is filed
            self._fail([o.req_id for o in group.owners], exc, "capture")

    def _fail(self, req_ids: Iterable[str], exc: BaseException | str, stage: str) -> None:
        ids = list(req_ids)
        logger.warning("vllm-lens: %s failed for request(s) %s: %s", stage, ", ".join(ids),
                       describe(exc))
        for req_id in ids:
            record = self.requests.records.get(req_id)
            if record is not None:
                record.fail(exc, stage)
                if record.attention is not None:  # its lens work stops: so does its history
                    record.attention.free()
                self.store.discard(record.lens.key, req_id)  # partial rows are never returned
                if record.monitors is not None:  # its monitors stop: so does their state
                    try:
                        record.monitors.free()
                    except Exception:  # noqa: BLE001 -- its report is not returned anyway
                        logger.exception("vllm-lens: cannot free a failed request's monitors")
                self._close_guarded(record)

    def _close_guarded(self, record: RequestRecord) -> None:
        """A failed request a ``stop`` monitor guards ends from this step on (a guardrail
        fails closed), whether or not its monitors were built; so does one whose MLP
        replacement did not run in some step (its prefix-cache salt promises the
        replacement: it must not go on computing without it). Ending forces the
        end-of-sequence token where the step samples (TP rank 0 of the last stage); with
        ``ignore_eos`` it cannot be ended and runs on, and its error says so."""
        if not any(m.stops for m in record.lens.monitors) and not record.replacement_lost:
            return
        state = record.monitors
        if state is None:
            try:
                eos = self.view.eos_token_id(record.req_id)
            except Exception:  # noqa: BLE001 -- not in the batch: nothing to end
                return
            if eos is None:
                return
            state = MonitorState(specs=record.lens.monitors, eos=eos, stops=True, failed=True)
        self._stops.close(record.req_id, state)

    def settle(self, wait: bool = False,
               destination: Callable[[str, str], Hashable | None] | None = None) -> None:
        """File finished steps' captured rows; fail the requests whose rows could not be
        (``destination``: see ``CaptureStore.settle``)."""
        for key, req_id, problem in self.store.settle(wait=wait, destination=destination):
            self.fail_owned([(key, req_id)], problem, "capture")
        self.staging.trim()

    def fail_owned(self, owners: Iterable[tuple[str, str]], problem: str, stage: str) -> None:
        """Fail the requests behind (lens key, request id) pairs whose rows were lost."""
        records = self.requests.records
        ids = [r for key, r in owners if r in records and records[r].lens.key == key]
        if ids:
            self._fail(ids, problem, stage)

    def _fault_of(self, req_id: str) -> str | None:
        record = self.requests.records.get(req_id)
        return record.lens.fault if record is not None else None

    def _run_hooks(self, plan: StepPlan, layer: int, site: str, hidden: torch.Tensor,
                   residual: torch.Tensor | None) -> None:
        if plan.faults:
            for call in plan.hook_calls:
                faults.check(self._fault_of(call.req_id), "hooks")
        run_hook_calls(plan.hook_calls, layer, site, hidden, residual, self.params.model,
                       self.tp_rank, self.params, self.attention.meta.get(layer),
                       split=self.split)

    # -- fetch ---------------------------------------------------------------------------------
    def pop_records(self, key: str) -> dict[str, RequestRecord]:
        """Remove the records of lens key ``key`` (request id -> record)."""
        return self.requests.pop(key)

    def _hook_states(self, record: RequestRecord | None, req_id: str,
                     device: torch.device) -> tuple[HookState, ...]:
        states = []
        if record is not None and record.lens.hooks:
            if record.hooks is None:
                record.hooks = HookState.build(record.lens.hooks)
            states.append(record.hooks)
        if self.persistent_specs:
            state = self.persistent_results.get(req_id)
            if state is None:
                state = self.persistent_results[req_id] = HookState.build(self.persistent_specs)
                self._persistent_running.add(req_id)
                while len(self.persistent_results) > envs.hook_results_max():
                    self.persistent_results.popitem(last=False)
            states.append(state)
        if record is not None and any(m.hook for m in record.lens.monitors):
            monitors = self._monitor_state(record, device)
            if monitors.hooks is not None:  # they run after its hooks; the monitors read them
                states.append(monitors.hooks)
        return tuple(states)

    # -- per-step plan -------------------------------------------------------------------------
    def _plan_for_step(self, hidden: torch.Tensor) -> StepPlan:
        """The plan of the running step, built on its first tap (vLLM makes a fresh forward
        context object per step, so the object's identity marks the step)."""
        if not is_forward_context_available():
            return _EMPTY_PLAN
        ctx = get_forward_context()
        if ctx is not self._plan_ctx:
            self._plan_ctx = ctx
            self._plan = _EMPTY_PLAN  # what the rest of the step sees if the build fails
            try:
                self._plan = self._build_plan(hidden.device, hidden.dtype)
            except Exception as exc:
                self._fail_step(exc)
            self.attention.enable(
                any(key[1] in ATTENTION_TAP_KEYS for key in self._plan.capture)
                or any(site == "attn" for _, site in self._plan.hook_layers)
                or bool(self._plan.attention),
                values=any(key[1] == "attn_v" for key in self._plan.capture))
        return self._plan

    def _fail_step(self, exc: BaseException) -> None:
        """Fail every lens request of the running step (the plan could not be built, or a
        tap raised outside the per-request stages)."""
        try:
            ids = [s.req_id for s in self.view.scheduled()
                   if self.requests.lookup(s.req_id, s.payload) is not None]
        except Exception:  # the runner's state itself is unreadable: fail every running one
            ids = [r for r, rec in self.requests.records.items() if rec.finished_at is None]
        for req_id in ids:  # the rest of the step runs without their replacements
            record = self.requests.records.get(req_id)
            if record is not None and any(not r.idle and r.layer in self.shard_layers
                                          for r in record.lens.replace_mlp):
                record.lose_replacements()
        self._fail(ids, exc, "plan")

    def _build_plan(self, device: torch.device, dtype: torch.dtype) -> StepPlan:
        # The previous step is over: file its captured rows.
        self.settle()
        live = self.view.live()
        self.requests.finish_gone(live)
        if self._persistent_running:
            for req_id in [r for r in self._persistent_running if r not in live]:
                self._persistent_running.discard(req_id)
                if (state := self.persistent_results.get(req_id)) is not None:
                    try:
                        state.to_host()
                    except Exception as exc:  # noqa: BLE001 -- keep the error, not the rows
                        state.runs = []
                        state.error = {"message": f"vllm-lens could not move the persistent "
                                       f"hooks' results to the host: {describe(exc)}",
                                       "traceback": ""}
        persistent = bool(self.persistent_specs)
        slices, hook_calls, replaced = [], [], []
        for sched in self.view.scheduled(plain=persistent):
            record = self.requests.lookup(sched.req_id, sched.payload)
            if record is not None and record.error is not None:
                self._close_guarded(record)  # its monitors no longer run: it ends
                if record.replacements and not record.replacement_lost:
                    # Its salt promises the replacement: that keeps running (every rank).
                    replaced.append(RequestSlice(
                        req_id=sched.req_id, lens=record.running_lens, start=sched.start,
                        end=sched.end, pos0=sched.pos0, n_prompt=sched.n_prompt))
                record = None  # a failed request runs to its end without its lens work
            if record is None and not persistent:
                continue
            try:
                if record is not None:
                    faults.check(record.lens.fault, "plan")
                states = self._hook_states(record, sched.req_id, device)
            except Exception as exc:
                self._fail([sched.req_id], exc, "plan")
                continue
            if states:
                hook_calls.append(HookCall(sched.req_id, sched.start, sched.end, sched.pos0,
                                           states, sched.n_prompt))
            if record is not None:
                slices.append(RequestSlice(
                    req_id=sched.req_id, lens=record.running_lens, start=sched.start,
                    end=sched.end,
                    pos0=sched.pos0, n_prompt=sched.n_prompt,
                ))
        if len(self.store):
            self.fail_owned(
                self.store.mark_finished(live),
                "its captured rows waited longer than VLLM_LENS_FINISHED_TTL_S for the front "
                "end to fetch them and were dropped",
                "capture")
        if not slices and not hook_calls and not replaced:
            self._steer_layout, self._steer_groups = (), {}
            return _EMPTY_PLAN
        plan = StepPlan.build(slices, device, self.capture_layers, self.shard_layers,
                              split=self.split)
        plan.faults = any(s.lens.fault is not None for s in slices)
        if hook_calls:
            plan.hook_calls = hook_calls
            plan.hook_layers = frozenset(
                (layer, hook_site(run.point, split=self.split)) for call in hook_calls for state in call.states
                for run in state.runs for layer in run.layers)
        for group in plan.groups:
            if group.signal.startswith(SAE_PREFIX):
                try:
                    self._attach_sae(plan, group)
                except Exception as exc:  # its requests fail, not the step
                    group.failed = True
                    self._fail([o.req_id for o in group.owners], exc, "sae")
            self.store.stage(group)
        steered = []
        for s in slices:
            if s.lens.steer:
                try:
                    steered.append((s, self._prepared(s, device, dtype)))
                except Exception as exc:  # e.g. out of device memory: this request only
                    self._fail([s.req_id], exc, "steer")
        if steered:
            plan.steer = self._steering_for(steered, device)
        else:
            self._steer_layout, self._steer_groups = (), {}
        for s in slices:
            if s.lens.monitors:
                self._guarded("monitors", (s.req_id,), self._plan_monitors, plan, s, device)
            if s.lens.steer_attention:
                self._guarded("steer_attention", (s.req_id,), self._plan_attention, plan, s,
                              device, dtype)
        replacing: dict[tuple, list[tuple[RequestSlice, PreparedReplacement]]] = {}
        for s in (*(s for s in slices if s.lens.replace_mlp), *replaced):
            try:
                self._plan_replacement(replacing, s)
            except Exception as exc:
                self._lose_replacements([s.req_id], exc)
        for members in replacing.values():
            try:
                ReplacementGroup.add_to(plan, members, device)
            except Exception as exc:
                self._lose_replacements([s.req_id for s, _ in members], exc)
        return plan

    def _plan_replacement(self, replacing: dict[tuple, list], s: RequestSlice) -> None:
        """Its MLPs replaced by transcoders on this stage (``worker.replacement``), added to
        ``replacing`` by what they compute alike."""
        record = self.requests.records[s.req_id]
        if record.replacements is None:
            faults.check(record.lens.fault, "replace_mlp")
            record.replacements = [
                prepare_replacement(spec, held_transcoder(self.saes, spec), split=self.split)
                for spec in s.lens.replace_mlp
                if spec.layer in self.shard_layers and not spec.idle]
        for replacement in record.replacements:
            replacing.setdefault(replacement.key, []).append((s, replacement))

    def _plan_attention(self, plan: StepPlan, s: RequestSlice, device: torch.device,
                        dtype: torch.dtype) -> None:
        record = self.requests.records[s.req_id]
        if record.attention is None:
            faults.check(record.lens.fault, "steer_attention")
            record.attention = self.attention_steering.prepare(s.lens, s.n_prompt, device,
                                                               dtype)
        for layer in record.attention.by_layer:
            plan.attention.setdefault(layer, []).append((s, record.attention))

    def _monitor_state(self, record: RequestRecord, device: torch.device) -> MonitorState:
        """The request's monitors on this worker, built when it first runs (if they cannot
        be, the request fails, and so ends: ``_close_guarded``)."""
        if record.monitors is None:
            record.monitors = MonitorState.build(record.lens.monitors, device,
                                                 self.view.eos_token_id(record.req_id),
                                                 self.split)
        return record.monitors

    def _plan_monitors(self, plan: StepPlan, s: RequestSlice, device: torch.device) -> None:
        record = self.requests.records[s.req_id]
        state = self._monitor_state(record, device)
        for where in state.sites:
            plan.monitors.setdefault(where, []).append((s, state))
        if state.stops:
            plan.stops.append((s.req_id, state))

    def before_sample(self, logits: torch.Tensor) -> None:
        """Force the end-of-sequence token for the requests a ``stop`` monitor ended in this
        step (``monitors.force_stops``); runs before the step samples."""
        plan = self._plan
        stops, plan.stops = plan.stops, []  # this step's, used once
        if not stops and not self._stops.closing:
            return
        try:
            self._stops.force(logits, stops, self.requests.records, self.view)
        except Exception as exc:  # never into the sampler: the requests fail, not the engine
            self._fail([req_id for req_id, _ in stops], exc, "monitors")

    def _attach_sae(self, plan: StepPlan, group) -> None:
        """Give an SAE feature capture group its SAE (loaded when the front end admitted the
        request); without it the group's requests fail, and nothing is captured for them."""
        owner = group.owners[0]
        spec = next(s for s in plan.slice_by_req[owner.req_id].lens.saes
                    if s.signal == group.signal)
        sae = self.saes.get(spec.path, spec.hook_point, resolved=True)
        if sae is None:
            group.failed = True
            self._fail([o.req_id for o in group.owners],
                       f"SAE {spec.sae!r} is not loaded on this worker (unloaded for another "
                       "since the request was admitted?)", "sae")
            return
        group.sae = (sae, spec.top_k, spec.reconstruction)
        if sae.is_transcoder and spec.reconstruction:  # compared with what it predicts
            group.target_site = site_of(sae.out_point, split=self.split)
            for index, layer in enumerate(group.layers):
                plan.capture.setdefault((layer, group.target_site), []).append((group, index))
        if spec.attribution:  # the norm's scale of the rows, where the model's stream ends
            if not isinstance(self.readout, Readout):
                group.failed = True
                self._fail([o.req_id for o in group.owners],
                           f"no readout for attribution on this worker: {self.readout}", "sae")
                return
            group.readout = self.readout
            plan.capture.setdefault((self.readout.last_layer,
                                     tap_key("resid_post", split=self.split)), []).append(
                (group, READOUT))

    def _steering_for(self, steered: list[tuple[RequestSlice, list[PreparedSteer]]],
                      device: torch.device) -> dict[tuple[int, str], SteerGroup]:
        """This step's per-layer steering, rebuilt only when the steered rows moved.

        In steady decoding every step puts the same requests at the same rows, and vectors
        without positions apply to every row (of their phase), so the previous step's groups
        still hold; so do those of vectors whose positions the request has passed (a
        replacement at one prompt position: nothing more to write).
        """
        layout = tuple(
            (s.req_id, s.start, s.end,
             s.pos0 if any(p.positions_sorted is not None and p.positions_sorted.size
                           and s.pos0 <= p.positions_sorted[-1] for p in prepared) else None,
             phase_boundary(s) if any(p.spec.phase != "all" for p in prepared) else None)
            for s, prepared in steered)
        if layout != self._steer_layout:
            self._steer_layout = ()  # a failed build leaves nothing stale behind
            try:
                self._steer_groups = build_steer_groups(steered, device, split=self.split)
            except Exception:  # noqa: BLE001 -- e.g. out of device memory: find whose
                kept = self._buildable(steered, device)
                try:
                    self._steer_groups = build_steer_groups(kept, device, split=self.split)
                except Exception as exc:  # noqa: BLE001 -- each fits alone, not together
                    self._fail([s.req_id for s, _ in kept], exc, "steer_groups")
                    self._steer_groups = {}
                return self._steer_groups  # layout left empty: rebuilt next step
            self._steer_layout = layout
        return self._steer_groups

    def _buildable(self, steered: list[tuple[RequestSlice, list[PreparedSteer]]],
                   device: torch.device) -> list[tuple[RequestSlice, list[PreparedSteer]]]:
        """The steered requests whose groups build on their own; the others fail alone (one
        request's steering too large for the device must not fail the step's others)."""
        kept = []
        for item in steered:
            try:
                build_steer_groups([item], device, split=self.split)
            except Exception as exc:  # noqa: BLE001
                self._fail([item[0].req_id], exc, "steer_groups")
            else:
                kept.append(item)
        return kept

    def _prepared(self, s: RequestSlice, device: torch.device,
                  dtype: torch.dtype) -> list[PreparedSteer]:
        record = self.requests.records[s.req_id]
        if record.steer is None:
            faults.check(record.lens.fault, "steer")
            record.steer = [prepare(spec, device, dtype, self._held_sae(spec))
                            for spec in s.lens.steer]
        return record.steer

    def _held_sae(self, spec: SteerSpec) -> SAE | None:
        """The SAE a TopK clamp encodes with: this worker's, loaded when the front end
        admitted the request and held while it runs (``None`` for other steering, and on a
        pipeline stage without the clamp's layer)."""
        clamp = spec.clamp
        if clamp is None or clamp.path is None or not self.shard_layers.intersection(
                spec.layers):
            return None
        sae = self.saes.get(clamp.path, clamp.hook_point, resolved=True)
        if sae is None:
            raise ValueError(f"{clamp.field}: the TopK SAE it clamps is not loaded on this "
                             "worker (unloaded for another since the request was admitted?)")
        if self.saes.version(clamp.path, clamp.hook_point) != clamp.version:
            raise ValueError(f"{clamp.field}: the TopK SAE it clamps was read again from "
                             "changed files since the request was admitted; retry it")
        return sae
