"""Position selectors: grammar, Python slice semantics over prompt / generated / all, and the
worker's two passes (superset while running, exact window at fetch time)."""

import numpy as np
import pytest
import torch

from vllm_lens.errors import LensRequestError
from vllm_lens.common.positions import Selector, parse_selector
from vllm_lens.spec import CaptureSpec, LensRequest, ModelFacts, parse_extra_args
from vllm_lens.worker.capture import assemble
from vllm_lens.worker.plan import RequestSlice, StepPlan, select_rows
from vllm_lens.worker.capture_store import CaptureStore

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8,
                   max_model_len=64, mapped=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prompt", Selector("prompt")),
        ("last_prompt", Selector("prompt", -1, None)),
        ("prompt[1:]", Selector("prompt", 1, None)),
        ("generated[-5:]", Selector("generated", -5, None)),
        ("all[-1]", Selector("all", -1, None)),
        ("all[3]", Selector("all", 3, 4)),
        ("prompt[-2]", Selector("prompt", -2, -1)),
        ("generated[:4]", Selector("generated", None, 4)),
        (" prompt[ 1 : -1 ] ", Selector("prompt", 1, -1)),
        ("prompt[:]", Selector("prompt")),
    ],
)
def test_parse(text, expected):
    assert parse_selector(text) == expected


@pytest.mark.parametrize("text", ["middle", "prompt[]", "prompt[::2]", "prompt[1:2:1]",
                                  "tokens[1:]", "prompt[a]", "prompt(1:)", "prompt[1:]x",
                                  "prompt[1234567890:]"])
def test_parse_refuses(text):
    assert parse_selector(text) is None


def _python(selector: Selector, n_prompt: int, n_seen: int) -> list[int]:
    """What Python's own slicing selects, as the reference."""
    every = list(range(n_seen))
    base = {"all": every, "prompt": every[:n_prompt], "generated": every[n_prompt:]}
    return base[selector.base][slice(selector.start, selector.stop)]


SELECTORS = ["all", "prompt", "generated", "last_prompt", "prompt[1:]", "prompt[-3:]",
             "prompt[:-1]", "prompt[2]", "prompt[-1]", "prompt[40]", "generated[-2:]",
             "generated[1:3]", "generated[0]", "generated[-1]", "generated[:-1]", "all[-1]",
             "all[-4:-1]", "all[2:]", "all[50:]", "generated[-100:]", "prompt[5:2]"]


@pytest.mark.parametrize("text", SELECTORS)
@pytest.mark.parametrize(("n_prompt", "n_seen"), [(5, 9), (5, 5), (1, 4), (7, 8)])
def test_bounds_match_python_slicing(text, n_prompt, n_seen):
    selector = parse_selector(text)
    lo, hi = selector.bounds(n_prompt, n_seen)
    expected = _python(selector, n_prompt, n_seen)
    assert list(range(lo, hi)) == expected
    # Without the end, the bounds contain the exact window (the worker keeps a superset).
    lo_open, hi_open = selector.bounds(n_prompt)
    assert lo == hi or (lo_open <= lo and (hi_open is None or hi <= hi_open))


def _file_steps(store: CaptureStore, lens: LensRequest, steps, n_prompt: int,
                width: int) -> int:
    """Run (pos0, n_rows) steps of request ``r`` through plan -> store, row ``p`` holding the
    value ``p``; returns the most bytes the store held at once."""
    peak = 0
    for pos0, n_rows in steps:
        s = RequestSlice(req_id="r", lens=lens, start=0, end=n_rows, pos0=pos0, n_prompt=n_prompt)
        plan = StepPlan.build([s], torch.device("cpu"), frozenset({0}), split=False)
        hidden = torch.arange(pos0, pos0 + n_rows, dtype=torch.float32)[:, None].expand(-1, width)
        for group in plan.groups:
            group.staging = hidden[group.rows][None].clone()
            group.complete = True
            store.stage(group)
        store.settle(wait=True)
        peak = max(peak, store.nbytes)
    return peak


def _capture_in_steps(text: str, n_prompt: int, n_seen: int, reduce=None, chunk=3):
    """A request of ``n_seen`` computed positions (and two surplus ones past the stop) in
    steps of ``chunk`` rows, assembled."""
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    lens = LensRequest(key="k", capture=CaptureSpec(layers=(0,), positions=text, reduce=reduce))
    steps = [(p, min(chunk, n_seen + 2 - p)) for p in range(0, n_seen + 2, chunk)]
    _file_steps(store, lens, steps, n_prompt, width=2)
    entries = store.pop("k")
    return None if not entries else assemble(entries["r"]["residual_stream"], n_seen)


@pytest.mark.parametrize("text", SELECTORS)
def test_plan_and_assembly_select_exactly_the_window(text):
    n_prompt, n_seen = 5, 11
    expected = _python(parse_selector(text), n_prompt, n_seen)
    out = _capture_in_steps(text, n_prompt, n_seen)
    got = [] if out is None else out["positions"].tolist()
    assert got == expected
    if out is not None:
        assert out["tensor"][0, :, 0].tolist() == [float(p) for p in expected]


def test_reductions_over_a_window_and_over_nothing():
    out = _capture_in_steps("generated[-3:]", 5, 11, reduce="mean")
    assert out["tensor"].shape == (1, 2)
    assert out["tensor"][0, 0].item() == pytest.approx(np.mean([8, 9, 10]))
    assert out["positions"].tolist() == [8, 9, 10]
    last = _capture_in_steps("prompt[1:]", 5, 11, reduce="last")
    assert last["tensor"][0, 0].item() == 4 and last["positions"].tolist() == [4]
    # A worker that kept rows for a window that turns out empty: NaN rows, no positions.
    empty = _capture_in_steps("generated[-3:-3]", 5, 11, reduce="mean")
    assert empty["tensor"].shape == (1, 2)
    assert torch.isnan(empty["tensor"]).all() and empty["positions"].numel() == 0
    last_row = _capture_in_steps("all[-1:]", 5, 11, reduce="mean")["tensor"]
    assert last_row.shape == (1, 2) and last_row[0, 0].item() == 10


def test_empty_window_after_trim_reduces_to_nan():
    # "generated[-1]" keeps generated rows while running; a request that generated no
    # forward-passed token (n_seen == n_prompt) trims them all away at fetch time.
    out = _capture_in_steps("generated[-1]", 5, 5, reduce="mean")
    assert out["tensor"].shape == (1, 2) and torch.isnan(out["tensor"]).all()


def test_validation_accepts_slices_and_names_the_forms():
    spec = {"output_residual_stream": {"layers": [1], "positions": "prompt[1:]",
                                       "reduce": "mean"}}
    lens = parse_extra_args(spec, lambda: FACTS)[1]
    assert lens.capture.positions == "prompt[1:]" and lens.capture.wants_prompt_rows()
    generated = parse_extra_args(
        {"output_residual_stream": {"layers": [1], "positions": "generated[-5:]"}},
        lambda: FACTS)[1]
    assert not generated.capture.wants_prompt_rows()
    with pytest.raises(LensRequestError, match=r"positions'.*'prompt\[1:\]'"):
        parse_extra_args({"output_residual_stream": {"layers": [1], "positions": "prompt[::2]"}},
                         lambda: FACTS)
    numpy_positions = {"layers": [1], "positions": np.array([3, 1])}
    arr = parse_extra_args({"output_residual_stream": numpy_positions}, lambda: FACTS)[1]
    assert arr.capture.positions == (1, 3)


def _run_request(text: str, n_prompt: int, n_computed: int, prefill_chunk: int):
    """Prefill in chunks, then one decode row per step; returns the store, the request's
    entry and the most bytes the store held at once."""
    store = CaptureStore(max_bytes=1 << 30, finished_ttl_s=60)
    lens = LensRequest(key="k", capture=CaptureSpec(layers=(0,), positions=text))
    steps = [(p, min(prefill_chunk, n_prompt - p)) for p in range(0, n_prompt, prefill_chunk)]
    steps += [(p, 1) for p in range(n_prompt, n_computed)]
    peak = _file_steps(store, lens, steps, n_prompt, width=4)
    return store, store.pop("k").get("r", {}).get("residual_stream"), peak


@pytest.mark.parametrize("text", ["all[-3:]", "generated[-5:]", "all[-1]", "generated[-4:-1]"])
def test_rolling_windows_hold_only_their_last_rows(text):
    n_prompt, n_computed = 100, 400
    store, entry, peak = _run_request(text, n_prompt, n_computed, prefill_chunk=32)
    selector = parse_selector(text)
    row_bytes = 4 * 4
    assert peak <= (2 * selector.keep_last + 64 + 16) * row_bytes  # not 400 rows
    assert peak <= selector.held_bound(400) * row_bytes
    out = assemble(entry, n_computed)
    assert out["positions"].tolist() == _python(selector, n_prompt, n_computed)


def test_a_rolling_window_past_its_slack_fails_instead_of_returning_wrong_rows():
    # The scheduler ran 200 positions past the request's real end (valid_len 200): the rows
    # the window needs were trimmed, which must fail, not return other rows.
    _, entry, _ = _run_request("all[-3:]", 10, 400, prefill_chunk=10)
    with pytest.raises(ValueError, match="trimmed while the request ran"):
        assemble(entry, 200)
    _, entry, _ = _run_request("all[-3:]", 10, 400, prefill_chunk=10)
    assert assemble(entry, 380)["positions"].tolist() == [377, 378, 379]  # within the slack


def test_held_bounds_cover_what_is_held():
    for text in SELECTORS + ["generated[2:-1]", "all[:-3]", "all[5:-5]"]:
        selector = parse_selector(text)
        for n_prompt, n_computed in [(5, 9), (50, 300), (300, 320)]:
            _, entry, peak = _run_request(text, n_prompt, n_computed, prefill_chunk=16)
            base = {"prompt": n_prompt, "generated": n_computed - n_prompt, "all": n_computed}
            assert peak <= selector.held_bound(base[selector.base]) * 16, (text, n_prompt)


def test_admission_bounds_generation_when_the_prompt_is_not_tokenized():
    from vllm_lens.frontend.admission import capture_bound

    facts = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8,
                       max_model_len=1000, mapped=True)
    generated = CaptureSpec(layers=(0,), positions="generated")
    assert capture_bound(generated, facts, None, 300)[0] == 300
    assert capture_bound(generated, facts, None, None)[0] == 1000
    assert capture_bound(generated, facts, 900, 300)[0] == 100
    prompt = CaptureSpec(layers=(0,), positions="prompt")
    assert capture_bound(prompt, facts, None, 5)[0] == 1000
    assert capture_bound(prompt, facts, 12, 5)[0] == 12
    rolling = CaptureSpec(layers=(0,), positions="generated[-5:]")
    assert capture_bound(rolling, facts, None, None)[0] == 2 * 5 + 64 + 16
    assert capture_bound(CaptureSpec(layers=(0, 1), positions=(1, 2, 3)), facts, 12, 5) == (
        3, 2 * 3 * 8 * 4)
