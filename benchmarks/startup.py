"""Engine start-up with and without vllm-lens, side by side (runs in: this script's process,
which starts each engine in a child process of its own).

Each round starts the same engine twice, once with the plugin and once without
(``VLLM_LENS_DISABLE=1``: vLLM loads the plugin's entry point, which then registers nothing),
in alternating order, every start a fresh interpreter. A warm-up start of each kind first
puts vLLM's compile cache (and the OS's file cache) in the same state for both. Each child
reports two times: importing vLLM and constructing ``LLM(...)`` (weights, profiling, KV cache,
compile or cache load, vllm-lens' workers set up); the parent also times the whole process
(interpreter start to engine shut down)::

    python benchmarks/startup.py [--model PATH] [--rounds 5] [--eager]

The plugin's share is the median of the per-round differences divided by the median start
without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CHILD = r"""
import json, sys, time
t0 = time.monotonic()
from vllm import LLM
t1 = time.monotonic()
llm = LLM(**json.loads(sys.argv[1]))
t2 = time.monotonic()
print("TIMES " + json.dumps({"import": t1 - t0, "engine": t2 - t1}), flush=True)
llm.llm_engine.engine_core.shutdown()
"""


def start_once(engine: dict, disabled: bool) -> dict[str, float]:
    env = {**os.environ, "VLLM_LENS_DISABLE": "1" if disabled else "0"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(engine)], env=env,
                          capture_output=True, text=True, timeout=900)
    total = time.monotonic() - began
    line = next((x for x in done.stdout.splitlines() if x.startswith("TIMES ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"engine start failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(line[len("TIMES "):]), "process": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no compile)")
    args = parser.parse_args()
    if args.model is None:
        from vllm_lens.demo_models import smollm2_dir

        args.model = str(smollm2_dir())
    engine = {"model": args.model, "dtype": "float32", "max_model_len": 512,
              "kv_cache_memory_bytes": 256 << 20, "enforce_eager": args.eager}
    for disabled in (False, True):  # warm-up: the same cache state for both
        start_once(engine, disabled)
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(args.rounds):
        for disabled in ((False, True) if i % 2 == 0 else (True, False)):
            runs[disabled].append(start_once(engine, disabled))
            print(f"round {i + 1} {'without' if disabled else 'with'} the plugin: "
                  f"{runs[disabled][-1]}", file=sys.stderr)
    print(f"{args.rounds} rounds, model {os.path.basename(args.model)}, "
          f"{'eager' if args.eager else 'compiled'}\n")
    print("| time (s, median) | without vllm-lens | with vllm-lens | difference (median of "
          "rounds) | share |")
    print("|---|---:|---:|---:|---:|")
    for part in ("import", "engine", "process"):
        without = statistics.median(r[part] for r in runs[True])
        with_ = statistics.median(r[part] for r in runs[False])
        diff = statistics.median(a[part] - b[part] for a, b in zip(runs[False], runs[True]))
        print(f"| {part} | {without:.2f} | {with_:.2f} | {diff:+.2f} | "
              f"{100 * diff / without:+.1f}% |")


if __name__ == "__main__":
    main()
