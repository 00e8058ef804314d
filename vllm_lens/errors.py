"""Errors raised by vllm-lens (runs in: every process).

Split by who is to blame, like vLLM's own ``vllm/exceptions.py``::

    LensError                      base of everything vllm-lens raises
    ├── LensRequestError(ValueError)   the caller sent a bad lens request (HTTP 400)
    │   ├── UnsupportedModelError      the model's layers could not be mapped
    │   ├── UnsupportedConfigError     the engine runs a configuration vllm-lens refuses
    │   ├── RemoteCodeRefusedError     a pickled hook without the operator's opt-in (403)
    │   └── SinkRefusedError           a capture sink the operator has not opened to HTTP
    │                                  clients (HTTP 403)
    ├── LensExecutionError             the worker failed while handling this request (HTTP
    │   │                              500); the engine and every other request carry on
    │   ├── SinkConflictError          the sink refused the request's example: it conflicts
    │   │                              with what its dataset holds (HTTP 409)
    │   └── WorkerCapacityError        a worker's shared budget had no room for the request's
    │                                  captures or its sink example (HTTP 503)
    ├── CapacityError              a budget every client shares is full: this request's
    │                              results are refused, nobody else's dropped (HTTP 503)
    ├── DatasetConflictError(ValueError)  an example that conflicts with its dataset (its key
    │                                  is there already; the dataset has other settings)
    └── WireError(ValueError)          bytes that do not decode as a vllm-lens payload

``LensRequestError`` subclasses ``ValueError`` so that offline callers get the ``ValueError``
they expect and vLLM's OpenAI server turns it into a 400 response.
"""

from __future__ import annotations

__all__ = [
    "CapacityError", "DatasetConflictError", "LensError", "LensExecutionError", "LensRequestError",
    "RemoteCodeRefusedError", "SinkConflictError", "SinkRefusedError", "UnsupportedConfigError",
    "UnsupportedModelError", "WireError", "WorkerCapacityError",
]


class LensError(Exception):
    """Base class of every error raised by vllm-lens."""


class LensRequestError(LensError, ValueError):
    """A lens request is malformed; the message names the offending field.

    Attributes:
        field: dotted path of the offending key, e.g. ``"output_residual_stream.layers[2]"``.
        request_id: the request's id when known, else ``None``.
        index: the request's index in the caller's list (``LLM.generate`` / ``LLM.chat``),
            else ``None``.
    """

    def __init__(self, field: str, problem: str, *, request_id: str | None = None,
                 index: int | None = None) -> None:
        self.field = field
        self.problem = problem
        self.request_id = request_id
        self.index = index
        if index is not None:
            where = f" (request {index} of this call)"
        elif request_id:
            where = f" (request id {request_id})"
        else:
            where = ""
        super().__init__(f"vllm-lens: invalid '{field}'{where}: {problem}")


class UnsupportedModelError(LensRequestError):
    """Lens features were asked for on a model whose decoder layers vllm-lens cannot find."""


class UnsupportedConfigError(LensRequestError):
    """The engine's configuration (runner, scheduling, speculative decoding, ...) is one
    vllm-lens has not proven, so lens requests are refused; the message names the setting."""


class LensExecutionError(LensError):
    """The worker failed while handling this request's lens work (a server-side error).

    Attributes:
        request_id: the engine request id.
        message: what failed, and where (``plan``, ``steer``, ``hooks``, ``capture``,
            ``fetch`` or ``handoff``).
    """

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        self.message = message
        self.request_id = request_id
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"{message}{where}")


class SinkConflictError(LensExecutionError):
    """The capture sink refused the request's example because it conflicts with its dataset
    (a key already written, examples with other settings): the caller's to fix by choosing
    another key or dataset; nothing was written."""


class CapacityError(LensError):
    """A budget that every client shares is full, so this request's results are refused
    rather than another client's dropped to make room; retry once earlier results are
    fetched or expired.

    Attributes:
        setting: the environment variable that sizes the budget.
    """

    def __init__(self, message: str, *, setting: str) -> None:
        self.setting = setting
        super().__init__(message)


class WorkerCapacityError(LensExecutionError):
    """A budget that a worker shares between clients had no room for this request: its
    capture's reservation of ``VLLM_LENS_WORKER_MAX_BYTES`` when it first ran (it then ran
    with its steering and hooks but without its captures), or a capture sink's open datasets
    when its example was to be written. Nobody else's rows or datasets were dropped for it;
    retry later.

    Attributes:
        setting: the setting that sizes the budget.
    """

    def __init__(self, message: str, *, setting: str, request_id: str | None = None) -> None:
        self.setting = setting
        super().__init__(message, request_id=request_id)


class DatasetConflictError(LensError, ValueError):
    """An example that does not fit its dataset: its key is already there, or the dataset
    holds examples with other settings (model, points, layers, dtype, positions ...)."""


class RemoteCodeRefusedError(LensRequestError):
    """A request carried pickled code (a ``Hook``) and the operator has not allowed that."""


class SinkRefusedError(LensRequestError):
    """An HTTP request named a capture sink that the operator has not opened to clients."""


class WireError(LensError, ValueError):
    """Bytes that are not a valid vllm-lens payload (corrupt, truncated or foreign)."""
