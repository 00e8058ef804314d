"""Hook requests: what is accepted, what is refused, and how hooks travel (no engine)."""

import json

import pytest

from vllm_lens import Hook, LensRequestError, NamedHook, RemoteCodeRefusedError
from vllm_lens.client import encode_xargs
from vllm_lens.hooks import hook_to_json
from vllm_lens.named_hooks import linear_probe, logit_lens_topk
from vllm_lens.spec import LensRequest, ModelFacts, parse_extra_args
from vllm_lens.common.hook_results import decode as decode_results
from vllm_lens.worker.hooks import HookState, encode_results

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8, max_model_len=64,
                   mapped=True)


def _noop(ctx, hidden):
    return None


def parse(hooks):
    return parse_extra_args({"apply_hooks": hooks}, lambda: FACTS)[1]


def test_live_and_named_hooks_round_trip_through_the_payload():
    lens = parse([Hook(_noop, [2, 1], pre=True),
                  NamedHook("linear_probe", [3], {"weight": [1.0] * 8})])
    again = LensRequest.from_payload(lens.to_payload())
    assert again.hooks == lens.hooks
    assert again.hooks[0].layers == (1, 2) and again.hooks[0].pre
    assert again.hooks[1].name == "linear_probe" and json.loads(again.hooks[1].args)["weight"]
    assert lens.cache_salt == f"vllm-lens:hooks:{lens.key}"  # hooked requests share no blocks


def test_json_forms_are_accepted_but_pickles_need_the_operator(monkeypatch):
    named = json.dumps([hook_to_json(NamedHook("logit_lens_topk", [0], {"k": 2}))])
    assert parse(named).hooks[0].name == "logit_lens_topk"
    pickled = json.dumps([hook_to_json(Hook(_noop, [1]))])
    monkeypatch.delenv("VLLM_LENS_ALLOW_PICKLED_HOOKS", raising=False)
    with pytest.raises(RemoteCodeRefusedError, match="VLLM_LENS_ALLOW_PICKLED_HOOKS"):
        parse(pickled)
    monkeypatch.setenv("VLLM_LENS_ALLOW_PICKLED_HOOKS", "1")
    assert parse(pickled).hooks[0].pickled is not None


@pytest.mark.parametrize("hooks,field", [
    ([], "apply_hooks"),
    ([Hook(_noop, [4])], "apply_hooks[0].layer_indices[0]"),
    ([Hook(_noop, [])], "apply_hooks[0].layer_indices"),
    ([Hook("not callable", [1])], "apply_hooks[0].fn"),
    ([NamedHook("nope", [1])], "apply_hooks[0].name"),
    ([NamedHook("linear_probe", [1], {"weight": "x"})], "apply_hooks[0].args"),
    # What depends on the model is checked before the request is scheduled (was: the worker's
    # error after the fact, HTTP 500 for the attention hook without its hook point).
    ([NamedHook("linear_probe", [1], {"weight": [1.0] * 7})], "apply_hooks[0].args.weight"),
    ([NamedHook("attention_to_span", [1], {"span": [0, 2]})], "apply_hooks[0].hook_point"),
    ([{"name": "linear_probe"}], "apply_hooks[0]"),
    ([42], "apply_hooks[0]"),
])
def test_bad_hooks_name_their_field(hooks, field):
    with pytest.raises(LensRequestError) as info:
        parse(hooks)
    assert info.value.field == field


def test_model_dependent_hook_arguments_say_what_fits():
    with pytest.raises(LensRequestError, match=r"has 7 numbers; the rows at resid_post have 8"):
        parse([NamedHook("linear_probe", [1], {"weight": [1.0] * 7})])
    with pytest.raises(LensRequestError, match="at the point 'attn_qk', not resid_post"):
        parse([NamedHook("attention_to_span", [1], {"span": [0, 2]})])
    assert parse([NamedHook("linear_probe", [1], {"weight": [1.0] * 8})]).hooks[0].name


def test_named_hook_factories_validate_their_arguments():
    with pytest.raises(ValueError, match="k must be"):
        logit_lens_topk({"k": 1000})
    with pytest.raises(ValueError, match="unknown argument"):
        linear_probe({"weight": [1.0], "colour": 1})


def test_results_travel_as_msgpack_and_pickle_only_for_trusted_hooks():
    blob = encode_results(HookState(runs=[], trusted=True))
    assert blob[:1] == b"W" and decode_results(blob, allow_pickle=False)["results"] == {}

    from vllm_lens.worker.hooks import _Run

    odd = HookState(runs=[_Run(fn=_noop, layers=frozenset({0}), point="resid_post", saved={"x": {1, 2}})],
                    trusted=True)
    blob = encode_results(odd)
    assert blob[:1] == b"P"
    with pytest.raises(ValueError, match="refusing pickled"):
        decode_results(blob, allow_pickle=False)
    assert decode_results(blob, allow_pickle=True)["results"] == {"0": {"x": {1, 2}}}
    odd.trusted = False  # only named hooks: an error, never a pickle
    assert decode_results(encode_results(odd), allow_pickle=False)["error"]["message"]


def test_encode_xargs_makes_vllm_xargs_values():
    xargs = encode_xargs({"output_residual_stream": True, "apply_hooks": [NamedHook("x", [1])],
                          "activations_transport": "binary"})
    assert xargs["output_residual_stream"] == "true"
    assert json.loads(xargs["apply_hooks"]) == [{"name": "x", "layer_indices": [1], "args": {},
                                                 "pre": False}]
    assert encode_xargs({"output_residual_stream": [1, 2]})["output_residual_stream"] == [1, 2]
    spec = encode_xargs({"output_residual_stream": {"layers": [1], "reduce": "mean"}})
    assert json.loads(spec["output_residual_stream"]) == {"layers": [1], "reduce": "mean"}


def test_pre_hooks_are_refused_where_layer_inputs_cannot_be_tapped():
    import dataclasses

    facts = dataclasses.replace(FACTS, pre_hooks=False)
    with pytest.raises(LensRequestError, match=r"apply_hooks\[0\]\.pre.*no tappable input"):
        parse_extra_args({"apply_hooks": [Hook(_noop, [1], pre=True)]}, lambda: facts)
    assert parse_extra_args({"apply_hooks": [Hook(_noop, [1])]}, lambda: facts)[1] is not None


def test_taps_report_whether_layer_inputs_are_tapped():
    from torch import nn

    from vllm_lens.worker.taps import install_taps

    class FusedLayer(nn.Module):
        def forward(self, positions, hidden_states, residual):
            return hidden_states, residual

    class PlainLayer(nn.Module):
        def forward(self, x):
            return x

    def model_of(layer_cls):
        model = nn.Module()
        model.model = nn.Module()
        model.model.layers = nn.ModuleList([layer_cls(), layer_cls()])
        return model

    # (unmapped toys: only what was found is recorded; tests/unit/test_taps.py taps them)
    assert install_taps(model_of(FusedLayer)).pre_taps
    assert install_taps(model_of(PlainLayer)).pre_taps is False


def test_named_hooks_accumulate_rows_without_recopying_them():
    import torch

    from vllm_lens.common import wire
    from vllm_lens.named_hooks import _append

    saved, steps = {}, [torch.arange(6).reshape(3, 2)] + [torch.full((1, 2), i) for i in range(40)]
    start = 0
    for rows in steps:
        _append(saved, "ids", 7, rows, start)
        start += rows.shape[0]
    kept = saved["ids"]["7"]
    assert torch.equal(kept, torch.cat(steps))
    assert kept.untyped_storage().nbytes() <= 2 * kept.numel() * kept.element_size()
    assert torch.equal(wire.loads(wire.dumps(saved))["ids"]["7"], torch.cat(steps))


def test_named_hooks_keep_one_row_per_position_when_positions_are_recomputed():
    import torch

    from vllm_lens.named_hooks import _append

    saved = {}
    _append(saved, "x", 0, torch.tensor([0.0, 1.0, 2.0]), 0)
    _append(saved, "x", 0, torch.tensor([3.0]), 3)
    # preempted, then resumed: positions 0..4 computed again
    _append(saved, "x", 0, torch.tensor([10.0, 11.0]), 0)
    _append(saved, "x", 0, torch.tensor([12.0, 13.0, 14.0]), 2)
    assert saved["x"]["0"].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]


def test_logit_lens_in_chunks_equals_one_pass_and_declares_a_row_bound(monkeypatch):
    """The shipped hook, run on a real (random) unembedding: chunked logits give the same top-k
    as one matrix product, and it declares the bound the front end checks."""
    import types

    import torch

    from vllm_lens import named_hooks

    torch.manual_seed(0)
    params = {"lm_head.weight": torch.randn(50, 8), "model.norm.weight": torch.rand(8) + 0.5}
    hidden = torch.randn(23, 8)

    def run() -> dict:
        ctx = types.SimpleNamespace(
            get_parameter=params.__getitem__, model=types.SimpleNamespace(config=None),
            positions=torch.arange(23), layer_idx=2, saved={})
        logit_lens_topk({"k": 3})(ctx, hidden)
        return ctx.saved

    whole = run()
    # 4 rows per chunk, and vocabulary slices of 25 rows of the unembedding
    monkeypatch.setattr(named_hooks, "_LOGIT_CHUNK_ELEMENTS", 50 * 4)
    chunked = run()
    assert torch.equal(whole["token_ids"]["2"], chunked["token_ids"]["2"])
    torch.testing.assert_close(whole["logprobs"]["2"], chunked["logprobs"]["2"])
    x = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = torch.log_softmax((x * params["model.norm.weight"]) @ params["lm_head.weight"].T,
                                 -1).topk(3, -1)
    assert torch.equal(chunked["token_ids"]["2"], expected.indices)
    assert logit_lens_topk.max_rows == ("VLLM_LENS_LOGIT_LENS_MAX_ROWS", 65536)
    # A bfloat16 unembedding: logits are still float32 (no rounding of logits to bfloat16).
    params["lm_head.weight"] = params["lm_head.weight"].bfloat16()
    half = run()
    reference = torch.log_softmax(
        (x * params["model.norm.weight"]) @ params["lm_head.weight"].float().T, -1).topk(3, -1)
    assert torch.equal(half["token_ids"]["2"], reference.indices)
    torch.testing.assert_close(half["logprobs"]["2"], reference.values, rtol=1e-5, atol=1e-5)


def test_admission_bounds_named_hook_rows(monkeypatch):
    from vllm_lens.frontend.admission import check_admission

    monkeypatch.setenv("VLLM_LENS_LOGIT_LENS_MAX_ROWS", "100")
    lens = parse([NamedHook("linear_probe", [0, 1, 2, 3], {"weight": [0.0] * 8}),
                  NamedHook("logit_lens_topk", [0, 1, 2], {"k": 1})])
    check_admission(lens, FACTS, prompt_len=10, max_tokens=20, n=1)  # 3 x 30 = 90 rows
    with pytest.raises(LensRequestError, match=r"'apply_hooks\[1\]'.*360 rows \(3 layers x 30 "
                                               r"positions x n=4\).*VLLM_LENS_LOGIT_LENS_MAX_ROWS"):
        check_admission(lens, FACTS, prompt_len=10, max_tokens=20, n=4)
    # The prompt's length unknown: bounded by the context (64 positions here).
    with pytest.raises(LensRequestError, match=r"3 layers x 64 positions"):
        check_admission(lens, FACTS, prompt_len=None, max_tokens=20, n=1)


def test_a_request_carries_a_bounded_number_of_hooks(monkeypatch):
    monkeypatch.setenv("VLLM_LENS_MAX_HOOKS", "3")
    assert len(parse([NamedHook("logit_lens_topk", [0], {"k": 1})] * 3).hooks) == 3
    with pytest.raises(LensRequestError, match=r"'apply_hooks'.* 4 hooks.*VLLM_LENS_MAX_HOOKS "
                                               r"\(3\)"):
        parse([NamedHook("logit_lens_topk", [0], {"k": 1})] * 4)
    monkeypatch.delenv("VLLM_LENS_MAX_HOOKS")
    with pytest.raises(LensRequestError, match=r"2,000 hooks.*VLLM_LENS_MAX_HOOKS \(32\)"):
        parse(json.dumps([hook_to_json(NamedHook("logit_lens_topk", [0, 1, 2, 3],
                                                 {"k": 1}))] * 2000))


def test_admission_sums_a_named_hooks_rows_over_its_copies(monkeypatch):
    """Copies of one row-bounded hook cost what one hook on all their layers would: two
    copies on 3 layers each are refused where one passes."""
    from vllm_lens.frontend.admission import check_admission

    monkeypatch.setenv("VLLM_LENS_LOGIT_LENS_MAX_ROWS", "100")
    one = NamedHook("logit_lens_topk", [0, 1, 2], {"k": 1})
    check_admission(parse([one]), FACTS, prompt_len=10, max_tokens=20, n=1)  # 90 rows
    with pytest.raises(LensRequestError, match=r"'apply_hooks\[1\]'.*180 rows \(6 layers x 30 "
                                               r"positions, 2 hooks named so together\)"):
        check_admission(parse([one, one]), FACTS, prompt_len=10, max_tokens=20, n=1)
    # Other factories' hooks do not count towards it.
    other = NamedHook("linear_probe", [0, 1, 2, 3], {"weight": [0.0] * 8})
    check_admission(parse([other, one, other]), FACTS, prompt_len=10, max_tokens=20, n=1)
