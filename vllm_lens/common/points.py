"""Tap points of a decoder layer: their names, aliases and where each is read (runs in: front end,
worker).

The front end validates requests with it; workers route taps.

Per decoder layer ``L`` (TransformerLens names)::

    resid_pre -> norm -> attn_in -> attention ([q/k_pre_norm -> q/k norm -> q/k_normed
              -> RoPE ->] attn_q, attn_k, value, attn_z)
              [-> attn_out_pre_norm -> post-norm] -> attn_out -> resid_mid
              -> norm -> mlp_in -> MLP (mlp_post) [-> mlp_out_pre_norm -> post-norm]
              -> mlp_out -> resid_post

A point is read at one of the *sites* inside the traced model, each a tap op that receives
two tensors ``(a, b)``: ``b`` is the fused residual where the model keeps one apart (Llama,
Qwen2, Gemma), else ``None``. A point's value is ``a`` or ``a + b``:

========== ====== ================================ ===========================================
point      site   value                            what it is
========== ====== ================================ ===========================================
resid_pre  pre    ``a + b``                        the stream entering the layer
attn_in    attn_in ``a``                           what attention reads (after its norm)
attn_out   mid    ``a``                            what attention adds (after o_proj)
resid_mid  mid    ``a + b``                        ``resid_pre + attn_out``
mlp_in     mlp_in ``a``                            what the MLP reads (after its norm)
mlp_out    post   ``a``                            what the MLP adds
resid_post post   ``a + b``                        the stream leaving the layer
mlp_post   act    ``a``                            the MLP's activation, input of down_proj
attn_z     attn   the attention kernel's output    per head, input of o_proj
attn_q/k   attn   the attention kernel's inputs    per head, post-RoPE
value      attn   the attention kernel's input     V per key/value head
router_... router the MoE router's output          ``router_logits``, per expert
final_norm final  the final norm's output          what the LM head reads (last layer only)
========== ====== ================================ ===========================================

Blocks that add to the stream inside the layer (GPT-2, GPT-NeoX, OLMo 2: *split* layouts)
have no fused residual to read ``attn_out`` and ``mlp_out`` beside: there they are read at
the outputs of the attention block (``attn_block``) and of the MLP (``mlp_block``), and the
``mid`` site is the MLP's input (``resid_mid`` alone). Parallel blocks (GPT-NeoX) have no
``mid`` site: attention and the MLP both read ``resid_pre``, so there is no ``resid_mid``.
``attn_in`` is read at the output of the norm before attention, where a written layout names
it (``Layout.attn_in``): the norm's output, with its weight (nnsight's
``input_layernorm.output``). TransformerLens' ``hook_attn_in`` is another tensor (the stream
before that norm, per head, with ``use_attn_in``), so that name is refused, not aliased.
Post-norm layers (OLMo 2) have no norm before attention: their attention reads ``resid_pre``.
``mlp_in`` is read at the output of the module the ``mid`` site taps the input of (the norm
before the MLP), where a written layout says that output is what the MLP reads
(``Layout.mlp_in``). ``hook_mlp_in`` names it as sae-lens' transcoders (Gemma Scope 2's)
use the name: the norm's output, with its weight; TransformerLens' own ``hook_mlp_in`` is the
block's input before ``ln2`` (that is ``resid_mid`` here), and ``ln2.hook_normalized`` (before
the norm's weight) is not a point here.
``value`` is V exactly as the attention kernel receives it, ``[key/value heads, head_dim]``
per row (after a family's V norm, where it has one): TransformerLens'
``blocks.L.attn.hook_v`` (per key/value head, as TransformerLens keeps it for grouped-query
attention); in nnsight, the V the attention function receives, viewed per head (``v_proj``'s
output where V is not fused with Q/K and not normed). It is read where Q and K are
(tap key ``attn_v``, before the kernel runs), so attention probabilities from ``attn_q`` and
``attn_k`` times ``value`` give ``attn_z``.
``final_norm`` is read once per row, at the output of the model's final norm (site ``final``,
with the last layer's index): what the LM head reads, nnsight's ``model.norm.output``.
TransformerLens' ``ln_final.hook_normalized`` is that norm before its weight, so it is not an
alias; ``run_with_cache`` names the point ``final_norm``.
``attn_out_pre_norm`` and ``mlp_out_pre_norm`` are the attention block's and the MLP's own
outputs where a norm follows them before the stream receives them (sandwich layers: Gemma 2/3/4,
GLM-4; post-norm layers: OLMo 2/3, EXAONE 4), read at that norm's input (sites ``attn_post_norm``,
``mlp_post_norm``): nnsight's ``self_attn.output`` and ``mlp.output``. ``attn_out`` and
``mlp_out`` stay what is added, after the norm, as in transformers and TransformerLens (which
has no hook before the norm). Elsewhere the two would equal ``attn_out`` and ``mlp_out``, and
they are not offered. Read-only.
``q_pre_norm`` / ``q_normed`` and ``k_pre_norm`` / ``k_normed`` are Q and K per head before
and after the family's own norm of them (Qwen3, Gemma 3/4, OLMo 2/3, OLMoE, EXAONE 4: the
input and output of ``q_norm`` / ``k_norm``, read at one site each), so before RoPE, where
``attn_q`` / ``attn_k`` are what the kernel receives, after it; nnsight's
``self_attn.q_norm.input`` and ``.output``. Read-only, split across tensor-parallel ranks by
head like Q and K; a norm that spans every head at once (OLMo 2/3, OLMoE: vLLM gathers the
heads of every rank for it) is tapped only without tensor parallelism.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ATTENTION_SIGNALS", "ATTENTION_TAP_KEYS", "DLA_PREFIX", "FINAL_POINT", "KV_HEAD_SIGNALS",
    "POINTS",
    "QK_HOOK_POINT", "QK_NORM_POINTS", "RESIDUAL_SIGNAL", "SHARDED", "SITES", "STEERABLE",
    "Point", "hook_name",
    "hook_site", "operands", "resolve", "shard_dim", "site_of", "tap_key",
]

#: Where taps run, in the order a layer reaches them.
SITES = ("pre", "attn_in", "q_norm", "k_norm", "attn", "attn_post_norm", "attn_block", "mid",
         "mlp_in", "router", "act", "mlp_post_norm", "mlp_block", "post", "final")


@dataclass(frozen=True)
class Point:
    name: str
    site: str
    with_residual: bool
    """The value is ``a + b`` (the full stream), not ``a`` alone."""
    steerable: bool
    split_site: str | None = None
    """Where the point is read in split layouts, if not at ``site``."""
    from_input: bool = False
    """The value is ``b``, what the site's module was called with (``a``: what it returned)."""


POINTS: dict[str, Point] = {p.name: p for p in (
    Point("resid_pre", "pre", True, True),
    Point("attn_in", "attn_in", False, True),
    Point("attn_out", "mid", False, True, split_site="attn_block"),
    Point("resid_mid", "mid", True, True),
    Point("mlp_in", "mlp_in", False, True),
    Point("mlp_out", "post", False, True, split_site="mlp_block"),
    Point("resid_post", "post", True, True),
    Point("mlp_post", "act", False, False),
    Point("attn_z", "attn", False, False),
    Point("value", "attn", False, False),
    Point("router_logits", "router", False, False),
    Point("final_norm", "final", False, False),
    Point("attn_out_pre_norm", "attn_post_norm", False, False),
    Point("mlp_out_pre_norm", "mlp_post_norm", False, False),
    Point("q_pre_norm", "q_norm", False, False, from_input=True),
    Point("q_normed", "q_norm", False, False),
    Point("k_pre_norm", "k_norm", False, False, from_input=True),
    Point("k_normed", "k_norm", False, False),
)}
#: Q and K before and after a family's norms of them: per head, read-only.
QK_NORM_POINTS = ("q_pre_norm", "q_normed", "k_pre_norm", "k_normed")
#: The point read once, after the last decoder layer (its only layer is the last).
FINAL_POINT = "final_norm"
#: Points steering vectors and hooks may write to (each is a ``[n_tokens, hidden]`` stream).
STEERABLE = tuple(name for name, p in POINTS.items() if p.steerable)
#: A hook point that reads the attention kernel's Q (as ``hidden``) and K (``ctx.key``), with
#: the layer's ``ctx.attention`` metadata; such hooks may not replace anything.
QK_HOOK_POINT = "attn_qk"
#: The signal ``output_residual_stream`` captures (at ``resid_post``).
RESIDUAL_SIGNAL = "residual_stream"
#: Signals read from the attention kernel's inputs (``output_qk``).
ATTENTION_SIGNALS = ("attn_q", "attn_k")
#: Signals each tensor-parallel rank holds a part of (heads, or MLP columns): every rank
#: captures its part, and the front end joins them in rank order.
SHARDED = ("attn_q", "attn_k", "attn_z", "value", "mlp_post", *QK_NORM_POINTS)
#: Signals with one row part per key/value head: under tensor parallelism with fewer key/value
#: heads than ranks, several ranks hold the same head (kept once when the parts join).
KV_HEAD_SIGNALS = ("attn_k", "value", "k_pre_norm", "k_normed")


#: The signal of an SAE's feature capture: ``sae:<ident>:<point>`` (``spec.saes``).
SAE_PREFIX = "sae:"
#: The signal of a point's rows kept for a direct logit attribution: ``dla:<point>``
#: (``spec.logit_attribution``); they never leave the worker.
DLA_PREFIX = "dla:"


def base_signal(signal: str) -> str:
    """The tap point an SAE feature capture (or a logit attribution) reads, or ``signal``
    itself.

    >>> base_signal("sae:0123abcd:resid_post"), base_signal("attn_out")
    ('resid_post', 'attn_out')
    >>> base_signal("dla:mlp_out")
    'mlp_out'
    """
    return (signal.rsplit(":", 1)[1] if signal.startswith((SAE_PREFIX, DLA_PREFIX))
            else signal)


def shard_dim(signal: str) -> int:
    """The dimension (from the end) along which a sharded signal's parts join."""
    return -1 if signal == "mlp_post" else -2

# Aliases: TransformerLens hook names and the RhizoNymph fork's three points.
_ALIASES = {
    "pre_attn": "resid_pre", "post_attn": "resid_mid", "post_block": "resid_post",
    "attn.hook_z": "attn_z", "hook_z": "attn_z", "z": "attn_z",
    "mlp.hook_post": "mlp_post", "hook_mlp_post": "mlp_post",
    "attn.hook_v": "value", "hook_v": "value", "v": "value", "attn_v": "value",
}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
#: TransformerLens names that would resolve to a point reading another tensor.
_NOT_OURS = {
    "hook_attn_in": "TransformerLens' stream before ln1, copied per head (use resid_pre); "
                    "vllm-lens' attn_in is the pre-attention norm's output: name it attn_in",
}
#: TransformerLens names outside the blocks that would read another tensor.
_NOT_OURS_TOP = {
    "ln_final.hook_normalized": "TransformerLens' final norm before its weight; vllm-lens' "
                                "final_norm is the norm's output, with its weight: name it "
                                "final_norm",
}


def resolve(name: str) -> tuple[str, int | None]:
    """``(point, layer)`` named by ``name``; ``layer`` is set by ``blocks.{L}.`` names.

    >>> resolve("attn_out"), resolve("hook_resid_mid"), resolve("blocks.3.hook_attn_out")
    (('attn_out', None), ('resid_mid', None), ('attn_out', 3))
    >>> resolve("post_block"), resolve("blocks.0.attn.hook_z"), resolve("blocks.2.attn.hook_v")
    (('resid_post', None), ('attn_z', 0), ('value', 2))

    Raises:
        KeyError: not a tap point (the message lists them).
    """
    layer = None
    text = name.strip() if isinstance(name, str) else name
    if isinstance(text, str) and (m := _BLOCK.match(text)):
        layer, text = int(m.group(1)), m.group(2)
    if isinstance(text, str) and text in _NOT_OURS:
        raise KeyError(f"{name!r} is {_NOT_OURS[text]}")
    if isinstance(text, str) and layer is None and text in _NOT_OURS_TOP:
        raise KeyError(f"{name!r} is {_NOT_OURS_TOP[text]}")
    if isinstance(text, str):
        text = _ALIASES.get(text, text)
        if text.startswith("hook_"):
            text = _ALIASES.get(text, text.removeprefix("hook_"))
    if not isinstance(text, str) or text not in POINTS:
        raise KeyError(f"unknown tap point {name!r}; use one of {', '.join(POINTS)} (or "
                       "hook_<point>, blocks.<layer>.hook_<point>, pre_attn, post_attn, "
                       "post_block)")
    return text, layer


def hook_name(point: str, layer: int) -> str:
    """TransformerLens' (and so sae-lens') name of ``point`` at ``layer`` (``attn_in``, which
    TransformerLens has no hook for, keeps its own name: ``blocks.L.attn_in``; ``final_norm``,
    after every block, is ``final_norm``).

    >>> hook_name("resid_post", 12), hook_name("attn_z", 3), hook_name("mlp_post", 0)
    ('blocks.12.hook_resid_post', 'blocks.3.attn.hook_z', 'blocks.0.mlp.hook_post')
    >>> hook_name("value", 2), hook_name("final_norm", 29)
    ('blocks.2.attn.hook_v', 'final_norm')
    """
    if point == FINAL_POINT:  # one per model: no block
        return FINAL_POINT
    inner = {"attn_z": "attn.hook_z", "attn_q": "attn.hook_q", "attn_k": "attn.hook_k",
             "value": "attn.hook_v", "mlp_post": "mlp.hook_post",
             # TransformerLens' hook_attn_in reads another tensor (``_NOT_OURS``).
             "attn_in": "attn_in"}.get(point, f"hook_{point}")
    return f"blocks.{layer}.{inner}"


def hook_site(point: str, *, split: bool) -> str:
    """The site a hook at ``point`` (``STEERABLE`` or ``QK_HOOK_POINT``) runs at, in a split
    layout if ``split``."""
    return "attn" if point == QK_HOOK_POINT else site_of(point, split=split)


def tap_key(signal: str, *, split: bool) -> str:
    """Which tap call reads ``signal``: its site, except that ``attn_z`` is read after the
    attention kernel ran (``"attn_z"``), Q/K before (``"attn"``) and ``value`` beside them
    (``"attn_v"``).

    >>> tap_key("value", split=False), tap_key("attn_k", split=True)
    ('attn_v', 'attn')
    """
    signal = base_signal(signal)
    return _ATTENTION_KEYS.get(signal) or site_of(signal, split=split)


#: The attention wrappers' tap keys (``worker.attention_taps``), each read on the ``attn`` site.
_ATTENTION_KEYS = {"attn_z": "attn_z", "value": "attn_v"}
ATTENTION_TAP_KEYS = ("attn", *_ATTENTION_KEYS.values())


def operands(signal: str, a, b):
    """The tensors whose sum is ``signal``'s value, from a tap's two (``(q, k)`` at the
    ``attn`` site): ``(a, b)``, ``(a, None)`` or ``(b, None)``."""
    signal = base_signal(signal)
    if signal == "attn_k" or (signal in POINTS and POINTS[signal].from_input):
        return b, None
    if signal == RESIDUAL_SIGNAL or (signal in POINTS and POINTS[signal].with_residual):
        return a, b
    return a, None


def site_of(signal: str, *, split: bool) -> str:
    """The site a captured signal is read at (in a split layout if ``split``)."""
    if signal == RESIDUAL_SIGNAL:
        return "post"
    if signal in ATTENTION_SIGNALS:
        return "attn"
    point = POINTS[signal]
    return (point.split_site or point.site) if split else point.site
