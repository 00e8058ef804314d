"""Activations in HTTP responses: the JSON and binary forms, and ``decode_activations`` (runs in:
API server and clients; needs no vLLM).

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
  :func:`decode_activation_bytes`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from vllm_lens import wire
from vllm_lens.errors import WireError

__all__ = [
    "activations_to_json",
    "decode_json_tensors",
    "hook_results_to_json",
    "binary_descriptor",
    "decode_activation_bytes",
    "decode_activations",
    "is_binary_descriptor",
]

ACTIVATIONS_PATH = "/v1/lens/activations"


def activations_to_json(acts: Mapping[str, Any]) -> dict[str, Any]:
    """The json form of one choice's activations."""
    return {k: wire.tensor_to_json(v) if isinstance(v, torch.Tensor) else v
            for k, v in acts.items()}


def hook_results_to_json(value: Any) -> Any:
    """Hook results as JSON: tensors as records, containers recursively; anything else that
    JSON cannot carry becomes its ``repr`` (the server never sends pickles)."""
    from vllm_lens.hooks import HookError

    if isinstance(value, torch.Tensor):
        return wire.tensor_to_json(value)
    if isinstance(value, HookError):
        return {"error": value.message, "traceback": value.traceback}
    if isinstance(value, dict):
        return {str(k): hook_results_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [hook_results_to_json(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def decode_json_tensors(value: Any) -> Any:
    """Inverse of :func:`hook_results_to_json` for what it can invert: tensor records back to
    tensors, containers recursively."""
    if _is_tensor_record(value):
        return wire.tensor_from_json(value)
    if isinstance(value, dict):
        return {k: decode_json_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json_tensors(v) for v in value]
    return value


def binary_descriptor(acts: Mapping[str, Any], handle: str, nbytes: int) -> dict[str, Any]:
    """The binary form of one choice's activations, once its bytes are stored under ``handle``."""
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
    the tensors themselves."""
    return isinstance(value, Mapping) and value.get("transport") == "binary"


def decode_activation_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Decode the body of ``GET /v1/lens/activations/{handle}``."""
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
    (``LensClient`` does) and use :func:`decode_activation_bytes`.
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
    return isinstance(value, Mapping) and "dtype" in value and "data" in value
