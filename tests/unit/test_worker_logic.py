"""Worker-side slicing, grouping, buffering and assembly, without an engine."""

import numpy as np
import pytest
import torch

from vllm_lens.spec import CaptureSpec, LensRequest
from vllm_lens.worker.capture import assemble, capture_rows
from vllm_lens.worker.plan import RequestSlice, StepPlan, select_rows
from vllm_lens.worker.store import CaptureStore


@pytest.mark.parametrize(
    ("positions", "pos0", "n_rows", "n_prompt", "expected"),
    [
        ("all", 0, 4, 3, [0, 1, 2, 3]),
        ("prompt", 2, 4, 3, [0]),
        ("generated", 2, 4, 3, [1, 2, 3]),
        ("last_prompt", 0, 5, 3, [2]),
        ("last_prompt", 3, 1, 3, []),
        ((1, 7, 9), 6, 3, 3, [1]),
    ],
)
def test_select_rows(positions, pos0, n_rows, n_prompt, expected):
    spec = CaptureSpec(layers=(0,), positions=positions)
    assert select_rows(spec, pos0, n_rows, n_prompt).tolist() == expected


def _slice(key, start, end, pos0, n_prompt, layers, positions="all", reduce=None):
    lens = LensRequest(key=key, capture=CaptureSpec(layers=layers, positions=positions,
                                                    reduce=reduce))
    return RequestSlice(req_id=f"req-{key}", lens=lens, start=start, end=end, pos0=pos0,
                        n_prompt=n_prompt)


def test_plan_groups_rows_per_layer():
    # batch rows: a = 0..2 (prefill), plain request at 3, b = 4 (decode at position 9)
    a = _slice("a", 0, 3, 0, 3, (0, 2))
    b = _slice("b", 4, 5, 9, 5, (2,))
    plan = StepPlan.build([a, b], torch.device("cpu"), frozenset(range(4)))
    assert set(plan.capture) == {0, 2}
    assert plan.capture[0].rows == slice(0, 3)
    assert plan.capture[2].rows.tolist() == [0, 1, 2, 4]
    assert [(o.key, o.lo, o.hi) for o in plan.capture[2].owners] == [("a", 0, 3), ("b", 3, 4)]
    assert plan.captured_positions["req-b"].tolist() == [9]


def test_plan_without_capture_rank_has_no_groups():
    plan = StepPlan.build([_slice("a", 0, 3, 0, 3, (0,))], torch.device("cpu"), frozenset())
    assert not plan.empty and plan.capture == {}


def test_plan_captures_only_this_stages_layers():
    a = _slice("a", 0, 3, 0, 3, (0, 3))
    b = _slice("b", 3, 4, 5, 5, (1,))
    plan = StepPlan.build([a, b], torch.device("cpu"), frozenset({2, 3}))
    assert set(plan.capture) == {3}
    assert set(plan.captured_positions) == {"req-a"}


def _run_steps(store, steps, hidden_size=4):
    """Feed (slices, hidden, residual) steps through plan + capture like the runtime does."""
    for slices, hidden, residual, layers in steps:
        plan = StepPlan.build(slices, hidden.device, frozenset(range(4)))
        for s in slices:
            if s.req_id in plan.captured_positions:
                store.begin_step(s.lens.key, s.req_id, plan.captured_positions[s.req_id],
                                 s.lens.capture.reduce)
        for layer in layers:
            if layer in plan.capture:
                capture_rows(plan.capture[layer], hidden, residual, layer, store)


def test_capture_sums_hidden_and_residual_and_assembles_across_steps():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h1, r1 = torch.randn(5, 4), torch.randn(5, 4)
    h2, r2 = torch.randn(2, 4), torch.randn(2, 4)
    steps = [
        ([_slice("a", 1, 4, 0, 3, (0, 1))], h1, r1, [0, 1]),  # prefill of 3 tokens at rows 1..3
        ([_slice("a", 1, 2, 3, 3, (0, 1))], h2, r2, [0, 1]),  # decode, position 3, row 1
    ]
    _run_steps(store, steps)
    (entry,) = store.pop("a").values()
    out = assemble(entry, valid_len=4)
    expected = torch.cat([(h1 + r1)[1:4], (h2 + r2)[1:2]])
    assert out["layers"] == [0, 1]
    assert out["positions"].tolist() == [0, 1, 2, 3]
    assert torch.equal(out["residual_stream"][0], expected)
    # a later in-place change of the hidden states must not reach the buffers
    h1.zero_()
    assert torch.equal(out["residual_stream"][1], expected)
    assert store.nbytes == 0 and len(store) == 0


def test_assemble_trims_surplus_and_deduplicates_recomputed_positions():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h = [torch.full((2, 4), float(i)) for i in range(3)]
    steps = [
        ([_slice("a", 0, 2, 0, 2, (0,))], h[0], None, [0]),  # positions 0, 1
        ([_slice("a", 0, 2, 0, 2, (0,))], h[1], None, [0]),  # recomputed after preemption
        ([_slice("a", 0, 1, 2, 2, (0,))], h[2], None, [0]),  # surplus step at position 2
    ]
    _run_steps(store, steps)
    (entry,) = store.pop("a").values()
    out = assemble(entry, valid_len=2)
    assert out["positions"].tolist() == [0, 1]
    assert torch.equal(out["residual_stream"][0], h[1])


@pytest.mark.parametrize("reduce", ["mean", "last"])
def test_reductions(reduce):
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h = torch.randn(3, 4)
    _run_steps(store, [([_slice("a", 0, 3, 0, 3, (1,), reduce=reduce)], h, None, [1])])
    (entry,) = store.pop("a").values()
    out = assemble(entry, valid_len=3)["residual_stream"]
    expected = h.mean(0) if reduce == "mean" else h[-1]
    torch.testing.assert_close(out, expected[None])


def test_store_closes_fetched_keys_and_expires_finished_entries():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=0.0)
    store.begin_step("k", "r1", np.array([0]), None)
    store.add_rows("k", "r1", 0, torch.ones(1, 4))
    store.pop("k")
    store.begin_step("k", "r1", np.array([1]), None)  # surplus step after the fetch
    store.add_rows("k", "r1", 0, torch.ones(1, 4))
    assert len(store) == 0 and store.nbytes == 0
    store.begin_step("other", "r2", np.array([0]), None)
    store.add_rows("other", "r2", 0, torch.ones(1, 4))
    store.mark_finished(live_req_ids={"r2"})
    assert len(store) == 1
    store.mark_finished(live_req_ids=set())  # r2 finished, ttl 0 -> dropped on next sweep
    store.mark_finished(live_req_ids=set())
    assert len(store) == 0 and store.nbytes == 0


def test_store_byte_budget_evicts_oldest_finished():
    store = CaptureStore(max_bytes=40, finished_ttl_s=1e9)
    for i in range(3):
        store.begin_step(f"k{i}", f"r{i}", np.array([0]), None)
        store.add_rows(f"k{i}", f"r{i}", 0, torch.ones(1, 4))  # 16 bytes each
    store.mark_finished(live_req_ids={"r2"})
    assert store.nbytes <= 40
    assert store.pop("k2")  # the live one survives


def test_assemble_with_no_valid_rows_is_empty():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    _run_steps(store, [([_slice("a", 0, 2, 5, 2, (0, 1))], torch.randn(2, 4), None, [0, 1])])
    (entry,) = store.pop("a").values()
    out = assemble(entry, valid_len=3)
    assert out["residual_stream"].shape == (2, 0, 4) and out["positions"].numel() == 0
