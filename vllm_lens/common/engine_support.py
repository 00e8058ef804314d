"""Which engine configurations vllm-lens serves lens requests on (runs in: any).

The front end asks when it builds an engine's config (``frontend.engine_args``: engines that
refuse lens requests keep vLLM's CUDA-graph settings), and every worker when the front end
first describes it (``worker.runner.unsupported_reason`` adds what only the runner shows).
Each refusal names the setting to change; plain requests are served either way.
"""

from __future__ import annotations

from typing import Any

from vllm_lens.common import lora_guard

__all__ = ["NGRAM_METHODS", "config_unsupported_reason"]

#: Speculative methods whose draft tokens are proposed without running the target's layers
#: under another forward context; capture and steering are tested with n-gram drafts.
NGRAM_METHODS = ("ngram",)


def config_unsupported_reason(vllm_config: Any) -> str | None:
    """The configuration part of ``unsupported_reason`` (no runner needed), after what this
    vLLM lacks of what vllm-lens needs from it (``common.vllm_api``, checked once a process)."""
    from vllm_lens.common.vllm_api import unsupported_reason as missing_from_vllm

    if (missing := missing_from_vllm()) is not None:
        return missing
    scheduler = vllm_config.scheduler_config
    if getattr(scheduler, "async_scheduling", False):
        return ("async scheduling is on (async_scheduling=True / --async-scheduling); "
                "vllm-lens needs synchronous scheduling: leave the setting unset (vllm-lens "
                "then turns it off) or pass --no-async-scheduling")
    model_config = vllm_config.model_config
    if getattr(model_config, "runner_type", "generate") != "generate":
        return (f"runner type {model_config.runner_type!r} (pooling models) is not supported; "
                "vllm-lens serves generative models")
    if getattr(model_config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    parallel = vllm_config.parallel_config
    if getattr(parallel, "use_ubatching", False):
        return ("micro-batching (enable_dbo / --enable-dbo, ubatch_size) is not supported; "
                "turn it off to use vllm-lens")
    if getattr(vllm_config, "lora_config", None) is not None:
        if lora_guard.needs_guard() and not lora_guard.guarded():
            return ("LoRA (enable_lora / --enable-lora) on a platform that runs vLLM's PyTorch "
                    "LoRA ops, which vllm-lens could not guard in this vLLM (see "
                    "vllm_lens.common.lora_guard): a request without an adapter could run "
                    "with another request's adapter; disable LoRA to use vllm-lens")
    speculative = vllm_config.speculative_config
    if speculative is not None and speculative.method not in NGRAM_METHODS:
        return (f"speculative decoding with method {speculative.method!r} is not supported "
                f"(supported: {', '.join(NGRAM_METHODS)}); remove speculative_config")
    return None
