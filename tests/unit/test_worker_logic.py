"""Worker-side slicing, grouping, buffering and assembly, without an engine."""

import pytest
import torch

from vllm_lens.spec import CaptureSpec, LensRequest
from vllm_lens.worker.capture import assemble, capture_layer
from vllm_lens.worker.plan import RequestSlice, StepPlan, select_rows
from vllm_lens.worker.staging_pool import StagingPool
from vllm_lens.worker.capture_store import CaptureStore


def _entries(store, key):
    """Every entry of lens key ``key`` (all requests, all signals), popping them."""
    return [e for by_signal in store.pop(key).values() for e in by_signal.values()]


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


def test_plan_groups_requests_by_layer_set():
    # batch rows: a = 0..2 (prefill), plain request at 3, b = 4 (decode at position 9)
    a = _slice("a", 0, 3, 0, 3, (0, 2))
    b = _slice("b", 4, 5, 9, 5, (2,))
    c = _slice("c", 5, 6, 7, 5, (0, 2))
    plan = StepPlan.build([a, b, c], torch.device("cpu"), frozenset(range(4)), split=False)
    assert set(plan.capture) == {(0, "post"), (2, "post")}
    ac, bb = plan.groups
    assert ac.layers == (0, 2) and bb.layers == (2,)
    assert ac.rows.tolist() == [0, 1, 2, 5] and bb.rows == slice(4, 5)
    assert [(o.key, o.lo, o.hi) for o in ac.owners] == [("a", 0, 3), ("c", 3, 4)]
    assert ac.owners[1].positions.tolist() == [7]
    assert plan.capture[(2, "post")] == [(ac, 1), (bb, 0)]
    assert bb.owners[0].positions.tolist() == [9]


def test_plan_without_capture_rank_has_no_groups():
    plan = StepPlan.build([_slice("a", 0, 3, 0, 3, (0,))], torch.device("cpu"), frozenset(),
                          split=False)
    assert not plan.empty and plan.capture == {} and plan.groups == []


def test_plan_captures_only_this_stages_layers():
    a = _slice("a", 0, 3, 0, 3, (0, 3))
    b = _slice("b", 3, 4, 5, 5, (1,))
    plan = StepPlan.build([a, b], torch.device("cpu"), frozenset({2, 3}), split=False)
    assert set(plan.capture) == {(3, "post")}
    assert [o.key for g in plan.groups for o in g.owners] == ["a"]


def _run_steps(store, steps):
    """Feed (slices, hidden, residual, layers) steps through plan + capture like the runtime:
    plan and stage at the step's start, settle at the next step's start."""
    for slices, hidden, residual, layers in steps:
        store.settle()
        plan = StepPlan.build(slices, hidden.device, frozenset(range(4)), split=False)
        for group in plan.groups:
            store.stage(group)
        for layer in layers:
            for group, index in plan.capture.get((layer, "post"), ()):
                capture_layer(group, index, hidden, residual)
    return store.settle(wait=True)


def test_capture_sums_hidden_and_residual_and_assembles_across_steps():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h1, r1 = torch.randn(5, 4), torch.randn(5, 4)
    h2, r2 = torch.randn(2, 4), torch.randn(2, 4)
    steps = [
        ([_slice("a", 1, 4, 0, 3, (0, 1))], h1, r1, [0, 1]),  # prefill of 3 tokens at rows 1..3
        ([_slice("a", 1, 2, 3, 3, (0, 1))], h2, r2, [0, 1]),  # decode, position 3, row 1
    ]
    _run_steps(store, steps)
    (entry,) = _entries(store, "a")
    out = assemble(entry, valid_len=4)
    expected = torch.cat([(h1 + r1)[1:4], (h2 + r2)[1:2]])
    assert out["layers"] == [0, 1]
    assert out["positions"].tolist() == [0, 1, 2, 3]
    assert torch.equal(out["tensor"][0], expected)
    # a later in-place change of the hidden states must not reach the buffers
    h1.zero_()
    assert torch.equal(out["tensor"][1], expected)
    assert store.nbytes == 0 and len(store) == 0


def test_a_step_that_stops_part_way_files_nothing():
    # Layer 0 of two ran, then the step failed: the staging tensor's layer-1 slice was never
    # written, so none of it may reach the request's rows.
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h = torch.randn(3, 4)
    failed = _run_steps(store, [([_slice("a", 0, 3, 0, 3, (0, 1))], h, None, [0])])
    assert store.pop("a") == {} and store.nbytes == 0
    # ... and the request is told (it fails), never served without those rows.
    assert [(k, r) for k, r, _ in failed] == [("a", "req-a")]
    assert "layers [1] were not produced" in failed[0][2]
    _run_steps(store, [([_slice("b", 0, 3, 0, 3, (0, 1))], h, None, [0, 1])])
    (b,) = _entries(store, "b")
    assert torch.equal(assemble(b, 3)["tensor"][1], h)


def test_requests_of_one_step_get_their_own_copies():
    # Two requests share a step's staging tensor; each entry must hold its own rows only,
    # so a fetched request's memory is not kept alive by the other one.
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h = torch.randn(3, 4)
    _run_steps(store, [([_slice("a", 0, 2, 0, 2, (0,)), _slice("b", 2, 3, 0, 1, (0,))],
                        h, None, [0])])
    (a,) = _entries(store, "a")
    (b,) = _entries(store, "b")
    assert a.nbytes == 2 * 4 * 4 and b.nbytes == 4 * 4
    assert a.chunks[0].untyped_storage().nbytes() == a.nbytes
    assert torch.equal(assemble(b, 1)["tensor"][0], h[2:3])


def _settle_one_step(store, slices, hidden, destination, pool=None):
    plan = StepPlan.build(slices, hidden.device, frozenset(range(4)), split=False)
    for group in plan.groups:
        store.stage(group)
        capture_layer(group, 0, hidden, None, pool)
    failed = store.settle(destination=destination)
    return plan.groups[0].staging, failed


def _shares(entry, staging):
    (chunk,) = entry.chunks
    return chunk.untyped_storage().data_ptr() == staging.untyped_storage().data_ptr()


@pytest.mark.parametrize(("destinations", "viewed"), [
    ({"a": "d", "b": "d"}, {"a", "b"}),  # one dataset, 3 of 4 rows: views of the staging
    ({"a": "d"}, {"a"}),                 # half of the rows: a view; the others copies
    ({"b": "d"}, set()),                 # a quarter: copies, or b would keep all four rows
    ({"a": "d", "b": "e"}, {"a"}),       # two datasets: only the one holding half
    ({"b": "d", "c": "d"}, {"b", "c"}),
    ({}, set()),                         # nothing fetched for a sink now
])
def test_requests_fetched_for_one_dataset_keep_views_only_of_rows_mostly_theirs(destinations,
                                                                              viewed):
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h = torch.randn(4, 3)
    slices = [_slice("a", 0, 2, 0, 2, (0,)), _slice("b", 2, 3, 0, 1, (0,)),
              _slice("c", 3, 4, 0, 1, (0,))]
    staging, failed = _settle_one_step(store, slices, h,
                                       lambda key, _req_id: destinations.get(key))
    assert failed == []
    for key, rows in (("a", h[0:2]), ("b", h[2:3]), ("c", h[3:4])):
        (entry,) = _entries(store, key)
        assert _shares(entry, staging) == (key in viewed), key
        assert entry.nbytes == rows.numel() * 4
        assert torch.equal(assemble(entry, 9)["tensor"][0], rows)
    assert store.nbytes == 0


def test_rows_refused_or_closed_do_not_count_toward_a_view():
    # a (3 of 4 rows) is refused for the byte budget: b's one row must not keep the rest.
    store = CaptureStore(max_bytes=5 * 4 * 3, finished_ttl_s=60)
    store._nbytes = 4 * 4 * 3  # (held for other requests)
    h = torch.randn(4, 3)
    slices = [_slice("a", 0, 3, 0, 3, (0,)), _slice("b", 3, 4, 0, 1, (0,))]
    staging, failed = _settle_one_step(store, slices, h, lambda key, _req_id: "d")
    assert [(k, r) for k, r, _ in failed] == [("a", "req-a")]
    (b,) = _entries(store, "b")
    assert not _shares(b, staging)
    # a fetched already (closed): b alone, a quarter of the rows, is copied.
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    store.pop("a")
    staging, failed = _settle_one_step(store, slices, h, lambda key, _req_id: "d")
    assert failed == [] and store.pop("a") == {}
    (b,) = _entries(store, "b")
    assert not _shares(b, staging)


def test_a_pooled_staging_tensor_waits_for_the_requests_viewing_it():
    # Rows kept as views for a sink (a and b: one dataset) share the step's pooled staging
    # tensor; later steps must not be handed its memory while any of them is held: b's
    # entry by the store, a's rows by whoever fetched them (a sink's shard).
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    pool = StagingPool()
    h = torch.randn(4, 1 << 17)  # 2 MiB a step: pooled
    slices = [_slice("a", 0, 3, 0, 3, (0,)), _slice("b", 3, 4, 0, 1, (0,))]
    staging, failed = _settle_one_step(store, slices, h, lambda key, _req_id: "d", pool)
    (a,) = _entries(store, "a")  # fetched
    assert failed == [] and _shares(a, staging)
    viewed = staging.data_ptr()
    del staging
    held = []  # later steps' rows, fetched and still held (so each step needs a buffer)
    for i in range(3):
        other = torch.full((4, 1 << 17), float(i))
        staging, _ = _settle_one_step(store, [_slice(f"c{i}", 0, 4, 0, 4, (0,))], other,
                                      None, pool)
        assert staging.data_ptr() != viewed
        held.append(store.pop(f"c{i}"))
        if i == 1:
            del a  # a let go: b's entry still holds the tensor
        del staging
    assert torch.equal(assemble(_entries(store, "b")[0], 9)["tensor"][0], h[3:4])
    # b fetched and let go: its buffer, the only free one, is handed out again.
    staging, _ = _settle_one_step(store, [_slice("d", 0, 4, 0, 4, (0,))], h, None, pool)
    assert staging.data_ptr() == viewed


def test_assemble_trims_surplus_and_deduplicates_recomputed_positions():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h = [torch.full((2, 4), float(i)) for i in range(3)]
    steps = [
        ([_slice("a", 0, 2, 0, 2, (0,))], h[0], None, [0]),  # positions 0, 1
        ([_slice("a", 0, 2, 0, 2, (0,))], h[1], None, [0]),  # recomputed after preemption
        ([_slice("a", 0, 1, 2, 2, (0,))], h[2], None, [0]),  # surplus step at position 2
    ]
    _run_steps(store, steps)
    (entry,) = _entries(store, "a")
    out = assemble(entry, valid_len=2)
    assert out["positions"].tolist() == [0, 1]
    assert torch.equal(out["tensor"][0], h[1])


@pytest.mark.parametrize("reduce", ["mean", "last"])
def test_reductions(reduce):
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h, h2 = torch.randn(3, 4), torch.randn(1, 4)
    _run_steps(store, [([_slice("a", 0, 3, 0, 3, (1,), reduce=reduce)], h, None, [1]),
                       ([_slice("a", 0, 1, 3, 3, (1,), reduce=reduce)], h2, None, [1]),
                       ([_slice("a", 0, 1, 4, 3, (1,), reduce=reduce)], h2 + 1, None, [1])])
    (entry,) = _entries(store, "a")
    out = assemble(entry, valid_len=4)["tensor"]  # position 4 is a surplus step
    rows = torch.cat([h, h2])
    expected = rows.mean(0) if reduce == "mean" else rows[-1]
    torch.testing.assert_close(out, expected[None])


def _one_row(store, key, position=0):
    """Capture one row for request ``req-<key>``; returns the request id."""
    _run_steps(store, [([_slice(key, 0, 1, position, 1, (0,))], torch.ones(1, 4), None, [0])])
    return f"req-{key}"


def test_store_closes_fetched_keys_and_expires_finished_entries():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=0.0)
    _one_row(store, "k")
    store.pop("k")
    _one_row(store, "k", position=1)  # surplus step after the fetch
    assert len(store) == 0 and store.nbytes == 0
    other = _one_row(store, "other")
    store.mark_finished(live_req_ids={other})
    assert len(store) == 1
    store.mark_finished(live_req_ids=set())  # finished, ttl 0 -> dropped on next sweep
    store.mark_finished(live_req_ids=set())
    assert len(store) == 0 and store.nbytes == 0


def test_store_byte_budget_refuses_new_rows_and_keeps_finished_ones():
    store = CaptureStore(max_bytes=40, finished_ttl_s=1e9)
    finished = [_one_row(store, f"k{i}") for i in range(2)]  # 16 bytes each
    store.mark_finished(live_req_ids=set())  # both finished, not fetched yet
    lens = LensRequest(key="k2", capture=CaptureSpec(layers=(0,)))
    s = RequestSlice(req_id="req-k2", lens=lens, start=0, end=1, pos0=0, n_prompt=1)
    plan = StepPlan.build([s], torch.device("cpu"), frozenset({0}), split=False)
    (group,) = plan.groups
    capture_layer(group, 0, torch.ones(1, 4), None)
    store.stage(group)
    ((key, req_id, problem),) = store.settle()
    assert (key, req_id) == ("k2", "req-k2")
    assert "VLLM_LENS_WORKER_MAX_BYTES (40 bytes; 32 held for 2 requests, 16 more" in problem
    assert store.nbytes == 32 and not store.pop("k2")
    store.mark_finished(live_req_ids=set())
    for i, req_id in enumerate(finished):  # nothing finished was dropped to make room
        assert list(store.pop(f"k{i}")) == [req_id]


def test_rows_read_in_one_step_are_handed_over_without_a_copy():
    """A prompt read in one step (a dataset job's usual request): its chunk is the fetched
    tensor itself; rows from several steps, or with a surplus tail, are joined into one."""
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h = torch.randn(3, 4)
    _run_steps(store, [([_slice("a", 0, 3, 0, 3, (0, 1))], h, None, [0, 1])])
    (entry,) = _entries(store, "a")
    out = assemble(entry, valid_len=3)
    assert out["tensor"] is entry.chunks[0] and torch.equal(out["tensor"][1], h)
    _run_steps(store, [([_slice("b", 0, 3, 0, 3, (0, 1))], h, None, [0, 1]),
                       ([_slice("b", 0, 1, 3, 3, (0, 1))], h[:1], None, [0, 1])])
    (entry,) = _entries(store, "b")
    for valid, expected in ((4, torch.cat([h, h[:1]])), (2, h[:2])):
        out = assemble(entry, valid_len=valid)["tensor"]
        assert all(out is not chunk for chunk in entry.chunks)
        assert torch.equal(out[0], expected)


def test_assemble_with_no_valid_rows_is_empty():
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    _run_steps(store, [([_slice("a", 0, 2, 5, 2, (0, 1))], torch.randn(2, 4), None, [0, 1])])
    (entry,) = _entries(store, "a")
    out = assemble(entry, valid_len=3)
    assert out["tensor"].shape == (2, 0, 4) and out["positions"].numel() == 0


def test_streamed_rows_are_taken_once_and_the_rest_stays_for_the_final_fetch():
    """``take`` removes the rows below a position (each position once, also when a preempted
    request computes it again); the final fetch assembles what is left, and the parts laid
    end to end are the rows a fetch without streaming returns."""
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    h1, h2, h3 = torch.randn(3, 4), torch.randn(1, 4), torch.randn(2, 4)
    _run_steps(store, [([_slice("a", 0, 3, 0, 3, (0, 1))], h1, None, [0, 1]),  # prompt 0..2
                       ([_slice("a", 0, 1, 3, 3, (0, 1))], h2, None, [0, 1])])  # position 3
    first = store.take({"a": {"": 3}})["a"]["req-a"]["residual_stream"]
    part1 = assemble(first, 3)
    assert part1["positions"].tolist() == [0, 1, 2] and torch.equal(part1["tensor"][0], h1)
    assert store.take({"a": {"": 3}}) == {}  # nothing new below 3
    # Preempted and recomputed from position 2: position 2 was streamed, so only 3.. count.
    _run_steps(store, [([_slice("a", 0, 2, 2, 2, (0, 1))], h3, None, [0, 1])])
    assert store.nbytes == 2 * 2 * 4 * 4  # position 3 twice (2 layers of 4 floats), not 2
    (entry,) = _entries(store, "a")
    rest = assemble(entry, 4)
    assert rest["positions"].tolist() == [3]
    assert torch.equal(rest["tensor"][1], h3[1:2])  # the recomputed copy of position 3
    assert store.nbytes == 0
