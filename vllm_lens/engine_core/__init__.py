"""What vllm-lens installs inside vLLM's engine-core process.

Runs in: engine core.
"""
