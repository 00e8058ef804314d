"""Errors raised by vllm-lens (runs in: every process).

Split by who is to blame, like vLLM's own ``vllm/exceptions.py``::

    LensError                      base of everything vllm-lens raises
    ├── LensRequestError(ValueError)   the caller sent a bad lens request (HTTP 400)
    │   ├── UnsupportedModelError      the model's layers could not be mapped
    │   └── RemoteCodeRefusedError     a pickled hook without the operator's opt-in (HTTP 403)
    └── WireError(ValueError)          bytes that do not decode as a vllm-lens payload

``LensRequestError`` subclasses ``ValueError`` so that offline callers get the ``ValueError``
they expect and vLLM's OpenAI server turns it into a 400 response.
"""

from __future__ import annotations

__all__ = [
    "LensError", "LensRequestError", "RemoteCodeRefusedError", "UnsupportedModelError",
    "WireError",
]


class LensError(Exception):
    """Base class of every error raised by vllm-lens."""


class LensRequestError(LensError, ValueError):
    """A lens request is malformed; the message names the offending field.

    Attributes:
        field: dotted path of the offending key, e.g. ``"output_residual_stream.layers[2]"``.
        request_id: the request's id when known, else ``None``.
    """

    def __init__(self, field: str, problem: str, *, request_id: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.request_id = request_id
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"vllm-lens: invalid '{field}'{where}: {problem}")


class UnsupportedModelError(LensRequestError):
    """Lens features were asked for on a model whose decoder layers vllm-lens cannot find."""


class RemoteCodeRefusedError(LensRequestError):
    """A request carried pickled code (a ``Hook``) and the operator has not allowed that."""


class WireError(LensError, ValueError):
    """Bytes that are not a valid vllm-lens payload (corrupt, truncated or foreign)."""
