"""Front-end half of vllm-lens (runs in: the process that owns ``LLM`` / ``AsyncLLM``)."""
