"""Attention steering on the worker: the steered heads' output rows recomputed with the
request's edits (runs in: worker).

vLLM's attention kernel reads past keys and values from its paged cache, whose layout each
backend chooses. Rather than read it, a request with ``steer_attention`` keeps its own copy of
the keys and values of the layers it steers (``KeyValueHistory``, this rank's KV heads, on the
model's device), written by position as its rows are computed. The request never reads the
prefix cache (the front end sets ``skip_reading_prefix_cache`` and a salt of its own), so every
position it attends to passed through here first; after a preemption its recomputed rows are
written again, equal to the first.

After the kernel has run, for each steered request and layer, the chosen heads' rows of the
kernel's output (``attn_z``, ``[tokens, heads, head_dim]``) are replaced by the softmax
attention recomputed in float32 from the same post-RoPE Q, K and V with the layer's scale,
soft cap, sliding window and ALiBi slopes (``vllm_lens.attention.attention_scores``) and the
edits of ``spec.attention_steering`` applied. Other heads, layers and requests keep the
kernel's values; the compiled graph is untouched (the kernel runs outside it).

Memory: ``VLLM_LENS_ATTENTION_STEER_MAX_BYTES`` bounds the histories a worker holds (default
1 GiB); a request that would exceed it fails, and nobody else's is dropped.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_lens.attention import attention_scores
from vllm_lens.spec.attention_steering import AttentionEdit

__all__ = ["HistoryBudget", "KeyValueHistory", "LayerEdits", "RequestAttentionSteer",
           "steer_rows"]

#: Scores computed at once for one request's rows of one layer (float32 elements): the query
#: rows are taken in blocks so that a long prefill chunk never needs heads × rows × keys.
_BLOCK_ELEMENTS = 1 << 24


@dataclass
class HistoryBudget:
    """The device bytes all requests' histories on this worker may hold."""

    limit: int
    used: int = 0

    def take(self, nbytes: int) -> None:
        if self.used + nbytes > self.limit:
            raise MemoryError(
                f"attention steering needs {nbytes:,} more bytes for this request's keys and "
                f"values, and the requests steered here hold {self.used:,} of "
                f"VLLM_LENS_ATTENTION_STEER_MAX_BYTES ({self.limit:,}); steer fewer layers, "
                "shorten the request, or raise the setting")
        self.used += nbytes

    def give(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)


@dataclass
class _Layer:
    keys: torch.Tensor
    values: torch.Tensor
    filled: int = 0
    """Positions ``0 .. filled - 1`` are written."""

    @property
    def nbytes(self) -> int:
        return (self.keys.numel() * self.keys.element_size()
                + self.values.numel() * self.values.element_size())


@dataclass
class KeyValueHistory:
    """One request's keys and values, by absolute position, at the layers it steers."""

    budget: HistoryBudget
    layers: dict[int, _Layer] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.layers.values())

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
        if entry is None or end > entry.keys.shape[0]:
            capacity = max(64, 1 << math.ceil(math.log2(end)))
            grown = _Layer(keys.new_empty((capacity, *keys.shape[1:])),
                           values.new_empty((capacity, *values.shape[1:])), filled)
            self.budget.take(grown.nbytes - (0 if entry is None else entry.nbytes))
            if entry is not None:
                grown.keys[:filled] = entry.keys[:filled]
                grown.values[:filled] = entry.values[:filled]
            entry = self.layers[layer] = grown
        entry.keys[pos0:end] = keys
        entry.values[pos0:end] = values
        entry.filled = max(filled, end)
        return entry.keys[:end], entry.values[:end]

    def free(self) -> None:
        self.budget.give(self.nbytes)
        self.layers.clear()


@dataclass(frozen=True)
class LayerEdits:
    """One request's edits at one layer, on this rank's heads."""

    heads: torch.Tensor
    """Local query heads edited (ascending, on the device)."""
    kv_heads: torch.Tensor
    """The local KV head each of them reads."""
    biases: tuple[tuple[torch.Tensor | slice, torch.Tensor, tuple[int, ...], float], ...]
    """(indices into ``heads``, key positions on the device and on the host (ascending),
    bias) per ``key_positions`` edit."""
    emphases: tuple[tuple[torch.Tensor | slice, int, int, float], ...]
    """(indices into ``heads``, start, end, alpha) per ``emphasize`` edit."""
    meta: dict[str, Any]
    """The layer's ``attention_taps.attention_meta``."""

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
        heads = sorted({h for hs in mine for h in hs})
        if not heads:
            return None
        where = {h: i for i, h in enumerate(heads)}

        def select(hs: list[int]) -> torch.Tensor | slice:
            if hs == heads:
                return slice(None)
            return torch.tensor([where[h] for h in hs], dtype=torch.long, device=device)

        biases, emphases = [], []
        for edit, hs in zip(edits, mine):
            if not hs:
                continue
            if edit.emphasis:
                emphases.append((select(hs), *edit.span, edit.alpha))
            else:
                positions = torch.tensor(edit.key_positions, dtype=torch.long, device=device)
                biases.append((select(hs), positions, edit.key_positions, edit.bias))
        index = torch.tensor(heads, dtype=torch.long, device=device)
        return cls(heads=index, kv_heads=torch.div(index, group, rounding_mode="floor"),
                   biases=tuple(biases), emphases=tuple(emphases), meta=meta)


@dataclass
class RequestAttentionSteer:
    """A request's attention steering on this worker: its edits by layer and its history."""

    by_layer: dict[int, LayerEdits]
    history: KeyValueHistory

    @classmethod
    def build(cls, edits: tuple[AttentionEdit, ...], meta: dict[int, dict[str, Any]],
              tp_rank: int, budget: HistoryBudget,
              device: torch.device) -> RequestAttentionSteer:
        """For the layers of this worker (``meta``: its layers' attention metadata)."""
        by_layer: dict[int, LayerEdits] = {}
        for layer, layer_meta in meta.items():
            here = [e for e in edits if layer in e.layers]
            if here:
                offset = tp_rank * int(layer_meta["num_heads"])
                built = LayerEdits.build(here, layer_meta, offset, device)
                if built is not None:
                    by_layer[layer] = built
        return cls(by_layer, KeyValueHistory(budget))

    @property
    def nbytes(self) -> int:
        return self.history.nbytes

    def free(self) -> None:
        self.history.free()


def steer_rows(edits: LayerEdits, history: KeyValueHistory, layer: int, pos0: int,
               query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               out: torch.Tensor) -> None:
    """Replace the edited heads' output rows of one request at one layer.

    ``query`` ``[n, heads, d]``, ``key`` / ``value`` ``[n, kv_heads, d]`` and ``out``
    ``[n, heads, d_v]`` are the request's rows (positions ``pos0 ..``) of the kernel's inputs
    and output on this rank; ``out`` is written in place.
    """
    keys, values = history.extend(layer, pos0, key, value)
    meta = edits.meta
    q = query.index_select(1, edits.heads)
    k = keys.index_select(1, edits.kv_heads)
    v = values.index_select(1, edits.kv_heads).float()
    slopes = meta.get("alibi_slopes")
    if slopes is not None:
        slopes = torch.as_tensor(slopes, dtype=torch.float32,
                                 device=q.device).index_select(0, edits.heads)
    n, n_keys = q.shape[0], k.shape[0]
    k_pos = torch.arange(n_keys, device=q.device)
    bias = _bias_row(edits, n_keys, q.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, q.shape[1] * n_keys))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        scores = attention_scores(
            q[lo:hi], k, scale=meta["scale"], q_start=pos0 + lo,
            sliding_window=meta["sliding_window"], logits_soft_cap=meta["logits_soft_cap"],
            alibi_slopes=slopes)  # [h, rows, keys]
        if bias is not None:
            scores = scores + bias[:, None, :]
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        for sel, start, end, alpha in edits.emphases:
            chosen = probs[sel]
            weighted = chosen * torch.where((k_pos >= start) & (k_pos < end), 1.0, alpha)
            total = weighted.sum(dim=-1, keepdim=True)
            probs[sel] = torch.where(total > 0, weighted / total.clamp_min(1e-38), chosen)
        z = torch.einsum("hqk,khd->qhd", probs, v)
        out[lo:hi].index_copy_(1, edits.heads, z.to(out.dtype))


def _bias_row(edits: LayerEdits, n_keys: int, device: torch.device) -> torch.Tensor | None:
    """``[heads, n_keys]``: the sum of the biases on each key (``None`` without one)."""
    if not edits.biases:
        return None
    bias = torch.zeros((edits.heads.numel(), n_keys), dtype=torch.float32, device=device)
    for sel, positions, host, value in edits.biases:
        seen = positions[:bisect.bisect_left(host, n_keys)]  # no device sync
        rows = bias[sel]
        rows[:, seen] += value
        bias[sel] = rows
    return bias
