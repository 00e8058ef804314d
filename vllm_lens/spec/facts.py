"""``ModelFacts``: what the front end knows about the served model and engine, the ground every lens
key is validated against (runs in: front end).

Built from the workers' answers to ``lens_describe`` (``facts_from_describe``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_lens.common.messages import DescribeAnswer, read_all
from vllm_lens.common import points as tap_points
from vllm_lens.common.points import SITES

__all__ = ["ModelFacts", "facts_from_describe"]


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
    """Size of an attention head (the largest, where layers differ: ``qk_meta`` per layer)."""
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
    refused_points: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Point -> why the start-up check of the layout refuses it (``worker.layout_check``)."""
    derived_layout: bool = False
    """The layout was derived from the model's module tree, not written by hand."""
    readout_refused: str | None = "the workers did not describe their readout"
    """Why direct logit attribution is refused on this engine (``None``: served; the last
    stage's TP rank 0 proved its readout, ``worker.readout``)."""
    vocab_size: int = 0
    heads_refused: str | None = "the workers did not describe their output projections"
    """Why per-head logit attribution is refused (``worker.head_projection``), or ``None``."""

    @property
    def attribution_refused(self) -> str | None:
        """Why this engine cannot carry a vector on the last layer's stream to a logit (direct
        logit attribution), or ``None``."""
        if self.pp_size > 1:
            return (f"pipeline parallelism ({self.pp_size} stages): the layers read and the LM "
                    "head are on different stages")
        if self.readout_refused:
            return self.readout_refused
        if (why := self.refused_points.get("resid_post")) is not None:
            return f"the last layer's stream (resid_post) is refused: {why}"
        return None

    def row_shape(self, signal: str, layers: Sequence[int] = ()) -> tuple[int, ...]:
        """The shape of one captured row (one position, one layer) of ``signal`` (a logit
        attribution's ``dla:<point>``: the point's) at ``layers`` (per-head signals: heads of
        those layers' size, see ``head_size``)."""
        signal = tap_points.base_signal(signal) if signal.startswith(
            tap_points.DLA_PREFIX) else signal
        if signal in tap_points.KV_HEAD_SIGNALS:
            return (self.n_kv_heads, self.head_size(layers))
        if signal in ("attn_q", "attn_z", "q_pre_norm", "q_normed"):
            return (self.n_heads, self.head_size(layers))
        if signal == "router_logits":
            return (self.n_experts,)
        return (self.d_mlp if signal == "mlp_post" else self.hidden_size,)

    def row_width(self, signal: str, layers: Sequence[int] = ()) -> int:
        """Elements per captured row of ``signal`` at ``layers``."""
        return math.prod(self.row_shape(signal, layers))

    def head_size(self, layers: Sequence[int] = ()) -> int:
        """The size of an attention head at ``layers`` (``qk_meta``; a capture over heads of
        two sizes is refused, ``spec.capture.check_one_head_size``), the largest where they
        differ or are not known (``head_dim``)."""
        sizes = {int(self.qk_meta[layer].get("head_size") or 0) for layer in layers
                 if 0 <= layer < len(self.qk_meta)} - {0}
        return max(sizes) if sizes else self.head_dim


def facts_from_describe(answers: Sequence[Any]) -> ModelFacts:
    """Combine every rank's ``lens_describe`` answer (``DescribeAnswer`` records, or their
    msgpack maps) into one view of the model.

    Raises:
        WorkerAnswerError: an answer of another version or shape.
    """
    results = read_all(DescribeAnswer, answers)
    first = results[0]
    sites = set.intersection(*(set(r.sites) for r in results))
    # The final norm is on the ranks holding the last layer alone (the last pipeline stage).
    last = [r for r in results if first.n_layers - 1 in r.local_layers]
    if last and all("final" in r.sites for r in last):
        sites.add("final")
    meta = _join_qk_meta(results)
    return ModelFacts(
        model_class=first.model_class,
        n_layers=first.n_layers,
        hidden_size=first.hidden_size,
        max_model_len=first.max_model_len,
        mapped=all(r.mapped for r in results),
        dtype=first.dtype,
        pre_hooks=all(r.pre_taps for r in results),
        unsupported=next((r.unsupported for r in results if r.unsupported), None),
        speculative=any(r.speculative for r in results),
        sites=tuple(site for site in SITES if site in sites),
        d_mlp=first.d_mlp,
        n_heads=first.num_heads_total,
        n_kv_heads=first.num_kv_heads_total,
        # The largest (Gemma 4's heads differ in size by layer): admission counts no less.
        head_dim=max((int(m.get("head_size", 0)) for m in meta.values()), default=0),
        tp_size=first.tp_size,
        qk_meta=tuple(meta.get(layer, {}) for layer in range(first.n_layers)),
        split=first.split,
        block=first.block,
        n_experts=first.n_experts,
        moe_top_k=first.moe_top_k,
        unmapped=next((r.unmapped for r in results if r.unmapped), None),
        inner_taps=all(r.inner_taps for r in results),
        pp_size=len({r.pp_rank for r in results}),
        # Every engine's workers answer (``rpc.all_workers``): one TP rank 0 of the first
        # stage per engine; vLLM's dense-model DP workers report data_parallel_size 1. The
        # workers' own figure covers offline DP, where each process's LLM sees its engine.
        dp_size=max(sum(not r.tp_rank and not r.pp_rank for r in results),
                    *(r.dp_size for r in results)),
        # A point refused by any rank's (any stage's) check is refused.
        refused_points={point: why for r in results for point, why in r.refused_points.items()},
        derived_layout=any(r.derived_layout for r in results),
        vocab_size=first.vocab_size,
        heads_refused=next((r.heads_refused for r in results if r.heads_refused), None),
        # The stage that ends the model answers for the readout (the others hold no head).
        readout_refused=next((r.readout_refused for r in results
                              if not r.tp_rank and r.pp_rank == max(x.pp_rank for x in results)),
                             "no worker of the last pipeline stage answered"),
    )


def _join_qk_meta(results: Sequence[DescribeAnswer]) -> dict[int, dict[str, Any]]:
    """Per layer, the attention metadata of all TP ranks as one (the form users see in
    ``activations["qk_meta"]``): head counts of the whole layer, per-head values (ALiBi
    slopes, sinks) joined in rank order."""
    by_layer: dict[int, dict[int, Any]] = {}
    for r in results:  # (with data parallelism, every engine answers alike: one per rank)
        for m in r.qk_meta:
            by_layer.setdefault(m.layer, {}).setdefault(r.tp_rank, m)
    first = results[0]
    joined = {}
    for layer, by_rank in by_layer.items():
        metas = [by_rank[rank] for rank in sorted(by_rank)]
        one = metas[0].as_dict()
        if metas[0].alibi_slopes is not None:
            one["alibi_slopes"] = [v for m in metas for v in m.alibi_slopes]
        if metas[0].sinks is not None:
            one["sinks"] = [v for m in metas for v in m.sinks]
        one["num_heads"] = first.num_heads_total
        one["num_kv_heads"] = first.num_kv_heads_total
        joined[layer] = one
    return joined
