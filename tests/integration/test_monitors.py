"""Monitors (``extra_args["monitors"]``, ``spec.monitors``): a probe's score at every computed
position equals the one computed from transformers' rows; a ``stop`` monitor ends the
generation right after the first position where that reference crosses the threshold (on a
generated token, or on the prompt: no visible token), with ``stop_reason`` its name; a ``flag``
monitor reports and lets it go on; a plain request in the same batch is untouched; bad
monitors are refused naming the field, offline and over HTTP (streaming included). Monitors
read a probe, an SAE feature, or a named hook's score (``linear_probe``,
``attention_to_span``)."""

import json

import httpx
import pytest
import torch
from vllm import SamplingParams

from tests.integration.test_steering import TINY_PROMPT
from vllm_lens import LensRequestError

LAYER = 2
TOL = 1e-3


def _probe(seed: int, hidden: int) -> torch.Tensor:
    return torch.randn(hidden, generator=torch.Generator().manual_seed(seed))


def _reference_scores(ref, ids, probe, bias, layer=LAYER, point="resid_post"):
    rows = ref.points(ids)[(point, layer)].float()
    return rows @ probe + bias


def _crossing(scores: torch.Tensor, start: int) -> tuple[int, float]:
    """A position at or after ``start`` that is a new maximum of the scores by the widest
    margin, and a threshold halfway between it and the maximum before it."""
    best = None
    for j in range(start, len(scores)):
        margin = float(scores[j] - scores[:j].max())
        if margin > 0 and (best is None or margin > best[1]):
            best = (j, margin)
    assert best is not None, "no score rises above all earlier ones"
    j, margin = best
    return j, float(scores[:j].max()) + margin / 2


def _monitor(name, probe, threshold, action, bias=0.0, layer=LAYER, point="resid_post"):
    return {"name": name, "probe": probe.tolist(), "bias": bias, "layer": layer,
            "point": point, "threshold": threshold, "action": action}


def test_a_stop_monitor_ends_after_the_first_crossing_and_flag_reports_it(tiny_llm, tiny_ref):
    eos = tiny_llm.get_tokenizer().eos_token_id
    plain_sp = SamplingParams(max_tokens=12, temperature=0)
    plain = tiny_llm.generate([TINY_PROMPT], plain_sp)[0]
    ids = list(plain.prompt_token_ids) + list(plain.outputs[0].token_ids)
    n_prompt = len(plain.prompt_token_ids)
    # A probe pointing from the earlier rows' mean to the row of a generated position, so
    # that its score rises to a new high there.
    rows = tiny_ref.points(ids[:-1])[("resid_post", LAYER)].float()
    target = n_prompt + 3
    probe = rows[target] - rows[:target].mean(0)
    probe = probe / probe.norm()
    bias = 0.25
    scores = _reference_scores(tiny_ref, ids[:-1], probe, bias)
    position, threshold = _crossing(scores, n_prompt + 1)
    stop = SamplingParams(max_tokens=12, temperature=0, extra_args={"monitors": [
        _monitor("rising", probe, threshold, "stop", bias)]})
    flag = SamplingParams(max_tokens=12, temperature=0, extra_args={"monitors": [
        _monitor("rising", probe, threshold, "flag", bias)]})
    stopped, beside, flagged = tiny_llm.generate([TINY_PROMPT] * 3, [stop, plain_sp, flag])

    # Stop: every token up to the one at ``position`` (fed through the model in the step
    # that fired), then the end-of-sequence token, which ends it.
    kept = ids[n_prompt:position + 1]
    assert list(stopped.outputs[0].token_ids) == [*kept, eos]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == "rising"
    record = stopped.monitors[0]
    assert record["fired"] and record["position"] == position
    assert abs(record["score"] - float(scores[position])) <= TOL * scores.abs().max()
    assert list(beside.outputs[0].token_ids) == ids[n_prompt:]  # untouched beside it
    assert beside.monitors is None

    # Flag: the generation goes on; the scores are the reference's at every position.
    assert list(flagged.outputs[0].token_ids) == ids[n_prompt:]
    assert flagged.outputs[0].stop_reason != "rising"
    record = flagged.monitors[0]
    assert record["fired"] and record["position"] == position and record["action"] == "flag"
    assert record["positions"].tolist() == list(range(len(ids) - 1))
    assert (record["scores"] - scores).abs().max() <= TOL * scores.abs().max()
    assert flagged.outputs[0].monitors is flagged.monitors


def test_a_stop_monitor_on_the_prompt_generates_nothing_visible(tiny_llm, tiny_ref):
    probe = _probe(6, 128)
    ids = list(tiny_llm.generate([TINY_PROMPT], SamplingParams(max_tokens=1))[0]
               .prompt_token_ids)
    scores = _reference_scores(tiny_ref, ids, probe, 0.0)
    threshold = float(scores[:4].max() + scores[4:].max()) / 2 \
        if scores[:4].max() < scores[4:].max() else float(scores.min()) - 1.0
    first = int((scores > threshold).nonzero()[0, 0])
    sp = SamplingParams(max_tokens=8, temperature=0, extra_args={"monitors": [
        _monitor("prompt-guard", probe, threshold, "stop")]})
    out = tiny_llm.generate([TINY_PROMPT], sp)[0]
    assert out.outputs[0].text == ""
    assert list(out.outputs[0].token_ids) == [tiny_llm.get_tokenizer().eos_token_id]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "prompt-guard"
    assert out.monitors[0]["position"] == first < len(ids)


def test_a_monitor_by_sae_feature_scores_and_stops_like_sae_lens(tiny_llm, tiny_ref,
                                                                 tmp_path):
    """A JumpReLU SAE (saved by sae-lens) at layer 2's stream: a ``flag`` monitor's scores
    are sae-lens' ``encode`` of transformers' rows for the feature, and a ``stop`` monitor
    ends right after the first position where they cross; a TopK SAE's feature is refused
    naming the field."""
    from tests.integration.saes import saved_sae

    path = tmp_path / "jumprelu"
    sae = saved_sae(path, "jumprelu", f"blocks.{LAYER}.hook_resid_post")
    eos = tiny_llm.get_tokenizer().eos_token_id
    plain = tiny_llm.generate([TINY_PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
    ids = list(plain.prompt_token_ids) + list(plain.outputs[0].token_ids)
    n_prompt = len(plain.prompt_token_ids)
    rows = tiny_ref.points(ids[:-1])[("resid_post", LAYER)].float()
    with torch.no_grad():
        acts = sae.encode(rows)  # [positions, d_sae]
    # The feature that rises to a new high on a generated position by the widest margin.
    margins = acts[n_prompt + 1:].max(0).values - acts[:n_prompt + 1].max(0).values
    feature = int(margins.argmax())
    assert float(margins[feature]) > 0
    scores = acts[:, feature]
    position, threshold = _crossing(scores, n_prompt + 1)
    monitor = {"name": "feature", "sae": str(path), "feature": feature,
               "threshold": threshold}
    stopped, flagged = tiny_llm.generate([TINY_PROMPT] * 2, [
        SamplingParams(max_tokens=12, temperature=0,
                       extra_args={"monitors": [{**monitor, "action": "stop"}]}),
        SamplingParams(max_tokens=12, temperature=0,
                       extra_args={"monitors": json.dumps([{**monitor, "action": "flag"}])})])
    assert list(stopped.outputs[0].token_ids) == [*ids[n_prompt:position + 1], eos]
    assert stopped.outputs[0].stop_reason == "feature"
    assert stopped.monitors[0]["position"] == position
    assert list(flagged.outputs[0].token_ids) == ids[n_prompt:]
    got = flagged.monitors[0]["scores"]
    assert (got - scores).abs().max() <= TOL * scores.abs().max(), (got, scores)
    topk = tmp_path / "topk"
    saved_sae(topk, "topk", f"blocks.{LAYER}.hook_resid_post", k=8)
    with pytest.raises(LensRequestError, match=r"monitors\[0\]\.sae.*topk"):
        tiny_llm.generate([TINY_PROMPT], SamplingParams(max_tokens=2, extra_args={
            "monitors": [{**monitor, "sae": str(topk), "action": "flag"}]}))
    with pytest.raises(LensRequestError, match=r"monitors\[0\]\.feature"):
        tiny_llm.generate([TINY_PROMPT], SamplingParams(max_tokens=2, extra_args={
            "monitors": [{**monitor, "feature": 512, "action": "flag"}]}))


def test_monitors_by_a_named_hooks_score_stop_like_the_reference(tiny_llm, tiny_ref):
    """By ``linear_probe``'s score at ``resid_post`` and by ``attention_to_span``'s mass at
    ``attn_qk`` (the largest head's, on generated queries): a
    ``flag`` monitor reports transformers' scores, a ``stop`` monitor ends right after the
    first position where they cross, and a plain request beside them is untouched. The
    monitors' hooks' rows are theirs: ``hook_results`` holds the request's own hooks only."""
    eos = tiny_llm.get_tokenizer().eos_token_id
    plain_sp = SamplingParams(max_tokens=12, temperature=0)
    plain = tiny_llm.generate([TINY_PROMPT], plain_sp)[0]
    ids = list(plain.prompt_token_ids) + list(plain.outputs[0].token_ids)
    n_prompt = len(plain.prompt_token_ids)
    seen = tiny_ref.points(ids[:-1], attentions=True)
    rows = seen[("resid_post", LAYER)].float()
    target = n_prompt + 3
    probe = rows[target] - rows[:target].mean(0)
    probe = probe / probe.norm()
    probe_scores = rows @ probe - 0.5
    probe_at, probe_threshold = _crossing(probe_scores, n_prompt + 1)
    # The largest head's mass on the first eight generated positions, from generated queries:
    # it grows while more of the span becomes visible (the tiny random model attends almost
    # evenly), so it rises to new highs.
    weights = seen[("attn", 1)].float()  # [heads, T, T], eager attention
    span = [n_prompt, n_prompt + 8]
    span_scores = weights[:, n_prompt:, span[0]:span[1]].sum(-1).amax(0)
    span_at, span_threshold = _crossing(span_scores, 1)
    span_at += n_prompt

    def monitors(action):
        return [{"name": "probe", "hook": "linear_probe", "layer": LAYER,
                 "args": {"weight": probe.tolist(), "bias": -0.5}, "threshold":
                 probe_threshold if action == "stop" else 1e9, "action": action},
                {"name": "span", "hook": "attention_to_span", "layer": 1, "point": "attn_qk",
                 "args": {"span": span, "queries": "generated"},
                 "reduce": "max", "threshold": span_threshold if action == "stop" else 1e9,
                 "action": action}]

    from vllm_lens import NamedHook

    same_probe = NamedHook("linear_probe", [LAYER], {"weight": probe.tolist(), "bias": -0.5})
    flag_sp = SamplingParams(max_tokens=12, temperature=0, extra_args={
        "monitors": monitors("flag"), "apply_hooks": [same_probe]})
    by_probe = SamplingParams(max_tokens=12, temperature=0,
                              extra_args={"monitors": monitors("stop")[:1]})
    by_span = SamplingParams(max_tokens=12, temperature=0,
                             extra_args={"monitors": json.dumps(monitors("stop")[1:])})
    flagged, beside, stopped_probe, stopped_span = tiny_llm.generate(
        [TINY_PROMPT] * 4, [flag_sp, plain_sp, by_probe, by_span])

    assert list(flagged.outputs[0].token_ids) == ids[n_prompt:]
    assert list(beside.outputs[0].token_ids) == ids[n_prompt:] and beside.monitors is None
    probe_record, span_record = flagged.monitors
    # The request's own hook beside its monitors' (which are not in hook_results).
    assert list(flagged.hook_results) == ["0"] and flagged.hook_error is None
    torch.testing.assert_close(flagged.hook_results["0"]["scores"][str(LAYER)],
                               probe_record["scores"])
    assert probe_record["positions"].tolist() == list(range(len(ids) - 1))
    assert (probe_record["scores"] - probe_scores).abs().max() <= TOL * probe_scores.abs().max()
    assert span_record["positions"].tolist() == list(range(n_prompt, len(ids) - 1))
    torch.testing.assert_close(span_record["scores"], span_scores, rtol=1e-4,
                               atol=1e-5)
    assert not probe_record["fired"] and not span_record["fired"]
    for out, at, name in ((stopped_probe, probe_at, "probe"), (stopped_span, span_at, "span")):
        assert list(out.outputs[0].token_ids) == [*ids[n_prompt:at + 1], eos], name
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == name
        assert out.monitors[0]["fired"] and out.monitors[0]["position"] == at
    for change, field in (({"hook": "logit_lens_topk", "args": {}}, r"monitors\[0\]\.hook"),
                          ({"reduce": None}, r"monitors\[0\]\.reduce")):
        with pytest.raises(LensRequestError, match=field):
            tiny_llm.generate([TINY_PROMPT], SamplingParams(max_tokens=2, extra_args={
                "monitors": [{**monitors("flag")[1], **change}]}))


@pytest.mark.parametrize(("change", "field"), [
    ({"probe": [1.0, 2.0]}, "monitors[0].probe"),
    ({"action": "halt"}, "monitors[0].action"),
    ({"threshold": float("nan")}, "monitors[0].threshold"),
    ({"layer": 99}, "monitors[0].layer"),
    ({"point": "mlp_post"}, "monitors[0].point"),
    ({"sae": "x", "feature": 3}, "monitors[0].bias"),  # a probe's fields with an SAE's
    ({"nme": "typo"}, "monitors[0].nme"),
])
def test_bad_monitors_are_refused_naming_the_field(tiny_llm, change, field):
    monitor = {**_monitor("m", torch.ones(128), 1.0, "stop"), **change}
    sp = SamplingParams(max_tokens=2, extra_args={"monitors": [monitor]})
    with pytest.raises(LensRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tiny_llm.generate([TINY_PROMPT], sp)


@pytest.mark.parametrize(("params", "field"), [
    (dict(ignore_eos=True), "monitors[0].action"),
    (dict(min_tokens=3), "monitors[0].action"),
    (dict(n=2), "monitors"),
])
def test_sampling_a_stop_monitor_cannot_end_is_refused(tiny_llm, params, field):
    sp = SamplingParams(max_tokens=4, **params, extra_args={"monitors": [
        _monitor("m", torch.ones(128), 1.0, "stop")]})
    with pytest.raises(LensRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tiny_llm.generate([TINY_PROMPT], sp)
    two = [{**_monitor("m", torch.ones(128), 1.0, "flag")}] * 2
    with pytest.raises(LensRequestError, match=r"monitors\[1\]\.name"):
        tiny_llm.generate([TINY_PROMPT], SamplingParams(max_tokens=2, extra_args={
            "monitors": two}))


def test_monitors_over_http_stream_and_stop_with_the_reason(smol_server):
    """SmolLM2 behind the OpenAI server (the real OpenAI SDK): a flag monitor's scores equal
    the captured rows' (same request); the same monitor as ``stop`` ends a streamed
    completion right after the position where those scores cross its threshold, the stream's
    last chunk saying why."""
    from openai import OpenAI

    from vllm_lens.activations import decode_json_tensors
    from vllm_lens.client import encode_xargs

    client = OpenAI(base_url=f"{smol_server.base_url}/v1", api_key="x")
    model = client.models.list().data[0].id
    prompt = "Once upon a time, in a small village by the sea, there lived"

    def complete(xargs):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0,
            extra_body={"return_token_ids": True, "vllm_xargs": encode_xargs(xargs)})

    # A probe from the rows of a first request: from the earlier rows' mean to the row of a
    # generated position, so that its score rises to a new high there.
    first = complete({"output_residual_stream": [10]}).choices[0].model_extra
    rows = decode_json_tensors(first["activations"])["residual_stream"][0].float()
    target = len(first["prompt_token_ids"]) + 3
    probe = rows[target] - rows[:target].mean(0)
    probe = probe / probe.norm()
    by_hook = {"name": "m-hook", "hook": "linear_probe", "args": {"weight": probe.tolist()},
               "layer": 10, "threshold": 1e9, "action": "flag"}
    flagged = complete({"monitors": [_monitor("m", probe, 1e9, "flag", layer=10), by_hook],
                        "output_residual_stream": [10]})
    choice = flagged.choices[0].model_extra
    record, hook_record = choice["monitors"]
    # By the named hook's score: the same probe, the same float32 scores.
    assert hook_record["name"] == "m-hook" and hook_record["positions"] == record["positions"]
    torch.testing.assert_close(torch.tensor(hook_record["scores"]),
                               torch.tensor(record["scores"]), rtol=1e-5, atol=1e-5)
    assert not record["fired"] and record["action"] == "flag"
    rows = decode_json_tensors(choice["activations"])["residual_stream"][0].float()
    expected = rows @ probe
    got = torch.tensor(record["scores"])
    assert record["positions"] == list(range(len(expected)))
    # The same rows, scored on the worker: float32 rounding apart, per position.
    assert bool(((got - expected).abs() <= 1e-4 * rows.norm(dim=-1) * probe.norm()).all())
    n_prompt = len(choice["prompt_token_ids"])
    position, threshold = _crossing(got, n_prompt + 1)
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "stream": True, "return_token_ids": True,
            "vllm_xargs": encode_xargs({"monitors": [
                _monitor("lighthouse", probe, threshold, "stop", layer=10)]})}
    chunks = []
    with httpx.stream("POST", f"{smol_server.base_url}/v1/completions", json=body,
                      timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    choices = [ch for c in chunks for ch in c.get("choices") or ()]
    finals = [ch for ch in choices if ch.get("finish_reason")]
    assert finals and finals[-1]["finish_reason"] == "stop"
    assert finals[-1].get("stop_reason") == "lighthouse"
    tokens = [t for ch in choices for t in ch.get("token_ids") or ()]
    kept = position + 1 - n_prompt
    assert tokens[:kept] == choice["token_ids"][:kept]
    assert len(tokens) == kept + 1  # and the end-of-sequence token
    records = [ch["monitors"] for ch in choices if ch.get("monitors")]
    assert records and records[-1][0]["position"] == position
    assert records[-1][0]["fired"] and records[-1][0]["name"] == "lighthouse"

    from vllm_lens.client import LensClient  # the same stop through LensClient (a tensor probe)

    with LensClient(smol_server.base_url) as lens_client:
        result = lens_client.generate(prompt, max_tokens=16, monitors=[
            {**_monitor("lighthouse", probe, threshold, "stop", layer=10), "probe": probe}])
    assert result.stop_reason == "lighthouse" and result.finish_reason == "stop"
    assert result.token_ids == tokens and result.monitors[0]["position"] == position


def test_a_monitor_by_a_served_sae_feature_over_http(smol_server, smol_sae, smol_ref):
    """``smol-l10`` (the server's SAE, by name): a flag monitor's scores are sae-lens'
    ``encode`` of transformers' rows at layer 10 for the feature; a directory instead of a
    registered name is refused naming the field."""
    from vllm_lens.client import LensClient, LensHTTPError

    prompt = "Once upon a time, in a small village by the sea, there lived"
    feature = 11
    with LensClient(smol_server.base_url) as client:
        result = client.generate(prompt, max_tokens=6, ignore_eos=True, monitors=[
            {"name": "f", "sae": "smol-l10", "feature": feature, "threshold": 1e9,
             "action": "flag"}])
        with pytest.raises(LensHTTPError, match=r"monitors\[0\]\.sae"):
            client.generate(prompt, max_tokens=2, monitors=[
                {"name": "f", "sae": str(smol_sae[0]), "feature": feature,
                 "threshold": 1.0, "action": "flag"}])
    ids = result.prompt_token_ids + result.token_ids
    rows = smol_ref.points(ids[:-1])[("resid_post", 10)].float()
    with torch.no_grad():
        expected = smol_sae[1].encode(rows)[:, feature]
    got = result.monitors[0]["scores"]
    assert float(expected.abs().max()) > 0  # the feature is active somewhere
    assert (torch.as_tensor(got) - expected).abs().max() <= TOL * expected.abs().max() + 1e-5


def test_a_bad_monitor_over_http_is_a_400_naming_the_field(smol_server):
    r = httpx.post(f"{smol_server.base_url}/v1/completions", timeout=120, json={
        "prompt": "Hi", "max_tokens": 2,
        "vllm_xargs": {"monitors": json.dumps([{"name": "m", "probe": [0.5] * 10,
                                                 "layer": 3, "threshold": 1.0,
                                                 "action": "stop"}])}})
    assert r.status_code == 400, r.text
    assert "monitors[0].probe" in r.text


def test_the_inspect_provider_sees_a_monitor_stop(smol_server, smollm2_path):
    """Through the Inspect provider: a ``stop`` monitor that fires on the prompt ends the
    generation with nothing visible, Inspect's ``stop_reason`` says a filter cut it off and
    the metadata names the monitor; a ``flag`` monitor leaves the generation as it was."""
    import asyncio

    from inspect_ai.model import ChatMessageUser, GenerateConfig, get_model

    model = get_model(f"vllm-lens/{smollm2_path}", base_url=smol_server.base_url + "/v1",
                      api_key="unused")
    probe = torch.ones(576)

    def generate(monitor):
        config = GenerateConfig(temperature=0, max_tokens=8,
                                extra_body={"extra_args": {"monitors": [monitor]}})
        return asyncio.run(model.generate([ChatMessageUser(content="Name three colours.")],
                                          config=config))

    stopped = generate(_monitor("guard", probe, -1e9, "stop", layer=5))
    assert stopped.completion == ""
    assert stopped.stop_reason == "content_filter"
    assert stopped.metadata["stop_reason"] == "guard"
    assert stopped.metadata["monitors"][0]["position"] == 0
    flagged = generate(_monitor("guard", probe, -1e9, "flag", layer=5))
    assert flagged.completion != "" and flagged.stop_reason != "content_filter"
    assert flagged.metadata["monitors"][0]["fired"]


_NEVER_BY_HOOK = {"name": "never", "hook": "linear_probe", "layer": 1,
                  "args": {"weight": [1.0] * 128}, "threshold": 1e9}


@pytest.mark.parametrize(("stage", "monitor", "extra"), [
    ("capture", None, {"output_residual_stream": [1]}),
    ("plan", None, {}),  # before its monitors are built
    ("hooks", _NEVER_BY_HOOK, {}),  # the hooks stage fails before the monitor's hook runs
])
def test_a_stop_monitor_whose_lens_work_fails_ends_the_generation(tiny_llm, stage, monitor,
                                                                  extra):
    """Fail closed: when a request's lens work fails (an injected fault at ``stage``), its
    monitors stop running, so a ``stop`` monitor's request is ended at the next token and
    reports the failure; a ``flag`` monitor's request runs on (it only reports)."""
    from vllm_lens.common.faults import FAULT_KEY

    def params(action):
        watch = (_monitor("never", torch.ones(128), 1e9, action) if monitor is None
                 else {**monitor, "action": action})
        return SamplingParams(max_tokens=8, temperature=0, extra_args={
            "monitors": [watch], **extra, FAULT_KEY: stage})

    stopped, flagged = tiny_llm.generate([TINY_PROMPT] * 2, [params("stop"), params("flag")])
    eos = tiny_llm.get_tokenizer().eos_token_id
    assert list(stopped.outputs[0].token_ids) == [eos]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.lens_error is not None
    assert f"stage {stage!r}" in str(stopped.lens_error)
    assert stopped.monitors is None  # nothing partial is returned
    assert len(flagged.outputs[0].token_ids) == 8 and flagged.lens_error is not None
