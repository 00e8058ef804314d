"""A ``Layout`` derived from the module tree vLLM built, for a model class without a written
row (runs in: worker).

What is derived, from the constructed model (before its weights load):

- the decoder layers: the longest ``nn.ModuleList`` whose every entry holds exactly one of
  vLLM's ``Attention`` modules;
- the attention block: the child of the layer that holds that ``Attention`` module;
- whether the layers pass a separate residual along (``fused_residual``): their ``forward``
  takes a ``residual`` argument and hands it to a norm before the MLP;
- the module called on ``resid_mid`` (``Layout.mid``) and the MLP block, from the order of
  ``self.<child>(...)`` calls in the layer's ``forward`` (read with ``ast``): in a fused layer,
  the first norm called with two arguments after the attention block; in a split one, the
  last norm called between the attention block and the next non-norm child, which is the MLP;
  in a post-norm one (no norm before the attention block, one after it and one after the MLP:
  OLMo 2, EXAONE 4) the MLP itself reads ``resid_mid`` and the two norms' outputs are what is
  added (``attn_out``, ``mlp_out``).

Nothing derived is trusted: ``worker.layout_check`` proves the layout on the model's own
weights before a lens request is served, and refuses what it cannot prove. A derived layout
offers the stream points (``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``,
``resid_post``) and the attention kernel's Q/K/``attn_z``; it offers no ``mlp_post`` and no
``router_logits`` (no invariant proves an activation or a router module yet).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn

from vllm_lens.worker.layouts import Layout

__all__ = ["Derivation", "derive_layout"]


@dataclass(frozen=True)
class Derivation:
    """A derived layout, or why none could be derived."""

    layout: Layout | None
    reason: str | None = None


def derive_layout(model: nn.Module, attention_cls: type | None = None) -> Derivation:
    """``model``'s layout as far as its module tree shows it (never raises).
    ``attention_cls``: the attention kernel's module class (vLLM's ``Attention``)."""
    try:
        if attention_cls is None:
            from vllm.model_executor.layers.attention.attention import Attention as attention_cls
        return _derive(model, attention_cls)
    except Exception as exc:  # noqa: BLE001 -- an unusual tree is a refusal, not a crash
        return Derivation(None, f"its layout could not be derived ({exc!r})")


def _derive(model: nn.Module, Attention: type) -> Derivation:  # noqa: N803 -- a class
    found = _decoder_layers(model, Attention)
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
    before_attn, after = calls[:names.index(attn_child)], calls[names.index(attn_child) + 1:]
    children = dict(layer.named_children())
    norm = {name for name, module in children.items() if _is_norm(module)}
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
            mlp_block=mlp_norm, derived=True))
    if fused:
        mid = next((name for name, n_args in before_mlp if name in norm and n_args >= 2), None)
    else:
        mid = next((name for name, _ in reversed(before_mlp) if name in norm), None)
    if mid is None:
        return Derivation(None, f"no norm before self.{mlp} takes the residual stream")
    sandwich = any(name in norm and name != mid for name, _ in before_mlp)
    layout = Layout(
        layers=path, block="sequential", norms="sandwich" if sandwich else "pre",
        fused_residual=fused, mid=mid, attention=attention, act=None, down_proj=None,
        attn_block=None if fused else attn_child, mlp_block=None if fused else mlp,
        derived=True)
    return Derivation(layout)


def _decoder_layers(model: nn.Module, attention_cls: type) -> tuple[str, nn.ModuleList] | None:
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        from vllm.model_executor.models.utils import PPMissingLayer

        owned = [m for m in module if not isinstance(m, PPMissingLayer)]
        if owned and all(_attention_count(m, attention_cls) == 1 for m in owned):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    return best


def _attention_count(layer: nn.Module, attention_cls: type) -> int:
    return sum(isinstance(m, attention_cls) for m in layer.modules())


def _attention_path(layer: nn.Module, attention_cls: type) -> str | None:
    return next((name for name, m in layer.named_modules() if isinstance(m, attention_cls)),
                None)


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
