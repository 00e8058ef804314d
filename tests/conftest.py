"""Session-wide fixtures: the two real models, built once and cached on disk."""

import os

import pytest

# Every engine of the suite (and its workers, which inherit the environment) accepts the
# test-only fault-injection key (vllm_lens.faults).
os.environ.setdefault("VLLM_LENS_TEST_FAULTS", "1")

from vllm_lens.demo_models import smollm2_dir, tiny_llama_dir


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return str(smollm2_dir())


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(tiny_llama_dir())
