"""The Inspect AI provider ``vllm-lens`` against a real server, with a real Inspect eval."""

import json
import zipfile

import pytest
import torch
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageUser, GenerateConfig, get_model
from inspect_ai.scorer import Score, Target, mean, scorer
from inspect_ai.solver import TaskState, generate
from vllm import SamplingParams

from tests.integration.reference import max_relative_error
from vllm_lens import SteeringVector
from vllm_lens.client import LensHTTPError

MESSAGES = [{"role": "user", "content": "Name three colours."}]
LAYERS = [0, 11, 29]


@pytest.fixture(scope="module")
def model(smol_server, smollm2_path):
    return get_model(f"vllm-lens/{smollm2_path}", base_url=smol_server.base_url + "/v1",
                     api_key="unused")


def _generate(model, extra_args, max_tokens=6, **config_fields):
    import asyncio

    config = GenerateConfig(**{"temperature": 0, **config_fields}, max_tokens=max_tokens,
                            extra_body={"extra_args": extra_args})
    return asyncio.run(model.generate([ChatMessageUser(content=MESSAGES[0]["content"])],
                                      config=config))


def test_activations_through_inspect_equal_offline(model, smol_llm):
    output = _generate(model, {"output_residual_stream": LAYERS})
    acts = output.metadata["activations"]
    offline = smol_llm.chat(MESSAGES, SamplingParams(
        max_tokens=6, temperature=0, extra_args={"output_residual_stream": LAYERS}))[0]
    assert acts["prompt_token_ids"] == list(offline.prompt_token_ids)
    assert acts["completion_token_ids"] == list(offline.outputs[0].token_ids)
    assert output.completion == offline.outputs[0].text
    assert acts["positions"].tolist() == offline.activations["positions"].tolist()
    assert max_relative_error(acts["residual_stream"],
                              offline.activations["residual_stream"]) <= 1e-5


def test_sae_features_through_inspect_equal_offline(model, smol_llm, smol_sae):
    """The server's named SAE (``VLLM_LENS_SAES``) through Inspect, in the output's
    metadata; offline names the same SAE by its directory."""
    output = _generate(model, {"output_sae_features": {"sae": "smol-l10", "top_k": 8}})
    (found,) = output.metadata["sae_features"]
    offline = smol_llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0, extra_args={
        "output_sae_features": {"sae": str(smol_sae[0]), "top_k": 8}}))[0]
    (expected,) = offline.sae_features
    assert found["sae"] == "smol-l10" and found["layer"] == 10
    assert found["positions"].tolist() == expected["positions"].tolist()
    assert found["indices"].shape == (len(expected["positions"]), 8)
    torch.testing.assert_close(found["values"], expected["values"], rtol=1e-3, atol=1e-3)
    assert found["labels"] and found["labels"] == expected["labels"]  # the SAE's labels


def test_binary_transport_through_inspect_is_fetched_and_freed(model, smol_server):
    import httpx

    def stored() -> int:
        return httpx.get(smol_server.base_url + "/v1/lens/stats").json()["store"]["entries"]

    before = stored()
    by_json = _generate(model, {"output_residual_stream": LAYERS})
    by_handle = _generate(model, {"output_residual_stream": LAYERS,
                                  "activations_transport": "binary"})
    json_acts, handle_acts = by_json.metadata["activations"], by_handle.metadata["activations"]
    assert torch.equal(handle_acts["residual_stream"], json_acts["residual_stream"])
    assert torch.equal(handle_acts["positions"], json_acts["positions"])
    assert stored() == before  # the provider deleted the handle after reading it

    # Several choices (sampled: vLLM refuses n > 1 with greedy sampling): every one is fetched
    # and freed, and each holds its own completion's rows after the shared prompt's.
    both = _generate(model, {"output_residual_stream": LAYERS, "activations_transport": "binary"},
                     num_choices=2, temperature=1.0, seed=0)
    listed = both.metadata["choice_activations"]
    assert len(listed) == 2 and listed[0] is both.metadata["activations"]
    n_prompt = len(json_acts["prompt_token_ids"])
    for acts in listed:
        stream = acts["residual_stream"]
        assert stream.shape == (len(LAYERS), n_prompt + len(acts["completion_token_ids"]) - 1,
                                576)
        assert max_relative_error(stream[:, :n_prompt],
                                  json_acts["residual_stream"][:, :n_prompt]) <= 1e-4
    assert stored() == before


def test_steering_through_inspect_equals_offline(model, smol_llm):
    d = torch.randn(576, generator=torch.Generator().manual_seed(3))
    vectors = [SteeringVector(activations=(d / d.norm() * 50)[None], layer_indices=[9])]
    steered = _generate(model, {"apply_steering_vectors": vectors}, max_tokens=10)
    offline = smol_llm.chat(MESSAGES, SamplingParams(
        max_tokens=10, temperature=0, extra_args={"apply_steering_vectors": vectors}))[0]
    plain = _generate(model, {}, max_tokens=10)
    assert steered.completion == offline.outputs[0].text
    assert steered.completion != plain.completion


def test_bad_lens_input_is_a_clear_error_not_a_retry(model):
    import time

    start = time.monotonic()
    with pytest.raises(Exception, match=r"layer index 99 is out of range") as info:
        _generate(model, {"output_residual_stream": [99]})
    causes = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(c, LensHTTPError) and c.param == "output_residual_stream[0]"
               for c in causes)
    assert time.monotonic() - start < 30  # failed at once, no retry loop


@scorer(metrics=[mean()])
def probe_scorer(direction: torch.Tensor):
    """Scores each sample by its mean last-layer activation projected on ``direction``."""

    async def score(state: TaskState, target: Target) -> Score:
        acts = state.output.metadata["activations"]["residual_stream"]  # [1, hidden] (mean)
        return Score(value=float(acts[0] @ direction), explanation=str(list(acts.shape)))

    return score


def test_inspect_eval_scores_every_sample_and_logs_no_tensors(smol_server, smollm2_path,
                                                              tmp_path):
    samples = [Sample(input=text, target="") for text in
               ["I love sunny days.", "This is terrible news.", "What a wonderful gift!",
                "I feel sad and tired."]]
    direction = torch.randn(576, generator=torch.Generator().manual_seed(0))
    capture = {"output_residual_stream": {"layers": [20], "positions": "prompt",
                                          "reduce": "mean"}}
    task = Task(dataset=samples, solver=generate(), scorer=probe_scorer(direction),
                config=GenerateConfig(max_tokens=4, temperature=0,
                                      extra_body={"extra_args": capture}))
    (log,) = eval(task, model=f"vllm-lens/{smollm2_path}", log_dir=str(tmp_path),
                  model_base_url=smol_server.base_url + "/v1", model_args={"api_key": "unused"},
                  display="none")
    assert log.status == "success", log.error
    assert len(log.samples) == len(samples)
    for sample in log.samples:
        (score,) = sample.scores.values()
        assert isinstance(score.value, float) and score.explanation == "[1, 576]"
    # The eval log holds no tensor data: no base64 records, and it stays small.
    (path,) = tmp_path.glob("*.eval")
    with zipfile.ZipFile(path) as archive:
        text = "".join(archive.read(n).decode("utf-8", "replace") for n in archive.namelist()
                       if n.endswith(".json"))
    assert '"<omitted>"' in text  # the logged model calls kept only a summary
    assert '"compression": "zstd"' not in text and '"compression":"zstd"' not in text
    assert path.stat().st_size < 200_000
    json.loads(json.dumps(log.results.model_dump()))  # results serialise cleanly


def _api_server_pids(model_path: str) -> list[int]:
    """API servers of ``model_path`` started by this test process (its descendants: other
    pytest-xdist workers may run servers of the same model meanwhile)."""
    import os

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])

    pids = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if b"vllm.entrypoints.openai.api_server" not in cmd or model_path.encode() not in cmd:
                continue
            ancestor = pid
            while ancestor > 1 and ancestor != os.getpid():
                ancestor = parent(ancestor)
        except (OSError, ValueError, IndexError):
            continue
        if ancestor == os.getpid():
            pids.append(pid)
    return pids


def test_provider_starts_and_stops_its_own_server(tiny_path, tmp_path):
    """Without base_url the provider starts the server itself (model args become server
    flags); closing the model stops it (Inspect also stops it at interpreter exit)."""
    capture = {"output_residual_stream": {"layers": [1], "positions": "last_prompt"}}
    task = Task(dataset=[Sample(input="Hello there", target="")], solver=generate(),
                config=GenerateConfig(max_tokens=3, temperature=0,
                                      extra_body={"extra_args": capture}))
    server_args = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512,
                   "kv_cache_memory_bytes": 64 << 20, "timeout": 600}
    with get_model(f"vllm-lens/{tiny_path}", **server_args) as model:
        (log,) = eval(task, model=model, display="none", log_dir=str(tmp_path))
        assert log.status == "success", log.error
        assert len(_api_server_pids(tiny_path)) == 1
        assert model.api.server_is_running
    (sample,) = log.samples
    assert sample.output.completion
    assert _api_server_pids(tiny_path) == []
