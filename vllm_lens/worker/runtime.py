"""The per-process tap handler: builds the step plan, then at each layer steers, runs hooks and
captures, in that order, so captures show the steered and hooked stream; pre-hooks run at the
layer's input (runs in: worker).

One ``LensRuntime`` exists per worker process once the front end has asked for lens features
(``lens_describe``); until then the taps have no handler and cost one Python call per layer.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_lens import envs
from vllm_lens.spec import PAYLOAD_KEY, HookSpec, LensRequest
from vllm_lens.worker.capture import capture_layer
from vllm_lens.worker.hooks import HookCall, HookState, ParameterSource, run_hook_calls
from vllm_lens.worker.plan import RequestSlice, StepPlan
from vllm_lens.worker.steer import (
    PreparedSteer,
    SteerGroup,
    apply_steering,
    build_steer_groups,
    prepare,
)
from vllm_lens.worker.store import CaptureStore

logger = logging.getLogger(__name__)

__all__ = ["LensRuntime"]

_EMPTY_PLAN = StepPlan(slices=[])


class LensRuntime:
    """Reads the model runner's batch state; one plan per forward step, shared by all taps."""

    def __init__(self, runner: Any, *, capture_layers: frozenset[int], tp_rank: int,
                 tp_size: int) -> None:
        self.runner = runner
        self.capture_layers = capture_layers
        """Layers whose rows this rank captures: its stage's layers on TP rank 0, else none."""
        self.tp_rank = tp_rank
        self.store = CaptureStore(envs.worker_max_bytes(), envs.finished_ttl_s())
        self.params = ParameterSource(runner.get_model(), tp_size)
        self._lens_by_req: dict[str, LensRequest | None] = {}
        self._steer_by_req: dict[str, list[PreparedSteer]] = {}
        self._hooks_by_req: dict[str, tuple[str, HookState]] = {}
        """Request id -> (lens key, state) of per-request hooks, until fetched or released."""
        self._finished_hooks: dict[str, float] = {}
        self.persistent_specs: tuple[HookSpec, ...] = ()
        self.persistent_results: OrderedDict[str, HookState] = OrderedDict()
        """Request id -> state of the persistent hooks for it (bounded, oldest dropped)."""
        self._plan_ctx: object | None = None
        self._plan: StepPlan = _EMPTY_PLAN
        self._steer_layout: tuple[tuple[str, int, int, int | None], ...] = ()
        self._steer_groups: dict[int, SteerGroup] = {}

    # -- tap handler ---------------------------------------------------------------------------
    def on_tap(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: int,
               pre: bool) -> None:
        plan = self._plan_for_step(hidden)
        if plan.empty:
            return
        if pre:
            if (layer, True) in plan.hook_layers:
                self._run_hooks(plan, layer, True, hidden, residual)
            return
        steering = plan.steer.get(layer)
        if steering is not None:
            apply_steering(steering, hidden, residual)
        if (layer, False) in plan.hook_layers:
            self._run_hooks(plan, layer, False, hidden, residual)
        for group, index in plan.capture.get(layer, ()):
            capture_layer(group, index, hidden, residual)

    def _run_hooks(self, plan: StepPlan, layer: int, pre: bool, hidden: torch.Tensor,
                   residual: torch.Tensor | None) -> None:
        run_hook_calls(plan.hook_calls, layer, pre, hidden, residual, self.params.model,
                       self.tp_rank, self.params)

    # -- hooks bookkeeping ---------------------------------------------------------------------
    def pop_hooks(self, key: str) -> dict[str, HookState]:
        """Remove the per-request hook states of lens key ``key`` (request id -> state)."""
        found = {r: st for r, (k, st) in self._hooks_by_req.items() if k == key}
        for req_id in found:
            del self._hooks_by_req[req_id]
            self._finished_hooks.pop(req_id, None)
        return found

    def _hook_states(self, req_id: str, lens: LensRequest | None) -> tuple[HookState, ...]:
        states = []
        if lens is not None and lens.hooks:
            entry = self._hooks_by_req.get(req_id)
            if entry is None:
                entry = self._hooks_by_req[req_id] = (lens.key, HookState.build(lens.hooks))
            states.append(entry[1])
        if self.persistent_specs:
            state = self.persistent_results.get(req_id)
            if state is None:
                state = self.persistent_results[req_id] = HookState.build(self.persistent_specs)
                while len(self.persistent_results) > envs.hook_results_max():
                    self.persistent_results.popitem(last=False)
            states.append(state)
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
            self._plan = self._build_plan(hidden.device, hidden.dtype)
        return self._plan

    def _build_plan(self, device: torch.device, dtype: torch.dtype) -> StepPlan:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids
        query_start = runner.query_start_loc.np  # host mirror: reading it never syncs
        computed = batch.num_computed_tokens_cpu
        self.store.settle()  # the previous step is over: file its captured rows
        slices, hook_calls = [], []
        for i in range(num_reqs):
            req_id = req_ids[i]
            lens = self._lens_of(req_id)
            if lens is None and not self.persistent_specs:
                continue
            start, end, pos0 = int(query_start[i]), int(query_start[i + 1]), int(computed[i])
            states = self._hook_states(req_id, lens)
            if states:
                hook_calls.append(HookCall(req_id, start, end, pos0, states))
            if lens is None:
                continue
            slices.append(RequestSlice(
                req_id=req_id, lens=lens, start=start, end=end, pos0=pos0,
                n_prompt=runner.requests[req_id].num_prompt_tokens,
            ))
        self._forget_finished()
        if not slices and not hook_calls:
            return _EMPTY_PLAN
        plan = StepPlan.build(slices, device, self.capture_layers)
        if hook_calls:
            plan.hook_calls = hook_calls
            plan.hook_layers = frozenset(
                (layer, run.pre) for call in hook_calls for state in call.states
                for run in state.runs for layer in run.layers)
        for group in plan.groups:
            self.store.stage(group)
        steered = [(s, self._prepared(s, device, dtype)) for s in slices if s.lens.steer]
        if steered:
            plan.steer = self._steering_for(steered, device)
        return plan

    def _steering_for(self, steered: list[tuple[RequestSlice, list[PreparedSteer]]],
                      device: torch.device) -> dict[int, SteerGroup]:
        """This step's per-layer steering, rebuilt only when the steered rows moved.

        In steady decoding every step puts the same requests at the same rows, and vectors
        without positions apply to every row, so the previous step's groups still hold.
        """
        layout = tuple(
            (s.req_id, s.start, s.end,
             s.pos0 if any(p.positions_sorted is not None for p in prepared) else None)
            for s, prepared in steered)
        if layout != self._steer_layout:
            self._steer_layout = layout
            self._steer_groups = build_steer_groups(steered, device)
        return self._steer_groups

    def _prepared(self, s: RequestSlice, device: torch.device,
                  dtype: torch.dtype) -> list[PreparedSteer]:
        prepared = self._steer_by_req.get(s.req_id)
        if prepared is None:
            prepared = [prepare(spec, device, dtype) for spec in s.lens.steer]
            self._steer_by_req[s.req_id] = prepared
        return prepared

    def _lens_of(self, req_id: str) -> LensRequest | None:
        try:
            return self._lens_by_req[req_id]
        except KeyError:
            pass
        lens = None
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        payload = (params.extra_args or {}).get(PAYLOAD_KEY) if params is not None else None
        if payload is not None:
            try:
                lens = LensRequest.from_payload(payload)
            except (ValueError, KeyError, TypeError) as exc:
                # The front end validated it; anything else did not come from vllm-lens.
                logger.warning("vllm-lens: ignoring malformed payload of %s: %s", req_id, exc)
        self._lens_by_req[req_id] = lens
        return lens

    def _forget_finished(self) -> None:
        live = self.runner.requests
        if len(self._lens_by_req) > 2 * len(live) + 64:
            self._lens_by_req = {r: v for r, v in self._lens_by_req.items() if r in live}
            self._steer_by_req = {r: v for r, v in self._steer_by_req.items() if r in live}
        if len(self.store):
            self.store.mark_finished(live)
        if self._hooks_by_req:
            # Finished requests' hook states wait for their fetch, as captures do.
            now, ttl = time.monotonic(), self.store.finished_ttl_s
            for req_id in self._hooks_by_req:
                if req_id not in live:
                    self._finished_hooks.setdefault(req_id, now)
            for req_id, since in list(self._finished_hooks.items()):
                if now - since > ttl:
                    del self._finished_hooks[req_id]
                    self._hooks_by_req.pop(req_id, None)
