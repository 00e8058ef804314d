"""Recording what a derived layout's blocks read and return for the start-up check
(``worker.block_inputs``), on toy modules: the right tensors, and the modules left as they
were, also when the pass fails (no vLLM engine)."""

import pytest
import torch
from torch import nn

from vllm_lens.worker import block_inputs


class Attn(nn.Module):
    def forward(self, positions, hidden_states):
        return 2.0 * hidden_states, None  # a tuple, as vLLM's blocks may return


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attn(), nn.Linear(4, 4)


def _layers(n=2):
    return nn.ModuleList(Layer() for _ in range(n))


READERS = (("attn_in", "self_attn", "input"), ("attn_out_pre_norm", "self_attn", "output"),
           ("mlp_in", "mlp", "input"))


def test_each_block_records_its_first_calls_input_and_output():
    layers, seen = _layers(), {}
    x = torch.randn(3, 4)
    with block_inputs.recording_inputs(layers, (0, 1), READERS, seen):
        layers[0].self_attn(torch.arange(3), hidden_states=x)
        layers[0].self_attn(torch.arange(3), x + 1.0)  # a second call is not recorded
        layers[1].mlp(x)
    torch.testing.assert_close(seen[(0, "attn_in")], x)
    torch.testing.assert_close(seen[(0, "attn_out_pre_norm")], 2.0 * x)
    torch.testing.assert_close(seen[(1, "mlp_in")], x)
    assert (1, "attn_in") not in seen  # that block was not called
    assert all("forward" not in m.__dict__ for m in layers.modules())


def test_the_blocks_are_unwrapped_when_the_pass_fails():
    layers = _layers()
    with pytest.raises(RuntimeError, match="boom"):
        with block_inputs.recording_inputs(layers, (0, 1), READERS, {}):
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in layers.modules())


def test_eager_switches_compiled_modules_to_their_python_forward_and_back():
    model = _layers()
    model[0].do_not_compile = False  # as vLLM's support_torch_compile sets it when compiling
    model[1].do_not_compile = True
    with pytest.raises(RuntimeError):
        with block_inputs.eager(model):
            assert model[0].do_not_compile is True
            raise RuntimeError
    assert model[0].do_not_compile is False and model[1].do_not_compile is True
