"""Time vllm-lens' own code inside a benchmark's engine process (runs in: a benchmark's child
process, where the engine runs in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

The share of a run's wall time spent in the plugin (the tap handler, the worker's fetch,
validation and collation in the front end) is its cost measured in the same run, far less
noisy on a shared machine than a ratio of two runs.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["time_plugin_code"]


def time_plugin_code(extra: tuple[tuple[type, str], ...] = ()) -> dict[str, float]:
    """Wrap vllm-lens' entry points (and ``extra`` (class, method) pairs) with timers; returns
    the running totals by method name, which the caller may reset."""
    from vllm_lens.frontend.collate import LensSession
    from vllm_lens.worker.extension import LensWorkerExtension
    from vllm_lens.worker.runtime import LensRuntime

    spent: dict[str, float] = {}

    def timed(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

        setattr(cls, name, wrapper)

    for cls, name in ((LensRuntime, "on_tap"), (LensWorkerExtension, "lens_fetch"),
                      (LensSession, "prepare"), (LensSession, "attach"), *extra):
        timed(cls, name)
    return spent
