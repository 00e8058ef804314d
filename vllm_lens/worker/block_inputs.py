"""What a derived layout's attention and MLP blocks read and return, recorded for the
start-up check (runs in: worker).

``attn_in`` and ``mlp_in`` are tapped at a norm's output, ``attn_out_pre_norm`` and
``mlp_out_pre_norm`` at the input of the norm after a block; on a derived layout nothing but
the module tree says that the attention block and the MLP read the one and return the other.
The start-up check (``worker.layout_check``) settles it on one more forward pass of vLLM's
dummy run: each block's input and output are recorded beside the taps, and the invariants
("attention reads attn_in", "the MLP reads mlp_in", "attention returns attn_out_pre_norm",
"the MLP returns mlp_out_pre_norm") hold where the two are the same rows.

The blocks are reached by wrapping their ``forward`` for that pass, so the pass runs the
model's Python code (``eager``): a compiled graph would replay without calling a wrapper. The
taps hold the same tensors in both modes (they are splitting ops of the compiled graph), and
the first pass of the check keeps proving the stream as it is served, compiled.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["eager", "eager_reason", "recording_inputs"]

#: Names a block's input goes by, most likely first; otherwise its first floating tensor.
_INPUT_NAMES = ("hidden_states", "x", "hidden", "input_", "input")


def eager_reason(vllm_config) -> str | None:
    """Why ``eager`` cannot make ``vllm_config``'s model run its Python code, if so: with
    ``STOCK_TORCH_COMPILE`` the runner compiles the whole model with ``torch.compile``
    (``do_not_compile`` is set everywhere already), so a wrapped ``forward`` would be traced
    into a new graph, not called."""
    from vllm.config import CompilationMode

    if vllm_config.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE:
        return ("the model is compiled whole by torch.compile (STOCK_TORCH_COMPILE), so its "
                "blocks' inputs and outputs cannot be recorded")
    return None


@contextlib.contextmanager
def eager(model: nn.Module) -> Iterator[None]:
    """While inside, the modules vLLM compiles (``support_torch_compile``, which skips its
    compiled graph where ``do_not_compile`` is set) run their Python ``forward``."""
    switched = [m for m in model.modules() if getattr(m, "do_not_compile", None) is False]
    try:
        for module in switched:
            module.do_not_compile = True
        yield
    finally:
        for module in switched:
            module.do_not_compile = False


@contextlib.contextmanager
def recording_inputs(layers: nn.Module, local_layers: tuple[int, ...],
                     readers: tuple[tuple[str, str, str], ...],
                     seen: dict[tuple[int, str], torch.Tensor]) -> Iterator[None]:
    """While inside, the ``(point, path, end)`` blocks of ``readers`` in every local layer of
    ``layers`` record the input they are called with (``end`` "input") or what they return
    ("output": the first element of a tuple) into ``seen[(layer, point)]`` (float32, one row
    per token; their first call in the pass)."""
    wrapped: list[tuple[nn.Module, object]] = []
    by_block: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for index in local_layers:
        for point, path, end in readers:
            by_block.setdefault((index, path), []).append((point, end))
    try:
        for (index, path), ends in by_block.items():
            try:
                block = layers[index].get_submodule(path)
            except AttributeError:
                continue
            own = block.__dict__.get("forward")
            block.forward = _recording(block, index, ends, seen)
            wrapped.append((block, own))  # once wrapped: the exit unwraps it
        yield
    finally:
        for block, own in reversed(wrapped):
            if own is None:
                del block.forward
            else:
                block.forward = own


def _recording(block: nn.Module, layer: int, ends: list[tuple[str, str]],
               seen: dict[tuple[int, str], torch.Tensor]):
    forward = block.forward
    signature = inspect.signature(_model_forward(type(block)))

    def record(*args, **kwargs):
        first = any((layer, point) not in seen for point, _ in ends)
        if first:
            found = _input(signature, block, args, kwargs)
            keep(found, "input")  # before the block runs: it may write into its input
        out = forward(*args, **kwargs)
        if first:
            keep(out[0] if isinstance(out, tuple) else out, "output")
        return out

    def keep(found, end: str) -> None:
        for point, wanted in ends:
            if wanted == end and (layer, point) not in seen and isinstance(found, torch.Tensor):
                seen[(layer, point)] = found.detach().float().reshape(-1, found.shape[-1]
                                                                      ).clone()

    return record


def _model_forward(cls: type) -> object:
    """The model's own ``forward`` of ``cls``: past the subclasses ``worker.taps`` makes."""
    for klass in cls.__mro__:
        if "_vllm_lens_site" not in klass.__dict__ and "forward" in klass.__dict__:
            return klass.__dict__["forward"]
    return cls.forward


def _input(signature: inspect.Signature, block: nn.Module, args: tuple,
           kwargs: dict) -> torch.Tensor | None:
    try:
        bound = signature.bind(block, *args, **kwargs).arguments
    except TypeError:
        return None
    for name in _INPUT_NAMES:
        if isinstance(bound.get(name), torch.Tensor):
            return bound[name]
    return next((v for v in bound.values()
                 if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2),
                None)
