"""The layout check's invariants (no engine): tensors a correct fused-residual layer records
pass every invariant; a tap at the wrong module breaks exactly the invariants that relate it,
and the points they prove are refused by name, the rest kept."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from vllm_lens.worker.layout_check import INVARIANTS, evaluate

SITES = ("pre", "attn_in", "q_norm", "k_norm", "attn", "attn_post_norm", "mid", "mlp_in", "act",
         "mlp_post_norm", "post", "final")
LAYERS = (0, 1, 2)


def _info(sites=SITES, block="sequential", split=False):
    return SimpleNamespace(sites=sites, block=block, split=split, local_layers=LAYERS)


def _fused_rows(n_tokens=5, hidden=8, seed=0):
    """What the taps of a Llama-style stack record: (layer, site) -> (a, b), with
    ``pre = (stream, None)``-style pairs split the way vLLM passes them."""
    g = torch.Generator().manual_seed(seed)
    rows = {}
    stream = torch.randn(n_tokens, hidden, generator=g)
    hidden_prev, residual_prev = stream, None
    for layer in LAYERS:
        rows[(layer, "pre")] = (hidden_prev, residual_prev)
        resid_pre = hidden_prev if residual_prev is None else hidden_prev + residual_prev
        rows[(layer, "attn_in")] = (torch.randn(n_tokens, hidden, generator=g), None)
        rows[(layer, "mlp_in")] = (torch.randn(n_tokens, hidden, generator=g), None)
        for site in ("attn_post_norm", "mlp_post_norm"):
            rows[(layer, site)] = (torch.randn(n_tokens, hidden, generator=g), None)
        for site in ("q_norm", "k_norm"):  # (normed, before the norm), two heads of 4
            rows[(layer, site)] = (torch.randn(n_tokens, 2, 4, generator=g),
                                   torch.randn(n_tokens, 2, 4, generator=g))
        attn_out = torch.randn(n_tokens, hidden, generator=g)
        rows[(layer, "mid")] = (attn_out, resid_pre)
        resid_mid = attn_out + resid_pre
        mlp_out = torch.randn(n_tokens, hidden, generator=g)
        rows[(layer, "post")] = (mlp_out, resid_mid)
        hidden_prev, residual_prev = mlp_out, resid_mid
    last = hidden_prev + residual_prev
    rows[(LAYERS[-1], "final")] = (2.0 * last, None)  # the final norm (_Scale) of it
    return rows, last


def _reads(rows):
    """What a correct layout's blocks read and return: the tapped ``attn_in`` and
    ``mlp_in``, and the inputs of the norms after them."""
    sites = {"attn_in": "attn_in", "mlp_in": "mlp_in", "attn_out_pre_norm": "attn_post_norm",
             "mlp_out_pre_norm": "mlp_post_norm"}
    return {point: [(rows[(layer, site)][0], rows[(layer, site)][0].clone())
                    for layer in LAYERS] for point, site in sites.items()}


class _Rope:
    """What the check reads of a layer's rotary embedding."""
    rotary_dim, is_neox_style = 4, True


def _qk(rows, turn=None, rope=_Rope()):
    """What the check compares per site: what RoPE keeps of the tapped normed Q/K, and of the
    kernel's Q/K (the normed ones turned by ``turn``)."""
    from vllm_lens.worker.layout_check import _rope_keeps

    found = {"q_norm": [], "k_norm": []}
    for layer in LAYERS:
        for site in ("q_norm", "k_norm"):
            normed = rows[(layer, site)][0]
            received = normed if turn is None else turn(normed)
            found[site].append((_rope_keeps(normed, rope), _rope_keeps(received, rope)))
    return found


def _rotate(x, neox=True):
    """RoPE's turn of each pair of a head (half with half, or neighbours), by a fixed angle
    per pair."""
    half = x.shape[-1] // 2
    angle = torch.arange(half, dtype=x.dtype) + 0.3
    if neox:
        a, b = x[..., :half], x[..., half:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    a, b = a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()
    return torch.cat([a, b], -1) if neox else torch.stack([a, b], -1).flatten(-2)


class _Scale(nn.Module):
    def forward(self, x):
        return 2.0 * x


def test_a_correct_layer_passes_every_invariant():
    rows, last = _fused_rows()
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=_reads(rows), qk=_qk(rows, _rotate))
    assert sorted(result.passed) == sorted(INVARIANTS)
    assert result.refused == {}


def test_a_q_or_k_that_is_not_the_normed_one_turned_refuses_its_norm_points():
    """Something between the norm and the kernel that changes a head (a scale, heads in
    another order, pairs turned that RoPE does not pair) breaks the invariant: that norm's two
    points are refused, the rest kept. Without the kernel's K recorded, K's are unproven."""
    rows, last = _fused_rows()

    def check(qk):
        return evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                        reads=_reads(rows), qk=qk)

    assert check(_qk(rows, _rotate)).refused == {}
    scaled = _qk(rows, lambda x: 1.5 * _rotate(x))
    assert set(check(scaled).refused) == {"q_pre_norm", "q_normed", "k_pre_norm", "k_normed"}
    assert "normed Q, rotated' failed" in check(scaled).refused["q_normed"]
    swapped = _qk(rows, lambda x: _rotate(x.flip(-2)))  # the heads in another order
    assert "q_normed" in check(swapped).refused
    # Neighbours turned where the rotary embedding pairs half with half: not what it keeps.
    assert "q_normed" in check(_qk(rows, lambda x: _rotate(x, neox=False))).refused
    gptj = _Rope()
    gptj.is_neox_style = False
    assert check(_qk(rows, lambda x: _rotate(x, neox=False), gptj)).refused == {}
    without_k = _qk(rows, _rotate)
    without_k["k_norm"] = [(None, None)]
    refused = check(without_k).refused
    assert set(refused) == {"k_pre_norm", "k_normed"}
    assert "was not recorded" in refused["k_normed"]


def test_a_block_that_reads_another_tensor_refuses_its_input_point_alone():
    """A derived ``attn_in`` tapped at a norm whose output attention does not read (here: the
    block reads the stream before the norm) is refused by name; ``mlp_in`` and the rest
    stand. Without recorded inputs (a written row) the points are unproven, with why."""
    rows, last = _fused_rows()
    reads = _reads(rows)
    reads["attn_in"][1] = (reads["attn_in"][1][0], rows[(1, "pre")][0])
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=reads, qk=_qk(rows))
    assert result.refused == {"attn_in": "the invariant 'attention reads attn_in' failed"}
    assert "the MLP reads mlp_in" in result.passed
    # One tensor seen twice in one pass must be equal: 1% off is not the same rows.
    scaled = _reads(rows)
    scaled["mlp_in"][0] = (scaled["mlp_in"][0][0], 1.01 * scaled["mlp_in"][0][0])
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=scaled, qk=_qk(rows))
    assert result.refused == {"mlp_in": "the invariant 'the MLP reads mlp_in' failed"}
    # Rows that are all zero prove nothing (an attention kernel that wrote nothing).
    zero = _reads(rows)
    zero["attn_out_pre_norm"] = [(torch.zeros(5, 8), torch.zeros(5, 8)) for _ in LAYERS]
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=zero, qk=_qk(rows))
    assert "were all zero" in result.refused["attn_out_pre_norm"]
    reads["mlp_in"][2] = (reads["mlp_in"][2][0], None)  # that layer's MLP was not called
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=reads, qk=_qk(rows))
    assert "was not called in the check's pass" in result.refused["mlp_in"]
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads="the pass recording the blocks' inputs failed (boom)", qk=_qk(rows))
    assert set(result.refused) == {"attn_in", "mlp_in", "attn_out_pre_norm", "mlp_out_pre_norm"}
    assert "(boom)" in result.refused["mlp_in"]
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True)
    assert result.refused["attn_in"].startswith("unproven: the invariant 'attention reads")


def test_a_final_norm_tap_off_the_lm_heads_input_refuses_final_norm_alone():
    rows, last = _fused_rows()
    rows[(LAYERS[-1], "final")] = (last, None)  # the norm's input, not its output
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=_reads(rows), qk=_qk(rows))
    assert result.refused == {"final_norm": "the invariant 'the LM head reads final_norm' failed"}
    del rows[(LAYERS[-1], "final")]  # the tap did not run: unproven, named
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=_reads(rows), qk=_qk(rows))
    assert set(result.refused) == {"final_norm"}
    assert "the final norm's tap did not run" in result.refused["final_norm"]
    result = evaluate(rows, _info(), hidden=None, final_norm=_Scale(), last_stage=False,
                      reads=_reads(rows), qk=_qk(rows))
    assert "does not end the model" in result.refused["final_norm"]


def test_a_final_norm_run_twice_in_a_pass_refuses_final_norm():
    """A later call would overwrite the rows of the first: the final norm's point (and a Q or
    K norm's, a module called on Q and then on K) is refused."""
    from vllm_lens.worker.layout_check import LayoutCheck, _Recorder, _refuse_repeated

    recorder, result = _Recorder(), LayoutCheck(ran=True)
    x = torch.ones(3, 4)
    recorder(x, None, 2, "final")
    recorder(x, None, 2, "post")
    recorder(x, x, 2, "q_norm")
    _refuse_repeated(result, recorder)
    assert result.refused == {}
    recorder(x[:1], None, 2, "final")  # a second call in the same step (fewer rows)
    _refuse_repeated(result, recorder)
    assert "ran 2 times" in result.refused["final_norm"]
    assert recorder.rows[(2, "final")][0].shape == (3, 4)  # the first call's rows are kept
    recorder(x, x, 2, "q_norm")
    _refuse_repeated(result, recorder)
    assert {"q_pre_norm", "q_normed"} <= set(result.refused)
    assert "k_normed" not in result.refused


def test_a_wrong_mid_module_refuses_the_points_it_reads_and_keeps_the_stream():
    rows, last = _fused_rows()
    attn_out, resid_pre = rows[(1, "mid")]
    rows[(1, "mid")] = (attn_out, 0.5 * resid_pre)  # the norm before attention, not the MLP's
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      reads=_reads(rows), qk=_qk(rows))
    assert "continuity" in result.passed and "final norm" in result.passed
    assert set(result.refused) == {"attn_out", "resid_mid", "mlp_out"}
    assert "'attention adds attn_out' failed" in result.refused["attn_out"]
    assert "'the MLP adds mlp_out' failed" in result.refused["mlp_out"]


def test_a_broken_stream_refuses_every_point():
    rows, last = _fused_rows()
    a, b = rows[(2, "pre")]
    rows[(2, "pre")] = (a + 1.0, b)  # not the stream layer 1 left
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True)
    assert "continuity" not in result.passed
    assert {"resid_pre", "resid_post", "attn_out", "resid_mid", "mlp_out", "attn_z",
            "attn_q", "attn_k", "mlp_post"} <= set(result.refused)
    assert all("'continuity' failed" in why for why in result.refused.values())


def test_a_stream_that_is_not_what_the_lm_head_reads_is_refused():
    rows, last = _fused_rows()
    result = evaluate(rows, _info(), hidden=2.0 * last + 0.5, final_norm=_Scale(),
                      last_stage=True)
    assert "final norm" not in result.passed
    assert "'final norm' failed" in result.refused["resid_post"]


def test_what_cannot_be_checked_is_refused_as_unproven():
    rows, last = _fused_rows()
    rows = {key: value for key, value in rows.items() if key[1] != "pre"}
    result = evaluate(rows, _info(sites=("attn", "mid", "act", "post")), hidden=2.0 * last,
                      final_norm=_Scale(), last_stage=False)
    assert result.refused["resid_post"].startswith("unproven: the invariant 'continuity'")
    assert set(result.refused) >= {"resid_post", "attn_out", "mlp_out"}


def test_an_invariant_that_was_never_judged_leaves_its_points_refused():
    """No ``mid`` site: the sums are not judged, so ``mlp_out`` (read at ``post``) is not
    served on the stream's invariants alone."""
    rows, last = _fused_rows()
    rows = {key: value for key, value in rows.items() if key[1] != "mid"}
    result = evaluate(rows, _info(sites=("pre", "attn", "act", "post")), hidden=2.0 * last,
                      final_norm=_Scale(), last_stage=True)
    assert "continuity" in result.passed and "resid_post" not in result.refused
    assert result.refused["mlp_out"].startswith("unproven: the invariant 'the MLP adds mlp_out'")


def test_a_sublayer_too_small_to_tell_from_rounding_proves_nothing():
    rows, last = _fused_rows()
    for layer in LAYERS:  # attention adds (next to) nothing beside the stream
        attn_out, resid_pre = rows[(layer, "mid")]
        rows[(layer, "mid")] = (attn_out * 1e-9, resid_pre)
    result = evaluate(rows, _info(), hidden=2.0 * last, final_norm=_Scale(), last_stage=True,
                      dtype=torch.bfloat16)
    assert result.refused["attn_out"].startswith(
        "unproven: the invariant 'attention adds attn_out' could not run")


def test_a_non_finite_value_an_invariant_reads_is_found_and_others_are_not():
    from vllm_lens.worker.layout_check import _non_finite

    rows, last = _fused_rows()
    assert _non_finite(rows, last) is None
    rows[(1, "act")] = (torch.tensor([[float("nan")]]), None)  # no invariant reads mlp_post
    assert _non_finite(rows, last) is None
    a, b = rows[(2, "mid")]
    rows[(2, "mid")] = (a, b.clone().fill_(float("inf")))
    assert _non_finite(rows, last) == "layer 2, site mid"
    rows[(2, "mid")] = (a, b)
    assert _non_finite(rows, last * float("nan")) == "the model's output"


def test_a_stream_only_layout_refuses_every_inner_point_with_its_reason():
    from vllm_lens.worker.layout_check import LayoutCheck, _refuse_inner

    result = LayoutCheck(ran=True, refused={"mlp_out": "unproven: something else"})
    _refuse_inner(result, SimpleNamespace(stream_only="hybrid layers"))
    assert "resid_pre" not in result.refused and "resid_post" not in result.refused
    assert result.refused["mlp_out"] == "hybrid layers"
    assert {"attn_in", "attn_out", "resid_mid", "attn_z", "attn_q"} <= set(result.refused)
    untouched = LayoutCheck(ran=True)
    _refuse_inner(untouched, SimpleNamespace(stream_only=None))
    assert untouched.refused == {}


def test_a_pipeline_stage_before_the_last_hands_no_hidden_state_to_judge():
    """Its pass returns vLLM's ``IntermediateTensors``, not a hidden state: the invariants of
    its own layers still run, and ``final norm`` is left to the last stage."""
    from vllm.sequence import IntermediateTensors

    from vllm_lens.worker.layout_check import _forward

    class Runner:
        def _dummy_run(self, *args, **kwargs):
            return IntermediateTensors({"hidden_states": torch.zeros(2, 4)}), None

    assert _forward(Runner()) is None
    rows, _ = _fused_rows()
    result = evaluate(rows, _info(), hidden=None, final_norm=_Scale(), last_stage=False,
                      reads=_reads(rows), qk=_qk(rows))
    assert {"continuity", "attention adds attn_out", "the MLP adds mlp_out"} <= set(result.passed)
    assert "does not end the model" in result.refused["resid_post"]
