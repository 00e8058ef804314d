"""Merging what several workers or several streamed outputs sent for one request (runs in: front
end).

A request's rows come back in parts: one per pipeline stage (its layers), one per
tensor-parallel rank for the signals each rank holds a part of (``points.SHARDED``), and, for
a streamed request, one per output. This module joins them: rank payloads into one tensor
(``merge_rank_payloads``), the hook results of the stages (``merge_hook_results``), and
consecutive streamed results end to end (``join_streamed``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_lens.common.points import KV_HEAD_SIGNALS, shard_dim
from vllm_lens.hooks import HookError

__all__ = ["join_features", "join_rows", "join_streamed", "merge_hook_results",
           "merge_rank_payloads"]


def merge_rank_payloads(
    parts: Sequence[tuple[Mapping[str, Any], torch.Tensor]], n_kv_heads: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one signal of one request (``handoff.receive`` results) from the ranks that
    captured it: pipeline stages in layer order; the tensor-parallel parts of a sharded
    signal (``points.SHARDED``) joined in rank order along their heads or columns (a key head
    that several ranks hold, when there are fewer key heads than ranks, is kept once).
    Returns (tensor, positions)."""
    ordered = sorted(parts, key=lambda part: (part[0]["layers"][0], part[0].get("tp_rank", 0)))
    stages: dict[tuple[int, ...], list[tuple[Mapping[str, Any], torch.Tensor]]] = {}
    for header, tensor in ordered:
        stages.setdefault(tuple(header["layers"]), []).append((header, tensor))
    tensors = []
    for shards in stages.values():
        first = shards[0][0]["positions"]
        if any(not torch.equal(h["positions"], first) for h, _ in shards[1:]):
            raise ValueError("tensor-parallel ranks returned different positions for one "
                             "signal")
        if len(shards) == 1:
            tensors.append(shards[0][1])
            continue
        signal = shards[0][0]["signal"]
        if signal in KV_HEAD_SIGNALS and 0 < n_kv_heads < len(shards):
            replicas = len(shards) // n_kv_heads  # ranks r holds key head r // replicas
            shards = shards[::replicas]
        tensors.append(torch.cat([t for _, t in shards], dim=shard_dim(signal)))
    tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return tensor, ordered[0][0]["positions"]


def join_rows(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Lay the ``activations`` of consecutive streamed outputs end to end: tensors of rows
    along positions (``[n_layers, n_rows, ...]``: dim 1; position lists: dim 0); other
    values (``qk_meta`` ...) from the first."""
    joined = dict(parts[0])
    for name, first in parts[0].items():
        if isinstance(first, torch.Tensor) and len(parts) > 1:
            dim = 0 if first.dim() == 1 else 1
            joined[name] = torch.cat([part[name] for part in parts], dim=dim)
    return joined


def join_features(parts: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Lay the ``sae_features`` of consecutive streamed outputs end to end: per entry, every
    per-position tensor (``positions``, ``indices``, ``values``, ``nmse``, ``l0``) along
    positions."""
    return [{name: torch.cat([part[i][name] for part in parts])
             if isinstance(value, torch.Tensor) else value for name, value in entry.items()}
            for i, entry in enumerate(parts[0])]


def join_streamed(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Lay consecutive streamed results (``attach_partial``, then possibly a final one)
    end to end: their ``activations`` (``join_rows``) and ``sae_features``
    (``join_features``); the other fields from the last. A field the last one has as
    ``None`` (the request failed) stays ``None``: nothing partial is returned."""
    joined = dict(parts[-1])
    for name, join in (("activations", join_rows), ("sae_features", join_features)):
        found = [part[name] for part in parts if part.get(name) is not None]
        failed = name in parts[-1] and parts[-1][name] is None
        if found and not failed:
            joined[name] = join(found)
    return joined


def merge_hook_results(
    stages: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, Any] | None, HookError | None]:
    """Merge one request's hook results from its pipeline stages (each reported by its TP rank
    0, so nothing is duplicated): per hook, the ``saved`` dicts are united, and dict values
    (e.g. per-layer entries) are united one level down. Returns (results, first error)."""
    merged: dict[str, dict[str, Any]] = {}
    error = None
    for stage in stages:
        if stage.get("error") and error is None:
            error = HookError(stage["error"]["message"], stage["error"]["traceback"])
        for index, saved in stage.get("results", {}).items():
            into = merged.setdefault(index, {})
            for name, value in saved.items():
                if isinstance(value, dict) and isinstance(into.get(name), dict):
                    into[name] = {**into[name], **value}
                else:
                    into[name] = value
    if error is not None:
        return None, error
    return merged, None
