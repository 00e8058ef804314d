"""vLLM general-plugin entry point (runs in: front end, engine core, worker).

vLLM loads it in each of its processes, possibly several times per process.

``register`` installs the pieces and nothing else; each piece is idempotent:

- front end: engine config gets the worker extension (``frontend.engine_args``); ``LLMEngine``
  and ``AsyncLLM`` validate lens requests and collate activations (``frontend.offline``,
  ``frontend.async_engine``); steered and hooked requests get a prefix-cache salt
  (``frontend.prefix_cache``); ``LLM`` and ``AsyncLLM`` get the persistent-hook and
  steering-preset methods, ``register_sae`` / ``registered_saes`` and ``patching_sweep``
  (``frontend.persistent_hooks``, ``frontend.presets``, ``frontend.sae_names``,
  ``frontend.patching_sweep``); in a process that builds vLLM's OpenAI server,
  the server's completions and chat endpoints return activations, and the ``/v1/lens/*``,
  ``/v1/hooks/*`` and ``/v1/steering*`` routes are added (``frontend.http``,
  ``frontend.patching_sweep``);
- engine core: blocks of generated tokens under decode-only steering get their own hash
  (``frontend.prefix_cache``); the front end's once-per-step worker calls get a method that
  does not hold up the next step (``engine_core.pipelined_rpc``);
- worker: every model vLLM constructs gets taps on its decoder layers (``worker.taps``), by
  wrapping the class vLLM's model loader resolves for the architecture; vLLM's PyTorch LoRA
  ops (the CPU build's) leave tokens of requests without an adapter alone, as its Triton
  kernels do (``common.lora_guard``; this is the one change to plain traffic: without it such
  a token runs with the adapter in the last LoRA slot).

``VLLM_LENS_DISABLE=1`` makes it a complete no-op.
"""

from __future__ import annotations

import sys

from vllm_lens import envs

__all__ = ["register"]


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (see pyproject.toml)."""
    if envs.disabled():
        return
    from vllm_lens.engine_core import pipelined_rpc
    from vllm_lens.frontend import (
        async_engine,
        collator,
        engine_args,
        offline,
        patching_sweep,
        persistent_hooks,
        prefix_cache,
        presets,
        sae_names,
    )
    from vllm_lens.common import lora_guard
    from vllm_lens.worker import taps

    engine_args.install()
    collator.install_output_fields()
    offline.install()
    async_engine.install()
    prefix_cache.install()
    pipelined_rpc.install()
    persistent_hooks.install()
    presets.install()
    sae_names.install()
    patching_sweep.install()
    taps.install_model_hook()
    lora_guard.install()
    # The API server imports its app builder before it creates the engine (which loads the
    # plugins); other processes never pay for importing the server stack.
    if "vllm.entrypoints.launchers.app" in sys.modules:
        from vllm_lens.frontend.http import install as http_install

        http_install.install()
