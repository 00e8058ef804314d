"""Hooks published by name (entry-point group ``vllm_lens.hooks``) and the two vllm-lens ships (runs
in: front end, worker).

The front end validates their arguments; the workers run them.

A named hook is a factory ``make(args: dict) -> fn(ctx, hidden)``; it raises ``ValueError``
for bad arguments (the front end calls it once to validate them, so a bad request fails with
HTTP 400 before it is scheduled). What depends on the served model is checked there too when
the factory declares ``check(args, point, row_shape)`` (the hook point and the shape of one row
there, ``None`` where rows are split across TP ranks): it raises ``HookArgumentError`` naming
the request field at fault (``"args.weight"``, ``"hook_point"``). What it stores in ``ctx.saved`` must be tensors and plain
JSON types, which is what crosses HTTP. Any client may call a named hook, so one that costs
much per row declares a bound: a factory attribute ``max_rows = (ENV_VAR, default)`` caps the
rows (positions × hooked layers × samples) one request may run it on, checked before the
request is scheduled. A hook whose rows make a score a monitor can stop a generation on
(``spec.monitors``) declares ``monitor_score = (KEY, COLUMNS)``: ``saved[KEY][layer]`` holds one
row per scored position, paired with ``saved["positions"][layer]`` (on the host, ascending,
each position once), each a number (``COLUMNS`` ``None``) or a vector a monitor reduces to one
(``COLUMNS`` says what its entries are, e.g. ``"heads"``); such a hook only reads (a monitor's
hook that returns a tensor fails its request). Any installed package can publish more::

    [project.entry-points."vllm_lens.hooks"]
    my_hook = "my_package.hooks:make_my_hook"
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

import torch

__all__ = ["ENTRY_POINT_GROUP", "HookArgumentError", "attention_to_span", "linear_probe", "load",
           "logit_lens_topk"]

ENTRY_POINT_GROUP = "vllm_lens.hooks"
HookFn = Callable[[Any, torch.Tensor], "torch.Tensor | None"]


class HookArgumentError(ValueError):
    """A named hook's arguments do not fit the served model: ``field`` is the part of the
    hook item at fault (``"args.weight"``, ``"hook_point"``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(problem)
        self.field = field


@functools.cache
def _factories() -> dict[str, Callable[[Mapping[str, Any]], HookFn]]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load(name: str) -> Callable[[Mapping[str, Any]], HookFn]:
    """The factory published as ``name``; ``KeyError`` lists the available names."""
    found = _factories().get(name)
    if found is None:
        raise KeyError(f"no hook named {name!r}; installed: {', '.join(sorted(_factories()))}")
    return found.load()


def _append(saved: dict[str, Any], key: str, layer: int, rows: torch.Tensor,
            start: int) -> None:
    """Accumulate per-layer rows across steps, on the rows' device (so a hook never waits for
    the device; the rows reach the host when the request's results are fetched); ``start`` is
    the absolute position of ``rows[0]`` (hooked requests compute every position from 0, so
    row = position).

    ``saved[key][layer]`` is always the rows so far, but as a prefix view of a buffer whose
    capacity doubles when full, so a generation of ``n`` steps copies O(n) rows, not O(n^2).
    Positions vLLM computes again (a preempted request resumed) overwrite their rows, so each
    position keeps one row.
    """
    per_layer = saved.setdefault(key, {})
    name = str(layer)
    rows = rows.detach()
    previous = per_layer.get(name)
    n, k = (0 if previous is None else previous.shape[0]), rows.shape[0]
    at = min(start, n)
    end = max(n, at + k)
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    capacity = previous.untyped_storage().nbytes() // row_bytes if n and row_bytes else 0
    if previous is not None and end <= capacity:
        buffer = torch.empty(0, dtype=rows.dtype).set_(
            previous.untyped_storage(), 0, (capacity, *rows.shape[1:]))
    else:
        buffer = torch.empty((max(2 * n, end), *rows.shape[1:]), dtype=rows.dtype,
                             device=rows.device)
        if previous is not None:
            buffer[:n] = previous
    buffer[at : at + k] = rows
    per_layer[name] = buffer[:end]


#: Logits materialised at once by ``logit_lens_topk``: rows per chunk = this / vocabulary size.
_LOGIT_CHUNK_ELEMENTS = 8 << 20


def logit_lens_topk(args: Mapping[str, Any]) -> HookFn:
    """Logit lens: the top-``k`` next-token ids of each position, read through the model's final
    norm (RMSNorm, as in Llama and Qwen2) and unembedding at every hooked layer. Under
    pipeline parallelism, prefetch ``lm_head.weight`` and ``model.norm.weight``.

    Cost is bounded: logits are float32, made for a chunk of rows at a time from a slice of
    the unembedding at a time (each at most ``_LOGIT_CHUNK_ELEMENTS`` floats; the whole matrix
    is never copied), and a request may run it on at most ``VLLM_LENS_LOGIT_LENS_MAX_ROWS``
    rows (positions × layers × samples; default 65536), checked before it is scheduled.

    ``args``: ``{"k": int (default 5)}``. ``saved``: ``{"token_ids": {layer: [positions, k]},
    "logprobs": {layer: [positions, k]}, "positions": {layer: [positions]}}``.
    """
    k = args.get("k", 5)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 100:
        raise ValueError(f"k must be an integer in 1..100, got {k!r}")
    unknown = set(args) - {"k"}
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)}; logit_lens_topk takes k")

    def hook(ctx: Any, hidden: torch.Tensor) -> None:
        weight = ctx.get_parameter("lm_head.weight")
        normed = _final_rms_norm(ctx, hidden.float())
        vocab, width = weight.shape
        rows = max(1, _LOGIT_CHUNK_ELEMENTS // vocab)
        vocab_slice = max(1, _LOGIT_CHUNK_ELEMENTS // width)
        ids, values = [], []
        for lo in range(0, normed.shape[0], rows):
            x = normed[lo : lo + rows]
            logits = torch.empty((x.shape[0], vocab), dtype=torch.float32, device=x.device)
            for v0 in range(0, vocab, vocab_slice):  # float32 logits from a bounded slice
                logits[:, v0 : v0 + vocab_slice] = x @ weight[v0 : v0 + vocab_slice].float().T
            top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
            ids.append(top.indices)
            values.append(top.values)
        start = int(ctx.positions[0])
        _append(ctx.saved, "token_ids", ctx.layer_idx, torch.cat(ids), start)
        _append(ctx.saved, "logprobs", ctx.layer_idx, torch.cat(values), start)
        _append(ctx.saved, "positions", ctx.layer_idx, ctx.positions, start)
        return None

    return hook


logit_lens_topk.max_rows = ("VLLM_LENS_LOGIT_LENS_MAX_ROWS", 65536)  # type: ignore[attr-defined]


def _final_rms_norm(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    """The model's final RMSNorm (Llama / Qwen2 style), from its parameters, so it works on a
    pipeline stage that does not own the norm (prefetch ``model.norm.weight`` there)."""
    weight = ctx.get_parameter("model.norm.weight").float()
    eps = getattr(getattr(ctx.model, "config", None), "rms_norm_eps", 1e-6)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear_probe(args: Mapping[str, Any]) -> HookFn:
    """A linear probe's score ``hidden @ weight + bias`` at each position and hooked layer.

    ``args``: ``{"weight": [hidden_size floats], "bias": float (default 0)}``. ``saved``:
    ``{"scores": {layer: [positions]}, "positions": {layer: [positions]}}``.
    """
    weight = args.get("weight")
    if not isinstance(weight, list) or not weight or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weight):
        raise ValueError("weight must be a non-empty list of numbers (one per hidden unit)")
    bias = args.get("bias", 0.0)
    if isinstance(bias, bool) or not isinstance(bias, (int, float)):
        raise ValueError(f"bias must be a number, got {bias!r}")
    unknown = set(args) - {"weight", "bias"}
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)}; linear_probe takes weight, bias")
    direction = torch.tensor(weight, dtype=torch.float32)
    on_device: dict[torch.device, torch.Tensor] = {}  # copied once, not at every step

    def hook(ctx: Any, hidden: torch.Tensor) -> None:
        if hidden.shape[-1] != direction.numel():
            raise ValueError(f"probe has {direction.numel()} weights but the hidden size is "
                             f"{hidden.shape[-1]}")
        weights = on_device.get(hidden.device)
        if weights is None:
            weights = on_device[hidden.device] = direction.to(hidden.device)
        scores = hidden.float() @ weights + bias
        start = int(ctx.positions[0])
        _append(ctx.saved, "scores", ctx.layer_idx, scores, start)
        _append(ctx.saved, "positions", ctx.layer_idx, ctx.positions, start)
        return None

    return hook


def _check_probe(args: Mapping[str, Any], point: str, row_shape: tuple[int, ...] | None) -> None:
    from vllm_lens.common.points import QK_HOOK_POINT

    if point == QK_HOOK_POINT:
        raise HookArgumentError("hook_point", f"linear_probe reads a stream point (its rows are "
                                f"hidden-wide), not the attention kernel's Q ({point})")
    if row_shape is not None and len(args["weight"]) != row_shape[-1]:
        raise HookArgumentError("args.weight", f"has {len(args['weight'])} numbers; the rows "
                                f"at {point} have {row_shape[-1]} (one weight per unit)")


linear_probe.check = _check_probe  # type: ignore[attr-defined]
linear_probe.monitor_score = ("scores", None)  # type: ignore[attr-defined]


#: Attention weights ``attention_to_span`` materialises at once (heads × queries × keys).
_ATTENTION_BLOCK_ELEMENTS = 16 << 20


def attention_to_span(args: Mapping[str, Any]) -> HookFn:
    """Each head's attention mass on a span of key positions, for chosen query positions,
    computed in the worker from the attention kernel's Q and K (hook point ``attn_qk``), so a
    detector gets a few numbers per request instead of Q and K.

    ``args``: ``{"span": [start, stop]`` (absolute key positions, ``stop`` exclusive),
    ``"queries": "last_prompt" | "prompt" | "generated" | "all" | a slice such as
    "prompt[-4:]" | [positions]}`` (default ``"last_prompt"``). The hook keeps the K rows of
    earlier steps itself (hooked requests compute every position, prefix cache or not), on the
    device, for the life of the request. ``saved``: ``{"mass": {layer: [queries, heads]},
    "positions": {layer: [queries]}}`` (float32; the mass is the softmax weight summed over
    the span, exactly as the kernel's attention would weigh it: scale, window, soft cap, ALiBi
    and sinks applied). Bounded like ``logit_lens_topk`` by
    ``VLLM_LENS_ATTENTION_HOOK_MAX_ROWS`` rows (positions × layers × samples; default 65536).
    """
    from vllm_lens.attention import compute_attention_weights
    from vllm_lens.common.positions import parse_selector

    unknown = set(args) - {"span", "queries"}
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)}; attention_to_span takes "
                         "span, queries")
    span = args.get("span")
    if (not isinstance(span, list) or len(span) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)
            or not 0 <= span[0] < span[1]):
        raise ValueError(f"span must be [start, stop] with 0 <= start < stop, got {span!r}")
    queries = args.get("queries", "last_prompt")
    if isinstance(queries, list):
        if not queries or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0
                                  for p in queries):
            raise ValueError("queries must be a selector or a non-empty list of positions")
        wanted = torch.tensor(sorted(set(queries)), dtype=torch.int64)
        selector = None
    else:
        selector = parse_selector(queries) if isinstance(queries, str) else None
        if selector is None or (selector.base != "prompt" and (
                (selector.start or 0) < 0 or (selector.stop or 0) < 0)):
            raise ValueError(f"queries must be 'last_prompt', 'prompt', 'generated', 'all', "
                             f"a slice of them counting from the start, or a list of "
                             f"positions, got {queries!r}")
    # This request's state (the factory runs once per request): K rows by position, and how
    # many query rows each layer recorded (a recomputed position is recorded once).
    keys: dict[int, torch.Tensor] = {}
    filled: dict[int, int] = {}  # K rows 0..filled-1 were written
    recorded: dict[int, int] = {}
    last_query: dict[int, int] = {}

    def hook(ctx: Any, q: torch.Tensor) -> None:
        meta = ctx.attention
        if meta is None:
            raise ValueError(f"layer {ctx.layer_idx}'s attention metadata is unknown")
        positions = ctx.positions
        start, end = int(positions[0]), int(positions[-1]) + 1
        if start > filled.get(ctx.layer_idx, 0):
            raise ValueError(f"positions {filled.get(ctx.layer_idx, 0)}..{start - 1} never "
                             "passed through this hook (served from a cache?): their keys "
                             "are unknown")
        filled[ctx.layer_idx] = max(filled.get(ctx.layer_idx, 0), end)
        stored = keys.get(ctx.layer_idx)
        if stored is None or stored.shape[0] < end:
            grown = torch.empty((max(end, 2 * (0 if stored is None else stored.shape[0])),
                                 *ctx.key.shape[1:]), dtype=ctx.key.dtype, device=ctx.key.device)
            if stored is not None:
                grown[: stored.shape[0]] = stored
            keys[ctx.layer_idx] = stored = grown
        stored[start:end] = ctx.key
        if selector is None:
            pick = torch.isin(positions, wanted)
        else:
            lo, hi = selector.bounds(ctx.prompt_len)
            pick = (positions >= lo) & (positions < (end if hi is None else hi))
        pick &= positions > last_query.get(ctx.layer_idx, -1)
        chosen = positions[pick]
        if not chosen.numel():
            return None
        rows = torch.nonzero(pick).flatten().to(q.device)
        # Weights of a block of queries at a time: at most _ATTENTION_BLOCK_ELEMENTS floats.
        kv_len = int(chosen[-1]) + 1
        block = max(1, _ATTENTION_BLOCK_ELEMENTS // (q.shape[1] * kv_len))
        parts = []
        for lo in range(0, rows.numel(), block):
            weights = compute_attention_weights(
                q.index_select(0, rows[lo : lo + block]), stored[:kv_len], scale=meta["scale"],
                q_positions=chosen[lo : lo + block].to(q.device),
                sliding_window=meta["sliding_window"], logits_soft_cap=meta["logits_soft_cap"],
                alibi_slopes=meta["alibi_slopes"], sinks=meta["sinks"])
            parts.append(weights[:, :, span[0] : span[1]].sum(dim=-1).T)  # [queries, heads]
        mass = torch.cat(parts)
        row = recorded.get(ctx.layer_idx, 0)
        _append(ctx.saved, "mass", ctx.layer_idx, mass, row)
        _append(ctx.saved, "positions", ctx.layer_idx, chosen, row)
        recorded[ctx.layer_idx] = row + chosen.numel()
        last_query[ctx.layer_idx] = int(chosen[-1])
        return None

    return hook


attention_to_span.max_rows = (  # type: ignore[attr-defined]
    "VLLM_LENS_ATTENTION_HOOK_MAX_ROWS", 65536)


def _check_attention_hook(args: Mapping[str, Any], point: str,
                          row_shape: tuple[int, ...] | None) -> None:
    from vllm_lens.common.points import QK_HOOK_POINT

    if point != QK_HOOK_POINT:
        raise HookArgumentError("hook_point", f"attention_to_span reads the attention kernel's "
                                f"Q and K, at the point '{QK_HOOK_POINT}', not {point}")


attention_to_span.check = _check_attention_hook  # type: ignore[attr-defined]
attention_to_span.monitor_score = ("mass", "heads")  # type: ignore[attr-defined]
