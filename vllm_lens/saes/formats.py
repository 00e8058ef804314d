"""Reading sparse autoencoders from the layouts the field ships them in, without importing the
libraries that wrote them (runs in: any).

``LAYOUTS``, recognised by the files in the directory:

- ``sae-lens``: ``cfg.json`` + ``sae_weights.safetensors`` (sae-lens' ``SAE.save_model``):
  architectures ``standard``, ``jumprelu``, ``topk``, ``abstopk`` and ``gated`` (a BatchTopK
  or Matryoshka BatchTopK SAE saved for inference is a ``jumprelu`` file; their training
  checkpoints, matching-pursuit, temporal SAEs and transcoders are refused naming why:
  ``REFUSED``); the hook point is the cfg's ``metadata.hook_name`` (or ``hook_name``).
  Flags read and honoured: ``apply_b_dec_to_input``, ``rescale_acts_by_decoder_norm``,
  ``reshape_activations`` (``hook_z``: rows are flattened heads, as vllm-lens' ``attn_z``
  rows are once flattened); ``normalize_activations`` other than ``none`` is refused by name,
  as is any architecture sae-lens has that is not listed here.
- ``sparsify`` (EleutherAI): ``cfg.json`` + ``sae.safetensors`` (``encoder.weight
  [d_sae, d_in]``, ``encoder.bias``, ``W_dec [d_sae, d_in]``, ``b_dec``), TopK with the cfg's
  ``k``, ``b_dec`` subtracted from the input; ``groupmax`` activations, transcoders and skip
  connections are refused. Its hook point is not in its files: the caller names it.
- ``gemma-scope``: ``params.npz`` (``W_enc``, ``W_dec``, ``b_enc``, ``b_dec``, ``threshold``),
  JumpReLU without ``b_dec`` subtracted from the input; the caller names the hook point.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vllm_lens.saes.model import ARCHITECTURES, SAE

__all__ = ["LAYOUTS", "REFUSED", "SAEFormatError", "detect_layout", "read_sae"]

LAYOUTS = {
    "sae-lens": ("cfg.json", "sae_weights.safetensors"),
    "sparsify": ("cfg.json", "sae.safetensors"),
    "gemma-scope": ("params.npz",),
}

_TRANSCODER = ("is a transcoder (it reads the MLP's input and predicts its output); "
               "transcoders are not served yet")
#: sae-lens architectures that are not served, and why (the error names them).
REFUSED = {
    "batchtopk": "is a training checkpoint; save it for inference with sae-lens "
                 "(save_inference_model writes it as 'jumprelu' with its threshold) and load that",
    "matryoshka_batchtopk": "is a training checkpoint; save it for inference with sae-lens "
                            "(save_inference_model writes it as 'jumprelu' with its threshold) "
                            "and load that",
    "matching_pursuit": "encodes by matching pursuit over its decoder (up to d_in dependent "
                        "steps per row, each choosing one feature): not served yet",
    "temporal": "encodes each row with attention over the earlier rows of its sequence (context "
                "a per-step encoder does not have): not served",
    **{name: _TRANSCODER for name in ("transcoder", "skip_transcoder", "jumprelu_transcoder",
                                      "jumprelu_skip_transcoder")},
}


class SAEFormatError(ValueError):
    """A directory that does not hold an SAE vllm-lens can read, or one whose files
    disagree; the message names the file and field.

    Raised by `load_sae`, `read_sae` and `detect_layout` (a
    ``ValueError``, so ``except ValueError`` catches it too).

    Examples:
        >>> from vllm_lens.saes import SAEFormatError, load_sae
        >>> try:
        ...     load_sae(tmp)                      # an empty directory
        ... except SAEFormatError as exc:
        ...     print("holds no SAE layout" in str(exc), isinstance(exc, ValueError))
        True True
    """


def detect_layout(path: str | os.PathLike) -> str:
    """Which of ``LAYOUTS`` the directory ``path`` holds.

    Only the files' names are looked at (the first layout whose files are all there, in
    ``LAYOUTS`` order), not their contents.

    Args:
        path: the directory (a ``str`` or a path).

    Returns:
        ``"sae-lens"``, ``"sparsify"`` or ``"gemma-scope"``.

    Raises:
        SAEFormatError: ``path`` is not a directory, or holds none of the layouts (the
            message lists each layout's files).

    Examples:
        >>> from vllm_lens.saes import detect_layout
        >>> for name in ("cfg.json", "sae.safetensors"):
        ...     (tmp / name).touch()
        >>> detect_layout(tmp)
        'sparsify'
    """
    path = Path(path)
    if not path.is_dir():
        raise SAEFormatError(f"{path} is not a directory holding an SAE")
    for layout, files in LAYOUTS.items():
        if all((path / name).is_file() for name in files):
            return layout
    listing = "; ".join(f"{layout}: {' + '.join(files)}" for layout, files in LAYOUTS.items())
    raise SAEFormatError(f"{path} holds no SAE layout vllm-lens reads ({listing})")


def read_sae(path: str | Path) -> SAE:
    """The SAE in directory ``path`` (any of ``LAYOUTS``), on the CPU, in its own dtype.

    Unlike `load_sae` it does not resolve where the SAE reads: ``point`` and ``layer``
    stay ``None``, and ``hook_name`` is what the files say (``None`` for sparsify and Gemma
    Scope).

    Args:
        path: the directory (``str`` or ``pathlib.Path``).

    Returns:
        The `SAE`, with ``layout`` set.

    Raises:
        SAEFormatError: no layout found, a file that is damaged (not JSON, an unreadable
            safetensors or npz file: the message names it and the error), lacks a tensor or
            disagrees with the others, or an architecture or flag that is not served
            (``normalize_activations`` other than ``none``, a transcoder, ``batchtopk``
            training checkpoints ...).
    """
    path = Path(path)
    layout = detect_layout(path)
    try:
        return _READERS[layout](path)
    except SAEFormatError:
        raise
    except Exception as exc:  # a damaged file (safetensors, zip ...) fails its request alone
        raise SAEFormatError(f"{path} ({layout}): {type(exc).__name__}: {exc}") from None


def _json(path: Path) -> Mapping[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SAEFormatError(f"{path} is not JSON: {exc}") from None
    if not isinstance(cfg, Mapping):
        raise SAEFormatError(f"{path} is not a JSON object")
    return cfg


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def _need(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...], where: Path
          ) -> list[torch.Tensor]:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise SAEFormatError(f"{where} lacks {', '.join(missing)} (it has "
                             f"{', '.join(sorted(tensors)) or 'nothing'})")
    return [tensors[n] for n in names]


def _pre_6_0(cfg: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """A cfg written before sae-lens 6.0 (no ``metadata``) read as sae-lens 6 reads it: its
    ``hook_point``, and ``activation_fn_str`` ``topk`` with ``activation_fn_kwargs.k`` a TopK
    SAE; any activation other than ``relu`` and ``topk`` is refused by name."""
    new = dict(cfg)
    if "hook_point" in new:
        new.setdefault("hook_name", new.pop("hook_point"))
    if "hook_point_head_index" in new:
        new.setdefault("hook_head_index", new.pop("hook_point_head_index"))
    activation = new.pop("activation_fn_str", new.pop("activation_fn", "relu")) or "relu"
    if activation not in ("relu", "topk"):
        raise SAEFormatError(f"{where}: activation_fn={activation!r} is not supported (relu, "
                             "topk)")
    k = (new.get("activation_fn_kwargs") or {}).get("k")
    if activation == "topk":
        if k is None:
            raise SAEFormatError(f"{where}: activation_fn 'topk' without activation_fn_kwargs.k")
        new["architecture"], new["k"] = "topk", k
    if isinstance(new.get("normalize_activations"), bool):
        new["normalize_activations"] = ("expected_average_only_in"
                                        if new["normalize_activations"] else "none")
    return new


def _read_sae_lens(path: Path) -> SAE:
    where = path / "cfg.json"
    cfg = _json(where)
    if "metadata" not in cfg:  # written before sae-lens 6.0
        cfg = _pre_6_0(cfg, where)
    architecture = cfg.get("architecture", "standard")
    if architecture in REFUSED:
        raise SAEFormatError(f"{where}: architecture {architecture!r} {REFUSED[architecture]}")
    if architecture not in ARCHITECTURES:
        raise SAEFormatError(f"{where}: architecture {architecture!r} is not one vllm-lens "
                             f"serves ({', '.join(ARCHITECTURES)})")
    norm = cfg.get("normalize_activations") or "none"
    if norm != "none":
        raise SAEFormatError(f"{where}: normalize_activations={norm!r} is not supported (only "
                             "'none'); fold the normalization into the weights first")
    reshape = cfg.get("reshape_activations") or "none"
    if reshape not in ("none", "hook_z"):
        raise SAEFormatError(f"{where}: reshape_activations={reshape!r} is not supported")
    metadata = cfg.get("metadata") or {}
    for flag in ("hook_head_index",):
        value = cfg.get(flag, metadata.get(flag))
        if value is not None:
            raise SAEFormatError(f"{where}: {flag}={value!r} (one head's SAE) is not supported")
    if cfg.get("finetuning_scaling_factor"):
        raise SAEFormatError(f"{where}: finetuning_scaling_factor=true is not supported; fold "
                             "the scaling factor into W_dec first")
    if (cfg.get("activation_fn_kwargs") or {}).get("signed"):
        raise SAEFormatError(f"{where}: signed activations are not supported")
    tensors = _safetensors(path / "sae_weights.safetensors")
    gated = architecture == "gated"
    W_enc, b_enc, W_dec, b_dec = _need(tensors, ("W_enc", "b_mag" if gated else "b_enc",
                                                 "W_dec", "b_dec"),
                                       path / "sae_weights.safetensors")
    threshold = b_gate = r_mag = None
    if architecture == "jumprelu":
        (threshold,) = _need(tensors, ("threshold",), path / "sae_weights.safetensors")
    if gated:
        b_gate, r_mag = _need(tensors, ("b_gate", "r_mag"), path / "sae_weights.safetensors")
    scaling = tensors.get("scaling_factor")
    if scaling is not None and not bool((scaling == 1).all()):
        raise SAEFormatError(f"{path / 'sae_weights.safetensors'}: a scaling_factor other than "
                             "1 is not supported; fold it into W_dec first")
    sae = SAE(architecture=architecture, W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec,
              layout="sae-lens", threshold=threshold, b_gate=b_gate, r_mag=r_mag,
              k=cfg.get("k") if architecture in ("topk", "abstopk") else None,
              apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
              rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm",
                                                        False)),
              hook_name=metadata.get("hook_name") or cfg.get("hook_name"))
    for field in ("d_in", "d_sae"):
        if field in cfg and cfg[field] != getattr(sae, field):
            raise SAEFormatError(f"{where}: {field}={cfg[field]} but the weights have "
                                 f"{getattr(sae, field)}")
    return sae


def _read_sparsify(path: Path) -> SAE:
    cfg = _json(path / "cfg.json")
    where = path / "cfg.json"
    for flag in ("transcode", "skip_connection"):
        if cfg.get(flag):
            raise SAEFormatError(f"{where}: {flag}=true (a transcoder or skip connection) is "
                                 "not an SAE vllm-lens serves")
    activation = cfg.get("activation", "topk")
    if activation != "topk":
        raise SAEFormatError(f"{where}: activation={activation!r} is not supported (topk)")
    if cfg.get("multi_topk"):
        raise SAEFormatError(f"{where}: multi_topk=true is not supported")
    weights = path / "sae.safetensors"
    tensors = _safetensors(weights)
    encoder, W_dec = _need(tensors, ("encoder.weight", "W_dec"), weights)
    b_enc = tensors.get("encoder.bias", torch.zeros(encoder.shape[0], dtype=encoder.dtype))
    b_dec = tensors.get("b_dec", torch.zeros(encoder.shape[1], dtype=encoder.dtype))
    sae = SAE(architecture="topk", W_enc=encoder.T.contiguous(), b_enc=b_enc, W_dec=W_dec,
              b_dec=b_dec, layout="sparsify", k=cfg.get("k"), apply_b_dec_to_input=True)
    if "d_in" in cfg and cfg["d_in"] != sae.d_in:
        raise SAEFormatError(f"{where}: d_in={cfg['d_in']} but the weights have {sae.d_in}")
    return sae


def _read_gemma_scope(path: Path) -> SAE:
    import numpy as np

    where = path / "params.npz"
    with np.load(where) as data:
        tensors = {name: torch.from_numpy(np.array(data[name])) for name in data.files}
    W_enc, W_dec, b_enc, b_dec, threshold = _need(
        tensors, ("W_enc", "W_dec", "b_enc", "b_dec", "threshold"), where)
    return SAE(architecture="jumprelu", W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec,
               layout="gemma-scope", threshold=threshold, apply_b_dec_to_input=False)


_READERS = {"sae-lens": _read_sae_lens, "sparsify": _read_sparsify,
            "gemma-scope": _read_gemma_scope}
