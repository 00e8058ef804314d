"""Installing taps by a layout (``worker.layouts``) on toy models: which tap fires where, for
which layer, twice installed, with modules shared between layers (no vLLM engine)."""

import pytest
import torch
from torch import nn

from vllm_lens.worker import layouts, taps
from vllm_lens.worker.layouts import Layout

SPLIT = Layout(layers="model.layers", block="sequential", norms="pre", fused_residual=False,
               mid="ln_2", attention="attn.attn", act="mlp.act", down_proj="mlp.down",
               attn_block="attn", mlp_block="mlp")


class Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(4, 8), nn.Linear(8, 4), act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """GPT-2's shape: the residual is added inside the block."""

    def __init__(self, act, attn=None):
        super().__init__()
        self.ln_2 = nn.LayerNorm(4)
        self.attn = attn or nn.Linear(4, 4)
        self.mlp = Mlp(act)

    def forward(self, hidden_states):
        h = hidden_states + self.attn(hidden_states)
        return h + self.mlp(self.ln_2(h))


def toy(name, blocks):
    model = type(name, (nn.Module,), {})()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(blocks)
    return model


@pytest.fixture
def calls(monkeypatch):
    monkeypatch.setitem(layouts.LAYOUTS, "ToyForCausalLM", SPLIT)
    seen = []
    taps.set_tap_handler(lambda a, b, layer, site: seen.append((layer, site)))
    yield seen
    taps.set_tap_handler(None)


def test_a_split_layout_taps_every_site_of_every_layer_once(calls):
    shared = nn.GELU()  # vLLM hands one activation instance to every layer
    model = toy("ToyForCausalLM", [Block(shared), Block(shared)])
    for _ in range(2):  # installing twice changes nothing
        info = taps.install_taps(model)
    assert info.sites == ("pre", "attn_block", "mid", "act", "mlp_block", "post")
    assert info.split and info.d_mlp == 0  # nn.Linear has no input_size
    layers = model.model.layers
    assert layers[0].mlp.act is not layers[1].mlp.act  # private copies ...
    assert type(shared) is nn.GELU  # ... and the shared instance left as it was
    for layer in (0, 1):
        calls.clear()
        layers[layer](torch.randn(3, 4))
        assert calls == [(layer, site) for site in info.sites]


def test_a_module_shared_by_two_layers_is_not_offered(calls):
    attn = nn.Linear(4, 4)
    model = toy("ToyForCausalLM", [Block(nn.GELU(), attn), Block(nn.GELU(), attn)])
    info = taps.install_taps(model)
    assert "attn_block" not in info.sites and "mid" in info.sites


def test_the_mid_tap_of_a_split_layout_gets_the_stream_alone_and_writes_through(calls):
    model = toy("ToyForCausalLM", [Block(nn.GELU())])
    taps.install_taps(model)
    x = torch.randn(3, 4)
    plain = model.model.layers[0](x)

    def bump(a, b, layer, site):
        assert b is None
        if site == "mid":
            a.add_(1.0)  # steering resid_mid in place reaches the MLP and the stream

    taps.set_tap_handler(bump)
    steered = model.model.layers[0](x)
    taps.set_tap_handler(None)
    block = model.model.layers[0]
    h = x + block.attn(x) + 1.0
    torch.testing.assert_close(steered, h + block.mlp(block.ln_2(h)))
    assert not torch.allclose(steered, plain)


def test_mlp_in_is_the_norms_output_and_is_left_out_where_the_mlp_reads_otherwise(
        calls, monkeypatch):
    """With ``Layout.mlp_in`` the mid module's output is tapped after its input (a write
    there reaches the MLP and nothing else); a layer with a time-conditioned norm, or a
    quantized linear, gets no ``mlp_in``."""
    import dataclasses

    monkeypatch.setitem(layouts.LAYOUTS, "ToyForCausalLM", dataclasses.replace(SPLIT, mlp_in=True))
    model = toy("ToyForCausalLM", [Block(nn.GELU())])
    info = taps.install_taps(model)
    assert info.sites == ("pre", "attn_block", "mid", "mlp_in", "act", "mlp_block", "post")
    x = torch.randn(3, 4)

    def bump(a, b, layer, site):
        if site == "mlp_in":
            a.add_(1.0)

    taps.set_tap_handler(bump)
    steered = model.model.layers[0](x)
    taps.set_tap_handler(None)
    block = model.model.layers[0]
    h = x + block.attn(x)
    torch.testing.assert_close(steered, h + block.mlp(block.ln_2(h) + 1.0))
    conditioned = toy("ToyForCausalLM", [Block(nn.GELU())])
    conditioned.model.layers[0].ada_rms_norm_t_cond = nn.Identity()
    assert "mlp_in" not in taps.install_taps(conditioned).sites
    quantized = toy("ToyForCausalLM", [Block(nn.GELU())])
    quantized.model.layers[0].mlp.up.quant_method = type("Fp8LinearMethod", (), {})()
    assert "mlp_in" not in taps.install_taps(quantized).sites
    plain = toy("ToyForCausalLM", [Block(nn.GELU())])
    plain.model.layers[0].mlp.up.quant_method = type("UnquantizedLinearMethod", (), {})()
    assert "mlp_in" in taps.install_taps(plain).sites


def test_unmapped_models_and_unmet_config_gates_are_left_alone(calls, monkeypatch):
    model = toy("OtherForCausalLM", [Block(nn.GELU())])
    info = taps.install_taps(model)
    # No row, and nothing to derive a layout from (no vLLM attention module in its layers).
    assert not info.tapped and info.unmapped.startswith("no list of decoder layers")
    gated = Layout(**{**SPLIT.__dict__, "requires": ("parallel", True)})
    monkeypatch.setitem(layouts.LAYOUTS, "ToyForCausalLM", gated)
    model = toy("ToyForCausalLM", [Block(nn.GELU())])
    model.config = type("Config", (), {"parallel": False})()
    info = taps.install_taps(model)
    assert not info.tapped and "parallel=True" in info.unmapped
    model.model.layers[0](torch.randn(2, 4))
    assert calls == []


class PostNormBlock(nn.Module):
    """OLMo 2's shape: each sublayer's output is normed, then added inside the block."""

    def __init__(self):
        super().__init__()
        self.attn, self.attn_norm = nn.Linear(4, 4), nn.LayerNorm(4)
        self.mlp, self.mlp_norm = Mlp(nn.GELU()), nn.LayerNorm(4)

    def forward(self, hidden_states):
        h = hidden_states + self.attn_norm(self.attn(hidden_states))
        return h + self.mlp_norm(self.mlp(h))


def test_the_norms_after_the_sublayers_are_read_at_their_inputs(calls, monkeypatch):
    """``attn_out_pre_norm`` / ``mlp_out_pre_norm``: the inputs of the norms after attention
    and the MLP, tapped before they run; where such a norm is also the split layout's block
    (its output is ``attn_out``), one tapped class reads both, input first."""
    import dataclasses

    post = Layout(layers="model.layers", block="sequential", norms="post", fused_residual=False,
                  mid="mlp", attention="attn.attn", act=None, down_proj=None,
                  attn_block="attn_norm", mlp_block="mlp_norm", attn_post_norm="attn_norm",
                  mlp_post_norm="mlp_norm")
    monkeypatch.setitem(layouts.LAYOUTS, "ToyForCausalLM", post)
    model = toy("ToyForCausalLM", [PostNormBlock()])
    info = taps.install_taps(model)
    assert info.sites == ("pre", "attn_post_norm", "attn_block", "mid", "mlp_post_norm",
                          "mlp_block", "post")
    rows = {}
    taps.set_tap_handler(lambda a, b, layer, site: rows.setdefault(site, a.clone()))
    x = torch.randn(3, 4)
    model.model.layers[0](x)
    taps.set_tap_handler(None)
    block = model.model.layers[0]
    torch.testing.assert_close(rows["attn_post_norm"], block.attn(x))
    torch.testing.assert_close(rows["attn_block"], block.attn_norm(block.attn(x)))
    h = x + block.attn_norm(block.attn(x))
    torch.testing.assert_close(rows["mlp_post_norm"], block.mlp(h))
    # A norm after a sublayer that no other site taps gets an input tap of its own.
    monkeypatch.setitem(layouts.LAYOUTS, "ToyForCausalLM", dataclasses.replace(
        post, attn_block=None, mlp_block=None))
    alone = toy("ToyForCausalLM", [PostNormBlock()])
    assert taps.install_taps(alone).sites == ("pre", "attn_post_norm", "mid", "mlp_post_norm",
                                              "post")


class Kernel(nn.Module):  # stands for vLLM's Attention: what the q/k norm sites look up
    head_size, num_kv_heads = 2, 1


class QKAttn(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.q_norm, self.k_norm, self.attn = nn.LayerNorm(width), nn.LayerNorm(width), Kernel()

    def forward(self, x):
        q = self.q_norm(x.view(x.shape[0], 2, 2)).reshape(x.shape)
        k = self.k_norm(x.view(x.shape[0], 2, 2)[:, :1]).reshape(x.shape[0], 2)
        return q + k.repeat(1, 2)


def test_q_and_k_norms_are_read_at_their_input_and_output_where_one_head_wide(
        calls, monkeypatch):
    """The ``q_norm`` / ``k_norm`` sites hand the norm's output and input together (``a``,
    ``b``); a norm spanning every head is tapped only without tensor parallelism."""
    qk = Layout(layers="model.layers", block="sequential", norms="pre", fused_residual=False,
                mid="ln_2", attention="attn.attn", act=None, down_proj=None,
                q_norm="attn.q_norm", k_norm="attn.k_norm")
    monkeypatch.setitem(layouts.LAYOUTS, "ToyForCausalLM", qk)
    block = Block(nn.GELU(), attn=QKAttn(2))
    model = toy("ToyForCausalLM", [block])
    info = taps.install_taps(model)
    assert {"q_norm", "k_norm"} <= set(info.sites)
    rows = {}
    taps.set_tap_handler(lambda a, b, layer, site: rows.setdefault(site, (a.clone(), b.clone()))
                         if site in ("q_norm", "k_norm") else None)
    x = torch.randn(3, 4)
    block(x)
    taps.set_tap_handler(None)
    heads = x.view(3, 2, 2)
    torch.testing.assert_close(rows["q_norm"][1], heads)
    torch.testing.assert_close(rows["q_norm"][0], block.attn.q_norm(heads))
    torch.testing.assert_close(rows["k_norm"][1], heads[:, :1])
    # One norm over every head: tapped at TP=1 only (and not where the size is unknown).
    wide = Block(nn.GELU(), attn=QKAttn(4))
    assert "q_norm" not in taps.install_taps(toy("ToyForCausalLM", [wide])).sites
    monkeypatch.setattr(taps, "_tp_size", lambda: 1)
    wide = Block(nn.GELU(), attn=QKAttn(4))
    wide.attn.forward = lambda x: wide.attn.q_norm(x) + wide.attn.k_norm(x)
    assert "q_norm" in taps.install_taps(toy("ToyForCausalLM", [wide])).sites
    monkeypatch.setattr(taps, "_tp_size", lambda: 2)
    wide = Block(nn.GELU(), attn=QKAttn(4))
    assert "q_norm" not in taps.install_taps(toy("ToyForCausalLM", [wide])).sites
    narrow = Block(nn.GELU(), attn=QKAttn(2))
    assert "q_norm" in taps.install_taps(toy("ToyForCausalLM", [narrow])).sites
