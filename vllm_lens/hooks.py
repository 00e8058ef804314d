"""Per-request hooks: user functions that read or replace a request's residual stream at chosen
layers (runs in: caller, front end, worker).

Hooks are declared where the request is built and run on the workers.

A hook is ``fn(ctx, hidden) -> Tensor | None``, called once per hooked layer per forward step
for that request only. ``hidden`` is the request's rows of the **full** residual stream in this
step, ``(n_tokens_in_step, hidden_size)``: after the layer (``pre=False``) or entering it
(``pre=True``); for fused-residual models (Llama, Qwen2) that is ``hidden + residual``, never
half of it. ``hook_point`` picks another point of the layer (``attn_in``, ``attn_out``,
``resid_mid``, ``mlp_in``, ``mlp_out``; see ``vllm_lens.common.points``): the hook then sees and
replaces that signal; at
``attn_qk`` it reads the attention kernel's Q (``hidden``) and K (``ctx.key``) and replaces
nothing. ``hidden`` is a copy: returning a tensor of the same shape and dtype replaces the
request's rows, returning ``None`` leaves them. At each tap the order is: steering, then
hooks (in list order), then capture — so captures show what hooks wrote.

Two kinds of hook reach a worker:

- ``Hook(fn, layer_indices)``: any Python callable. Offline it travels pickled inside the
  request (``cloudpickle``); over HTTP it is code, refused with 403 unless the operator set
  ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1``.
- ``NamedHook(name, layer_indices, args)``: a hook published by an installed package under the
  entry-point group ``vllm_lens.hooks`` and called by name with JSON arguments; safe to accept
  from anyone. vllm-lens ships ``logit_lens_topk`` and ``linear_probe``
  (``vllm_lens.named_hooks``).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_lens.errors import LensError

__all__ = ["Hook", "HookContext", "HookError", "NamedHook", "hook_to_json"]


class HookContext(Protocol):
    """What a hook function receives besides the hidden states.

    The worker builds one per hook call; a user never constructs it, only reads it (and
    writes ``saved``) inside ``fn(ctx, hidden)``. At the ``attn_qk`` hook point it also has
    ``key``: the request's rows of the attention kernel's K, beside Q in ``hidden``.

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import Hook
        >>> def where(ctx, hidden):
        ...     ctx.saved["seen"] = [ctx.hook_point, ctx.layer_idx, ctx.tp_rank]
        >>> sp = SamplingParams(max_tokens=1, extra_args={"apply_hooks": [Hook(where, [2])]})
        >>> llm.generate(["Hello world"], sp)[0].hook_results["0"]["seen"]
        ['resid_post', 2, 0]
    """

    saved: dict[str, Any]
    """Persists across layers and steps for this request and hook; returned as its result."""
    hook_point: str
    """The tap point the hook runs at (``resid_post`` unless it asked for another)."""
    layer_idx: int
    """The decoder layer the hook is running at."""
    seq_len: int
    """Tokens of the sequence up to and including this step's."""
    positions: torch.Tensor
    """Absolute token positions of the rows of ``hidden`` (CPU, int64)."""
    request_id: str
    """The engine's id of the request being run."""
    model: torch.nn.Module
    """This worker's model (its tensor-parallel shard of the weights)."""
    tp_rank: int
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""

    def get_parameter(self, name: str) -> torch.Tensor:
        """The full parameter ``name`` (gathered across tensor-parallel ranks).

        Gathered on first use and cached on the worker; under pipeline parallelism a
        parameter of another stage is available only if it was prefetched.

        Args:
            name: the parameter's dotted name in the vLLM model, e.g. ``"lm_head.weight"``
                or ``"model.norm.weight"``.

        Returns:
            The whole (unsharded) parameter, detached, on the worker's device.

        Raises:
            KeyError: the model has no parameter of that name (or it is not a tensor).
        """
        ...


@dataclass(frozen=True)
class Hook:
    """A Python function run on a request's residual stream at ``layer_indices``.

    Pass a list of them as ``extra_args["apply_hooks"]``; the output then has
    ``hook_results`` (``{"0": saved of the first hook, "1": ...}``, keyed by the hook's index
    in the list as a string) and ``hook_error`` (``None``, or the ``HookError`` that failed
    the request's hooks, with ``hook_results`` then ``None``). Bad fields (a layer out of
    range, an unknown ``hook_point``) raise ``LensRequestError`` naming
    ``apply_hooks[i].<field>`` before the request runs.

    Args:
        fn: ``fn(ctx, hidden) -> Tensor | None`` (see the module docs): ``ctx`` is a
            ``HookContext``, ``hidden`` a copy of the request's rows ``(n_tokens_in_step,
            hidden_size)``; return a tensor of the same shape and dtype to replace them, or
            ``None`` to leave them. It must be picklable with ``cloudpickle``.
        layer_indices: the decoder layers to run at (``0 .. n_layers - 1``).
        pre: run on the stream entering each layer (``resid_pre``) instead of leaving it;
            default ``False``.
        hook_point: the tap point to run at instead (``vllm_lens.common.points.STEERABLE``, or
            ``attn_qk`` to read Q and K); default ``None``: ``resid_post``, or ``resid_pre``
            with ``pre=True``.

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import Hook
        >>> def double(ctx, hidden):
        ...     ctx.saved["rows"] = ctx.saved.get("rows", 0) + hidden.shape[0]
        ...     return hidden * 2
        >>> sp = SamplingParams(max_tokens=2, extra_args={"apply_hooks": [Hook(double, [1])]})
        >>> out = llm.generate(["Hello world"], sp)[0]
        >>> out.hook_error is None, sorted(out.hook_results["0"])
        (True, ['rows'])
    """

    fn: Callable[[HookContext, torch.Tensor], torch.Tensor | None]
    layer_indices: Sequence[int]
    pre: bool = False
    hook_point: str | None = None
    """Where the hook runs (``vllm_lens.common.points.STEERABLE``): default ``resid_post``, or
    ``resid_pre`` with ``pre=True``."""


@dataclass(frozen=True)
class NamedHook:
    """A hook published under the ``vllm_lens.hooks`` entry-point group, called by name.

    Used like ``Hook`` (in ``extra_args["apply_hooks"]``, results in ``hook_results``), but
    it carries no code, so any HTTP client may send it. An unknown ``name`` or arguments
    the hook refuses raise ``LensRequestError`` (``apply_hooks[i].name`` /
    ``apply_hooks[i].args``) before the request runs.

    Args:
        name: the entry-point name, e.g. ``"logit_lens_topk"`` or ``"linear_probe"``
            (``vllm_lens.named_hooks``).
        layer_indices: the decoder layers to run at (``0 .. n_layers - 1``).
        args: the hook's JSON arguments (each hook documents its own); default ``{}``.
        pre: run on the stream entering each layer (``resid_pre``); default ``False``.
        hook_point: the tap point to run at instead (as for ``Hook``); default ``None``.

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import NamedHook
        >>> probe = NamedHook("linear_probe", [1, 2], {"weight": [0.01] * 128})
        >>> sp = SamplingParams(max_tokens=2, extra_args={"apply_hooks": [probe]})
        >>> sorted(llm.generate(["Hello world"], sp)[0].hook_results["0"])
        ['positions', 'scores']
        >>> probe.to_json()["name"]
        'linear_probe'
    """

    name: str
    layer_indices: Sequence[int]
    args: Mapping[str, Any] = field(default_factory=dict)
    pre: bool = False
    hook_point: str | None = None

    def to_json(self) -> dict[str, Any]:
        """This hook as the JSON object an ``apply_hooks`` list carries over HTTP
        (``{"name", "layer_indices", "args", "pre"}``, and ``"hook_point"`` if set).

        Returns:
            A new dict: ``name`` (str), ``layer_indices`` (list of int), ``args`` (a dict
            copy), ``pre`` (bool), and ``hook_point`` (str) only when it is not ``None``.
        """
        out = {"name": self.name, "layer_indices": list(self.layer_indices),
               "args": dict(self.args), "pre": self.pre}
        if self.hook_point is not None:
            out["hook_point"] = self.hook_point
        return out


class HookError(LensError):
    """A hook raised, or returned something that cannot replace the hidden states.

    Offline it is not raised but attached to the request's output as ``out.hook_error``
    (with ``out.hook_results`` then ``None``); ``AsyncLLM.generate`` raises it. Only that
    request fails: the engine and the other requests carry on.

    Args:
        message: what went wrong (kept as ``message``).
        traceback: where, on the worker (kept as ``traceback``); default ``""``. When
            given it is appended to the message on a new line.

    Attributes:
        message: what went wrong, e.g. the hook's exception or the shape it returned.
        traceback: a short summary of where the hook failed (on the worker).

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import Hook, HookError
        >>> def broken(ctx, hidden):
        ...     raise RuntimeError("this hook is broken")
        >>> sp = SamplingParams(max_tokens=1, extra_args={"apply_hooks": [Hook(broken, [0])]})
        >>> out = llm.generate(["Hello world"], sp)[0]
        >>> isinstance(out.hook_error, HookError), "this hook is broken" in str(out.hook_error)
        (True, True)
    """

    def __init__(self, message: str, traceback: str = "") -> None:
        self.message = message
        self.traceback = traceback
        super().__init__(message + (f"\n{traceback}" if traceback else ""))


def hook_to_json(hook: Hook | NamedHook) -> dict[str, Any]:
    """The ``vllm_xargs`` form of a hook: a named hook's fields, or a pickled ``Hook``."""
    if isinstance(hook, NamedHook):
        return hook.to_json()
    import cloudpickle

    return {"pickle": base64.b64encode(cloudpickle.dumps(hook)).decode("ascii")}
