"""Capture sinks over HTTP: the workers write a request's rows to the operator's dataset and
the response carries a receipt; sinks not opened to clients, unknown sinks and bad names are
refused; a shard the OS refuses to write is dropped alone, the next request writing to its
dataset fails naming its keys, and the dataset stays valid.

Once the server has started, its processes get a file-size limit (``RLIMIT_FSIZE``, 1 MiB): a
shard larger than that fails to write with "File too large", as a full disk would with "No
space left".
"""

import json
import resource
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.integration.server import running_server
from vllm_lens import datasets
from vllm_lens.client import LensClient

FILE_LIMIT = 1 << 20


def _descendants(pid):
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found.extend(_descendants(int(child)))
    return found


def _limit_file_size(pid):
    """Limit the size of files the server's processes (the engine's included) write."""
    for each in _descendants(pid):
        resource.prlimit(each, resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


@pytest.fixture(scope="module")
def tiny_sae(tmp_path_factory):
    """(directory, sae-lens ``SAE``): a random JumpReLU SAE on the tiny model's layer-2
    residual stream; the sink server serves it as ``tiny-l2``."""
    from tests.integration.saes import saved_sae

    path = tmp_path_factory.mktemp("saes") / "tiny-l2"
    return path, saved_sae(path, "jumprelu", "blocks.2.hook_resid_post")


@pytest.fixture(scope="module")
def sink_server(tiny_path, tmp_path_factory, tiny_sae):
    root = tmp_path_factory.mktemp("sinks")
    saes = root / "saes.json"
    saes.write_text(json.dumps({"tiny-l2": str(tiny_sae[0])}))
    sinks = {
        "open": {"root": str(root / "open"), "clients": True, "rows_per_shard": 4,
                 "flush_s": 0.2},
        "closed": {"root": str(root / "closed")},
        "small": {"root": str(root / "small"), "clients": True, "rows_per_shard": 100000,
                  "max_shard_bytes": 1 << 20, "flush_s": 0},
        "few": {"root": str(root / "few"), "clients": True, "max_open_datasets": 2,
                "idle_close_s": 3600, "rows_per_shard": 1, "max_queued_shards": 0},
    }
    with running_server(tiny_path, "--enforce-eager",
                        env={"VLLM_LENS_SINKS": json.dumps(sinks),
                             "VLLM_LENS_SAES": str(saes)}) as server:
        _limit_file_size(server.pid)
        yield server, root


def _post(server, **xargs):
    body = {"model": _model(server), "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0, "return_token_ids": True,
            "vllm_xargs": {k: v if isinstance(v, str) else json.dumps(v)
                           for k, v in xargs.items()}}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=300)


def _model(server):
    return httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]


def _wait_for_keys(path, keys, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (path / "index.jsonl").exists() and set(keys) <= set(datasets.open(path).keys()):
            return datasets.open(path)
        time.sleep(0.1)
    raise AssertionError(f"{keys} did not reach {path}'s index")


def test_the_workers_write_the_rows_and_the_response_carries_a_receipt(sink_server):
    server, root = sink_server
    capture = {"resid_post": {"layers": [1, 3]}, "attn_out": {"layers": [1, 3]}}
    with LensClient(server.base_url) as client:
        returned = client.generate("The capital of France is", max_tokens=4,
                                   output_activations=capture)
        receipts = [client.generate(prompt, max_tokens=4, output_activations=capture,
                                    capture_sink={"sink": "open", "dataset": "run-1",
                                                  "key": key})
                    for key, prompt in (("fr", "The capital of France is"),
                                        ("tale", "Once upon a time"))]
    assert receipts[0].activations is None and receipts[0].text == returned.text
    n_rows = len(returned.prompt_token_ids) + 3  # the last generated token never ran
    # rows_per_shard 4: the first example fills its shard, which the writer thread writes
    # after the response (where it lands is not known yet).
    assert receipts[0].capture_receipt == {
        "sink": "open", "dataset": "run-1", "key": "fr", "shard": None, "offset": None,
        "rows": n_rows, "shapes": {"resid_post": [2, n_rows, 128], "attn_out": [2, n_rows, 128]},
        "durable": False}
    ds = _wait_for_keys(root / "open" / "run-1", ["fr", "tale"])  # the timer flushed "tale"
    example = ds.get("fr")
    for point in ("resid_post", "attn_out"):
        assert torch.equal(example[point], returned.activations[point])
    assert example["positions"].tolist() == returned.activations["positions"].tolist()
    assert example["prompt_token_ids"] == returned.prompt_token_ids
    assert ds.manifest["points"] == ["resid_post", "attn_out"] and ds.manifest["layers"] == [1, 3]
    entry = next(e for e in ds.entries if e["key"] == "fr")
    assert entry["token_ids"] == receipts[0].token_ids
    again = _post(server, output_activations=capture,
                  capture_sink={"sink": "open", "dataset": "run-1", "key": "fr"})
    assert again.status_code == 409 and "already in the dataset" in again.text
    assert again.json()["error"]["param"] == "capture_sink"
    other = _post(server, output_residual_stream=[1],
                  capture_sink={"sink": "open", "dataset": "run-1", "key": "new"})
    assert other.status_code == 409 and "holds examples with layers=[1, 3]" in other.text


def test_clients_rotating_dataset_names_are_refused_past_max_open_datasets(sink_server):
    """Every open dataset is in use (written within idle_close_s): a third name gets a 503
    naming the sink's option, nothing is written for it, and the open ones keep working."""
    server, root = sink_server
    capture = {"resid_post": {"layers": [1]}}

    def write(dataset, key):
        return _post(server, output_activations=capture,
                     capture_sink={"sink": "few", "dataset": dataset, "key": key})

    first = write("d1", "a")
    assert first.status_code == 200 and write("d2", "a").status_code == 200
    # max_queued_shards 0: the request waits for the shard its example completes.
    receipt = first.json()["choices"][0]["capture_receipt"]
    assert (receipt["shard"], receipt["offset"], receipt["durable"]) == (0, 0, True)
    refused = write("d3", "a")
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["param"] == "VLLM_LENS_SINKS['few'].max_open_datasets"
    assert "dataset 'd3' was not opened" in error["message"]
    assert not (root / "few" / "d3").exists()
    assert write("d1", "b").status_code == 200
    assert _wait_for_keys(root / "few" / "d1", ["a", "b"]).keys() == ["a", "b"]
    assert _post(server, output_residual_stream=[1]).status_code == 200  # others served


@pytest.mark.parametrize("sink, status, problem", [
    ({"sink": "closed", "dataset": "d", "key": "k"}, 403, "not open to HTTP clients"),
    ({"sink": "nope", "dataset": "d", "key": "k"}, 400, "unknown sink 'nope'"),
    ({"sink": "open", "dataset": "../../etc", "key": "k"}, 400, "not a valid name"),
    ({"sink": "open", "dataset": "d", "key": "k", "root": "/"}, 400, "unknown field"),
])
def test_sinks_a_client_may_not_use_are_refused(sink_server, sink, status, problem):
    server, root = sink_server
    response = _post(server, output_residual_stream=[1], capture_sink=sink)
    assert response.status_code == status and problem in response.text, response.text
    assert not (root / "closed").exists()
    n2 = httpx.post(server.base_url + "/v1/completions", timeout=300, json={
        "model": _model(server), "prompt": "Hi", "max_tokens": 2, "n": 2,
        "vllm_xargs": {"output_residual_stream": "[1]", "capture_sink": json.dumps(
            {"sink": "open", "dataset": "d", "key": "k"})}})
    assert n2.status_code == 400 and "one example per request" in n2.text
    batch = httpx.post(server.base_url + "/v1/completions", timeout=300, json={
        "model": _model(server), "prompt": ["Hi", "Hello"], "max_tokens": 2,
        "vllm_xargs": {"output_residual_stream": "[1]", "capture_sink": json.dumps(
            {"sink": "open", "dataset": "batch", "key": "k"})}})
    assert batch.status_code == 400 and "several prompts" in batch.text
    assert not (root / "open" / "batch").exists()


def test_a_closed_sink_is_never_reached_through_the_responses_route(sink_server):
    """The Responses API hands ``vllm_xargs`` to the engine without the completions and chat
    wrappers: lens keys there are refused before anything runs (the route would drop what
    they return), so a sink not open to clients is never written through it either."""
    server, root = sink_server
    response = httpx.post(server.base_url + "/v1/responses", timeout=300, json={
        "model": _model(server), "input": "Hi", "max_output_tokens": 2,
        "vllm_xargs": {"output_residual_stream": "[1]", "capture_sink": json.dumps(
            {"sink": "closed", "dataset": "d", "key": "k"})}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] in ("output_residual_stream", "capture_sink"), error
    assert "/v1/completions" in error["message"]
    assert not (root / "closed").exists()


def test_a_shard_the_os_refuses_is_dropped_and_the_next_request_to_its_dataset_learns_it(
        sink_server):
    server, root = sink_server
    long_prompt = " ".join(["word"] * 300)  # ~300 rows × 4 layers × 128 × 4 B ≈ 600 KiB
    capture = {"layers": True}

    def write(key, prompt=long_prompt):
        return httpx.post(server.base_url + "/v1/completions", timeout=300, json={
            "model": _model(server), "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "vllm_xargs": {"output_residual_stream": json.dumps(capture),
                           "capture_sink": json.dumps({"sink": "small", "dataset": "d",
                                                       "key": key})}})

    first = write("a")
    assert first.status_code == 200 and first.json()["choices"][0]["capture_receipt"]["key"] == "a"
    second = write("b")  # completes a shard (~1.2 MiB) past the file-size limit
    assert second.status_code == 200, second.text  # answered before the shard is written
    assert second.json()["choices"][0]["capture_receipt"]["durable"] is False
    # The writer thread's failure reaches the next request writing to the dataset (requests
    # sent before it happened are queued as usual).
    deadline = time.monotonic() + 60
    sent = 0
    while True:
        told = write(f"c{sent}", "A short one")
        if told.status_code != 200 or time.monotonic() > deadline:
            break
        sent += 1
        time.sleep(0.1)
    assert told.status_code == 500, told.text
    assert "File too large" in told.text and "['a', 'b']" in told.text
    assert "this request's example was not written" in told.text
    # Everyone else is still served, rows included.
    with LensClient(server.base_url) as client:
        plain = client.generate("Hello", max_tokens=2, capture_layers=[1])
    assert plain.activations["residual_stream"].shape[0] == 1
    path = root / "small" / "d"
    assert not (path / "index.jsonl").exists() or datasets.open(path).keys() == []
    assert not list(path.glob("shard-*")) and not list(path.glob(".*tmp*"))
    assert write(f"c{sent}", "A short one").status_code == 200  # told once; sent again
    short = httpx.post(server.base_url + "/v1/completions", timeout=300, json={
        "model": _model(server), "prompt": "A short one", "max_tokens": 1,
        "vllm_xargs": {"output_residual_stream": "[1]", "capture_sink": json.dumps(
            {"sink": "small", "dataset": "d2", "key": "k"})}})
    assert short.status_code == 200  # the sink itself carries on


def test_extract_against_a_server_equals_transformers(sink_server, tmp_path, tiny_ref):
    """``vllm-lens extract --server``: the prompts run on the server, the rows come back over
    HTTP and are written locally; bad rows listed; a re-run resumes."""
    import subprocess
    import sys

    from tests.integration.reference import max_relative_error

    server, _ = sink_server
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "The capital of France is", "key": "fr"},
        {"messages": [{"role": "user", "content": "Name three colours."}], "key": "chat"},
        {"prompt": ""}]) + "\n")
    output = tmp_path / "remote"

    def extract():
        return subprocess.run(
            [sys.executable, "-m", "vllm_lens.cli", "extract", "--server", server.base_url,
             "--input", str(source), "--output", str(output), "--layers", "1,3",
             "--points", "resid_post,mlp_out"], capture_output=True, text=True, timeout=600)

    done = extract()
    assert done.returncode == 1 and "line 3: needs a non-empty prompt" in done.stderr, \
        done.stderr[-3000:]
    ds = datasets.open(output)
    assert ds.keys() == ["fr", "chat"] and ds.manifest["model"] == _model(server)
    for ex in ds:
        expected = tiny_ref.points(ex["prompt_token_ids"])
        assert ex["positions"].tolist() == list(range(len(ex["prompt_token_ids"])))
        for i, layer in enumerate((1, 3)):
            for point in ("resid_post", "mlp_out"):
                assert max_relative_error(ex[point][i], expected[(point, layer)]) <= 1e-4
    again = extract()
    assert "2 of 2 examples already written" in again.stderr, again.stderr[-3000:]


def test_sae_features_are_written_beside_the_rows_or_alone(sink_server, tiny_sae, tiny_ref):
    """A sink example holds each SAE's top features at the rows' positions (as the response
    would have carried them: sae-lens' encode of transformers' rows), beside the rows or
    alone; features at other positions than the rows are refused."""
    server, root = sink_server
    _, sae = tiny_sae
    features = {"sae": "tiny-l2", "top_k": 8, "reconstruction": True}
    capture = {"resid_post": {"layers": [1, 3]}}
    with LensClient(server.base_url) as client:
        returned = client.generate("The capital of France is", max_tokens=4,
                                   sae_features=features)
        for key, alone in (("both", False), ("alone", True)):
            receipt = client.generate(
                "The capital of France is", max_tokens=4, sae_features=features,
                output_activations=None if alone else capture,
                capture_sink={"sink": "open", "dataset": f"sae-{key}", "key": key})
            assert receipt.sae_features is None and receipt.activations is None
            n_rows = len(returned.prompt_token_ids) + 3
            assert receipt.capture_receipt["rows"] == n_rows
            assert receipt.capture_receipt["shapes"]["sae.0.indices"] == [n_rows, 8]
            ds = _wait_for_keys(root / "open" / f"sae-{key}", [key])
            (entry,) = ds.get(key)["sae_features"]
            assert ds.saes == ({"sae": "tiny-l2", "point": "resid_post", "layer": 2,
                                "d_sae": 512, "top_k": 8, "reconstruction": True},)
            assert ds.manifest["points"] == ([] if alone else ["resid_post"])
            for field in ("positions", "indices", "values", "nmse", "l0"):
                assert torch.equal(entry[field], returned.sae_features[0][field]), field
        refused = _post(server, output_activations=capture, capture_sink={
            "sink": "open", "dataset": "sae-bad", "key": "k"},
            output_sae_features={**features, "positions": "prompt"})
    assert refused.status_code == 400 and "needs the rows' positions" in refused.text
    ids = returned.prompt_token_ids + returned.token_ids[:-1]
    with torch.no_grad():
        dense = sae.encode(tiny_ref.points(ids)[("resid_post", 2)])
    top = dense.topk(8)
    torch.testing.assert_close(returned.sae_features[0]["values"], top.values.clamp(min=0),
                               rtol=1e-4, atol=1e-4)


def test_extract_against_a_server_writes_sae_features_and_sae_lens_caches(sink_server, tiny_sae,
                                                                        tmp_path, tiny_ref):
    """``extract --server --sae NAME`` writes the features the server computed (sae-lens'
    encode of transformers' rows); ``--format sae-lens`` writes rows sae-lens' own
    ``ActivationsStore`` reads back, in order, with their tokens."""
    import subprocess
    import sys

    from tests.sae_lens_reader import read_with_sae_lens

    server, _ = sink_server
    _, sae = tiny_sae
    source = tmp_path / "prompts.jsonl"
    prompts = ["The capital of France is", "Once upon a time in a quiet village",
               "Name three colours of the rainbow"]
    source.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n")

    def extract(output, *flags):
        done = subprocess.run(
            [sys.executable, "-m", "vllm_lens.cli", "extract", "--server", server.base_url,
             "--input", str(source), "--output", str(output), *flags],
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    extract(tmp_path / "features", "--sae", "tiny-l2", "--top-k", "4")
    ds = datasets.open(tmp_path / "features")
    assert ds.manifest["points"] == [] and ds.saes[0]["d_sae"] == 512
    every_row = []
    for ex in ds:
        ids = ex["prompt_token_ids"]
        rows = tiny_ref.points(ids)[("resid_post", 2)]
        every_row.append(rows)
        with torch.no_grad():
            top = sae.encode(rows).topk(4)
        (entry,) = ex["sae_features"]
        assert set(entry) == {"sae", "layer", "point", "positions", "indices", "values"}
        torch.testing.assert_close(entry["values"], top.values.clamp(min=0), rtol=1e-4,
                                   atol=1e-4)
    cache = tmp_path / "cache"
    done = extract(cache, "--layers", "2", "--points", "resid_post", "--format", "sae-lens",
                   "--context-size", "5")
    assert "hook blocks.2.hook_resid_post" in done.stderr
    tokens = [t for ex in ds for t in ex["prompt_token_ids"]]
    n = len(tokens) // 5
    acts, ids = read_with_sae_lens(cache, "blocks.2.hook_resid_post", 5, 128, n)
    assert ids.tolist() == tokens[:5 * n]
    torch.testing.assert_close(acts, torch.cat(every_row)[:5 * n], rtol=1e-4, atol=1e-4)
    assert datasets.open(cache / "vllm-lens-rows").keys() == ds.keys()
