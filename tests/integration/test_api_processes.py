"""``vllm-lens serve --data-parallel-size 2``: two engines behind one server, and two API
server processes (vLLM's default for that size; ``--api-server-count``): a binary
transport handle one process stored is fetched, deleted and counted by the other, under
concurrent load, and the fetches are seen landing on both processes (each names the process
that answered it in a header); a steering preset registered or dropped through one process
is seen by both; streamed rows, a named hook and a patching sweep are served as with one
process."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.integration.server import LENS_SERVE, running_server
from vllm_lens import NamedHook, SteeringVector, decode_activations
from vllm_lens.activations import decode_activation_bytes

pytestmark = pytest.mark.slow  # starts a server of its own

PROMPTS = [f"Fact number {i}: the capital of France is" for i in range(24)]


@pytest.fixture(scope="module")
def sink_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dp-sink")


@pytest.fixture(scope="module")
def two_process_server(tiny_path, sink_root):
    """Data parallel 2 behind one server (``--data-parallel-size 2``, vLLM's own load
    balancing), for which vLLM starts two API server processes by default; with a capture
    sink open to clients that writes each example's shard before answering."""
    sinks = {"dp": {"root": str(sink_root), "clients": True, "rows_per_shard": 1,
                    "max_queued_shards": 0}}
    with running_server(tiny_path, "--enforce-eager", "--data-parallel-size", "2",
                        env={"VLLM_LENS_HTTP_STORE_TTL_S": "120",
                             "VLLM_LENS_ALLOW_STEERING_ROUTES": "1",
                             "VLLM_LENS_SINKS": json.dumps(sinks),
                             "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                        launcher=LENS_SERVE) as server:
        yield server


def test_both_engines_write_one_sink_dataset(two_process_server, sink_root):
    """Requests naming a capture sink land on both engines; each engine writes the ones it
    served as a writer of its own into the one dataset, which reads back equal to the rows
    the same prompts return."""
    from vllm_lens import datasets

    server = two_process_server
    with ThreadPoolExecutor(8) as pool:
        receipts = list(pool.map(lambda i: _complete(
            server, PROMPTS[i], "json", capture_sink={"sink": "dp", "dataset": "both",
                                                      "key": f"k{i}"})["capture_receipt"],
            range(16)))
        returned = list(pool.map(lambda i: _complete(server, PROMPTS[i], "json"), range(16)))
    assert all(r["durable"] for r in receipts), receipts
    assert {r["writer"] for r in receipts} == {"dp0-pp0", "dp1-pp0"}, receipts
    ds = datasets.open(sink_root / "both")
    assert sorted(ds.keys()) == sorted(f"k{i}" for i in range(16))
    (point,) = ds.manifest["points"]  # output_residual_stream's rows, as the sink names them
    assert ds.manifest["layers"] == [1, 3]
    for i, choice in enumerate(returned):
        assert torch.equal(ds.get(f"k{i}")[point],
                           decode_activations(choice)["residual_stream"]), i


def _complete(server, prompt, transport, **xargs):
    body = {"model": _model(server), "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "vllm_xargs": {"output_residual_stream": json.dumps({"layers": [1, 3]}),
                           "activations_transport": transport,
                           **{k: json.dumps(v) for k, v in xargs.items()}}}
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
    stats = [httpx.get(server.base_url + "/v1/lens/stats").json() for _ in range(6)]
    assert {s["store"]["entries"] for s in stats} == {6 + len(PROMPTS)}
    assert all(len(s["workers"]) == 2 for s in stats)  # one worker in each DP engine
    with ThreadPoolExecutor(6) as pool:
        deleted = list(pool.map(lambda h: _fetch(server, h, "DELETE"), left))
    assert [r.status_code for r in deleted] == [200] * 6
    assert all(_fetch(server, h).status_code == 404 for h in left)


def _new_connection(server, method, path, body=None):
    with httpx.Client(timeout=300) as client:
        return client.request(method, server.base_url + path, json=body)


def test_presets_registered_through_one_process_steer_on_both(two_process_server):
    server = two_process_server
    vector = SteeringVector(activations=torch.randn(1, 128, generator=torch.Generator()
                                                    .manual_seed(5)) * 8, layer_indices=[1])
    inline = _complete(server, PROMPTS[0], "json",
                       apply_steering_vectors=[vector.model_dump(mode="json")])
    plain = _complete(server, PROMPTS[0], "json")
    assert inline["text"] != plain["text"]
    made = _new_connection(server, "POST", "/v1/steering/register", {
        "name": "up", "vectors": [vector.model_dump(mode="json")]})
    assert made.status_code == 200, made.text
    # The binary store's housekeeping, beside the log in the shared directory, on both.
    _complete(server, PROMPTS[0], "binary")
    assert all(_new_connection(server, "GET", "/v1/lens/stats").status_code == 200
               for _ in range(6))
    listed = [_new_connection(server, "GET", "/v1/steering") for _ in range(8)]
    assert all([p["name"] for p in r.json()["data"]] == ["up"] for r in listed)
    assert {r.headers["x-vllm-lens-api-process"] for r in listed} == {"ApiServer_0",
                                                                      "ApiServer_1"}
    with ThreadPoolExecutor(4) as pool:
        steered = list(pool.map(lambda _: _complete(
            server, PROMPTS[0], "json", apply_steering_vectors=["preset:up"]), range(8)))
    for choice in steered:
        assert choice["text"] == inline["text"]
        assert torch.equal(decode_activations(choice)["residual_stream"],
                           decode_activations(inline)["residual_stream"])
    dropped = _new_connection(server, "POST", "/v1/steering/unregister", {"name": "up"})
    assert dropped.status_code == 200, dropped.text
    body = {"model": _model(server), "prompt": PROMPTS[0], "max_tokens": 2,
            "vllm_xargs": {"apply_steering_vectors": json.dumps(["preset:up"])}}
    refused = [_new_connection(server, "POST", "/v1/completions", body) for _ in range(6)]
    assert [r.status_code for r in refused] == [400] * 6, [r.text for r in refused]
    assert all("preset" in r.text for r in refused)
    again = _new_connection(server, "POST", "/v1/steering/register", {
        "name": "up", "vectors": [vector.model_dump(mode="json")]})
    assert again.status_code == 200, again.text
    with ThreadPoolExecutor(4) as pool:
        steered = list(pool.map(lambda _: _complete(
            server, PROMPTS[0], "json", apply_steering_vectors=["preset:up"]), range(6)))
    assert all(choice["text"] == inline["text"] for choice in steered)


def test_streamed_rows_and_sweeps_are_served_with_two_processes(two_process_server):
    from vllm_lens.client import LensClient

    server = two_process_server
    with LensClient(server.base_url) as client:
        whole = client.generate(PROMPTS[1], max_tokens=4, capture_layers=[2])
        parts = list(client.generate(PROMPTS[1], max_tokens=4, capture_layers=[2],
                                     stream=True, stream_activations=True))
        ids = whole.prompt_token_ids
        hooked = client.generate(PROMPTS[1], max_tokens=4, hooks=[
            NamedHook("logit_lens_topk", [3], {"k": 2})])
        sweep = client.patching_sweep(ids, torch.zeros(2, 2, 128), [1, 2], [0, 1],
                                      {"prob": whole.token_ids[0]})
    streamed = torch.cat([p.activations["residual_stream"] for p in parts
                          if p.activations is not None], dim=1)
    assert torch.equal(streamed, whole.activations["residual_stream"])
    assert sweep["grid"].shape == (2, 2)
    top = hooked.hook_results["0"]["token_ids"]["3"]
    assert top.shape == (len(ids) + 3, 2)  # every computed position, the top 2 at layer 3
