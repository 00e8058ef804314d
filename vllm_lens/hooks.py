"""Per-request hooks: user functions that read or replace a request's residual stream at chosen
layers (runs in: front end, where hooks are declared; worker, where they run).

A hook is ``fn(ctx, hidden) -> Tensor | None``, called once per hooked layer per forward step
for that request only. ``hidden`` is the request's rows of the **full** residual stream in this
step, ``(n_tokens_in_step, hidden_size)``: after the layer (``pre=False``) or entering it
(``pre=True``); for fused-residual models (Llama, Qwen2) that is ``hidden + residual``, never
half of it. ``hook_point`` picks another point of the layer (``attn_out``, ``resid_mid``,
``mlp_out``; see ``vllm_lens.points``): the hook then sees and replaces that signal; at
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
    """What a hook function receives besides the hidden states."""

    saved: dict[str, Any]
    """Persists across layers and steps for this request and hook; returned as its result."""
    hook_point: str
    """The tap point the hook runs at (``resid_post`` unless it asked for another)."""
    layer_idx: int
    seq_len: int
    """Tokens of the sequence up to and including this step's."""
    positions: torch.Tensor
    """Absolute token positions of the rows of ``hidden`` (CPU, int64)."""
    request_id: str
    model: torch.nn.Module
    tp_rank: int

    def get_parameter(self, name: str) -> torch.Tensor:
        """The full parameter ``name`` (gathered across tensor-parallel ranks)."""
        ...


@dataclass(frozen=True)
class Hook:
    """A Python function run on a request's residual stream at ``layer_indices``."""

    fn: Callable[[HookContext, torch.Tensor], torch.Tensor | None]
    layer_indices: Sequence[int]
    pre: bool = False
    hook_point: str | None = None
    """Where the hook runs (``vllm_lens.points.STEERABLE``): default ``resid_post``, or
    ``resid_pre`` with ``pre=True``."""


@dataclass(frozen=True)
class NamedHook:
    """A hook published under the ``vllm_lens.hooks`` entry-point group, called by name."""

    name: str
    layer_indices: Sequence[int]
    args: Mapping[str, Any] = field(default_factory=dict)
    pre: bool = False
    hook_point: str | None = None

    def to_json(self) -> dict[str, Any]:
        """This hook as the JSON object an ``apply_hooks`` list carries over HTTP
        (``{"name", "layer_indices", "args", "pre"}``, and ``"hook_point"`` if set)."""
        out = {"name": self.name, "layer_indices": list(self.layer_indices),
               "args": dict(self.args), "pre": self.pre}
        if self.hook_point is not None:
            out["hook_point"] = self.hook_point
        return out


class HookError(LensError):
    """A hook raised, or returned something that cannot replace the hidden states.

    Attributes:
        traceback: a short summary of where the hook failed (on the worker).
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
