"""``ModelFacts``: what the front end knows about the served model and engine, the ground every lens
key is validated against (runs in: front end).

Built from the workers' answers to ``lens_describe``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFacts:
    """What the front end must know about the served model to validate lens requests."""

    model_class: str
    n_layers: int
    hidden_size: int
    max_model_len: int
    mapped: bool
    """False when the workers could not find the model's decoder layers, or found them in a
    model class without a layout (``worker.layouts``)."""
    dtype: str = "float32"
    """The model's dtype name (``torch.<dtype>``): the dtype of captured activations."""
    pre_hooks: bool = True
    """False when the decoder layers' inputs cannot be tapped (their ``forward`` takes no
    ``hidden_states``): ``pre=True`` hooks are refused."""
    unsupported: str | None = None
    """Why this engine's configuration refuses every lens request (it names the setting),
    or ``None`` (see ``worker.runner.unsupported_reason``)."""
    speculative: bool = False
    """Speculative decoding is on: hooks are refused (they would see draft tokens that the
    sampler may reject)."""
    sites: tuple[str, ...] = ("pre", "post")
    """Tap sites the workers installed (``points.SITES``): points at other sites are refused."""
    d_mlp: int = 0
    """Width of ``mlp_post`` (the MLP's intermediate size), 0 if unknown."""
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    tp_size: int = 1
    qk_meta: tuple[Mapping[str, Any], ...] = ()
    """Per layer: what ``vllm_lens.attention`` needs to rebuild the attention pattern
    (``scale``, ``logits_soft_cap``, ``sliding_window``, ``alibi_slopes``, ``sinks``)."""
    split: bool = False
    """The layers add to the stream themselves (GPT-2, GPT-NeoX, OLMo 2): ``attn_out`` and
    ``mlp_out`` are read at sites of their own (``points``)."""
    block: str = "sequential"
    """``sequential`` or ``parallel`` (attention and MLP both read ``resid_pre``)."""
    n_experts: int = 0
    """Width of ``router_logits`` (MoE models), 0 without a router."""
    moe_top_k: int = 0
    """Experts each token is routed to, where they follow from the logits (``softmax_topk``
    routing); 0 otherwise (then no ``router_experts``)."""
    unmapped: str | None = None
    """Why the model class is not mapped (when ``mapped`` is False)."""
    inner_taps: bool = True
    """False when the engine was started with ``VLLM_LENS_INNER_TAPS=0``."""
    pp_size: int = 1
    """Pipeline-parallel stages."""
    dp_size: int = 1
    """Data-parallel engines."""

    def row_shape(self, signal: str) -> tuple[int, ...]:
        """The shape of one captured row (one position, one layer) of ``signal``."""
        if signal == "attn_k":
            return (self.n_kv_heads, self.head_dim)
        if signal in ("attn_q", "attn_z"):
            return (self.n_heads, self.head_dim)
        if signal == "router_logits":
            return (self.n_experts,)
        return (self.d_mlp if signal == "mlp_post" else self.hidden_size,)

    def row_width(self, signal: str) -> int:
        """Elements per captured row of ``signal``."""
        return math.prod(self.row_shape(signal))
