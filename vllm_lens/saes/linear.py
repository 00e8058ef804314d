"""``x @ W + b`` for a weight that many products reuse: an SAE's encoder or decoder (runs in: any).

The worker that serves an SAE's features, or a user's own process.

On the host, torch's default float32 GEMM (MKL) is slow on the AMD CPUs this project is
measured on: a ``[64, 576] @ [576, 9216]`` product (one decode step of a 16x-wide SAE on
SmolLM2) takes ~7.5 ms on one thread, against ~3 ms through oneDNN with the weight reordered
once into oneDNN's blocked layout (``benchmarks/RESULTS.md``, the SAE section). ``Linear``
keeps such a reordered copy where torch was built with oneDNN, the weight is a float32 tensor
in host memory, and it is large enough to pay for it (``MIN_REORDERED_ELEMENTS``: below that,
oneDNN's fixed ~10 µs per call outweighs the gain). Everywhere else — GPUs, other dtypes,
products autograd must see, a torch without those ops — it computes the plain ``x @ W + b``.
Both sum in float32 and differ in rounding order only (by ~1e-6 of the sums' size here).

The reordered copy is a snapshot: a weight changed in place (its version counter moved) is
reordered again at the next product. Tensors made under ``torch.inference_mode`` have no
version counter: such a weight is taken as never changing.
"""

from __future__ import annotations

import torch

__all__ = ["Linear", "MIN_REORDERED_ELEMENTS"]

MIN_REORDERED_ELEMENTS = 1 << 18
"""Weights with fewer elements (1 MiB of float32) keep torch's own product."""


class Linear:
    """``x @ weight + bias`` for rows ``x`` ``[n, d_in]``, ``weight`` ``[d_in, d_out]`` (sae-lens'
    orientation) and ``bias`` ``[d_out]``, all in one dtype on one device."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.weight, self.bias = weight, bias
        self._reordered: torch.Tensor | None = None
        self._version: int | None = -1
        if _can_reorder(weight):
            self._reorder()

    @property
    def nbytes(self) -> int:
        """Bytes of the reordered copy (0 without one); the weight itself is not counted."""
        if self._reordered is None:
            return 0
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._reordered is None or (torch.is_grad_enabled() and (
                x.requires_grad or self.weight.requires_grad or self.bias.requires_grad)):
            return x @ self.weight + self.bias
        if _version(self.weight) != self._version:  # changed in place since it was reordered
            self._reorder()
            if self._reordered is None:
                return x @ self.weight + self.bias
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._reordered, self.bias, "none", [], "")

    def _reorder(self) -> None:
        """oneDNN's blocked copy of ``weight`` (as ``[d_out, d_in]``), or none if this torch
        refuses to make one."""
        self._version = _version(self.weight)
        try:
            self._reordered = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach().t().contiguous())
        except RuntimeError:
            self._reordered = None


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def _can_reorder(weight: torch.Tensor) -> bool:
    return (weight.is_cpu and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.numel() >= MIN_REORDERED_ELEMENTS
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
