"""What vllm-lens installs inside vLLM's engine-core process (runs in: engine core).
"""
