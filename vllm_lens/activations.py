"""Activations in HTTP responses: the JSON and binary forms, and ``decode_activations`` (runs in:
caller, front end).

The API server encodes; clients decode, without vLLM.

A choice of an OpenAI-style response carries ``"activations"`` in one of two forms:

- **json** (default): every tensor is a self-describing record (see ``wire.tensor_to_json``)::

      {"residual_stream": {"dtype": "float32", "shape": [2, 9, 576], "compression": "zstd",
                           "data": "<base64 of the zstd frame of the raw bytes>"},
       "positions": {...}}

- **binary**: a handle to bytes the server keeps for a while::

      {"transport": "binary", "handle": "…", "nbytes": 123,
       "shapes": {"residual_stream": [2, 9, 576], "positions": [9]}, "dtype": "float32"}

  ``POST /v1/lens/activations/fetch`` with ``{"handle": …}`` (the handle stays out of URLs,
  hence out of access logs) returns ``application/octet-stream``: msgpack of the same dict, tensors as the
  same records with raw (not base64) ``data`` (``wire.dumps``), read by
  ``decode_activation_bytes``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vllm_lens.common import wire
from vllm_lens.errors import WireError

__all__ = [
    "activations_to_json",
    "activations_to_lists",
    "decode_json_tensors",
    "decode_sae_features",
    "hook_results_to_json",
    "binary_descriptor",
    "decode_activation_bytes",
    "decode_activations",
    "is_binary_descriptor",
]

ACTIVATIONS_PATH = "/v1/lens/activations"


def activations_to_json(acts: Mapping[str, Any]) -> dict[str, Any]:
    """The json form of one choice's activations.

    What the API server puts in a choice's ``"activations"`` with the default json
    transport; ``decode_activations`` reverses it.

    Args:
        acts: one output's activations (``out.activations``): names to tensors, and other
            values (lists, ``qk_meta`` dicts ...) that JSON carries as they are.

    Returns:
        A new dict with the same keys: each tensor becomes a record ``{"dtype", "shape",
        "compression": "zstd", "data"}`` (``data``: base64 of the zstd frame of the raw
        bytes), other values are kept.

    Examples:
        >>> import torch
        >>> from vllm_lens.activations import activations_to_json
        >>> record = activations_to_json({"residual_stream": torch.zeros(2, 3, 128)})
        >>> sorted(record["residual_stream"]), record["residual_stream"]["shape"]
        (['compression', 'data', 'dtype', 'shape'], [2, 3, 128])
    """
    return {k: wire.tensor_to_json(v) if isinstance(v, torch.Tensor) else v
            for k, v in acts.items()}


def activations_to_lists(acts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``lists`` transport's form of one choice's activations: each tensor as
    ``{"dtype", "shape", "values"}`` (``wire.tensor_to_lists``: flat values, readable without
    zstandard, e.g. by a browser), other values kept; ``decode_activations`` reverses it.

    Args:
        acts: one output's activations (``out.activations``): names to tensors, and other
            values that JSON carries as they are.

    Returns:
        A new dict with the same keys, each tensor as its ``lists`` record.

    Examples:
        >>> import torch
        >>> from vllm_lens.activations import activations_to_lists
        >>> activations_to_lists({"positions": torch.arange(3)})["positions"]["values"]
        [0, 1, 2]
    """
    return {k: wire.tensor_to_lists(v) if isinstance(v, torch.Tensor) else v
            for k, v in acts.items()}


def hook_results_to_json(value: Any, tensor: Callable[[torch.Tensor], dict[str, Any]]
                         = wire.tensor_to_json) -> Any:
    """Hook results as JSON: tensors as records, containers recursively; anything else that
    JSON cannot carry becomes its ``repr`` (the server never sends pickles).

    Args:
        value: an output's ``hook_results`` (``{"0": saved, ...}``), or any part of it.
        tensor: how a tensor becomes JSON (default ``tensor_to_json``; the ``lists``
            transport's ``wire.tensor_to_lists``).

    Returns:
        The JSON form: a tensor becomes a tensor record (as in
        ``activations_to_json``), a ``HookError`` ``{"error": message, "traceback":
        traceback}``, a dict a dict with ``str`` keys, a list or tuple a list; ``None``,
        ``str``, ``int``, ``float`` and ``bool`` are kept; anything else becomes its
        ``repr``.

    Examples:
        >>> import torch
        >>> from vllm_lens.activations import hook_results_to_json
        >>> out = hook_results_to_json({"0": {"rows": [torch.ones(2, 128)], "n": 3}})
        >>> out["0"]["rows"][0]["shape"], out["0"]["n"]
        ([2, 128], 3)
    """
    from vllm_lens.hooks import HookError

    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, HookError):
        return {"error": value.message, "traceback": value.traceback}
    if isinstance(value, dict):
        return {str(k): hook_results_to_json(v, tensor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [hook_results_to_json(v, tensor) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def decode_sae_features(value: Any) -> Any:
    """A choice's ``sae_features`` as JSON carries it, decoded as offline: tensors, and each
    entry's ``labels`` keyed by feature index (JSON gives the keys as strings).

    Args:
        value: a choice's ``sae_features`` (a list of entries) or ``None``.

    Returns:
        The entries decoded (``decode_json_tensors``), or ``None``.

    Raises:
        WireError: a tensor record is malformed.

    Examples:
        >>> from vllm_lens.activations import decode_sae_features
        >>> decode_sae_features([{"sae": "l10", "labels": {"7": "the sea"}}])[0]["labels"]
        {7: 'the sea'}
    """
    entries = decode_json_tensors(value)
    for entry in entries or ():
        if isinstance(entry, dict) and isinstance(entry.get("labels"), dict):
            entry["labels"] = {int(k): v for k, v in entry["labels"].items()}
    return entries


def decode_json_tensors(value: Any) -> Any:
    """Inverse of ``hook_results_to_json`` for what it can invert: tensor records back to
    tensors, containers recursively.

    Args:
        value: JSON as a response carries it (a choice's ``hook_results`` or
            ``sae_features``, or any part of them).

    Returns:
        The same structure with every tensor record (a dict with ``dtype`` and ``data``)
        decoded to a CPU ``torch.Tensor``; dicts and lists are rebuilt, everything else is
        kept (``repr`` strings stay strings).

    Raises:
        WireError: a tensor record is malformed (bad base64, shape, dtype or frame).

    Examples:
        >>> import torch
        >>> from vllm_lens.activations import decode_json_tensors, hook_results_to_json
        >>> sent = hook_results_to_json({"0": {"scores": torch.ones(4)}})
        >>> decode_json_tensors(sent)["0"]["scores"].shape
        torch.Size([4])
    """
    if _is_tensor_record(value):
        return wire.tensor_from_json(value)
    if isinstance(value, dict):
        return {k: decode_json_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json_tensors(v) for v in value]
    return value


def binary_descriptor(acts: Mapping[str, Any], handle: str, nbytes: int) -> dict[str, Any]:
    """The binary form of one choice's activations, once its bytes are stored under ``handle``.

    Args:
        acts: one output's activations (names to tensors and other values).
        handle: the handle the server stored the encoded activations under.
        nbytes: the size of those stored bytes.

    Returns:
        ``{"transport": "binary", "handle": handle, "nbytes": nbytes, "shapes": {name:
        shape list} (for each tensor), "dtype": str | None}``; ``dtype`` is that of
        ``residual_stream``, else of the first tensor whose name does not end in
        ``positions`` (``None`` when there is none), without the ``torch.`` prefix.

    Examples:
        >>> import torch
        >>> from vllm_lens.activations import binary_descriptor, is_binary_descriptor
        >>> acts = {"residual_stream": torch.zeros(2, 3, 128), "positions": torch.arange(3)}
        >>> desc = binary_descriptor(acts, "a" * 43, nbytes=3072)
        >>> desc["shapes"], desc["dtype"], is_binary_descriptor(desc)
        ({'residual_stream': [2, 3, 128], 'positions': [3]}, 'float32', True)
    """
    tensors = {k: v for k, v in acts.items() if isinstance(v, torch.Tensor)}
    stream = tensors.get("residual_stream")
    if stream is None:  # a capture at tap points only: the first signal's dtype
        stream = next((v for k, v in tensors.items() if not k.endswith("positions")), None)
    return {
        "transport": "binary",
        "handle": handle,
        "nbytes": nbytes,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "dtype": None if stream is None else str(stream.dtype).removeprefix("torch."),
    }


#: A handle is ``secrets.token_urlsafe(32)``: 43 URL-safe characters.
_HANDLE = re.compile(r"[A-Za-z0-9_-]{16,128}")
#: ``POST`` here with ``{"handle": ..., "delete": true}`` returns a handle's bytes (and frees
#: them): the handle stays out of URLs, hence out of access logs.
FETCH_PATH = ACTIVATIONS_PATH + "/fetch"


def valid_handle(value: Any) -> str:
    """``value`` if it is a well-formed handle; ``ValueError`` otherwise (a client never puts
    anything else into a request it sends)."""
    if not isinstance(value, str) or _HANDLE.fullmatch(value) is None:
        raise ValueError(f"not a vllm-lens activations handle: {str(value)[:80]!r}")
    return value


def is_binary_descriptor(value: Any) -> bool:
    """Whether a choice's ``activations`` is the binary transport's handle (``{"transport":
    "binary", "handle", ...}``: fetch it with ``LensClient.fetch_activations``) rather than
    the tensors themselves.

    Args:
        value: anything; typically a choice's ``"activations"``.

    Returns:
        ``True`` if ``value`` is a mapping whose ``"transport"`` is ``"binary"``, else
        ``False`` (never raises).

    Examples:
        >>> from vllm_lens.activations import is_binary_descriptor
        >>> is_binary_descriptor({"transport": "binary", "handle": "a" * 43})
        True
        >>> is_binary_descriptor({"dtype": "float32", "data": ""}), is_binary_descriptor(None)
        (False, False)
    """
    return isinstance(value, Mapping) and value.get("transport") == "binary"


def decode_activation_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Decode the body that ``POST /v1/lens/activations/fetch`` returns for a handle.

    Args:
        blob: the response body (``application/octet-stream``): msgpack of the
            activations dict, tensors as records with raw ``data`` (``wire.dumps``).

    Returns:
        The activations dict, as the json form decodes to: names to CPU tensors, other
        values as sent.

    Raises:
        WireError: ``blob`` is not bytes, is empty or corrupt, or does not hold a map.

    Examples:
        >>> import torch
        >>> from vllm_lens.common import wire
        >>> from vllm_lens.activations import decode_activation_bytes
        >>> body = wire.dumps({"residual_stream": torch.zeros(2, 3, 128)})
        >>> decode_activation_bytes(body)["residual_stream"].shape
        torch.Size([2, 3, 128])
    """
    decoded = wire.loads(blob)
    if not isinstance(decoded, dict):
        raise WireError("activation bytes do not hold a map")
    return decoded


def decode_activations(
    x: Mapping[str, Any],
) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor] | None] | None:
    """Decode activations from a response JSON, one choice, or an activations dict.

    - a whole response (has ``"choices"``): one choice -> its dict; several -> a list with one
      entry per choice, in choice order (``None`` for a choice without activations);
    - a choice (has ``"activations"``) or a streamed chunk's choice: its dict (or ``None``);
    - an activations dict: the same dict with every tensor record decoded.

    Objects of the ``openai`` SDK (a ``Completion``, ``ChatCompletion`` or one of their
    choices) are taken as they are (through their ``model_dump()``).

    Binary-transport activations hold a handle, not tensors: fetch their bytes
    (``LensClient`` does) and use ``decode_activation_bytes``.

    Args:
        x: a response, a choice or an activations dict (plain JSON as parsed, or an
            ``openai`` SDK object).

    Returns:
        A dict of names to CPU tensors (other values, such as ``qk_meta``, as sent); for a
        whole response with several choices a list of them (``None`` entries for choices
        without activations); ``None`` for a choice without activations.

    Raises:
        TypeError: ``x`` is neither a mapping nor an object with ``model_dump()``.
        WireError: ``x`` (or a choice's activations) is a binary descriptor, or a tensor
            record is malformed.

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import decode_activations
        >>> from vllm_lens.activations import activations_to_json
        >>> sp = SamplingParams(max_tokens=2, extra_args={"output_residual_stream": [1, 3]})
        >>> out = llm.generate(["Hello world"], sp)[0]
        >>> choice = {"index": 0, "activations": activations_to_json(out.activations)}
        >>> decode_activations({"choices": [choice]})["residual_stream"].shape
        torch.Size([2, ..., 128])
    """
    if not isinstance(x, Mapping) and callable(getattr(x, "model_dump", None)):
        x = x.model_dump()
    if not isinstance(x, Mapping):
        raise TypeError(f"expected a response, choice or activations dict (or an openai SDK "
                        f"response object), got {type(x).__name__}")
    if "choices" in x:
        choices = sorted(x["choices"], key=lambda c: c.get("index", 0))
        decoded = [decode_activations(c) for c in choices]
        return decoded[0] if len(decoded) == 1 else decoded
    if "index" in x or "text" in x or "message" in x or "delta" in x:
        acts = x.get("activations")
        return None if acts is None else decode_activations(acts)
    if is_binary_descriptor(x):
        raise WireError(
            f"these activations were sent by handle ({x.get('handle')!r}); fetch the bytes "
            "(POST /v1/lens/activations/fetch with the handle) and call "
            "decode_activation_bytes, or use LensClient, which does both"
        )
    return {k: wire.tensor_from_json(v) if _is_tensor_record(v) else v for k, v in x.items()}


def _is_tensor_record(value: Any) -> bool:
    return isinstance(value, Mapping) and (("dtype" in value and "data" in value)
                                           or wire.is_lists_record(value))
