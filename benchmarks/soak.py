"""Soak of a lens server over HTTP: many concurrent mixed requests, one in ten disconnecting
mid-stream (the suite runs a 200-request variant; this is the long one). Runs in: its own
process (client side), starting the server as a subprocess.

    python benchmarks/soak.py [--requests 1000] [--clients 4]

Starts SmolLM2 behind vLLM's OpenAI server with the test harness's settings, runs
``tests/integration/soak.py`` and prints one line: requests, disconnects, results checked
against the same request sent alone, failures, the API server's RSS (start, peak, end) and
the lens bytes left in the binary store and on each worker afterwards. Exits non-zero on any
failure or leftover.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests in the soak")
    parser.add_argument("--clients", type=int, default=4, help="HTTP client pools")
    args = parser.parse_args()

    from tests.integration.conftest import SERVER_ENV
    from tests.integration.server import running_server
    from tests.integration.soak import soak
    from vllm_lens.demo_models import smollm2_dir

    # The suite's server settings, but binary handles live as long as by default (300 s): the
    # suite's 20 s (for its expiry test) is shorter than a fetch can queue behind 1,000
    # concurrent requests in a client's connection pool.
    env = {k: v for k, v in SERVER_ENV.items() if k != "VLLM_LENS_HTTP_STORE_TTL_S"}
    with running_server(smollm2_dir(), env=env) as server:
        report = asyncio.run(soak(server.base_url, server.pid, args.requests, args.clients))
    print(report.line())
    for failure in report.failures[:20]:
        print("  ", failure)
    left = report.store_left.get("entries", 0) or any(
        w.get("entries") or w.get("records") for w in report.workers_left)
    return 1 if report.failures or left else 0


if __name__ == "__main__":
    sys.exit(main())
