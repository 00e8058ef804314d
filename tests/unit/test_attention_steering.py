"""``steer_attention``: parsing (every refusal names its field) and the worker's recomputation
of the steered heads (``worker.attention_steering``) against the definition written out."""

import dataclasses
import math

import pytest
import torch

from vllm_lens.errors import LensRequestError, UnsupportedConfigError, UnsupportedModelError
from vllm_lens.spec import LensRequest
from vllm_lens.spec.attention_steering import AttentionEdit, parse_attention_steering
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.worker.attention_steering import (
    HistoryBudget,
    KeyValueHistory,
    LayerEdits,
    RequestAttentionSteer,
    steer_rows,
)

META = {"scale": 0.25, "logits_soft_cap": 0.0, "sliding_window": [-1, -1],
        "alibi_slopes": None, "sinks": None, "num_heads": 4, "num_kv_heads": 2,
        "head_size": 16, "layer_name": ""}
FACTS = ModelFacts(model_class="Toy", n_layers=3, hidden_size=64, max_model_len=128,
                   mapped=True, sites=("pre", "post", "attn"), n_heads=4, n_kv_heads=2,
                   head_dim=16, qk_meta=(META,) * 3)


def test_both_forms_parse_from_python_and_json():
    edits = parse_attention_steering(
        '[{"layers": "all", "heads": null, "emphasize": [2, 9], "alpha": 0.01},'
        ' {"layers": [-1, 0, 0], "heads": [3, 1], "key_positions": [5, 1], "bias": "-inf"}]',
        FACTS)
    assert edits[0] == AttentionEdit(layers=(0, 1, 2), heads=None, span=(2, 9), alpha=0.01)
    assert edits[1] == AttentionEdit(layers=(0, 2), heads=(1, 3), key_positions=(1, 5),
                                     bias=-math.inf)
    one = parse_attention_steering({"layers": [1], "heads": None, "key_positions": [0],
                                    "bias": 2}, FACTS)
    assert one[0].bias == 2.0 and one[0].layers == (1,)
    for edit in edits:
        assert AttentionEdit.from_payload(edit.to_payload()) == edit


@pytest.mark.parametrize("item, field", [
    ("not a list", "steer_attention"),
    ([], "steer_attention"),
    ([1], "steer_attention[0]"),
    ([{"layers": [0], "heads": None}], "steer_attention[0]"),
    ([{"layers": [0], "heads": None, "emphasize": [0, 2], "alpha": 1,
       "key_positions": [0], "bias": 1}], "steer_attention[0]"),
    ([{"layers": [0], "heads": None, "emphasize": [0, 2], "alpha": 1, "bias": 1}],
     "steer_attention[0].bias"),
    ([{"layers": [], "heads": None, "emphasize": [0, 2], "alpha": 1}],
     "steer_attention[0].layers"),
    ([{"layers": [3], "heads": None, "emphasize": [0, 2], "alpha": 1}],
     "steer_attention[0].layers[0]"),
    ([{"layers": [True], "heads": None, "emphasize": [0, 2], "alpha": 1}],
     "steer_attention[0].layers[0]"),
    ([{"layers": [0], "heads": [4], "emphasize": [0, 2], "alpha": 1}],
     "steer_attention[0].heads[0]"),
    ([{"layers": [0], "heads": [], "emphasize": [0, 2], "alpha": 1}],
     "steer_attention[0].heads"),
    ([{"layers": [0], "heads": None, "emphasize": [2, 1], "alpha": 1}],
     "steer_attention[0].emphasize"),
    ([{"layers": [0], "heads": None, "emphasize": [0, 129], "alpha": 1}],
     "steer_attention[0].emphasize"),
    ([{"layers": [0], "heads": None, "emphasize": [0.5, 2], "alpha": 1}],
     "steer_attention[0].emphasize"),
    ([{"layers": [0], "heads": None, "emphasize": [0, 2], "alpha": float("nan")}],
     "steer_attention[0].alpha"),
    ([{"layers": [0], "heads": None, "emphasize": [0, 2], "alpha": -0.1}],
     "steer_attention[0].alpha"),
    ([{"layers": [0], "heads": None, "emphasize": [0, 2], "alpha": 1e39}],
     "steer_attention[0].alpha"),
    ([{"layers": [0], "heads": None, "key_positions": [1], "bias": 3e38}],
     "steer_attention[0].bias"),
    ([{"layers": [0], "heads": None, "key_positions": [], "bias": 1}],
     "steer_attention[0].key_positions"),
    ([{"layers": [0], "heads": None, "key_positions": [128], "bias": 1}],
     "steer_attention[0].key_positions[0]"),
    ([{"layers": [0], "heads": None, "key_positions": [1], "bias": float("inf")}],
     "steer_attention[0].bias"),
    ([{"layers": [0], "heads": None, "key_positions": [1], "bias": "inf"}],
     "steer_attention[0].bias"),
    ([{"layers": [0], "heads": None, "key_positions": [1]}], "steer_attention[0].bias"),
    ([{"layers": [0], "heads": None, "emphasize": [0, 2], "alpha": 1}] * 33,
     "steer_attention"),
])
def test_bad_edits_name_the_field(item, field):
    with pytest.raises(LensRequestError) as err:
        parse_attention_steering(item, FACTS)
    assert err.value.field == field


def test_engines_and_layers_it_cannot_steer_are_refused():
    good = [{"layers": [1], "heads": None, "emphasize": [0, 2], "alpha": 0.5}]
    with pytest.raises(UnsupportedConfigError):
        parse_attention_steering(good, dataclasses.replace(FACTS, speculative=True))
    sinks = dataclasses.replace(FACTS, qk_meta=(META, {**META, "sinks": [0.0] * 4}, META))
    with pytest.raises(UnsupportedModelError, match="layer 1 has attention sinks"):
        parse_attention_steering(good, sinks)
    parse_attention_steering([{**good[0], "layers": [0, 2]}], sinks)  # the others are fine
    with pytest.raises(UnsupportedModelError):
        parse_attention_steering(good, dataclasses.replace(FACTS, sites=("pre", "post")))


def test_a_steered_request_never_shares_cached_blocks():
    edit = AttentionEdit(layers=(0,), heads=None, span=(0, 2), alpha=0.1)
    a = LensRequest(key="a", steer_attention=(edit,))
    b = LensRequest(key="b", steer_attention=(edit,))
    assert a.cache_salt and b.cache_salt and a.cache_salt != b.cache_salt
    assert LensRequest.from_payload(a.to_payload()) == a


# -- the worker's recomputation ---------------------------------------------------------------

def _weights(q, k, meta=META):
    """Softmax attention weights ``[heads, n, n]`` written out loop by loop (no code shared
    with ``vllm_lens.attention``): scale, soft cap, ALiBi, causal mask and window."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    left = meta["sliding_window"][0]
    cap = meta["logits_soft_cap"]
    w = torch.zeros(heads, n, n)
    for h in range(heads):
        for i in range(n):
            seen = [j for j in range(i + 1) if left < 0 or j >= i - left]
            scores = torch.stack([q[i, h] @ k[j, h // group] * meta["scale"] for j in seen])
            if cap:
                scores = cap * torch.tanh(scores / cap)
            if meta["alibi_slopes"] is not None:
                scores = scores + meta["alibi_slopes"][h] * torch.tensor(
                    [j - i for j in seen], dtype=torch.float32)
            w[h, i, seen] = torch.softmax(scores, 0)
    return w


def _attention(q, k, v, meta=META):
    """Plain softmax attention of rows ``q`` (positions ``0 ..``) over every key."""
    group = q.shape[1] // k.shape[1]
    return torch.einsum("hqk,khd->qhd", _weights(q, k, meta), v.repeat_interleave(group, dim=1))


def _toy(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, 16, generator=g), torch.randn(n, 2, 16, generator=g),
            torch.randn(n, 2, 16, generator=g))


def _run(edits, q, k, v, meta=META, chunks=(None,), tp_rank=0):
    layer_edits = LayerEdits.build(list(edits), meta, tp_rank * meta["num_heads"],
                                   torch.device("cpu"))
    history = KeyValueHistory(HistoryBudget(1 << 30), positions=q.shape[0])
    # The kernel's output, the steered heads' rows NaN: each must be written.
    out = _attention(q, k, v, meta)
    out[:, layer_edits.written] = float("nan")
    bounds = [0, *(c for c in chunks if c is not None), q.shape[0]]
    for lo, hi in zip(bounds, bounds[1:]):
        steer_rows(layer_edits, history, 0, lo, q[lo:hi], k[lo:hi], v[lo:hi], out[lo:hi])
    return out


@pytest.mark.parametrize("meta", [
    META,
    {**META, "sliding_window": [3, 0], "logits_soft_cap": 5.0},
    {**META, "alibi_slopes": [0.5, 0.25, 0.125, 0.0625]},
], ids=["plain", "window-softcap", "alibi"])
def test_edits_that_change_nothing_reproduce_the_kernel(meta):
    q, k, v = _toy()
    edits = [AttentionEdit(layers=(0,), heads=None, span=(2, 5), alpha=1.0),
             AttentionEdit(layers=(0,), heads=(1,), key_positions=(3,), bias=0.0)]
    out = _run(edits, q, k, v, meta, chunks=(5,))
    assert torch.allclose(out, _attention(q, k, v, meta), atol=1e-6)


def test_emphasis_renormalises_the_span_in_the_chosen_heads_only():
    q, k, v = _toy()
    start, end, alpha = 4, 7, 0.1
    out = _run([AttentionEdit(layers=(0,), heads=(2,), span=(start, end), alpha=alpha)],
               q, k, v, chunks=(3, 8))
    plain = _attention(q, k, v)
    assert torch.equal(out[:, [0, 1, 3]], plain[:, [0, 1, 3]])
    w = _weights(q, k)[2]  # head 2 reads key head 1
    keep = torch.full((12,), alpha)
    keep[start:end] = 1.0
    for p in range(12):
        if p < start:  # sees no key of the span: left as it is
            assert torch.allclose(out[p, 2], plain[p, 2], atol=1e-6)
            continue
        row = w[p] * keep
        assert torch.allclose(out[p, 2], (row / row.sum()) @ v[:, 1], atol=1e-5)


def test_a_bias_knocking_out_every_edge_leaves_nothing_attended():
    q, k, v = _toy()
    out = _run([AttentionEdit(layers=(0,), heads=(0,), key_positions=(0, 1),
                              bias=-math.inf)], q, k, v)
    assert torch.equal(out[0, 0], torch.zeros(16)) and torch.equal(out[1, 0], torch.zeros(16))
    scores = torch.einsum("d,kd->k", q[5, 0], k[:6, 0]) * META["scale"]
    scores[:2] = -math.inf
    assert torch.allclose(out[5, 0], torch.softmax(scores, 0) @ v[:6, 0], atol=1e-5)


def test_heads_are_global_under_tensor_parallelism():
    """Rank 1 of two holds global heads 4..7 as its local 0..3: a global head 5 is its 1."""
    q, k, v = _toy()
    edit = AttentionEdit(layers=(0,), heads=(5,), span=(0, 2), alpha=0.0)
    on_rank_1 = _run([edit], q, k, v, tp_rank=1)
    local = _run([dataclasses.replace(edit, heads=(1,))], q, k, v)
    assert torch.equal(on_rank_1, local)
    assert LayerEdits.build([edit], META, 0, torch.device("cpu")) is None  # not rank 0's


def test_a_gap_in_the_history_and_a_full_budget_fail_with_a_reason():
    q, k, v = _toy()
    edit = AttentionEdit(layers=(0,), heads=None, span=(0, 2), alpha=0.5)
    edits = LayerEdits.build([edit], META, 0, torch.device("cpu"))
    history = KeyValueHistory(HistoryBudget(1 << 30), positions=12)
    with pytest.raises(RuntimeError, match="has not seen the keys of positions 0..3"):
        steer_rows(edits, history, 0, 4, q[4:], k[4:], v[4:], q[4:].clone())
    short = KeyValueHistory(HistoryBudget(1 << 30), positions=8)
    with pytest.raises(RuntimeError, match="past the 8 positions"):
        steer_rows(edits, short, 0, 0, q, k, v, q.clone())
    budget = HistoryBudget(1 << 30)
    meta = {0: META, 1: META}  # two layers here, 12 positions, 2 key heads of 16, float32
    both = dataclasses.replace(edit, layers=(0, 1))
    steer = RequestAttentionSteer.build((both,), meta, 0, budget, 12, 4, torch.device("cpu"))
    assert budget.used == steer.history.reserved == 12 * 2 * (2 * 16) * 2 * 4
    with pytest.raises(MemoryError, match="VLLM_LENS_ATTENTION_STEER_MAX_BYTES"):
        RequestAttentionSteer.build((both,), meta, 0, HistoryBudget(1000), 12, 4,
                                    torch.device("cpu"))
    steer_rows(steer.by_layer[0], steer.history, 0, 0, q, k, v, q.clone())
    assert 0 < steer.nbytes <= steer.history.reserved
    steer.free()
    steer.free()  # twice: nothing given back twice
    assert budget.used == 0


def test_only_the_key_heads_read_are_kept():
    q, k, v = _toy()
    edits = LayerEdits.build([AttentionEdit(layers=(0,), heads=(3,), span=(0, 2), alpha=0.5)],
                             META, 0, torch.device("cpu"))
    assert edits.kv_heads.tolist() == [1] and edits.written.tolist() == [3]
    history = KeyValueHistory(HistoryBudget(1 << 30), positions=12)
    steer_rows(edits, history, 0, 0, q, k, v, torch.zeros(12, 4, 16))
    assert history.layers[0].keys.shape[1:] == (1, 16)


def test_emphases_multiply_and_a_row_left_with_no_weight_is_kept():
    """Two disjoint spans with ``alpha = 0`` leave every key without weight: each row stays
    as the kernel computed it, whichever order the edits come in."""
    q, k, v = _toy()
    a = AttentionEdit(layers=(0,), heads=(0,), span=(1, 3), alpha=0.0)
    b = AttentionEdit(layers=(0,), heads=(0,), span=(6, 8), alpha=0.0)
    one, other = _run([a, b], q, k, v), _run([b, a], q, k, v)
    assert torch.equal(one, other)
    assert torch.allclose(one[:, 0], _attention(q, k, v)[:, 0], atol=1e-5)


def test_fetching_a_request_gives_its_reservation_back():
    """A record fetched (``RequestTable.pop``) before the runner dropped it frees its
    history at once, not at a later step."""
    from vllm_lens.worker.request_records import RequestTable

    budget = HistoryBudget(1 << 30)
    edit = AttentionEdit(layers=(0,), heads=None, span=(0, 2), alpha=0.5)
    table = RequestTable(finished_ttl_s=60.0)
    lens = LensRequest(key="k", steer_attention=(edit,), attention_positions=12)
    record = table.lookup("r", lens.to_payload())
    record.attention = RequestAttentionSteer.build(lens.steer_attention, {0: META}, 0, budget,
                                                   12, 4, torch.device("cpu"))
    assert budget.used > 0
    table.pop("k")
    assert budget.used == 0


def test_three_key_heads_a_subset_of_heads_and_alibi():
    """Six heads on three key heads, steering heads 0 and 5 (key heads 0 and 2: slots 0 and
    1, neither equal to its key head), with ALiBi: each steered row is the definition's, the
    other heads untouched."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(10, 6, 8, generator=g), torch.randn(10, 3, 8, generator=g),
               torch.randn(10, 3, 8, generator=g))
    meta = {**META, "num_heads": 6, "num_kv_heads": 3, "head_size": 8,
            "alibi_slopes": [0.5, 0.4, 0.3, 0.2, 0.1, 0.05]}
    edits = [AttentionEdit(layers=(0,), heads=(0, 5), span=(2, 6), alpha=0.1),
             AttentionEdit(layers=(0,), heads=(5,), key_positions=(1, 7), bias=-2.0)]
    out = _run(edits, q, k, v, meta, chunks=(4,))
    plain = _attention(q, k, v, meta)
    assert torch.equal(out[:, 1:5], plain[:, 1:5])
    w = _weights(q, k, meta)
    keep = torch.full((10,), 0.1)
    keep[2:6] = 1.0
    for p in range(10):
        row = w[0, p, : p + 1] * keep[: p + 1]
        expected = (row / row.sum()) @ v[: p + 1, 0] if p >= 2 else plain[p, 0]
        assert torch.allclose(out[p, 0], expected, atol=1e-5), p
        # Head 5 (key head 2): the bias on keys 1 and 7 first, then the emphasis.
        scores = torch.stack([q[p, 5] @ k[j, 2] * META["scale"] + 0.05 * (j - p)
                              for j in range(p + 1)])
        scores[[j for j in (1, 7) if j <= p]] -= 2.0
        row = torch.softmax(scores, 0) * keep[: p + 1]
        expected = (row / row.sum()) @ v[: p + 1, 2] if p >= 2 else \
            torch.softmax(scores, 0) @ v[: p + 1, 2]
        assert torch.allclose(out[p, 5], expected, atol=1e-5), p


def test_every_rank_reserves_alike_whichever_heads_it_steers():
    """Rank 0 of two holds heads 0..3, rank 1 heads 4..7: an edit of head 5 steers nothing on
    rank 0, yet both reserve the same (so they refuse alike under a full budget)."""
    edit = AttentionEdit(layers=(0,), heads=(5,), span=(0, 2), alpha=0.5)
    reserved = []
    for rank in (0, 1):
        budget = HistoryBudget(1 << 30)
        steer = RequestAttentionSteer.build((edit,), {0: META}, rank, budget, 12, 4,
                                            torch.device("cpu"))
        reserved.append(budget.used)
        assert bool(steer.by_layer) == (rank == 1)
    assert reserved[0] == reserved[1] == 12 * 2 * 16 * 2 * 4


def test_prepare_reserves_prompt_plus_max_tokens_within_the_context():
    from vllm_lens.worker.attention_steering import AttentionSteering

    edit = AttentionEdit(layers=(0,), heads=None, span=(0, 2), alpha=0.5)
    steering = AttentionSteering({0: META}, 0, frozenset({0}), 1 << 30)
    per_position = 2 * 16 * 2 * 4  # key heads x head size x (keys, values) x float32
    lens = LensRequest(key="k", steer_attention=(edit,), attention_positions=100,
                       attention_max_tokens=30)
    state = steering.prepare(lens, 20, torch.device("cpu"), torch.float32)
    assert state.history.positions == 50 and steering.budget.used == 50 * per_position
    long = steering.prepare(lens, 90, torch.device("cpu"), torch.float32)  # the context caps
    assert long.history.positions == 100
    state.free()
    long.free()
    assert steering.budget.used == 0
    for unset in (dict(attention_positions=0), dict(attention_max_tokens=0)):
        with pytest.raises(ValueError, match="no position bound"):
            steering.prepare(dataclasses.replace(lens, **unset), 20, torch.device("cpu"),
                             torch.float32)
