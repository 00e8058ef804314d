"""Q, K and per-head output around vLLM's attention kernel (runs in: worker).

vLLM runs attention as one opaque custom op (``unified_attention_with_output``, on CPU and
CUDA alike), outside the compiled graph and outside CUDA graphs; its body looks up
``layer.impl.forward`` at run time. Wrapping that bound method therefore sees the post-RoPE
query ``[tokens, heads, head_dim]`` and key ``[tokens, kv_heads, head_dim]`` exactly as the
kernel receives them, the value ``[tokens, kv_heads, head_dim]`` beside them, and the kernel's
output (``attn_z``), with no change to the traced graph.
Attention steering (``worker.attention_steering``) rewrites rows of that output there, before
``attn_z`` is read.

The wrappers are dormant: they are installed only for the steps that capture Q/K, ``value``
or ``attn_z`` or steer attention, and removed when no step needs them, so plain traffic pays
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["AttentionTaps", "attention_meta"]

#: handler(a, b, layer, site): ``("attn", q, k)`` and ``("attn_v", v, None)`` before the
#: kernel, ``("attn_z", out, None)`` after it.
Handler = Callable[[torch.Tensor, "torch.Tensor | None", int, str], None]
#: editor(query, key, value, output, layer): after the kernel, may rewrite rows of ``output``
#: (``None`` when the kernel's output cannot be rewritten: quantized).
Editor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", int],
                  None]


class AttentionTaps:
    """Wraps (or unwraps) ``impl.forward`` of each local layer's ``Attention`` module."""

    def __init__(self, modules: tuple[tuple[int, nn.Module], ...], handler: Handler,
                 editor: Editor | None = None) -> None:
        self.modules = modules
        self.handler = handler
        self.editor = editor
        self.enabled = False
        self.values = False
        """Whether the step reads ``value`` (else the wrappers do not hand it on)."""
        self.meta: dict[int, dict[str, Any]] = {}
        """Layer -> ``attention_meta`` (for hooks at ``attn_qk``), where it can be read."""
        for layer, module in modules:
            try:
                self.meta[layer] = attention_meta(module)
            except Exception:  # noqa: BLE001 - such a layer's hooks get no metadata
                pass

    def enable(self, on: bool, values: bool = False) -> None:
        """Install the wrappers (``on``) or remove them; ``values``: hand ``value`` on too."""
        self.values = on and values
        if on == self.enabled:
            return
        for layer, module in self.modules:
            impl = module.impl
            wrapped = "forward" in impl.__dict__  # judged per module: a failure part-way
            if on and not wrapped:               # leaves nothing wrapped twice or forgotten
                impl.forward = _wrapped(type(impl).forward.__get__(impl), layer,
                                        self.handler, self.editor, self)
            elif not on and wrapped:
                del impl.forward  # back to the class's method
        self.enabled = on  # after the loop: a failure part-way is retried next step


def _wrapped(original: Callable[..., Any], layer: int, handler: Handler,
             editor: Editor | None, taps: AttentionTaps) -> Callable[..., Any]:
    def forward(attn_layer, query, key, value, kv_cache, attn_metadata, output=None,
                **kwargs):
        if key is not None:
            handler(query, key, layer, "attn")
            if value is not None and taps.values:
                handler(value, None, layer, "attn_v")
        result = original(attn_layer, query, key, value, kv_cache, attn_metadata,
                          output=output, **kwargs)
        z = output if output is not None else result
        # With a fused output quantization the kernel writes quantized values: no attn_z
        # then (its capture is incomplete, and the request fails rather than get them), and
        # no steering (the editor is told, with ``None``, and fails its requests).
        plain = isinstance(z, torch.Tensor) and kwargs.get("output_scale") is None
        if editor is not None:  # (told ``None`` where it cannot rewrite: it fails its requests)
            editable = plain and key is not None and value is not None
            editor(query, key, value, z if editable else None, layer)
        if plain:
            handler(z, None, layer, "attn_z")
        return result

    return forward


def attention_meta(module: nn.Module) -> dict[str, Any]:
    """What ``vllm_lens.attention`` needs to rebuild one layer's attention pattern."""
    impl = module.impl
    window = getattr(impl, "sliding_window", None)
    if window is None or window == -1:
        window = (-1, -1)
    elif isinstance(window, int):
        window = (window - 1, 0)  # a query sees itself and window - 1 keys before it
    else:
        window = tuple(int(w) for w in window)
    slopes = getattr(impl, "alibi_slopes", None)
    sinks = getattr(impl, "sinks", None)
    cap = getattr(impl, "logits_soft_cap", None)
    return {
        "scale": float(impl.scale),
        "logits_soft_cap": float(cap or 0.0),
        "sliding_window": list(window),
        "alibi_slopes": None if slopes is None else torch.as_tensor(slopes).float().tolist(),
        "sinks": None if sinks is None else sinks.detach().float().cpu().tolist(),
        "num_heads": int(impl.num_heads),
        "num_kv_heads": int(impl.num_kv_heads),
        "head_size": int(impl.head_size),
        "layer_name": str(getattr(module, "layer_name", "")),
        "kv_cache_dtype": str(getattr(module, "kv_cache_dtype", "auto")),
    }
