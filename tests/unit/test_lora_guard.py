"""The LoRA guard on vLLM's own PyTorch LoRA ops (no engine): tokens whose slot is ``-1`` (no
adapter) get nothing from any slot, exactly as vLLM's Triton kernels skip them, while the rows
with an adapter get what vLLM's op computes; without the guard the same call gives the
no-adapter rows the last slot's adapter."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from vllm.lora.ops.torch_ops import lora_ops

from vllm_lens.common import lora_guard
from vllm_lens.common.engine_support import config_unsupported_reason

#: Two slots, both holding an adapter; rows 1 and 3 have none (-1).
INDICES = torch.tensor([0, -1, 1, -1, 1])
SLOTS, RANK, HIDDEN = 2, 4, 6


def _weights(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cases():
    x = _weights((5, HIDDEN), 1)
    a = _weights((SLOTS, 1, RANK, HIDDEN), 2)      # shrink: [slots, 1, rank, in]
    r = _weights((5, RANK), 3)
    b = _weights((SLOTS, 1, HIDDEN, RANK), 4)      # expand: [slots, 1, out, rank]
    return [
        ("bgmv_shrink", (x, a), (5, RANK), (0.5,)),
        ("bgmv_expand", (r, b), (5, HIDDEN), (True,)),
        ("bgmv_expand", (r, b), (5, HIDDEN), (False,)),
        ("bgmv_expand_slice", (r, b), (5, 2 * HIDDEN), (HIDDEN, HIDDEN, True)),
    ]


@pytest.mark.parametrize("name, inputs, out_shape, rest", _cases(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_rows_without_an_adapter_are_left_alone_and_the_others_equal_vllms_op(
        name, inputs, out_shape, rest):
    original = getattr(lora_ops, name)
    original = getattr(original, "__wrapped__", original)
    before = _weights(out_shape, 5)

    guarded_out = before.clone()
    lora_guard.skip_rows_without_adapter(original)(*inputs, guarded_out, INDICES, *rest)

    keep = INDICES >= 0
    assert torch.equal(guarded_out[~keep], before[~keep])  # untouched, as Triton skips them
    alone = before[keep].clone()  # vLLM's op on the rows with an adapter alone
    original(inputs[0][keep], inputs[1], alone, INDICES[keep], *rest)
    assert torch.equal(guarded_out[keep], alone)

    unguarded = before.clone()
    original(*inputs, unguarded, INDICES, *rest)
    assert not torch.equal(unguarded[~keep], before[~keep])  # vLLM alone: the last slot's


def test_no_adapter_at_all_changes_nothing_and_all_adapters_is_vllms_op():
    original = lora_ops.bgmv_expand
    original = getattr(original, "__wrapped__", original)
    r, b = _weights((3, RANK), 6), _weights((SLOTS, 1, HIDDEN, RANK), 7)
    out = _weights((3, HIDDEN), 8)
    guarded = lora_guard.skip_rows_without_adapter(original)
    kept = out.clone()
    guarded(r, b, kept, torch.tensor([-1, -1, -1]), True)
    assert torch.equal(kept, out)
    ours, theirs = out.clone(), out.clone()
    guarded(r, b, ours, torch.tensor([1, 0, 1]), True)
    original(r, b, theirs, torch.tensor([1, 0, 1]), True)
    assert torch.equal(ours, theirs)


def test_segment_ops_and_the_cpu_wrapper_use_the_guarded_ops_once_installed():
    """``sgmv_*`` (the CPU runner's prefill path) reach the row ops through their module; the
    CPU wrapper imported the row ops by name."""
    from vllm.lora.punica_wrapper import punica_cpu

    lora_guard.install()
    lora_guard.install()  # idempotent
    assert lora_guard.guarded()
    assert lora_guard.needs_guard()  # the CPU build runs the PyTorch ops
    assert not hasattr(punica_cpu.bgmv_shrink.__wrapped__, "__wrapped__")  # wrapped once

    x, a = _weights((5, HIDDEN), 9), _weights((SLOTS, 1, RANK, HIDDEN), 10)
    out = torch.zeros(5, RANK)
    # Segments: [0], [-1], [1, 1], [-1] over the five tokens.
    lora_ops.sgmv_shrink(x, a, out, None, torch.tensor([1, 1, 2, 1]),
                         torch.tensor([0, -1, 1, -1]), 4, 2, 5, 1.0)
    assert torch.count_nonzero(out[[1, 4]]) == 0
    assert torch.count_nonzero(out[[0, 2, 3]]) > 0


def test_a_lora_engine_whose_pytorch_ops_are_not_guarded_refuses_lens_requests(monkeypatch):
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=False),
        model_config=SimpleNamespace(runner_type="generate", is_encoder_decoder=False),
        parallel_config=SimpleNamespace(use_ubatching=False),
        speculative_config=None, lora_config=None)
    assert config_unsupported_reason(config) is None
    lora = copy.copy(config)
    lora.lora_config = SimpleNamespace(max_loras=1)
    monkeypatch.setattr(lora_guard, "guarded", lambda: True)
    assert config_unsupported_reason(lora) is None
    monkeypatch.setattr(lora_guard, "guarded", lambda: False)
    reason = config_unsupported_reason(lora)
    assert reason is not None and "--enable-lora" in reason and "adapter" in reason
