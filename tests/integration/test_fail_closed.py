"""Fail closed on a real engine: an exception anywhere in the lens path fails only the
requests it concerns (offline, async and over HTTP) and the engine serves on; unproven
configurations and models are refused up front while plain requests serve."""

import httpx
import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import IDLE, held, running_llm
from tests.integration.reference import max_relative_error
from tests.integration.saes import saved_transcoder
from vllm_lens import (
    LensExecutionError,
    NamedHook,
    SteeringVector,
    UnsupportedConfigError,
    decode_activations,
)
from vllm_lens.common.faults import FAULT_KEY, STAGES

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In a hole in the ground there lived a hobbit, not a nasty dirty wet hole.",
]


#: A transcoder for the tiny model's layer 1 (``_transcoder``), which ``_everything`` clamps.
_TRANSCODER: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _transcoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("transcoder") / "t1"
    saved_transcoder(path, "jumprelu_transcoder", 1)
    _TRANSCODER[:] = [str(path)]


def _everything(fault=None):
    """Capture, steering, a named hook, attention steering and an MLP replaced by a
    transcoder at once (every stage has work to do)."""
    extra = {
        "output_residual_stream": [1, 3],
        "apply_steering_vectors": [SteeringVector(activations=torch.ones(1, 128),
                                                  layer_indices=[0])],
        "apply_hooks": [NamedHook("linear_probe", [2], {"weight": [0.01] * 128})],
        "steer_attention": [{"layers": [2], "heads": None, "emphasize": [0, 3],
                             "alpha": 0.5}],
        "replace_mlp": [{"transcoder": _TRANSCODER[0], "keep_error": True,
                         "clamp": {"3": 1.0}}],
    }
    if fault is not None:
        extra[FAULT_KEY] = fault
    return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=extra)


CLEAN = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                       extra_args={"output_residual_stream": [0, 2]})


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "step"])
def test_a_failing_stage_fails_only_its_request(tiny_llm, tiny_ref, stage):
    # The clean request captures other layers: a failing batched operation (one capture
    # group, one layer's steering, one hook call) fails every request that shares it.
    faulty, clean = tiny_llm.generate(PROMPTS, [_everything(stage), CLEAN])
    assert isinstance(faulty.lens_error, LensExecutionError)
    assert f"failed at {stage}" in str(faulty.lens_error)
    assert faulty.activations is None and faulty.hook_results is None  # nothing partial
    _assert_clean_and_serving(tiny_llm, tiny_ref, clean)


def test_a_failing_steering_build_leaves_the_steps_other_steered_requests_steered(tiny_llm):
    """The step's steering is joined for every steered request at once; when that fails for
    one request (its vectors too large for the device, say) the others stay steered."""
    steer = SteeringVector(activations=torch.linspace(-4, 4, 128)[None], layer_indices=[1],
                           scale=3.0)

    def steered(fault=None):
        extra = {"apply_steering_vectors": [steer], "output_residual_stream": [2]}
        if fault is not None:
            extra[FAULT_KEY] = fault
        return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=extra)

    alone = tiny_llm.generate([PROMPTS[1]], steered())[0]
    faulty, other = tiny_llm.generate(PROMPTS, [steered("steer_groups"), steered()])
    assert "failed at steer_groups" in str(faulty.lens_error)
    assert other.lens_error is None
    assert other.outputs[0].token_ids == alone.outputs[0].token_ids
    rows = other.activations["residual_stream"]
    assert max_relative_error(rows, alone.activations["residual_stream"]) <= 1e-4
    unsteered = tiny_llm.generate([PROMPTS[1]], CLEAN)[0].activations["residual_stream"][1]
    n = min(len(unsteered), rows.shape[1])
    assert max_relative_error(rows[0, :n], unsteered[:n]) > 0.1  # the steering is there
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


def test_a_failure_outside_the_per_request_stages_fails_the_steps_lens_requests(tiny_llm,
                                                                               tiny_ref):
    # Raised in the tap itself, where nothing pins it on one request: every lens request of
    # the step fails, plain requests are untouched, and the engine serves on.
    # The engine core starts stepping as soon as the first request arrives: the long one
    # goes first, so it is still running in the step where the faulty one first runs.
    short = ["One two three.", "Four five.", "Six seven eight."]
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    running = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                             extra_args={"output_residual_stream": [0, 2]})
    other, faulty, untouched = tiny_llm.generate(short, [running, _everything("step"), plain])
    for out in (faulty, other):
        assert "failed at plan" in str(out.lens_error) and "'step'" in str(out.lens_error)
    expected_plain = tiny_llm.generate(short[2:], plain)[0]
    assert untouched.outputs[0].token_ids == expected_plain.outputs[0].token_ids
    _assert_clean_and_serving(tiny_llm, tiny_ref, tiny_llm.generate(PROMPTS[1:], CLEAN)[0])


def _assert_clean_and_serving(tiny_llm, tiny_ref, clean):
    assert clean.lens_error is None
    ids = list(clean.prompt_token_ids) + list(clean.outputs[0].token_ids[:-1])
    expected = tiny_ref.residual_stream(ids, [0, 2])
    assert max_relative_error(clean.activations["residual_stream"], expected) <= 1e-4
    # The engine serves on: the same request without the fault runs whole.
    again = tiny_llm.generate([PROMPTS[0]], _everything())[0]
    assert again.lens_error is None and again.hook_error is None
    assert again.activations["residual_stream"].shape[:2] == (
        2, len(again.prompt_token_ids) + 5)
    assert set(again.hook_results["0"]["scores"]) == {"2"}
    assert held(tiny_llm.collective_rpc("lens_stats")) == [IDLE]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_stage_is_a_500_for_that_request_and_the_server_serves_on(smol_server,
                                                                            stage):
    url = smol_server.base_url + "/v1/completions"
    body = {"model": _served_model(smol_server), "prompt": "The capital of France is",
            "max_tokens": 4, "temperature": 0}
    steering = SteeringVector(activations=torch.zeros(1, 576), layer_indices=[2])
    xargs = {"output_residual_stream": "[3, 7]", "apply_steering_vectors": steering.to_wire(),
             "apply_hooks": '[{"name": "linear_probe", "layer_indices": [5], '
                            '"args": {"weight": ' + str([0.0] * 576) + '}}]',
             "steer_attention": '[{"layers": [4], "heads": [0], "key_positions": [1], '
                                '"bias": -1.0}]',
             "replace_mlp": '[{"transcoder": "smol-t5", "keep_error": true, '
                            '"clamp": {"3": 1.0}}]',
             FAULT_KEY: stage}
    failed = httpx.post(url, json={**body, "vllm_xargs": xargs}, timeout=120)
    assert failed.status_code == 500, failed.text
    label = "plan" if stage == "step" else stage  # a step-wide failure fails at plan
    assert f"failed at {label}" in failed.json()["error"]["message"]
    ok = httpx.post(url, json={**body, "vllm_xargs": {"output_residual_stream": "[3]"}},
                    timeout=120)
    assert ok.status_code == 200, ok.text
    assert decode_activations(ok.json())["residual_stream"].shape[0] == 1


def _served_model(server) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_hooks_are_refused_with_speculative_decoding_capture_and_steering_are_exact(
        tiny_path, tiny_llm):
    # A prompt that repeats itself, so the n-gram proposer has drafts to offer.
    prompt = "one two three four five one two three four five one two three four five one two"
    capture = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             extra_args={"output_residual_stream": True})
    steer_3d = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": [SteeringVector(
            activations=torch.linspace(-4, 4, 128).repeat(1, 3, 1), layer_indices=[1],
            position_indices=[2, 22, 30])],
        "output_residual_stream": [3]})
    expected = tiny_llm.generate([prompt, prompt], [capture, steer_3d])
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1}
    with running_llm(tiny_path, enforce_eager=True, speculative_config=ngram,
                     disable_log_stats=False) as llm:
        got = llm.generate([prompt, prompt], [capture, steer_3d])
        with pytest.raises(UnsupportedConfigError, match="speculative") as info:
            llm.generate([prompt], SamplingParams(max_tokens=2, extra_args={
                "apply_hooks": [NamedHook("linear_probe", [0], {"weight": [0.0] * 128})]}))
        assert info.value.field == "apply_hooks"
        with pytest.raises(UnsupportedConfigError, match="speculative"):
            llm.register_hooks([NamedHook("linear_probe", [0], {"weight": [0.0] * 128})])
        accepted = _accepted_drafts(llm)
        stats = llm.collective_rpc("lens_stats")
    assert accepted > 0  # drafts were proposed and accepted: the test exercises them
    for out, ref in zip(got, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        a, b = out.activations["residual_stream"], ref.activations["residual_stream"]
        assert a.shape == b.shape
        assert torch.equal(out.activations["positions"], ref.activations["positions"])
        assert max_relative_error(a, b) <= 1e-4
    assert held(stats) == [IDLE]


def _accepted_drafts(llm) -> float:
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_accepted_tokens":
            return metric.value
    raise AssertionError("vLLM reported no speculative-decoding metrics")


def test_preempted_requests_keep_one_row_per_position(tiny_path, tiny_llm):
    """A KV cache of four blocks for four long requests: vLLM preempts and later recomputes
    them. Captures and named-hook results still hold exactly one row per position, equal to
    the same requests run without preemption."""
    prompts = [f"{p} Story {i}:" for i, p in enumerate(PROMPTS * 2)]
    sp = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True, extra_args={
        "output_residual_stream": [1, 3],
        "apply_hooks": [NamedHook("linear_probe", [2], {"weight": [0.01] * 128})]})
    expected = tiny_llm.generate(prompts, sp)
    block_bytes = 128 * 4 * 2 * 64 * 4  # CPU block size x layers x (K, V) x head_dim x fp32
    with running_llm(tiny_path, enforce_eager=True, max_model_len=384, max_num_seqs=4,
                     kv_cache_memory_bytes=4 * block_bytes, disable_log_stats=False) as llm:
        got = llm.generate(prompts, sp)
        preemptions = sum(m.value for m in llm.get_metrics()
                          if m.name == "vllm:num_preemptions")
        stats = llm.collective_rpc("lens_stats")
    assert preemptions > 0  # the test exercises recomputation
    assert held(stats) == [IDLE]
    for out, ref in zip(got, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        n_rows = len(out.prompt_token_ids) + 159
        assert out.activations["positions"].tolist() == list(range(n_rows))
        assert max_relative_error(out.activations["residual_stream"],
                                  ref.activations["residual_stream"]) <= 1e-4
        probe, ref_probe = out.hook_results["0"], ref.hook_results["0"]
        assert probe["positions"]["2"].tolist() == list(range(n_rows))
        torch.testing.assert_close(probe["scores"]["2"], ref_probe["scores"]["2"],
                                   rtol=1e-4, atol=1e-5)
