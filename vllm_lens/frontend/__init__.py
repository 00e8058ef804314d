"""Front-end half of vllm-lens (runs in: front end).

The process that owns ``LLM`` / ``AsyncLLM`` or the OpenAI server."""
