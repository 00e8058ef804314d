"""A model whose decoder layers vllm-lens cannot find: lens requests fail with the model
class named, plain requests still serve."""

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
from vllm import SamplingParams

from tests.integration.engines import running_llm
from vllm_lens import UnsupportedModelError


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory, tiny_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    # head_dim 64: the CPU attention kernel rejects smaller heads.
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=128, n_layer=2, n_head=2,
                        n_positions=512, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2-tiny")
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_lens_request_names_the_model_class_and_plain_requests_serve(gpt2_path):
    with running_llm(gpt2_path, enforce_eager=True, max_model_len=512) as llm:
        sp = SamplingParams(max_tokens=3, temperature=0, extra_args={"output_residual_stream": [0]})
        with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
            llm.generate(["Hello there"], sp)
        out = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0))[0]
        assert len(out.outputs[0].token_ids) == 3
