"""Worker-side half of vllm-lens (runs in: every worker process, one per TP/PP rank)."""
