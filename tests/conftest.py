"""Session-wide fixtures: the two real models, built once and cached on disk."""

import pytest

from vllm_lens.demo_models import smollm2_dir, tiny_llama_dir


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return str(smollm2_dir())


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(tiny_llama_dir())
