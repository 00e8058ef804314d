"""Reading sparse autoencoders from the layouts the field ships them in, without importing the
libraries that wrote them (runs in: any).

``LAYOUTS``, recognised by the files in the directory:

- ``sae-lens``: ``cfg.json`` + ``sae_weights.safetensors`` (sae-lens' ``SAE.save_model``):
  architectures ``standard``, ``jumprelu``, ``topk``, ``abstopk`` and ``gated`` (a BatchTopK
  or Matryoshka BatchTopK SAE saved for inference is a ``jumprelu`` file; their training
  checkpoints, matching-pursuit and temporal SAEs are refused naming why: ``REFUSED``), and
  the four transcoders (``transcoder``, ``skip_transcoder``, ``jumprelu_transcoder``,
  ``jumprelu_skip_transcoder``: ``W_dec`` ``[d_sae, d_out]``, ``W_skip`` ``[d_out, d_in]``);
  the hook point is the cfg's ``metadata.hook_name`` (or ``hook_name``), a transcoder's
  output ``hook_name_out`` (either may be given in the Hugging Face form, ``hf_hook_name`` /
  ``hf_hook_name_out``: ``hf_hook_name``).
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
- ``gemma-scope-2``: ``config.json`` + ``params.safetensors`` (lower-case ``w_enc`` ...,
  ``affine_skip_connection``), JumpReLU SAEs and transcoders; the points are the config's
  ``hf_hook_point_in`` / ``hf_hook_point_out``. Cross-layer transcoders are refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vllm_lens.saes.model import ARCHITECTURES, SAE, TRANSCODERS

__all__ = ["LAYOUTS", "REFUSED", "SAEFormatError", "detect_layout", "hf_hook_name", "read_sae"]

logger = logging.getLogger(__name__)

LAYOUTS = {
    "sae-lens": ("cfg.json", "sae_weights.safetensors"),
    "sparsify": ("cfg.json", "sae.safetensors"),
    "gemma-scope": ("params.npz",),
    "gemma-scope-2": ("config.json", "params.safetensors"),
}
#: Where Hugging Face module names read (Gemma Scope 2's ``hf_hook_point_in`` / ``_out``, a
#: sae-lens cfg's ``hf_hook_name`` / ``_out``), as tap points: the layer's ``output`` is
#: ``resid_post``; the MLP's input (Gemma's pre-MLP norm's output) ``mlp_in``; Gemma's post-MLP
#: norm's output, what the layer adds, ``mlp_out``; ``o_proj``'s input ``attn_z``. Names whose
#: point differs between families are not read (``post_attention_layernorm`` is the pre-MLP
#: norm in Llama but follows attention in Gemma; ``mlp.output`` is ``mlp_out`` only without a
#: post-MLP norm).
_HF_POINTS = {"output": "resid_post", "pre_feedforward_layernorm.output": "mlp_in",
              "mlp.input": "mlp_in", "post_feedforward_layernorm.output": "mlp_out",
              "self_attn.o_proj.input": "attn_z"}
_HF_NAME = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(.+)$")


def hf_hook_name(name: str) -> str | None:
    """A Hugging Face module name a transcoder or SAE names (``hf_hook_point_in``) as a
    TransformerLens-style hook name, or ``None`` if it is not a point here.

    >>> hf_hook_name("model.layers.7.pre_feedforward_layernorm.output")
    'blocks.7.hook_mlp_in'
    >>> hf_hook_name("model.layers.7.post_feedforward_layernorm.output")
    'blocks.7.hook_mlp_out'
    """
    m = _HF_NAME.match(name.strip()) if isinstance(name, str) else None
    if m is None or m.group(2) not in _HF_POINTS:
        return None
    return f"blocks.{m.group(1)}.hook_{_HF_POINTS[m.group(2)]}"

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
            (``normalize_activations`` other than ``none``, a sparsify transcoder,
            ``batchtopk`` training checkpoints ...).
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
    if "architecture" not in cfg:
        _defaulted_architecture(where, tensors, path / "sae_weights.safetensors")
    if architecture in TRANSCODERS:
        return _sae_lens_transcoder(cfg, metadata, tensors, architecture, path)
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


#: Tensors that only another architecture than ``standard`` has, and that architecture.
_IMPLIED = {"threshold": "jumprelu", "b_gate": "gated", "r_mag": "gated",
            "W_skip": "skip_transcoder", "b_mag": "gated"}


def _defaulted_architecture(where: Path, tensors: Mapping[str, torch.Tensor],
                            weights: Path) -> None:
    """A cfg without ``architecture`` is read as sae-lens reads it, ``standard``: refused
    where its weights hold another architecture's tensors (a JumpReLU threshold would be
    ignored), else said in the log (it registered under a default, not by its own word)."""
    implied = next((name for name in _IMPLIED if name in tensors), None)
    if implied is not None:
        raise SAEFormatError(
            f"{where} names no architecture (sae-lens' default: 'standard'), but {weights} "
            f"holds {implied!r}, which a {_IMPLIED[implied]!r} SAE has; add \"architecture\": "
            f"\"{_IMPLIED[implied]}\" (or the architecture it was trained as) to the cfg")
    logger.warning("vllm-lens: %s names no architecture: read as sae-lens' default, "
                   "'standard' (relu(x' @ W_enc + b_enc)); add \"architecture\" to say so",
                   where)


def _points_named(cfg: Mapping[str, Any], metadata: Mapping[str, Any], where: Path
                  ) -> tuple[str | None, str | None]:
    """A transcoder's input and output hook names: sae-lens' ``hook_name`` /
    ``hook_name_out`` (in ``metadata`` or at the top), else the Hugging Face form
    (``hf_hook_name`` / ``hf_hook_name_out``, Gemma Scope 2's ``hf_hook_point_in`` /
    ``hf_hook_point_out``) read as tap points (``hf_hook_name``)."""
    names = []
    for tl, hf in (("hook_name", ("hf_hook_name", "hf_hook_point_in")),
                   ("hook_name_out", ("hf_hook_name_out", "hf_hook_point_out"))):
        # The Hugging Face module name, where given, says exactly which tensor it is
        # (TransformerLens' own ``hook_mlp_in`` is the stream before the norm; sae-lens'
        # transcoders use the name for the norm's output, as vllm-lens does).
        raw = next((src.get(k) for k in hf for src in (metadata, cfg) if src.get(k)), None)
        name = None if raw is None else hf_hook_name(raw)
        given = metadata.get(tl) or cfg.get(tl)
        if raw is not None and name is None and not given:
            raise SAEFormatError(
                f"{where}: {raw!r} is not a module output vllm-lens reads as a tap point "
                f"(model.layers.<L>. + {', '.join(_HF_POINTS)}); name the point as "
                f"{tl}='blocks.<L>.hook_<point>' instead")
        names.append(name or given)
    return names[0], names[1]


def _sae_lens_transcoder(cfg: Mapping[str, Any], metadata: Mapping[str, Any],
                         tensors: Mapping[str, torch.Tensor], architecture: str, path: Path
                         ) -> SAE:
    where, weights = path / "cfg.json", path / "sae_weights.safetensors"
    if cfg.get("apply_b_dec_to_input"):
        raise SAEFormatError(f"{where}: apply_b_dec_to_input=true: a transcoder's b_dec is its "
                             "output's, and sae-lens refuses the flag for transcoders")
    W_enc, b_enc, W_dec, b_dec = _need(tensors, ("W_enc", "b_enc", "W_dec", "b_dec"), weights)
    threshold = W_skip = None
    if architecture.startswith("jumprelu"):
        (threshold,) = _need(tensors, ("threshold",), weights)
    if "skip" in architecture:
        (W_skip,) = _need(tensors, ("W_skip",), weights)
    hook_in, hook_out = _points_named(cfg, metadata, where)
    try:
        sae = SAE(architecture=architecture, W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec,
                  layout="sae-lens", threshold=threshold, W_skip=W_skip,
                  apply_b_dec_to_input=False, hook_name=hook_in, hook_name_out=hook_out)
    except ValueError as exc:
        raise SAEFormatError(f"{weights}: {exc}") from None
    for field in ("d_in", "d_sae", "d_out"):
        if field in cfg and cfg[field] != getattr(sae, field):
            raise SAEFormatError(f"{where}: {field}={cfg[field]} but the weights have "
                                 f"{getattr(sae, field)}")
    return sae


def _read_gemma_scope_2(path: Path) -> SAE:
    """Gemma Scope 2: ``config.json`` (``architecture`` ``jump_relu``, ``hf_hook_point_in``,
    and for a transcoder ``hf_hook_point_out`` and ``affine_connection``) +
    ``params.safetensors`` (``w_enc``, ``w_dec``, ``b_enc``, ``b_dec``, ``threshold``, a skip
    transcoder's ``affine_skip_connection`` ``[d_in, d_out]``); nothing subtracted from the
    input."""
    where, weights = path / "config.json", path / "params.safetensors"
    cfg = _json(where)
    if cfg.get("architecture", "jump_relu") != "jump_relu":
        raise SAEFormatError(f"{where}: architecture {cfg.get('architecture')!r} is not "
                             "Gemma Scope 2's 'jump_relu'")
    tensors = _safetensors(weights)
    W_enc, W_dec, b_enc, b_dec, threshold = _need(
        tensors, ("w_enc", "w_dec", "b_enc", "b_dec", "threshold"), weights)
    if W_dec.dim() != 2:
        raise SAEFormatError(f"{weights}: w_dec has shape {tuple(W_dec.shape)}; a "
                             "cross-layer transcoder's decoders are not served")
    hook_in, hook_out = _points_named(cfg, {}, where)
    skip = tensors.get("affine_skip_connection")
    transcoder = hook_out is not None
    if skip is not None and not transcoder:
        raise SAEFormatError(f"{where}: affine_skip_connection without hf_hook_point_out")
    if "affine_connection" in cfg and bool(cfg["affine_connection"]) != (skip is not None):
        raise SAEFormatError(f"{where}: affine_connection={cfg['affine_connection']!r} but "
                             f"{weights.name} {'has' if skip is not None else 'lacks'} "
                             "affine_skip_connection")
    architecture = ("jumprelu_skip_transcoder" if skip is not None
                    else "jumprelu_transcoder" if transcoder else "jumprelu")
    try:
        return SAE(architecture=architecture, W_enc=W_enc, b_enc=b_enc, W_dec=W_dec,
                   b_dec=b_dec, layout="gemma-scope-2", threshold=threshold,
                   W_skip=None if skip is None else skip.T.contiguous(),
                   apply_b_dec_to_input=False, hook_name=hook_in, hook_name_out=hook_out)
    except ValueError as exc:
        raise SAEFormatError(f"{weights}: {exc}") from None


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
            "gemma-scope": _read_gemma_scope, "gemma-scope-2": _read_gemma_scope_2}
