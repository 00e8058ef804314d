"""The HTTP layer of the front end: vLLM's OpenAI server with lens support, and vllm-lens's own
routes (runs in: front end)."""
