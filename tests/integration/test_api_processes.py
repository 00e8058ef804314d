"""``vllm-lens serve`` with two API server processes (``--api-server-count 2``): a binary
transport handle one process stored is fetched, deleted and counted by the other, under
concurrent load, and the fetches are seen landing on both processes (each names the process
that answered it in a header)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.integration.server import LENS_SERVE, running_server
from vllm_lens import decode_activations
from vllm_lens.activations import decode_activation_bytes

pytestmark = pytest.mark.slow  # starts a server of its own

PROMPTS = [f"Fact number {i}: the capital of France is" for i in range(24)]


@pytest.fixture(scope="module")
def two_process_server(tiny_path):
    with running_server(tiny_path, "--enforce-eager", "--api-server-count", "2",
                        env={"VLLM_LENS_HTTP_STORE_TTL_S": "120"},
                        launcher=LENS_SERVE) as server:
        yield server


def _complete(server, prompt, transport):
    body = {"model": _model(server), "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "vllm_xargs": {"output_residual_stream": json.dumps({"layers": [1, 3]}),
                           "activations_transport": transport}}
    with httpx.Client(timeout=300) as client:  # a new connection: any process may answer
        response = client.post(server.base_url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _fetch(server, handle, method="GET"):
    with httpx.Client(timeout=300) as client:  # a new connection: any process may answer
        return client.request(method, f"{server.base_url}/v1/lens/activations/{handle}")


def _model(server):
    return httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]


def test_binary_handles_are_served_by_every_api_process(two_process_server):
    server = two_process_server
    with ThreadPoolExecutor(8) as pool:
        binary = list(pool.map(lambda p: _complete(server, p, "binary"), PROMPTS))
        plain = list(pool.map(lambda p: _complete(server, p, "json"), PROMPTS[:4]))
        fetched = list(pool.map(lambda c: _fetch(server, c["activations"]["handle"]), binary))
    assert [r.status_code for r in fetched] == [200] * len(PROMPTS)
    for choice, response, reference in zip(binary, fetched, plain):
        rows = decode_activation_bytes(response.content)["residual_stream"]
        expected = decode_activations(reference)["residual_stream"]
        assert torch.equal(rows, expected)
    answered = {r.headers["x-vllm-lens-api-process"] for r in fetched}
    assert answered == {"ApiServer_0", "ApiServer_1"}, answered
    # What is left is counted the same by every process, and deleted by any of them.
    left = [_complete(server, p, "binary")["activations"]["handle"] for p in PROMPTS[:6]]
    counts = {httpx.get(server.base_url + "/v1/lens/stats").json()["store"]["entries"]
              for _ in range(6)}
    assert counts == {6 + len(PROMPTS)}, counts
    with ThreadPoolExecutor(6) as pool:
        deleted = list(pool.map(lambda h: _fetch(server, h, "DELETE"), left))
    assert [r.status_code for r in deleted] == [200] * 6
    assert all(_fetch(server, h).status_code == 404 for h in left)
