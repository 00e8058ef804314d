"""Each layer's attention output projection ``W_O``, found in the module tree and proven on the
model's own weights: ``attn_z`` through it gives ``attn_out`` (runs in: worker).

Per head ``h``, ``z[:, h] @ W_O[:, h].T`` is that head's part of ``attn_out``; a direct logit
attribution per head (``spec.logit_attribution`` with ``heads``) reads it. The projection is
the one child of the attention block (the module holding vLLM's ``Attention`` kernel) whose
2-D weight maps the kernel's output width to the stream's. ``prove`` runs it on what the
layout check's forward pass recorded (the kernel's output and ``attn_out``): a model that
does more between the two (a gate, a norm after attention: Gemma's ``attn_out`` is after its
post-attention norm) fails, and its heads are refused naming the invariant.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INVARIANT", "bias", "find_projections", "matrix", "prove", "sizes"]

#: The layout check's name for this invariant.
INVARIANT = "the output projection gives attn_out"


def find_projections(model: torch.nn.Module, attention: tuple[tuple[int, torch.nn.Module], ...],
                     width: int, hidden: int) -> dict[int, torch.nn.Module] | str:
    """Layer -> its output projection (``width``: the kernel's output per token, ``hidden``
    the stream's), or why one is not found."""
    names = {id(m): n for n, m in model.named_modules()}
    found: dict[int, torch.nn.Module] = {}
    for layer, kernel in attention:
        name = names.get(id(kernel))
        if name is None:
            return f"layer {layer}'s attention kernel is not in the model's module tree"
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        candidates = [m for m in parent.children() if sizes(m) == (width, hidden)]
        if len(candidates) != 1:
            return (f"layer {layer}'s attention block has {len(candidates)} modules mapping "
                    f"{width} values to {hidden}, not one")
        module = candidates[0]
        method = type(getattr(module, "quant_method", None)).__name__
        if module.weight.dtype not in _FLOATS or not (
                method == "NoneType" or method.startswith("Unquantized")):
            return (f"layer {layer}'s output projection is quantised ({method}, "
                    f"{module.weight.dtype})")
        found[layer] = module
    return found


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def sizes(module: torch.nn.Module) -> tuple[int, int] | None:
    """(input, output) width of a linear module: its weight's, or where vLLM's CPU build
    packed the weight away (leaving it empty) the sizes vLLM's linear layers record."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if weight.dim() == 2 and weight.numel():
        return int(weight.shape[1]), int(weight.shape[0])
    inputs = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
    outputs = getattr(module, "output_size_per_partition", getattr(module, "output_size", None))
    return None if inputs is None or outputs is None else (int(inputs), int(outputs))


def matrix(module: torch.nn.Module, width: int) -> torch.Tensor:
    """The projection's matrix ``W_O`` ``[hidden, width]`` in float32 on its device: its
    weight, or where the weight was packed away (vLLM's CPU linear layers), what the module
    computes for each unit input less what it computes for zero (its bias)."""
    weight = module.weight
    if weight.dim() == 2 and weight.numel():
        return weight.float()
    with torch.inference_mode():
        eye = torch.eye(width, dtype=weight.dtype, device=weight.device)
        out = module(eye)
        out = out[0] if isinstance(out, tuple) else out
        zero = module(torch.zeros(1, width, dtype=weight.dtype, device=weight.device))
        zero = zero[0] if isinstance(zero, tuple) else zero
        return (out - zero).t().float().contiguous()


def bias(module: torch.nn.Module) -> torch.Tensor | None:
    """What the projection adds to every row (its bias, unless vLLM returns it apart:
    ``skip_bias_add``), float32, or ``None``."""
    b = getattr(module, "bias", None)
    if not isinstance(b, torch.Tensor) or not b.numel() or getattr(module, "skip_bias_add",
                                                                    False):
        return None
    return b.float()


def prove(projections: dict[int, torch.nn.Module], z: dict[int, torch.Tensor],
          attn_out: dict[int, torch.Tensor | None], close: Any) -> str | None:
    """``None`` if at every layer the recorded kernel output ``z`` through the matrix the
    attribution uses (``matrix``, plus the bias) is the recorded ``attn_out``
    (``close(actual, expected)``), else what failed."""
    with torch.inference_mode():
        for layer, module in projections.items():
            rows, expected = z.get(layer), attn_out.get(layer)
            if rows is None or expected is None:
                return f"layer {layer}'s kernel output or attn_out was not recorded"
            w = matrix(module, rows.shape[-1])
            out = rows.float().to(w.device) @ w.t()
            b = bias(module)
            if b is not None:
                out = out + b
            if not close(expected.float().to(w.device), out):
                return f"the invariant {INVARIANT!r} failed at layer {layer}"
    return None


