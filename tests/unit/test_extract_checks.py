"""``vllm-lens extract`` refuses, before any engine starts, layers the model lacks, an unknown
positions selector and a model family vllm-lens does not map; a configuration it cannot read
is left to the engine."""

import json
from types import SimpleNamespace

import pytest

from vllm_lens.cli.extract.checks import check_against_model, parse_layer_list


def _model(tmp_path, architecture="LlamaForCausalLM", model_type="llama", layers=4):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": model_type, "num_hidden_layers": layers,
        "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 100}))
    return str(tmp_path)


def _args(model, layers="1,3", positions="all", **more):
    return SimpleNamespace(model=model, layers=layers, positions=positions, **more)


def test_layers_and_positions_the_model_lacks_are_refused_naming_the_flag(tmp_path):
    model = _model(tmp_path)
    check_against_model(_args(model))
    check_against_model(_args(model, layers="all", positions="prompt[-4:]"))
    with pytest.raises(SystemExit, match=r"--layers: 4 is out of range; .* has layers 0\.\.3"):
        check_against_model(_args(model, layers="0,4"))
    with pytest.raises(SystemExit, match=r"--layers: 'x' is not a layer index"):
        check_against_model(_args(model, layers="1,x"))
    with pytest.raises(SystemExit, match=r"--positions: unknown selector 'promt'"):
        check_against_model(_args(model, positions="promt"))


def test_an_unmapped_family_is_refused_with_the_mapped_ones(tmp_path):
    model = _model(tmp_path, "GPTJForCausalLM", "gptj")
    with pytest.raises(SystemExit, match=r"--model: GPTJForCausalLM is not a model family "
                                         r"vllm-lens maps.*LlamaForCausalLM"):
        check_against_model(_args(model))
    # Mapped only through vLLM's Transformers backend: fine unless another backend is asked.
    neox = _model(tmp_path, "GPTNeoXForCausalLM", "gpt_neox")
    check_against_model(_args(neox))
    llama = _model(tmp_path)
    with pytest.raises(SystemExit, match="LlamaForCausalLM is not a model family"):
        check_against_model(_args(llama, model_impl="transformers"))


def test_a_configuration_that_cannot_be_read_is_left_to_the_engine(tmp_path):
    check_against_model(_args(str(tmp_path / "no-such-model"), layers="0,99"))


def test_layer_lists():
    assert parse_layer_list("all") is True
    assert parse_layer_list(" 3, 7 ,") == [3, 7]
    with pytest.raises(SystemExit, match="names no layer"):
        parse_layer_list(",")
