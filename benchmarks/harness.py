"""What the side-by-side benchmarks share (runs in: a benchmark's parent process, which
drives ``ChildEngine`` s, and its child processes, which run one engine each in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

``time_plugin_code`` times vllm-lens' own code in a child: the share of a run's wall time
spent in the plugin (the tap handler, the worker's fetch, validation and collation in the
front end) is its cost measured in the same run, far less noisy on a shared machine than a
ratio of two runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

__all__ = ["ChildEngine", "time_plugin_code"]


class ChildEngine:
    """A child process running ``script --child CFG`` (one engine, plain when ``disabled``),
    which prints ``READY`` once started and answers each line sent to it with a line
    ``RESULT ...``."""

    def __init__(self, script: str, cfg: dict, disabled: bool,
                 env: dict[str, str] | None = None) -> None:
        # In-process engines: vLLM's engine-core busy loop would otherwise compete with the
        # model for the cores. ``env``: more variables (``PYTHONPATH`` of another vllm-lens).
        env = {**os.environ, "VLLM_LENS_DISABLE": "1" if disabled else "0",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, script, "--child", json.dumps({**cfg, "disabled": disabled})],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("READY")

    def ask(self, line: str) -> str:
        """Send one command; returns its ``RESULT`` line's text."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._expect("RESULT ")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        sys.exit(f"benchmark engine exited with {self.proc.wait()} (see its stderr above)")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def time_plugin_code(extra: tuple[tuple[Any, str], ...] = ()) -> dict[str, float]:
    """Wrap vllm-lens' entry points (and ``extra`` (class or module, name) pairs) with timers;
    returns the running totals by name, which the caller may reset."""
    from vllm_lens.frontend import collator
    from vllm_lens.frontend.session import LensSession
    from vllm_lens.worker.extension import LensWorkerExtension
    from vllm_lens.worker.tap_handler import LensRuntime

    spent: dict[str, float] = {}

    def timed(cls: Any, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

        setattr(cls, name, wrapper)

    for cls, name in ((LensRuntime, "on_tap"), (LensRuntime, "on_attention"),
                      (LensRuntime, "before_sample"),
                      (LensWorkerExtension, "lens_fetch"), (LensSession, "prepare"),
                      (collator, "attach"), *extra):
        timed(cls, name)
    return spent
