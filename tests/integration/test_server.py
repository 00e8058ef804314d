"""The OpenAI-compatible server: activations and steering over HTTP equal the offline engine's."""

import base64
import contextlib
import json
import os
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import zstandard
from vllm import SamplingParams

from tests.integration.engines import IDLE, held
from tests.integration.reference import max_relative_error
from vllm_lens import SteeringVector, decode_activations
from vllm_lens.client import AsyncLensClient, LensClient, LensHTTPError

PROMPT = "The capital of France is"
PROMPTS = [PROMPT, "Write one sentence about the ocean and a small boat:"]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
LAYERS = [0, 11, 29]
TOL = 1e-5


@pytest.fixture(scope="module")
def client(smol_server):
    with LensClient(smol_server.base_url) as c:
        yield c


def _offline(llm, prompt_ids, spec, max_tokens=6, **extra):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0,
                        extra_args={"output_residual_stream": spec, **extra})
    return llm.generate([{"prompt_token_ids": prompt_ids}], sp)[0]


def _assert_same(http_acts, offline_acts):
    assert http_acts["positions"].tolist() == offline_acts["positions"].tolist()
    assert http_acts["residual_stream"].shape == offline_acts["residual_stream"].shape
    assert max_relative_error(http_acts["residual_stream"], offline_acts["residual_stream"]) <= TOL


def _final(results):
    """The last streamed result of each choice."""
    last = {}
    for r in results:
        last[r.index] = r
    return [last[i] for i in sorted(last)]


@pytest.mark.parametrize("transport", ["json", "binary"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_completion_activations_equal_offline(client, smol_llm, transport, stream):
    spec = {"layers": LAYERS, "positions": "all"}
    result = client.generate(PROMPT, max_tokens=6, capture=spec, stream=stream,
                             transport=transport)
    if stream:
        (result,) = _final(list(result))
    offline = _offline(smol_llm, result.prompt_token_ids or _ids(smol_llm, PROMPT), spec)
    assert result.token_ids == list(offline.outputs[0].token_ids)
    assert result.text == offline.outputs[0].text
    _assert_same(result.activations, offline.activations)


@pytest.mark.parametrize("transport", ["json", "binary"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_activations_equal_offline(client, smol_llm, transport, stream):
    result = client.chat(MESSAGES, max_tokens=6, capture_layers=LAYERS, stream=stream,
                         transport=transport)
    if stream:
        (result,) = _final(list(result))
    prompt_ids = smol_llm.get_tokenizer().apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    offline = _offline(smol_llm, prompt_ids, LAYERS)
    assert result.token_ids == list(offline.outputs[0].token_ids)
    _assert_same(result.activations, offline.activations)


def _ids(llm, prompt):
    return llm.get_tokenizer()(prompt)["input_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_each_choice_gets_its_own_activations(client, smol_llm, stream):
    """Two prompts x n=2 sampled choices: every choice's rows are its own sequence's."""
    result = client.generate(PROMPTS, max_tokens=5, temperature=1.0, seed=7, n=2,
                             capture_layers=[4, 20], stream=stream)
    choices = _final(list(result)) if stream else result.choices
    assert [c.index for c in choices] == [0, 1, 2, 3]
    texts = set()
    for c in choices:
        prompt_ids = _ids(smol_llm, PROMPTS[c.index // 2])
        sequence = prompt_ids + c.token_ids
        # The whole sequence as a prompt gives, at each position, the same residual stream.
        replay = _offline(smol_llm, sequence, [4, 20], max_tokens=1)
        rows = len(sequence) - 1
        got = c.activations["residual_stream"]
        assert got.shape == (2, rows, 576)
        assert max_relative_error(got, replay.activations["residual_stream"][:, :rows]) <= 1e-4
        texts.add(tuple(sequence))
    assert len(texts) == 4  # the choices really differ, so a mix-up would be caught


def test_steering_over_http_equals_offline(client, smol_llm):
    g = torch.Generator().manual_seed(0)
    d = torch.randn(576, generator=g)
    vectors = [SteeringVector(activations=(d / d.norm() * 60)[None], layer_indices=[10])]
    prompt = "Tell me about your favourite animal."
    http = client.generate(prompt, max_tokens=10, steering_vectors=vectors, ignore_eos=True)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                        extra_args={"apply_steering_vectors": vectors})
    offline = smol_llm.generate([prompt], sp)[0].outputs[0]
    plain = client.generate(prompt, max_tokens=10, ignore_eos=True)
    assert http.token_ids == list(offline.token_ids)
    assert http.token_ids != plain.token_ids
    # The wire-string form of one vector is accepted too.
    wire_form = client.generate(prompt, max_tokens=10, steering_vectors=vectors[0].to_wire(),
                                ignore_eos=True)
    assert wire_form.token_ids == http.token_ids


def test_openai_sdk_with_extra_body(smol_server, smol_llm):
    """The recipe of docs/http.md: the official SDK, extra_body, and decode_activations."""
    sdk = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused")
    model = sdk.models.list().data[0].id
    response = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0,
        extra_body={"vllm_xargs": {"output_residual_stream": "[0, 11, 29]"}})
    acts = decode_activations(response)  # the SDK object as it is
    offline = _offline(smol_llm, _ids(smol_llm, PROMPT), LAYERS, max_tokens=4)
    _assert_same(acts, offline.activations)
    _assert_same(decode_activations(response.choices[0]), offline.activations)


def test_json_tensors_decode_with_numpy_and_zstandard_alone(smol_server):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "vllm_xargs": {"output_residual_stream": [3]}}
    data = httpx.post(smol_server.base_url + "/v1/completions", json=body, timeout=120).json()
    record = data["choices"][0]["activations"]["residual_stream"]
    raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(record["data"]))
    array = np.frombuffer(raw, dtype=record["dtype"]).reshape(record["shape"])
    assert np.array_equal(array, decode_activations(data)["residual_stream"].numpy())


def test_binary_handles_are_freed_and_unknown_ones_are_404(smol_server):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "vllm_xargs": {"output_residual_stream": [3], "activations_transport": "binary"}}
    base = smol_server.base_url
    data = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
    desc = data["choices"][0]["activations"]
    assert desc["transport"] == "binary" and len(desc["handle"]) >= 40
    assert "url" not in desc  # nothing invites a GET that logs the handle
    desc["url"] = f"/v1/lens/activations/{desc['handle']}"  # the GET route still serves it
    first = httpx.get(base + desc["url"])
    assert first.status_code == 200
    assert first.headers["content-type"] == "application/octet-stream"
    assert httpx.get(base + desc["url"]).content == first.content  # reads are repeatable
    assert httpx.delete(base + desc["url"]).status_code == 200
    gone = httpx.get(base + desc["url"])
    assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
    assert httpx.get(base + "/v1/lens/activations/not-a-handle").status_code == 404
    with pytest.raises(ValueError, match="fetch the bytes"):
        decode_activations(data)


def test_clients_fetch_by_handle_from_their_own_server_only(smol_server):
    """A descriptor's ``url`` is never followed: the client posts the (validated) handle to its
    own server, which serves the bytes and frees them in the same call."""
    from vllm_lens.client import LensClient, LensHTTPError

    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "vllm_xargs": {"output_residual_stream": [3], "activations_transport": "binary"}}
    base = smol_server.base_url
    desc = httpx.post(base + "/v1/completions", json=body, timeout=120).json()[
        "choices"][0]["activations"]
    tampered = {**desc, "url": "@127.0.0.2:9/steal"}  # would send the GET to another host
    with LensClient(base) as client:
        acts = client.fetch_activations(tampered)
        assert acts["residual_stream"].shape[0] == 1
        with pytest.raises(LensHTTPError) as gone:  # fetched once, freed at once
            client.fetch_activations(desc)
        assert gone.value.status == 404
        for handle in ("../../v1/hooks/register", "a/b", "", None, "x" * 500):
            with pytest.raises(ValueError, match="not a vllm-lens activations handle"):
                client.fetch_activations({**desc, "handle": handle})
    bad = httpx.post(base + "/v1/lens/activations/fetch", json={"handle": "../etc"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "handle"
    assert httpx.post(base + "/v1/lens/activations/fetch", content=b"x" * 5000).status_code == 400


BAD_XARGS = [
    ({"output_residual_stream": [30]}, "output_residual_stream[0]"),
    ({"output_residual_stream": [-1]}, "output_residual_stream[0]"),
    ({"output_residual_stream": "[]"}, "output_residual_stream"),
    ({"output_residual_stream": "[1, "}, "output_residual_stream"),
    ({"output_residual_stream": '{"layers": [1], "positions": "middle"}'},
     "output_residual_stream.positions"),
    ({"output_residual_stream": '{"layers": [1], "reduce": "max"}'}, "output_residual_stream.reduce"),
    ({"output_residual_stream": '{"layers": [1], "positions": [5000]}'},
     "output_residual_stream.positions[0]"),
    ({"output_residual_stream": '{"layers": [1], "colour": 1}'}, "output_residual_stream.colour"),
    ({"output_residual_streams": [1]}, "output_residual_streams"),
    ({"apply_steering_vectors": "[{\"activations\": 1"}, "apply_steering_vectors"),
    ({"apply_steering_vectors": "not-a-wire-string"}, "apply_steering_vectors[0]"),
    ({"activations_transport": "carrier-pigeon"}, "activations_transport"),
    ({"vllm_lens": "{}"}, "vllm_lens"),
    ({"apply_steering_vectors": "x" * ((1 << 20) + 1)}, "apply_steering_vectors"),  # oversize
]


@pytest.mark.parametrize("xargs,field", BAD_XARGS, ids=[f for _, f in BAD_XARGS])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_lens_input_is_400_naming_the_field(smol_server, xargs, field, endpoint):
    base = smol_server.base_url
    content = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    for stream in (False, True):
        r = httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={
            **content, "max_tokens": 2, "stream": stream, "vllm_xargs": xargs})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and field.split("[")[0] in error["message"]
    ok = httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={
        **content, "max_tokens": 2, "vllm_xargs": {"output_residual_stream": [1]}})
    assert ok.status_code == 200 and "activations" in ok.json()["choices"][0]


def test_client_raises_the_server_error(client):
    with pytest.raises(LensHTTPError) as info:
        client.generate(PROMPT, capture_layers=[99])
    assert info.value.status == 400 and info.value.param == "output_residual_stream[0]"


def test_async_client_matches_sync_client(smol_server, client):
    import asyncio

    async def run():
        async with AsyncLensClient(smol_server.base_url) as ac:
            full = await ac.generate(PROMPT, max_tokens=4, capture_layers=[2], transport="binary")
            parts = [r async for r in await ac.chat(MESSAGES, max_tokens=4, capture_layers=[2],
                                                     stream=True)]
            return full, parts

    full, parts = asyncio.run(run())
    sync_full = client.generate(PROMPT, max_tokens=4, capture_layers=[2])
    assert full.token_ids == sync_full.token_ids
    assert torch.equal(full.activations["residual_stream"],
                       sync_full.activations["residual_stream"])
    (last,) = _final(parts)
    assert last.activations["residual_stream"].shape[:1] == (1,)
    assert "".join(p.delta for p in parts) == last.text


def test_soak_200_concurrent_mixed_requests_with_disconnects(smol_server):
    """The CI variant of the soak (``benchmarks/soak.py`` runs 1,000): 200 concurrent requests
    of every kind, one in ten hanging up mid-stream; every completed one equals the same
    request sent alone, and afterwards no lens bytes are held anywhere."""
    import asyncio

    from tests.integration.soak import soak

    report = asyncio.run(soak(smol_server.base_url, smol_server.pid, n_requests=200))
    print(report.line())
    assert report.failures == [], report.failures[:5]
    assert report.checked == report.requests - report.disconnects == 180
    assert report.store_left == {"entries": 0, "bytes": 0}
    assert held(report.workers_left) == [IDLE] * len(report.workers_left), report.workers_left
    assert report.rss_end - report.rss_start < 200 << 20


def test_unfetched_binary_handles_expire(smol_server):
    import time

    from tests.integration.conftest import SERVER_ENV

    base = smol_server.base_url
    unfetched = [httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 4, "vllm_xargs": {
            "output_residual_stream": "true", "activations_transport": "binary"}}).json()
        for prompt in PROMPTS]
    assert httpx.get(base + "/v1/lens/stats").json()["store"]["entries"] == len(PROMPTS)
    time.sleep(float(SERVER_ENV["VLLM_LENS_HTTP_STORE_TTL_S"]) + 1)
    stats = httpx.get(base + "/v1/lens/stats").json()
    assert stats["store"] == {"entries": 0, "bytes": 0}
    url = f"/v1/lens/activations/{unfetched[0]['choices'][0]['activations']['handle']}"
    assert httpx.get(base + url).status_code == 404
    assert held(stats["workers"]) == [IDLE] * len(stats["workers"])


def _pickled_hook(ctx, hidden):
    ctx.saved["n"] = ctx.saved.get("n", 0) + hidden.shape[0]


def test_named_hook_over_http_needs_no_opt_in(client):
    """The shipped logit lens at the last layer reads the model's own next-token choice."""
    from vllm_lens import NamedHook

    result = client.generate(PROMPT, max_tokens=5, ignore_eos=True,
                             hooks=[NamedHook("logit_lens_topk", [29], {"k": 3})])
    lens = result.hook_results["0"]
    n_prompt = len(result.prompt_token_ids)
    top1 = lens["token_ids"]["29"][:, 0]
    assert lens["positions"]["29"].tolist() == list(range(n_prompt + 4))
    assert top1[n_prompt - 1:].tolist() == result.token_ids


def test_pickled_hooks_are_refused_with_403(smol_server, client):
    from vllm_lens import Hook

    with pytest.raises(LensHTTPError) as info:
        client.generate(PROMPT, max_tokens=2, hooks=[Hook(_pickled_hook, [1])])
    assert info.value.status == 403 and "VLLM_LENS_ALLOW_PICKLED_HOOKS" in info.value.message
    with pytest.raises(LensHTTPError) as info:
        client.register_hooks([Hook(_pickled_hook, [1])])
    assert info.value.status == 403
    assert client.generate(PROMPT, max_tokens=2).text  # still serving


def test_persistent_named_hooks_over_http(client):
    from vllm_lens import NamedHook

    n_prompt = len(client.generate(PROMPT, max_tokens=1).prompt_token_ids)
    client.register_hooks([NamedHook("linear_probe", [5], {"weight": [0.01] * 576})])
    try:
        result = client.generate(PROMPT, max_tokens=3, ignore_eos=True)
        collected = client.collect_hook_results()
        (mine,) = [v for k, v in collected.items() if k.startswith(result.raw["id"])]
        assert mine["0"]["scores"]["5"].shape == (n_prompt + 2,)
        assert client.collect_hook_results().keys() == collected.keys()
        client.clear_hook_results()
        assert client.collect_hook_results() == {}
    finally:
        client.clear_hooks()
    client.generate(PROMPT, max_tokens=2)
    assert client.collect_hook_results() == {}


def test_operator_settings_pickled_hooks_and_a_full_binary_store(tiny_path):
    """A server whose operator allows pickled hooks and keeps a small binary store: hooks run,
    routes not opted into are 403; a full store refuses the newcomer (503 naming the setting)
    and keeps every handle it holds readable."""
    from tests.integration.server import running_server
    from vllm_lens import Hook

    env = {"VLLM_LENS_ALLOW_PICKLED_HOOKS": "1", "VLLM_LENS_HTTP_STORE_MAX_BYTES": str(48 << 10),
           "VLLM_LENS_WORKER_MAX_BYTES": str(64 << 10)}
    with running_server(tiny_path, "--enforce-eager", env=env) as server, \
            LensClient(server.base_url) as c:
        _full_store_refuses_the_newcomer(server.base_url)
        _full_worker_budget_refuses_the_newcomer(server.base_url)
        result = c.generate(PROMPT, max_tokens=3, ignore_eos=True,
                            hooks=[Hook(_pickled_hook, [1])])
        assert result.hook_results == {"0": {"n": len(result.prompt_token_ids) + 2}}
        with pytest.raises(LensHTTPError) as info:  # this server did not enable /v1/hooks
            c.collect_hook_results()
        assert info.value.status == 403 and "VLLM_LENS_ALLOW_PERSISTENT_HOOKS" in info.value.message
        with pytest.raises(LensHTTPError) as info:  # nor the steering-preset routes
            c.register_steering("any", [SteeringVector(activations=torch.ones(1, 128),
                                                       layer_indices=[1])])
        assert info.value.status == 403 and "VLLM_LENS_ALLOW_STEERING_ROUTES" in info.value.message
        assert c.steering_presets() == []  # listing needs no opt-in; no presets file here

        def broken(ctx, hidden):
            raise RuntimeError("broken on purpose")

        with pytest.raises(LensHTTPError) as info:
            c.generate(PROMPT, max_tokens=2, hooks=[Hook(broken, [1])])
        assert info.value.status == 500 and "broken on purpose" in info.value.message
        assert info.value.param == "apply_hooks"
        assert c.generate(PROMPT, max_tokens=2).text is not None  # still serving, same connection
        _stopped_mid_stream_quietly(server)


def _stream_until_first_chunk(server, lines: list[str]):
    """Start a long stream that captures rows with every chunk; return its thread once the
    first chunk arrived (every line it reads goes to ``lines``)."""
    import threading

    first = threading.Event()

    def stream() -> None:
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60, json={
                    "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True,
                    "vllm_xargs": {"output_residual_stream": [1], "stream_activations": "true"},
            }) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    first.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first.wait(60), "the stream did not start"
    return client


@pytest.mark.slow
def test_an_engine_that_dies_mid_stream_is_an_error_not_a_stop(tiny_path):
    """The engine process killed while a lens request streams: the client gets an error event
    (an engine failure is never passed off as a deliberate stop)."""
    import signal

    from tests.integration.server import running_server

    with running_server(tiny_path, "--enforce-eager") as server:
        lines: list[str] = []
        client = _stream_until_first_chunk(server, lines)
        cores = [pid for pid in _children(server.pid) if b"EngineCore" in _cmdline(pid)]
        assert cores, "no engine core process found"
        for pid in cores:
            os.kill(pid, signal.SIGKILL)
        client.join(60)
        assert not client.is_alive()
        errors = [json.loads(line.removeprefix("data: ")) for line in lines
                  if line.startswith("data: {") and '"error"' in line]
        assert errors and "EngineCore" in errors[-1]["error"]["message"], lines[-3:]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _stopped_mid_stream_quietly(server) -> None:
    """Ctrl-C while a request streams its rows: the server stops without an EngineDeadError
    or any other traceback from vllm-lens (vLLM's own requests end cancelled then; the
    resource tracker's shared-memory warning, vLLM's own, may still follow)."""
    import signal

    client = _stream_until_first_chunk(server, [])
    start = len(server.log_tail(10**9))
    os.kill(server.pid, signal.SIGINT)
    client.join(60)
    assert not client.is_alive(), "the stream did not end"
    deadline = time.monotonic() + 60
    while not _exited(server.pid):
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.5)
    after = server.log_tail(10**9)[start:]
    assert "Application shutdown complete" in after
    for noise in ("Traceback", "EngineDeadError", "Task exception was never retrieved"):
        assert noise not in after, after[-3000:]


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: it has exited
    except FileNotFoundError:
        return True


def _full_worker_budget_refuses_the_newcomer(base: str) -> None:
    """Two samples of one request, each reserving ~48 KiB of a 64 KiB worker budget: the
    second sample's captures are refused when it first runs (503 naming the setting); the
    same capture with one sample is served, and the worker holds nothing afterwards."""
    body = {"prompt": "The capital of France is a city", "max_tokens": 40, "temperature": 1.0,
            "ignore_eos": True, "n": 2,
            "vllm_xargs": {"output_residual_stream": json.dumps([0, 1])}}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 503, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == "VLLM_LENS_WORKER_MAX_BYTES", err
    assert "refused its capture" in err["message"] and "steering and hooks ran" in err["message"]
    one = httpx.post(base + "/v1/completions", json={**body, "n": 1}, timeout=120)
    assert one.status_code == 200, one.text[:300]
    time.sleep(1.2)  # the route caches the workers' stats for about a second
    stats = httpx.get(base + "/v1/lens/stats").json()
    assert stats["workers"][0]["bytes"] == 0 and stats["workers"][0]["records"] == 0, stats


def _full_store_refuses_the_newcomer(base: str) -> None:
    # All 4 layers at ~12 positions, 2 KiB each per layer: ~20 KB a response (random floats
    # hardly compress); two fit in 48 KiB, the third does not.
    body = {"prompt": "The capital of France is a city", "max_tokens": 4, "temperature": 0,
            "vllm_xargs": {"output_residual_stream": "true", "activations_transport": "binary"}}
    handles = []
    for _ in range(4):
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        if r.status_code != 200:
            break
        handles.append(r.json()["choices"][0]["activations"]["handle"])
    assert r.status_code == 503 and len(handles) >= 1, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == "VLLM_LENS_HTTP_STORE_MAX_BYTES" and "do not fit" in err["message"]
    stream = httpx.post(base + "/v1/completions", json={**body, "stream": True}, timeout=120)
    assert '"VLLM_LENS_HTTP_STORE_MAX_BYTES"' in stream.text and "[DONE]" in stream.text
    rows = {**body, "stream": True, "vllm_xargs": {**body["vllm_xargs"],
                                                   "stream_activations": "true"}}
    stream = httpx.post(base + "/v1/completions", json=rows, timeout=120)  # rows mid-stream
    assert '"VLLM_LENS_HTTP_STORE_MAX_BYTES"' in stream.text, stream.text[-500:]
    assert stream.text.rstrip().endswith("data: [DONE]")
    for handle in handles:  # nothing held was evicted: each is fetched (and freed)
        fetched = httpx.post(base + "/v1/lens/activations/fetch", json={"handle": handle},
                             timeout=60)
        assert fetched.status_code == 200 and len(fetched.content) > 10_000
    again = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert again.status_code == 200, again.text[:300]  # room again
    assert httpx.get(base + "/v1/lens/stats").json()["store"]["entries"] == 1


@pytest.mark.parametrize("transport", ["json", "binary"])
def test_points_and_qk_over_http_equal_offline(client, smol_llm, transport):
    from vllm_lens.attention import attention_patterns

    points = {"attn_out": [3], "mlp_post": {"layers": [3], "positions": "last_prompt"}}
    result = client.generate(PROMPT, max_tokens=4, output_activations=points, output_qk=[3],
                             transport=transport)
    sp = SamplingParams(max_tokens=4, temperature=0, extra_args={
        "output_activations": points, "output_qk": [3]})
    offline = smol_llm.generate([{"prompt_token_ids": result.prompt_token_ids}], sp)[0]
    assert result.token_ids == list(offline.outputs[0].token_ids)
    for name in ("attn_out", "mlp_post", "attn_q", "attn_k"):
        got, expected = result.activations[name], offline.activations[name]
        assert got.shape == expected.shape, name
        assert max_relative_error(got.flatten(2), expected.flatten(2)) <= TOL, name
        assert torch.equal(result.activations[f"{name}_positions"],
                           offline.activations[f"{name}_positions"])
    assert result.activations["qk_meta"] == offline.activations["qk_meta"]
    torch.testing.assert_close(attention_patterns(result.activations, 3),
                               attention_patterns(offline.activations, 3))


def test_points_through_the_openai_sdk(smol_server):
    sdk = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="none")
    model = sdk.models.list().data[0].id
    completion = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, temperature=0,
        extra_body={"vllm_xargs": {"output_activations": '{"blocks.5.hook_resid_mid": true}',
                                   "output_qk": "[5]"}})
    acts = decode_activations(completion)
    assert acts["resid_mid"].shape[:2] == (1, acts["positions"].numel())
    assert acts["attn_k"].shape[2:] == (3, 64) and acts["qk_layers"] == [5]
    with pytest.raises(openai.BadRequestError, match="unknown tap point"):
        sdk.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={
            "vllm_xargs": {"output_activations": '{"attn": true}'}})


@pytest.mark.parametrize("transport", ["json", "binary"])
def test_streamed_rows_arrive_with_the_chunks_and_add_up_to_the_capture(smol_server, client,
                                                                        transport):
    """With ``stream_activations``, every SSE chunk of a choice carries the rows computed
    since its previous chunk and the last chunk the rest: laid end to end, they equal the
    same request's capture without streaming (completions with the sync client, chat with
    the async one)."""
    import asyncio

    capture = {"layers": [3, 11]}
    whole = client.generate(PROMPT, max_tokens=6, capture=capture)
    parts = list(client.generate(PROMPT, max_tokens=6, capture=capture, stream=True,
                                 stream_activations=True, transport=transport))
    with_rows = [p for p in parts if p.activations is not None]
    assert len(with_rows) >= 3  # the prompt's rows with the first token, then per chunk (vLLM
    # merges the chunks of a consumer that falls behind, so not always one per token)
    rows = torch.cat([p.activations["residual_stream"] for p in with_rows], dim=1)
    positions = torch.cat([p.activations["positions"] for p in with_rows])
    assert positions.tolist() == whole.activations["positions"].tolist()
    assert max_relative_error(rows, whole.activations["residual_stream"]) <= TOL
    assert with_rows[0].activations["positions"].tolist() == list(
        range(len(whole.prompt_token_ids)))
    assert "".join(p.delta for p in parts) == whole.text

    async def chat():
        async with AsyncLensClient(smol_server.base_url) as ac:
            full = await ac.chat(MESSAGES, max_tokens=5, capture=capture)
            streamed = [r async for r in await ac.chat(
                MESSAGES, max_tokens=5, capture=capture, stream=True, stream_activations=True)]
            return full, streamed

    full, streamed = asyncio.run(chat())
    got = [p.activations for p in streamed if p.activations is not None]
    assert len(got) >= 3
    assert max_relative_error(torch.cat([a["residual_stream"] for a in got], dim=1),
                              full.activations["residual_stream"]) <= TOL
    assert httpx.get(smol_server.base_url + "/v1/lens/stats").json()["store"]["entries"] == 0
