"""Engines shared across integration tests (one per configuration per session)."""

import json

import pytest
import torch

from tests.integration.engines import running_llm
from tests.integration.reference import HFReference
from vllm_lens import SteeringVector


@pytest.fixture(scope="session")
def smol_llm(smollm2_path):
    """SmolLM2 in vLLM's default (compiled) mode, as users run it."""
    with running_llm(smollm2_path) as llm:
        yield llm


@pytest.fixture(scope="session")
def smol_ref(smollm2_path):
    return HFReference(smollm2_path)


#: The tiny engine runs eager and splits prompts into chunks of at most 16 tokens, so every
#: multi-chunk prompt exercises positions across chunked-prefill steps.
TINY_CHUNKED = dict(enforce_eager=True, max_num_batched_tokens=16, max_num_seqs=8)


@pytest.fixture(scope="session")
def tiny_llm(tiny_path):
    with running_llm(tiny_path, **TINY_CHUNKED) as llm:
        yield llm


@pytest.fixture(scope="session")
def tiny_ref(tiny_path):
    return HFReference(tiny_path)


#: The test server keeps binary handles briefly (the load test waits for their expiry), caps
#: lens values at 1 MiB (the oversize test sends more) and enables persistent hooks, the
#: steering-preset routes and the lens page.
SERVER_ENV = {"VLLM_LENS_HTTP_STORE_TTL_S": "20", "VLLM_LENS_MAX_REQUEST_BYTES": str(1 << 20),
              "VLLM_LENS_ALLOW_PERSISTENT_HOOKS": "1", "VLLM_LENS_ALLOW_STEERING_ROUTES": "1",
              "VLLM_LENS_PAGE": "1"}


def server_preset() -> SteeringVector:
    """The steering preset the test server registers from its presets file (``calm``)."""
    g = torch.Generator().manual_seed(77)
    return SteeringVector(activations=torch.randn(1, 576, generator=g) * 3, layer_indices=[10],
                          phase="decode")


#: The test server's preset ``focus``: steering by features of the SAE it serves
#: (``smol-l10``), from the same presets file (registered after ``VLLM_LENS_SAES``).
SERVER_FEATURE_PRESET = [{"sae": "smol-l10", "feature": 21, "scale": 12.0, "phase": "decode"},
                         {"sae": "smol-l10", "feature": [5, 9], "clamp": [4.0, 0.0]}]


@pytest.fixture(scope="session")
def smol_sae(tmp_path_factory):
    """(directory, sae-lens ``SAE``): a random 512-feature JumpReLU SAE on SmolLM2's layer-10
    residual stream, saved by sae-lens; the test server serves it as ``smol-l10``."""
    from tests.integration.saes import saved_sae

    path = tmp_path_factory.mktemp("saes") / "smol-l10"
    sae = saved_sae(path, "jumprelu", "blocks.10.hook_resid_post", d_in=576)
    # Labels of its even features, as {index: label} (``saes.labels``).
    (path / "labels.json").write_text(json.dumps({str(i): f"even {i}" for i in range(0, 512, 2)}))
    return path, sae


@pytest.fixture(scope="session")
def smol_transcoder(tmp_path_factory):
    """(directory, sae-lens ``JumpReLUSkipTranscoder``): a random 512-feature transcoder
    standing in for SmolLM2's layer-5 MLP, saved by sae-lens; the test server serves it as
    ``smol-t5``."""
    from tests.integration.saes import saved_transcoder

    path = tmp_path_factory.mktemp("transcoders") / "smol-t5"
    transcoder = saved_transcoder(path, "jumprelu_skip_transcoder", 5, d_in=576, scale=0.05)
    # Every third feature explained, as Neuronpedia exports explanations.
    (path / "explanations.json").write_text(json.dumps([
        {"modelId": "smollm2-135m", "layer": "5-transcoder", "index": str(i),
         "description": f"third {i}", "explanationModelName": "test"}
        for i in range(0, 512, 3)]))
    return path, transcoder


@pytest.fixture(scope="session")
def smol_server(smollm2_path, tmp_path_factory, smol_sae, smol_transcoder):
    """SmolLM2 behind vLLM's OpenAI server (compiled mode, like ``smol_llm``), with the
    steering presets ``calm`` and ``focus`` (``SERVER_FEATURE_PRESET``), the SAE
    ``smol-l10`` (``smol_sae``) and the transcoder ``smol-t5`` (``smol_transcoder``)
    registered from files at start-up."""
    from tests.integration.server import running_server

    presets = tmp_path_factory.mktemp("presets") / "presets.json"
    presets.write_text(json.dumps({"calm": {
        "model": "SmolLM2-135M-Instruct", "vectors": [server_preset().model_dump(mode="json")]},
        "focus": SERVER_FEATURE_PRESET}))
    saes = presets.with_name("saes.json")
    saes.write_text(json.dumps({"smol-l10": str(smol_sae[0]),
                                "smol-t5": str(smol_transcoder[0])}))
    env = {**SERVER_ENV, "VLLM_LENS_STEERING_PRESETS": str(presets),
           "VLLM_LENS_SAES": str(saes)}
    with running_server(smollm2_path, env=env) as server:
        yield server
