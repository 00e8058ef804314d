"""One choice's lens results as the JSON fields it gets in an HTTP response (runs in: front
end).

Used for whole responses (``endpoints``) and for the extra chunk of a stream
(``streaming``). The request's ``activations_transport`` picks the ``Transport``: ``json``
(tensors as base64 zstd records), ``binary`` (the activations stored in the blob store, the
choice naming their handle) or ``lists`` (every tensor as its values, for a reader without
zstandard such as the lens page).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_lens.activations import (
    activations_to_json,
    activations_to_lists,
    binary_descriptor,
    hook_results_to_json,
)
from vllm_lens import envs
from vllm_lens.common import wire
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.merge import join_streamed
from vllm_lens.frontend.http.blob_store import store
from vllm_lens.frontend.response_scope import ResponseScope
from vllm_lens.spec.keys import TRANSPORT_KEY

__all__ = ["TRANSPORTS", "Transport", "check_size", "encode_binary", "encode_results",
           "monitors_to_json", "tensors_in", "transport", "with_partials"]


@dataclass(frozen=True)
class Transport:
    """How one request's results become JSON."""

    activations: Callable[[Any], dict[str, Any]]
    """Activations -> the JSON value of a choice's ``activations`` field."""
    tensor: Callable[[torch.Tensor], dict[str, Any]]
    """A tensor among the other results (hook results, SAE features, attributions)."""

    def results(self, value: Any) -> Any:
        """Hook results, SAE features or attributions with their tensors as JSON."""
        return hook_results_to_json(value, self.tensor)


def encode_binary(acts: Mapping[str, Any]) -> dict[str, Any]:
    """Activations stored in the blob store; the descriptor naming their handle."""
    blob = wire.dumps(dict(acts))
    return binary_descriptor(acts, store().put(blob), len(blob))


#: By ``activations_transport``; the other results are JSON in ``json`` and ``binary`` alike.
TRANSPORTS = {"json": Transport(activations_to_json, wire.tensor_to_json),
              "binary": Transport(encode_binary, wire.tensor_to_json),
              "lists": Transport(activations_to_lists, wire.tensor_to_lists)}


def transport(name: str | None) -> Transport:
    """The transport a request's ``activations_transport`` names (unset: ``json``)."""
    return TRANSPORTS[name or "json"]


def encode_results(results: Mapping[str, Any], encode: Transport) -> dict[str, Any]:
    """One choice's lens results as the JSON fields it gets.

    Raises:
        LensRequestError: the ``lists`` transport's values would exceed
            ``VLLM_LENS_MAX_LIST_VALUES`` (each value is a Python object and JSON text on the
            way); the client is told to use ``json`` or ``binary``.
    """
    check_size(results, encode)
    fields = {}
    if results.get("activations") is not None:
        fields["activations"] = encode.activations(results["activations"])
    if results.get("hook_results") is not None:
        fields["hook_results"] = encode.results(results["hook_results"])
    if results.get("capture_receipt") is not None:
        fields["capture_receipt"] = results["capture_receipt"]
    if results.get("steering_gates") is not None:
        fields["steering_gates"] = encode.results(results["steering_gates"])
    if results.get("sae_features") is not None:  # sparse: JSON in every transport
        fields["sae_features"] = encode.results(results["sae_features"])
    if results.get("monitors") is not None:
        fields["monitors"] = monitors_to_json(results["monitors"])
    if results.get("logit_attribution") is not None:  # [layers, positions]: JSON in each
        fields["logit_attribution"] = encode.results(results["logit_attribution"])
    return fields


def check_size(results: Any, encode: Transport) -> None:
    """Refuse results the ``lists`` transport would send as more than
    ``VLLM_LENS_MAX_LIST_VALUES`` numbers (``LensRequestError`` naming
    ``activations_transport``); the other transports take any size admission allowed."""
    if encode is not TRANSPORTS["lists"]:
        return
    count, most = _values(results), envs.max_list_values()
    if count > most:
        raise LensRequestError(
            TRANSPORT_KEY, f"'lists' would send {count:,} values, above this server's {most:,} "
            "(VLLM_LENS_MAX_LIST_VALUES); use 'json' or 'binary' for answers this large")


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or dicts, lists and tuples holding them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def _values(value: Any) -> int:
    """How many numbers the tensors in ``value`` hold."""
    return sum(t.numel() for t in tensors_in(value))


def monitors_to_json(records: Any) -> list[dict[str, Any]]:
    """The monitor records as plain JSON: positions and scores as lists (a score that is not
    finite as ``null``)."""
    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return [{**{k: v for k, v in r.items() if k not in ("positions", "scores", "score")},
             "score": None if r["score"] is None else finite(r["score"]),
             "positions": [int(p) for p in r["positions"].tolist()],
             "scores": [finite(float(x)) for x in r["scores"].tolist()]} for r in records]


def with_partials(scope: ResponseScope, response_id: str, n: int) -> dict[int, Any]:
    """Each choice's final results, with the streamed rows not sent yet (if any) in front of
    the final output's rows."""
    found = scope.by_choice(response_id, n)
    for index, results in found.items():
        early = scope.take_partial(response_id, index)
        if early:
            found[index] = join_streamed([*early, results])
    return found
