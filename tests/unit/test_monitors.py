"""Monitors without an engine: what ``spec.monitors`` refuses and keeps, the worker's scores,
joins, packing and forced rows (``worker.monitors``), and the records the front end makes of
them (``frontend.collator``, ``frontend.http.results``). The engine tests are in
``tests/integration/test_monitors.py`` and the families' ``test_a_stop_monitor...``."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from vllm import SamplingParams

from vllm_lens.common import wire
from vllm_lens.errors import LensRequestError, UnsupportedConfigError
from vllm_lens.frontend.collator import _stopped_by, monitor_records
from vllm_lens.frontend.http.results import monitors_to_json
from vllm_lens.spec import LensRequest, ModelFacts, parse_extra_args
from vllm_lens.spec.monitors import MAX_MONITORS, check_sampling, parse_monitors
from vllm_lens.worker import monitors as worker_monitors
from vllm_lens.worker.monitors import MonitorState, force_stops, pack_scores

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8,
                   max_model_len=1024, mapped=True, sites=["pre", "mid", "post"])


def _monitor(**change):
    return {"name": "m", "probe": [1.0] * 8, "layer": 1, "threshold": 2.0,
            "action": "stop", **change}


def test_a_monitor_is_parsed_with_its_defaults_and_travels_in_the_payload():
    (spec,) = parse_monitors([_monitor(layer=-1, bias=0.5)], FACTS)
    assert (spec.name, spec.layer, spec.point, spec.bias, spec.stops) == (
        "m", 3, "resid_post", 0.5, True)
    assert wire.loads(spec.probe).tolist() == [1.0] * 8
    _, lens = parse_extra_args({"monitors": json.dumps([_monitor()])}, lambda: FACTS)
    again = LensRequest.from_payload(lens.to_payload())
    assert again.monitors == lens.monitors


@pytest.mark.parametrize(("change", "field"), [
    ({"probe": [1.0] * 7}, "monitors[0].probe"),
    ({"probe": [1.0] * 7 + [math.inf]}, "monitors[0].probe"),
    ({"probe": "abc"}, "monitors[0].probe"),
    ({"action": None}, "monitors[0].action"),
    ({"threshold": True}, "monitors[0].threshold"),
    ({"bias": math.nan}, "monitors[0].bias"),
    ({"layer": 4}, "monitors[0].layer"),
    ({"layer": 1.0}, "monitors[0].layer"),
    ({"point": "attn_z"}, "monitors[0].point"),
    ({"name": "has space"}, "monitors[0].name"),
    ({"thresold": 1}, "monitors[0].thresold"),
    ({"feature": 3}, "monitors[0].layer"),  # a probe's fields with an SAE feature's
])
def test_a_bad_field_is_named(change, field):
    with pytest.raises(LensRequestError) as raised:
        parse_monitors([_monitor(**change)], FACTS)
    assert raised.value.field == field


def test_lists_that_cannot_be_served_are_refused():
    for raw, field in (([], "monitors"), ("not json", "monitors"),
                       ([_monitor()] * (MAX_MONITORS + 1), "monitors"),
                       ([_monitor(), _monitor()], "monitors[1].name")):
        with pytest.raises(LensRequestError) as raised:
            parse_monitors(raw, FACTS)
        assert raised.value.field == field
    for change in ({"pp_size": 2}, {"speculative": True}):
        with pytest.raises(UnsupportedConfigError):
            parse_monitors([_monitor()], ModelFacts(**{**FACTS.__dict__, **change}))


def test_sampling_a_stop_monitor_cannot_end_is_refused_and_flag_is_not():
    stop, flag = (parse_monitors([_monitor(action=a)], FACTS) for a in ("stop", "flag"))
    for params in (SamplingParams(ignore_eos=True), SamplingParams(min_tokens=2),
                   SamplingParams(allowed_token_ids=[1, 2]), SamplingParams(bad_words=["x"])):
        with pytest.raises(LensRequestError, match=r"monitors\[0\]\.action"):
            check_sampling(stop, params)
        check_sampling(flag, params)
    with pytest.raises(LensRequestError, match="n=2"):
        check_sampling(flag, SamplingParams(n=2))
    check_sampling(stop, SamplingParams())


def _state(*monitors, split=False):
    specs = parse_monitors([_monitor(**m) for m in monitors], FACTS)
    return MonitorState.build(specs, torch.device("cpu"), eos=7, split=split)


def test_scores_at_a_site_are_the_probe_on_the_points_value_and_the_flag_sticks():
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(8, generator=g)
    state = _state({"name": "post", "probe": probe.tolist(), "bias": 0.5, "threshold": 1e9},
                   {"name": "out", "probe": probe.tolist(), "point": "mlp_out",
                    "action": "flag"})
    hidden, residual = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    sites = list(state.by_site)
    assert len(sites) == 1  # resid_post and mlp_out share the post site (fused layout)
    state.score(sites[0], hidden, residual, 2, 6, 40, n_prompt=4, keep=True)
    (positions, post), (_, out) = state.kept(0), state.kept(1)
    assert torch.allclose(post, (hidden[2:6] + residual[2:6]) @ probe + 0.5, atol=1e-5)
    assert torch.allclose(out, hidden[2:6] @ probe, atol=1e-5)
    assert positions.tolist() == [40, 41, 42, 43]
    assert not bool(state.fired)
    low = _state({"threshold": -1e9})
    low.score(next(iter(low.by_site)), hidden, residual, 0, 1, 0, n_prompt=4, keep=False)
    assert bool(low.fired) and low.chunks == [[]]  # fired, nothing kept on this rank


def test_a_generated_only_monitor_skips_the_prompt_rows():
    state = _state({"positions": "generated", "action": "flag"}, {"name": "all"})
    hidden = torch.ones(10, 8)
    where = next(iter(state.by_site))
    state.score(where, hidden, None, 0, 6, 0, n_prompt=4, keep=True)  # prompt 0-3, then 4-5
    state.score(where, hidden, None, 6, 7, 6, n_prompt=4, keep=True)
    generated = state.kept(0)[0].tolist()
    every = state.kept(1)[0].tolist()
    assert generated == [4, 5, 6] and every == list(range(7))
    assert bool(state.fired)  # the stop monitor over every position: 8 > its threshold 2
    with pytest.raises(LensRequestError, match=r"monitors\[0\]\.positions"):
        parse_monitors([_monitor(positions="prompt")], FACTS)


def test_steps_are_joined_and_packed_once_per_position_below_the_valid_count(monkeypatch):
    monkeypatch.setattr(worker_monitors, "_JOIN_EVERY", 3)
    state = _state({"action": "flag"})
    where = next(iter(state.by_site))
    hidden = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
    for pos0 in range(0, 8):  # one row a step, position 5 computed again (a preemption)
        state.score(where, hidden, None, pos0, pos0 + 1, pos0, n_prompt=3, keep=True)
    state.score(where, hidden * 0, None, 5, 6, 5, n_prompt=3, keep=True)
    assert len(state.chunks[0]) < 9 and state.ranges[0] == [[0, 8], [5, 1]]
    (packed,) = wire.loads(pack_scores(state, valid=7))
    assert packed["positions"].tolist() == list(range(7))
    assert packed["scores"][5] == 0.0 and packed["scores"][4] == hidden[4].sum()
    (everything,) = wire.loads(pack_scores(state, valid=None))
    assert everything["positions"].tolist() == list(range(8))


def test_forced_rows_put_all_mass_on_eos_only_where_fired_or_failed():
    fired, quiet, failed = _state({}), _state({}), _state({})
    fired.fired = torch.tensor(True)
    quiet.fired = torch.tensor(False)
    logits = torch.randn(4, 10)
    before = logits.clone()
    force_stops(logits, [(0, fired, False), (1, quiet, False), (3, failed, True)])
    assert logits[0].argmax() == 7 and torch.isinf(logits[0]).sum() == 9
    assert torch.equal(logits[1], before[1]) and torch.equal(logits[2], before[2])
    assert logits[3].argmax() == 7 and torch.isinf(logits[3]).sum() == 9


def test_a_stop_monitor_without_eos_is_refused_naming_it():
    specs = parse_monitors([_monitor()], FACTS)
    with pytest.raises(ValueError, match=r"monitors\[0\]\.action"):
        MonitorState.build(specs, torch.device("cpu"), eos=None, split=False)


def test_records_name_the_first_crossing_and_the_first_stop_wins():
    _, lens = parse_extra_args({"monitors": [_monitor(name="a"), _monitor(name="b"),
                                             _monitor(name="c", action="flag")]},
                               lambda: FACTS)
    scored = [{"positions": torch.arange(4), "scores": torch.tensor(s)} for s in (
        [0.0, 1.0, 3.0, 5.0], [0.0, 2.5, 0.0, 9.0], [9.0, 9.0, 9.0, 9.0])]
    records = monitor_records(lens, scored)
    assert [(r["fired"], r["position"], r["score"]) for r in records] == [
        (True, 2, 3.0), (True, 1, 2.5), (True, 0, 9.0)]
    assert _stopped_by(records) == "b"  # the earliest stop; a flag never names the stop
    quiet = monitor_records(lens, [{"positions": torch.arange(1),
                                    "scores": torch.tensor([0.0])}] * 3)
    assert _stopped_by(quiet) is None and quiet[0]["position"] is None
    as_json = monitors_to_json(records)
    assert as_json[0]["positions"] == [0, 1, 2, 3] and as_json[1]["score"] == 2.5
    json.dumps(as_json)  # plain JSON
    with pytest.raises(ValueError):
        monitor_records(lens, scored[:2])  # a rank that sent fewer monitors than asked


def test_long_chunks_are_scored_a_block_of_rows_at_a_time(monkeypatch):
    monkeypatch.setattr(worker_monitors, "_BLOCK_ROWS", 2)
    g = torch.Generator().manual_seed(1)
    hidden, residual = torch.randn(9, 8, generator=g), torch.randn(9, 8, generator=g)
    probe = torch.randn(8, generator=g)
    state = _state({"probe": probe.tolist(), "bias": -1.0, "action": "flag"})
    state.score(next(iter(state.by_site)), hidden, residual, 1, 8, 0, n_prompt=0, keep=True)
    positions, scores = state.kept(0)
    assert positions.tolist() == list(range(7))
    assert torch.allclose(scores, (hidden[1:8] + residual[1:8]) @ probe - 1.0, atol=1e-5)


def test_sae_feature_monitors_are_referenced_before_the_parse_and_need_a_describer():
    from vllm_lens.spec.monitors import monitor_sae_references

    one = {"name": "f", "sae": "s", "feature": 3, "threshold": 1.0, "action": "flag"}
    assert monitor_sae_references([one, _monitor()]) == [("s", None, (3,), False)]
    assert monitor_sae_references(json.dumps(one)) == [("s", None, (3,), False)]
    assert monitor_sae_references("not json") == [] and monitor_sae_references(None) == []
    with pytest.raises(LensRequestError) as err:
        parse_monitors([one], FACTS)  # no SAE describer: refused by field
    assert err.value.field == "monitors[0].sae"
    with pytest.raises(LensRequestError) as err:
        parse_monitors([{**one, "feature": "3"}], FACTS)
    assert err.value.field == "monitors[0].feature"
    with pytest.raises(LensRequestError) as err:
        parse_monitors([{**one, "hook": "logit_lens"}], FACTS)
    assert err.value.field == "monitors[0].feature"  # a hook monitor has no SAE fields


def test_an_sae_feature_monitor_scores_the_features_activation():
    """The worker's score is the cut-down SAE's ``encode`` of ``a + b`` (JumpReLU: zero at or
    below the threshold)."""
    g = torch.Generator().manual_seed(0)
    w_enc, w_dec = torch.randn(8, 1, generator=g), torch.randn(1, 8, generator=g)
    encoder = {"architecture": "jumprelu", "W_enc": w_enc, "b_enc": torch.tensor([0.1]),
               "W_dec": w_dec, "b_dec": torch.randn(8, generator=g),
               "threshold": torch.tensor([0.5]), "apply_b_dec_to_input": True}
    from vllm_lens.spec.monitors import MonitorSpec

    spec = MonitorSpec(name="f", action="flag", threshold=1.0, layer=1, point="resid_mid",
                       probe=b"", encoder=wire.dumps(encoder), sae="s", feature=0)
    state = MonitorState.build((spec,), torch.device("cpu"), 2, split=False)
    hidden, residual = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    (where,) = state.by_site
    state.score(where, hidden, residual, 0, 5, 0, 5, True)
    _, got = state.kept(0)
    h = (hidden + residual - encoder["b_dec"]) @ w_enc[:, 0] + 0.1
    assert torch.allclose(got, torch.where(h > 0.5, h, torch.zeros(())), atol=1e-6)
    assert MonitorSpec.from_payload(spec.to_payload()) == spec


def test_stop_control_closes_failed_requests_until_they_are_gone():
    """A request whose lens work failed while a stop monitor guarded it is forced to end at
    this step and every later one, until the runner drops it; a healthy one only once fired."""
    from types import SimpleNamespace

    from vllm_lens.worker.monitors import StopControl

    healthy, broken = _state({}), _state({})
    healthy.fired = torch.tensor(False)
    live = {"a", "b"}
    view = SimpleNamespace(live=lambda: live, logits_row={"a": 0, "b": 1}.get)
    records = {"a": SimpleNamespace(error=None), "b": SimpleNamespace(error="failed")}
    control = StopControl()
    logits = torch.zeros(2, 10)
    control.force(logits, [("a", healthy), ("b", broken)], records, view)
    assert "b" in control.closing and "a" not in control.closing
    assert logits[0].argmax() == 0 and not torch.isinf(logits[0]).any()  # not fired
    assert logits[1].argmax() == 7  # failed: ends (fails closed)
    again = torch.zeros(2, 10)
    control.force(again, [], records, view)  # a later step: still closing
    assert again[1].argmax() == 7
    live.discard("b")
    control.force(torch.zeros(2, 10), [], records, view)
    assert control.closing == {}


QK_FACTS = ModelFacts(**{**FACTS.__dict__, "sites": ["pre", "mid", "post", "attn"],
                         "n_heads": 4, "n_kv_heads": 2, "head_dim": 2})


def _hook_monitor(**change):
    return {"name": "h", "hook": "linear_probe", "args": {"weight": [1.0] * 8, "bias": 0.5},
            "layer": 1, "threshold": 2.0, "action": "stop", **change}


def test_a_monitor_by_a_hooks_score_is_parsed_and_travels_in_the_payload():
    (spec,) = parse_monitors([_hook_monitor(layer=-2, point="mlp_out")], FACTS)
    assert (spec.hook, spec.layer, spec.point, spec.score_key, spec.reduce) == (
        "linear_probe", 2, "mlp_out", "scores", "")
    assert json.loads(spec.hook_args) == {"weight": [1.0] * 8, "bias": 0.5}
    hook = spec.hook_spec()
    assert (hook.layers, hook.name, hook.point, hook.args) == (
        (2,), "linear_probe", "mlp_out", spec.hook_args)
    _, lens = parse_extra_args({"monitors": [_hook_monitor()]}, lambda: FACTS)
    assert LensRequest.from_payload(lens.to_payload()).monitors == lens.monitors
    (attention,) = parse_monitors([_hook_monitor(
        hook="attention_to_span", args={"span": [0, 3], "queries": "generated"},
        point="attn_qk", reduce="max")], QK_FACTS)
    assert (attention.score_key, attention.reduce, attention.point) == ("mass", "max", "attn_qk")


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"hook": "no_such_hook"}, "monitors[0].hook", "no hook named"),
    ({"hook": "logit_lens_topk", "args": {}}, "monitors[0].hook", "monitor_score"),
    ({"hook": 3}, "monitors[0].hook", "name"),
    ({"args": {"weight": [1.0] * 7}}, "monitors[0].args.weight", "7 numbers"),
    ({"args": {"weight": [1.0] * 8, "scale": 2}}, "monitors[0].args", "unknown argument"),
    ({"args": [1, 2]}, "monitors[0].args", "JSON object"),
    ({"reduce": "max"}, "monitors[0].reduce", "nothing to reduce"),
    ({"point": "mlp_post"}, "monitors[0].point", "cannot be written"),
    ({"layer": 9}, "monitors[0].layer", "not a layer"),
    ({"probe": [1.0] * 8}, "monitors[0].probe", "unknown field"),
    ({"hook": "attention_to_span", "args": {"span": [0, 3]}, "point": "attn_qk"},
     "monitors[0].reduce", "one number per head"),
    ({"hook": "attention_to_span", "args": {"span": [0, 3]}, "reduce": "max"},
     "monitors[0].point", "attn_qk"),
    ({"hook": "attention_to_span", "args": {"span": [3, 0]}, "point": "attn_qk",
      "reduce": "median"}, "monitors[0].args", "span must be"),
])
def test_a_bad_hook_monitor_is_refused_naming_the_field(change, field, message):
    with pytest.raises(LensRequestError) as raised:
        parse_monitors([_hook_monitor(**change)], QK_FACTS)
    assert raised.value.field == field and message in str(raised.value)


def test_a_hook_monitor_at_qk_is_refused_under_tensor_parallelism():
    tp2 = ModelFacts(**{**QK_FACTS.__dict__, "tp_size": 2})
    with pytest.raises(UnsupportedConfigError) as raised:
        parse_monitors([_hook_monitor(hook="attention_to_span", args={"span": [0, 3]},
                                      point="attn_qk", reduce="max")], tp2)
    assert raised.value.field == "monitors[0].point"


def _run_hooks(state, where, hidden, residual, start, end, pos0, n_prompt):
    from vllm_lens.worker.hooks import HookCall, run_hook_calls

    call = HookCall("r", start, end, pos0, (state.hooks,), n_prompt)
    run_hook_calls([call], where[0], where[1], hidden, residual, None, 0, None, split=False)
    state.score(where, hidden, residual, start, end, pos0, n_prompt, True)


def test_a_hook_monitor_reads_what_its_hook_saved_for_these_rows():
    """A monitor by ``linear_probe``'s score reports what the probe computes (the hook runs
    first, at the same tap), the generated rows alone when asked, from the hook's rows, also
    once they moved to the host."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(8, generator=g)
    args = {"weight": weight.tolist(), "bias": 0.25}
    state = _state_of([_hook_monitor(args=args, threshold=1e9),
                       _hook_monitor(name="g", args=args, action="flag",
                                     positions="generated")])
    assert state.hooks is not None and len(state.hooks.runs) == 2
    (where,) = state.sites
    hidden, residual = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    _run_hooks(state, where, hidden, residual, 0, 6, 0, 4)  # prompt 0-3, then 4-5
    _run_hooks(state, where, hidden, residual, 6, 7, 6, 4)
    expected = (hidden[:7] + residual[:7]) @ weight + 0.25
    positions, scores = state.kept(0)
    assert positions.tolist() == list(range(7))
    assert torch.allclose(scores, expected, atol=1e-5)
    generated, later = state.kept(1)
    assert generated.tolist() == [4, 5, 6] and torch.allclose(later, expected[4:], atol=1e-5)
    assert not bool(state.fired)
    packed = wire.loads(pack_scores(state, valid=None))
    assert packed[1]["positions"].tolist() == [4, 5, 6]
    state.free()  # what the hook saved goes to the host, and the report still reads it
    assert state.kept(0)[0].tolist() == list(range(7)) and state.hooks.runs[0].fn is None


def test_a_stop_hook_monitor_fires_on_this_steps_rows_only():
    """Rows whose first unit is the score (weight e0): a stop monitor fires in the step that
    computes a crossing position, reads only that step's rows (an old crossing row does not
    fire it again), and with ``"positions": "generated"`` a crossing prompt row does not."""
    weight = [1.0] + [0.0] * 7
    hidden = torch.zeros(10, 8)
    hidden[:, 0] = torch.tensor([0.0, 20.0, 2.0, 3.0, 1.0, 2.0, 10.0, 1.0, 0.0, 0.0])
    every = _state_of([_hook_monitor(args={"weight": weight}, threshold=7.0)])
    generated = _state_of([_hook_monitor(args={"weight": weight}, threshold=7.0,
                                         positions="generated")])
    (where,) = every.sites
    for state in (every, generated):
        _run_hooks(state, where, hidden, None, 0, 4, 0, 4)  # the prompt: position 1 is 20
    assert bool(every.fired) and (generated.fired is None or not bool(generated.fired))
    every.fired = None  # only this step's rows count: old position 1 is not read again
    for pos in (4, 5):
        for state in (every, generated):
            _run_hooks(state, where, hidden, None, pos, pos + 1, pos, 4)
    assert not bool(every.fired) and not bool(generated.fired)
    for state in (every, generated):
        _run_hooks(state, where, hidden, None, 6, 7, 6, 4)  # 10 > 7
    assert bool(every.fired) and bool(generated.fired)


def test_a_monitors_hook_only_reads_and_a_failure_closes_on_rank_0_only():
    from types import SimpleNamespace

    from vllm_lens.worker.hooks import HookCall, HookState, _Run, run_hook_calls
    from vllm_lens.worker.monitors import StopControl

    state = HookState(runs=[_Run(fn=lambda ctx, h: h * 2, layers=frozenset({1}),
                                 point="resid_post")], trusted=False, read_only=True)
    hidden = torch.ones(3, 8)
    run_hook_calls([HookCall("r", 0, 3, 0, (state,), 3)], 1, "post", hidden, None, None, 0,
                   None, split=False)
    assert "only reads" in state.error["message"] and bool((hidden == 1).all())
    guarded = _state_of([_hook_monitor()])
    view = SimpleNamespace(live=lambda: {"a"}, logits_row={"a": 0}.get)
    for on_failure, forced in ((True, True), (False, False)):
        control = StopControl(on_failure=on_failure)
        control.close("a", guarded)
        guarded.failed = True
        logits = torch.zeros(1, 10)
        control.force(logits, [("a", guarded)], {"a": SimpleNamespace(error="x")}, view)
        assert (logits[0].argmax() == 7) == forced and ("a" in control.closing) == forced


def test_a_hook_monitor_reduces_a_positions_entries_and_fails_with_its_hook():
    g = torch.Generator().manual_seed(4)
    specs = parse_monitors([_hook_monitor(action="flag")], FACTS)
    for reduce, fn in (("max", lambda t: t.amax(1)), ("min", lambda t: t.amin(1)),
                       ("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1))):
        spec = dataclasses.replace(specs[0], score_key="mass", reduce=reduce)
        state = MonitorState.build((spec,), torch.device("cpu"), eos=7, split=False)
        mass = torch.randn(3, 4, generator=g)
        state.hooks.runs[0].saved.update({"mass": {"1": mass},
                                          "positions": {"1": torch.tensor([2, 5, 9])}})
        positions, scores = state.kept(0)
        assert positions.tolist() == [2, 5, 9] and torch.allclose(scores, fn(mass))
    state = _state_of([_hook_monitor()])
    state.hooks.fail(ValueError("probe has 7 weights"))
    with pytest.raises(RuntimeError, match="probe has 7 weights"):
        state.score(next(iter(state.sites)), torch.ones(2, 8), None, 0, 2, 0, 2, True)
    assert state.failed


def _state_of(monitors):
    specs = parse_monitors(monitors, FACTS)
    return MonitorState.build(specs, torch.device("cpu"), eos=7, split=False)


def test_a_hook_monitors_rows_count_against_the_hooks_row_bound(monkeypatch):
    from vllm_lens.frontend.admission import check_admission

    monkeypatch.setenv("VLLM_LENS_ATTENTION_HOOK_MAX_ROWS", "100")
    _, lens = parse_extra_args({"monitors": [_hook_monitor(
        hook="attention_to_span", args={"span": [0, 3]}, point="attn_qk", reduce="max")]},
        lambda: QK_FACTS)
    check_admission(lens, QK_FACTS, prompt_len=20, max_tokens=30, n=1)
    with pytest.raises(LensRequestError) as raised:
        check_admission(lens, QK_FACTS, prompt_len=60, max_tokens=50, n=1)
    assert raised.value.field == "monitors[0].hook"
    assert "VLLM_LENS_ATTENTION_HOOK_MAX_ROWS" in str(raised.value)
