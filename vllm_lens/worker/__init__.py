"""Worker-side half of vllm-lens (runs in: worker).

Every worker process, one per TP/PP rank."""
