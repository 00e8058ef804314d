"""Tap ops in each decoder layer, inside the traced graph (runs in: worker).

PyTorch forward hooks do not fire in vLLM's compiled model, so vllm-lens changes what is
traced instead: right after the model is constructed (before weights load and before the first
forward pass, which is when vLLM compiles) every decoder layer's class is swapped for a thin
subclass whose ``forward`` calls the custom op ``vllm_lens::pre_tap`` on the layer's inputs,
then the original, then ``vllm_lens::tap`` on its outputs. Inside the layer (where
``worker.layouts`` says, per model class; ``VLLM_LENS_INNER_TAPS=0`` leaves them out) the
module called on ``resid_mid`` gets ``vllm_lens::mid_tap`` on its inputs, and the MLP's
activation, an MoE router and (in split layouts) the attention and MLP blocks a tap op on
their outputs, the same way. Swapping the class keeps parameter names, so weight loading is
untouched, and one code path serves compiled and eager mode: Dynamo sees an ordinary op, eager
mode calls it directly.

The op is declared as mutating ``hidden`` so steering can add to the stream in place; what it
does is delegated to a per-process handler (``set_tap_handler``). With no handler (plain
traffic before any lens request) it returns at once.

The module is one job, putting the ops into a constructed model, and runs a little past 450
lines: the ops' definitions, the tapped layer and inner-module classes and the walk over the
layers share the conventions (slots, batched rows, claimed modules) that keep them exact.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_lens import envs
from vllm_lens.common import faults
from vllm_lens.common.points import SITES
from vllm_lens.common.tap_ops import (
    PRE_TAP_OP_NAME,
    SITE_OP_NAMES,
    TAP_OP_NAME,
    TAP_OPS,
)
from vllm_lens.worker.layout_derivation import derive_layout
from vllm_lens.worker.layouts import (
    Layout,
    derivable,
    final_norm_of,
    layout_of,
    model_key,
    unmapped_reason,
)

__all__ = ["TAP_OPS", "TapInfo", "current_tap_handler", "install_taps", "set_tap_handler", "tap_info"]

logger = logging.getLogger(__name__)

#: handler(a, b, layer_index, site): ``site`` is one of ``points.SITES`` but ``attn`` here
#: (``worker.attention_taps`` calls it with ``attn`` / ``attn_v`` / ``attn_z``); ``b`` is the
#: fused residual (None for layers without one, and entering the first layer).
TapHandler = Callable[[torch.Tensor, "torch.Tensor | None", int, str], None]
_handler: TapHandler | None = None


def set_tap_handler(handler: TapHandler | None) -> None:
    """Route every tap in this process to ``handler`` (``None``: taps do nothing)."""
    global _handler
    _handler = handler


def current_tap_handler() -> TapHandler | None:
    """The handler taps are routed to now."""
    return _handler


# Registered directly on a Library rather than with ``torch.library.custom_op``: the latter's
# dispatch wrappers cost ~15 us per call, the direct registration ~2.5 us (measured on the CI
# kind; ``benchmarks/tap_overhead.py``), and plain traffic pays this call at every tap op
# of every layer per step (six on Llama-style layers, with ``attn_in`` and ``mlp_in``). vLLM
# registers its own ops the same way (``direct_register_custom_op``). One
# ``CompositeExplicitAutograd`` kernel serves every device; the fake kernel lets Dynamo trace it.
_LIBRARY = torch.library.Library("vllm_lens", "FRAGMENT")


def _define_tap(name: str, site: str) -> None:
    """Define one tap op, for one site of ``points.SITES``. Its arguments are [num_tokens, d]
    tensors: at a layer's output (``post``) the residual stream is hidden + residual for
    fused-residual models (Llama, Qwen2), hidden alone otherwise; at its input (``pre``)
    likewise, with no residual entering the first layer; before the MLP (``mid``) the
    attention output and the stream it is added to (fused), or ``resid_mid`` alone (split
    layouts); at the other sites the output of one module (``points``)."""

    def tap(hidden: torch.Tensor, residual: torch.Tensor | None, layer: int) -> None:
        handler = _handler
        if handler is not None:
            handler(hidden, residual, layer, site)

    def fake(hidden: torch.Tensor, residual: torch.Tensor | None, layer: int) -> None:
        return None

    op = name.split("::")[1]
    _LIBRARY.define(op + torch.library.infer_schema(tap, mutates_args=("hidden",)))
    _LIBRARY.impl(op, tap, dispatch_key="CompositeExplicitAutograd")
    torch.library.register_fake(name, fake, lib=_LIBRARY)


_define_tap(PRE_TAP_OP_NAME, "pre")
_define_tap(TAP_OP_NAME, "post")
for _site, _name in SITE_OP_NAMES.items():
    _define_tap(_name, _site)


@dataclass(frozen=True)
class TapInfo:
    """What ``install_taps`` found in a model."""

    model_class: str
    n_layers: int
    """Total decoder layers of the model (on every pipeline stage)."""
    local_layers: tuple[int, ...]
    """Layers owned (and tapped) by this pipeline stage."""
    pre_taps: bool
    """Whether every local layer taps its input too (its ``forward`` takes
    ``hidden_states``), so pre-hooks can run."""
    tapped: bool = True
    """False for a model without a layout (``worker.layouts``): its layers were found but
    left as they are (no tap op in its graph; lens requests are refused)."""
    sites: tuple[str, ...] = ()
    """Tap sites every local layer has (``points.SITES``)."""
    attention: tuple[tuple[int, nn.Module], ...] = ()
    """(layer, vLLM ``Attention`` module) per local layer, when the ``attn`` site exists."""
    d_mlp: int = 0
    """Full width of ``mlp_post`` (all TP ranks together)."""
    split: bool = False
    """The layers add to the stream themselves (``points``: split layouts)."""
    block: str = "sequential"
    """``Layout.block`` of the model's family."""
    n_experts: int = 0
    """Width of ``router_logits`` (MoE), 0 without a router site."""
    routing: str | None = None
    """``Layout.routing`` where the router site exists."""
    unmapped: str | None = None
    """Why the model class is not tapped (``layouts.unmapped_reason``), if it is not."""
    derived: bool = False
    """The layout was derived from the module tree (``worker.layout_derivation``)."""
    layers_path: str = ""
    """``Layout.layers``: where the decoder layers are, from the model."""
    stream_only: str | None = None
    """``Layout.stream_only``: why only the stream between layers is offered, if so."""
    readers: tuple[tuple[str, str, str], ...] = ()
    """Derived layouts: ``(point, path in a layer, "input" or "output")``: the block whose
    input should be ``attn_in`` / ``mlp_in``, or whose output ``attn_out_pre_norm`` /
    ``mlp_out_pre_norm``, for the start-up check to compare with the tap."""


# Where unmapped models usually keep their layers: found only to report their depth.
_LAYER_PATHS = ("model.layers", "language_model.model.layers", "model.language_model.layers",
                "language_model.layers", "transformer.h", "model.decoder.layers")
_TAPPED_CLASSES: dict[tuple[type, bool, bool], type] = {}
_INFO_ATTR = "_vllm_lens_taps"


def _find_layers(model: nn.Module, paths: tuple[str, ...]) -> nn.ModuleList | None:
    for path in paths:
        obj = _submodule(model, path)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    return None


def _input_slots(cls: type[nn.Module]) -> tuple[int, int | None] | None:
    """Positions of ``hidden_states`` and ``residual`` (``None`` for layers that keep no
    residual apart) among ``forward``'s positional args."""
    names = [p for p in inspect.signature(cls.forward).parameters][1:]  # drop self
    if "hidden_states" not in names:
        return None
    return names.index("hidden_states"), names.index("residual") if "residual" in names else None


def _inputs(args: tuple, kwargs: dict, slots: tuple[int, int | None]) -> tuple[Any, Any]:
    h, r = slots
    hidden = args[h] if len(args) > h else kwargs.get("hidden_states")
    if r is None:
        return hidden, None
    residual = args[r] if len(args) > r else kwargs.get("residual")
    return hidden, residual


def _rows(t: Any) -> Any:
    """``[num_tokens, d]`` view of a tap's tensor in a ``Layout.batched`` model (a leading
    batch dimension of 1; a view, so steering in place reaches the model)."""
    return t[0] if isinstance(t, torch.Tensor) and t.dim() == 3 else t


def _same(t: Any) -> Any:
    return t


def _call_original(cls: type[nn.Module], module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module``'s own forward: an instance-bound one (the Transformers backend rewrites
    some modules' ``forward`` per instance; ``_claim_forward`` moved it) or ``cls``'s."""
    bound = module.__dict__.get("_vllm_lens_forward")
    return bound(*args, **kwargs) if bound is not None else cls.forward(module, *args, **kwargs)


def _claim_forward(module: nn.Module) -> None:
    """Move an instance-bound ``forward`` aside so that the tapped class's runs (it calls the
    moved one)."""
    bound = module.__dict__.pop("forward", None)
    if bound is not None:
        module.__dict__["_vllm_lens_forward"] = bound


def _tapped_class(cls: type[nn.Module], fused: bool = True, batched: bool = False
                  ) -> type[nn.Module]:
    """``cls`` with taps on its input stream and on its output: ``(hidden, residual)`` for
    ``fused`` layers, the stream alone otherwise (any further outputs are ignored);
    ``batched``: the tensors carry a leading batch dimension of 1."""
    tapped = _TAPPED_CLASSES.get((cls, fused, batched))
    if tapped is None:
        slots = _input_slots(cls)
        rows = _rows if batched else _same

        def forward(self, *args, **kwargs):
            if slots is not None:
                hidden_in, residual_in = _inputs(args, kwargs, slots)
                if not fused:  # a split layer's input is the whole stream: a residual it
                    residual_in = None  # is handed (and ignores: EXAONE 4) is not added
                if isinstance(hidden_in, torch.Tensor):
                    torch.ops.vllm_lens.pre_tap(rows(hidden_in), rows(residual_in),
                                                self._vllm_lens_layer)
            out = _call_original(cls, self, args, kwargs)
            if isinstance(out, tuple):
                hidden, residual = out[0], out[1] if fused else None
            else:
                hidden, residual = out, None
            torch.ops.vllm_lens.tap(rows(hidden), rows(residual), self._vllm_lens_layer)
            return out

        tapped = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        _TAPPED_CLASSES[(cls, fused, batched)] = tapped
    return tapped


def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    obj: object = layer
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj if isinstance(obj, nn.Module) else None


def _inner_tapped_class(cls: type[nn.Module], site: str, fused: bool, batched: bool,
                        mlp_in: bool = False, in_site: str | None = None) -> type[nn.Module]:
    """``cls`` with a tap on its inputs (``mid``: its first argument, and the residual beside
    it where the layout is ``fused``; with ``mlp_in`` also on its output, the first element
    of a tuple, which the MLP reads; ``_INPUT_SITES``: its first argument) or on its output
    (every other site; the first element of a tuple output), and with ``in_site`` also on its
    first argument before it runs (a post-norm whose output is ``attn_block``).
    ``batched``: the tensors carry a leading batch dimension of 1."""
    key = (cls, site, fused, batched, mlp_in, in_site)
    tapped = _INNER_CLASSES.get(key)
    if tapped is None:
        op = getattr(torch.ops.vllm_lens, SITE_OP_NAMES[site].split("::")[1])
        rows = _rows if batched else _same
        first = next(iter(list(inspect.signature(cls.forward).parameters)[1:]), "x")
        if site in _INPUT_SITES:
            def forward(self, *args, **kwargs):
                op(rows(args[0] if args else kwargs.get(first)), None, self._vllm_lens_layer)
                return _call_original(cls, self, args, kwargs)
        elif site in _IN_OUT_SITES:
            def forward(self, *args, **kwargs):
                x = rows(args[0] if args else kwargs.get(first))
                result = _call_original(cls, self, args, kwargs)
                out = rows(result[0] if isinstance(result, tuple) else result)
                # Rows of [heads, head_size], also from a norm over every head at once
                # (called on [tokens, heads * head_size]).
                size = self._vllm_lens_head_size
                op(out.reshape(out.shape[0], -1, size), x.reshape(x.shape[0], -1, size),
                   self._vllm_lens_layer)
                return result
        elif site == "mid":
            out_op = (getattr(torch.ops.vllm_lens, SITE_OP_NAMES["mlp_in"].split("::")[1])
                      if mlp_in else None)

            def forward(self, *args, **kwargs):
                x = args[0] if args else kwargs.get(first)
                residual = None
                if fused:
                    residual = args[1] if len(args) > 1 else kwargs.get("residual")
                op(rows(x), rows(residual), self._vllm_lens_layer)
                out = _call_original(cls, self, args, kwargs)
                if out_op is not None:  # what the MLP reads: written to in place
                    out_op(rows(out[0] if isinstance(out, tuple) else out), None,
                           self._vllm_lens_layer)
                return out
        else:
            in_op = (getattr(torch.ops.vllm_lens, SITE_OP_NAMES[in_site].split("::")[1])
                     if in_site else None)

            def forward(self, *args, **kwargs):
                if in_op is not None:
                    in_op(rows(args[0] if args else kwargs.get(first)), None,
                          self._vllm_lens_layer)
                out = _call_original(cls, self, args, kwargs)
                op(rows(out[0] if isinstance(out, tuple) else out), None,
                   self._vllm_lens_layer)
                return out

        tapped = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                             "_vllm_lens_site": site})
        _INNER_CLASSES[key] = tapped
    return tapped


_INNER_CLASSES: dict[tuple[type, str, bool, bool, bool, str | None], type] = {}
#: Sites read at a module's first argument: the inputs of the norms after attention and after
#: the MLP (``attn_out_pre_norm``, ``mlp_out_pre_norm``).
_INPUT_SITES = ("attn_post_norm", "mlp_post_norm")
#: Sites read at a module's output and input together, after it ran (``a``, ``b``): a
#: family's norms of Q and K (``q_normed`` and ``q_pre_norm``, ``k_normed``, ``k_pre_norm``).
_IN_OUT_SITES = ("q_norm", "k_norm")


def _own_module(layer: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """``module`` as this layer's alone, so that its tap can name the layer: vLLM hands one
    cached instance of a stateless module (an activation from ``get_act_fn``) to every layer
    and every model in the process, so such a module is replaced by a private copy here (its
    bound methods still point at the shared instance: it has no state to share)."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return module
    clone = copy.copy(module)
    for name in ("_modules", "_parameters", "_buffers", "_forward_hooks",
                 "_forward_pre_hooks"):
        object.__setattr__(clone, name, type(getattr(module, name))(getattr(module, name)))
    parent_path, _, attr = path.rpartition(".")
    parent = _submodule(layer, parent_path) if parent_path else layer
    setattr(parent, attr, clone)
    return clone


def _install_inner(layer: nn.Module, index: int, layout: Layout, tap: bool, inner: bool,
                   claimed: dict[int, tuple[str, int]]
                   ) -> tuple[set[str], nn.Module | None, int, int]:
    """Tap one layer's internals (the ops inside the layer only if ``inner``); returns
    (sites found, its Attention module, d_mlp, n_experts). ``claimed``: (site, layer) of
    every module tapped so far; a module met again at another site or layer is not tapped,
    and its site is not offered for this layer."""
    from vllm.model_executor.layers.attention.attention import Attention

    sites: set[str] = set()
    down = _submodule(layer, layout.down_proj) if layout.down_proj else None
    reads_norms = _reads_norm_outputs(layer)
    paths = {"attn_in": layout.attn_in if reads_norms else None, "mid": layout.mid,
             "act": layout.act, "attn_block": layout.attn_block,
             "mlp_block": layout.mlp_block, "router": layout.router,
             "attn_post_norm": layout.attn_post_norm, "mlp_post_norm": layout.mlp_post_norm,
             **_qk_norm_paths(layer, layout)}
    # A post-norm that is also a split layout's block (its output is attn_out / mlp_out) gets
    # one tapped class reading both its input and its output.
    joined = {block: post for block, post in (("attn_block", "attn_post_norm"),
                                              ("mlp_block", "mlp_post_norm"))
              if paths[post] is not None and paths[post] == paths[block]}
    n_experts = 0
    head_size = next((int(m.head_size) for m in layer.modules()
                      if hasattr(m, "head_size") and hasattr(m, "num_kv_heads")), 0)
    mlp_in = (layout.mlp_in and reads_norms
              and getattr(layer, "ada_rms_norm_t_cond", None) is None)
    for site, path in paths.items() if inner else ():
        if site in joined.values():
            continue  # tapped with its block
        module = _submodule(layer, path) if path else None
        if module is None or (site == "act" and _quantized_input(down)):
            # A quantized down_proj may take its input from a fused act+quant kernel that
            # never calls the activation module: no mlp_post there (and no lost fusion).
            continue
        if site == "router":
            n_experts = int(getattr(module, "output_size", 0) or 0)
            if not n_experts:
                continue
        if tap:
            cls = type(module)
            if getattr(cls, "_vllm_lens_site", None) is not None:
                # Tapped by an earlier call: fine only if for this very site and layer.
                if (cls._vllm_lens_site, module._vllm_lens_layer) != (site, index):
                    continue
                cls = cls.__mro__[1]
            else:
                module = _own_module(layer, path, module)
            if claimed.setdefault(id(module), (site, index)) != (site, index):
                continue  # shared with another site or layer: its tap could not tell them apart
            _claim_forward(module)
            module.__class__ = _inner_tapped_class(cls, site, layout.fused_residual,
                                                   layout.batched,
                                                   mlp_in=site == "mid" and mlp_in,
                                                   in_site=joined.get(site))
            module._vllm_lens_layer = index
            if site in _IN_OUT_SITES:
                module._vllm_lens_head_size = head_size
        sites.add(site)
        if site in joined:
            sites.add(joined[site])
        if site == "mid" and mlp_in:
            sites.add("mlp_in")
    attention = _submodule(layer, layout.attention)
    block_path = layout.attention.rpartition(".")[0]
    # The kernel must see the query as the model computed it: not quantized first (an fp8 KV
    # cache with a backend taking fp8 queries), and K of its own (no KV sharing).
    # And V heads the size of Q/K's: the rows ``value`` and ``attn_z`` are read as.
    if (type(attention) is Attention
            and getattr(attention, "kv_sharing_target_layer_name", None) is None
            and getattr(attention, "query_quant", None) is None
            and _v_heads_whole(_submodule(layer, block_path) if block_path else layer,
                               attention)):
        sites.add("attn")
    else:
        attention = None
    d_mlp = int(getattr(down, "input_size", 0) or 0)
    return sites, attention, d_mlp, n_experts


def _final_installed(model: nn.Module, layout: Layout, last: int, tap: bool,
                     claimed: dict[int, tuple[str, int]]) -> bool:
    """``_install_final``, never raising: a final norm that cannot be tapped leaves the model
    without ``final_norm`` (refused by name), not unable to load."""
    try:
        return _install_final(model, layout, last, tap, claimed)
    except Exception:  # noqa: BLE001 -- the model must load; the point is just not offered
        logger.warning("vllm-lens: the final norm could not be tapped; final_norm is not "
                       "offered", exc_info=True)
        return False


def _install_final(model: nn.Module, layout: Layout, last: int, tap: bool,
                   claimed: dict[int, tuple[str, int]]) -> bool:
    """Tap the output of the model's final norm (``final_norm``, with the last layer's index)
    on the stage that holds it; returns whether the site exists. Not where the LM head is
    quantized (vLLM may fuse the norm with the quantization of its input), nor where a
    layer's tap already claimed the module."""
    from vllm.model_executor.models.utils import PPMissingLayer

    module = final_norm_of(model, layout.layers)
    head = getattr(model, "lm_head", None)
    if (module is None or isinstance(module, PPMissingLayer)
            or (isinstance(head, nn.Module) and not _reads_norm_outputs(head))):
        return False
    cls = type(module)
    if getattr(cls, "_vllm_lens_site", None) is not None:  # tapped by an earlier call
        if (cls._vllm_lens_site, module._vllm_lens_layer) != ("final", last):
            return False
        cls = cls.__mro__[1]
    if claimed.setdefault(id(module), ("final", last)) != ("final", last):
        return False
    if tap:
        _claim_forward(module)
        module.__class__ = _inner_tapped_class(cls, "final", layout.fused_residual,
                                               layout.batched)
        module._vllm_lens_layer = last
    return True


def _v_heads_whole(block: nn.Module | None, kernel: nn.Module) -> bool:
    """Whether the kernel's V heads are the model's whole V heads, the size of Q/K's: not of
    another size (``head_size_v``), nor padded up to Q/K's size by the attention block (an
    attention block naming a ``v_head_dim`` of its own: MiniCPM3 pads V with zeros)."""
    size_v = getattr(kernel, "head_size_v", None)
    if size_v is not None and size_v != kernel.head_size:
        return False
    own = getattr(block, "v_head_dim", None)
    return not isinstance(own, int) or own == kernel.head_size


def _qk_norm_paths(layer: nn.Module, layout: Layout) -> dict[str, str | None]:
    """The ``q_norm`` / ``k_norm`` sites' modules in ``layer``: each where it normalises one
    head at a time (its weight one head wide), or whole heads together only without tensor
    parallelism (vLLM gathers every rank's heads for such a norm, so each rank would read
    them all)."""
    kernel = next((m for m in layer.modules() if hasattr(m, "head_size")
                   and hasattr(m, "num_kv_heads")), None)
    found = {}
    for site, path in (("q_norm", layout.q_norm), ("k_norm", layout.k_norm)):
        module = _submodule(layer, path) if path else None
        weight = getattr(module, "weight", None)
        # Its rows are read as [heads, head_size]: a norm whose width is not a whole number of
        # heads (or that has no weight to tell) is left untapped, never reshaped in the pass.
        width = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() else 0
        size = kernel.head_size if kernel is not None else 0
        whole = bool(size) and bool(width) and width % size == 0
        found[site] = path if (module is not None and whole
                               and (width == size or _tp_size() == 1)) else None
    return found


def _tp_size() -> int:
    """The tensor-parallel size, or 0 where it cannot be read (then a norm over every head is
    not tapped: it might be split across ranks)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 -- no distributed state: unknown, never taken as one rank
        return 0


def _reads_norm_outputs(layer: nn.Module) -> bool:
    """Whether this layer's attention and MLP read what their norms return, as its written
    layout says (``Layout.attn_in``, ``Layout.mlp_in``; the MLP also needs no time-conditioned
    norm scaling it first: vLLM's Mistral with ``ada_rms_norm_t_cond``): not on a quantized
    model, where vLLM may fuse a norm with the quantization of what follows (a tap between
    them would split the fusion, and the sublayer reads the quantized tensor)."""
    return not any(type(m.quant_method).__name__ not in _UNQUANTIZED for m in layer.modules()
                   if getattr(m, "quant_method", None) is not None)


#: vLLM's quant methods that leave weights and inputs as they are.
_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod",
                "UnquantizedFusedMoEMethod")


def _quantized_input(linear: nn.Module | None) -> bool:
    """Whether ``linear`` quantizes its input (then vLLM may fuse the activation into it)."""
    if linear is None or getattr(linear, "quant_method", None) is None:
        return False
    try:
        from vllm.model_executor.layers.fusion.quant_activation import get_input_quant_key
    except ImportError:  # no fusion registry in this vLLM: judge by the quant method
        return type(linear.quant_method).__name__ != "UnquantizedLinearMethod"
    return get_input_quant_key(linear) is not None


def install_taps(model: nn.Module, *, tap: bool = True) -> TapInfo | None:
    """Swap every local decoder layer of ``model`` for its tapped twin; idempotent. With
    ``tap=False`` only record what was found. Classes without a ``Layout`` are never tapped.

    Returns what was found, or ``None`` when the model's layers cannot be located (then lens
    requests on this model are refused with an error naming its class).
    """
    layout = layout_of(model)
    derivation = None
    if layout is None and derivable(model):
        derivation = derive_layout(model)
        layout = derivation.layout
    if layout is not None and (override := faults.layout_override(model_key(model))):
        layout = dataclasses.replace(layout, **override)
    tap = tap and layout is not None
    layers = _find_layers(model, (layout.layers,) if layout else _LAYER_PATHS)
    if layers is None:
        return None
    from vllm.model_executor.models.utils import PPMissingLayer

    local = []
    pre_taps = True
    inner_ops = envs.inner_taps()
    inner: set[str] | None = None
    attention, d_mlp, n_experts = [], 0, 0
    claimed: dict[int, tuple[str, int]] = {}
    fused = layout.fused_residual if layout else True
    for index, layer in enumerate(layers):
        if isinstance(layer, PPMissingLayer):
            continue  # owned by another pipeline stage
        tapped_already = type(layer) in _TAPPED_CLASSES.values()
        original = type(layer).__mro__[1] if tapped_already else type(layer)
        pre_taps = pre_taps and _input_slots(original) is not None
        if tap:
            _claim_forward(layer)
            layer.__class__ = _tapped_class(original, fused, layout.batched)
            layer._vllm_lens_layer = index
        if layout is not None and layout.stream_only is None:
            sites, attn, d_mlp, n_experts = _install_inner(layer, index, layout, tap, inner_ops,
                                                           claimed)
            inner = sites if inner is None else inner & sites
            if attn is not None:
                attention.append((index, attn))
        local.append(index)
    sites = {"post"} | ({"pre"} if pre_taps else set()) | (inner or set())
    if (layout is not None and layout.stream_only is None and inner_ops
            and len(layers) - 1 in local
            and _final_installed(model, layout, len(layers) - 1, tap, claimed)):
        sites.add("final")
    if "attn" not in sites:
        attention = []
    info = TapInfo(model_class=model_key(model), n_layers=len(layers),
                   local_layers=tuple(local), pre_taps=pre_taps, tapped=tap,
                   sites=tuple(site for site in SITES if site in sites),
                   attention=tuple(attention), d_mlp=d_mlp,
                   split=layout is not None and layout.split,
                   block=layout.block if layout else "sequential",
                   n_experts=n_experts if "router" in sites else 0,
                   routing=layout.routing if layout and "router" in sites else None,
                   unmapped=None if tap else (
                       derivation.reason if derivation is not None and derivation.reason
                       else unmapped_reason(model)),
                   derived=layout is not None and layout.derived,
                   layers_path=layout.layers if layout else "",
                   stream_only=layout.stream_only if layout else None,
                   readers=_readers(layout, sites))
    setattr(model, _INFO_ATTR, info)
    return info


def _readers(layout: Layout | None, sites: set[str]) -> tuple[tuple[str, str, str], ...]:
    """``TapInfo.readers``: on a derived layout, the attention block (the parent of its
    kernel module) and ``Layout.mlp_module``, for the points read at their input or output,
    where tapped."""
    if layout is None or not layout.derived:
        return ()
    attention = layout.attention.rpartition(".")[0]
    found = (("attn_in", "attn_in", attention, "input"),
             ("mlp_in", "mlp_in", layout.mlp_module, "input"),
             ("attn_out_pre_norm", "attn_post_norm", attention, "output"),
             ("mlp_out_pre_norm", "mlp_post_norm", layout.mlp_module, "output"))
    return tuple((point, path, end) for point, site, path, end in found
                 if site in sites and path)


def tap_info(model: nn.Module) -> TapInfo | None:
    """The ``TapInfo`` recorded on ``model`` by ``install_taps``, if any."""
    return getattr(model, _INFO_ATTR, None)


_TAPPED_MODELS: dict[type, type] = {}


def tapped_model_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``cls`` that installs taps as soon as the model is constructed.

    Construction happens before weights load and before the first (compiling) forward pass,
    which is the last moment the taps can join the traced graph.
    """
    if getattr(cls, "_vllm_lens_model_hook", False):
        return cls
    sub = _TAPPED_MODELS.get(cls)
    if sub is None:

        # wraps(): vLLM inspects the constructor's signature to pick its calling convention.
        @functools.wraps(cls.__init__)
        def __init__(self, *args, **kwargs):
            cls.__init__(self, *args, **kwargs)
            install_taps(self)

        sub = type(cls.__name__, (cls,), {
            "__init__": __init__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_vllm_lens_model_hook": True,
        })
        _TAPPED_MODELS[cls] = sub
    return sub


def install_model_hook() -> None:
    """Make vLLM's model loader construct tapped model classes (idempotent)."""
    from vllm.model_executor.model_loader import utils as loader_utils

    from vllm_lens.common.wrapping import wrap_attribute

    def wrap(original):
        def get_model_architecture(model_config):
            model_cls, arch = original(model_config)
            if _is_draft_model(model_config):
                return model_cls, arch
            return tapped_model_class(model_cls), arch

        return get_model_architecture

    wrap_attribute(loader_utils, "get_model_architecture", wrap)


def _is_draft_model(model_config: Any) -> bool:
    """Whether ``model_config`` is a speculative-decoding draft model's. Drafts stay untapped:
    their forward passes see other token counts under their own forward context, and their
    layer indices are not the target model's."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    speculative = getattr(config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    # Draft-free methods (n-gram, suffix) name the target model as their draft.
    target = getattr(speculative, "target_model_config", None)
    return draft is not None and model_config is draft and draft is not target
