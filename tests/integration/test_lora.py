"""LoRA adapters (vLLM's ``LoRARequest``, ``--enable-lora``) with lens features: requests with
an adapter and without one, in the same batch, each equal their own transformers reference
(PEFT's adapter merged into the weights, and the base model): the residual stream and what
the LoRA-wrapped attention and MLP output projections add, steered tokens and a hook's edit;
over HTTP the adapter is selected by its served name.

The adapters touch all seven projections (so vLLM's packed ``qkv_proj`` and ``gate_up_proj``
slices too). The engines run vLLM's LoRA defaults (``max_loras`` unset, i.e. 1) offline and
``--max-loras 1`` over HTTP, where vLLM's PyTorch LoRA ops alone would run a request without an
adapter with the other request's adapter, and ``max_loras=2`` with both slots taken
(``common.lora_guard``)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from tests.integration.engines import running_llm
from tests.integration.reference import HFReference, max_relative_error
from vllm_lens import Hook, SteeringVector, decode_activations

pytestmark = pytest.mark.slow  # starts engines and a server of their own

#: vLLM's LoRA defaults (``max_loras`` left unset); LoRA runs eager on the CPU build anyway.
LORA = dict(enable_lora=True, max_lora_rank=8, enforce_eager=True)
PROMPTS = ["The capital of France is", "Once upon a time in a quiet village"]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_adapter(tiny_path, root, seed):
    """(adapter directory, transformers reference with the adapter merged): a random rank-8
    PEFT LoRA on every projection of attention and MLP."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                            target_modules=PROJECTIONS))
    with torch.no_grad():  # big enough to change what the model says
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.save_pretrained(root / f"adapter{seed}")
    merged = model.merge_and_unload()
    merged.save_pretrained(root / f"merged{seed}")  # the reference reads weights, not text
    return root / f"adapter{seed}", HFReference(str(root / f"merged{seed}"))


@pytest.fixture(scope="module")
def adapter(tiny_path, tmp_path_factory):
    return _make_adapter(tiny_path, tmp_path_factory.mktemp("lora"), 11)


@pytest.fixture(scope="module")
def second_adapter(tiny_path, tmp_path_factory):
    return _make_adapter(tiny_path, tmp_path_factory.mktemp("lora2"), 12)


@pytest.fixture(scope="module")
def lora_llm(tiny_path):
    with running_llm(tiny_path, **LORA) as llm:
        yield llm


def _ids(llm, prompt):
    return llm.get_tokenizer()(prompt)["input_ids"]


def test_adapter_and_base_requests_in_one_batch_each_equal_their_reference(
        lora_llm, adapter, tiny_ref):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    path, merged_ref = adapter
    lora = LoRARequest("tiny-adapter", 1, str(path))
    ids = [_ids(lora_llm, p) for p in PROMPTS]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
        "output_residual_stream": {"layers": [1, 3]},
        # Read at the outputs of the LoRA-wrapped o_proj and down_proj.
        "output_activations": {"attn_out": [1], "mlp_out": [2]}})
    outs = lora_llm.generate([{"prompt_token_ids": i} for i in ids] * 2, sp,
                             lora_request=[lora, None, None, lora])
    for out, ref, prompt_ids in zip(outs, (merged_ref, tiny_ref, tiny_ref, merged_ref),
                                    ids * 2):
        assert out.lens_error is None
        generated = list(out.outputs[0].token_ids)
        assert generated == ref.greedy(prompt_ids, 4)
        expected = ref.residual_stream(prompt_ids + generated[:-1], [1, 3])
        assert max_relative_error(out.activations["residual_stream"], expected) <= 1e-4
        points = ref.points(prompt_ids + generated[:-1])
        for name, layer in (("attn_out", 1), ("mlp_out", 2)):
            assert max_relative_error(out.activations[name][0], points[(name, layer)]) <= 1e-4
    assert list(outs[0].outputs[0].token_ids) != tiny_ref.greedy(ids[0], 4)  # it mattered

    # Steering and a hook on the adapter's request, beside a plain one.
    vector = SteeringVector(activations=torch.randn(1, 128, generator=torch.Generator()
                                                    .manual_seed(3)) * 4, layer_indices=[1])

    def double(ctx, hidden):
        return hidden * 2

    steered_sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": [vector], "apply_hooks": [Hook(double, [2])]})
    plain_sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    steered, plain = lora_llm.generate([{"prompt_token_ids": ids[1]}] * 2,
                                       [steered_sp, plain_sp], lora_request=[lora, lora])
    assert steered.lens_error is None and steered.hook_error is None
    expected = merged_ref.hooked_greedy(ids[1], 5, {
        1: lambda h: h + vector.activations[0], 2: lambda h: h * 2})
    assert list(steered.outputs[0].token_ids) == expected
    assert list(plain.outputs[0].token_ids) == merged_ref.greedy(ids[1], 5)
    assert expected != merged_ref.greedy(ids[1], 5)


def test_with_every_slot_taken_a_request_without_adapter_runs_the_base_model(
        tiny_path, adapter, second_adapter, tiny_ref):
    """``max_loras=2`` with both slots holding an adapter: vLLM's PyTorch ops alone would give
    the request without one the adapter of the last slot."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    (path1, ref1), (path2, ref2) = adapter, second_adapter
    one, two = LoRARequest("one", 1, str(path1)), LoRARequest("two", 2, str(path2))
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                        extra_args={"output_residual_stream": {"layers": [1, 3]}})
    with running_llm(tiny_path, **LORA, max_loras=2) as llm:
        prompt = {"prompt_token_ids": _ids(llm, PROMPTS[0])}
        llm.generate([prompt] * 2, sp, lora_request=[one, two])  # both slots taken
        outs = llm.generate([prompt] * 3, sp, lora_request=[one, None, two])
    prompt_ids = prompt["prompt_token_ids"]
    expected_tokens = [ref.greedy(prompt_ids, 4) for ref in (ref1, tiny_ref, ref2)]
    assert len({tuple(t) for t in expected_tokens}) == 3  # each adapter changes the answer
    for out, ref, tokens in zip(outs, (ref1, tiny_ref, ref2), expected_tokens):
        assert out.lens_error is None
        generated = list(out.outputs[0].token_ids)
        assert generated == tokens
        expected = ref.residual_stream(prompt_ids + generated[:-1], [1, 3])
        assert max_relative_error(out.activations["residual_stream"], expected) <= 1e-4


def test_adapter_over_http_by_its_served_name(tiny_path, adapter, tiny_ref):
    """``--max-loras 1`` set explicitly: a base-model request sent while the adapter's request
    is generating (so the two share decode steps) equals the base model."""
    from tests.integration.server import running_server

    path, merged_ref = adapter
    with running_server(tiny_path, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
                        "--lora-modules", f"tiny-adapter={path}", "--enforce-eager") as server:
        def body(model, max_tokens, **extra):
            return {"model": model, "prompt": PROMPTS[0], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                    "vllm_xargs": {"output_residual_stream": json.dumps({"layers": [2]})},
                    **extra}

        def complete(model, max_tokens=3):
            response = httpx.post(server.base_url + "/v1/completions",
                                  json=body(model, max_tokens), timeout=300)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        def check(choice, ref):
            ids = choice["prompt_token_ids"] + choice["token_ids"][:-1]
            rows = decode_activations(choice)["residual_stream"]
            assert max_relative_error(rows, ref.residual_stream(ids, [2])) <= 1e-4
            assert choice["token_ids"] == ref.greedy(choice["prompt_token_ids"],
                                                     len(choice["token_ids"]))
            return rows

        base_name = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        seen = [check(complete(model), ref)[:, 0]
                for model, ref in (("tiny-adapter", merged_ref), (base_name, tiny_ref))]
        assert not torch.allclose(*seen)  # the adapter changed the first position's row

        # The adapter's request streams 400 tokens; once its first chunk arrived, the base
        # request is sent and finishes while the adapter's is still decoding.
        started, finished = threading.Event(), threading.Event()
        chunks_after: list[int] = []

        def stream_adapter():
            with httpx.stream("POST", server.base_url + "/v1/completions", timeout=300,
                              json=body("tiny-adapter", 400, stream=True)) as response:
                for line in response.iter_lines():
                    started.set()
                    if finished.is_set() and line.startswith("data: {"):
                        chunks_after.append(1)
            started.set()

        streamer = threading.Thread(target=stream_adapter)
        streamer.start()
        assert started.wait(300)
        base = complete(base_name, max_tokens=8)
        finished.set()
        streamer.join(300)
        check(base, tiny_ref)
        assert chunks_after, "the adapter's request ended before the base request did"
