"""Models vllm-lens has not proven: lens requests fail up front with the model class named,
plain requests still serve (before, a capture on GPT-NeoX or OLMo 2 killed the engine).
GPT-J is not in ``worker.layouts``; GPT-NeoX is, but only with parallel blocks (Pythia's):
a sequential GPT-NeoX config is refused rather than tapped at the wrong places."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTJConfig, GPTNeoXConfig
from vllm import SamplingParams

from tests.integration.engines import running_llm
from vllm_lens import UnsupportedModelError
from vllm_lens.common.messages import DescribeAnswer, read


def _configs(tokenizer):
    # head_dim 64: the CPU attention kernel rejects smaller heads.
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    return {
        "GPTJForCausalLM": GPTJConfig(n_embd=128, n_layer=2, n_head=2, rotary_dim=32,
                                      n_positions=512, **common),
        "GPTNeoXForCausalLM": GPTNeoXConfig(hidden_size=128, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=256,
                                            max_position_embeddings=512,
                                            use_parallel_residual=False, **common),
    }


@pytest.mark.parametrize("model_class", ["GPTJForCausalLM", "GPTNeoXForCausalLM"])
def test_lens_request_names_the_model_class_and_plain_requests_serve(
        tmp_path_factory, tiny_path, model_class):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(model_class)
    AutoModelForCausalLM.from_config(_configs(tokenizer)[model_class]).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with running_llm(str(path), enforce_eager=True, max_model_len=512) as llm:
        # vLLM may run the architecture through its Transformers backend: the message names
        # the class vLLM runs, with the architecture.
        served = read(DescribeAnswer, llm.collective_rpc("lens_describe")[0]).model_class
        assert served in (model_class, f"TransformersForCausalLM:{model_class}")
        for extra in ({"output_residual_stream": [0]}, {"output_residual_stream": True}):
            sp = SamplingParams(max_tokens=3, temperature=0, extra_args=extra)
            with pytest.raises(UnsupportedModelError, match=f"model class {served} "):
                llm.generate(["Hello there"], sp)
        out = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0))[0]
        assert len(out.outputs[0].token_ids) == 3
