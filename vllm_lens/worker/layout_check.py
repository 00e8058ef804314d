"""The layout's start-up check on the model's own weights (runs in: worker).

Before this worker serves its first lens request (``lens_describe`` runs it once), one short
forward pass of the loaded model (vLLM's own dummy run: random token ids, attention metadata
built, no CUDA graph, between two steps as vLLM's data-parallel idle steps are) runs with every
tap recording, and the recorded tensors must satisfy what any correct layout satisfies and a
wrong one breaks:

- ``continuity``: the stream leaving layer ``L`` (``resid_post``) is the stream entering layer
  ``L + 1`` (``resid_pre``);
- ``attention adds attn_out``: ``resid_mid = resid_pre + attn_out`` (sequential blocks);
- ``the MLP adds mlp_out``: ``resid_post = resid_mid + mlp_out`` (sequential) or
  ``resid_post = resid_pre + attn_out + mlp_out`` (parallel blocks);
- ``final norm``: the last layer's ``resid_post`` through the model's final norm is the
  hidden state vLLM itself hands to the LM head (on the last pipeline stage);
- ``the LM head reads final_norm``: the final norm's tap (``final_norm``) holds that hidden
  state;
- ``attention reads attn_in`` and ``the MLP reads mlp_in`` (derived layouts): the input the
  attention block and the MLP are called with is the tapped ``attn_in`` / ``mlp_in``;
  ``attention returns attn_out_pre_norm`` and ``the MLP returns mlp_out_pre_norm``: what they
  return is the tapped input of the norm after them. On a second pass that runs the model's
  Python code (``worker.block_inputs``; written rows have these points proven against
  transformers by the test suite instead);
- ``the kernel receives the normed Q, rotated`` (and ``... K, rotated``): each head's Q (K)
  as the family's norm of it returned (``q_normed``, ``k_normed``) is what the attention
  kernel receives up to RoPE's turns: per token, head and pair of coordinates RoPE turns
  together (from the layer's rotary embedding: its ``rotary_dim`` and style), the pair's
  length is the same, and coordinates RoPE leaves alone are equal (all of them on a layer
  without RoPE). A scale, another module, or heads or tokens in another order would break it.

Each invariant names the points it proves; a point whose invariant fails is refused by name
with that invariant, and the rest of the model serves. A derived layout
(``worker.layout_derivation``) serves only what was proven: where an invariant cannot run
(no input taps, a pipeline stage without the final norm, data parallelism, an engine whose
dummy run fails) its points are refused. Written rows are proven by the test suite against
transformers; they face the same check, and a failure refuses their points the same way.

Q/K, ``value`` and ``attn_z`` are the attention kernel's own inputs and output
(``worker.attention_taps`` reads them at vLLM's ``Attention`` module, found by its class), so
no invariant is needed for them; they are refused with the stream when ``continuity`` fails.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_lens.common.points import POINTS, QK_NORM_POINTS, operands, site_of, tap_key
from vllm_lens.worker import block_inputs, head_projection, taps
from vllm_lens.worker.layout_derivation import attention_kernels, recurrent_state_reason
from vllm_lens.worker.layouts import final_norm_of

__all__ = ["INVARIANTS", "LayoutCheck", "check_layout", "evaluate", "final_norm", "tolerance"]

logger = logging.getLogger(__name__)

#: The invariants, each proving the points ``_requires`` lists it for.
INVARIANTS = ("continuity", "final norm", "attention adds attn_out", "the MLP adds mlp_out",
              "the LM head reads final_norm", "attention reads attn_in",
              "the MLP reads mlp_in", "attention returns attn_out_pre_norm",
              "the MLP returns mlp_out_pre_norm", "the kernel receives the normed Q, rotated",
              "the kernel receives the normed K, rotated")
#: Site -> the invariant proving Q or K before and after its norm (``QK_NORM_POINTS``).
_QK_ROTATED = {"q_norm": INVARIANTS[-2], "k_norm": INVARIANTS[-1]}
_STREAM = ("continuity", "final norm")
_SUMS = ("attention adds attn_out", "the MLP adds mlp_out")
#: Point -> the invariant that its block reads or returns it (``block_inputs``).
_READERS = {"attn_in": "attention reads attn_in", "mlp_in": "the MLP reads mlp_in",
            "attn_out_pre_norm": "attention returns attn_out_pre_norm",
            "mlp_out_pre_norm": "the MLP returns mlp_out_pre_norm"}


def _requires(point: str, info: Any) -> tuple[str, ...]:
    """The invariants that prove ``point`` on ``info``'s layout: the stream's two for every
    point (each is read inside the layers the stream runs through), and the sublayer sums for
    the points they relate."""
    if info.block == "parallel":
        sums = {"attn_out": ("the MLP adds mlp_out",), "mlp_out": ("the MLP adds mlp_out",)}
    else:
        sums = {"attn_out": ("attention adds attn_out",),
                "resid_mid": ("attention adds attn_out", "the MLP adds mlp_out"),
                "mlp_out": ("the MLP adds mlp_out",)}
    if point == "final_norm":
        return (*_STREAM, "the LM head reads final_norm")
    if point in _READERS:
        return (*_STREAM, _READERS[point])
    if point in QK_NORM_POINTS:
        return (*_STREAM, _QK_ROTATED[POINTS[point].site])
    return _STREAM + sums.get(point, ())


#: Tokens of the check's forward pass.
N_TOKENS = 8


@dataclass
class LayoutCheck:
    """What the check found."""

    ran: bool
    refused: dict[str, str] = field(default_factory=dict)
    """Point -> why it is refused (the invariant that failed, or the one that could not run)."""
    passed: list[str] = field(default_factory=list)
    """The invariants that held."""
    seconds: float = 0.0
    error: str | None = None
    """Why the forward pass could not run, if it did not."""
    projections: dict[int, torch.nn.Module] = field(default_factory=dict)
    """Layer -> its attention output projection, proven (``worker.head_projection``)."""
    heads_refused: str | None = "the check did not run"
    """Why per-head attribution through ``projections`` is refused, or ``None``."""


class _Recorder:
    """A tap handler that keeps a float32 copy of every tap's tensors."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.calls: dict[tuple[int, str], int] = {}
        """Calls per (layer, site) in the pass: a tap run twice per step would have its
        second call overwrite the rows captured at the first."""
        self.dtype = torch.float32

    def __call__(self, a: torch.Tensor, b: torch.Tensor | None, layer: int, site: str) -> None:
        self.dtype = a.dtype
        self.calls[(layer, site)] = self.calls.get((layer, site), 0) + 1
        self.rows.setdefault((layer, site), (
            a.detach().float().clone(), None if b is None else b.detach().float().clone()))


def check_layout(runner: Any, model: torch.nn.Module, info: Any, *, derived: bool,
                 can_run: str | None = None) -> LayoutCheck:
    """Run the forward pass and evaluate the invariants. ``can_run``: why the pass may not run
    on this engine (then nothing is proven). Never raises."""
    start = time.perf_counter()
    can_run = can_run or recurrent_state_reason(model)
    if can_run is not None:
        return _unproven(info, derived, can_run, start)
    recorder = _Recorder()
    previous = taps.current_tap_handler()
    kernel_out: dict[int, torch.Tensor] = {}
    kernel_qk: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    try:
        taps.set_tap_handler(recorder)
        try:
            with _attention_output(_kernels(model, info), kernel_out, kernel_qk):
                hidden = _forward(runner)
        finally:
            taps.set_tap_handler(previous)
        if (where := _non_finite(recorder.rows, hidden)) is not None:
            return _unproven(info, derived, f"the start-up check's pass gave non-finite "
                             f"values ({where}), which prove nothing", start)
        final = final_norm(model, info)
        reads = _block_inputs(runner, model, info) if info.readers else None
        result = evaluate(recorder.rows, info, hidden=hidden, final_norm=final,
                          last_stage=_last_stage(), dtype=recorder.dtype, reads=reads,
                          qk=_qk_lengths(recorder.rows, info, kernel_qk, model))
        _refuse_repeated(result, recorder)
        try:
            _check_projections(result, model, info, recorder, kernel_out)
        except Exception as exc:  # noqa: BLE001 -- only per-head attribution is refused
            logger.warning("vllm-lens: the output projections could not be proven: %r", exc)
            result.heads_refused = f"the output projections could not be proven ({exc!r})"
    except Exception as exc:  # noqa: BLE001 -- the check must answer, never crash the worker
        logger.warning("vllm-lens: the layout check could not run: %r", exc)
        return _unproven(info, derived, f"the start-up check could not run ({exc!r})", start)
    if not derived:
        result.refused = {p: why for p, why in result.refused.items()
                          if not why.startswith("unproven:")}
    _refuse_inner(result, info)
    result.seconds = time.perf_counter() - start
    return result


def _block_inputs(runner: Any, model: torch.nn.Module, info: Any
                  ) -> dict[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]] | str:
    """``evaluate``'s ``reads``: per point of ``info.readers``, ``(tapped, what the block
    read or returned)`` per local layer from one more pass, run eagerly; or why that pass
    could not run."""
    if (why := block_inputs.eager_reason(runner.vllm_config)) is not None:
        return why
    recorder, seen = _Recorder(), {}
    previous = taps.current_tap_handler()
    layers = model.get_submodule(info.layers_path)
    try:
        taps.set_tap_handler(recorder)
        try:
            # As on the first pass, a kernel that wrote nothing writes noise: an attention
            # block returning zeros would prove nothing about its output.
            with block_inputs.eager(model), block_inputs.recording_inputs(
                    layers, info.local_layers, info.readers, seen), \
                    _attention_output(_kernels(model, info), {}):
                _forward(runner)
        finally:
            taps.set_tap_handler(previous)
    except Exception as exc:  # noqa: BLE001 -- only the points it proves are refused
        logger.warning("vllm-lens: the pass recording the blocks' inputs failed: %r", exc)
        return f"the pass recording the blocks' inputs failed ({exc!r})"
    reads = {}
    for point, _, _ in info.readers:
        rows = []
        for layer in info.local_layers:
            tapped = recorder.rows.get((layer, tap_key(point, split=info.split)))
            rows.append((None if tapped is None else tapped[0].reshape(-1, tapped[0].shape[-1]),
                         seen.get((layer, point))))
        reads[point] = rows
    return reads


def _qk_lengths(rows: dict, info: Any, kernel_qk: dict, model: torch.nn.Module
                ) -> dict[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """``evaluate``'s ``qk``: per site (``q_norm``, ``k_norm``) and local layer, ``(what RoPE
    keeps of the tapped q_normed / k_normed, of what the kernel received)``
    (``_rope_keeps``), one row per token; ``None`` where one was not recorded."""
    kernels = dict(info.attention)
    layers = model.get_submodule(info.layers_path) if info.layers_path else None
    found: dict[str, list] = {"q_norm": [], "k_norm": []}
    for layer in info.local_layers:
        kernel = kernels.get(layer)
        rope = None if layers is None else next(
            (m for m in layers[layer].modules()
             if hasattr(m, "rotary_dim") and hasattr(m, "is_neox_style")), None)
        for index, site in enumerate(("q_norm", "k_norm")):
            tapped, received = rows.get((layer, site)), kernel_qk.get(layer, (None, None))[index]
            if kernel is None or tapped is None or received is None:
                found[site].append((None, None))
                continue
            size = kernel.head_size
            normed = tapped[0].reshape(tapped[0].shape[0], -1, size)  # [tokens, heads, size]
            received = received.reshape(received.shape[0], -1, size)[: normed.shape[0]]
            found[site].append((_rope_keeps(normed, rope), _rope_keeps(received, rope)))
    return found


def _rope_keeps(x: torch.Tensor, rope: torch.nn.Module | None) -> torch.Tensor:
    """What RoPE leaves unchanged in ``x`` (``[tokens, heads, size]``), one row per token: the
    length of every pair of coordinates it turns together (``rotary_dim`` of them, paired
    half with half in the NeoX style, else neighbours) and the coordinates past them."""
    if rope is None:
        return x.reshape(x.shape[0], -1)
    rot = int(rope.rotary_dim)
    turned = x[..., :rot]
    if rope.is_neox_style:
        a, b = turned[..., : rot // 2], turned[..., rot // 2:]
    else:
        a, b = turned[..., 0::2], turned[..., 1::2]
    return torch.cat([torch.sqrt(a * a + b * b), x[..., rot:]], dim=-1).reshape(x.shape[0], -1)


#: Sites whose module a model might call more than once per step, and the points they serve.
_ONCE = {"final": ("final_norm",), "q_norm": ("q_pre_norm", "q_normed"),
         "k_norm": ("k_pre_norm", "k_normed")}


def _refuse_repeated(result: LayoutCheck, recorder: _Recorder) -> None:
    """A model that calls its final norm (or a norm of Q or K) more than once in a step (on
    other rows too, or on K after Q) would have the point overwritten by the later call:
    refused then, on written layouts too."""
    for at, points in _ONCE.items():
        repeated = [n for (_, site), n in recorder.calls.items() if site == at and n > 1]
        for point in points if repeated else ():
            result.refused[point] = (f"its module ran {repeated[0]} times in one forward "
                                     "pass, so its rows are not one per token")


#: The sites the invariants read (``evaluate``).
_STREAM_SITES = ("pre", "mid", "attn_block", "mlp_block", "post", "final")


def _non_finite(rows: dict, hidden: torch.Tensor | None) -> str | None:
    """Where the check's pass gave a non-finite value that an invariant would read, if
    anywhere: ``layer L, site S`` or ``the model's output``."""
    for (layer, site), pair in sorted(rows.items(), key=lambda item: item[0]):
        if site in _STREAM_SITES and not all(bool(torch.isfinite(t).all())
                                            for t in pair if t is not None):
            return f"layer {layer}, site {site}"
    if hidden is not None and not bool(torch.isfinite(hidden).all()):
        return "the model's output"
    return None


def _check_projections(result: LayoutCheck, model: torch.nn.Module, info: Any,
                       recorder: _Recorder, kernel_out: dict[int, torch.Tensor]) -> None:
    """Find and prove each layer's attention output projection (``head_projection``): per-head
    attribution reads it. Under tensor parallelism it is not run (its all-reduce is not the
    check's to start)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() > 1:
        result.heads_refused = "tensor parallelism splits the heads across ranks"
        return
    if "attn_out" in result.refused:
        result.heads_refused = f"attn_out is refused: {result.refused['attn_out']}"
        return
    tapped = dict(info.attention)
    kernel_out = {layer: z for layer, z in kernel_out.items() if layer in tapped}
    if not info.attention or not kernel_out:
        result.heads_refused = ("no plain attention kernel's output was recorded (latent or "
                                "chunked attention has no per-head taps)")
        return
    attn_out = {layer: _value(recorder.rows, "attn_out", layer, info.split)
                for layer, _ in info.attention}
    first = next(iter(attn_out.values()))
    width = next(iter(kernel_out.values())).shape[-1]
    if first is None:
        result.heads_refused = "attn_out is not tapped"
        return
    found = head_projection.find_projections(model, info.attention, width, first.shape[-1])
    if isinstance(found, str):
        result.heads_refused = found
        return
    tol, eps = tolerance(recorder.dtype), torch.finfo(recorder.dtype).eps
    why = head_projection.prove(found, kernel_out, attn_out,
                                lambda actual, delta: _close(actual, None, delta, tol, eps))
    if why is None:
        result.passed.append(head_projection.INVARIANT)
        result.projections, result.heads_refused = found, None
    else:
        result.heads_refused = why


def _unproven(info: Any, derived: bool, why: str, start: float) -> LayoutCheck:
    refused = {p: f"unproven: {why}" for p in _offered(info)} if derived else {}
    result = LayoutCheck(ran=False, refused=refused, error=why,
                         seconds=time.perf_counter() - start)
    _refuse_inner(result, info)
    return result


def _refuse_inner(result: LayoutCheck, info: Any) -> None:
    """A stream-only layout (a hybrid's, ``Layout.stream_only``) refuses every point inside
    the layers with its reason, so that a request for one is told why."""
    why = getattr(info, "stream_only", None)
    if why is None:
        return
    for point in (*POINTS, "attn_q", "attn_k"):
        if point not in ("resid_pre", "resid_post"):
            result.refused[point] = why


def _forward(runner: Any) -> torch.Tensor | None:
    """The hidden state the pass hands to the LM head; ``None`` on a pipeline stage that
    does not end the model (it hands ``IntermediateTensors`` to the next stage)."""
    from vllm.config import CUDAGraphMode

    with torch.inference_mode():
        # skip_eplb: the expert load balancer's step counter is not the check's to advance.
        hidden, _ = runner._dummy_run(N_TOKENS, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                      force_attention=True, randomize_inputs=True,
                                      skip_eplb=True)
    return hidden if isinstance(hidden, torch.Tensor) else None


@contextlib.contextmanager
def _attention_output(modules: tuple[tuple[int, torch.nn.Module], ...],
                      seen: dict[int, torch.Tensor], qk: dict | None = None):
    """While the check's pass runs, an attention kernel that wrote nothing (vLLM's dummy run
    may come without attention metadata; the kernel then leaves its output zero) writes
    seeded noise instead: the invariants relate where attention's output goes, not what the
    kernel computed, and a zero output would make ``attention adds attn_out`` prove nothing.
    Without kernel modules to reach, a zero ``attn_out`` leaves the invariant unrun
    (``evaluate``). Each layer's kernel output is kept in ``seen`` (float32, one row per
    token), and with ``qk`` the Q and K a plain kernel received (float32, ``None`` for a K
    the layer does not compute: KV sharing).

    The kernel is reached where vLLM's attention op looks it up at run time: ``Attention``'s
    ``impl.forward(layer, query, key, value, kv_cache, metadata, output)``, and
    ``MLAAttention``'s own ``forward_impl(q, kv_c, k_pe, kv_cache, metadata, output)``."""
    generators: dict[torch.device, torch.Generator] = {}

    def wrap(original, layer, output_at: int):
        def forward(*args, **kwargs):
            result = original(*args, **kwargs)
            z = kwargs.get("output")
            if z is None:
                z = args[output_at] if len(args) > output_at else result
            if isinstance(z, torch.Tensor) and z.numel() and not bool(z.any()):
                g = generators.get(z.device)
                if g is None:
                    g = generators[z.device] = torch.Generator(z.device).manual_seed(0)
                z.copy_(torch.randn(z.shape, generator=g, device=z.device, dtype=z.dtype))
            if isinstance(z, torch.Tensor) and layer not in seen:
                seen[layer] = z.detach().float().reshape(z.shape[0], -1).clone()
            if qk is not None and output_at == 6 and layer not in qk and len(args) > 2:
                query, key = args[1], args[2]  # impl.forward(layer, query, key, value, ...)
                qk[layer] = (query.detach().float().reshape(query.shape[0], -1).clone(),
                             None if key is None else
                             key.detach().float().reshape(key.shape[0], -1).clone())
            return result

        return forward

    wrapped: list[tuple[object, str]] = []
    try:
        for layer, module in modules:
            impl = getattr(module, "impl", None)
            if hasattr(module, "forward_impl"):  # latent attention: the module computes
                owner, name, output_at = module, "forward_impl", 5
            elif impl is not None:
                owner, name, output_at = impl, "forward", 6
            else:
                continue
            if name not in owner.__dict__:
                setattr(owner, name, wrap(getattr(type(owner), name).__get__(owner), layer,
                                          output_at))
                wrapped.append((owner, name))
        yield
    finally:
        for owner, name in wrapped:
            delattr(owner, name)


def _kernels(model: torch.nn.Module, info: Any) -> tuple[tuple[int, torch.nn.Module], ...]:
    """Every local layer's attention kernel module (vLLM's ``Attention`` or a subclass:
    chunked local attention; ``MLAAttention``), also where Q/K are not tapped (``info
    .attention`` holds only plain ``Attention`` modules): each must write in the check's pass
    for ``attention adds attn_out`` to prove anything."""
    kinds = attention_kernels()
    found = dict(info.attention)
    if info.layers_path:
        layers = model.get_submodule(info.layers_path)
        for index in info.local_layers:
            if index in found:
                continue
            kernel = next((m for m in layers[index].modules() if isinstance(m, kinds)), None)
            if kernel is not None:
                found[index] = kernel
    return tuple(sorted(found.items(), key=lambda item: item[0]))


def _last_stage() -> bool:
    from vllm.distributed import get_pp_group

    return get_pp_group().is_last_rank


def final_norm(model: torch.nn.Module, info: Any) -> torch.nn.Module | None:
    """The norm vLLM applies after the last decoder layer (``layouts.final_norm_of``)."""
    return final_norm_of(model, info.layers_path)


def _offered(info: Any) -> list[str]:
    """The points the layout offers (before the check)."""
    split = info.split
    offered = [p for p in POINTS if site_of(p, split=split) in info.sites]
    return offered + (["attn_q", "attn_k"] if "attn" in info.sites else [])


def _value(rows, point: str, layer: int, split: bool) -> torch.Tensor | None:
    found = rows.get((layer, tap_key(point, split=split)))
    if found is None:
        return None
    x, y = operands(point, *found)
    return x if y is None else x + y


def _close(actual: torch.Tensor, base: torch.Tensor | None, delta: torch.Tensor, tol: float,
           eps: float) -> bool:
    """Whether ``actual == base + delta`` row by row, up to ``tol`` of ``delta`` (what the
    invariant relates: a sublayer's output, or the whole value where there is no ``base``) and
    the rounding of the sum in the model's dtype (``eps``, its machine epsilon)."""
    expected = delta if base is None else base + delta
    if actual.shape != expected.shape:
        return False
    bound = tol * delta.norm(dim=-1) + _rounding(expected, eps)
    return bool(((actual - expected).norm(dim=-1) <= bound).all())


def _rounding(expected: torch.Tensor, eps: float) -> torch.Tensor:
    """How far a correct sum may be off per row: the model rounds each addition to its dtype
    (half an ulp per element); a layer may add twice (a scaled branch, a fused add), and the
    check adds once more in float32: four ulps of the result bound it."""
    return 4 * eps * expected.norm(dim=-1) + 1e-30


def _telling(base: torch.Tensor, delta: torch.Tensor, eps: float) -> bool:
    """Whether a sum could tell a wrong ``delta`` from a right one on some row: the sublayer's
    output is well above what rounding the stream may hide."""
    return bool((delta.norm(dim=-1) > 2 * _rounding(base + delta, eps)).any())


def evaluate(rows: dict, info: Any, *, hidden: torch.Tensor | None,
             final_norm: torch.nn.Module | None, last_stage: bool,
             dtype: torch.dtype | None = None, tol: float | None = None,
             reads: dict[str, list[tuple[Any, Any]]] | str | None = None,
             qk: dict[str, list[tuple[Any, Any]]] | None = None) -> LayoutCheck:
    """The invariants over ``rows`` (``(layer, tap key) -> (a, b)``), for ``info`` (a
    ``TapInfo``); ``hidden``: what the model returned, ``final_norm`` the norm before the LM
    head; ``reads``: point -> ``(tapped, what its block read or returned)`` per layer
    (``attn_in``, ``mlp_in``, the ``_pre_norm`` points), or why they were not recorded;
    ``qk``: site (``q_norm``, ``k_norm``) -> ``(what RoPE keeps of the tapped normed Q or K,
    of the kernel's)`` per layer (``_qk_lengths``). Points of a failed or unrunnable invariant
    are refused."""
    dtype = dtype or torch.float32
    tol = tol if tol is not None else tolerance(dtype)
    eps = torch.finfo(dtype).eps
    split, layers = info.split, list(info.local_layers)
    failed: dict[str, str] = {}
    unrun: dict[str, str] = {}
    passed: list[str] = []

    def judge(name: str, checks: list[tuple[Any, Any, Any]], missing: str) -> None:
        """``checks``: ``(actual, base, delta)`` per layer, ``actual`` should be
        ``base + delta`` (``base`` None: ``actual`` should be ``delta``)."""
        needs_base = name in _SUMS
        same = name in _READERS.values()  # one tensor, seen twice in one pass: equal
        nonzero = same or name in _QK_ROTATED.values()
        if not checks or any(a is None or d is None or (needs_base and b is None)
                             for a, b, d in checks):
            unrun[name] = missing
        elif needs_base and not any(_telling(b, d, eps) for _, b, d in checks):
            unrun[name] = ("the sublayer's output was too small beside the stream in the "
                           "check's pass to be told apart from rounding")
        elif nonzero and not any(bool((d.norm(dim=-1) > 0).any()) for _, _, d in checks):
            unrun[name] = "the rows it compares were all zero in the check's pass"
        elif all(_close(a, b, d, 0.0 if same else tol, eps) for a, b, d in checks):
            passed.append(name)
        else:
            failed[name] = f"the invariant {name!r} failed"

    def v(point: str, layer: int) -> torch.Tensor | None:
        return _value(rows, point, layer, split)

    pairs = [(layer, layer + 1) for layer in layers if layer + 1 in layers]
    judge("continuity", [(v("resid_post", a), None, v("resid_pre", b)) for a, b in pairs],
          "the layers' inputs are not tapped" if pairs else "one decoder layer on this stage")
    if info.block == "parallel":
        judge("the MLP adds mlp_out",
              [(v("resid_post", L), v("resid_pre", L), _sum(v("attn_out", L), v("mlp_out", L)))
               for L in layers], "a point of the parallel block is not tapped")
    elif "mid" in info.sites:
        judge("attention adds attn_out",
              [(v("resid_mid", L), v("resid_pre", L), v("attn_out", L)) for L in layers],
              "resid_pre is not tapped")
        judge("the MLP adds mlp_out",
              [(v("resid_post", L), v("resid_mid", L), v("mlp_out", L)) for L in layers],
              "mlp_out is not tapped")
    if last_stage and layers:
        last = v("resid_post", layers[-1])
        actual = expected = None
        if final_norm is not None and last is not None and hidden is not None:
            with torch.inference_mode():
                normed = final_norm(last.to(_param_dtype(final_norm, hidden)))
            normed = normed[0] if isinstance(normed, tuple) else normed
            actual = normed.float().reshape(-1, normed.shape[-1])
            expected = hidden.detach().float().reshape(-1, hidden.shape[-1])[: len(actual)]
        judge("final norm", [(actual, None, expected)],
              "no final norm was found beside the layers")
        if "final" in info.sites:  # the final norm's own tap holds what the LM head reads
            found = rows.get((layers[-1], "final"))
            tapped = full = None
            if found is not None and hidden is not None:
                tapped = found[0].reshape(-1, found[0].shape[-1])
                full = hidden.detach().float().reshape(-1, hidden.shape[-1])[: len(tapped)]
            judge("the LM head reads final_norm", [(tapped, None, full)],
                  "the final norm's tap did not run")
    else:
        unrun["final norm"] = "this pipeline stage does not end the model"
        unrun["the LM head reads final_norm"] = "this pipeline stage does not end the model"
    for site, name in _QK_ROTATED.items():
        if site in info.sites:
            judge(name, [(t, None, k) for t, k in (qk or {}).get(site, [])],
                  "the kernel's input or the norm's tap was not recorded in the check's pass")
    for point, name in _READERS.items():
        if isinstance(reads, dict) and point in reads:
            judge(name, [(tapped, None, read) for tapped, read in reads[point]],
                  "its block was not called in the check's pass")
        else:
            unrun[name] = (reads if isinstance(reads, str) else
                           "no block that reads or returns it is known (written rows are "
                           "proven by the test suite)")

    refused: dict[str, str] = {}
    for point in _offered(info):
        for name in _requires(point, info):
            if name in passed:
                continue
            if name in failed:
                refused[point] = failed[name]
            else:
                why = unrun.get(name, "the layout has no taps it relates")
                refused[point] = f"unproven: the invariant {name!r} could not run ({why})"
            break
    return LayoutCheck(ran=True, passed=passed, refused=refused)


def _sum(*parts: torch.Tensor | None) -> torch.Tensor | None:
    if any(p is None for p in parts):
        return None
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _param_dtype(module: torch.nn.Module, fallback: torch.Tensor | None) -> torch.dtype:
    param = next(module.parameters(), None)
    if param is not None:
        return param.dtype
    return fallback.dtype if fallback is not None else torch.float32


def tolerance(dtype: torch.dtype) -> float:
    """Error allowed per row, as a share of what the invariant relates (a sublayer's output),
    beside the rounding of the sums: a wrong mapping is off by a whole sublayer's output."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2
