"""Compiled vs eager mode, tensor and pipeline parallelism: all give the same activations and
the same steered tokens.

The reference is the session's tiny engine (eager, TP=1, PP=1), itself checked against
transformers in test_chunked_and_mixed.py.
"""

import json

import pytest
import torch
from vllm import SamplingParams

from tests.integration.engines import env, running_llm
from tests.integration.reference import max_relative_error
from tests.integration.saes import (
    architecture_saes,
    check_architectures,
    check_features_and_clamp,
    check_transcoder,
    saved_sae,
    saved_transcoder,
)
from vllm_lens import Hook, NamedHook, SteeringVector, datasets
from vllm_lens.common.messages import DescribeAnswer, read_all

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In a hole in the ground there lived a hobbit, not a nasty dirty wet hole.",
]
ALL_LAYERS = SamplingParams(max_tokens=6, temperature=0,
                            extra_args={"output_residual_stream": True})
STEER = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={
    "apply_steering_vectors": [
        SteeringVector(activations=torch.linspace(-3, 3, 128).repeat(2, 1), layer_indices=[0, 3]),
        SteeringVector(activations=torch.ones(1, 2, 128) * 2, layer_indices=[2],
                       position_indices=[3, 12], norm_match=True, scale=0.5),
        # an embedding written over position 2, a generated-only push, a patched resid_mid
        SteeringVector(activations=torch.linspace(4, -4, 128)[None, None], layer_indices=[-1],
                       position_indices=[2], mode="replace"),
        SteeringVector(activations=torch.ones(1, 128) * 1.5, layer_indices=[1], phase="decode"),
        SteeringVector(activations=torch.linspace(-2, 2, 128)[None, None], layer_indices=[3],
                       hook_point="resid_mid", position_indices=[5], mode="replace"),
    ],
    "output_residual_stream": [3],
})


#: Conditional steering (refused under PP): the gate read at layer 1, steering layer 3.
GATED = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={
    "apply_steering_vectors": [SteeringVector(
        activations=torch.linspace(3, -3, 128)[None], layer_indices=[3], scale=4.0,
        condition={"probe": torch.linspace(-1, 1, 128), "layer": 1, "threshold": 0.0,
                   "sharpness": 2.0})]})


#: Every tap point and Q/K at every layer: under TP the heads and MLP columns come from both
#: ranks, under PP the layers from both stages (and final_norm from the last).
SIGNALS = ["resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post", "mlp_post",
           "attn_z", "value", "final_norm", "attn_q", "attn_k"]
POINTS = SamplingParams(max_tokens=6, temperature=0, extra_args={
    "output_activations": {p: True for p in SIGNALS[:-2]}, "output_qk": True,
    "output_residual_stream": [1]})


def _assert_points_same(outs, ref_outs, tol):
    for out, ref in zip(outs, ref_outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for signal in SIGNALS:
            a, b = out.activations[signal], ref.activations[signal]
            assert a.shape == b.shape, signal
            assert max_relative_error(a.flatten(2), b.flatten(2)) <= tol, signal
        assert out.activations["qk_meta"] == ref.activations["qk_meta"]


def _lm_head_shape(ctx, hidden):
    ctx.saved["shape"] = list(ctx.get_parameter("lm_head.weight").shape)
    ctx.saved.setdefault("ranks", set()).add(ctx.tp_rank)


# Saves the full unembedding's shape, and a logit lens on a layer of each pipeline stage.
HOOKED = SamplingParams(max_tokens=3, temperature=0, extra_args={"apply_hooks": [
    Hook(_lm_head_shape, [3]), NamedHook("logit_lens_topk", [1, 3], {"k": 2})]})


def _assert_hook_results(outs, vocab):
    for out in outs:
        first, lens = out.hook_results["0"], out.hook_results["1"]
        assert first["shape"] == [vocab, 128] and first["ranks"] == {0}
        n_rows = len(out.prompt_token_ids) + 2
        assert {k: v.shape for k, v in lens["token_ids"].items()} == {
            "1": (n_rows, 2), "3": (n_rows, 2)}


# One worker per core on the CPU backend.
TWO_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


LONG = "The quick brown fox jumps over the lazy dog. " * 70  # ~700 tokens: > 1 MB captured
#: Longer than the compiled engine's 16-token prefill chunks.
LONG_SAE_PROMPT = ("Once upon a time in a quiet village by the sea, an old fisherman mended "
                   "his nets.")


def _assert_inline_handoff_equals_shared_memory(llm, monkeypatch):
    """Captures sent inline, as to a front end on another host (multi-node), equal the ones
    handed over through /dev/shm on this host (where a part is large enough for it)."""
    from vllm_lens.common import handoff

    received = []
    receive = handoff.receive

    def recording(h):
        received.append(h)
        return receive(h)

    monkeypatch.setattr(handoff, "receive", recording)
    sp = SamplingParams(max_tokens=2, temperature=0, extra_args={"output_residual_stream": True})
    shared = llm.generate([LONG], sp)[0].activations
    shared_parts, received[:] = list(received), []
    with env(VLLM_LENS_SHM_HANDOFF="0"):
        inline = llm.generate([LONG], sp)[0].activations
    assert shared["residual_stream"].nbytes > 1 << 20
    assert received and all(isinstance(h, bytes) for h in received)  # really inline
    large = [h for h in shared_parts if not isinstance(h, bytes) or len(h) >= 1 << 20]
    assert all(isinstance(h, dict) for h in large)  # parts of >= 1 MB went through /dev/shm
    assert torch.equal(shared["residual_stream"], inline["residual_stream"])
    assert torch.equal(shared["positions"], inline["positions"])


def _run(llm):
    return llm.generate(PROMPTS, ALL_LAYERS), llm.generate(PROMPTS, STEER), llm.generate(
        PROMPTS, POINTS)


def _assert_same_as_reference(outs, ref_outs, tol):
    for out, ref in zip(outs, ref_outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        a, b = out.activations["residual_stream"], ref.activations["residual_stream"]
        assert a.shape == b.shape
        assert max_relative_error(a, b) <= tol


@pytest.fixture(scope="module")
def resid_sae(tmp_path_factory):
    """A random jumprelu SAE at layer 2's resid_post (the PP test's second stage)."""
    path = tmp_path_factory.mktemp("sae") / "resid"
    return path, saved_sae(path, "jumprelu", "blocks.2.hook_resid_post")


@pytest.fixture(scope="module")
def transcoder(tmp_path_factory):
    """A random JumpReLU skip transcoder standing in for layer 1's MLP (the PP test's first
    stage)."""
    path = tmp_path_factory.mktemp("transcoder") / "t1"
    return path, saved_transcoder(path, "jumprelu_skip_transcoder", 1)


@pytest.fixture(scope="module")
def arch_saes(tmp_path_factory):
    """A standard and a TopK SAE (``saes.architecture_saes``)."""
    return architecture_saes(tmp_path_factory.mktemp("arch-saes"))


@pytest.fixture(scope="module")
def reference(tiny_llm):
    captured, steered, points = _run(tiny_llm)
    unsteered = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0,
                                                          ignore_eos=True))
    assert all(a.outputs[0].token_ids != b.outputs[0].token_ids
               for a, b in zip(steered, unsteered))  # the steering matters
    gated = tiny_llm.generate(PROMPTS, GATED)
    ungated = tiny_llm.generate(PROMPTS, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, extra_args={"apply_steering_vectors": [
            GATED.extra_args["apply_steering_vectors"][0].model_copy(
                update={"condition": None, "scale": 0.0})]}))
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids
               for a, b in zip(gated, ungated))  # the gated steering matters
    for out in gated:
        g = out.steering_gates[0]["gates"]
        assert float(g.min()) < 0.5 < float(g.max())  # it fires on some tokens, not all
    return captured, steered, points, gated


def test_compiled_mode_matches_eager(tiny_path, reference, tiny_ref, arch_saes):
    with running_llm(tiny_path, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        assert llm.llm_engine.vllm_config.compilation_config.mode != 0  # really compiled
        outs = _run(llm)
        check_architectures(llm, tiny_ref, arch_saes, LONG_SAE_PROMPT, kept=[2])  # compiled
    for got, expected in zip(outs[:2], reference[:2]):
        _assert_same_as_reference(got, expected, tol=1e-5)
    _assert_points_same(outs[2], reference[2], tol=1e-5)


def _assert_stages_write_one_dataset(llm, root, sae_path):
    """Under PP each stage writes its part of every example (its layers' rows, the features
    of the SAE at its layer) into one dataset: read back, the examples are the rows and
    features the same requests return without a sink."""
    from vllm_lens.errors import SinkConflictError
    from vllm_lens.frontend.sink_control import flush_sinks

    extra = {"output_residual_stream": [1, 3],  # one layer on each stage, the SAE on the second
             "output_sae_features": {"sae": str(sae_path), "top_k": 8}}
    sp = [SamplingParams(max_tokens=4, temperature=0, extra_args={
        **extra, "capture_sink": {"sink": "acts", "dataset": "pp", "key": f"p{i}"}})
        for i in range(len(PROMPTS))]
    written = llm.generate(PROMPTS, sp)
    flush_sinks(llm)
    returned = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0,
                                                     extra_args=extra))
    ds = datasets.open(root / "pp")
    assert ds.keys() == ["p0", "p1"]
    for i, (out, ref) in enumerate(zip(written, returned)):
        receipt = out.capture_receipt
        assert out.lens_error is None and [p["writer"] for p in receipt["parts"]] == [
            "dp0-pp0", "dp0-pp1"]
        assert [(p["layers"], p["saes"]) for p in receipt["parts"]] == [([1], []), ([3], [0])]
        assert receipt["shapes"]["residual_stream"] == list(
            ref.activations["residual_stream"].shape)
        ex = ds.get(f"p{i}")
        assert ex["token_ids"] == list(out.outputs[0].token_ids)
        torch.testing.assert_close(ex["residual_stream"], ref.activations["residual_stream"],
                                   rtol=1e-4, atol=1e-5)
        (features,) = ex["sae_features"]
        assert features["positions"].tolist() == ref.sae_features[0]["positions"].tolist()
        torch.testing.assert_close(features["values"], ref.sae_features[0]["values"],
                                   rtol=1e-4, atol=1e-4)
    # A key the dataset holds whole is the caller's conflict, from either stage.
    again = llm.generate(PROMPTS[:1], sp[:1])[0]
    assert isinstance(again.lens_error, SinkConflictError)


@pytest.mark.slow
def test_tensor_parallel_2_matches_tp1(tiny_path, reference, monkeypatch, tiny_ref, resid_sae,
                                       arch_saes, transcoder):
    with env(**TWO_WORKERS), running_llm(tiny_path, tensor_parallel_size=2,
                                         enforce_eager=True) as llm:
        outs = _run(llm)
        gated = llm.generate(PROMPTS, GATED)
        describe = llm.collective_rpc("lens_describe")
        hooked = llm.generate(PROMPTS, HOOKED)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        _assert_inline_handoff_equals_shared_memory(llm, monkeypatch)
        check_features_and_clamp(llm, tiny_ref, *resid_sae, PROMPTS[0], kept=[1, 0])
        # Rank 1 keeps the TopK SAE a request clamps (it steers too), and no other.
        check_architectures(llm, tiny_ref, arch_saes, PROMPTS[1], kept=[3, 1])
        # Both ranks replace layer 1's MLP, so both keep the transcoder.
        check_transcoder(llm, tiny_ref, *transcoder, 1, PROMPTS[0], loaded=[1, 1])
    assert [d.tp_rank for d in read_all(DescribeAnswer, describe)] == [0, 1]
    _assert_hook_results(hooked, vocab)  # the parameter is gathered from both ranks
    for out, ref in zip(gated, reference[3]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        got, expected = out.steering_gates[0], ref.steering_gates[0]
        assert got["positions"].tolist() == expected["positions"].tolist()
        torch.testing.assert_close(got["gates"], expected["gates"], rtol=1e-4, atol=1e-5)
    for got, expected in zip(outs[:2], reference[:2]):
        _assert_same_as_reference(got, expected, tol=1e-4)
    _assert_points_same(outs[2], reference[2], tol=1e-4)


@pytest.mark.slow
def test_pipeline_parallel_2_matches_pp1(tiny_path, reference, monkeypatch, tmp_path, tiny_ref,
                                        resid_sae, arch_saes, transcoder):
    # vLLM 0.32's CPU runner supports PP only in compiled mode.
    sinks = json.dumps({"acts": {"root": str(tmp_path), "flush_s": 0}})
    with env(**TWO_WORKERS, VLLM_LENS_SINKS=sinks), running_llm(
            tiny_path, pipeline_parallel_size=2) as llm:
        _assert_stages_write_one_dataset(llm, tmp_path, resid_sae[0])
        describe = llm.collective_rpc("lens_describe")
        outs = _run(llm)
        one_per_stage = llm.generate(
            PROMPTS, SamplingParams(max_tokens=6, temperature=0,
                                    extra_args={"output_residual_stream": [1, 3]}))
        first_stage_only = llm.generate(
            PROMPTS, SamplingParams(max_tokens=6, temperature=0,
                                    extra_args={"output_residual_stream": [1]}))
        # The first stage has no lm_head or final norm: its hooks read prefetched copies.
        llm.prefetch_params(["lm_head.weight", "model.norm.weight"])
        hooked = llm.generate(PROMPTS, HOOKED)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        _assert_inline_handoff_equals_shared_memory(llm, monkeypatch)
        check_features_and_clamp(llm, tiny_ref, *resid_sae, PROMPTS[0], kept=[0, 1])
        # The TopK SAE at layer 2: only the second stage keeps it, also to clamp it.
        check_architectures(llm, tiny_ref, arch_saes, PROMPTS[1], kept=[1, 2])
        # Layer 1's MLP is on the first stage: only it keeps the transcoder.
        check_transcoder(llm, tiny_ref, *transcoder, 1, PROMPTS[0], loaded=[1, 0])
        # Attention steered on both stages (each recomputes its own layers' heads).
        pasta = [{"layers": [1, 3], "heads": [1], "emphasize": [2, 9], "alpha": 0.02}]
        attention = llm.generate([PROMPTS[0]], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True,
            extra_args={"steer_attention": pasta, "output_residual_stream": [3]}))[0]
    assert list(attention.outputs[0].token_ids) == tiny_ref.attention_greedy(
        list(attention.prompt_token_ids), 8, pasta)
    rows = list(attention.prompt_token_ids) + list(attention.outputs[0].token_ids)[:-1]
    with tiny_ref.attention_edits(pasta):
        steered = tiny_ref.residual_stream(rows, [3])[0]
    assert max_relative_error(attention.activations["residual_stream"][0], steered) <= 1e-4
    assert max_relative_error(steered, tiny_ref.residual_stream(rows, [3])[0]) > 1e-3
    _assert_hook_results(hooked, vocab)
    assert [d.local_layers for d in read_all(DescribeAnswer, describe)] == [[0, 1], [2, 3]]
    for got, expected in zip(outs[:2], reference[:2]):
        _assert_same_as_reference(got, expected, tol=1e-4)
    _assert_points_same(outs[2], reference[2], tol=1e-4)
    for out, first, ref in zip(one_per_stage, first_stage_only, reference[0]):
        torch.testing.assert_close(out.activations["residual_stream"],
                                   ref.activations["residual_stream"][[1, 3]],
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(first.activations["residual_stream"],
                                   ref.activations["residual_stream"][[1]],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_data_parallel_2_fetches_from_the_engine_that_served_each_request(tiny_path, tiny_llm,
                                                                         tmp_path):
    """vLLM's collective_rpc through the DP client answers with engine 0 only; every request
    must still get its own rows, whichever engine served it. Requests with a capture sink
    landing on both engines write one dataset, each engine's worker as its own writer."""
    import asyncio

    from tests.integration.engines import IDLE, held, running_async_llm
    from vllm.sampling_params import RequestOutputKind

    from vllm_lens.frontend.rpc import all_workers, pipelined
    from vllm_lens.frontend.sink_control import flush_sinks_async

    prompts = [f"{p} Request number {i}." for i, p in enumerate(PROMPTS * 4)]
    sp = SamplingParams(max_tokens=5, temperature=0, extra_args={"output_residual_stream": [1, 3]})
    expected = tiny_llm.generate(prompts, sp)

    async def serve(engine):
        # Which engine vLLM's load balancer picks for each request (read, not changed).
        core = engine.engine_core
        pick = core.get_core_engine_for_request
        chosen = []

        def recording(request):
            chosen.append(pick(request))
            return chosen[-1]

        core.get_core_engine_for_request = recording

        async def final(i, prompt):
            async for out in engine.generate(prompt, sp, f"dp-{i}"):
                pass
            return out
        async def streamed(i, prompt):  # rows with every output (the pipelined fetch)
            params = SamplingParams(max_tokens=5, temperature=0, extra_args={
                "output_residual_stream": [1, 3], "stream_activations": True},
                output_kind=RequestOutputKind.DELTA)
            return [out.activations["residual_stream"]
                    async for out in engine.generate(prompt, params, f"dp-stream-{i}")]

        outs, *streams = await asyncio.gather(
            asyncio.gather(*[final(i, p) for i, p in enumerate(prompts)]),
            *[streamed(i, p) for i, p in enumerate(prompts[:4])])
        assert len(set(chosen)) == 2  # both engines served some of the requests
        for rows, ref in zip(streams, expected[:4]):
            assert len(rows) >= 2
            torch.testing.assert_close(torch.cat(rows, dim=1),
                                       ref.activations["residual_stream"], rtol=1e-4, atol=1e-5)
        # Each engine's worker writes the requests it served into one dataset, as its own
        # named writer.
        chosen.clear()

        async def to_sink(i, prompt):
            params = SamplingParams(max_tokens=5, temperature=0, extra_args={
                **sp.extra_args, "capture_sink": {"sink": "acts", "dataset": "dp",
                                                  "key": f"k{i}"}})
            async for out in engine.generate(prompt, params, f"dp-sink-{i}"):
                pass
            return out

        receipts = [out.capture_receipt for out in await asyncio.gather(
            *[to_sink(i, p) for i, p in enumerate(prompts)])]
        assert len(set(chosen)) == 2  # both engines wrote some of them
        await flush_sinks_async(engine)
        stats = await all_workers(engine, "lens_stats")
        # The streamed fetch's route asks every engine too (both idle here: it blocks).
        assert await pipelined(engine, "lens_stats") == stats
        return outs, stats, receipts

    sinks = json.dumps({"acts": {"root": str(tmp_path)}})
    with env(**TWO_WORKERS, VLLM_LENS_SINKS=sinks), running_async_llm(
            tiny_path, data_parallel_size=2, enforce_eager=True) as (engine, run):
        outs, stats, receipts = run(serve(engine))
    assert held(stats) == [IDLE, IDLE]  # one worker per engine, both empty afterwards
    assert {r["writer"] for r in receipts} == {"dp0-pp0", "dp1-pp0"}
    ds = datasets.open(tmp_path / "dp")
    assert sorted(ds.keys()) == sorted(f"k{i}" for i in range(len(prompts)))
    for i, ref in enumerate(expected):
        torch.testing.assert_close(ds.get(f"k{i}")["residual_stream"],
                                   ref.activations["residual_stream"], rtol=1e-4, atol=1e-5)
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        _assert_same_as_reference([out], [ref], tol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, enforce_eager=True),
                                    dict(pipeline_parallel_size=2)],  # PP: compiled (vLLM 0.32)
                         ids=["tp2", "pp2"])
def test_streamed_rows_under_tensor_and_pipeline_parallelism(tiny_path, tiny_llm, resid_sae,
                                                             layout):
    """``stream_activations`` on an ``AsyncLLM`` at TP=2 (a point split across the ranks
    among the streamed ones) and PP=2 (layers on both stages): each output carries the rows
    and SAE features computed since the previous one, and laid end to end they are the TP=1
    engine's unstreamed capture."""
    import asyncio

    from tests.integration.engines import IDLE, held, running_async_llm
    from vllm.sampling_params import RequestOutputKind

    from vllm_lens.frontend.merge import join_streamed
    from vllm_lens.frontend.rpc import all_workers

    extra = {"output_residual_stream": [1, 3], "output_activations": {"attn_z": [1, 2]},
             "output_sae_features": {"sae": str(resid_sae[0]), "top_k": 8}}
    expected = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0,
                                                          extra_args=extra))
    streamed_sp = SamplingParams(max_tokens=5, temperature=0, output_kind=RequestOutputKind.DELTA,
                                 extra_args={**extra, "stream_activations": True})

    async def stream_all(engine):
        async def one(i, prompt):
            return [{"activations": out.activations, "sae_features": out.sae_features}
                    async for out in engine.generate(prompt, streamed_sp, f"stream-{i}")]

        streams = await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])
        return streams, await all_workers(engine, "lens_stats")

    with env(**TWO_WORKERS), running_async_llm(tiny_path, **layout) as (engine, run):
        streams, stats = run(stream_all(engine))
    assert held(stats) == [IDLE, IDLE]
    for parts, ref in zip(streams, expected):
        # The rows came in pieces: outputs before the last carried rows and features.
        early = [p for p in parts[:-1] if p["activations"] is not None
                 and p["activations"]["residual_stream"].shape[1] > 0
                 and p["sae_features"] is not None and len(p["sae_features"][0]["positions"])]
        assert len(early) >= 2, [None if p["activations"] is None else
                                 p["activations"]["residual_stream"].shape for p in parts]
        joined = join_streamed(parts)
        for name in ("residual_stream", "attn_z"):
            assert max_relative_error(joined["activations"][name],
                                      ref.activations[name]) <= 1e-4, name
        (features,) = joined["sae_features"]
        assert features["positions"].tolist() == ref.sae_features[0]["positions"].tolist()
        torch.testing.assert_close(features["values"], ref.sae_features[0]["values"],
                                   rtol=1e-4, atol=1e-4)
        active = ref.sae_features[0]["values"] > 1e-3  # (ties below that may swap places)
        assert torch.equal(features["indices"][active], ref.sae_features[0]["indices"][active])
