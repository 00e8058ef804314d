"""Inspect AI model provider ``vllm-lens``: Inspect's vLLM provider plus per-call lens requests.

Installing the project registers it (entry point group ``inspect_ai``), so
``inspect eval task.py --model vllm-lens/<model>`` and ``get_model("vllm-lens/<model>")`` work
with no import. See ``inspect_provider.provider.VLLMLensAPI``.
"""

from inspect_provider.provider import VLLMLensAPI

__all__ = ["VLLMLensAPI"]
