"""Direct logit attribution of a finished request's SAE features and components, computed when
it is fetched (runs in: worker).

TP rank 0 of the one pipeline stage (attribution is refused under TP and PP).

While the request runs, each selected row of an ``attribution`` entry is staged as its top
features (``capture.encode_top_features``) and the final norm's scale of that position
(``capture.READOUT``). The token whose logit each position is attributed to is known only
once the request ends (the token sampled from the last position), so the attribution is
computed at fetch, from the token ids the front end sends with it: for feature ``i`` with
value ``v`` at a position ``p`` whose norm scale is ``s``, ``readout.attribute``'s
``v * (W_dec[i] . u_t) / s`` onto token ``t`` (the spec's ``attribution_token``, or the token
at ``p + 1``). A component attribution (``spec.logit_attribution``) is the same with the
captured rows of the embedding and of each layer's ``attn_out`` and ``mlp_out`` as the vectors
(value 1), and the last layer's captured stream for the scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["attribute_rows", "component_rows", "following_tokens"]

#: Bytes of decoder rows gathered at once (``[rows, top_k, d]`` float32).
_CHUNK_BYTES = 64 << 20


def following_tokens(positions: torch.Tensor, tokens: Mapping[str, Sequence[int]] | None,
                     token: int | None) -> torch.Tensor:
    """Per position, the token id its logit is attributed to: ``token`` if given, else the
    token at the next position (prompt, then generated), -1 where there is none.

    >>> following_tokens(torch.tensor([0, 1, 2]), {"prompt_token_ids": [5, 6],
    ...                  "token_ids": [7]}, None).tolist()
    [6, 7, -1]
    """
    if token is not None:
        return torch.full((positions.numel(),), int(token), dtype=torch.int64)
    if tokens is None:
        raise ValueError("the request's token ids did not reach the worker with its fetch")
    sequence = torch.tensor([*tokens.get("prompt_token_ids", ()), *tokens.get("token_ids", ())],
                            dtype=torch.int64)
    after = positions.long() + 1
    known = after < sequence.numel()
    return torch.where(known, sequence[after.clamp(max=max(sequence.numel() - 1, 0))]
                       if sequence.numel() else torch.zeros_like(after), -1)


def attribute_rows(rows: torch.Tensor, positions: torch.Tensor, spec: Any, sae: Any,
                   readout: Any, tokens: Mapping[str, Sequence[int]] | None) -> torch.Tensor:
    """One entry's staged rows ``[n, width + 1]`` (float32, the last column the norm scale)
    turned into ``[n, width + top_k + 1]``: the features as they were, then their
    attributions (0 for padding, NaN where the token is not known), then the token id."""
    k = spec.top_k
    base, scales = rows[:, :-1], rows[:, -1]
    targets = following_tokens(positions, tokens, spec.attribution_token)
    if targets.numel() and int(targets.max()) >= readout.vocab_size:
        raise ValueError(f"token id {int(targets.max())} is outside the model's vocabulary "
                         f"({readout.vocab_size})")
    device = readout.unembed.device
    step = max(1, _CHUNK_BYTES // (4 * k * readout.unembed.shape[1]))
    parts = []
    for lo in range(0, rows.shape[0], step):
        hi = lo + step
        indices = base[lo:hi, :k].to(device).long()
        found = readout.attribute(sae.directions(indices), base[lo:hi, k:2 * k].to(device),
                                  scales[lo:hi].to(device), targets[lo:hi].to(device))
        parts.append(found.masked_fill(indices < 0, 0.0).cpu())
    attribution = torch.cat(parts) if parts else rows.new_zeros((0, k))
    return torch.cat([base, attribution, targets.float()[:, None]], dim=1)


def component_rows(captures: Mapping[str, Mapping[str, Any]], spec: Any, readout: Any,
                   tokens: Mapping[str, Sequence[int]] | None,
                   projections: Mapping[int, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit attribution's rows from its assembled captures (``point -> assemble(...)``:
    ``resid_pre`` of layer 0, ``attn_out`` and ``mlp_out`` of its layers, the last layer's
    ``resid_post``, with heads ``attn_z`` of its layers): ``([n, 2 + 2L (+ L * H)] float32,
    positions)`` — per position the token, the embedding's attribution, each layer's
    ``attn_out``'s, each layer's ``mlp_out``'s, then with heads each layer's heads' (``attn_z``
    of a head through its columns of the layer's output projection: ``projections``, layer ->
    ``W_O`` float32 ``[d, heads * head_dim]``, ``head_projection.matrix``).

    Raises:
        ValueError: the points' rows are not of the same positions (a step lost some), or a
            layer's projection is missing.
    """
    positions = captures["resid_post"]["positions"]
    for point, found in captures.items():
        if not torch.equal(found["positions"], positions):
            raise ValueError(f"the {point} rows kept for the logit attribution are not of the "
                             "positions of the last layer's")
    targets = following_tokens(positions, tokens, spec.token)
    if targets.numel() and int(targets.max()) >= readout.vocab_size:
        raise ValueError(f"token id {int(targets.max())} is outside the model's vocabulary "
                         f"({readout.vocab_size})")
    weights = []
    if spec.heads:
        missing = [layer for layer in spec.layers if layer not in (projections or {})]
        if missing:
            raise ValueError(f"no proven output projection of layers {missing}")
        weights = [projections[layer] for layer in spec.layers]
    device = readout.unembed.device
    final = captures["resid_post"]["tensor"][0]
    parts = [captures[p]["tensor"] for p in ("resid_pre", "attn_out", "mlp_out")]
    z = captures["attn_z"]["tensor"] if spec.heads else None  # [L, n, H, head_dim]
    n_rows, width = final.shape[0], sum(part.shape[0] for part in parts)
    step = max(1, _CHUNK_BYTES // (4 * width * final.shape[-1]))
    found = []
    with torch.inference_mode():
        for lo in range(0, n_rows, step):
            hi = lo + step
            u = readout.directions(readout.norm_scale(final[lo:hi].to(device)),
                                   targets[lo:hi].to(device))  # [rows, d]
            row = [(part[:, lo:hi].to(device).float() * u).sum(-1).t() for part in parts]
            for j, w_o in enumerate(weights):  # float32 [d, heads * head_dim]
                per_head = z[j, lo:hi].to(device).float().reshape(u.shape[0], spec.heads, -1)
                row.append((per_head * (u @ w_o).view(per_head.shape)).sum(-1))
            found.append(torch.cat(row, dim=1).cpu())
    out = (torch.cat(found) if found
           else torch.zeros(0, width + len(spec.layers) * spec.heads))
    return torch.cat([targets.float()[:, None], out], dim=1), positions
