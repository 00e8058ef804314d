"""Streaming over SSE with per-token rows vs streaming without them, side by side.

    python benchmarks/streaming.py [--concurrency 16] [--tokens 64] [--rounds 5]

Starts SmolLM2 behind vLLM's OpenAI server (the test harness's settings: float32, compiled)
and, per round, sends ``--concurrency`` streamed completions at once with the async client,
for each case in turn (order rotating between rounds): plain streaming; the residual stream of
one layer at every generated token streamed with its chunk (``stream_activations``, JSON
transport); the same layer captured but sent once at the end; and 30 layers streamed. The
throughput is generated tokens per second of wall time over the round's requests; a case's
ratio is to the plain streams of the same round. Also reports the chunks a stream received
(vLLM merges the outputs of a consumer that falls behind, so fewer than one per token means
chunks carried several tokens). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test harness's server

CASES = {
    "stream, no rows": {},
    "stream, 1 layer, rows with every chunk": {
        "capture": {"layers": [15], "positions": "generated"}, "stream_activations": True},
    "stream, 1 layer, rows at the end": {"capture": {"layers": [15], "positions": "generated"}},
    "stream, 30 layers, rows with every chunk": {
        "capture": {"layers": True, "positions": "generated"}, "stream_activations": True},
}


def _prompts(n: int) -> list[str]:
    return [f"Tell a short story about a lighthouse keeper (number {i})." for i in range(n)]


async def _round(base_url: str, options: dict, prompts: list[str], tokens: int
                 ) -> tuple[float, float]:
    """(generated tokens/s, mean chunks per stream)."""
    from vllm_lens.client import AsyncLensClient

    async def one(client: AsyncLensClient, prompt: str) -> tuple[int, int]:
        n = chunks = rows = 0
        async for part in await client.generate(prompt, max_tokens=tokens, ignore_eos=True,
                                                stream=True, **options):
            n = len(part.token_ids)
            chunks += 1
            if part.activations is not None:
                rows += part.activations["residual_stream"].shape[1]
        if options and rows != tokens - 1:
            raise SystemExit(f"expected {tokens - 1} generated rows, got {rows}")
        return n, chunks

    async with AsyncLensClient(base_url) as client:
        await client.served_model()
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p) for p in prompts))
        elapsed = time.perf_counter() - start
        return (sum(n for n, _ in counts) / elapsed,
                statistics.mean(chunks for _, chunks in counts))


def main() -> None:
    from tests.integration.server import running_server
    from vllm_lens.demo_models import smollm2_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16, help="streams at once")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the first warms up)")
    args = parser.parse_args()

    prompts = _prompts(args.concurrency)
    names = list(CASES)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    chunks: dict[str, list[float]] = {name: [] for name in names}
    with running_server(str(smollm2_dir())) as server:
        for r in range(args.rounds + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            got = {name: asyncio.run(_round(server.base_url, CASES[name], prompts, args.tokens))
                   for name in order}
            if r == 0:
                continue  # warm-up
            for name in names:
                speeds[name].append(got[name][0])
                ratios[name].append(got[name][0] / got[names[0]][0])
                chunks[name].append(got[name][1])
            print(f"round {r}: " + ", ".join(f"{n}: {got[n][0]:.0f} tok/s" for n in names),
                  file=sys.stderr, flush=True)

    print(f"\n{args.concurrency} concurrent streams x {args.tokens} tokens (ignore_eos), "
          f"SmolLM2-135M float32 compiled on the CPU behind the OpenAI server, {args.rounds} "
          "rounds\n")
    print("| case | tokens/s (median) | ratio to plain streaming (median) | lowest | highest "
          "| chunks per stream (mean) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {statistics.median(speeds[name]):.0f} | "
              f"{statistics.median(ratios[name]):.3f} | {min(ratios[name]):.3f} | "
              f"{max(ratios[name]):.3f} | {statistics.mean(chunks[name]):.1f} |")


if __name__ == "__main__":
    main()
