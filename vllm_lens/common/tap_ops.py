"""The names of the custom ops vllm-lens puts in the traced model (runs in: any).

The worker defines and calls them (``worker.taps``); the front end names them to vLLM as
splitting ops, so that CUDA graphs leave them out (``frontend.engine_args``), and in the
compile-cache marker. Only the names live here: importing this module registers nothing.
"""

from __future__ import annotations

__all__ = ["ACT_TAP_OP_NAME", "MID_TAP_OP_NAME", "PRE_TAP_OP_NAME", "SITE_OP_NAMES", "TAP_OPS",
           "TAP_OP_NAME"]

TAP_OP_NAME = "vllm_lens::tap"
PRE_TAP_OP_NAME = "vllm_lens::pre_tap"
MID_TAP_OP_NAME = "vllm_lens::mid_tap"
ACT_TAP_OP_NAME = "vllm_lens::act_tap"
#: The ops of the sites only some layouts have (``points``): what attention and the MLP
#: return in split layouts, what attention and the MLP read, an MoE router's logits, and the
#: model's final norm (once, after the last layer), and the inputs of the norms after
#: attention and after the MLP (sandwich and post-norm layers), and a family's norms of Q and
#: K (their inputs and outputs).
SITE_OP_NAMES = {"attn_in": "vllm_lens::attn_in_tap", "mid": MID_TAP_OP_NAME,
                 "mlp_in": "vllm_lens::mlp_in_tap",
                 "act": ACT_TAP_OP_NAME,
                 "attn_block": "vllm_lens::attn_block_tap",
                 "mlp_block": "vllm_lens::mlp_block_tap", "router": "vllm_lens::router_tap",
                 "final": "vllm_lens::final_norm_tap",
                 "attn_post_norm": "vllm_lens::attn_post_norm_tap",
                 "mlp_post_norm": "vllm_lens::mlp_post_norm_tap",
                 "q_norm": "vllm_lens::q_norm_tap", "k_norm": "vllm_lens::k_norm_tap"}
#: Every custom op vllm-lens puts in the traced graph.
TAP_OPS = (PRE_TAP_OP_NAME, *SITE_OP_NAMES.values(), TAP_OP_NAME)
