"""Per-request and persistent hooks, against transformers and native capture."""

import asyncio

import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import env, running_llm
from tests.integration.reference import max_relative_error
from vllm_lens import Hook, HookError, LensRequestError, NamedHook, SteeringVector
from vllm_lens.cli.extract.engine_stop import stop_engine

PROMPT = "The capital of France is Paris, and the capital of Italy is"
LONG = ("A long prompt for the tiny model, long enough to be prefilled in several chunks of "
        "sixteen tokens each, so that hooks see slices that cross chunk boundaries.")


def _greedy(llm, prompt, hooks=None, max_tokens=8, **extra):
    extra_args = {**({"apply_hooks": hooks} if hooks else {}), **extra}
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        extra_args=extra_args or None)
    return llm.generate([prompt], sp)[0]


def _zero_neuron(j):
    def hook(ctx, hidden):
        hidden[:, j] = 0
        return hidden
    return hook


def test_zeroing_a_neuron_matches_transformers(smol_llm, smol_ref):
    ids = smol_llm.get_tokenizer()(PROMPT)["input_ids"]
    layer = 12
    # The largest-magnitude dimension of the stream there: zeroing it changes the output.
    neuron = int(smol_ref.residual_stream(ids, [layer])[0].abs().amax(0).argmax())
    hooked = _greedy(smol_llm, PROMPT, [Hook(_zero_neuron(neuron), [layer])], max_tokens=10)

    def zero(h):
        h = h.clone()
        h[:, neuron] = 0
        return h

    assert list(hooked.outputs[0].token_ids) == smol_ref.hooked_greedy(ids, 10, {layer: zero})
    assert hooked.hook_results == {"0": {}}
    plain = _greedy(smol_llm, PROMPT, max_tokens=10)
    assert plain.outputs[0].token_ids != hooked.outputs[0].token_ids  # the test has teeth


def test_pre_hook_in_compiled_mode_matches_transformers(smol_llm, smol_ref):
    """A pre-hook on layer 12 edits what layer 11 handed over (compiled engine)."""
    ids = smol_llm.get_tokenizer()(PROMPT)["input_ids"]

    def scale(ctx, hidden):
        return hidden * 0.5

    hooked = _greedy(smol_llm, PROMPT, [Hook(scale, [12], pre=True)], max_tokens=10)
    expected = smol_ref.hooked_greedy(ids, 10, {11: lambda h: h * 0.5})
    assert list(hooked.outputs[0].token_ids) == expected
    assert expected != list(_greedy(smol_llm, PROMPT, max_tokens=10).outputs[0].token_ids)


def _save_rows(ctx, hidden):
    ctx.saved.setdefault("rows", []).append(hidden)
    ctx.saved.setdefault("positions", []).append(ctx.positions)
    ctx.saved["seq_len"] = ctx.seq_len
    ctx.saved["layer"] = ctx.layer_idx


def test_capturing_hook_equals_native_capture_across_chunks(tiny_llm):
    out = _greedy(tiny_llm, LONG, [Hook(_save_rows, [2])], max_tokens=5,
                  output_residual_stream=[2])
    saved = out.hook_results["0"]
    rows, positions = torch.cat(saved["rows"]), torch.cat(saved["positions"])
    native = out.activations["residual_stream"][0]
    n = native.shape[0]
    assert len(saved["rows"]) > 2  # several chunked-prefill and decode steps
    assert positions[:n].tolist() == list(range(n))
    assert torch.equal(rows[:n], native)
    assert saved["layer"] == 2 and saved["seq_len"] == positions[-1].item() + 1


def test_order_is_steering_then_hooks_then_capture(tiny_llm):
    sv = SteeringVector(activations=torch.ones(1, 128) * 3, layer_indices=[1])
    steered_only = _greedy(tiny_llm, PROMPT, max_tokens=3, apply_steering_vectors=[sv],
                           output_residual_stream=[1])

    def double(ctx, hidden):
        ctx.saved.setdefault("seen", []).append(hidden)
        return hidden * 2

    both = _greedy(tiny_llm, PROMPT, [Hook(double, [1])], max_tokens=1,
                   apply_steering_vectors=[sv], output_residual_stream=[1])
    seen = both.hook_results["0"]["seen"][0]
    n = seen.shape[0]
    expected = steered_only.activations["residual_stream"][0, :n]
    assert max_relative_error(seen, expected) <= 1e-5  # the hook saw the steered stream
    captured = both.activations["residual_stream"][0]
    assert max_relative_error(captured, 2 * seen) <= 1e-5  # capture saw the hook's output


def test_pre_hook_noise_and_causal_tracing_restore(tiny_llm):
    """Noise at layer 0's input changes the output; restoring the clean stream after layer 2
    at every position (the causal-tracing patch) restores it."""
    clean = _greedy(tiny_llm, PROMPT, max_tokens=6, output_residual_stream=[2])
    clean_stream = clean.activations["residual_stream"][0]

    def noise(ctx, hidden):
        g = torch.Generator().manual_seed(int(ctx.positions[0]))
        return hidden + 5 * torch.randn(hidden.shape, generator=g).to(hidden.dtype)

    def restore(ctx, hidden):
        return clean_stream[ctx.positions].to(hidden.dtype)

    noisy = _greedy(tiny_llm, PROMPT, [Hook(noise, [0], pre=True)], max_tokens=6)
    restored = _greedy(tiny_llm, PROMPT, [Hook(noise, [0], pre=True), Hook(restore, [2])],
                       max_tokens=6)
    assert noisy.outputs[0].token_ids != clean.outputs[0].token_ids
    assert restored.outputs[0].token_ids == clean.outputs[0].token_ids


def test_pre_hook_sees_the_full_input_stream(tiny_llm):
    """A pre-hook at layer 3 sees what capture reports after layer 2 (hidden + residual)."""
    out = _greedy(tiny_llm, LONG, [Hook(_save_rows, [3], pre=True)], max_tokens=3,
                  output_residual_stream=[2])
    rows = torch.cat(out.hook_results["0"]["rows"])
    native = out.activations["residual_stream"][0]
    assert max_relative_error(rows[:native.shape[0]], native) <= 1e-6


def _raise(ctx, hidden):
    raise RuntimeError("this hook is broken")


def _wrong_shape(ctx, hidden):
    return hidden[:, :3]


@pytest.mark.parametrize("bad,message", [(_raise, "this hook is broken"),
                                         (_wrong_shape, "returned shape")])
def test_failing_hook_fails_only_its_request(tiny_llm, bad, message):
    sv = SteeringVector(activations=torch.ones(1, 128), layer_indices=[1])
    plain_ref = _greedy(tiny_llm, PROMPT)
    steer_ref = _greedy(tiny_llm, LONG, apply_steering_vectors=[sv],
                        output_residual_stream=[3])
    sps = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                       extra_args={"apply_hooks": [Hook(bad, [1])]}),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                       extra_args={"apply_steering_vectors": [sv], "output_residual_stream": [3],
                                   "apply_hooks": [Hook(_save_rows, [1])]}),
    ]
    plain, failed, steered = tiny_llm.generate([PROMPT, PROMPT, LONG], sps)
    assert isinstance(failed.hook_error, HookError) and message in str(failed.hook_error)
    assert "Traceback" in failed.hook_error.traceback and failed.hook_results is None
    assert plain.outputs[0].token_ids == plain_ref.outputs[0].token_ids
    assert steered.outputs[0].token_ids == steer_ref.outputs[0].token_ids
    assert torch.equal(steered.activations["residual_stream"],
                       steer_ref.activations["residual_stream"])
    assert steered.hook_error is None and steered.hook_results["0"]["rows"]


def test_bad_hook_requests_fail_before_the_engine(tiny_llm):
    cases = [
        ([Hook(_save_rows, [9])], "apply_hooks[0].layer_indices[0]"),
        ([NamedHook("no_such_hook", [1])], "apply_hooks[0].name"),
        ([NamedHook("logit_lens_topk", [1], {"k": 0})], "apply_hooks[0].args"),
        ([{"pickle": "AAAA"}], "apply_hooks[0]"),
        ("[1, 2", "apply_hooks"),
    ]
    for hooks, field in cases:
        with pytest.raises(LensRequestError) as info:
            _greedy(tiny_llm, PROMPT, hooks)
        assert info.value.field == field
    assert _greedy(tiny_llm, PROMPT).outputs[0].token_ids  # the engine still serves


def test_async_engine_raises_for_the_failing_request_only(tiny_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.integration.conftest import TINY_CHUNKED
    from tests.integration.engines import engine_kwargs

    async def run():
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(model=tiny_path, **engine_kwargs(**TINY_CHUNKED)))

        async def final(request_id, hooks):
            sp = SamplingParams(max_tokens=4, temperature=0, extra_args={"apply_hooks": hooks})
            last = None
            async for out in engine.generate(PROMPT, sp, request_id):
                last = out
            return last

        try:
            return await asyncio.gather(final("ok", [Hook(_save_rows, [0])]),
                                        final("bad", [Hook(_raise, [0])]),
                                        return_exceptions=True)
        finally:
            stop_engine(engine)

    ok, bad = asyncio.run(run())
    assert ok.hook_results["0"]["rows"]
    assert isinstance(bad, HookError) and "this hook is broken" in str(bad)


def _count_tokens(ctx, hidden):
    ctx.saved["tokens"] = ctx.saved.get("tokens", 0) + hidden.shape[0]


def test_persistent_hooks(tiny_path):
    with env(VLLM_LENS_HOOK_RESULTS_MAX="5"), running_llm(
            tiny_path, enforce_eager=True, enable_prefix_caching=False) as llm:
        # Q/K hooks keep per-request state: they are refused as persistent hooks.
        with pytest.raises(LensRequestError, match="per request only") as info:
            llm.register_hooks([NamedHook("attention_to_span", [1], {"span": [0, 2]},
                                          hook_point="attn_qk")])
        assert info.value.field == "hooks[0].hook_point"
        llm.register_hooks([Hook(_count_tokens, [0]),
                            NamedHook("linear_probe", [3], {"weight": [0.01] * 128})])
        sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        outs = llm.generate([f"Request number {i} says hello." for i in range(3)], sp)
        results = llm.collect_hook_results()
        assert sorted(results) == sorted(o.request_id for o in outs)  # keyed per request
        for out in outs:
            r = results[out.request_id]
            assert r["0"]["tokens"] == len(out.prompt_token_ids) + 2
            assert r["1"]["scores"]["3"].shape == (len(out.prompt_token_ids) + 2,)
        assert llm.collect_hook_results().keys() == results.keys()  # non-destructive

        llm.generate([f"More traffic {i}." for i in range(6)], sp)
        assert len(llm.collect_hook_results()) == 5  # bounded: the oldest were dropped

        llm.clear_hook_results()
        assert llm.collect_hook_results() == {}
        llm.clear_hooks()
        llm.generate(["After clearing."], sp)
        assert llm.collect_hook_results() == {}
