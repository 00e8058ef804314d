"""A ``Layout`` derived from the module tree vLLM built, for a model class without a written
row (runs in: worker).

What is derived, from the constructed model (before its weights load):

- the decoder layers: the longest ``nn.ModuleList`` whose every entry holds exactly one of
  vLLM's attention kernel modules (``Attention``, or ``MLAAttention`` for latent attention);
- the attention block: the child of the layer that holds that ``Attention`` module;
- whether the layers pass a separate residual along (``fused_residual``): their ``forward``
  takes a ``residual`` argument and hands it to a norm before the MLP;
- the module called on ``resid_mid`` (``Layout.mid``) and the MLP block, from the order of
  ``self.<child>(...)`` calls in the layer's ``forward`` (read with ``ast``): in a fused layer,
  the first norm called with two arguments after the attention block; in a split one, the
  last norm called between the attention block and the next non-norm child, which is the MLP;
  in a post-norm one (no norm before the attention block, one after it and one after the MLP:
  OLMo 2, EXAONE 4) the MLP itself reads ``resid_mid`` and the two norms' outputs are what is
  added (``attn_out``, ``mlp_out``);
- the norms after the attention block and after the MLP, where a layer has them (sandwich:
  a norm between attention and ``mid``, and the first norm after the MLP): their inputs are
  ``attn_out_pre_norm`` and ``mlp_out_pre_norm``, and in a split layer their outputs are what
  is added.

A hybrid (Granite 4, Nemotron-H: attention layers among Mamba or MLP-only layers, of several
classes) has no list whose every entry holds attention; the longest list whose entries each
hold at most one kernel, some none, gets a stream-only layout (``Layout.stream_only``): the
layers' inputs and outputs, handed on fused where every class passes the residual to a norm.
Where those layers keep a recurrent state (Mamba, gated delta-net) no layout is derived: the
start-up check cannot run over it, so the model stays untapped and its plain traffic pays
nothing.

Nothing derived is trusted: ``worker.layout_check`` proves the layout on the model's own
weights before a lens request is served, and refuses what it cannot prove. A derived layout
offers the stream points (``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``,
``resid_post``), ``final_norm``, the attention kernel's Q/K, ``value`` and ``attn_z``, and on
pre-norm and sandwich layers ``attn_in`` (the output of the last norm called before the
attention block) and ``mlp_in`` (the output of ``mid``), each proven to be what its block
reads, and where a norm follows a block (sandwich and post-norm layers)
``attn_out_pre_norm`` / ``mlp_out_pre_norm`` at that norm's input, each proven to be what the
block returned, and where the attention block has norms named ``q_norm`` / ``k_norm`` Q and K
before and after them (proven by the per-head lengths RoPE keeps); it offers no ``mlp_post`` and no ``router_logits`` (no invariant proves an activation or
a router module yet). Q/K, ``value`` and ``attn_z`` are tapped only at vLLM's plain ``Attention``
kernel (not latent or chunked attention).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn

from vllm_lens.worker.layouts import Layout

__all__ = ["Derivation", "attention_kernels", "derive_layout", "recurrent_state_reason"]


@dataclass(frozen=True)
class Derivation:
    """A derived layout, or why none could be derived."""

    layout: Layout | None
    reason: str | None = None


def derive_layout(model: nn.Module, attention_cls: type | tuple[type, ...] | None = None
                  ) -> Derivation:
    """``model``'s layout as far as its module tree shows it (never raises).
    ``attention_cls``: the attention kernel's module classes (``attention_kernels()``)."""
    try:
        return _derive(model, attention_cls or attention_kernels())
    except Exception as exc:  # noqa: BLE001 -- an unusual tree is a refusal, not a crash
        return Derivation(None, f"its layout could not be derived ({exc!r})")


def attention_kernels() -> tuple[type, ...]:
    """vLLM's attention kernel modules a decoder layer may hold: ``Attention`` (and its
    subclasses: chunked local attention) and ``MLAAttention`` (multi-head latent attention:
    DeepSeek-V2/V3, Kimi). Only plain ``Attention`` gets Q/K, ``value`` and ``attn_z`` taps
    (``worker.taps``); the others locate the attention block, and its sums are proven like any
    other."""
    from vllm.model_executor.layers.attention.attention import Attention

    kernels: tuple[type, ...] = (Attention,)
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:  # a vLLM without latent attention
        return kernels
    return (*kernels, MLAAttention)


def _derive(model: nn.Module,
            Attention: type | tuple[type, ...]) -> Derivation:  # noqa: N803 -- classes
    found = _decoder_layers(model, Attention)
    hybrid = _decoder_layers(model, Attention, hybrid=True)
    # The decoder is the longer list: a short all-attention list beside a hybrid's (a
    # multi-token-prediction head's layers, say) is not the model's stack.
    if hybrid is not None and (found is None or len(hybrid[1]) > len(found[1])):
        return _stream_only(*hybrid, Attention)
    if found is None:
        return Derivation(None, "no list of decoder layers each holding one vLLM attention "
                                "module was found")
    path, layers = found
    layer = next(m for m in layers if _attention_path(m, Attention) is not None)
    attention = _attention_path(layer, Attention)
    attn_child = attention.split(".")[0]
    cls = type(layer)
    params = list(inspect.signature(cls.forward).parameters)
    if "hidden_states" not in params:
        return Derivation(None, f"{cls.__name__}.forward takes no hidden_states")
    calls = _self_calls(cls)
    names = [name for name, _ in calls]
    if attn_child not in names:
        return Derivation(None, f"{cls.__name__}.forward does not call self.{attn_child}")
    # A layer may call its attention block from two branches (DeepSeek-V2: with and without
    # a scaling argument): what follows the last call is what follows attention.
    last = len(names) - 1 - names[::-1].index(attn_child)
    before_attn, after = calls[:names.index(attn_child)], calls[last + 1:]
    children = dict(layer.named_children())
    norm = {name for name, module in children.items() if _is_norm(module)}
    # A norm called before attention in one branch and after it in another (OPT: its config
    # picks pre- or post-norm) leaves the layout to the config, which the source does not say.
    twice = sorted({name for name, _ in before_attn if name in norm}
                   & {name for name, _ in after if name in norm})
    if twice:
        return Derivation(None, f"{cls.__name__}.forward calls self.{twice[0]} both before "
                                f"and after self.{attn_child} (branches its config picks)")
    mlp = next((name for name, _ in after if name in children and name not in norm), None)
    if mlp is None:
        return Derivation(None, f"no MLP block is called after self.{attn_child}")
    before_mlp = after[:[name for name, _ in after].index(mlp)]
    after_mlp = after[[name for name, _ in after].index(mlp) + 1:]
    # A fused layer hands a residual to a norm that adds it (``norm(x, residual)``).
    fused = "residual" in params and any(name in norm and n_args >= 2
                                         for name, n_args in before_mlp)
    if (not fused and not any(name in norm for name, _ in before_attn)
            and any(name in norm for name, _ in before_mlp)
            and any(name in norm for name, _ in after_mlp)):
        # Post-norm (OLMo 2, EXAONE 4): each sublayer's output is normed, then added, so
        # what is added is the norms' outputs and resid_mid is what the MLP reads.
        attn_norm = next(name for name, _ in before_mlp if name in norm)
        mlp_norm = next(name for name, _ in after_mlp if name in norm)
        return Derivation(Layout(
            layers=path, block="sequential", norms="post", fused_residual=False, mid=mlp,
            attention=attention, act=None, down_proj=None, attn_block=attn_norm,
            mlp_block=mlp_norm, attn_post_norm=attn_norm, mlp_post_norm=mlp_norm,
            q_norm=_child_norm(layer, attn_child, "q_norm"),
            k_norm=_child_norm(layer, attn_child, "k_norm"), mlp_module=mlp, derived=True))
    if fused:
        mid = next((name for name, n_args in before_mlp if name in norm and n_args >= 2), None)
    else:
        mid = next((name for name, _ in reversed(before_mlp) if name in norm), None)
    if mid is None:
        return Derivation(None, f"no norm before self.{mlp} takes the residual stream")
    sandwich = any(name in norm and name != mid for name, _ in before_mlp)
    # What attention reads: the output of the last norm called before it (the start-up check
    # compares it with the attention block's input); what the MLP reads: ``mid``'s output.
    attn_in = next((name for name, _ in reversed(before_attn) if name in norm), None)
    # The norms after attention and after the MLP, where the layer has them (sandwich): the
    # blocks' own outputs are read at their inputs.
    attn_post_norm = next((name for name, _ in before_mlp[:[n for n, _ in before_mlp]
                                                         .index(mid)] if name in norm), None)
    mlp_post_norm = next((name for name, _ in after_mlp if name in norm), None)
    q_norm, k_norm = (_child_norm(layer, attn_child, name) for name in ("q_norm", "k_norm"))
    layout = Layout(
        layers=path, block="sequential", norms="sandwich" if sandwich else "pre",
        fused_residual=fused, mid=mid, attention=attention, act=None, down_proj=None,
        # A split layer adds what its blocks return, or (sandwich) what the norms after them
        # return: attn_out and mlp_out are read there.
        attn_block=None if fused else attn_post_norm or attn_child,
        mlp_block=None if fused else mlp_post_norm or mlp,
        attn_in=attn_in, mlp_in=True, attn_post_norm=attn_post_norm,
        mlp_post_norm=mlp_post_norm, q_norm=q_norm, k_norm=k_norm, mlp_module=mlp,
        derived=True)
    return Derivation(layout)


def _stream_only(path: str, layers: nn.ModuleList, Attention) -> Derivation:  # noqa: N803
    """A hybrid's layout (attention layers among Mamba, linear-attention or MLP-only layers,
    often of several classes): the stream at the layer boundaries only. Every layer class must
    hand the stream on the same way: as ``(hidden, residual)`` added in the next layer's norm
    (``fused_residual``: each calls a norm with the residual), or whole."""
    from vllm.model_executor.models.utils import PPMissingLayer

    if (why := recurrent_state_reason(layers)) is not None:
        return Derivation(None, f"{why}, so no layout of it can be proven at start-up")
    classes = {type(m) for m in layers if not isinstance(m, PPMissingLayer)}
    fused = set()
    for cls in classes:
        params = list(inspect.signature(cls.forward).parameters)
        if "hidden_states" not in params:
            return Derivation(None, f"{cls.__name__}.forward takes no hidden_states")
        norms = {name for layer in layers if type(layer) is cls
                 for name, module in layer.named_children() if _is_norm(module)}
        fused.add("residual" in params and any(name in norms and n_args >= 2
                                               for name, n_args in _self_calls(cls)))
    if len(fused) != 1:
        return Derivation(None, "its layer classes hand the residual stream on in different "
                                "ways")
    layer = next(m for m in layers if _attention_path(m, Attention) is not None)
    return Derivation(Layout(
        layers=path, block="sequential", norms="pre", fused_residual=fused.pop(), mid=None,
        attention=_attention_path(layer, Attention), act=None, down_proj=None, derived=True,
        stream_only=HYBRID))


#: Why a hybrid's layout offers only the stream between layers.
HYBRID = ("its decoder layers mix attention with other mixers (Mamba, linear attention or "
          "MLP-only layers): only the stream between layers (resid_pre, resid_post) is derived")


def recurrent_state_reason(modules: nn.Module) -> str | None:
    """Why a start-up check's pass may not run over ``modules``, if they hold layers with
    recurrent state (vLLM's ``MambaBase``: Mamba, gated delta-net, linear attention): vLLM's
    dummy pass reads their cached state (measured: a Granite 4 Mamba layer gave NaN in it, on
    some starts) and could write to the state of requests in flight."""
    try:
        from vllm.model_executor.layers.mamba.abstract import MambaBase
    except ImportError:
        return None
    kinds = sorted({type(m).__name__ for m in modules.modules() if isinstance(m, MambaBase)})
    if not kinds:
        return None
    return (f"its layers keep a recurrent state ({', '.join(kinds)}), which vLLM's dummy "
            "forward pass would read and write")


def _decoder_layers(model: nn.Module, attention_cls: type | tuple[type, ...], *,
                    hybrid: bool = False) -> tuple[str, nn.ModuleList] | None:
    """The longest module list whose every entry holds one attention kernel module; with
    ``hybrid``, whose entries hold at most one, some none and some one (a hybrid's layers)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        counts = [_attention_count(m, attention_cls) for m in module
                  if not isinstance(m, PPMissingLayer)]
        if not counts:
            continue
        if hybrid:
            fits = set(counts) == {0, 1} and all(
                "hidden_states" in inspect.signature(type(m).forward).parameters
                for m in module if not isinstance(m, PPMissingLayer))
        else:
            fits = set(counts) == {1}
        if fits and (best is None or len(module) > len(best[1])):
            best = (name, module)
    return best


def _attention_count(layer: nn.Module, attention_cls: type | tuple[type, ...]) -> int:
    return sum(isinstance(m, attention_cls) for m in layer.modules())


def _attention_path(layer: nn.Module, attention_cls: type | tuple[type, ...]) -> str | None:
    return next((name for name, m in layer.named_modules() if isinstance(m, attention_cls)),
                None)


def _child_norm(layer: nn.Module, block: str, name: str) -> str | None:
    """``block.name`` where the attention block has a norm of that name (its Q or K norm)."""
    found = getattr(getattr(layer, block, None), name, None)
    return f"{block}.{name}" if isinstance(found, nn.Module) and _is_norm(found) else None


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _self_calls(cls: type) -> list[tuple[str, int]]:
    """``(child, positional args)`` of every ``self.<child>(...)`` call in ``cls.forward``, in
    the order they run: by where each call ends, so that in ``self.a(self.b(x))`` ``b`` comes
    first (a call taking ``residual=`` by keyword counts it as a second argument)."""
    source = textwrap.dedent(inspect.getsource(cls.forward))
    calls: list[tuple[int, int, str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            n_args = len(node.args) + sum(k.arg == "residual" for k in node.keywords)
            calls.append((node.end_lineno, node.end_col_offset, node.func.attr, n_args))
    return [(name, n) for _, _, name, n in sorted(calls)]
