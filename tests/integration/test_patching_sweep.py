"""Activation-patching sweeps (``patching_sweep``): every cell equals transformers with hooks
that add the same corruption and write the same clean row (also a corruption steering by SAE
feature); bad sweeps fail alone."""

import math

import pytest
import torch

from tests.integration.saes import saved_sae
from tests.integration.test_steering import TINY_PROMPT, _direction, _prompt_ids
from vllm_lens import LensRequestError, SteeringVector

LAYERS = [0, 3]  # the tiny model's first and last layers


def _setup(llm, ref):
    ids = _prompt_ids(llm, TINY_PROMPT)[:12]
    clean_run = ref.points(ids)
    positions = [1, 2, len(ids) - 1]
    clean = torch.stack([torch.stack([clean_run[("resid_post", layer)][p] for p in positions])
                         for layer in LAYERS])
    noise = torch.stack([_direction(128, 70 + p, 6.0) for p in (1, 2)])
    corrupt = [SteeringVector(activations=noise[None], layer_indices=[-1],
                              position_indices=[1, 2])]
    return ids, positions, clean, noise, corrupt


def _reference_metric(ref, ids, noise, patch, a, b):
    def corrupt(value):
        value = value.clone()
        value[1:3] += noise
        return value

    edits = {("resid_pre", 0): corrupt}
    if patch is not None:
        layer, position, row = patch

        def write(value):
            value = value.clone()
            value[position] = row
            return value
        edits[("resid_post", layer)] = write
    with torch.no_grad(), ref.point_hooks(edits):
        logits = ref.model(torch.tensor([ids])).logits[0, -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return float(logprobs[a] - logprobs[b])


def test_sweep_cells_equal_transformers_with_hooks(tiny_llm, tiny_ref):
    assert len(tiny_ref.layers) == LAYERS[-1] + 1
    ids, positions, clean, noise, corrupt = _setup(tiny_llm, tiny_ref)
    a, b = 17, 42
    out = tiny_llm.patching_sweep(ids, clean, LAYERS, positions, {"logit_diff": [a, b]},
                                  corrupt=corrupt)
    assert out["grid"].shape == (len(LAYERS), len(positions))
    assert out["layers"] == LAYERS and out["positions"] == positions
    expected = torch.tensor([[_reference_metric(tiny_ref, ids, noise, (layer, p, clean[i, j]),
                                                a, b) for j, p in enumerate(positions)]
                             for i, layer in enumerate(LAYERS)], dtype=torch.float64)
    torch.testing.assert_close(out["grid"], expected, rtol=1e-3, atol=1e-3)
    assert math.isclose(out["corrupted"], _reference_metric(tiny_ref, ids, noise, None, a, b),
                        rel_tol=1e-3, abs_tol=1e-3)
    # The clean stream restored at the last position after the last layer: the clean run.
    assert math.isclose(float(out["grid"][1, 2]), out["uncorrupted"], rel_tol=1e-4,
                        abs_tol=1e-4)
    assert abs(out["corrupted"] - out["uncorrupted"]) > 1e-2  # the corruption matters
    # The same sweep by text, with a probability metric.
    by_text = tiny_llm.patching_sweep(TINY_PROMPT, torch.zeros(1, 1, 128), [1], [0],
                                      {"prob": a})
    assert 0 < float(by_text["grid"][0, 0]) < 1


def _logit_diff(ref, ids, edits, a, b):
    with torch.no_grad(), ref.point_hooks(edits):
        logits = ref.model(torch.tensor([ids])).logits[0, -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return float(logprobs[a] - logprobs[b])


def test_a_sweep_corrupting_by_sae_feature_equals_transformers_with_hooks(tiny_llm, tiny_ref,
                                                                          tmp_path):
    """``corrupt`` may steer by SAE feature: a ``scale`` item sweeps exactly as the steering
    vector its decoder row makes; a ``clamp`` item gives every cell of transformers with the
    clamp and the patch in hooks; a clamp where the sweep patches is refused by field."""
    path = tmp_path / "resid"
    sae = saved_sae(path, "jumprelu", "blocks.2.hook_resid_post")
    ids, positions, clean, _, _ = _setup(tiny_llm, tiny_ref)
    a, b = 17, 42
    sweep = (ids, clean, LAYERS, positions, {"logit_diff": [a, b]})
    W_dec = sae.W_dec.detach()
    by_feature = tiny_llm.patching_sweep(*sweep, corrupt=[
        {"sae": str(path), "feature": 11, "scale": 40.0}])
    by_vector = tiny_llm.patching_sweep(*sweep, corrupt=[
        SteeringVector(activations=W_dec[11:12], layer_indices=[2], scale=40.0)])
    torch.testing.assert_close(by_feature["grid"], by_vector["grid"], rtol=1e-5, atol=1e-5)
    assert math.isclose(by_feature["corrupted"], by_vector["corrupted"], abs_tol=1e-5)
    assert abs(by_feature["corrupted"] - by_feature["uncorrupted"]) > 1e-2

    features, targets = torch.tensor([11, 300]), torch.tensor([6.0, 0.0])

    def clamp(x):
        with torch.no_grad():
            return x + (targets - sae.encode(x)[:, features]) @ W_dec[features]

    def write(position, row):
        def edit(value):
            value = value.clone()
            value[position] = row
            return value
        return edit

    item = {"sae": str(path), "feature": features.tolist(), "clamp": targets.tolist()}
    clamped = tiny_llm.patching_sweep(*sweep, corrupt=[item])
    expected = torch.tensor([[_logit_diff(tiny_ref, ids, {
        ("resid_post", 2): clamp, ("resid_post", layer): write(p, clean[i, j])}, a, b)
        for j, p in enumerate(positions)] for i, layer in enumerate(LAYERS)],
        dtype=torch.float64)
    torch.testing.assert_close(clamped["grid"], expected, rtol=1e-3, atol=1e-3)
    corrupted = _logit_diff(tiny_ref, ids, {("resid_post", 2): clamp}, a, b)
    assert math.isclose(clamped["corrupted"], corrupted, rel_tol=1e-3, abs_tol=1e-3)
    assert abs(clamped["corrupted"] - clamped["uncorrupted"]) > 1e-2  # the clamp matters
    with pytest.raises(LensRequestError, match="only clamp or replacement") as info:
        tiny_llm.patching_sweep(ids, clean[:1], [2], positions, {"logit_diff": [a, b]},
                                corrupt=[item])
    assert info.value.field == "corrupt[0].clamp"


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(layers=[0, 9]), "layers[1]"),
    (dict(positions=[1, 400]), "positions[1]"),
    (dict(clean=torch.zeros(2, 2, 128)), "clean"),
    (dict(metric={"logit_diff": [1]}), "metric.logit_diff"),
    (dict(metric={"entropy": 1}), "metric"),
    (dict(metric={"prob": 10 ** 9}), "metric.prob"),
    (dict(point="embed"), "point"),
    (dict(point="mlp_post"), "point[0].hook_point"),
    (dict(corrupt=[SteeringVector(activations=torch.ones(1, 64), layer_indices=[0])]),
     "corrupt[0].activations"),
])
def test_bad_sweeps_name_the_field(tiny_llm, kwargs, field):
    args = dict(prompt=_prompt_ids(tiny_llm, TINY_PROMPT)[:12], clean=torch.zeros(2, 3, 128),
                layers=[0, 2], positions=[1, 2, 3], metric={"logit_diff": [1, 2]})
    args.update(kwargs)
    with pytest.raises(LensRequestError) as info:
        tiny_llm.patching_sweep(**args)
    assert info.value.field == field


def test_sweep_over_http_equals_offline(smol_server, smol_llm):
    from vllm_lens.client import LensClient, LensHTTPError

    prompt = "The Eiffel Tower is located in the city of"
    ids = _prompt_ids(smol_llm, prompt)
    clean = torch.randn(2, 2, 576, generator=torch.Generator().manual_seed(3)) * 5
    corrupt = [SteeringVector(activations=_direction(576, 80, 30.0)[None, None],
                              layer_indices=[-1], position_indices=[2])]
    args = (ids, clean, [4, 20], [2, len(ids) - 1], {"logit_diff": [12366, 5210]})
    offline = smol_llm.patching_sweep(*args, corrupt=corrupt)
    with LensClient(smol_server.base_url) as client:
        online = client.patching_sweep(*args, corrupt=corrupt)
        torch.testing.assert_close(online["grid"], offline["grid"], rtol=1e-4, atol=1e-4)
        assert math.isclose(online["corrupted"], offline["corrupted"], abs_tol=1e-4)
        with pytest.raises(LensHTTPError) as info:
            client.patching_sweep(ids, clean, [4, 20], [2, 999], {"prob": 5})
        assert info.value.status == 400 and info.value.param == "positions[1]"
        assert client.generate("Hello", max_tokens=2).text is not None  # serving on


def test_a_sweep_over_http_corrupts_by_the_servers_named_sae(smol_server, smol_llm, smol_sae):
    """Over HTTP a sweep's ``corrupt`` steers by features of an SAE the server serves by
    name, with the grid of the same sweep offline by the SAE's directory; a directory sent
    over HTTP is refused naming the field."""
    from vllm_lens.client import LensClient, LensHTTPError

    ids = _prompt_ids(smol_llm, "The Eiffel Tower is located in the city of")
    clean = torch.randn(2, 2, 576, generator=torch.Generator().manual_seed(3)) * 5
    sweep = (ids, clean, [4, 20], [2, len(ids) - 1], {"logit_diff": [12366, 5210]})
    by_name = [{"sae": "smol-l10", "feature": 21, "scale": 30.0},
               {"sae": "smol-l10", "feature": [5, 9], "clamp": [4.0, 0.0]}]
    by_path = [{**item, "sae": str(smol_sae[0])} for item in by_name]
    offline = smol_llm.patching_sweep(*sweep, corrupt=by_path)
    assert abs(offline["corrupted"] - offline["uncorrupted"]) > 1e-2
    with LensClient(smol_server.base_url) as client:
        online = client.patching_sweep(*sweep, corrupt=by_name)
        torch.testing.assert_close(online["grid"], offline["grid"], rtol=1e-4, atol=1e-4)
        assert math.isclose(online["corrupted"], offline["corrupted"], abs_tol=1e-4)
        with pytest.raises(LensHTTPError) as info:
            client.patching_sweep(*sweep, corrupt=by_path)
        assert info.value.status == 400 and info.value.param == "corrupt[0].sae"
        assert "cannot name a path" in info.value.message


def test_sweeps_past_the_cell_limit_are_refused_before_running(tiny_llm, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_MAX_SWEEP_CELLS", "5")
    with pytest.raises(LensRequestError, match="6 cells, above this engine's limit of 5"):
        tiny_llm.patching_sweep([1, 2, 3, 4], torch.zeros(2, 3, 128), [0, 1], [0, 1, 2],
                                {"prob": 1})
    monkeypatch.setenv("VLLM_LENS_MAX_SWEEP_CELLS", "4096")
    monkeypatch.setenv("VLLM_LENS_MAX_DECODED_BYTES", str(64 << 10))  # ~one corrupt x 100
    big = SteeringVector(activations=torch.randn(1, 4, 128), layer_indices=[-1])
    with pytest.raises(LensRequestError, match="VLLM_LENS_MAX_DECODED_BYTES") as info:
        tiny_llm.patching_sweep([1, 2, 3, 4], torch.zeros(4, 4, 128) + 0.1, [0, 1, 2, 3],
                                [0, 1, 2, 3], {"prob": 1}, corrupt=[big] * 10)
    assert info.value.field == "corrupt"
    # Charged decoded: zeros compress to almost nothing, but each variant carries them whole.
    zeros = SteeringVector(activations=torch.zeros(4, 8, 128), layer_indices=[0, 1, 2, 3])
    with pytest.raises(LensRequestError, match="VLLM_LENS_MAX_DECODED_BYTES"):
        tiny_llm.patching_sweep([1, 2, 3, 4], torch.zeros(4, 4, 128) + 0.1, [0, 1, 2, 3],
                                [0, 1, 2, 3], {"prob": 1}, corrupt=[zeros])


def test_sweep_route_is_bounded_limited_and_cancelled_with_its_client(smol_server):
    """A sweep body past VLLM_LENS_MAX_REQUEST_BYTES is a 413 before it is read whole; a
    third concurrent sweep is a 429 naming VLLM_LENS_MAX_CONCURRENT_SWEEPS; sweeps whose
    clients give up are cancelled (their thousands of engine requests aborted, not run for
    nobody): their slots free up, the workers hold nothing, and the server serves on."""
    import threading

    import httpx

    from vllm_lens.client import _sweep_body

    base = smol_server.base_url
    url = base + "/v1/lens/patching_sweep"
    r = httpx.post(url, content=b"[" + b" " * (2 << 20) + b"]", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "VLLM_LENS_MAX_REQUEST_BYTES" in r.text, r.text[:300]
    # 30 layers x 100 positions = 3,000 engine requests of 100 tokens each: minutes of work.
    ids = list(range(1000, 1100))
    body = _sweep_body(ids, torch.full((30, 100, 576), 0.5), list(range(30)),
                       list(range(100)), {"prob": 5}, None, "resid_post")
    outcomes = {}

    def leaving_client(i):
        try:
            r = httpx.post(url, json=body, timeout=20)
            outcomes[i] = (r.status_code, r.text[:300])  # not expected: reported below
        except httpx.TimeoutException:
            outcomes[i] = "gave up"

    clients = [threading.Thread(target=leaving_client, args=(i,)) for i in range(2)]
    for c in clients:
        c.start()
    small_body = _sweep_body(ids[:4], torch.zeros(1, 1, 576), [3], [1], {"prob": 5}, None,
                             "resid_post")
    while any(c.is_alive() for c in clients):  # until both big sweeps run
        if httpx.get(base + "/v1/lens/stats", timeout=30).json()["sweeps"] == 2:
            break
        threading.Event().wait(0.2)
    third = httpx.post(url, json=small_body, timeout=60)
    for c in clients:
        c.join()
    assert outcomes == {0: "gave up", 1: "gave up"}, outcomes
    assert third.status_code == 429, third.text[:300]
    assert "VLLM_LENS_MAX_CONCURRENT_SWEEPS=2" in third.json()["error"]["message"]
    small = None
    for _ in range(120):  # the cancelled sweeps give their slots back
        small = httpx.post(url, json=small_body, timeout=120)
        if small.status_code != 429:
            break
        threading.Event().wait(0.5)
    assert small.status_code == 200, small.text[:300]
    stats = httpx.get(base + "/v1/lens/stats", timeout=30).json()
    assert all(w["entries"] == 0 and w["records"] == 0 for w in stats["workers"]), stats
    assert stats["sweeps"] == 0
