"""Attention steering on the worker: the steered heads' output rows recomputed with the
request's edits (runs in: worker).

vLLM's attention kernel reads past keys and values from its paged cache, whose layout each
backend chooses. Rather than read it, a request with ``steer_attention`` keeps its own copy of
the keys and values it needs (``KeyValueHistory``: at the layers it steers, the key heads its
steered query heads read, on the model's device), written by position as its rows are
computed. The request never reads the prefix cache (the front end sets
``skip_reading_prefix_cache`` and a salt of its own), so every position it attends to passed
through here first; after a preemption its recomputed rows are written again, equal to the
first.

After the kernel has run, for each steered request and layer, the chosen heads' rows of the
kernel's output (``attn_z``, ``[tokens, heads, head_dim]``) are replaced by the softmax
attention recomputed in float32 from the same post-RoPE Q, K and V with the layer's scale,
soft cap, sliding window and ALiBi slopes (``vllm_lens.attention.attention_scores``) and the
edits of ``spec.attention_steering`` applied. Every query head of a key head read is computed
(grouped, so the keys are never copied per query head) and only the steered ones written.
Other heads, layers and requests keep the kernel's values; the compiled graph is untouched
(the kernel runs outside it).

Memory: when a request first runs here it reserves, from
``VLLM_LENS_ATTENTION_STEER_MAX_BYTES`` (``HistoryBudget``), the most its history can hold:
its positions (prompt + ``max_tokens`` within the context) × its layers here × the layer's
key heads on this rank × head size × 2 × dtype bytes — the same on every tensor-parallel rank,
so the ranks refuse alike. One that does not fit fails then (it runs on without its lens work
and reports the setting); a running one never fails for room. The history of a layer is
allocated whole when first written. The scores are computed a block of query rows at a time
(``_BLOCK_ELEMENTS``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_lens.attention import attention_scores
from vllm_lens.spec import LensRequest
from vllm_lens.spec.attention_steering import AttentionEdit

__all__ = ["AttentionSteering", "HistoryBudget", "KeyValueHistory", "LayerEdits",
           "RequestAttentionSteer", "steer_rows"]

#: Scores computed at once for one request's rows of one layer (float32 elements): the query
#: rows are taken in blocks so that a long prefill chunk never needs heads × rows × keys.
_BLOCK_ELEMENTS = 1 << 24


@dataclass
class HistoryBudget:
    """The device bytes all requests' histories on this worker may reserve."""

    limit: int
    used: int = 0

    def take(self, nbytes: int) -> None:
        if self.used + nbytes > self.limit:
            raise MemoryError(
                f"attention steering would reserve {nbytes:,} bytes for this request's keys "
                f"and values (its layers × positions × key heads × head size × 2), and the "
                f"requests steered here hold {self.used:,} of "
                f"VLLM_LENS_ATTENTION_STEER_MAX_BYTES ({self.limit:,}); retry later, steer "
                "fewer layers or heads, shorten the request, or raise the setting")
        self.used += nbytes

    def give(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)


@dataclass
class _Layer:
    keys: torch.Tensor
    values: torch.Tensor
    filled: int = 0
    """Positions ``0 .. filled - 1`` are written."""


@dataclass
class KeyValueHistory:
    """One request's keys and values, by absolute position, at the layers it steers
    (``[positions, key heads read, head_dim]`` each)."""

    budget: HistoryBudget
    positions: int
    """The most positions the request can compute (its reservation's bound)."""
    reserved: int = 0
    """Bytes taken from ``budget``."""
    layers: dict[int, _Layer] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(e.keys.numel() * e.keys.element_size()
                   + e.values.numel() * e.values.element_size() for e in self.layers.values())

    def reserve(self, nbytes: int) -> None:
        self.budget.take(nbytes)
        self.reserved = nbytes

    def extend(self, layer: int, pos0: int, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows of positions ``pos0 ..`` and return the keys and values of
        positions ``0 .. pos0 + len(keys) - 1``."""
        end = pos0 + keys.shape[0]
        entry = self.layers.get(layer)
        filled = 0 if entry is None else entry.filled
        if pos0 > filled:
            raise RuntimeError(
                f"attention steering has not seen the keys of positions {filled}..{pos0 - 1} "
                f"at layer {layer} (served from a cache it does not read?); the request cannot "
                "be steered exactly")
        if end > self.positions:
            raise RuntimeError(f"position {end - 1} is past the {self.positions} positions "
                               "this request's attention steering reserved for")
        if entry is None:  # reserved whole: allocated whole, never grown
            entry = self.layers[layer] = _Layer(
                keys.new_empty((self.positions, *keys.shape[1:])),
                values.new_empty((self.positions, *values.shape[1:])))
        entry.keys[pos0:end] = keys
        entry.values[pos0:end] = values
        entry.filled = max(filled, end)
        return entry.keys[:end], entry.values[:end]

    def free(self) -> None:
        self.layers.clear()
        self.budget.give(self.reserved)
        self.reserved = 0


@dataclass(frozen=True)
class LayerEdits:
    """One request's edits at one layer, on this rank's heads.

    The heads computed are every query head of the key heads the steered heads read
    (``kv_heads``), in local order: computed head ``i`` is local query head
    ``kv_heads[i // group] * group + i % group``.
    """

    kv_heads: torch.Tensor
    """Local key heads read (ascending), whose keys and values the history keeps."""
    group: int
    """Query heads per key head."""
    steered: torch.Tensor
    """Indices (into the computed heads) of the steered heads, ascending."""
    written: torch.Tensor
    """Their local query heads (where their rows are written)."""
    by_kv: tuple[tuple[int, torch.Tensor | None], ...]
    """(slot in ``kv_heads``, indices into ``steered`` of the heads reading it; ``None``:
    all of them) per key head read."""
    biases: tuple[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], float], ...]
    """(computed heads, key positions on the device and on the host (ascending), bias) per
    ``key_positions`` edit."""
    emphases: tuple[tuple[torch.Tensor, int, int, float], ...]
    """(computed heads, start, end, alpha) per ``emphasize`` edit."""
    meta: dict[str, Any]
    """The layer's ``attention_taps.attention_meta``."""
    slopes: torch.Tensor | None = None
    """The computed heads' ALiBi slopes (float32), if the layer has them."""

    @property
    def n_heads(self) -> int:
        return self.kv_heads.numel() * self.group

    @classmethod
    def build(cls, edits: list[AttentionEdit], meta: dict[str, Any], head_offset: int,
              device: torch.device) -> LayerEdits | None:
        """``None`` when no edit touches a head of this rank."""
        local = int(meta["num_heads"])
        group = local // int(meta["num_kv_heads"])
        mine = []
        for edit in edits:
            wanted = range(local) if edit.heads is None else [
                h - head_offset for h in edit.heads if head_offset <= h < head_offset + local]
            mine.append(sorted(wanted))
        steered = sorted({h for hs in mine for h in hs})
        if not steered:
            return None
        kv_heads = sorted({h // group for h in steered})
        slot = {kv: i for i, kv in enumerate(kv_heads)}

        def computed(hs: list[int]) -> torch.Tensor:
            return torch.tensor([slot[h // group] * group + h % group for h in hs],
                                dtype=torch.long, device=device)

        biases, emphases = [], []
        for edit, hs in zip(edits, mine):
            if not hs:
                continue
            if edit.emphasis:
                emphases.append((computed(hs), *edit.span, edit.alpha))
            else:
                positions = torch.tensor(edit.key_positions, dtype=torch.long, device=device)
                biases.append((computed(hs), positions, edit.key_positions, edit.bias))
        heads = [kv * group + r for kv in kv_heads for r in range(group)]
        by_kv = tuple(
            (i, None if len(kv_heads) == 1 else torch.tensor(
                [j for j, h in enumerate(steered) if h // group == kv], dtype=torch.long,
                device=device))
            for i, kv in enumerate(kv_heads))
        slopes = meta.get("alibi_slopes")
        if slopes is not None:
            slopes = torch.tensor([slopes[h] for h in heads], dtype=torch.float32,
                                  device=device)
        return cls(kv_heads=torch.tensor(kv_heads, dtype=torch.long, device=device),
                   group=group, steered=computed(steered),
                   written=torch.tensor(steered, dtype=torch.long, device=device), by_kv=by_kv,
                   biases=tuple(biases), emphases=tuple(emphases), meta=meta, slopes=slopes)


@dataclass
class RequestAttentionSteer:
    """A request's attention steering on this worker: its edits by layer and its history."""

    by_layer: dict[int, LayerEdits]
    history: KeyValueHistory

    @classmethod
    def build(cls, edits: tuple[AttentionEdit, ...], meta: dict[int, dict[str, Any]],
              tp_rank: int, budget: HistoryBudget, positions: int, itemsize: int,
              device: torch.device) -> RequestAttentionSteer:
        """For the layers of this worker (``meta``: its layers' attention metadata), with
        the history's reservation for ``positions`` positions of ``itemsize``-byte values
        taken from ``budget`` (``MemoryError`` if it does not fit)."""
        by_layer: dict[int, LayerEdits] = {}
        for layer, layer_meta in meta.items():
            here = [e for e in edits if layer in e.layers]
            if here:
                offset = tp_rank * int(layer_meta["num_heads"])
                built = LayerEdits.build(here, layer_meta, offset, device)
                if built is not None:
                    by_layer[layer] = built
        history = KeyValueHistory(budget, positions)
        # Every layer it steers here, with all of the layer's key heads on this rank (a
        # bound: the same on every rank, whichever heads it steers).
        layers = {layer for e in edits for layer in e.layers if layer in meta}
        history.reserve(sum(positions * int(meta[layer]["num_kv_heads"]) * 2
                            * int(meta[layer]["head_size"]) * itemsize for layer in layers))
        return cls(by_layer, history)

    @property
    def nbytes(self) -> int:
        return self.history.nbytes

    def free(self) -> None:
        self.history.free()


class AttentionSteering:
    """This worker's attention steering: a request's state when it first runs (``prepare``)
    and, after each layer's kernel, the steered requests' rows of its output (``edit``)."""

    def __init__(self, meta: dict[int, dict[str, Any]], tp_rank: int,
                 layers: frozenset[int], limit: int) -> None:
        self.meta = meta
        """Layer -> ``attention_meta`` of this worker's tapped attention layers."""
        self.tp_rank = tp_rank
        self.layers = layers
        """The layers of this worker's pipeline stage."""
        self.budget = HistoryBudget(limit)
        """``VLLM_LENS_ATTENTION_STEER_MAX_BYTES``: what the histories may reserve."""

    def prepare(self, lens: LensRequest, n_prompt: int, device: torch.device,
                dtype: torch.dtype) -> RequestAttentionSteer:
        """A request's edits on this worker, its history reserved for
        ``min(context, n_prompt + max_tokens)`` positions (``MemoryError`` naming the setting
        if the budget cannot hold it)."""
        missing = sorted({layer for edit in lens.steer_attention for layer in edit.layers
                          if layer in self.layers and layer not in self.meta})
        if missing:
            raise RuntimeError(f"the attention of layers {missing} is not tapped on this worker")
        if lens.attention_positions <= 0 or lens.attention_max_tokens <= 0:
            raise ValueError("the front end set no position bound for its attention steering "
                             "(attention_positions, attention_max_tokens)")
        positions = min(lens.attention_positions, n_prompt + lens.attention_max_tokens)
        return RequestAttentionSteer.build(lens.steer_attention, self.meta, self.tp_rank,
                                           self.budget, positions, dtype.itemsize, device)

    def edit(self, steered: list[tuple[Any, RequestAttentionSteer]], layer: int,
             query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             out: torch.Tensor | None, *, alive: Callable[[str], bool],
             fail: Callable[[str, BaseException], None]) -> None:
        """Rewrite ``out`` (the kernel's output, ``None`` where it cannot be rewritten) for
        each ``(plan.RequestSlice, state)`` steered at ``layer``; a request that fails is
        reported to ``fail`` and the others go on; ``alive``: whether a request still runs its
        lens work (one failed earlier in the step has no history left)."""
        for s, state in steered:
            if not alive(s.req_id):
                continue
            try:
                if out is None:
                    raise RuntimeError("this layer's attention kernel call cannot be rewritten "
                                       "(a quantized output, or no key and value)")
                z = out if out.dim() == 3 else out.view(out.shape[0], query.shape[1], -1)
                rows = slice(s.start, s.end)
                steer_rows(state.by_layer[layer], state.history, layer, s.pos0, query[rows],
                           key[rows], value[rows], z[rows])
            except Exception as exc:  # this request fails, never the forward pass
                fail(s.req_id, exc)


def steer_rows(edits: LayerEdits, history: KeyValueHistory, layer: int, pos0: int,
               query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               out: torch.Tensor) -> None:
    """Replace the steered heads' output rows of one request at one layer.

    ``query`` ``[n, heads, d]``, ``key`` / ``value`` ``[n, kv_heads, d]`` and ``out``
    ``[n, heads, d_v]`` are the request's rows (positions ``pos0 ..``) of the kernel's inputs
    and output on this rank; ``out`` is written in place.
    """
    keys, values = history.extend(layer, pos0, key.index_select(1, edits.kv_heads),
                                  value.index_select(1, edits.kv_heads))
    meta = edits.meta
    n = query.shape[0]
    local_kv = key.shape[1]
    # The query heads of the key heads read, grouped by key head: [n, computed heads, d].
    q = query.reshape(n, local_kv, edits.group, query.shape[-1]).index_select(
        1, edits.kv_heads).reshape(n, edits.n_heads, query.shape[-1])
    n_keys = keys.shape[0]
    k_pos = torch.arange(n_keys, device=q.device)
    bias = _bias_row(edits, n_keys, q.device)
    weight = _emphasis_weight(edits, k_pos)
    step = max(1, _BLOCK_ELEMENTS // max(1, edits.n_heads * n_keys))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        scores = attention_scores(
            q[lo:hi], keys, scale=meta["scale"], q_start=pos0 + lo,
            sliding_window=meta["sliding_window"], logits_soft_cap=meta["logits_soft_cap"],
            alibi_slopes=edits.slopes)  # [computed heads, rows, keys]
        if bias is not None:
            scores += bias[:, None, :]
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        del scores
        if weight is not None:  # (float64: stacked alphas up to 1e6 ** 32 stay finite)
            weighted = probs.double() * weight[:, None, :]
            total = weighted.sum(dim=-1, keepdim=True)
            probs = torch.where(total > 0, weighted.div_(total.clamp_min(1e-300)).float(),
                                probs)
            del weighted
        probs = probs.index_select(0, edits.steered)
        # Each steered head against its key head's values (float32, one key head at a time).
        z = None
        for slot, mine in edits.by_kv:
            if mine is None:  # one key head read: every steered head reads it
                z = torch.einsum("hqk,kd->qhd", probs, values[:, slot].float())
                break
            if z is None:
                z = torch.empty((hi - lo, edits.steered.numel(), values.shape[-1]),
                                dtype=torch.float32, device=q.device)
            z[:, mine] = torch.einsum("hqk,kd->qhd", probs.index_select(0, mine),
                                      values[:, slot].float())
        out[lo:hi].index_copy_(1, edits.written, z.to(out.dtype))


def _bias_row(edits: LayerEdits, n_keys: int, device: torch.device) -> torch.Tensor | None:
    """``[computed heads, n_keys]``: the sum of the biases on each key (``None`` without
    one)."""
    if not edits.biases:
        return None
    bias = torch.zeros((edits.n_heads, n_keys), dtype=torch.float32, device=device)
    for heads, positions, host, value in edits.biases:
        seen = positions[:bisect.bisect_left(host, n_keys)]  # no device sync
        rows = bias.index_select(0, heads)
        rows[:, seen] += value
        bias.index_copy_(0, heads, rows)
    return bias


def _emphasis_weight(edits: LayerEdits, k_pos: torch.Tensor) -> torch.Tensor | None:
    """``[computed heads, n_keys]``: the product of every emphasis's weights (1 inside its
    span, ``alpha`` outside) for each head and key, float64 (``None`` without one)."""
    if not edits.emphases:
        return None
    weight = torch.ones((edits.n_heads, k_pos.numel()), dtype=torch.float64,
                        device=k_pos.device)
    for heads, start, end, alpha in edits.emphases:
        inside = (k_pos >= start) & (k_pos < end)
        factor = torch.full((k_pos.numel(),), alpha, dtype=torch.float64,
                            device=k_pos.device).masked_fill_(inside, 1.0)
        weight.index_copy_(0, heads, weight.index_select(0, heads) * factor)
    return weight
