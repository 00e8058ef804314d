"""Engines shared across integration tests (one per configuration per session)."""

import pytest

from tests.integration.engines import running_llm
from tests.integration.reference import HFReference


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
#: lens values at 1 MiB (the oversize test sends more) and enables persistent hooks.
SERVER_ENV = {"VLLM_LENS_HTTP_STORE_TTL_S": "20", "VLLM_LENS_MAX_REQUEST_BYTES": str(1 << 20),
              "VLLM_LENS_ALLOW_PERSISTENT_HOOKS": "1"}


@pytest.fixture(scope="session")
def smol_server(smollm2_path):
    """SmolLM2 behind vLLM's OpenAI server (compiled mode, like ``smol_llm``)."""
    from tests.integration.server import running_server

    with running_server(smollm2_path, env=SERVER_ENV) as server:
        yield server
