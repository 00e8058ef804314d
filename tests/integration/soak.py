"""A soak over HTTP (runs in: the test process, or ``benchmarks/soak.py``): many concurrent
requests of every kind against one lens server, with some clients disconnecting mid-stream;
every completed result is checked against the same request sent alone, and afterwards the
server must hold no lens bytes (binary store and every worker) and its memory be back near
where it started.

Kinds: plain, capture (JSON), capture (binary transport), steering, a named hook, a streamed
capture, and a streamed capture whose client hangs up after its first chunk (``disconnect``,
one request in ten).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from tests.integration.reference import max_relative_error
from tests.integration.server import rss_bytes
from vllm_lens import NamedHook, SteeringVector
from vllm_lens.client import AsyncLensClient, encode_xargs

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colours are"]
#: Nine kinds that complete, then one that disconnects: one request in ten hangs up.
KINDS = ["plain", "capture", "binary", "steer", "hook", "stream", "capture", "binary", "stream",
         "disconnect"]
MAX_TOKENS = 8


def _options(kind: str) -> dict[str, Any]:
    if kind == "plain":
        return {}
    if kind == "steer":
        d = torch.ones(576) / 24 * 40
        return {"steering_vectors": [SteeringVector(activations=d[None], layer_indices=[8])]}
    if kind == "hook":
        return {"hooks": [NamedHook("linear_probe", [4, 20], {"weight": [0.01] * 576})]}
    capture = {"capture": {"layers": [2, 17], "positions": "all"}}
    if kind == "binary":
        return {**capture, "transport": "binary"}
    if kind == "stream":
        return {**capture, "stream": True}
    return capture


async def _one(client: AsyncLensClient, prompt: str, kind: str) -> Any:
    result = await client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   **_options(kind))
    if kind == "stream":
        parts = [r async for r in result]
        return parts[-1]
    return result


async def _disconnect(http: httpx.AsyncClient, base_url: str, model: str, prompt: str) -> None:
    """Start a streamed capture and hang up after the first chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 64, "ignore_eos": True,
            "stream": True, "vllm_xargs": encode_xargs({"output_residual_stream": [2, 17]})}
    async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream


def _check(result: Any, expected: Any, kind: str) -> None:
    assert result.token_ids == expected.token_ids, kind
    assert len(result.token_ids) == MAX_TOKENS and result.finish_reason == "length", kind
    if kind == "hook":
        got, want = result.hook_results["0"], expected.hook_results["0"]
        for layer in ("4", "20"):
            assert got["positions"][layer].tolist() == want["positions"][layer].tolist()
            torch.testing.assert_close(got["scores"][layer], want["scores"][layer],
                                       rtol=1e-4, atol=1e-3)
    if expected.activations is None:
        assert result.activations is None, kind
        return
    got, want = result.activations, expected.activations
    assert got["positions"].tolist() == want["positions"].tolist(), kind
    assert max_relative_error(got["residual_stream"], want["residual_stream"]) <= 1e-4, kind


@dataclass
class SoakReport:
    requests: int
    disconnects: int
    checked: int
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rss_start: int = 0
    rss_peak: int = 0
    rss_end: int = 0
    store_left: dict[str, int] = field(default_factory=dict)
    workers_left: list[dict[str, int]] = field(default_factory=list)

    def line(self) -> str:
        mib = 1 << 20
        return (f"{self.requests} requests ({self.disconnects} disconnected mid-stream) in "
                f"{self.seconds:.0f} s: {self.checked} checked, {len(self.failures)} failures; "
                f"API server RSS {self.rss_start / mib:.0f} -> peak {self.rss_peak / mib:.0f} "
                f"-> end {self.rss_end / mib:.0f} MiB; left: store {self.store_left}, "
                f"workers {self.workers_left}")


async def soak(base_url: str, server_pid: int, n_requests: int, n_clients: int = 4,
               settle_s: float = 60.0) -> SoakReport:
    """Run the soak; failures are collected (not raised) so a benchmark can report them."""
    jobs = [(PROMPTS[i % len(PROMPTS)], KINDS[i % len(KINDS)]) for i in range(n_requests)]
    report = SoakReport(requests=n_requests, disconnects=sum(k == "disconnect" for _, k in jobs),
                        checked=0)
    async with AsyncLensClient(base_url) as single:
        alone = {}
        for prompt, kind in sorted(set(jobs)):
            if kind != "disconnect":
                alone[prompt, kind] = await _one(single, prompt, kind)
    async with httpx.AsyncClient(timeout=60) as plain:
        model = (await plain.get(base_url + "/v1/models")).json()["data"][0]["id"]
    report.rss_start = report.rss_peak = rss_bytes(server_pid)

    clients = [AsyncLensClient(base_url) for _ in range(n_clients)]
    http = httpx.AsyncClient(timeout=600)
    stop = asyncio.Event()

    async def watch_rss() -> None:
        while not stop.is_set():
            report.rss_peak = max(report.rss_peak, rss_bytes(server_pid))
            await asyncio.sleep(0.2)

    async def run(i: int, prompt: str, kind: str) -> None:
        try:
            if kind == "disconnect":
                await _disconnect(http, base_url, model, prompt)
                return
            _check(await _one(clients[i % n_clients], prompt, kind), alone[prompt, kind], kind)
            report.checked += 1
        except Exception as exc:  # noqa: BLE001 -- every failure is reported
            report.failures.append(f"request {i} ({kind}): {type(exc).__name__}: {exc}"[:500])

    start = time.monotonic()
    watcher = asyncio.ensure_future(watch_rss())
    try:
        await asyncio.gather(*(run(i, p, k) for i, (p, k) in enumerate(jobs)))
    finally:
        stop.set()
        await watcher
        for c in clients:
            await c.aclose()
        await http.aclose()
    report.seconds = time.monotonic() - start

    # Disconnected requests are aborted and release their rows shortly after.
    deadline = time.monotonic() + settle_s
    async with httpx.AsyncClient(timeout=60) as plain:
        while True:
            stats = (await plain.get(base_url + "/v1/lens/stats")).json()
            report.store_left, report.workers_left = stats["store"], stats["workers"]
            idle = stats["store"]["entries"] == 0 and all(
                w["entries"] == 0 and w["records"] == 0 and w["bytes"] == 0
                for w in stats["workers"])
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
    report.rss_end = rss_bytes(server_pid)
    return report
