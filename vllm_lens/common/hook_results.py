"""The bytes a request's hook results travel in from the workers to the front end (runs in:
front end, worker).

The workers encode (``worker.hooks``), the front end decodes (``frontend.collator``,
``frontend.persistent_hooks``): ``W`` + the tensor codec (``common.wire``) when the saved values
allow it, ``P`` + pickle for trusted hooks' other objects, which only a front end that trusts
them reads back.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from vllm_lens.common import wire

__all__ = ["decode", "encode", "to_cpu"]


def encode(results: dict[str, Any], error: Any, *, trusted: bool) -> bytes:
    """A request's hook results and error as bytes for the front end.

    ``wire`` (msgpack + tensors) when the saved values allow it; results of trusted (pickled,
    i.e. the operator's or an opted-in client's) hooks fall back to pickle for other objects.
    """
    body = {"results": results, "error": error}
    try:
        return b"W" + wire.dumps(body)
    except Exception as exc:  # values msgpack cannot carry: never let them fail the batch
        failure: Exception = exc
    if trusted:
        try:
            return b"P" + pickle.dumps(to_cpu(body))
        except Exception as exc:
            failure = exc
    return b"W" + wire.dumps({"results": {}, "error": {
        "message": f"{type(failure).__name__}: a hook saved a value that cannot be sent back "
                   f"({failure}); save tensors and plain data", "traceback": ""}})


def to_cpu(value: Any) -> Any:
    """``value`` with its tensors on the CPU and compact: pickle writes a view's whole storage
    (e.g. the spare capacity of ``named_hooks`` buffers)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu")
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        return tensor
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def decode(blob: bytes, allow_pickle: bool) -> dict[str, Any]:
    """Inverse of ``encode``; pickled results only where the caller trusts them."""
    if blob[:1] == b"P":
        if not allow_pickle:
            raise ValueError("refusing pickled hook results from a worker")
        return pickle.loads(blob[1:])  # noqa: S301 - produced by a trusted hook
    return wire.loads(blob[1:])
