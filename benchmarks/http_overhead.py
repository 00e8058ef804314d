"""Cost of returning activations over HTTP: time and bytes per response, JSON vs binary.

    python benchmarks/http_overhead.py [--repeats 10] [--tokens 16]

Starts SmolLM2 behind vLLM's OpenAI server (the test harness's settings: float32, compiled),
then sends one request at a time: a plain request, and captures of 1 layer and of all 30 layers
(every position) with the json and the binary transport, through ``LensClient`` (which decodes
the tensors, and for binary fetches and deletes the handle). Cases run round-robin; each time
is the median of ``--repeats``; bytes are what crossed the wire for one response (body, plus
the fetched bytes for binary). Ratios are to the plain request. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test harness's server

PROMPT = ("Summarise the following in one sentence: the committee met on Tuesday to discuss "
          "the budget for the new library, the schedule for the renovation of the old town "
          "hall, and a proposal to plant two hundred trees along the river before winter.")
CASES = {
    "plain": {},
    "1 layer, json": {"capture_layers": [15]},
    "1 layer, binary": {"capture_layers": [15], "transport": "binary"},
    "all 30 layers, json": {"capture_layers": True},
    "all 30 layers, binary": {"capture_layers": True, "transport": "binary"},
}


class _CountingTransport:
    """Counts response bytes on the wire (httpx transport wrapper)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.nbytes = 0

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        response.read()
        self.nbytes += len(response.content)
        return response

    def close(self) -> None:
        self.inner.close()


def main() -> None:
    import httpx

    from tests.integration.server import running_server
    from vllm_lens.client import LensClient
    from vllm_lens.demo_models import smollm2_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    with running_server(str(smollm2_dir())) as server:
        client = LensClient(server.base_url)
        counter = _CountingTransport(httpx.HTTPTransport())
        client._http = httpx.Client(transport=counter, timeout=600)
        times: dict[str, list[float]] = {name: [] for name in CASES}
        sizes: dict[str, int] = {}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name, options in CASES.items():
                counter.nbytes = 0
                start = time.perf_counter()
                client.generate(PROMPT, max_tokens=args.tokens, ignore_eos=True, **options)
                if round_:
                    times[name].append(time.perf_counter() - start)
                    sizes[name] = counter.nbytes
        client.close()

    plain = statistics.median(times["plain"])
    print(f"{args.tokens} generated tokens; median of {args.repeats} sequential requests\n")
    print("| case | ms / response | ratio to plain | bytes / response |")
    print("|---|---:|---:|---:|")
    for name in CASES:
        t = statistics.median(times[name])
        print(f"| {name} | {t * 1000:.1f} | {t / plain:.2f} | {sizes[name]:,} |")


if __name__ == "__main__":
    main()
