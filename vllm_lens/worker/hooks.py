"""Running hooks on the worker (runs in: worker).

Every TP/PP rank.

Every TP rank runs every hook, so that replacements keep the ranks' residual streams
identical; results are reported by TP rank 0 of each pipeline stage. A request's hooks share
one ``HookState``: the hook functions, each hook's ``saved`` dict, and the first error. After an
error the request's hooks stop running (the front end fails the request when it finishes).
"""

from __future__ import annotations

import json
import pickle
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_lens import named_hooks
from vllm_lens.common import hook_results
from vllm_lens.common.points import QK_HOOK_POINT, hook_site, operands
from vllm_lens.spec import HookSpec

__all__ = [
    "HookCall", "HookState", "ParameterSource", "encode_results",
    "run_hook_calls",
]


@dataclass
class _Run:
    fn: Any
    layers: frozenset[int]
    point: str
    """The tap point it runs at (``points.STEERABLE``)."""
    saved: dict[str, Any] = field(default_factory=dict)


@dataclass
class HookState:
    """One request's hooks (or one request's share of the persistent hooks)."""

    runs: list[_Run]
    trusted: bool
    """Some hook was pickled, so the request came from a trusted caller (offline, or a client
    the operator allowed to send code): results may be pickled back if needed."""
    error: dict[str, str] | None = None
    read_only: bool = False
    """Its hooks may only read (a monitor's hooks: ``worker.monitors``); one that returns a
    tensor fails the request instead of replacing the stream."""

    @classmethod
    def build(cls, specs: Iterable[HookSpec], *, read_only: bool = False) -> HookState:
        specs = tuple(specs)
        state = cls(runs=[], trusted=any(s.pickled is not None for s in specs),
                    read_only=read_only)
        try:
            for spec in specs:
                if spec.pickled is not None:
                    fn = pickle.loads(spec.pickled)  # noqa: S301 - vetted by the front end
                else:
                    fn = named_hooks.load(str(spec.name))(json.loads(spec.args))
                state.runs.append(_Run(fn=fn, layers=frozenset(spec.layers), point=spec.point))
        except Exception as exc:  # a hook that cannot even be built fails its request
            state.fail(exc)
        return state

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            summary = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)
            self.error = {"message": f"{type(exc).__name__}: {exc}",
                          "traceback": "".join(summary)}

    def results(self) -> dict[str, Any]:
        return {str(i): run.saved for i, run in enumerate(self.runs)}

    def to_host(self) -> None:
        """Move what the hooks saved to the host and drop the hook functions (once their
        request finished: results kept for later collection must not hold device memory,
        nor may a function's own state, such as ``attention_to_span``'s K rows)."""
        for run in self.runs:
            run.saved = hook_results.to_cpu(run.saved)
            run.fn = None


@dataclass(frozen=True)
class HookCall:
    """One request's rows in this step, and the hook states that want them (built once per
    step by the plan, shared by every layer's taps)."""

    req_id: str
    start: int
    end: int
    pos0: int
    states: tuple[HookState, ...]
    n_prompt: int = 0
    positions: torch.Tensor = field(init=False)
    """Absolute positions of the rows (CPU, int64)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "positions",
                           torch.arange(self.pos0, self.pos0 + self.end - self.start))


class _Context:
    """The ``HookContext`` handed to hook functions (see ``vllm_lens.hooks``)."""

    __slots__ = ("attention", "hook_point", "key", "layer_idx", "model", "params", "positions",
                 "prompt_len", "request_id", "saved", "seq_len", "tp_rank")

    def __init__(self, saved: dict, layer: int, call: HookCall, model: Any, tp_rank: int,
                 params: ParameterSource, hook_point: str = "resid_post") -> None:
        self.saved = saved
        self.hook_point = hook_point
        self.prompt_len = call.n_prompt
        self.key: torch.Tensor | None = None
        self.attention: dict[str, Any] | None = None
        self.layer_idx = layer
        self.seq_len = call.pos0 + call.end - call.start
        self.positions = call.positions
        self.request_id = call.req_id
        self.model = model
        self.tp_rank = tp_rank
        self.params = params

    def get_parameter(self, name: str) -> torch.Tensor:
        return self.params.get(name)


def run_hook_calls(calls: list[HookCall], layer: int, site: str, hidden: torch.Tensor,
                   residual: torch.Tensor | None, model: Any, tp_rank: int,
                   params: ParameterSource, attention: dict[str, Any] | None = None, *,
                   split: bool) -> None:
    """Run the hooks of each request at this tap (``site``); replacements are written back in
    place.

    The signal handed to a hook is a copy of its point's value (``hidden + residual`` for the
    stream points, ``hidden`` for ``attn_out`` / ``mlp_out``); a replacement ``x`` of a stream
    point is written as ``hidden = x - residual`` so that the layer (or the next) sees exactly
    ``x`` as the residual stream. At the ``attn`` site ``hidden`` and ``residual`` are the
    kernel's Q and K: a hook there gets its rows of Q, ``ctx.key`` its rows of K and
    ``ctx.attention`` the layer's metadata (``attention``), and must return ``None``.
    """
    if site == "attn":
        _run_qk_hooks(calls, layer, hidden, residual, model, tp_rank, params, attention)
        return
    for call in calls:
        rows = slice(call.start, call.end)
        streams: dict[str, torch.Tensor] = {}
        for state in call.states:
            for run in state.runs:
                if (state.error is not None or run.fn is None or layer not in run.layers
                        or hook_site(run.point, split=split) != site):
                    continue
                a, b = operands(run.point, hidden, residual)
                stream = streams.get(run.point)
                if stream is None:
                    stream = a[rows] + b[rows] if b is not None else a[rows].clone()
                ctx = _Context(run.saved, layer, call, model, tp_rank, params, run.point)
                try:
                    out = run.fn(ctx, stream.clone())
                    if out is not None and state.read_only:
                        raise TypeError(f"hook at layer {layer} returned a value; a "
                                        "monitor's hook only reads (return None)")
                    if out is not None:
                        stream = _checked(out, stream, layer)
                        hidden[rows] = stream - b[rows] if b is not None else stream
                        # the other point of this site is read afresh from the new value
                        streams = {run.point: stream}
                    else:
                        streams[run.point] = stream
                except Exception as exc:
                    state.fail(exc)


def _run_qk_hooks(calls: list[HookCall], layer: int, q: torch.Tensor, k: torch.Tensor,
                  model: Any, tp_rank: int, params: ParameterSource,
                  attention: dict[str, Any] | None) -> None:
    for call in calls:
        rows = slice(call.start, call.end)
        for state in call.states:
            for run in state.runs:
                if (state.error is not None or run.fn is None or layer not in run.layers
                        or run.point != QK_HOOK_POINT):
                    continue
                ctx = _Context(run.saved, layer, call, model, tp_rank, params, run.point)
                ctx.key = k[rows].clone()
                ctx.attention = None if attention is None else dict(attention)  # its own copy
                try:
                    if run.fn(ctx, q[rows].clone()) is not None:
                        raise TypeError(f"hook at {QK_HOOK_POINT} of layer {layer} returned a "
                                        "value; Q/K hooks only read (return None)")
                except Exception as exc:
                    state.fail(exc)


def _checked(out: Any, stream: torch.Tensor, layer: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"hook at layer {layer} returned {type(out).__name__}; return a tensor "
                        "shaped like hidden, or None")
    if out.shape != stream.shape or out.dtype != stream.dtype:
        raise ValueError(f"hook at layer {layer} returned shape {tuple(out.shape)} {out.dtype}; "
                         f"expected {tuple(stream.shape)} {stream.dtype} like hidden")
    return out.to(stream.device)


def encode_results(state: HookState) -> bytes:
    """A request's hook results and error as bytes for the front end
    (``common.hook_results``)."""
    return hook_results.encode(state.results(), state.error, trusted=state.trusted)


class ParameterSource:
    """Full parameters by name for ``ctx.get_parameter``: taken from this rank's model and
    gathered across TP ranks on first use, or from parameters prefetched from the pipeline
    stage that owns them."""

    def __init__(self, model: Any, tp_size: int) -> None:
        self.model = model
        self.tp_size = tp_size
        self.cache: dict[str, torch.Tensor] = {}
        self.prefetched: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        found = self.prefetched.get(name)
        if found is None:
            found = self.cache.get(name)
        if found is None:
            found = self.cache[name] = self._gather(name)
        return found

    def local(self, name: str) -> torch.Tensor | None:
        """The full parameter if this rank's pipeline stage owns it, else ``None``."""
        try:
            return self.get(name)
        except KeyError:
            return None

    def _gather(self, name: str) -> torch.Tensor:
        module_path, _, attr = name.rpartition(".")
        try:
            module = self.model.get_submodule(module_path)
            param = getattr(module, attr)
        except AttributeError:
            raise KeyError(f"the model has no parameter {name!r}") from None
        if not isinstance(param, torch.Tensor):
            raise KeyError(f"{name!r} is not a parameter")
        param = param.detach()
        dim = _sharded_dim(module)
        if self.tp_size == 1 or dim is None:
            return param
        from vllm.distributed import tensor_model_parallel_all_gather

        full = tensor_model_parallel_all_gather(param.contiguous(), dim=dim)
        vocab = getattr(module, "org_vocab_size", None)
        if vocab is not None and dim == 0:
            full = full[:vocab]  # vocab-parallel padding sits at the end when it divides evenly
        return full


def _sharded_dim(module: Any) -> int | None:
    """The dimension a tensor-parallel module splits its weight along, if any."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    if isinstance(module, RowParallelLinear):
        return 1
    return None

