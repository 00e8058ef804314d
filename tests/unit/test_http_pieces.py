"""Engine-free parts of the HTTP path: the binary store, choice mapping, activation forms."""

import json
import time

import pytest
import torch

from vllm_lens import WireError, decode_activations
from vllm_lens.common import wire
from vllm_lens.activations import (
    activations_to_json,
    binary_descriptor,
    decode_activation_bytes,
)
from vllm_lens.frontend.http.blob_store import BlobStore
from vllm_lens.frontend.response_scope import ResponseScope


def test_a_full_store_refuses_the_newcomer_and_keeps_what_it_holds(tmp_path):
    from vllm_lens import CapacityError

    store = BlobStore(tmp_path, max_bytes=10, ttl_s=60)
    a, b = store.put(b"aaaa"), store.put(b"bbbb")
    with pytest.raises(CapacityError, match=r"holds 8 of its 10 bytes in 2 responses.*"
                                            "VLLM_LENS_HTTP_STORE_MAX_BYTES") as info:
        store.put(b"cccc")
    assert info.value.setting == "VLLM_LENS_HTTP_STORE_MAX_BYTES"
    assert store.get(a) == b"aaaa" and store.get(b) == b"bbbb"  # nobody else's is dropped
    assert store.stats() == {"entries": 2, "bytes": 8}
    assert store.delete(a)  # fetched or deleted: room again
    c = store.put(b"cccc")
    assert store.get(c) == b"cccc" and store.get(b) == b"bbbb"
    with pytest.raises(ValueError, match="VLLM_LENS_HTTP_STORE_MAX_BYTES"):
        store.put(b"x" * 11)


def test_store_entries_expire_and_handles_are_unguessable(tmp_path):
    store = BlobStore(tmp_path, max_bytes=100, ttl_s=0.05)
    handles = {store.put(b"x") for _ in range(50)}
    assert len(handles) == 50 and min(len(h) for h in handles) >= 40
    time.sleep(0.1)
    assert store.stats() == {"entries": 0, "bytes": 0}
    assert not store.delete(next(iter(handles)))


def test_api_processes_sharing_the_directory_share_the_store(tmp_path):
    """What one API server process stored, another reads, deletes and counts against the same
    budget (each process opens its own ``BlobStore`` on the shared directory); files that are
    not entries are never touched."""
    import multiprocessing

    from vllm_lens import CapacityError

    first = BlobStore(tmp_path, max_bytes=10, ttl_s=60)
    (tmp_path / "steering-presets.jsonl").write_text("not an entry\n")
    handle = first.put(b"aaaaaa")
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        assert pool.apply(_read_in_another_process, (str(tmp_path), handle)) == b"aaaaaa"
    second = BlobStore(tmp_path, max_bytes=10, ttl_s=60)
    with pytest.raises(CapacityError, match="holds 6 of its 10 bytes in 1 responses"):
        second.put(b"bbbbbb")
    assert not list(tmp_path.glob(".*.tmp"))  # the refused write left nothing
    with second.open(handle, delete=True) as f:  # fetched and freed in one call
        assert first.get(handle) is None and f.read() == b"aaaaaa"
    assert first.stats() == {"entries": 0, "bytes": 0}
    assert (tmp_path / "steering-presets.jsonl").read_text() == "not an entry\n"
    for bad in ("", "../x", ".lock", "a/b", "x" * 200, "steering-presets.jsonl"):
        assert second.get(bad) is None and not second.delete(bad)


def _read_in_another_process(root, handle):
    return BlobStore(root, max_bytes=10, ttl_s=60).get(handle)


def _put_many(root, n):
    from vllm_lens import CapacityError

    store, kept = BlobStore(root, max_bytes=1000, ttl_s=60), 0
    for _ in range(n):
        try:
            store.put(b"x" * 100)
            kept += 1
        except CapacityError:
            pass
    return kept


def test_concurrent_writers_in_several_processes_keep_to_the_budget(tmp_path):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        kept = pool.starmap(_put_many, [(str(tmp_path), 8)] * 4)
    assert sum(kept) == 10  # 32 tries of 100 bytes, a 1000-byte store
    assert BlobStore(tmp_path, 1000, 60).stats() == {"entries": 10, "bytes": 1000}


def test_choices_map_to_prompt_and_completion():
    scope = ResponseScope()
    acts = {i: {"residual_stream": torch.full((1,), float(i))} for i in range(2)}
    scope.found = {"cmpl-x-0": acts, "cmpl-x-1": acts, "cmpl-y-0": acts, "cmpl-x-1a": acts}
    by_choice = scope.by_choice("cmpl-x", n=2)
    assert sorted(by_choice) == [0, 1, 2, 3]
    assert by_choice[3]["residual_stream"].item() == 1.0
    scope.found = {"chatcmpl-z": acts}
    assert sorted(scope.by_choice("chatcmpl-z", n=2)) == [0, 1]


def test_decode_activations_takes_response_choice_or_dict():
    acts = {"residual_stream": torch.randn(2, 3, 4).to(torch.bfloat16),
            "positions": torch.arange(3)}
    encoded = activations_to_json(acts)
    choice = {"index": 0, "text": "hi", "activations": encoded}
    for form in ({"choices": [choice]}, choice, encoded):
        decoded = decode_activations(form)
        assert torch.equal(decoded["residual_stream"], acts["residual_stream"])
        assert torch.equal(decoded["positions"], acts["positions"])
    two = decode_activations({"choices": [{**choice, "index": 1}, choice]})
    assert isinstance(two, list) and len(two) == 2
    assert decode_activations({"index": 0, "text": "no capture"}) is None


def test_binary_descriptor_and_bytes_round_trip():
    acts = {"residual_stream": torch.randn(1, 5, 8), "positions": torch.arange(5)}
    blob = wire.dumps(acts)
    desc = binary_descriptor(acts, "h" * 43, len(blob))
    assert desc["handle"] == "h" * 43 and desc["shapes"]["residual_stream"] == [1, 5, 8]
    assert "url" not in desc  # a URL would carry the handle into access logs
    assert desc["dtype"] == "float32"
    assert torch.equal(decode_activation_bytes(blob)["residual_stream"], acts["residual_stream"])
    with pytest.raises(WireError, match="fetch the bytes"):
        decode_activations(desc)
    with pytest.raises(WireError):
        decode_activation_bytes(b"\x00garbage")


def test_lens_keys_off_the_lens_routes_are_refused_only_when_they_ask_for_work():
    """The engine wrapper's last line in an API process (routes that would drop lens
    results): a transport alone, or keys set to false, ask for nothing and pass."""
    from types import SimpleNamespace

    from vllm_lens import LensRequestError
    from vllm_lens.frontend.async_engine import _refuse_off_route

    for harmless in ({"activations_transport": "binary"}, {"output_residual_stream": False},
                     {"stream_activations": "false", "output_qk": 0}, None, {"seed": 1}):
        _refuse_off_route(SimpleNamespace(extra_args=harmless))
    with pytest.raises(LensRequestError, match="/v1/completions") as info:
        _refuse_off_route(SimpleNamespace(extra_args={"activations_transport": "binary",
                                                      "apply_steering_vectors": "[]"}))
    assert info.value.field == "apply_steering_vectors"


def test_a_sweep_cell_the_server_sent_as_null_is_nan_in_the_grid():
    """The server sends ``null`` for a cell whose metric is not finite (JSON has no NaN);
    the client's grid holds NaN there instead of failing to build the tensor."""
    import httpx

    from vllm_lens.client import _Protocol

    steps = _Protocol("http://127.0.0.1:1", "m", None).sweep_steps({"prompt": "x"})
    request = next(steps)
    assert request.url.path == "/v1/lens/patching_sweep"
    with pytest.raises(StopIteration) as done:
        steps.send(httpx.Response(200, json={"grid": [[0.5, None], [1.0, 2.0]],
                                             "clean": 1.0, "corrupted": 0.0}))
    grid = done.value.value["grid"]
    assert grid.dtype == torch.float64 and grid.shape == (2, 2)
    assert torch.isnan(grid[0, 1]) and grid[1, 1] == 2.0


def test_every_transport_a_request_may_name_has_an_encoder():
    from vllm_lens.frontend.http.results import TRANSPORTS as ENCODERS
    from vllm_lens.spec.keys import TRANSPORTS as NAMES

    assert set(ENCODERS) == set(NAMES)


def test_the_lists_transport_sends_plain_numbers_up_to_the_servers_cap(monkeypatch):
    import torch

    from vllm_lens.activations import decode_activations, decode_json_tensors
    from vllm_lens.errors import LensRequestError
    from vllm_lens.frontend.http.results import encode_results, transport

    results = {"activations": {"residual_stream": torch.arange(12.0).reshape(1, 3, 4),
                               "positions": torch.arange(3)},
               "hook_results": {"0": {"scores": {1: torch.tensor([0.5, float("nan")])}}}}
    fields = encode_results(results, transport("lists"))
    stream = fields["activations"]["residual_stream"]
    assert stream["values"] == list(range(12)) and stream["shape"] == [1, 3, 4]
    assert fields["hook_results"]["0"]["scores"]["1"]["values"] == [0.5, "nan"]
    json.dumps(fields, allow_nan=False)  # strict JSON
    assert torch.equal(decode_activations(fields["activations"])["residual_stream"],
                       results["activations"]["residual_stream"])
    assert decode_json_tensors(fields["hook_results"])["0"]["scores"]["1"].isnan().tolist() \
        == [False, True]
    monkeypatch.setenv("VLLM_LENS_MAX_LIST_VALUES", "16")  # 12 + 3 + 2 = 17 values
    with pytest.raises(LensRequestError, match="17 values, above this server's 16") as info:
        encode_results(results, transport("lists"))
    assert info.value.field == "activations_transport"
    assert encode_results(results, transport("json"))["activations"]["positions"]["data"]
