"""Bounded under hostile input, on real engines: captures are admitted by size before they
are scheduled, the worker reserves each capture's bound and refuses a newcomer that does not
fit (failing that request alone, never dropping a running or finished request's rows), and
bombs, oversized captures and foreign URLs get nowhere over HTTP."""

from __future__ import annotations

import base64
import contextlib

import httpx
import pytest
import torch
import zstandard
from vllm import SamplingParams

from tests.integration.engines import IDLE, held, env, running_llm
from vllm_lens import (
    LensExecutionError,
    LensRequestError,
    SteeringVector,
    WorkerCapacityError,
)
from vllm_lens.common import wire

LONG = " ".join(["word"] * 150)


def _capture(layers=True, positions="all", max_tokens=4, n=1):
    return SamplingParams(max_tokens=max_tokens, temperature=0 if n == 1 else 1.0,
                          ignore_eos=True, n=n, seed=0,
                          extra_args={"output_residual_stream": {"layers": layers,
                                                                 "positions": positions}})


def test_offline_admission_refuses_before_anything_runs(tiny_llm, monkeypatch):
    # tiny model: 4 layers x hidden 128 x float32 = 2 KiB per position.
    monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_BYTES", str(64 << 10))
    with pytest.raises(LensRequestError) as info:
        tiny_llm.generate(["Hello", LONG], [_capture(), _capture(max_tokens=8)])
    msg = str(info.value)
    assert info.value.index == 1 and "request 1 of this call" in msg
    assert "4 layers x 158 positions x hidden 128 x 4 bytes (float32)" in msg
    assert "VLLM_LENS_MAX_CAPTURE_BYTES (65,536)" in msg and "'prompt[-1]'" in msg
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    # n multiplies; a narrower selection of the same request is admitted.
    with pytest.raises(LensRequestError, match=r"x n=16\)"):
        tiny_llm.generate(["Hello"], _capture(max_tokens=2, n=16))
    out = tiny_llm.generate([LONG], _capture(positions="prompt[-4:]", max_tokens=8))[0]
    assert out.activations["residual_stream"].shape == (4, 4, 128)
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


@pytest.fixture(scope="module")
def small_budget_llm(tiny_path):
    """A tiny engine whose workers hold at most 64 KiB of captured rows (the setting is in
    the environment only while its workers start, so engines started later keep the default)."""
    with contextlib.ExitStack() as stack:
        with env(VLLM_LENS_WORKER_MAX_BYTES=str(64 << 10)):
            llm = stack.enter_context(running_llm(tiny_path, enforce_eager=True))
        yield llm


def test_worker_budget_fails_the_request_that_exceeds_it_alone(small_budget_llm):
    llm = small_budget_llm
    steer = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": [SteeringVector(activations=torch.ones(1, 128),
                                                  layer_indices=[1])]})
    small, big, steered, plain = llm.generate(
        ["Hello there", LONG, "Hello there", "Hello there"],
        [_capture(), _capture(), steer, SamplingParams(max_tokens=4, temperature=0)])
    assert small.lens_error is None and small.activations["residual_stream"].shape[0] == 4
    assert isinstance(big.lens_error, LensExecutionError) and big.activations is None
    assert "VLLM_LENS_WORKER_MAX_BYTES (65,536 bytes" in str(big.lens_error)
    assert steered.lens_error is None and plain.lens_error is None
    assert held(llm.collective_rpc("lens_stats")) == [IDLE]
    # The budget is for rows held at once: fetched rows give it back, so batch after batch
    # that fits is served in full.
    for _ in range(3):
        outs = llm.generate(["Hello there"] * 6, _capture(max_tokens=2))
        assert [o.lens_error for o in outs] == [None] * 6
        assert held(llm.collective_rpc("lens_stats")) == [IDLE]


def test_worker_budget_refuses_the_newcomer_not_the_running_request(small_budget_llm):
    """Two captures of ~40 KiB each under a 64 KiB budget: each fits alone, not both. The
    first to run reserves its share; the second fails at once, before any of its rows
    exist, and the first is served in full (before reservations, whichever filed its rows
    last failed, the one running longest included)."""
    llm = small_budget_llm
    prompt = " ".join(["word"] * 16)
    first, second = llm.generate([prompt, prompt], _capture(max_tokens=4))
    assert first.lens_error is None
    assert first.activations["residual_stream"].shape[:2] == (4, len(first.prompt_token_ids) + 3)
    assert isinstance(second.lens_error, WorkerCapacityError) and second.activations is None
    assert second.lens_error.setting == "VLLM_LENS_WORKER_MAX_BYTES"
    message = str(second.lens_error)
    assert "refused its capture" in message and "nobody else's rows were dropped" in message
    assert "VLLM_LENS_WORKER_MAX_BYTES (65,536 bytes)" in message
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)  # still ran
    assert held(llm.collective_rpc("lens_stats")) == [IDLE]
    # Fetched, the first gave its share back: the same request is admitted again.
    (again,) = llm.generate([prompt], _capture(max_tokens=4))
    assert again.lens_error is None


# --- over HTTP ----------------------------------------------------------------------------------

PROMPT = "The capital of France is"


def _bomb_wire_string() -> str:
    """A SteeringVector wire string of ~25 KB that declares 512 MiB of activations."""
    compressor = zstandard.ZstdCompressor().compressobj()
    data = b"".join(compressor.compress(bytes(1 << 20)) for _ in range(512)) + compressor.flush()
    record = {"__tensor__": True, "dtype": "float32", "shape": [1, 1 << 27],
              "compression": "zstd", "data": data}
    return base64.b64encode(wire.dumps({"activations": record, "layer_indices": [0]})).decode()


def test_server_refuses_bombs_and_oversized_captures_then_serves(smol_server):
    base = smol_server.base_url
    bomb = _bomb_wire_string()
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"apply_steering_vectors": bomb}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "apply_steering_vectors[0]"  # its declared shape, before inflating
    assert "hidden size is 134217728 but the model's is 576" in err["message"]
    # Every layer at up to 1024 positions x 16 samples: more than the default 1 GiB cap, refused
    # before it is scheduled; streaming requests get the same 400 (not an error event).
    for stream in (False, True):
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 1000, "n": 16, "stream": stream,
            "vllm_xargs": {"output_residual_stream": "true"}})
        assert r.status_code == 400, (stream, r.text)
        err = r.json()["error"]
        assert err["param"] == "output_residual_stream", err
        assert "VLLM_LENS_MAX_CAPTURE_BYTES" in err["message"] and "x n=16" in err["message"]
    ok = httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
        "vllm_xargs": {"output_residual_stream": "[3]"}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["activations"]
    stats = httpx.get(base + "/v1/lens/stats").json()
    assert all(w["entries"] == 0 and w["records"] == 0 for w in stats["workers"])


def test_server_refuses_request_level_floods_and_off_route_lens_keys_then_serves(smol_server):
    """Limits per request, not only per item: thousands of hooks, tens of thousands of preset
    references and hundreds of vectors are each a 400 naming the field and the setting before
    anything is scheduled; lens keys on a route that would drop their results (the Responses
    API) are a 400 naming the key; then the server serves others."""
    from vllm_lens.hooks import hook_to_json
    from vllm_lens import NamedHook

    base = smol_server.base_url
    hook = hook_to_json(NamedHook("logit_lens_topk", list(range(30)), {"k": 1}))
    zero = SteeringVector(activations=torch.zeros(1, 576), layer_indices=[3]).to_wire()
    floods = [
        ({"apply_hooks": json_dumps([hook] * 2000)}, "apply_hooks", "VLLM_LENS_MAX_HOOKS (32)"),
        ({"apply_steering_vectors": ["preset:calm"] * 50_000}, "apply_steering_vectors[256]",
         "VLLM_LENS_MAX_STEERING_VECTORS (256)"),
        ({"apply_steering_vectors": [zero] * 300}, "apply_steering_vectors[256]",
         "VLLM_LENS_MAX_STEERING_VECTORS (256)"),
    ]
    for xargs, param, setting in floods:
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs})
        assert r.status_code == 400, r.text[:500]
        err = r.json()["error"]
        assert err["param"] == param and setting in err["message"], err
    # Copies of an all-layer logit lens over ~1,006 positions: 30,180 rows each, within the
    # per-hook cap (65,536), three together past it.
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 1000, "vllm_xargs": {"apply_hooks": json_dumps(
            [hook] * 3)}})
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == "apply_hooks[2]" and "3 hooks named so together" in err["message"]
    r = httpx.post(base + "/v1/responses", timeout=60, json={
        "model": _served_model(base), "input": "Say hi.", "max_output_tokens": 4,
        "vllm_xargs": {"output_residual_stream": "[3]"}})
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == "output_residual_stream" and "/v1/completions" in err["message"]
    ok = httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
        "vllm_xargs": {"output_residual_stream": "[3]"}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["activations"]
    plain = httpx.post(base + "/v1/responses", timeout=120, json={
        "model": _served_model(base), "input": "Say hi.", "max_output_tokens": 4})
    assert plain.status_code == 200, plain.text[:500]
    stats = httpx.get(base + "/v1/lens/stats").json()
    assert all(w["entries"] == 0 and w["records"] == 0 for w in stats["workers"])


def json_dumps(value) -> str:
    import json

    return json.dumps(value)


def _served_model(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
