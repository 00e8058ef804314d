"""AsyncLLM: concurrent lens requests, streaming, aborts and bad input."""

import asyncio
import itertools

import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from tests.integration.conftest import TINY_CHUNKED
from tests.integration.engines import IDLE, held, running_async_llm
from vllm_lens.common.messages import StatsAnswer, read

PROMPTS = [
    "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi.",
    "One two three.",
    "The rain in Spain stays mainly in the plain, said the professor, twice.",
]
SPECS = [[0], {"layers": [1, 2], "positions": "generated"}, True]


@pytest.fixture(scope="module")
def async_engine(tiny_path):
    with running_async_llm(tiny_path, **TINY_CHUNKED) as engine_and_run:
        yield engine_and_run


async def _final(engine, prompt, sp, request_id):
    last = None
    async for out in engine.generate(prompt, sp, request_id):
        last = out
    return last


def _sp(spec, **kw):
    return SamplingParams(max_tokens=6, temperature=0, extra_args={"output_residual_stream": spec},
                          **kw)


def test_concurrent_requests_match_offline(async_engine, tiny_llm):
    engine, run = async_engine

    async def many():
        return await asyncio.gather(*[
            _final(engine, p, _sp(s), f"conc-{i}") for i, (p, s) in enumerate(zip(PROMPTS, SPECS))
        ])

    outs = run(many())
    offline = tiny_llm.generate(PROMPTS, [_sp(s) for s in SPECS])
    for out, ref in zip(outs, offline):
        assert out.finished and out.outputs[0].token_ids == ref.outputs[0].token_ids
        torch.testing.assert_close(out.activations["residual_stream"],
                                   ref.activations["residual_stream"], rtol=1e-5, atol=1e-6)


def test_streaming_delta_outputs_carry_full_capture_at_the_end(async_engine):
    engine, run = async_engine
    sp = _sp([3], output_kind=RequestOutputKind.DELTA)

    async def stream():
        return [out async for out in engine.generate(PROMPTS[1], sp, "stream-1")]

    outs = run(stream())
    n_generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(getattr(o, "activations", None) is None for o in outs[:-1])
    final = outs[-1].activations["residual_stream"]
    assert final.shape[1] == len(outs[0].prompt_token_ids) + n_generated - 1


def test_aborted_request_leaves_nothing_behind(async_engine):
    engine, run = async_engine
    sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True,
                        extra_args={"output_residual_stream": True})

    async def abandon():
        gen = engine.generate(PROMPTS[0], sp, "abandoned")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            stats = await engine.collective_rpc("lens_stats")
            if held(stats) == [IDLE]:
                return stats
            await asyncio.sleep(0.05)
        return stats

    assert held(run(abandon())) == [IDLE]


def test_bad_input_fails_alone(async_engine):
    engine, run = async_engine

    async def bad_then_good():
        with pytest.raises(ValueError, match=r"output_residual_stream\[0\]"):
            await _final(engine, PROMPTS[1], _sp([99]), "bad-1")
        return await _final(engine, PROMPTS[1], _sp([1]), "good-1")

    assert run(bad_then_good()).activations["residual_stream"].shape[0] == 1


def test_steering_through_async_matches_offline(async_engine, tiny_llm):
    engine, run = async_engine
    from vllm_lens import SteeringVector

    sv = SteeringVector(activations=torch.linspace(-2, 2, 128)[None], layer_indices=[1])
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                        extra_args={"apply_steering_vectors": sv.to_wire()})
    out = run(_final(engine, PROMPTS[2], sp, "steer-1"))
    offline = tiny_llm.generate([PROMPTS[2]], sp)[0]
    plain = tiny_llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0,
                                                           ignore_eos=True))[0]
    assert out.outputs[0].token_ids == offline.outputs[0].token_ids
    assert out.outputs[0].token_ids != plain.outputs[0].token_ids


def test_a_running_lens_requests_id_cannot_be_reused(async_engine, tiny_llm):
    # vLLM accepts duplicate ids; outputs carry only the id, so a second request under the id
    # of a running lens request could be handed its activations. It is refused instead.
    engine, run = async_engine

    async def clash():
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            extra_args={"output_residual_stream": [0]})
        first = engine.generate(PROMPTS[0], sp, "same-id")
        last = await first.__anext__()  # it is running now
        with pytest.raises(ValueError, match=r"'request_id'.*already used"):
            await _final(engine, PROMPTS[1], SamplingParams(max_tokens=2), "same-id")
        async for last in first:
            pass
        return last

    out = run(clash())
    expected = tiny_llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True,
        extra_args={"output_residual_stream": [0]}))[0]
    assert torch.equal(out.activations["residual_stream"],
                       expected.activations["residual_stream"])
    # once it finished, the id is free again
    assert run(_final(engine, PROMPTS[1], _sp([0]), "same-id")).activations is not None


def test_idle_engine_holds_nothing_after_200_mixed_requests_with_aborts(async_engine):
    """Capture, steering, hooks, plain and failing requests, every tenth one abandoned after
    its first output: afterwards no worker holds a byte or a record for any of them."""
    from vllm_lens import NamedHook, SteeringVector

    engine, run = async_engine
    sv = SteeringVector(activations=torch.ones(2, 128), layer_indices=[0, 2])
    kinds = [
        {"output_residual_stream": True},
        {"apply_steering_vectors": [sv]},
        {"apply_hooks": [NamedHook("linear_probe", [1], {"weight": [0.01] * 128})]},
        {},
        {"output_residual_stream": {"layers": [3], "positions": "generated"},
         "apply_steering_vectors": [sv]},
        {"output_residual_stream": [1], "lens_test_fault": "capture"},
        {"apply_steering_vectors": [sv], "lens_test_fault": "steer"},
    ]

    async def one(i):
        extra = kinds[i % len(kinds)]
        sp = SamplingParams(max_tokens=4 + i % 5, temperature=0, ignore_eos=True,
                            extra_args=extra or None)
        gen = engine.generate(PROMPTS[i % len(PROMPTS)], sp, f"mixed-{i}")
        if i % 10 == 9:  # abandoned mid-way
            async for _ in gen:
                break
            await gen.aclose()
            return "aborted"
        try:
            async for out in gen:
                pass
        except Exception as exc:
            return type(exc).__name__
        if "output_residual_stream" in extra:
            assert out.activations["residual_stream"].shape[1] > 0
        return "ok"

    async def everything():
        results = await asyncio.gather(*[one(i) for i in range(200)])
        for _ in range(100):
            stats = await engine.collective_rpc("lens_stats")
            if held(stats) == [IDLE]:
                break
            await asyncio.sleep(0.05)
        return results, stats

    results, stats = run(everything())
    assert held(stats) == [IDLE]
    faulty = {i for i in range(200) if "lens_test_fault" in kinds[i % len(kinds)]}
    for i, result in enumerate(results):
        if i % 10 == 9:
            assert result == "aborted"
        else:
            assert result == ("LensExecutionError" if i in faulty else "ok"), i


def _rows_by_output(outs, name):
    return [o.activations[name] for o in outs], [o.activations[f"{name}_positions"]
                                                  if f"{name}_positions" in o.activations
                                                  else o.activations["positions"] for o in outs]


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streamed_rows_arrive_with_each_output_and_add_up_to_the_final_capture(async_engine,
                                                                              kind):
    """Every output of a ``stream_activations`` request carries the rows computed since the
    previous one (the prompt's with the first); laid end to end, for every signal, they are
    the capture of the same request without streaming. Three stream at once, beside a plain
    capture."""
    engine, run = async_engine
    capture = {"output_residual_stream": [0, 3],
               "output_activations": {"attn_out": [1], "mlp_post": [2]}}

    def sp(stream, positions="all", max_tokens=6):
        extra = {**capture, "output_residual_stream": {"layers": [0, 3],
                                                       "positions": positions}}
        if stream:
            extra["stream_activations"] = True
        return SamplingParams(max_tokens=max_tokens, temperature=0, output_kind=kind,
                              extra_args=extra)

    async def both():
        streamed = [engine.generate(p, sp(True), f"rows-{kind.name}-{i}")
                    for i, p in enumerate(PROMPTS)]

        async def collect(gen):  # (output, its tokens so far: vLLM updates outputs in place)
            return [(out, len(out.outputs[0].token_ids)) async for out in gen]

        return await asyncio.gather(*map(collect, streamed),
                                    _final(engine, PROMPTS[0], sp(False), f"whole-{kind.name}"))

    *streams, whole_first = run(both())
    for i, with_counts in enumerate(streams):
        outs = [out for out, _ in with_counts]
        whole = whole_first if i == 0 else run(_final(engine, PROMPTS[i], sp(False),
                                                      f"whole-{kind.name}-{i}"))
        n_prompt = len(outs[-1].prompt_token_ids)
        assert all(o.lens_error is None for o in outs)
        rows, positions = _rows_by_output(outs, "residual_stream")
        assert positions[0].tolist()[:n_prompt] == list(range(n_prompt)) and len(outs) >= 2
        if kind == RequestOutputKind.DELTA:
            # An output with T tokens so far carries the rows up to position n_prompt + T - 2
            # (its last token is fed at the next step). vLLM merges outputs a consumer has not
            # taken yet, so one may carry several tokens; usually each carries one. (A
            # CUMULATIVE output's token list is vLLM's live one, which grows while a consumer
            # lags: there only the order and the concatenation below are checked.)
            totals = list(itertools.accumulate(n for _, n in with_counts))
            starts = [0] + [n_prompt + t - 1 for t in totals[:-1]]
            assert totals[-1] == 6 and [p.tolist() for p in positions] == [
                list(range(start, n_prompt + t - 1)) for start, t in zip(starts, totals)]
        for name in ("residual_stream", "attn_out", "mlp_post"):
            rows, positions = _rows_by_output(outs, name)
            torch.testing.assert_close(torch.cat(rows, dim=1), whole.activations[name],
                                       rtol=1e-5, atol=1e-6)
            assert torch.cat(positions).tolist() == whole.activations[
                f"{name}_positions" if name != "residual_stream" else "positions"].tolist()


def test_streamed_generated_rows_and_bad_streams(async_engine):
    engine, run = async_engine
    sp = SamplingParams(max_tokens=4, temperature=0, output_kind=RequestOutputKind.DELTA,
                        extra_args={"output_residual_stream": {"layers": [1],
                                                               "positions": "generated"},
                                    "stream_activations": True})

    async def stream():
        return [out async for out in engine.generate(PROMPTS[1], sp, "gen-rows")]

    outs = run(stream())
    n_prompt = len(outs[0].prompt_token_ids)
    sizes = [o.activations["residual_stream"].shape[1] for o in outs]
    assert sizes == [0, 1, 1, 1]  # the prompt's rows are not selected
    assert torch.cat([o.activations["positions"] for o in outs]).tolist() == [
        n_prompt, n_prompt + 1, n_prompt + 2]
    for extra, problem in [({"stream_activations": True,
                             "output_residual_stream": {"layers": [1], "reduce": "mean"}},
                            "reduced"),
                           ({"stream_activations": True}, "captures nothing")]:
        bad = SamplingParams(max_tokens=2, extra_args=extra)
        with pytest.raises(ValueError, match=problem):
            run(_final(engine, PROMPTS[0], bad, f"bad-{problem}"))
    with pytest.raises(ValueError, match="n=2 is not supported"):
        run(_final(engine, PROMPTS[0], SamplingParams(
            max_tokens=2, n=2, extra_args={"output_residual_stream": [1],
                                           "stream_activations": True}), "bad-n"))
    assert held(run(engine.collective_rpc("lens_stats"))) == [IDLE]


def test_pipelined_worker_call_answers_on_an_idle_and_on_a_busy_engine(async_engine):
    """``lens_pipelined_rpc`` (the engine-core method streamed fetches use) answers like
    ``collective_rpc`` when the engine is idle (blocking) and while requests run (the answer
    waits for the next step), and a generation around it is undisturbed."""
    from vllm_lens.frontend.rpc import pipelined

    engine, run = async_engine
    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)

    async def go():
        idle = await pipelined(engine, "lens_stats")
        generation = engine.generate(PROMPTS[0], sp, "pipelined-busy")
        first = await anext(generation)
        busy = [await pipelined(engine, "lens_stats") for _ in range(3)]
        rest = [out async for out in generation]
        # A call made while a request runs that is aborted at once: the engine goes idle
        # right after, and the answer must still come (bounded here, so a hang fails).
        aborted = engine.generate(PROMPTS[1], sp, "pipelined-aborted")
        await anext(aborted)
        call = asyncio.ensure_future(pipelined(engine, "lens_stats"))
        await engine.abort("pipelined-aborted")
        await aborted.aclose()
        last = await asyncio.wait_for(call, timeout=60)
        return idle, busy + [last], first, rest

    idle, busy, first, rest = run(go())
    assert idle == run(engine.collective_rpc("lens_stats")) and held(idle) == [IDLE]
    assert all(len(answer) == len(idle)
               and isinstance(read(StatsAnswer, answer[0]), StatsAnswer) for answer in busy)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "length"
    assert len(first.outputs[0].token_ids) + sum(len(o.outputs[0].token_ids) for o in rest) == 400


def test_sae_features_by_directory_and_by_registered_name(async_engine, tiny_llm, tmp_path):
    """An ``AsyncLLM`` outside the server (its caller owns the process) reads an SAE by
    directory or by a name ``register_sae`` gave it, with the same features the offline
    engine returns, also streamed (``stream_activations``: each output the features of the
    positions computed since the previous one); a directory that holds no SAE is refused
    naming the field."""
    from tests.integration.saes import saved_sae
    from vllm_lens import LensRequestError

    engine, run = async_engine
    saved_sae(tmp_path / "sae", "topk", "blocks.1.hook_resid_post", k=8)

    def sp(sae):
        return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
            "output_sae_features": {"sae": sae, "top_k": 8, "reconstruction": True}})

    by_path = run(_final(engine, PROMPTS[0], sp(str(tmp_path / "sae")), "sae-path"))
    run(engine.register_sae("topk-1", str(tmp_path / "sae")))
    by_name = run(_final(engine, PROMPTS[0], sp("topk-1"), "sae-name"))
    offline = tiny_llm.generate([PROMPTS[0]], sp(str(tmp_path / "sae")))[0]
    assert by_name.sae_features[0]["sae"] == "topk-1"
    for out in (by_path, by_name):
        assert out.outputs[0].token_ids == offline.outputs[0].token_ids
        for key in ("positions", "indices", "l0"):
            assert out.sae_features[0][key].tolist() == offline.sae_features[0][key].tolist()
        for key in ("values", "nmse"):
            torch.testing.assert_close(out.sae_features[0][key], offline.sae_features[0][key],
                                       rtol=1e-5, atol=1e-6)
    streamed = sp("topk-1")
    streamed.extra_args["stream_activations"] = True
    streamed.output_kind = RequestOutputKind.DELTA

    async def stream():
        return [out async for out in engine.generate(PROMPTS[0], streamed, "sae-stream")]

    outs = run(stream())
    assert all(len(o.sae_features) == 1 for o in outs)
    # The first output brings the prompt's positions, each later one the positions computed
    # since: laid end to end, the whole request's features.
    assert outs[0].sae_features[0]["positions"].numel() == len(outs[0].prompt_token_ids)
    for key in ("positions", "indices", "values", "nmse", "l0"):
        joined = torch.cat([o.sae_features[0][key] for o in outs])
        torch.testing.assert_close(joined, by_name.sae_features[0][key], rtol=1e-5, atol=1e-6)
    with pytest.raises(LensRequestError) as bad:
        run(_final(engine, PROMPTS[0], sp(str(tmp_path / "nothing")), "sae-bad"))
    assert bad.value.field == "output_sae_features.sae"
    assert held(run(engine.collective_rpc("lens_stats"))) == [IDLE]
