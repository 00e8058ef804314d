"""Attention patterns from captured Q and K (runs in: any).

It needs only torch.

``output_qk`` returns the post-RoPE query and key of chosen layers exactly as vLLM's attention
kernel received them, plus what the kernel did with them (``qk_meta``: scale, soft cap,
sliding window, ALiBi slopes, attention sinks). These helpers rebuild the attention weights::

    out = llm.generate(prompt, SamplingParams(extra_args={"output_qk": [5]}))[0]
    pattern = attention_patterns(out.activations, 5)   # [n_heads, seq, seq]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["attention_patterns", "attention_scores", "compute_attention_weights"]


def compute_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    q_start: int | None = None,
    q_positions: torch.Tensor | None = None,
    sliding_window: Sequence[int] = (-1, -1),
    logits_soft_cap: float = 0.0,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    sinks: Sequence[float] | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Softmax attention weights ``[n_heads, q_len, kv_len]``.

    Args:
        q: ``[q_len, n_heads, head_dim]``; its rows are positions ``q_start ..``.
        k: ``[kv_len, n_kv_heads, head_dim]`` at positions ``0 .. kv_len - 1``; grouped-query
            heads are shared by ``n_heads / n_kv_heads`` query heads each.
        scale: multiplies ``q · k`` (vLLM's ``qk_meta["scale"]``, usually
            ``head_dim ** -0.5``).
        causal: mask keys after each query's position (default ``True``).
        q_start: position of ``q[0]`` (default ``kv_len - q_len``: the queries are the last
            positions).
        q_positions: the position of each query row, for rows that are not consecutive
            (overrides ``q_start``).
        sliding_window: ``(left, right)`` as vLLM keeps it: a query at ``i`` sees keys
            ``i - left .. i + right`` (``-1``: unbounded).
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking (0: off).
        alibi_slopes: per head, ``slope * (key_pos - query_pos)`` is added to the scores.
        sinks: per head, a logit that joins each softmax's denominator only.
        dtype: the dtype the scores are computed and returned in (default float32).

    Returns:
        ``[n_heads, q_len, kv_len]`` weights in ``dtype`` on ``q``'s device; each row sums
        to 1 (less with ``sinks``); masked keys have weight 0.

    Raises:
        ValueError: ``q`` or ``k`` is not 3D, or ``n_heads`` is not a multiple of
            ``n_kv_heads``.

    Examples:
        >>> import torch
        >>> from vllm_lens.attention import compute_attention_weights
        >>> q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
        >>> w = compute_attention_weights(q, k, scale=32 ** -0.5)
        >>> w.shape, bool(torch.allclose(w.sum(-1), torch.ones(4, 5)))
        (torch.Size([4, 5, 5]), True)
        >>> bool((w[:, 0, 1:] == 0).all())  # causal: the first query sees only itself
        True
    """
    scores = attention_scores(q, k, scale=scale, causal=causal, q_start=q_start,
                              q_positions=q_positions, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                              dtype=dtype)
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = torch.as_tensor(sinks, dtype=dtype, device=q.device)[:, None, None]
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(scores - top)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    q_start: int | None = None,
    q_positions: torch.Tensor | None = None,
    sliding_window: Sequence[int] = (-1, -1),
    logits_soft_cap: float = 0.0,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The scores that the softmax of ``compute_attention_weights`` reads: scaled,
    soft-capped, with ALiBi, and ``-inf`` where the mask hides a key. Attention steering edits
    them (``worker.attention_steering``).

    Args:
        q: ``[q_len, n_heads, head_dim]``; its rows are positions ``q_start ..``.
        k: ``[kv_len, n_kv_heads, head_dim]`` at positions ``0 .. kv_len - 1``; query head
            ``h`` reads key head ``h // (n_heads / n_kv_heads)`` (the keys are not copied per
            query head).
        scale: multiplies ``q · k``.
        causal: mask keys after each query's position (default ``True``).
        q_start: position of ``q[0]`` (default ``kv_len - q_len``).
        q_positions: the position of each query row (overrides ``q_start``).
        sliding_window: ``(left, right)`` as vLLM keeps it (``-1``: unbounded).
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking (0: off).
        alibi_slopes: per head, ``slope * (key_pos - query_pos)`` is added.
        dtype: the dtype the scores are computed and returned in (default float32).

    Returns:
        ``[n_heads, q_len, kv_len]`` scores in ``dtype``, ``-inf`` at masked keys.

    Raises:
        ValueError: ``q`` or ``k`` is not 3D, or ``n_heads`` is not a multiple of
            ``n_kv_heads``.

    Examples:
        >>> import torch
        >>> from vllm_lens.attention import attention_scores
        >>> s = attention_scores(torch.ones(2, 1, 4), torch.ones(2, 1, 4), scale=0.5)
        >>> s.tolist()
        [[[2.0, -inf], [2.0, 2.0]]]
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [positions, heads, head_dim], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    q_len, n_heads, _ = q.shape
    kv_len, n_kv, _ = k.shape
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads cannot share {n_kv} key heads evenly")
    if q_start is None:
        q_start = kv_len - q_len
    # Grouped: query head h reads key head h // (n_heads / n_kv), without copying the keys
    # once per query head.
    grouped = q.to(dtype).reshape(q_len, n_kv, n_heads // n_kv, q.shape[-1])
    scores = torch.einsum("qgrd,kgd->grqk", grouped, k.to(dtype)).reshape(
        n_heads, q_len, kv_len) * scale
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if q_positions is not None:
        q_pos = torch.as_tensor(q_positions, device=q.device).reshape(q_len, 1)
    else:
        q_pos = torch.arange(q_start, q_start + q_len, device=q.device)[:, None]
    k_pos = torch.arange(kv_len, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, dtype=dtype, device=q.device)
        scores = scores + slopes[:, None, None] * (k_pos - q_pos).to(dtype)
    masked = torch.zeros((q_len, kv_len), dtype=torch.bool, device=q.device)
    if causal:
        masked |= k_pos > q_pos
    left, right = (int(w) for w in sliding_window)
    if left >= 0:
        masked |= k_pos < q_pos - left
    if right >= 0:
        masked |= k_pos > q_pos + right
    return scores.masked_fill(masked, float("-inf"))


def attention_patterns(activations: Mapping[str, Any], layer: int, *,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The attention weights ``[n_heads, seq, seq]`` of ``layer`` over every captured position
    (from an ``output_qk`` result: ``out.activations``).

    Uses the layer's ``qk_meta`` (scale, sliding window, soft cap, ALiBi slopes, sinks) so
    that the weights are the ones vLLM's kernel computed, causal, queries at positions
    ``0 .. seq - 1``.

    Args:
        activations: an output's activations with ``output_qk`` captured (``qk_layers``,
            ``qk_meta``, ``attn_q`` ``[n_layers, seq, n_heads, head_dim]``, ``attn_k``
            ``[n_layers, seq, n_kv_heads, head_dim]``, and optionally
            ``attn_q_positions``); decoded HTTP activations work too.
        layer: a decoder layer listed in ``qk_layers``.
        dtype: the dtype of the computation and the result (default float32).

    Returns:
        ``[n_heads, seq, seq]`` softmax weights in ``dtype``; ``seq`` is the number of
        captured positions.

    Raises:
        KeyError: ``layer`` was not captured with ``output_qk`` (the message lists those
            that were), or ``activations`` lacks ``qk_meta``, ``attn_q`` or ``attn_k``.
        ValueError: Q/K were not captured at positions ``0 .. seq - 1``.

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens.attention import attention_patterns
        >>> sp = SamplingParams(max_tokens=1, extra_args={"output_qk": [0, 2]})
        >>> out = llm.generate(["The quick brown fox"], sp)[0]
        >>> pattern = attention_patterns(out.activations, 2)
        >>> pattern.shape[0] == out.activations["qk_meta"][1]["num_heads"], pattern.dtype
        (True, torch.float32)
    """
    layers = list(activations.get("qk_layers") or [])
    if layer not in layers:
        raise KeyError(f"layer {layer} was not captured with output_qk (captured: {layers})")
    i = layers.index(layer)
    meta = activations["qk_meta"][i]
    q, k = activations["attn_q"][i], activations["attn_k"][i]
    positions = activations.get("attn_q_positions")
    if positions is not None and not torch.equal(
            torch.as_tensor(positions), torch.arange(len(positions))):
        raise ValueError("Q/K were not captured at positions 0..n-1 (an attention pattern "
                         "needs every key); use compute_attention_weights on what you have")
    return compute_attention_weights(
        q, k, scale=meta["scale"], q_start=0, sliding_window=meta["sliding_window"],
        logits_soft_cap=meta["logits_soft_cap"], alibi_slopes=meta["alibi_slopes"],
        sinks=meta["sinks"], dtype=dtype)
