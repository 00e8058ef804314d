"""HTTP clients for a vLLM OpenAI server with vllm-lens: ``LensClient`` and ``AsyncLensClient``
(runs in: the user's process; needs httpx, not vLLM).

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

from vllm_lens import wire
from vllm_lens.activations import (
    FETCH_PATH,
    decode_activation_bytes,
    decode_activations,
    decode_json_tensors,
    is_binary_descriptor,
    valid_handle,
)
from vllm_lens.errors import LensError
from vllm_lens.hooks import hook_to_json
from vllm_lens.spec import (
    ACTIVATIONS_KEY,
    CAPTURE_KEY,
    HOOKS_KEY,
    PRESET_PREFIX,
    QK_KEY,
    SAE_KEY,
    SINK_KEY,
    STEER_KEY,
    STREAM_KEY,
    TRANSPORT_KEY,
)

__all__ = ["AsyncLensClient", "LensClient", "LensHTTPError", "LensResult", "encode_xargs"]

#: One protocol step: send the request, get the response back; the return value is the result.
_Steps = Generator[httpx.Request, httpx.Response, Any]


class LensHTTPError(LensError):
    """The server answered with an error (bad lens input is status 400, ``param`` its field)."""

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
    sae_features: list[dict[str, Any]] | None = None
    """For requests with ``sae_features=``: per SAE asked for, ``{"sae", "layer", "point",
    "positions", "indices", "values"}`` (and ``"nmse"``, ``"l0"`` with reconstruction), on
    the last result of each choice or, with ``stream_activations=True``, like
    ``activations``: the positions computed since the previous result
    (``vllm_lens.saes.to_sparse`` makes a sparse tensor)."""
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
        if transport not in ("json", "binary"):
            raise ValueError(f"transport must be 'json' or 'binary', got {transport!r}")
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
        for key in (ACTIVATIONS_KEY, QK_KEY, SINK_KEY, STREAM_KEY, SAE_KEY):  # by name
            if openai_kwargs.get(key) is not None:
                lens[key] = openai_kwargs.pop(key)
        if openai_kwargs.get("sae_features") is not None:
            lens[SAE_KEY] = openai_kwargs.pop("sae_features")
        if steering_vectors is not None:
            lens[STEER_KEY] = steering_vectors
        if hooks is not None:
            lens[HOOKS_KEY] = hooks
        if transport == "binary":
            lens[TRANSPORT_KEY] = "binary"
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
        return {**result, "grid": torch.tensor(result["grid"], dtype=torch.float64)}

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
                sae_features=decode_json_tensors(choice.get("sae_features")),
            )
            self.by_index[index] = result
            out.append((result, choice.get("activations")))
        return out


class LensClient:
    """Synchronous client (httpx) for a lens-enabled vLLM OpenAI server.

    >>> client = LensClient("http://127.0.0.1:8000")            # doctest: +SKIP
    >>> r = client.generate("The capital of France is", max_tokens=5, capture_layers=[3, 7])
    ... # doctest: +SKIP
    >>> r.text, r.activations["residual_stream"].shape          # doctest: +SKIP
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
        ``stream_activations=`` and ``sae_features=`` (``output_sae_features``: SAEs the
        server registered, by name) are sent as those lens keys; other ``openai_kwargs`` go into
        the request body (``n``, ``seed``, ...)."""
        return self._run("/v1/completions", "prompt", prompt, stream, dict(
            max_tokens=max_tokens, temperature=temperature, capture_layers=capture_layers,
            capture=capture, steering_vectors=steering_vectors, hooks=hooks,
            transport=transport, openai_kwargs=openai_kwargs))

    def chat(self, messages: list[dict[str, Any]], *, max_tokens: int = 16,
             temperature: float = 0.0, capture_layers: Sequence[int] | bool | None = None,
             capture: Mapping[str, Any] | None = None, steering_vectors: Any = None,
             hooks: Any = None, stream: bool = False, transport: str = "json",
             **openai_kwargs: Any) -> Any:
        """``/v1/chat/completions``; arguments and result as for :meth:`generate`."""
        return self._run("/v1/chat/completions", "messages", messages, stream, dict(
            max_tokens=max_tokens, temperature=temperature, capture_layers=capture_layers,
            capture=capture, steering_vectors=steering_vectors, hooks=hooks,
            transport=transport, openai_kwargs=openai_kwargs))

    def served_model(self) -> str:
        """The model requests go to: the one given, else the server's first."""
        return self._drive(self._protocol.model_steps())

    def fetch_activations(self, payload: Any) -> dict[str, torch.Tensor] | None:
        """Decode one choice's ``activations`` from any response (e.g. one the ``openai`` SDK
        returned): JSON tensors are decoded; a binary handle is fetched, then deleted."""
        return self._drive(self._protocol.activations_steps(payload))

    # -- persistent hooks (``/v1/hooks/*``) ------------------------------------------------------
    def register_hooks(self, hooks: Sequence[Any], prefetch_params: Sequence[str] | None = None
                       ) -> Any:
        """Run ``hooks`` (``NamedHook`` objects, or ``Hook`` objects where the server opted
        in to pickled code) on every request until :meth:`clear_hooks`."""
        return self._drive(self._protocol.hooks_steps(
            "POST", "/v1/hooks/register", _register_body(hooks, prefetch_params)))

    def collect_hook_results(self) -> dict[str, Any]:
        """``{request id: {"0": saved, ...}}`` of the persistent hooks (non-destructive)."""
        return self._drive(self._protocol.hooks_steps("GET", "/v1/hooks/collect"))

    def clear_hook_results(self) -> None:
        """Drop the persistent hooks' results kept so far (the hooks stay registered)."""
        self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_results"))

    def clear_hooks(self) -> None:
        """Unregister every persistent hook (results kept so far stay until
        :meth:`clear_hook_results`)."""
        self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear"))

    def prefetch_params(self, names: Sequence[str]) -> dict[str, Any]:
        """Make these parameters available to hooks on every pipeline stage; returns shapes."""
        return self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/prefetch",
                                                      {"names": list(names)}))

    def clear_prefetched(self) -> None:
        """Drop the parameters :meth:`prefetch_params` made available to hooks."""
        self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_prefetched"))

    def patching_sweep(self, prompt: str | list[int], clean: Any, layers: Sequence[int],
                       positions: Sequence[int], metric: Mapping[str, Any], corrupt: Any = None,
                       point: str = "resid_post") -> dict[str, Any]:
        """An activation-patching sweep on the server (``frontend.patching``): the metric
        per (layer, position) cell as ``grid`` [len(layers), len(positions)]."""
        return self._drive(self._protocol.sweep_steps(
            _sweep_body(prompt, clean, layers, positions, metric, corrupt, point)))

    def steering_presets(self) -> list[dict[str, Any]]:
        """The server's named steering presets (select one with ``"preset:<name>"`` in
        ``steering_vectors``)."""
        return self._drive(self._protocol.presets_steps())

    def saes(self) -> list[dict[str, Any]]:
        """The SAEs the server serves by name (``sae_features={"sae": name, ...}``): name,
        layout, architecture, hook point, ``d_in``, ``d_sae``."""
        return self._drive(self._protocol.saes_steps())

    def register_steering(self, name: str, vectors: Any, model: str | None = None) -> Any:
        """Register a preset (needs the operator's ``VLLM_LENS_ALLOW_STEERING_ROUTES=1``)."""
        return self._drive(self._protocol.hooks_steps(
            "POST", "/v1/steering/register", _preset_body(name, vectors, model)))

    def unregister_steering(self, name: str) -> Any:
        """Remove the steering preset ``name`` (needs the operator's
        ``VLLM_LENS_ALLOW_STEERING_ROUTES=1``); a request still selecting it is then refused.

        Raises:
            LensHTTPError: no such preset (``status`` 400, ``param`` ``"name"``), or the
                operator did not open the routes (403)."""
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
    """Asynchronous twin of :class:`LensClient` (same methods, awaited)."""

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
        """See :meth:`LensClient.generate`; with ``stream=True`` an async iterator."""
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
        """See :meth:`LensClient.chat`."""
        return await self._run("/v1/chat/completions", "messages", messages, stream, dict(
            max_tokens=max_tokens, temperature=temperature, capture_layers=capture_layers,
            capture=capture, steering_vectors=steering_vectors, hooks=hooks,
            transport=transport, openai_kwargs=openai_kwargs))

    async def served_model(self) -> str:
        """See :meth:`LensClient.served_model`."""
        return await self._drive(self._protocol.model_steps())

    async def fetch_activations(self, payload: Any) -> dict[str, torch.Tensor] | None:
        """See :meth:`LensClient.fetch_activations`."""
        return await self._drive(self._protocol.activations_steps(payload))

    # -- persistent hooks: see LensClient -------------------------------------------------------
    async def register_hooks(self, hooks: Sequence[Any],
                             prefetch_params: Sequence[str] | None = None) -> Any:
        """See :meth:`LensClient.register_hooks`."""
        return await self._drive(self._protocol.hooks_steps(
            "POST", "/v1/hooks/register", _register_body(hooks, prefetch_params)))

    async def collect_hook_results(self) -> dict[str, Any]:
        """See :meth:`LensClient.collect_hook_results`."""
        return await self._drive(self._protocol.hooks_steps("GET", "/v1/hooks/collect"))

    async def clear_hook_results(self) -> None:
        """See :meth:`LensClient.clear_hook_results`."""
        await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_results"))

    async def clear_hooks(self) -> None:
        """See :meth:`LensClient.clear_hooks`."""
        await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear"))

    async def prefetch_params(self, names: Sequence[str]) -> dict[str, Any]:
        """See :meth:`LensClient.prefetch_params`."""
        return await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/prefetch",
                                                            {"names": list(names)}))

    async def clear_prefetched(self) -> None:
        """See :meth:`LensClient.clear_prefetched`."""
        await self._drive(self._protocol.hooks_steps("POST", "/v1/hooks/clear_prefetched"))

    async def patching_sweep(self, prompt: str | list[int], clean: Any, layers: Sequence[int],
                             positions: Sequence[int], metric: Mapping[str, Any],
                             corrupt: Any = None, point: str = "resid_post") -> dict[str, Any]:
        """See :meth:`LensClient.patching_sweep`."""
        return await self._drive(self._protocol.sweep_steps(
            _sweep_body(prompt, clean, layers, positions, metric, corrupt, point)))

    async def steering_presets(self) -> list[dict[str, Any]]:
        """See :meth:`LensClient.steering_presets`."""
        return await self._drive(self._protocol.presets_steps())

    async def saes(self) -> list[dict[str, Any]]:
        """See :meth:`LensClient.saes`."""
        return await self._drive(self._protocol.saes_steps())

    async def register_steering(self, name: str, vectors: Any, model: str | None = None) -> Any:
        """See :meth:`LensClient.register_steering`."""
        return await self._drive(self._protocol.hooks_steps(
            "POST", "/v1/steering/register", _preset_body(name, vectors, model)))

    async def unregister_steering(self, name: str) -> Any:
        """See :meth:`LensClient.unregister_steering`."""
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
    """
    out: dict[str, Any] = {}
    for key, value in extra_args.items():
        if key == STEER_KEY:
            out[key] = _steering_json(value)
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
        sae_features=decode_json_tensors(choice.get("sae_features")),
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
