"""What ``worker.layout_derivation`` reads from a module tree: toy decoder layers of the three
shapes vLLM's models have (fused pre-norm, split pre-norm, post-norm), and the trees it must
refuse. The start-up check (``test_layout_check.py``, the derived families on engines) proves
what is derived; these pin down what is proposed."""

from __future__ import annotations

from torch import nn

from vllm_lens.worker.layout_derivation import derive_layout


class Kernel(nn.Module):  # stands for vLLM's Attention (the class is passed in)
    def forward(self, x):
        return x


class RMSNorm(nn.Module):
    def forward(self, x, residual=None):
        return x if residual is None else (x + residual, x + residual)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Kernel()

    def forward(self, x):
        return self.attn(x)


class MLP(nn.Module):
    def forward(self, x):
        return x


class Fused(nn.Module):  # Llama in vLLM
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(), Attn()
        self.post_attention_layernorm, self.mlp = RMSNorm(), MLP()

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Split(nn.Module):  # GPT-2 / StableLM: the residual added inside the layer
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = RMSNorm(), Attn(), RMSNorm(), MLP()

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class PostNorm(nn.Module):  # EXAONE 4 in vLLM: takes a residual it does not hand to a norm
    def __init__(self):
        super().__init__()
        self.self_attn, self.post_attention_layernorm = Attn(), RMSNorm()
        self.mlp, self.post_feedforward_layernorm = MLP(), RMSNorm()

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states = residual + self.post_attention_layernorm(self.self_attn(hidden_states))
        residual = hidden_states
        hidden_states = residual + self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, None


class NoMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.self_attn = RMSNorm(), Attn()

    def forward(self, hidden_states):
        return self.self_attn(self.norm(hidden_states))


def _model(layer_cls: type) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(layer_cls() for _ in range(3))
    model.model.embed = nn.Embedding(4, 4)
    return model


def test_a_fused_pre_norm_layer():
    layout = derive_layout(_model(Fused), Kernel).layout
    assert layout is not None and layout.derived
    assert (layout.layers, layout.fused_residual, layout.mid, layout.attention, layout.norms) \
        == ("model.layers", True, "post_attention_layernorm", "self_attn.attn", "pre")
    assert layout.attn_block is None and layout.mlp_block is None
    # What attention and the MLP read: proposed here, proven by the start-up check.
    assert (layout.attn_in, layout.mlp_in, layout.mlp_module) == ("input_layernorm", True, "mlp")


def test_a_split_pre_norm_layer():
    layout = derive_layout(_model(Split), Kernel).layout
    assert (layout.fused_residual, layout.mid, layout.attn_block, layout.mlp_block) \
        == (False, "ln_2", "attn", "mlp")
    assert (layout.attn_in, layout.mlp_in, layout.mlp_module) == ("ln_1", True, "mlp")


def test_a_post_norm_layer_adds_its_norms_outputs():
    layout = derive_layout(_model(PostNorm), Kernel).layout
    assert (layout.fused_residual, layout.norms, layout.mid, layout.attn_block,
            layout.mlp_block) == (False, "post", "mlp", "post_attention_layernorm",
                                  "post_feedforward_layernorm")
    # Its attention reads resid_pre and its MLP resid_mid: no attn_in / mlp_in of their own.
    assert (layout.attn_in, layout.mlp_in) == (None, False)


class FusedSandwich(nn.Module):  # GLM-4 in vLLM: a norm after each sublayer, fused residual
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(), Attn()
        self.post_self_attn_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        self.mlp, self.post_mlp_layernorm = MLP(), RMSNorm()

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_self_attn_layernorm(self.self_attn(hidden_states))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.post_mlp_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class SplitSandwich(nn.Module):  # Gemma 4 in vLLM: sandwich norms, the residual added here
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(), Attn()
        self.post_attention_layernorm, self.pre_feedforward_layernorm = RMSNorm(), RMSNorm()
        self.mlp, self.post_feedforward_layernorm = MLP(), RMSNorm()

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(residual))) + residual
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return self.post_feedforward_layernorm(hidden_states) + residual, None


def test_sandwich_layers_name_the_norms_after_their_sublayers():
    layout = derive_layout(_model(FusedSandwich), Kernel).layout
    assert (layout.norms, layout.mid, layout.attn_post_norm, layout.mlp_post_norm) == (
        "sandwich", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")
    # A split sandwich adds what the norms after its blocks return: attn_out, mlp_out there.
    layout = derive_layout(_model(SplitSandwich), Kernel).layout
    assert (layout.fused_residual, layout.mid, layout.attn_block, layout.mlp_block) == (
        False, "pre_feedforward_layernorm", "post_attention_layernorm",
        "post_feedforward_layernorm")
    assert (layout.attn_post_norm, layout.mlp_post_norm, layout.attn_in) == (
        "post_attention_layernorm", "post_feedforward_layernorm", "input_layernorm")
    # Post-norm layers: the norms that follow the blocks; pre-norm ones have none.
    layout = derive_layout(_model(PostNorm), Kernel).layout
    assert (layout.attn_post_norm, layout.mlp_post_norm, layout.mlp_module) == (
        "post_attention_layernorm", "post_feedforward_layernorm", "mlp")
    layout = derive_layout(_model(Fused), Kernel).layout
    assert (layout.attn_post_norm, layout.mlp_post_norm) == (None, None)


class QKNormAttn(Attn):  # Qwen3-MoE: norms of Q and K inside the attention block
    def __init__(self):
        super().__init__()
        self.q_norm, self.k_norm = RMSNorm(), RMSNorm()


class QKNormLayer(Fused):
    def __init__(self):
        super().__init__()
        self.self_attn = QKNormAttn()


def test_the_attention_blocks_q_and_k_norms_are_named_where_it_has_them():
    layout = derive_layout(_model(QKNormLayer), Kernel).layout
    assert (layout.q_norm, layout.k_norm) == ("self_attn.q_norm", "self_attn.k_norm")
    layout = derive_layout(_model(Fused), Kernel).layout
    assert (layout.q_norm, layout.k_norm) == (None, None)


class Branches(nn.Module):  # OPT in vLLM: its config picks pre- or post-norm
    def __init__(self):
        super().__init__()
        self.self_attn_layer_norm, self.self_attn = RMSNorm(), Attn()
        self.final_layer_norm, self.mlp = RMSNorm(), MLP()
        self.do_layer_norm_before = True

    def forward(self, hidden_states):
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return residual + self.mlp(hidden_states)


def test_a_norm_the_config_puts_before_or_after_attention_is_refused():
    found = derive_layout(_model(Branches), Kernel)
    assert found.layout is None
    assert "calls self.self_attn_layer_norm both before and after self.self_attn" in found.reason


def test_trees_without_a_layout_are_refused_with_a_reason():
    found = derive_layout(_model(NoMLP), Kernel)
    assert found.layout is None and "no MLP block" in found.reason
    found = derive_layout(nn.Linear(2, 2), Kernel)
    assert found.layout is None and "no list of decoder layers" in found.reason



class TwoCalls(nn.Module):  # DeepSeek-V2: attention called from two branches
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(), Attn()
        self.post_attention_layernorm, self.mlp = RMSNorm(), MLP()

    def forward(self, positions, hidden_states, residual, scaling=None):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if scaling is None:
            hidden_states = self.self_attn(hidden_states)
        else:
            hidden_states = self.self_attn(hidden_states, scaling)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def test_attention_called_from_two_branches_is_one_block():
    layout = derive_layout(_model(TwoCalls), Kernel).layout
    assert layout is not None
    assert (layout.mid, layout.fused_residual, layout.attention) == (
        "post_attention_layernorm", True, "self_attn.attn")


class Mixer(nn.Module):  # a Mamba layer's mixer: no attention kernel
    def forward(self, x):
        return x


class MambaLayer(nn.Module):  # Nemotron-H: one norm, one mixer, the residual fused
    def __init__(self):
        super().__init__()
        self.norm, self.mixer = RMSNorm(), Mixer()

    def forward(self, hidden_states, residual):
        hidden_states, residual = self.norm(hidden_states, residual)
        return self.mixer(hidden_states), residual


class AttentionLayer(MambaLayer):
    def __init__(self):
        super().__init__()
        self.mixer = Attn()


class SplitMambaLayer(nn.Module):  # adds to the stream itself
    def __init__(self):
        super().__init__()
        self.norm, self.mixer = RMSNorm(), Mixer()

    def forward(self, hidden_states, residual):
        return hidden_states + self.mixer(self.norm(hidden_states)), None


def _hybrid(*classes: type) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(cls() for cls in classes)
    return model


def test_a_hybrid_gets_the_stream_between_layers_only():
    layout = derive_layout(_hybrid(MambaLayer, AttentionLayer, MambaLayer), Kernel).layout
    assert layout is not None and layout.stream_only is not None
    assert "Mamba" in layout.stream_only
    assert (layout.layers, layout.fused_residual, layout.mid) == ("model.layers", True, None)
    assert layout.attention == "mixer.attn"


def test_a_hybrid_whose_layers_hand_the_stream_on_differently_is_refused():
    found = derive_layout(_hybrid(SplitMambaLayer, AttentionLayer), Kernel)
    assert found.layout is None and "different" in found.reason
    found = derive_layout(_hybrid(MambaLayer, MambaLayer), Kernel)  # no attention at all
    assert found.layout is None and "no list of decoder layers" in found.reason


def test_a_hybrids_stack_is_found_beside_a_shorter_all_attention_list():
    model = _hybrid(MambaLayer, AttentionLayer, MambaLayer, AttentionLayer)
    model.mtp = nn.Module()  # a prediction head of one attention layer
    model.mtp.layers = nn.ModuleList([AttentionLayer()])
    layout = derive_layout(model, Kernel).layout
    assert layout is not None and layout.layers == "model.layers"
    assert layout.stream_only is not None
    model.mtp.layers = nn.ModuleList(Fused() for _ in range(5))  # now the longer one
    layout = derive_layout(model, Kernel).layout
    assert layout.layers == "mtp.layers" and layout.stream_only is None


def test_padded_or_narrower_v_heads_get_no_per_head_taps():
    from types import SimpleNamespace

    from vllm_lens.worker.taps import _v_heads_whole

    kernel = SimpleNamespace(head_size=64, head_size_v=64)
    assert _v_heads_whole(nn.Module(), kernel)
    assert not _v_heads_whole(nn.Module(), SimpleNamespace(head_size=64, head_size_v=32))
    minicpm3 = nn.Module()  # pads V with zeros up to Q/K's head size before the kernel
    minicpm3.v_head_dim = 32
    assert not _v_heads_whole(minicpm3, kernel)
    minicpm3.v_head_dim = 64
    assert _v_heads_whole(minicpm3, kernel) and _v_heads_whole(None, kernel)
