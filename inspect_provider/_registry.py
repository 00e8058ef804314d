"""Registers the ``vllm-lens`` model API with Inspect (loaded through the ``inspect_ai`` entry
point group). Importing the provider itself is deferred until a ``vllm-lens/...`` model is
requested, as Inspect's own providers do."""

from inspect_ai.model import modelapi


@modelapi(name="vllm-lens")
def vllm_lens():  # noqa: ANN201 - Inspect's registry decorator wants the class factory
    from inspect_provider.provider import VLLMLensAPI

    return VLLMLensAPI
