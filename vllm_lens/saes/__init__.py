"""Sparse autoencoders beside the taps: read the layouts the field ships SAEs in (sae-lens,
EleutherAI sparsify, Gemma Scope) into one record, and compute their features (runs in: any).

The worker that serves features loads them itself.

>>> from vllm_lens.saes import LAYOUTS
>>> sorted(LAYOUTS)
['gemma-scope', 'gemma-scope-2', 'sae-lens', 'sparsify']

Serving features per request (``output_sae_features``), steering and clamping by feature, and
the operator's registry of named SAEs build on this module (issue 29).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vllm_lens.common.points import FINAL_POINT, resolve
from vllm_lens.saes.formats import LAYOUTS, SAEFormatError, detect_layout, read_sae
from vllm_lens.saes.model import ARCHITECTURES, SAE, TRANSCODERS

__all__ = ["ARCHITECTURES", "LAYOUTS", "SAE", "SAEFormatError", "TRANSCODER_INPUTS",
           "TRANSCODERS", "detect_layout", "load_sae", "to_sparse"]

_SPARSIFY_LAYER = re.compile(r"layers[._](\d+)$")


def load_sae(path: str | Path, hook_point: str | None = None) -> SAE:
    """Read the SAE in directory ``path`` and resolve where it reads.

    Args:
        path: a directory in one of ``LAYOUTS``.
        hook_point: where it reads, as a TransformerLens-style name with its layer
            (``"blocks.12.hook_resid_post"``, ``"blocks.3.attn.hook_z"``); overrides what the
            files say. Needed for Gemma Scope's ``params.npz``; for a sparsify SAE in a folder
            named ``layers.N`` (how sparsify saves them) it defaults to ``N``'s residual stream
            output, ``blocks.N.hook_resid_post``.

    Returns:
        The ``SAE`` on the CPU in its own dtype, with ``point`` and ``layer`` set (and a
        transcoder's ``out_point``: ``mlp_out`` of its layer).

    Raises:
        SAEFormatError: the directory holds no layout read here, its files disagree or use a
            flag that is not honoured, its hook point is missing or not a tap point, or a
            transcoder does not stand in for one layer's MLP (``TRANSCODER_INPUTS`` to that
            layer's ``mlp_out``).

    Examples:
        >>> import json, torch
        >>> from safetensors.torch import save_file
        >>> from vllm_lens.saes import load_sae
        >>> cfg = {"architecture": "standard",
        ...        "metadata": {"hook_name": "blocks.2.hook_resid_post"}}
        >>> _ = (tmp / "cfg.json").write_text(json.dumps(cfg))      # sae-lens' layout
        >>> save_file({"W_enc": torch.randn(128, 512), "b_enc": torch.zeros(512),
        ...            "W_dec": torch.randn(512, 128), "b_dec": torch.zeros(128)},
        ...           tmp / "sae_weights.safetensors")
        >>> sae = load_sae(tmp)
        >>> sae.layout, sae.architecture, sae.point, sae.layer, sae.d_in, sae.d_sae
        ('sae-lens', 'standard', 'resid_post', 2, 128, 512)
    """
    path = Path(path)
    sae = read_sae(path)
    name = hook_point or sae.hook_name
    if name is None and sae.layout == "sparsify" and (m := _SPARSIFY_LAYER.search(path.name)):
        name = f"blocks.{m.group(1)}.hook_resid_post"
    if name is None:
        raise SAEFormatError(f"{path} ({sae.layout}) does not say where it reads; pass "
                             "hook_point='blocks.<layer>.hook_<point>'")
    try:
        point, layer = resolve(name)
    except KeyError as exc:
        raise SAEFormatError(f"{path}: hook point {name!r}: {exc.args[0]}") from None
    if layer is None:
        where = ("'blocks.<last layer>.final_norm'" if point == FINAL_POINT
                 else f"'blocks.<layer>.hook_{point}'")
        raise SAEFormatError(f"{path}: hook point {name!r} names no layer; use {where}")
    sae.hook_name, sae.point, sae.layer = name, point, layer
    if sae.is_transcoder:
        sae.out_point = _output_point(sae, path)
    return sae


#: Points a transcoder may read: the layer's stream before the MLP, or what the MLP reads.
TRANSCODER_INPUTS = ("resid_mid", "mlp_in")


def _output_point(sae: SAE, path: Path) -> str:
    """A transcoder's output point: ``mlp_out`` of the layer it reads (the MLP it stands in
    for); any other pairing is refused naming both."""
    if sae.hook_name_out is None:
        raise SAEFormatError(f"{path}: a {sae.architecture} must say which point it predicts "
                             "(hook_name_out, e.g. 'blocks.<layer>.hook_mlp_out')")
    try:
        point, layer = resolve(sae.hook_name_out)
    except KeyError as exc:
        raise SAEFormatError(f"{path}: hook_name_out {sae.hook_name_out!r}: "
                             f"{exc.args[0]}") from None
    if layer is None:
        raise SAEFormatError(f"{path}: hook_name_out {sae.hook_name_out!r} names no layer; use "
                             "'blocks.<layer>.hook_mlp_out'")
    if point != "mlp_out" or layer != sae.layer or sae.point not in TRANSCODER_INPUTS:
        raise SAEFormatError(
            f"{path}: a transcoder from {sae.hook_name!r} to {sae.hook_name_out!r} is not "
            "served: vllm-lens serves transcoders that stand in for one layer's MLP, reading "
            f"{' or '.join(TRANSCODER_INPUTS)} and predicting mlp_out of the same layer")
    return point


def to_sparse(entry: Mapping[str, Any], d_sae: int) -> torch.Tensor:
    """One ``sae_features`` entry as a ``torch.sparse_coo_tensor`` ``[n, d_sae]`` (the top
    features of each position; the padding, index -1, left out).

    Indices at or past ``d_sae`` are refused (torch's own sparse checks are off by default
    and would build an invalid tensor): pass the ``d_sae`` of the SAE the entry came from.

    Args:
        entry: an entry of ``sae_features`` (``LensResult.sae_features``, a request
            output's, a dataset example's) or ``{"indices", "values"}`` of
            ``ActivationDataset.sae_tensor``: at least ``"indices"`` (integer ``[n, top_k]``,
            -1 for padding) and ``"values"`` (``[n, top_k]``).
        d_sae: the SAE's number of features (``SAE.d_sae``, the ``d_sae`` of
            ``LensClient.saes()`` or of the dataset's ``saes``).

    Returns:
        A coalesced sparse COO tensor ``[n, d_sae]`` in ``values``' dtype: row ``i`` holds
        position ``i``'s top features, zero elsewhere.

    Raises:
        KeyError: ``entry`` lacks ``"indices"`` or ``"values"``.
        ValueError: an index is ``d_sae`` or more.

    Examples:
        >>> import torch
        >>> from vllm_lens.saes import to_sparse
        >>> entry = {"indices": torch.tensor([[3, -1], [0, 2]], dtype=torch.int32),
        ...          "values": torch.tensor([[0.5, 0.0], [1.0, 0.25]])}
        >>> to_sparse(entry, 4).to_dense()
        tensor([[0.0000, 0.0000, 0.0000, 0.5000],
                [1.0000, 0.0000, 0.2500, 0.0000]])
    """
    indices, values = entry["indices"].long(), entry["values"]
    if indices.numel() and int(indices.max()) >= d_sae:
        raise ValueError(f"feature index {int(indices.max())} is not below d_sae={d_sae}: "
                         "pass the d_sae of the SAE the entry came from")
    rows, slots = torch.nonzero(indices >= 0, as_tuple=True)
    # The indices were checked above: the tensor is valid, and torch need not check it again
    # (saying so keeps torch's "sparse invariant checks are implicitly disabled" quiet).
    return torch.sparse_coo_tensor(torch.stack([rows, indices[rows, slots]]),
                                   values[rows, slots], (indices.shape[0], d_sae),
                                   check_invariants=False).coalesce()
