"""Environment variables read by vllm-lens (runs in: every process).

- ``VLLM_LENS_DISABLE``: ``1`` makes the plugin a complete no-op (nothing is patched or tapped).
- ``VLLM_LENS_WORKER_MAX_BYTES``: budget of captured rows waiting on each worker for the front
  end to fetch them (default 4 GiB); past it, the oldest unfetched finished requests are dropped.
- ``VLLM_LENS_FINISHED_TTL_S``: seconds a finished request's rows wait for their fetch before
  the worker drops them (default 600): covers aborted requests and front ends that went away.
"""

from __future__ import annotations

import os

__all__ = ["disabled", "finished_ttl_s", "worker_max_bytes"]


def disabled() -> bool:
    return os.environ.get("VLLM_LENS_DISABLE", "0").strip().lower() in ("1", "true", "yes", "on")


def worker_max_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_WORKER_MAX_BYTES", str(4 << 30)))


def finished_ttl_s() -> float:
    return float(os.environ.get("VLLM_LENS_FINISHED_TTL_S", "600"))
