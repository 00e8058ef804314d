"""Where each proven model family keeps what vllm-lens taps (runs in: worker).

One row per vLLM model class, read by ``worker.taps`` when the model is constructed. Anything
not in ``LAYOUTS`` is unmapped: its plain requests serve, and lens requests are refused with
an error naming the class. A class joins the table only with a test in
``tests/integration/test_families.py`` that checks it against transformers.

Paths are dotted attribute paths, from the model for ``layers`` and from one decoder layer
for the rest; ``None`` means the family has no such module (its points are refused).

Models vLLM runs through its Transformers modeling backend (``TransformersForCausalLM``) are
keyed ``"TransformersForCausalLM:<transformers architecture>"``: their layers are
transformers' own modules (with vLLM's linear layers and attention inside), so the paths are
transformers' names; their tensors carry a leading batch dimension of 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["LAYOUTS", "Layout", "derivable", "final_norm_of", "layout_of", "model_key",
           "unmapped_reason"]


@dataclass(frozen=True)
class Layout:
    """The shape of one family's decoder layer, and where its parts are."""

    layers: str
    """The ``nn.ModuleList`` of decoder layers."""
    block: str
    """``sequential`` (attention, then the MLP on its result) or ``parallel`` (both read the
    layer's input: there is no ``resid_mid``)."""
    norms: str
    """``pre``, ``post`` (OLMo 2: after each sublayer, inside its branch) or ``sandwich``
    (Gemma 2/3: both). Documentation only: the taps sit where the stream is added to."""
    fused_residual: bool
    """The layers pass ``(hidden, residual)`` along and add them in the next norm (Llama);
    otherwise they add to the stream themselves (a *split* layout, ``points``)."""
    mid: str | None
    """The module called on ``resid_mid`` before the MLP: fused layouts call it as
    ``module(attn_out, resid_pre)`` (the add + norm), split ones as ``module(resid_mid)``."""
    attention: str
    """vLLM's ``Attention`` module: Q/K and ``attn_z`` are read around its kernel."""
    act: str | None
    """The MLP's activation module, whose output is ``mlp_post`` (``None`` for MoE)."""
    down_proj: str | None
    """The MLP's output projection (its ``input_size`` is d_mlp)."""
    attn_block: str | None = None
    """Split layouts: the module whose output is ``attn_out``."""
    mlp_block: str | None = None
    """Split layouts: the module whose output is ``mlp_out``."""
    router: str | None = None
    """MoE: the gate whose output is ``router_logits``. Offered only if every layer has one
    (models mixing dense and MoE layers get no ``router_logits``)."""
    routing: str | None = None
    """How the router picks experts, when ``router_experts`` can be derived from the logits:
    ``softmax_topk`` (the top ``num_experts_per_tok`` of the softmaxed logits)."""
    batched: bool = False
    """The layers' tensors carry a leading batch dimension of 1 (the Transformers backend)."""
    requires: tuple[str, object] | None = None
    """(config attribute, value) the layout holds for; other configs are unmapped."""
    mlp_in: bool = False
    """The ``mid`` module's output (its first element, in a fused layout) is what the MLP
    reads: ``mlp_in`` is tapped there. Written rows are proven against transformers
    (``tests/integration/test_families.py``); a derived layout's by the start-up check ("the
    MLP reads mlp_in", at ``mlp_module``). Not where the MLP reads ``resid_mid`` itself
    (post-norm layers) or there is no ``mid`` module (parallel blocks)."""
    stream_only: str | None = None
    """Why only the stream between layers (``resid_pre``, ``resid_post``) is offered, if so:
    a hybrid's layers (attention among Mamba or linear-attention layers) are derived no
    further; every inner point is refused with this reason."""
    attn_in: str | None = None
    """The norm before attention, whose output (its first element, in a fused layout) is what
    attention reads: ``attn_in`` is tapped there. Written rows are proven against
    transformers; a derived layout's by the start-up check ("attention reads attn_in": the
    attention block's input is the tapped tensor). Not on post-norm layers (their attention
    reads ``resid_pre``)."""
    attn_post_norm: str | None = None
    """The norm after the attention block (sandwich and post-norm layers), whose input is
    ``attn_out_pre_norm``: written rows are proven against transformers, a derived layout's
    by the start-up check ("attention returns attn_out_pre_norm")."""
    mlp_post_norm: str | None = None
    """The norm after the MLP, whose input is ``mlp_out_pre_norm`` (as ``attn_post_norm``)."""
    q_norm: str | None = None
    """The attention block's norm of Q, where a family has one (``q_pre_norm`` is its input,
    ``q_normed`` its output); a layer without the module gets neither. Written rows are
    proven against transformers, a derived layout's by the start-up check ("the kernel receives
    the normed Q, rotated")."""
    k_norm: str | None = None
    """The attention block's norm of K (``k_pre_norm``, ``k_normed``), as ``q_norm``."""
    mlp_module: str | None = None
    """Derived layouts: the MLP block, which should read ``mlp_in`` and return
    ``mlp_out_pre_norm`` (the start-up check compares its input and output with the taps).
    Written rows leave it unset: their points are proven by the test suite."""
    derived: bool = False
    """Derived from the module tree (``worker.layout_derivation``), not written here: served
    only once ``worker.layout_check`` proved it on the model's weights."""

    @property
    def split(self) -> bool:
        return not self.fused_residual


#: Llama and the families that share its layer: pre-norm, fused residual, gated MLP.
_LLAMA = Layout(layers="model.layers", block="sequential", norms="pre", fused_residual=True,
                mid="post_attention_layernorm", attention="self_attn.attn",
                act="mlp.act_fn", down_proj="mlp.down_proj", mlp_in=True,
                attn_in="input_layernorm",
                # Qwen3's q/k norms (Llama, Mistral, Phi-3 and Qwen2 have none)
                q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
#: Gemma 2 / 3: a norm before and after each sublayer; ``attn_out`` and ``mlp_out`` are what
#: is added to the stream, after the post-norms (as in transformers and TransformerLens).
_GEMMA = Layout(layers="model.layers", block="sequential", norms="sandwich",
                fused_residual=True, mid="pre_feedforward_layernorm",
                attention="self_attn.attn", act="mlp.act_fn", down_proj="mlp.down_proj",
                mlp_in=True, attn_in="input_layernorm",
                attn_post_norm="post_attention_layernorm",
                mlp_post_norm="post_feedforward_layernorm",
                q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
#: GPT-2: LayerNorm before each sublayer, the residual added inside the block.
_GPT2 = Layout(layers="transformer.h", block="sequential", norms="pre", fused_residual=False,
               mid="ln_2", attention="attn.attn", act="mlp.act", down_proj="mlp.c_proj",
               attn_block="attn", mlp_block="mlp", mlp_in=True, attn_in="ln_1")
#: Mixtral: Llama's layer with a sparse MoE block (no single activation: no ``mlp_post``).
_MIXTRAL = Layout(layers="model.layers", block="sequential", norms="pre", fused_residual=True,
                  mid="post_attention_layernorm", attention="self_attn.attn", act=None,
                  down_proj=None, router="block_sparse_moe.gate", routing="softmax_topk",
                  mlp_in=True, attn_in="input_layernorm")
#: Qwen2-MoE: routed experts plus a gated shared expert (``mlp_out`` is their sum).
_QWEN2_MOE = Layout(layers="model.layers", block="sequential", norms="pre",
                    fused_residual=True, mid="post_attention_layernorm",
                    attention="self_attn.attn", act=None, down_proj=None, router="mlp.gate",
                    routing="softmax_topk", mlp_in=True, attn_in="input_layernorm")

#: GPT-NeoX (Pythia), transformers' modules: attention and the MLP both read the layer's
#: input and are added to it together (``use_parallel_residual``).
_GPT_NEOX = Layout(layers="model.layers", block="parallel", norms="pre", fused_residual=False,
                   mid=None, attention="attention.attn", act="mlp.act",
                   down_proj="mlp.dense_4h_to_h", attn_block="attention", mlp_block="mlp",
                   requires=("use_parallel_residual", True), batched=True,
                   attn_in="input_layernorm")
#: OLMo 2, transformers' modules: each sublayer's output is normed before it is added.
_OLMO2 = Layout(layers="model.layers", block="sequential", norms="post", fused_residual=False,
                mid="mlp", attention="self_attn.attn", act="mlp.act_fn",
                down_proj="mlp.down_proj", attn_block="post_attention_layernorm",
                mlp_block="post_feedforward_layernorm", batched=True,
                attn_post_norm="post_attention_layernorm",
                mlp_post_norm="post_feedforward_layernorm",
                q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
#: SmolLM3, transformers' modules: Llama's pre-norm layer (some layers without RoPE), the
#: residual added inside the layer.
_SMOLLM3 = Layout(layers="model.layers", block="sequential", norms="pre", fused_residual=False,
                  mid="post_attention_layernorm", attention="self_attn.attn",
                  act="mlp.act_fn", down_proj="mlp.down_proj", attn_block="self_attn",
                  mlp_block="mlp", batched=True, mlp_in=True, attn_in="input_layernorm")

LAYOUTS: dict[str, Layout] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Phi3ForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,  # q/k norms sit inside attention, before the kernel
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "GPT2LMHeadModel": _GPT2,
    "MixtralForCausalLM": _MIXTRAL,
    "Qwen2MoeForCausalLM": _QWEN2_MOE,
    # Multimodal: Idefics3 builds a LlamaModel as its text model.
    "Idefics3ForConditionalGeneration": dataclasses.replace(
        _LLAMA, layers="model.text_model.layers"),
    "TransformersForCausalLM:GPTNeoXForCausalLM": _GPT_NEOX,
    "TransformersForCausalLM:Olmo2ForCausalLM": _OLMO2,
    # OLMo 3: OLMo 2's layer, with sliding windows on most layers.
    "TransformersForCausalLM:Olmo3ForCausalLM": _OLMO2,
    "TransformersForCausalLM:SmolLM3ForCausalLM": _SMOLLM3,
}


def model_key(model: object) -> str:
    """The ``LAYOUTS`` key of a constructed vLLM model: its class name, with the
    transformers architecture for the Transformers backend's generic classes."""
    name = type(model).__name__
    if name.startswith("Transformers"):
        architectures = getattr(getattr(model, "config", None), "architectures", None) or ["?"]
        return f"{name}:{architectures[0]}"
    return name


def layout_of(model: object) -> Layout | None:
    """``model``'s layout, or ``None`` when its class (or its config) is not mapped."""
    layout = LAYOUTS.get(model_key(model))
    if layout is not None and unmet_requirement(model, layout) is not None:
        return None
    return layout


def unmet_requirement(model: object, layout: Layout) -> str | None:
    """Why ``layout`` does not hold for ``model``'s config (``Layout.requires``), if so."""
    if layout.requires is None:
        return None
    attr, value = layout.requires
    found = getattr(getattr(model, "config", None), attr, None)
    return None if found == value else f"it is mapped only with {attr}={value} (got {found})"


def unmapped_reason(model: object) -> str | None:
    """Why ``model`` has no layout, for the refusal's message (``None`` if it has one)."""
    layout = LAYOUTS.get(model_key(model))
    if layout is None:
        return "its decoder layers are not mapped"
    return unmet_requirement(model, layout)


def derivable(model: object) -> bool:
    """Whether ``model``'s layout may be derived from its module tree: no row names its class,
    and it is not one of vLLM's Transformers-backend classes (their layers are transformers'
    modules, whose calling convention the derivation does not read)."""
    key = model_key(model)
    return key not in LAYOUTS and not key.startswith("Transformers")


#: What models name the norm after their last decoder layer (beside the layer list).
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f",
                     "final_norm")


def final_norm_of(model: Any, layers_path: str) -> Any:
    """The norm vLLM applies after the last decoder layer: the module beside the layer list
    (``layers_path``) named like one, or ``None``."""
    from torch import nn

    parent_path = layers_path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    for name in _FINAL_NORM_NAMES:
        module = getattr(parent, name, None)
        if isinstance(module, nn.Module):
            return module
    return None
