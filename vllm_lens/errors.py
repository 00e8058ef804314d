"""Errors raised by vllm-lens (runs in: any).

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
    """Base class of every error raised by vllm-lens.

    Catch it to handle anything vllm-lens refuses or fails at; its subclasses say who is to
    blame (see the tree at the top of this module).

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import LensError
        >>> try:
        ...     llm.generate(["Hi"], SamplingParams(max_tokens=1, extra_args={
        ...         "output_residual_stream": [99]}))
        ... except LensError as exc:
        ...     print(type(exc).__name__, isinstance(exc, ValueError))
        LensRequestError True
    """


class LensRequestError(LensError, ValueError):
    """A lens request is malformed; the message names the offending field.

    Raised before the request reaches the engine (offline by ``LLM.generate`` / ``LLM.chat``,
    over HTTP as a 400 response whose ``param`` is ``field``); nothing of the call runs.

    Args:
        field: dotted path of the offending key (kept as ``field``).
        problem: what is wrong with it, and how to fix it (kept as ``problem``).
        request_id: the request's id, if known.
        index: the request's position in the caller's list, if known; the message then says
            ``(request {index} of this call)``, else ``(request id {request_id})`` when a
            request id is given.

    Attributes:
        field: dotted path of the offending key, e.g. ``"output_residual_stream.layers[2]"``.
        problem: the description of the problem, without the field and request.
        request_id: the request's id when known, else ``None``.
        index: the request's index in the caller's list (``LLM.generate`` / ``LLM.chat``),
            else ``None``.

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import LensRequestError
        >>> bad = SamplingParams(max_tokens=1, extra_args={"output_residual_stream": [1, 99]})
        >>> try:
        ...     llm.generate(["Hi"], bad)
        ... except LensRequestError as exc:
        ...     print(exc.field, "out of range" in exc.problem)
        output_residual_stream[1] True
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
    """Lens features were asked for on a model whose decoder layers vllm-lens cannot find.

    Also raised for a tap point, or Q/K capture, that this model's layers do not offer (a
    parallel-block model has no ``resid_mid``, for example). Plain requests still run.

    Args:
        field: dotted path of the key that asked for it (see ``LensRequestError``).
        problem: what the model lacks.
        request_id: the request's id, if known.
        index: the request's position in the caller's list, if known.

    Examples:
        >>> from vllm_lens import LensRequestError, UnsupportedModelError
        >>> try:
        ...     raise UnsupportedModelError("output_activations.resid_mid", "no such site")
        ... except LensRequestError as exc:
        ...     print(type(exc).__name__, exc.field)
        UnsupportedModelError output_activations.resid_mid
    """


class UnsupportedConfigError(LensRequestError):
    """The engine's configuration (runner, scheduling, speculative decoding, ...) is one
    vllm-lens has not proven, so lens requests are refused; the message names the setting.

    Plain requests on the same engine still run.

    Args:
        field: dotted path of the key that asked for lens work (see ``LensRequestError``).
        problem: the setting that is refused, and what to change.
        request_id: the request's id, if known.
        index: the request's position in the caller's list, if known.

    Examples:
        >>> from vllm_lens import LensRequestError, UnsupportedConfigError
        >>> try:
        ...     raise UnsupportedConfigError("apply_hooks", "speculative decoding is on")
        ... except LensRequestError as exc:
        ...     print(type(exc).__name__, exc.field)
        UnsupportedConfigError apply_hooks
    """


class LensExecutionError(LensError):
    """The worker failed while handling this request's lens work (a server-side error).

    Offline it is not raised but attached to the request's output as ``out.lens_error``
    (``None`` when all went well; then ``out.activations`` and ``out.hook_results`` are
    ``None``: nothing partial is returned); ``AsyncLLM.generate`` raises it, and the HTTP
    server answers 500. The engine and every other request carry on.

    Args:
        message: what failed, and where (kept as ``message``).
        request_id: the engine request id, if known; appended to the message.

    Attributes:
        request_id: the engine request id.
        message: what failed, and where (``plan``, ``steer``, ``hooks``, ``capture``,
            ``fetch`` or ``handoff``).

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import LensExecutionError
        >>> out = llm.generate(["Hi"], SamplingParams(max_tokens=1, extra_args={
        ...     "output_residual_stream": [0]}))[0]
        >>> print(out.lens_error)
        None
        >>> str(LensExecutionError("vllm-lens failed at capture", request_id="7"))
        'vllm-lens failed at capture (request 7)'
    """

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        self.message = message
        self.request_id = request_id
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"{message}{where}")


class SinkConflictError(LensExecutionError):
    """The capture sink refused the request's example because it conflicts with its dataset
    (a key already written, examples with other settings): the caller's to fix by choosing
    another key or dataset; nothing was written.

    Offline it is attached to the request's output as ``out.lens_error``; over HTTP it is a
    409 response.

    Args:
        message: what conflicts (the dataset, the key or the settings).
        request_id: the engine request id, if known.
    """


class CapacityError(LensError):
    """A budget that every client shares is full, so this request's results are refused
    rather than another client's dropped to make room; retry once earlier results are
    fetched or expired.

    Raised by the API server's binary activation store (``VLLM_LENS_HTTP_STORE_MAX_BYTES``,
    ``VLLM_LENS_HTTP_STORE_DIR``) and by a capture sink open to clients whose
    ``max_open_datasets`` are all in use; over HTTP it is a 503 response whose ``param`` is
    ``setting``.

    Args:
        message: what is full and what to do about it.
        setting: the setting that sizes the budget (kept as ``setting``).

    Attributes:
        setting: the environment variable that sizes the budget.

    Examples:
        >>> from vllm_lens import CapacityError
        >>> try:
        ...     raise CapacityError("the binary store is full",
        ...                         setting="VLLM_LENS_HTTP_STORE_MAX_BYTES")
        ... except CapacityError as exc:
        ...     print(exc.setting)
        VLLM_LENS_HTTP_STORE_MAX_BYTES
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

    Offline it is attached to the request's output as ``out.lens_error`` (like any
    ``LensExecutionError``); over HTTP it is a 503 response.

    Args:
        message: what had no room, and what to do about it.
        setting: the setting that sizes the budget (kept as ``setting``), e.g.
            ``VLLM_LENS_WORKER_MAX_BYTES``.
        request_id: the engine request id, if known.

    Attributes:
        setting: the setting that sizes the budget.

    Examples:
        >>> from vllm_lens import LensExecutionError, WorkerCapacityError
        >>> try:
        ...     raise WorkerCapacityError("no room for this capture",
        ...                               setting="VLLM_LENS_WORKER_MAX_BYTES")
        ... except LensExecutionError as exc:
        ...     print(type(exc).__name__, exc.setting)
        WorkerCapacityError VLLM_LENS_WORKER_MAX_BYTES
    """

    def __init__(self, message: str, *, setting: str, request_id: str | None = None) -> None:
        self.setting = setting
        super().__init__(message, request_id=request_id)


class DatasetConflictError(LensError, ValueError):
    """An example that does not fit its dataset: its key is already there, or the dataset
    holds examples with other settings (model, points, layers, dtype, positions ...).

    Args:
        *args: the message, as for ``ValueError``.
    """


class RemoteCodeRefusedError(LensRequestError):
    """A request carried pickled code (a ``Hook``) and the operator has not allowed that.

    A pickled hook (``{"pickle": ...}`` in ``apply_hooks``, what ``Hook`` becomes over HTTP)
    runs only where ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1`` is set; over HTTP the refusal is a
    403 response. Live ``Hook`` objects passed offline are not pickled dicts and are accepted.

    Args:
        field: dotted path of the hook, e.g. ``"apply_hooks[0]"`` (see ``LensRequestError``).
        problem: the refusal, naming the setting that would allow it.
        request_id: the request's id, if known.
        index: the request's position in the caller's list, if known.

    Examples:
        >>> from vllm import SamplingParams
        >>> from vllm_lens import RemoteCodeRefusedError
        >>> sp = SamplingParams(max_tokens=1, extra_args={"apply_hooks": [{"pickle": "AAAA"}]})
        >>> try:
        ...     llm.generate(["Hi"], sp)
        ... except RemoteCodeRefusedError as exc:
        ...     print(exc.field)
        apply_hooks[0]
    """


class SinkRefusedError(LensRequestError):
    """An HTTP request named a capture sink that the operator has not opened to clients.

    A sink is open to HTTP clients when its ``VLLM_LENS_SINKS`` entry has ``"clients":
    true``; the refusal is a 403 response.

    Args:
        field: dotted path of the sink's name, ``"capture_sink.sink"``.
        problem: the refusal, naming the setting that would allow it.
        request_id: the request's id, if known.
        index: the request's position in the caller's list, if known.

    Examples:
        >>> from vllm_lens import LensRequestError, SinkRefusedError
        >>> try:
        ...     raise SinkRefusedError("capture_sink.sink", "sink 'acts' is not open")
        ... except LensRequestError as exc:
        ...     print(type(exc).__name__, exc.field)
        SinkRefusedError capture_sink.sink
    """


class WireError(LensError, ValueError):
    """Bytes that are not a valid vllm-lens payload (corrupt, truncated or foreign).

    Raised when decoding: ``SteeringVector.from_wire``, ``decode_activations``,
    ``decode_activation_bytes`` and the tensor records inside them.

    Examples:
        >>> from vllm_lens import SteeringVector, WireError
        >>> try:
        ...     SteeringVector.from_wire("not base64!")
        ... except WireError as exc:
        ...     print(exc, isinstance(exc, ValueError))
        steering vector wire string is not valid base64 True
    """
