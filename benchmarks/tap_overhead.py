"""What a tap costs plain traffic: per-call time of ``vllm_lens::tap`` with nothing to do.

    python benchmarks/tap_overhead.py [--calls 200000]

The throughput benchmark compares whole engines, so on a shared machine its plain-traffic ratio
carries run-to-run noise of several percent. This measures the one thing the plugin adds to a
step without lens requests — six tap calls per Llama-style decoder layer
(``vllm_lens::pre_tap`` at its input, ``attn_in_tap`` at attention's input, ``mid_tap`` between
attention and MLP, ``mlp_in_tap`` at the MLP's input, ``act_tap`` after the MLP's activation,
``vllm_lens::tap`` at its output;
GPT-2-style layers add two, an MoE router one; all are registered the same way and cost the same; the
attention wrappers are not installed while no step reads Q/K) — and prints it next to the duration of a decode step (``--step-ms``: pass the one throughput.py
implies on your machine, e.g. 64 tokens / (tokens/s) for the 64-request case, or
1 / (tokens/s) for batch 1).
"""

from __future__ import annotations

import argparse
import time

import torch

from vllm_lens.worker import taps


def per_call_us(hidden: torch.Tensor, residual: torch.Tensor, calls: int) -> float:
    op = torch.ops.vllm_lens.tap
    for _ in range(1000):
        op(hidden, residual, 3)
    start = time.perf_counter()
    for _ in range(calls):
        op(hidden, residual, 3)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--step-ms", type=float, default=213.0,
                        help="duration of the decode step to compare with (default: 64 "
                             "requests at 300 tokens/s)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--taps", type=int, default=6,
                        help="tap calls per layer (default 6: a Llama-style layer)")
    args = parser.parse_args()

    hidden, residual = torch.randn(64, 576), torch.randn(64, 576)
    taps.set_tap_handler(None)
    idle = per_call_us(hidden, residual, args.calls)
    # A handler that returns at once, like the runtime's with an empty plan.
    taps.set_tap_handler(lambda h, r, layer, site: None)
    attached = per_call_us(hidden, residual, args.calls)
    taps.set_tap_handler(None)
    n_taps = args.taps
    for name, us in (("no handler (before any lens request)", idle),
                     ("handler attached, nothing to do", attached)):
        per_step_ms = n_taps * us * args.layers / 1000
        print(f"{name}: {us:.2f} us/call -> {per_step_ms:.3f} ms/step over {args.layers} "
              f"layers x {n_taps} taps = {per_step_ms / args.step_ms:.3%} of a "
              f"{args.step_ms:.0f} ms decode step")


if __name__ == "__main__":
    main()
