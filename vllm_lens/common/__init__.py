"""What every process of vllm-lens shares: tap points, position selectors, the tensor codec, the
worker -> front end hand-off, test-only faults and idempotent method wrapping (runs in: any).
"""
