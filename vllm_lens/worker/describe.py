"""What one rank answers to ``lens_describe``: its model, its configuration and what the layout
check proved (runs in: worker).

``worker.extension`` decides when the tap handler is attached and the layout check runs; this
module turns what it found into the ``DescribeAnswer`` record the front end reads.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_lens import envs
from vllm_lens.common.messages import AttentionMeta, DescribeAnswer, LayoutCheckSummary
from vllm_lens.worker.attention_taps import attention_meta
from vllm_lens.worker.layout_check import LayoutCheck

__all__ = ["check_blocker", "describe_rank"]

logger = logging.getLogger(__name__)


def check_blocker(vllm_config: Any) -> str | None:
    """Why the layout check's forward pass may not run on this engine, if so (then a derived
    layout serves nothing; a written row serves as the test suite proved it)."""
    if int(vllm_config.parallel_config.data_parallel_size) > 1:
        return ("data parallelism: a dummy forward pass of one engine would not be matched by "
                "the other engines' (their MoE collectives wait for each other)")
    if getattr(vllm_config, "lora_config", None) is not None:
        return ("LoRA: vLLM's dummy forward pass loads dummy adapters and then removes every "
                "adapter, the requests' included")
    return None


def describe_rank(vllm_config: Any, model_config: Any, model: Any, info: Any,
                  reason: str | None, ranks: tuple[int, int, int],
                  check: LayoutCheck | None, readout: str | None = "not built"
                  ) -> DescribeAnswer:
    """The record of one rank: ``info`` is the model's ``TapInfo`` (``None``: layers not
    found), ``reason`` why lens requests are refused here, ``ranks`` (TP rank, TP size, PP
    rank), ``check`` the layout check of the model the tap handler serves, ``readout`` why
    this rank has no readout for attribution (``None``: it has, ``worker.readout``)."""
    tp_rank, tp_size, pp_rank = ranks
    return DescribeAnswer(
        unsupported=reason,
        model_class=info.model_class if info else type(model).__name__,
        mapped=info is not None and info.tapped,
        n_layers=info.n_layers if info else 0,
        local_layers=list(info.local_layers) if info else [],
        pre_taps=info.pre_taps if info else False,
        hidden_size=model_config.get_hidden_size(),
        dtype=str(model_config.dtype).removeprefix("torch."),
        max_model_len=model_config.max_model_len,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        speculative=vllm_config.speculative_config is not None,
        tp_size=tp_size,
        dp_size=int(vllm_config.parallel_config.data_parallel_size),
        num_heads_total=int(model_config.get_num_attention_heads(vllm_config.parallel_config)
                            * tp_size),
        num_kv_heads_total=int(model_config.get_total_num_kv_heads()),
        sites=list(info.sites) if info else [],
        d_mlp=info.d_mlp if info else 0,
        split=info.split if info else False,
        block=info.block if info else "sequential",
        n_experts=info.n_experts if info else 0,
        moe_top_k=int(getattr(model_config.hf_text_config, "num_experts_per_tok", 0) or 0)
        if info and info.routing == "softmax_topk" else 0,
        unmapped=info.unmapped if info else "its decoder layers were not found",
        inner_taps=envs.inner_taps(),
        derived_layout=bool(info and info.derived),
        refused_points=dict(check.refused) if check is not None else {},
        layout_check=_check_summary(check),
        readout_refused=readout,
        heads_refused=check.heads_refused if check is not None else "the check did not run",
        vocab_size=int(model_config.get_vocab_size()),
        # Per layer this stage owns (the front end joins the stages' lists).
        qk_meta=_qk_meta(info),
    )


def _qk_meta(info: Any) -> list[AttentionMeta]:
    """One ``AttentionMeta`` per local layer with Q/K taps; a layer whose metadata cannot be
    read is left out (its Q/K are then not described, and never guessed)."""
    out = []
    for layer, module in info.attention if info else ():
        try:
            out.append(AttentionMeta(layer=layer, **attention_meta(module)))
        except Exception:  # noqa: BLE001 - describe must answer
            logger.warning("vllm-lens: cannot read the attention metadata of layer %d", layer)
    return out


def _check_summary(check: LayoutCheck | None) -> LayoutCheckSummary | None:
    if check is None:
        return None
    return LayoutCheckSummary(ran=check.ran, passed=list(check.passed),
                              seconds=check.seconds, error=check.error)
