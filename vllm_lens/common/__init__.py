"""What every process of vllm-lens uses (runs in: any)."""
