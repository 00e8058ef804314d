"""HTTP clients for a vLLM OpenAI server with vllm-lens: ``LensClient`` and ``AsyncLensClient``
(runs in: caller).

It needs httpx, not vLLM.

Both have the same methods with the same arguments; the async one's are coroutines (and
async iterators when streaming). The protocol is written once, as generators that yield
``httpx.Request`` objects and receive the responses (httpx's own sans-I/O habit); each client
only sends them, so the two cannot drift apart.

The clients never unpickle anything: activations arrive as JSON tensor records or as msgpack
bytes (``vllm_lens.activations``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import torch

from vllm_lens.common import wire
from vllm_lens.activations import (
    FETCH_PATH,
    decode_activation_bytes,
    decode_activations,
    decode_json_tensors,
    decode_sae_features,
    is_binary_descriptor,
    valid_handle,
)
from vllm_lens.errors import LensError
from vllm_lens.hooks import hook_to_json
from vllm_lens.spec import (
    ACTIVATIONS_KEY,
    ATTENTION_STEER_KEY,
    CAPTURE_KEY,
    HOOKS_KEY,
    LOGIT_KEY,
    MONITORS_KEY,
    PRESET_PREFIX,
    QK_KEY,
    REPLACE_KEY,
    SAE_KEY,
    SINK_KEY,
    STEER_KEY,
    STREAM_KEY,
    TRANSPORT_KEY,
    TRANSPORTS,
)

__all__ = ["AsyncLensClient", "LensClient", "LensHTTPError", "LensResult", "encode_xargs"]

#: One protocol step: send the request, get the response back; the return value is the result.
_Steps = Generator[httpx.Request, httpx.Response, Any]


class LensHTTPError(LensError):
    """The server answered with an error (bad lens input is status 400, ``param`` its field).

    Raised by every method of `LensClient` and `AsyncLensClient` that gets an
    error status, a body of the OpenAI error form (``{"error": {"message", "param",
    "code"}}``) or, while streaming, an error chunk. What the statuses mean: 400 a bad lens
    value, refused before anything runs; 403 a route or kind of request the operator did not
    open (pickled hooks, ``/v1/hooks/*``, the steering-preset routes, a sink not open to
    clients); 404 a binary handle that is missing, deleted or expired; 409 a capture sink's
    dataset conflict; 413 a patching sweep's body over ``VLLM_LENS_MAX_REQUEST_BYTES`` (a
    lens value over it on the completion routes is a 400); 429 too many patching sweeps at
    once; 500 a request the worker failed while serving it (a hook that raised: its message
    and traceback summary); 503 a full store or worker budget.

    Args:
        status: the HTTP status (the error body's ``code`` where it has one).
        message: the server's message.
        param: the request field the error names (``"output_residual_stream[0]"``,
            ``"apply_hooks"``, ``"name"`` ...), or ``None``.

    Attributes:
        status (int): as above.
        message (str): as above; ``str(exc)`` is ``"HTTP <status>: <message>"``.
        param (str | None): as above.

    Examples:
        >>> from vllm_lens.client import LensClient, LensHTTPError
        >>> with LensClient(server) as client:
        ...     try:
        ...         client.generate("Hi", max_tokens=2, capture_layers=[99])
        ...     except LensHTTPError as exc:
        ...         print(exc.status, exc.param)
        400 output_residual_stream[0]
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        self.status = status
        self.message = message
        self.param = param
        super().__init__(f"HTTP {status}: {message}")


@dataclass
class LensResult:
    """One choice of a response; ``choices`` holds every choice of the same response.

    While streaming, ``text`` and ``token_ids`` are what arrived so far and ``delta`` the newest
    piece; ``activations`` is set on the last result of each choice, or, with
    ``stream_activations=True``, on every result that brought rows: the rows computed since
    the previous one (laid end to end along positions, they are the whole capture).

    The clients make these (``generate``, ``chat``); tensors arrive decoded, on the CPU.
    Each field below is an attribute of the result.

    Args:
        index (int): the choice's index in the response (0, 1, ... for ``n > 1`` or several
            prompts).
        text (str): the generated text (for ``chat``, the message's content); while
            streaming, the text so far.
        token_ids (list[int]): the generated token ids (so far, while streaming).
        finish_reason (str | None): vLLM's (``"stop"``, ``"length"`` ...); ``None`` until the
            choice's last token has arrived.
        activations (dict[str, torch.Tensor] | None): the choice's captured rows, in the
            served model's dtype (``"positions"`` and the other position lists int64), or
            ``None`` when the request captured nothing or sent its rows to a capture sink.
            ``"residual_stream"`` ``[n_layers, n_positions, hidden]`` for ``capture_layers``
            / ``capture`` (row ``[i, p]``: the stream after layer ``layers[i]`` at position
            ``positions[p]``; every prompt token and every generated token but the last),
            ``"positions"`` ``[n_positions]``; with ``output_activations``, per point
            ``<point>`` ``[n_layers, n_positions, *point shape]`` and ``"<point>_positions"``;
            with ``output_qk``, ``"attn_q"`` ``[n_layers, n_positions, n_heads, head_dim]``,
            ``"attn_k"`` and their metadata (``vllm_lens.attention``). Reduced captures
            (``"reduce": "mean"`` or ``"last"``) have no positions axis:
            ``[n_layers, hidden]``.
        raw (dict[str, Any]): the response JSON (or, when streaming, the chunk this result
            came from).
        prompt_token_ids (list[int] | None): the prompt's token ids, as the server
            tokenized it.
        hook_results (dict[str, Any] | None): for requests with ``hooks=``, ``{"0": saved of
            the first hook, "1": saved of the second, ...}``, each what the hook kept in
            ``ctx.saved`` (tensors decoded; a named hook documents its own, e.g.
            ``logit_lens_topk``'s ``{"token_ids": {"<layer>": [n_positions, k]},
            "positions": {"<layer>": [n_positions]}}``).
        capture_receipt (dict[str, Any] | None): for requests with ``capture_sink=``, where
            the rows went (``vllm_lens.sinks``): ``{"sink", "dataset", "key", "shard",
            "offset", "rows", "shapes", "durable"}`` (and ``"writer"`` from a named writer;
            under pipeline parallelism ``"parts"`` instead of ``"shard"`` and ``"offset"``).
        steering_gates (dict[str, Any] | None): for conditional steering vectors,
            ``{"<vector index>": {"positions", "gates"}}``: where each gated vector was
            tested and its gate there.
        sae_features (list[dict[str, Any]] | None): for requests with ``sae_features=``,
            one entry per SAE asked for: ``{"sae", "layer", "point", "positions" int64 [n],
            "indices" int32 [n, top_k], "values" float32 [n, top_k]}`` (index -1, value 0
            where fewer features were active), with ``"reconstruction": true`` also
            ``"nmse"`` float32 [n] and ``"l0"`` int32 [n], and where the SAE's directory
            has labels ``"labels"`` (feature index -> label of the features the entry
            holds). On the last result of each
            choice or, with ``stream_activations=True``, like ``activations``
            (``vllm_lens.saes.to_sparse`` makes a sparse tensor of an entry).
        delta (str): while streaming, the text this result added (``""`` otherwise).
        choices (list[LensResult]): every choice of the same response, in index order (this
            one among them); empty while streaming.

    Examples:
        >>> from vllm_lens import NamedHook
        >>> from vllm_lens.client import LensClient
        >>> with LensClient(server) as client:
        ...     r = client.generate(["Hello", "Bonjour"], max_tokens=3, ignore_eos=True,
        ...                         capture_layers=[5], hooks=[NamedHook("logit_lens_topk",
        ...                                                              [29], {"k": 2})])
        >>> [c.index for c in r.choices], len(r.token_ids), r.finish_reason
        ([0, 1], 3, 'length')
        >>> n = len(r.prompt_token_ids) + 2   # rows: the prompt and all but the last token
        >>> r.activations["residual_stream"].shape == (1, n, 576)
        True
        >>> r.hook_results["0"]["token_ids"]["29"].shape == (n, 2)
        True
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    activations: dict[str, torch.Tensor] | None
    raw: dict[str, Any]
    """The response JSON (or, when streaming, the chunk this result came from)."""
    prompt_token_ids: list[int] | None = None
    hook_results: dict[str, Any] | None = None
    """``{"0": saved of the first hook, ...}`` for requests with ``hooks=``."""
    capture_receipt: dict[str, Any] | None = None
    """Where the rows went, for a request with ``capture_sink=`` (``vllm_lens.sinks``)."""
    steering_gates: dict[str, Any] | None = None
    """``{"<vector index>": {"positions", "gates"}}`` for conditional steering vectors."""
    monitors: list[dict[str, Any]] | None = None
    """For requests with ``monitors=``: one record per monitor (``name``, ``action``,
    ``threshold``, ``fired``, ``position``, ``score``, ``positions``, ``scores``)."""
    stop_reason: str | int | None = None
    """What stopped the choice: a stop string or token, or the name of the monitor that
    ended it (``finish_reason`` ``"stop"``)."""
    sae_features: list[dict[str, Any]] | None = None
    """For requests with ``sae_features=``: per SAE asked for, ``{"sae", "layer", "point",
    "positions", "indices", "values"}`` (and ``"nmse"``, ``"l0"`` with reconstruction;
    ``"labels"`` where the SAE has them), on
    the last result of each choice or, with ``stream_activations=True``, like
    ``activations``: the positions computed since the previous result
    (``vllm_lens.saes.to_sparse`` makes a sparse tensor)."""
    logit_attribution: dict[str, Any] | None = None
    """For requests with ``logit_attribution=`` (``output_logit_attribution``): ``{"layers",
    "positions", "tokens", "embed", "attn_out", "mlp_out"}``, the direct effect of the
    embedding and of each layer's attention and MLP outputs on the logit of the token that
    follows each position (or the named one); on the last result of each choice."""
    delta: str = ""
    choices: list[LensResult] = field(default_factory=list, repr=False)


class _Protocol:
    """Request building and response parsing shared by both clients."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def request(self, method: str, path: str, body: Any = None) -> httpx.Request:
        return httpx.Request(method, self.base_url + path, json=body, headers=self.headers)

    def model_steps(self) -> _Steps:
        if self.model is None:
            response = yield self.request("GET", "/v1/models")
            self.model = _json_or_raise(response)["data"][0]["id"]
        return self.model

    def body(self, kind: str, content: Any, *, max_tokens: int, temperature: float,
             capture_layers: Sequence[int] | bool | None, capture: Mapping[str, Any] | None,
             steering_vectors: Any, hooks: Any, stream: bool, transport: str,
             openai_kwargs: dict[str, Any]) -> dict[str, Any]:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'json', 'binary' or 'lists', got "
                             f"{transport!r}")
        if capture_layers is not None and capture is not None:
            raise ValueError("pass capture_layers or capture, not both")
        lens: dict[str, Any] = {}
        if capture is not None:
            lens[CAPTURE_KEY] = capture
        elif capture_layers is not None:
            if isinstance(capture_layers, (str, bytes)):
                raise TypeError(f"capture_layers: expected a list of layer indices or True, "
                                f"got the string {capture_layers!r} (pass [12], not '12')")
            lens[CAPTURE_KEY] = capture_layers
        for key in (ACTIVATIONS_KEY, QK_KEY, SINK_KEY, STREAM_KEY, SAE_KEY, MONITORS_KEY,
                    ATTENTION_STEER_KEY, REPLACE_KEY, LOGIT_KEY):
            if openai_kwargs.get(key) is not None:
                lens[key] = openai_kwargs.pop(key)
        if openai_kwargs.get("sae_features") is not None:
            lens[SAE_KEY] = openai_kwargs.pop("sae_features")
        if openai_kwargs.get("logit_attribution") is not None:
            lens[LOGIT_KEY] = openai_kwargs.pop("logit_attribution")
        if steering_vectors is not None:
            lens[STEER_KEY] = steering_vectors
        if hooks is not None:
            lens[HOOKS_KEY] = hooks
        if transport != "json":
            lens[TRANSPORT_KEY] = transport
        xargs = {**(openai_kwargs.pop("vllm_xargs", None) or {}), **encode_xargs(lens)}
        body = {"model": self.model, kind: content, "max_tokens": max_tokens,
                "temperature": temperature, "stream": stream, "return_token_ids": True,
                **openai_kwargs}
        if xargs:
            body["vllm_xargs"] = xargs
        return body

    def call_steps(self, path: str, body: dict[str, Any]) -> _Steps:
        """POST a non-streaming request; returns the first choice's ``LensResult``."""
        response = yield self.request("POST", path, body)
        data = _json_or_raise(response)
        choices = sorted(data.get("choices", []), key=lambda c: c["index"])
        results = [_choice_result(c, data) for c in choices]
        for result, choice in zip(results, choices):
            result.activations = yield from self.activations_steps(choice.get("activations"))
            result.choices = results
        return results[0]

    def hooks_steps(self, method: str, path: str, body: Any = None) -> _Steps:
        """Call one ``/v1/hooks/*`` or ``/v1/steering/*`` route; returns its decoded
        ``result``."""
        response = yield self.request(method, path, body)
        return decode_json_tensors(_json_or_raise(response).get("result"))

    def sweep_steps(self, body: dict[str, Any]) -> _Steps:
        response = yield self.request("POST", "/v1/lens/patching_sweep", body)
        result = _json_or_raise(response)
        # The server sends null for a cell whose metric is not finite: NaN here.
        grid = [[float("nan") if v is None else v for v in row] for row in result["grid"]]
        return {**result, "grid": torch.tensor(grid, dtype=torch.float64)}

    def presets_steps(self) -> _Steps:
        response = yield self.request("GET", "/v1/steering")
        return _json_or_raise(response)["data"]

    def saes_steps(self) -> _Steps:
        response = yield self.request("GET", "/v1/lens/saes")
        return _json_or_raise(response)["data"]

    def activations_steps(self, payload: Any) -> _Steps:
        """Decode a choice's ``activations``, fetching (then deleting) binary ones."""
        if payload is None:
            return None
        if not is_binary_descriptor(payload):
            return decode_activations(payload)
        # Only the handle is taken from the response, checked to be a token; the request goes
        # to this client's own server (never to a URL the response names), with the handle in
        # the body, and frees the server's copy in the same call.
        handle = valid_handle(payload.get("handle"))
        response = yield self.request("POST", FETCH_PATH, {"handle": handle, "delete": True})
        if response.status_code != 200:
            _json_or_raise(response)
        return decode_activation_bytes(response.content)


class _StreamState:
    """Turns streamed server-sent events into partial ``LensResult`` objects."""

    def __init__(self) -> None:
        self.by_index: dict[int, LensResult] = {}

    def feed(self, line: str) -> list[tuple[LensResult, Any]]:
        """One line of the event stream -> [(result so far, activations payload or None)]."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return []
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            _raise_error_body(chunk, 200)
        out = []
        for choice in chunk.get("choices", []):
            index = choice["index"]
            previous = self.by_index.get(index) or LensResult(
                index=index, text="", token_ids=[], finish_reason=None, activations=None,
                raw=chunk)
            delta = choice.get("text")
            if delta is None:
                delta = (choice.get("delta") or {}).get("content") or ""
            result = replace(
                previous, text=previous.text + delta, delta=delta, raw=chunk, activations=None,
                token_ids=previous.token_ids + list(choice.get("token_ids") or ()),
                finish_reason=choice.get("finish_reason") or previous.finish_reason,
                prompt_token_ids=chunk.get("prompt_token_ids") or previous.prompt_token_ids,
                hook_results=decode_json_tensors(choice.get("hook_results"))
                or previous.hook_results,
                steering_gates=decode_json_tensors(choice.get("steering_gates"))
                or previous.steering_gates,
                sae_features=decode_sae_features(choice.get("sae_features")),
                monitors=choice.get("monitors") or previous.monitors,
                stop_reason=choice.get("stop_reason") or previous.stop_reason,
                logit_attribution=decode_json_tensors(choice.get("logit_attribution"))
                or previous.logit_attribution,
            )
            self.by_index[index] = result
            out.append((result, choice.get("activations")))
        return out


class LensClient:
    """Synchronous client (httpx) for a lens-enabled vLLM OpenAI server.

    Use it as a context manager (or call `close`) to close its connections. Every
    method raises `LensHTTPError` when the server answers with an error, and lets
    httpx's own errors through when none comes (``httpx.ConnectError`` for a server that is
    not there, ``httpx.TimeoutException`` past ``timeout``: both ``httpx.TransportError``).

    Args:
        base_url: the server's address without ``/v1`` (``"http://host:port"``; a trailing
            ``/`` is dropped).
        model: the model name sent with each request; default: the first model
            ``GET /v1/models`` lists, asked once, at the first request.
        api_key: sent as ``Authorization: Bearer <api_key>`` (a server started with
            ``--api-key``); default: no header.
        timeout: seconds httpx waits to connect, and for each read or write (not for the whole
            response); default 600.

    Examples:
        >>> from vllm_lens.client import LensClient
        >>> with LensClient(server) as client:
        ...     r = client.generate("The capital of France is", max_tokens=4,
        ...                         capture_layers=[3, 7])
        >>> acts = r.activations
        >>> acts["residual_stream"].shape[::2], acts["residual_stream"].dtype
        (torch.Size([2, 576]), torch.float32)
        >>> acts["positions"].tolist() == list(range(acts["residual_stream"].shape[1]))
        True
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None,
                 api_key: str | None = None, timeout: float = 600.0) -> None:
        self._protocol = _Protocol(base_url, model, api_key)
        self._http = httpx.Client(timeout=timeout)

    def generate(self, prompt: str | list[int] | list[str], *, max_tokens: int = 16,
                 temperature: float = 0.0, capture_layers: Sequence[int] | bool | None = None,
                 capture: Mapping[str, Any] | None = None, steering_vectors: Any = None,
                 hooks: Any = None, stream: bool = False, transport: str = "json",
                 **openai_kwargs: Any) -> Any:
        """``/v1/completions``. Returns a ``LensResult`` or, with ``stream=True``, an iterator
        of partial ones. ``output_activations=``, ``output_qk=``, ``capture_sink=``,
        ``stream_activations=``, ``sae_features=`` (``output_sae_features``: SAEs the
        server registered, by name), ``monitors=`` (``spec.monitors``; a probe may be a
        tensor) and ``steer_attention=`` (``spec.attention_steering``) are sent as those lens
        keys; other ``openai_kwargs`` go into the request body
        (``n``, ``seed``, ...).

        Args:
            prompt: the prompt: a string, a list of token ids, or a list of strings (several
                prompts: one choice each, in ``choices``).
            max_tokens: tokens to generate (default 16).
            temperature: sampling temperature (default 0.0: greedy).
            capture_layers: the residual stream (``output_residual_stream``) at these layer
                indices, or ``True`` for every layer, every position; ``None`` (default):
                none. Not a string: ``[12]``, not ``"12"``.
            capture: the extended form of ``output_residual_stream`` instead,
                ``{"layers": [...] or True, "positions": ..., "reduce": None | "mean" |
                "last"}``; not together with ``capture_layers``.
            steering_vectors: ``apply_steering_vectors``: a ``SteeringVector``, its
                ``model_dump(mode="json")`` dict or ``to_wire()`` string, an item steering by
                a served SAE's feature (``{"sae", "feature", "scale" | "clamp"}``),
                ``"preset:<name>"`` (a preset the server registered), or a list of these.
            hooks: ``apply_hooks``: a list of ``NamedHook`` (any server) or ``Hook`` (pickled:
                only where the operator set ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1``); their
                results come back in ``hook_results``.
            stream: ``False`` (default): wait for the whole response; ``True``: server-sent
                events, returned as an iterator of partial results.
            transport: ``"json"`` (default): the tensors travel inside the response;
                ``"binary"``: the response holds a handle, and the client fetches the bytes
                (msgpack) in a second request, which frees them on the server; ``"lists"``:
                every tensor as its plain values in the JSON (no zstandard needed to read
                it; larger than ``"json"``), decoded alike.
            **openai_kwargs: lens keys by name, sent as such in ``vllm_xargs``:
                ``output_activations=`` (tap points), ``output_qk=`` (layers),
                ``capture_sink=`` (``{"sink", "dataset", "key"}``), ``stream_activations=``
                (``True``), ``output_sae_features=`` or its short name ``sae_features=``
                (``{"sae": name the server registered, "top_k", "reconstruction"}`` or a
                list of them), ``monitors=``, ``steer_attention=`` (a list of edits),
                ``replace_mlp=`` (``[{"transcoder": name the server registered,
                "keep_error", "clamp"}]``). Anything else goes into the request body as it
                is (``n``,
                ``seed``, ``stop``, ``ignore_eos`` ...; ``vllm_xargs`` is merged with the
                lens keys).

        Returns:
            Without ``stream``: the first choice's `LensResult`, every choice in its
            ``choices``. With ``stream=True``: an iterator of ``LensResult`` (one per choice
            per chunk, each with the text so far and ``delta``); the request is sent when
            iteration starts, and the last result of each choice carries its
            ``activations`` (with ``stream_activations=True``, every result that brought
            rows carries those rows).

        Raises:
            ValueError: ``transport`` is not ``"json"``, ``"binary"`` or ``"lists"``, or both
                ``capture_layers`` and ``capture`` are given.
            TypeError: ``capture_layers`` is a string.
            LensHTTPError: the server refused or failed the request (400 naming the field
                in ``param`` for a bad lens value; see `LensHTTPError`); with
                ``stream=True`` raised while iterating.
            vllm_lens.WireError: binary activations that are not a valid payload, or a
                steering vector given as a wire string that does not decode.
            httpx.TransportError: no answer from the server (not reachable, timed out).

        Examples:
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     parts = list(client.generate("Once upon a time", max_tokens=4,
            ...                                  ignore_eos=True, stream=True, capture_layers=[5]))
            ...     r = client.generate("Hi", max_tokens=2, sae_features={"sae": "smol-l10",
            ...                                                           "top_k": 4})
            >>> "".join(p.delta for p in parts) == parts[-1].text, len(parts[-1].token_ids)
            (True, 4)
            >>> parts[-1].activations["residual_stream"].shape[0]
            1
            >>> sorted(r.sae_features[0]), r.sae_features[0]["indices"].shape[1]
            (['indices', 'labels', 'layer', 'point', 'positions', 'sae', 'values'], 4)
        """
        return self._run("/v1/completions", "prompt", prompt, stream, dict(
            max_tokens=max_tokens, temperature=temperature, capture_layers=capture_layers,
            capture=capture, steering_vectors=steering_vectors, hooks=hooks,
            transport=transport, openai_kwargs=openai_kwargs))

    def chat(self, messages: list[dict[str, Any]], *, max_tokens: int = 16,
             temperature: float = 0.0, capture_layers: Sequence[int] | bool | None = None,
             capture: Mapping[str, Any] | None = None, steering_vectors: Any = None,
             hooks: Any = None, stream: bool = False, transport: str = "json",
             **openai_kwargs: Any) -> Any:
        """``/v1/chat/completions``; arguments and result as for `generate`.

        The server renders ``messages`` with the model's chat template; positions count the
        rendered prompt's tokens.

        Args:
            messages: the chat, OpenAI style: ``[{"role": "user", "content": "..."}, ...]``.
            max_tokens: as for `generate` (default 16).
            temperature: as for `generate` (default 0.0).
            capture_layers: as for `generate`.
            capture: as for `generate`.
            steering_vectors: as for `generate`.
            hooks: as for `generate`.
            stream: as for `generate`.
            transport: as for `generate`.
            **openai_kwargs: as for `generate` (lens keys by name; the rest into the
                chat request's body).

        Returns:
            As `generate`: a `LensResult` whose ``text`` is the message's
            content, or with ``stream=True`` an iterator of them.

        Raises:
            ValueError: as for `generate`.
            TypeError: as for `generate`.
            LensHTTPError: as for `generate`.
            httpx.TransportError: as for `generate`.

        Examples:
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     r = client.chat([{"role": "user", "content": "Hi"}], max_tokens=3,
            ...                     capture={"layers": [2], "reduce": "mean"})
            >>> r.activations["residual_stream"].shape
            torch.Size([1, 576])
        """
        return self._run("/v1/chat/completions", "messages", messages, stream, dict(
            max_tokens=max_tokens, temperature=temperature, capture_layers=capture_layers,
            capture=capture, steering_vectors=steering_vectors, hooks=hooks,
            transport=transport, openai_kwargs=openai_kwargs))

    def served_model(self) -> str:
        """The model requests go to: the one given, else the server's first.

        Returns:
            The model name: ``model`` as given to the client, else the first ``id`` of
            ``GET /v1/models`` (asked once, then kept).

        Raises:
            LensHTTPError: ``/v1/models`` answered with an error (401 without the server's
                API key).
            httpx.TransportError: no answer from the server.
        """
        return self._drive(self._protocol.model_steps())

    def fetch_activations(self, payload: Any) -> dict[str, torch.Tensor] | None:
        """Decode one choice's ``activations`` from any response (e.g. one the ``openai`` SDK
        returned): JSON tensors are decoded; a binary handle is fetched, then deleted.

        Only the handle is taken from a binary descriptor: the bytes are asked of this
        client's own server (``POST /v1/lens/activations/fetch``), never of a URL the
        response names.

        Args:
            payload: a choice's ``"activations"`` value: a dict of JSON tensor records, the
                binary transport's ``{"transport": "binary", "handle", ...}``, or ``None``.
                (Other forms ``vllm_lens.decode_activations`` takes, a whole response or a
                choice, are decoded as it decodes them; a binary descriptor inside them is
                refused: pass the choice's ``"activations"`` itself.)

        Returns:
            ``{name: tensor}`` as `LensResult.activations` lays it out, or ``None``
            for ``None``.

        Raises:
            ValueError: the descriptor's handle is not a well-formed handle.
            LensHTTPError: 404 for a handle that is missing, already fetched or expired.
            vllm_lens.WireError: the fetched bytes are not a valid payload, or a response or
                choice holding a binary descriptor was passed.
            TypeError: ``payload`` is not a mapping (nor an ``openai`` SDK object).
            httpx.TransportError: no answer from the server.

        Examples:
            >>> import httpx
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     body = {"model": client.served_model(), "prompt": "Hi", "max_tokens": 2,
            ...             "vllm_xargs": {"output_residual_stream": "[1]",
            ...                            "activations_transport": "binary"}}
            ...     choice = httpx.post(server + "/v1/completions", json=body).json()["choices"][0]
            ...     acts = client.fetch_activations(choice["activations"])
            >>> choice["activations"]["transport"], acts["residual_stream"].shape[0]
            ('binary', 1)
        """
        return self._drive(self._protocol.activations_steps(payload))

    # -- persistent hooks (``/v1/hooks/*``) ------------------------------------------------------
    def register_hooks(self, hooks: Sequence[Any], prefetch_params: Sequence[str] | None = None
                       ) -> Any:
        """Run ``hooks`` (``NamedHook`` objects, or ``Hook`` objects where the server opted
        in to pickled code) on every request until `clear_hooks`.

        They run on every client's requests and see the tokens each step computes (prompt
        tokens served from the prefix cache are not run again). Their results are kept per
        request: `collect_hook_results`.

        Args:
            hooks: the hooks: ``NamedHook``, ``Hook`` (pickled: 403 unless the operator set
                ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1``) or their JSON dicts. Registering again
                replaces the hooks registered before. Hooks at ``attn_qk`` run per request
                only.
            prefetch_params: parameter names to make available to the hooks on every
                pipeline stage, as `prefetch_params` does; default none.

        Returns:
            ``None`` (the server's ``result``).

        Raises:
            LensHTTPError: 403 unless the operator started the server with
                ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (persistent hooks see every client's
                traffic), 403 for pickled hooks the operator did not allow, 400 naming the
                field for a hook that does not fit the model (an unknown named hook, a layer
                out of range ...) or an unknown parameter name (``param`` ``"names"``).
            httpx.TransportError: no answer from the server.

        Examples:
            >>> from vllm_lens import NamedHook
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     probe = NamedHook("linear_probe", [5], {"weight": [0.01] * 576})
            ...     client.register_hooks([probe])
            ...     try:
            ...         r = client.generate("A persistent hook sees this", max_tokens=2)
            ...         collected = client.collect_hook_results()
            ...     finally:  # (persistent hooks run on every request until cleared)
            ...         client.clear_hooks()
            ...         client.clear_hook_results()
            >>> mine = [v for k, v in collected.items() if k.startswith(r.raw["id"])]
            >>> sorted(mine[0]["0"]), mine[0]["0"]["scores"]["5"].ndim
            (['positions', 'scores'], 1)
        """
        return self._drive(self._protocol.hooks_steps(
            "POST", "/v1/hooks/register", _register_body(hooks, prefetch_params)))

    def collect_hook_results(self) -> dict[str, Any]:
        """``{request id: {"0": saved, ...}}`` of the persistent hooks (non-destructive).

        Returns:
            ``{request id: {"0": saved of the first hook, ...}}`` with tensors decoded, for
            the last ``VLLM_LENS_HOOK_RESULTS_MAX`` requests the hooks ran on (a completion's
            request id starts with the response's ``id``: ``LensResult.raw["id"]``); a
            request whose hook raised holds ``{"error", "traceback"}`` instead. Calling it
            again returns the same until `clear_hook_results`.

        Raises:
            LensHTTPError: 403 unless the operator started the server with
                ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (persistent hooks see every client's
                traffic).
            httpx.TransportError: no answer from the server.
        """
        return self._drive(self._protocol.hooks_steps("GET", "/v1/hooks/collect"))

    def clear_hook_results(self) -> None:
        """Drop the persistent hooks' results kept so far (the hooks stay registered).

        Raises:
            LensHTTPError: 403 unless the operator started the server with
                ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (persistent hooks see every client's
                traffic).
            httpx.TransportError: no answer from the server.
        """
        self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_results"))

    def clear_hooks(self) -> None:
        """Unregister every persistent hook (results kept so far stay until
        `clear_hook_results`).

        Raises:
            LensHTTPError: 403 unless the operator started the server with
                ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (persistent hooks see every client's
                traffic).
            httpx.TransportError: no answer from the server.
        """
        self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear"))

    def prefetch_params(self, names: Sequence[str]) -> dict[str, Any]:
        """Make these parameters available to hooks on every pipeline stage; returns shapes.

        Under pipeline parallelism a hook's ``ctx.get_parameter(name)`` reaches a parameter
        another stage holds (the unembedding, from an early stage) only once it was
        prefetched; they stay until `clear_prefetched`.

        Args:
            names: parameter names as the served model (vLLM's module) names them, e.g.
                ``"model.norm.weight"``.

        Returns:
            ``{name: shape}``, each shape a list of ints.

        Raises:
            LensHTTPError: 403 unless the operator started the server with
                ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (persistent hooks see every client's
                traffic); 400 with ``param`` ``"names"`` when no stage has one of ``names``.
            httpx.TransportError: no answer from the server.

        Examples:
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     shapes = client.prefetch_params(["model.norm.weight"])
            ...     client.clear_prefetched()
            >>> shapes
            {'model.norm.weight': [576]}
        """
        return self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/prefetch",
                                                      {"names": list(names)}))

    def clear_prefetched(self) -> None:
        """Drop the parameters `prefetch_params` made available to hooks.

        Raises:
            LensHTTPError: 403 unless the operator started the server with
                ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (persistent hooks see every client's
                traffic).
            httpx.TransportError: no answer from the server.
        """
        self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_prefetched"))

    def patching_sweep(self, prompt: str | list[int], clean: Any, layers: Sequence[int],
                       positions: Sequence[int], metric: Mapping[str, Any], corrupt: Any = None,
                       point: str = "resid_post") -> dict[str, Any]:
        """An activation-patching sweep on the server (``frontend.patching_sweep``): the metric
        per (layer, position) cell as ``grid`` [len(layers), len(positions)].

        Cell ``(i, j)`` runs the prompt with ``corrupt`` plus ``clean[i, j]`` written over
        ``point`` of layer ``layers[i]`` at position ``positions[j]`` (a ``mode="replace"``
        steering vector), one forward pass and one greedy token each, and reads the metric
        from the raw logprobs at the last prompt position. No code travels: a shared server
        accepts it like any steering request.

        Args:
            prompt: a string (tokenized by the server) or a non-empty list of token ids.
            clean: the rows to restore, ``[len(layers), len(positions), hidden]`` (a tensor
                or nested lists; e.g. a capture of the clean prompt).
            layers: layer indices, without duplicates.
            positions: prompt positions, without duplicates.
            metric: ``{"logit_diff": [a, b]}`` (logprob of token ``a`` minus that of ``b``),
                ``{"logprob": a}`` or ``{"prob": a}``, token ids.
            corrupt: the corruption, steering vectors as for ``steering_vectors`` of
                `generate` (e.g. noise added to the subject's embeddings:
                ``layer_indices=[-1]``), or an item steering by a served SAE's feature;
                default ``None``: no corruption.
            point: the tap point written (default ``"resid_post"``; any point steering may
                write: ``resid_pre``, ``attn_in``, ``attn_out``, ``resid_mid``, ``mlp_in``,
                ``mlp_out``).

        Returns:
            ``{"grid": float64 tensor [len(layers), len(positions)], "corrupted": the metric
            of the corrupted run alone, "uncorrupted": that of the prompt without
            ``corrupt``, "layers": [...], "positions": [...]}`` (``corrupted`` and
            ``uncorrupted`` are ``None`` where the metric is not finite).

        Raises:
            LensHTTPError: 400 naming the field for a bad argument (a layer or position out
                of range, a bad metric, ``clean`` of the wrong shape, more cells than
                ``VLLM_LENS_MAX_SWEEP_CELLS`` ...), 413 for a body over
                ``VLLM_LENS_MAX_REQUEST_BYTES``, 429 when the server runs its limit of
                sweeps, 500 when a variant failed.
            httpx.TransportError: no answer from the server.

        Examples:
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     r = client.generate("The Eiffel Tower is in", max_tokens=1,
            ...                         capture_layers=[4, 8])
            ...     clean = r.activations["residual_stream"][:, [1, 2]]
            ...     out = client.patching_sweep(r.prompt_token_ids, clean, [4, 8], [1, 2],
            ...                                 {"prob": r.token_ids[0]})
            >>> out["grid"].shape, out["grid"].dtype, sorted(out)
            (torch.Size([2, 2]), torch.float64,
             ['corrupted', 'grid', 'layers', 'positions', 'uncorrupted'])
        """
        return self._drive(self._protocol.sweep_steps(
            _sweep_body(prompt, clean, layers, positions, metric, corrupt, point)))

    def steering_presets(self) -> list[dict[str, Any]]:
        """The server's named steering presets (select one with ``"preset:<name>"`` in
        ``steering_vectors``).

        Listing and selecting presets needs no opt-in; only registering does.

        Returns:
            One dict per preset, by name: ``{"name", "model" (or None), "vectors": [{"layers",
            "point", "mode", "phase", "scale", "norm_match", "positions", "shape"}, ...]}``
            (and ``"cap"`` for a ``mode="cap"`` vector; never the vectors themselves).

        Raises:
            LensHTTPError: the server answered with an error.
            httpx.TransportError: no answer from the server.

        Examples:
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     presets = {p["name"]: p for p in client.steering_presets()}
            ...     r = client.generate("Hi", max_tokens=3, steering_vectors=["preset:calm"])
            >>> presets["calm"]["vectors"][0]["layers"], len(r.token_ids) > 0
            ([10], True)
        """
        return self._drive(self._protocol.presets_steps())

    def saes(self) -> list[dict[str, Any]]:
        """The SAEs the server serves by name (``sae_features={"sae": name, ...}``): name,
        layout, architecture, hook point, ``d_in``, ``d_sae``.

        Returns:
            One dict per SAE the operator registered (``VLLM_LENS_SAES``): ``{"name",
            "layout", "architecture", "hook_name", "point", "layer", "d_in", "d_sae",
            "dtype"}`` (never a path or weights).

        Raises:
            LensHTTPError: the server answered with an error.
            httpx.TransportError: no answer from the server.

        Examples:
            >>> from vllm_lens.client import LensClient
            >>> with LensClient(server) as client:
            ...     (sae,) = [s for s in client.saes() if s["name"] == "smol-l10"]
            >>> sae["point"], sae["layer"], sae["d_in"], sae["d_sae"]
            ('resid_post', 10, 576, 512)
        """
        return self._drive(self._protocol.saes_steps())

    def register_steering(self, name: str, vectors: Any, model: str | None = None) -> Any:
        """Register a preset (needs the operator's ``VLLM_LENS_ALLOW_STEERING_ROUTES=1``).

        The vectors are checked against the served model as a request's are; a preset steers
        every client that selects it (``"preset:<name>"``).

        Args:
            name: 1 to 64 letters, digits, ``.``, ``_`` or ``-``, starting with a letter or
                digit; a name registered again is replaced.
            vectors: steering vectors as for ``steering_vectors`` of `generate` (a
                ``SteeringVector``, its JSON dict or wire string, an item steering by a
                feature of an SAE the server serves by name, or a list of these).
            model: the model the preset is for; refused if the server serves another.
                Default ``None``: any.

        Returns:
            The preset's description, as `steering_presets` lists it.

        Raises:
            LensHTTPError: 403 unless the operator opened the routes; 400 naming the field
                (``"name"``, ``"model"``, ``"presets.<name>[i]..."``) for a bad name, another
                model or a vector that does not fit the model; 503 when a server of several
                API processes could not share the change with the others (nothing changed).
            vllm_lens.WireError: a vector given as a wire string that does not decode.
            httpx.TransportError: no answer from the server.

        Examples:
            >>> import torch
            >>> from vllm_lens import SteeringVector
            >>> from vllm_lens.client import LensClient
            >>> sv = SteeringVector(activations=torch.randn(1, 576), layer_indices=[10])
            >>> with LensClient(server) as client:
            ...     info = client.register_steering("doc-example", [sv])
            ...     try:
            ...         r = client.generate("Hi", max_tokens=2,
            ...                             steering_vectors=["preset:doc-example"])
            ...     finally:
            ...         removed = client.unregister_steering("doc-example")
            >>> info["name"], info["vectors"][0]["shape"], removed
            ('doc-example', [1, 576], True)
        """
        return self._drive(self._protocol.hooks_steps(
            "POST", "/v1/steering/register", _preset_body(name, vectors, model)))

    def unregister_steering(self, name: str) -> Any:
        """Remove the steering preset ``name`` (needs the operator's
        ``VLLM_LENS_ALLOW_STEERING_ROUTES=1``); a request still selecting it is then refused.

        Args:
            name: the preset's name.

        Returns:
            ``True``.

        Raises:
            LensHTTPError: no such preset (``status`` 400, ``param`` ``"name"``), or the
                operator did not open the routes (403).
            httpx.TransportError: no answer from the server.

        Examples:
            >>> from vllm_lens.client import LensClient, LensHTTPError
            >>> with LensClient(server) as client:
            ...     try:
            ...         client.unregister_steering("no-such-preset")
            ...     except LensHTTPError as exc:
            ...         print(exc.status, exc.param)
            400 name
        """
        return self._drive(self._protocol.hooks_steps("POST", "/v1/steering/unregister",
                                                      {"name": name}))

    def close(self) -> None:
        """Close the HTTP connections (also when the ``with`` block ends)."""
        self._http.close()

    def __enter__(self) -> LensClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self, path: str, kind: str, content: Any, stream: bool, options: dict) -> Any:
        self._drive(self._protocol.model_steps())
        body = self._protocol.body(kind, content, stream=stream, **options)
        if stream:
            return self._stream(path, body)
        return self._drive(self._protocol.call_steps(path, body))

    def _drive(self, steps: _Steps) -> Any:
        try:
            request = next(steps)
            while True:
                request = steps.send(self._http.send(request))
        except StopIteration as stop:
            return stop.value

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[LensResult]:
        state = _StreamState()
        response = self._http.send(self._protocol.request("POST", path, body), stream=True)
        try:
            if response.status_code != 200:
                response.read()
                _json_or_raise(response)
            for line in response.iter_lines():
                for result, payload in state.feed(line):
                    if payload is not None:
                        result.activations = self._drive(self._protocol.activations_steps(payload))
                    yield result
        finally:
            response.close()


class AsyncLensClient:
    """Asynchronous twin of `LensClient` (same methods, awaited).

    Each method is a coroutine taking the same arguments as the `LensClient` method of
    that name, returning the same and raising the same errors; ``generate`` and ``chat`` with
    ``stream=True`` return an async iterator. Use it as an async context manager (or await
    `aclose`).

    Args:
        base_url: as for `LensClient` (the server's address, without ``/v1``).
        model: as for `LensClient` (default: the server's first model).
        api_key: as for `LensClient` (sent as a bearer token).
        timeout: as for `LensClient` (seconds per connect, read or write; default
            600).

    Examples:
        >>> import asyncio
        >>> from vllm_lens.client import AsyncLensClient
        >>> async def main():
        ...     async with AsyncLensClient(server) as client:
        ...         one, two = await asyncio.gather(
        ...             client.generate("Hello", max_tokens=2, capture_layers=[0]),
        ...             client.chat([{"role": "user", "content": "Hi"}], max_tokens=2))
        ...         return one.activations["residual_stream"].shape[0], two.activations
        >>> asyncio.run(main())
        (1, None)
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None,
                 api_key: str | None = None, timeout: float = 600.0) -> None:
        self._protocol = _Protocol(base_url, model, api_key)
        self._http = httpx.AsyncClient(timeout=timeout)

    async def generate(self, prompt: str | list[int] | list[str], *, max_tokens: int = 16,
                       temperature: float = 0.0,
                       capture_layers: Sequence[int] | bool | None = None,
                       capture: Mapping[str, Any] | None = None, steering_vectors: Any = None,
                       hooks: Any = None, stream: bool = False, transport: str = "json",
                       **openai_kwargs: Any) -> Any:
        """See `LensClient.generate`; with ``stream=True`` an async iterator.


        Returns:
            The first choice's `LensResult` (every choice in its ``choices``), or with
            ``stream=True`` an async iterator of partial ones (the request is sent when
            iteration starts).

        Raises:
            ValueError: as for `LensClient.generate`.
            TypeError: as for `LensClient.generate`.
            LensHTTPError: as for `LensClient.generate`.
            httpx.TransportError: no answer from the server.
        """
        return await self._run("/v1/completions", "prompt", prompt, stream, dict(
            max_tokens=max_tokens, temperature=temperature, capture_layers=capture_layers,
            capture=capture, steering_vectors=steering_vectors, hooks=hooks,
            transport=transport, openai_kwargs=openai_kwargs))

    async def chat(self, messages: list[dict[str, Any]], *, max_tokens: int = 16,
                   temperature: float = 0.0,
                   capture_layers: Sequence[int] | bool | None = None,
                   capture: Mapping[str, Any] | None = None, steering_vectors: Any = None,
                   hooks: Any = None, stream: bool = False, transport: str = "json",
                   **openai_kwargs: Any) -> Any:
        """See `LensClient.chat`.


        Returns:
            As `LensClient.chat`; with ``stream=True`` an async iterator.

        Raises:
            ValueError: as for `LensClient.chat`.
            TypeError: as for `LensClient.chat`.
            LensHTTPError: as for `LensClient.chat`.
            httpx.TransportError: no answer from the server.
        """
        return await self._run("/v1/chat/completions", "messages", messages, stream, dict(
            max_tokens=max_tokens, temperature=temperature, capture_layers=capture_layers,
            capture=capture, steering_vectors=steering_vectors, hooks=hooks,
            transport=transport, openai_kwargs=openai_kwargs))

    async def served_model(self) -> str:
        """See `LensClient.served_model`.

        Returns:
            As `LensClient.served_model`.

        Raises:
            LensHTTPError: as for `LensClient.served_model`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.model_steps())

    async def fetch_activations(self, payload: Any) -> dict[str, torch.Tensor] | None:
        """See `LensClient.fetch_activations`.


        Returns:
            As `LensClient.fetch_activations`.

        Raises:
            ValueError: as for `LensClient.fetch_activations`.
            vllm_lens.WireError: as for `LensClient.fetch_activations`.
            LensHTTPError: as for `LensClient.fetch_activations`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.activations_steps(payload))

    # -- persistent hooks: see LensClient -------------------------------------------------------
    async def register_hooks(self, hooks: Sequence[Any],
                             prefetch_params: Sequence[str] | None = None) -> Any:
        """See `LensClient.register_hooks`.


        Returns:
            As `LensClient.register_hooks`.

        Raises:
            LensHTTPError: as for `LensClient.register_hooks`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.hooks_steps(
            "POST", "/v1/hooks/register", _register_body(hooks, prefetch_params)))

    async def collect_hook_results(self) -> dict[str, Any]:
        """See `LensClient.collect_hook_results`.

        Returns:
            As `LensClient.collect_hook_results`.

        Raises:
            LensHTTPError: as for `LensClient.collect_hook_results`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.hooks_steps("GET", "/v1/hooks/collect"))

    async def clear_hook_results(self) -> None:
        """See `LensClient.clear_hook_results`.

        Returns:
            ``None``.

        Raises:
            LensHTTPError: as for `LensClient.clear_hook_results`.
            httpx.TransportError: no answer from the server.
        """
        await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_results"))

    async def clear_hooks(self) -> None:
        """See `LensClient.clear_hooks`.

        Returns:
            ``None``.

        Raises:
            LensHTTPError: as for `LensClient.clear_hooks`.
            httpx.TransportError: no answer from the server.
        """
        await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear"))

    async def prefetch_params(self, names: Sequence[str]) -> dict[str, Any]:
        """See `LensClient.prefetch_params`.


        Returns:
            As `LensClient.prefetch_params`.

        Raises:
            LensHTTPError: as for `LensClient.prefetch_params`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/prefetch",
                                                            {"names": list(names)}))

    async def clear_prefetched(self) -> None:
        """See `LensClient.clear_prefetched`.

        Returns:
            ``None``.

        Raises:
            LensHTTPError: as for `LensClient.clear_prefetched`.
            httpx.TransportError: no answer from the server.
        """
        await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_prefetched"))

    async def patching_sweep(self, prompt: str | list[int], clean: Any, layers: Sequence[int],
                             positions: Sequence[int], metric: Mapping[str, Any],
                             corrupt: Any = None, point: str = "resid_post") -> dict[str, Any]:
        """See `LensClient.patching_sweep`.


        Returns:
            As `LensClient.patching_sweep`.

        Raises:
            LensHTTPError: as for `LensClient.patching_sweep`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.sweep_steps(
            _sweep_body(prompt, clean, layers, positions, metric, corrupt, point)))

    async def steering_presets(self) -> list[dict[str, Any]]:
        """See `LensClient.steering_presets`.

        Returns:
            As `LensClient.steering_presets`.

        Raises:
            LensHTTPError: as for `LensClient.steering_presets`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.presets_steps())

    async def saes(self) -> list[dict[str, Any]]:
        """See `LensClient.saes`.

        Returns:
            As `LensClient.saes`.

        Raises:
            LensHTTPError: as for `LensClient.saes`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.saes_steps())

    async def register_steering(self, name: str, vectors: Any, model: str | None = None) -> Any:
        """See `LensClient.register_steering`.


        Returns:
            As `LensClient.register_steering`.

        Raises:
            vllm_lens.WireError: as for `LensClient.register_steering`.
            LensHTTPError: as for `LensClient.register_steering`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.hooks_steps(
            "POST", "/v1/steering/register", _preset_body(name, vectors, model)))

    async def unregister_steering(self, name: str) -> Any:
        """See `LensClient.unregister_steering`.


        Returns:
            As `LensClient.unregister_steering`.

        Raises:
            LensHTTPError: as for `LensClient.unregister_steering`.
            httpx.TransportError: no answer from the server.
        """
        return await self._drive(self._protocol.hooks_steps("POST", "/v1/steering/unregister",
                                                            {"name": name}))

    async def aclose(self) -> None:
        """Close the HTTP connections (also when the ``async with`` block ends)."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncLensClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _run(self, path: str, kind: str, content: Any, stream: bool, options: dict) -> Any:
        await self._drive(self._protocol.model_steps())
        body = self._protocol.body(kind, content, stream=stream, **options)
        if stream:
            return self._stream(path, body)
        return await self._drive(self._protocol.call_steps(path, body))

    async def _drive(self, steps: _Steps) -> Any:
        try:
            request = next(steps)
            while True:
                request = steps.send(await self._http.send(request))
        except StopIteration as stop:
            return stop.value

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[LensResult]:
        state = _StreamState()
        response = await self._http.send(self._protocol.request("POST", path, body), stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
                _json_or_raise(response)
            async for line in response.aiter_lines():
                for result, payload in state.feed(line):
                    if payload is not None:
                        result.activations = await self._drive(
                            self._protocol.activations_steps(payload))
                    yield result
        finally:
            await response.aclose()


def _register_body(hooks: Sequence[Any], prefetch: Sequence[str] | None) -> dict[str, Any]:
    return {"hooks": [h if isinstance(h, Mapping) else hook_to_json(h) for h in hooks],
            "prefetch_params": list(prefetch) if prefetch else None}


def encode_xargs(extra_args: Mapping[str, Any]) -> dict[str, Any]:
    """``extra_args`` as offline users write them -> ``vllm_xargs`` values the server accepts.

    ``vllm_xargs`` carries only strings, numbers and flat lists of them: ``True`` becomes
    ``"true"``, dicts and nested lists become JSON strings, steering vectors (live objects,
    dicts or wire strings) a JSON list of their ``model_dump(mode="json")``.

    For a request sent with another HTTP client (the ``openai`` SDK's
    ``extra_body={"vllm_xargs": ...}``, plain httpx); ``LensClient`` calls it itself.

    Args:
        extra_args: lens keys and their values as ``SamplingParams.extra_args`` takes them
            (``"output_residual_stream": [3, 7]`` or ``True``, ``"output_activations":
            {...}``, ``"apply_steering_vectors": [SteeringVector, ...]``, ``"apply_hooks":
            [NamedHook, ...]`` ...). ``apply_steering_vectors`` also takes
            ``"preset:<name>"``, kept as it is; ``apply_hooks`` one hook or a list (a
            ``Hook`` is pickled with cloudpickle, a ``NamedHook`` sent as its JSON).

    Returns:
        A new dict with the same keys: flat lists of strings and numbers as lists, other
        lists and dicts as JSON strings, ``True`` as ``"true"``, anything else as it is.

    Raises:
        vllm_lens.WireError: a steering vector given as a wire string that does not decode
            (a ``ValueError``).

    Examples:
        >>> from vllm_lens.client import encode_xargs
        >>> encode_xargs({"output_residual_stream": True, "output_qk": [3, 7],
        ...               "output_activations": {"attn_out": [1]}})
        {'output_residual_stream': 'true', 'output_qk': [3, 7],
         'output_activations': '{"attn_out": [1]}'}
        >>> encode_xargs({"apply_steering_vectors": ["preset:calm"]})
        {'apply_steering_vectors': '["preset:calm"]'}
    """
    out: dict[str, Any] = {}
    for key, value in extra_args.items():
        if key == STEER_KEY:
            out[key] = _steering_json(value)
        elif key == MONITORS_KEY and not isinstance(value, str):  # a JSON string: as it is
            items = value if isinstance(value, (list, tuple)) else [value]
            out[key] = json.dumps([_monitor_json(m) for m in items])
        elif key == HOOKS_KEY:
            items = value if isinstance(value, (list, tuple)) else [value]
            out[key] = json.dumps([h if isinstance(h, Mapping) else hook_to_json(h)
                                   for h in items])
        elif value is True:
            out[key] = "true"
        elif isinstance(value, (Mapping, list, tuple)) and not _flat(value):
            out[key] = json.dumps(value)
        elif isinstance(value, (list, tuple)):
            out[key] = list(value)
        else:
            out[key] = value
    return out


def _monitor_json(monitor: Any) -> Any:
    """A monitor as JSON: a tensor or numpy probe as a JSON tensor record."""
    if not isinstance(monitor, Mapping) or "probe" not in monitor:
        return monitor
    probe = monitor["probe"]
    if hasattr(probe, "dtype") and not isinstance(probe, list):
        probe = wire.tensor_to_json(torch.as_tensor(probe).detach().float().cpu())
    return {**monitor, "probe": probe}


def _flat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value)


def _steering_json(vectors: Any) -> str:
    return json.dumps(_steering_items(vectors))


def _sweep_body(prompt: Any, clean: Any, layers: Sequence[int], positions: Sequence[int],
                metric: Mapping[str, Any], corrupt: Any, point: str) -> dict[str, Any]:
    return {"prompt": prompt, "clean": wire.tensor_to_json(torch.as_tensor(clean)),
            "layers": list(layers), "positions": list(positions), "metric": dict(metric),
            "corrupt": None if corrupt is None else _steering_items(corrupt), "point": point}


def _preset_body(name: str, vectors: Any, model: str | None) -> dict[str, Any]:
    return {"name": name, "vectors": _steering_items(vectors), "model": model}


def _steering_items(vectors: Any) -> list[Any]:
    """Steering vectors as JSON values (``"preset:<name>"`` kept as it is)."""
    from vllm_lens.steering import SteeringVector

    items = vectors if isinstance(vectors, (list, tuple)) else [vectors]
    dumped = []
    for item in items:
        if isinstance(item, str) and item.startswith(PRESET_PREFIX):
            dumped.append(item)
            continue
        if isinstance(item, str):
            item = SteeringVector.from_wire(item)
        if isinstance(item, SteeringVector):
            item = item.model_dump(mode="json")
        dumped.append(item)
    return dumped


def _choice_result(choice: dict[str, Any], data: dict[str, Any]) -> LensResult:
    message = choice.get("message") or {}
    text = choice.get("text")
    return LensResult(
        index=choice["index"],
        text=text if text is not None else message.get("content") or "",
        token_ids=list(choice.get("token_ids") or ()),
        finish_reason=choice.get("finish_reason"),
        activations=None,
        raw=data,
        prompt_token_ids=choice.get("prompt_token_ids") or data.get("prompt_token_ids"),
        hook_results=decode_json_tensors(choice.get("hook_results")),
        capture_receipt=choice.get("capture_receipt"),
        steering_gates=decode_json_tensors(choice.get("steering_gates")),
        sae_features=decode_sae_features(choice.get("sae_features")),
        monitors=choice.get("monitors"),
        stop_reason=choice.get("stop_reason"),
        logit_attribution=decode_json_tensors(choice.get("logit_attribution")),
    )



def _json_or_raise(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        data = {"error": {"message": response.text[:1000]}}
    if response.status_code >= 400 or (isinstance(data, dict) and "error" in data
                                       and "choices" not in data):
        _raise_error_body(data, response.status_code)
    return data


def _raise_error_body(data: Any, status: int) -> None:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        raise LensHTTPError(int(error.get("code") or status), str(error.get("message")),
                            error.get("param"))
    raise LensHTTPError(status, str(error or data))
