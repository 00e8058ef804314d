"""Wiring vllm-lens into vLLM's OpenAI server: its serving classes, app builder and launchers
are wrapped once (runs in: front end).

``install`` is called by ``vllm_lens.plugin`` in a process that builds the API server. It
wraps the completions and chat endpoints (``endpoints``), refuses lens keys on routes that
would drop their results, adds vllm-lens's own routers when vLLM registers its routes (the
lens page's only with ``VLLM_LENS_PAGE=1``), and
checks ``VLLM_LENS_SAES`` before the engine starts.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.logger import init_logger

from vllm_lens import envs
from vllm_lens.common.wrapping import wrap_attribute
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.async_engine import OFF_ROUTE
from vllm_lens.frontend.http import (
    routes_blobs,
    routes_hooks,
    routes_page,
    routes_patching,
    routes_stats,
    routes_steering,
    shared_dir,
)
from vllm_lens.frontend.http.endpoints import wrap_endpoint
from vllm_lens.frontend.http.errors import error_response
from vllm_lens.frontend.http.streaming import CHAT, COMPLETIONS
from vllm_lens.frontend.sae_names import check_sae_file, register_sae_file
from vllm_lens.sinks.config import mark_http_process
from vllm_lens.spec import asks_for_work

__all__ = ["install"]

logger = init_logger(__name__)


def install() -> None:
    from vllm.entrypoints.cli import serve as serve_module
    from vllm.entrypoints.launchers import app as app_module
    from vllm.entrypoints.launchers.api_server import entry as entry_module
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    wrap_attribute(OpenAIServingCompletion, "create_completion", wrap_endpoint(COMPLETIONS))
    wrap_attribute(OpenAIServingChat, "create_chat_completion", wrap_endpoint(CHAT))
    # Routes that take vllm_xargs but would drop what lens keys return: refused up front
    # (400 naming the key). Any other route is refused by the engine wrapper (async_engine).
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    wrap_attribute(OpenAIServingResponses, "create_responses", _refuse_lens_keys)
    wrap_attribute(AnthropicServingMessages, "create_messages", _refuse_lens_keys)
    wrap_attribute(app_module, "register_api_routers", _wrap_register_api_routers)
    wrap_attribute(entry_module, "build_async_engine_client", _wrap_build_engine_client)
    wrap_attribute(entry_module, "init_app_state", _wrap_init_app_state)
    wrap_attribute(serve_module, "run_multi_api_server", _wrap_run_multi_api_server)
    serve_command = sys.modules.get("vllm.entrypoints.cli.serve")
    if serve_command is not None:  # ``vllm serve`` / ``vllm-lens serve``: all its launchers
        wrap_attribute(serve_command.ServeSubcommand, "validate", _wrap_validate)


def _wrap_register_api_routers(original):
    def register_api_routers(args: Any, app: Any, *rest: Any, **kwargs: Any) -> None:
        mark_http_process()  # sinks not open to clients are refused on completions and chat
        original(args, app, *rest, **kwargs)
        app.include_router(routes_blobs.router)
        app.include_router(routes_stats.router)
        app.include_router(routes_hooks.router)
        app.include_router(routes_steering.router)
        app.include_router(routes_patching.router)
        if envs.lens_page():
            app.include_router(routes_page.router)
            logger.info("vllm-lens: the lens page is served at /lens (VLLM_LENS_PAGE=1; it has "
                        "no authentication of its own)")

    return register_api_routers


# Before the engine starts, a VLLM_LENS_SAES file that cannot be read, or an entry of the
# wrong shape, stops the server in seconds instead of after the model loaded: when the serve
# command checks its flags, and (one API process: ``python -m
# vllm.entrypoints.openai.api_server``) before the API process builds its engine. What needs
# the workers (each SAE against the model) is checked in init_app_state.
def _wrap_validate(original):
    def validate(self: Any, args: Any) -> None:
        original(self, args)
        check_sae_file()

    return validate


def _wrap_build_engine_client(original):
    def build_async_engine_client(*args: Any, **kwargs: Any) -> Any:
        check_sae_file()
        return original(*args, **kwargs)

    return build_async_engine_client


def _wrap_run_multi_api_server(original):
    def run_multi_api_server(args: Any, *rest: Any, **kwargs: Any) -> Any:
        # The API processes it starts share one directory (``http.shared_dir``).
        shared_dir.create()
        return original(args, *rest, **kwargs)

    return run_multi_api_server


def _wrap_init_app_state(original):
    async def init_app_state(engine_client: Any, state: Any, args: Any, *rest: Any,
                             **kwargs: Any) -> None:
        shared_dir.for_api_process(getattr(args, "api_server_count", None))
        await original(engine_client, state, args, *rest, **kwargs)
        names = await register_sae_file(engine_client)
        if names:
            logger.info("vllm-lens: serving SAEs %s", ", ".join(names))
        # Before serving, and after the SAEs: a preset may steer by their features.
        await routes_steering.register_preset_file(
            engine_client, getattr(args, "api_server_count", None))

    return init_app_state


def _refuse_lens_keys(original):
    async def serve(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        key = asks_for_work(getattr(request, "vllm_xargs", None))
        if key is not None:
            return error_response(LensRequestError(key, OFF_ROUTE))
        return await original(self, request, *args, **kwargs)

    return serve
