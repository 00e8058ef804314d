"""Tap point names, the output_activations / output_qk keys, and attention weights from Q/K."""

import dataclasses
import math

import msgspec
import pytest
import torch

from vllm_lens import (LensRequestError, SteeringVector, UnsupportedConfigError,
                       UnsupportedModelError)
from vllm_lens.frontend.admission import check_capture_size
from vllm_lens.attention import attention_patterns, compute_attention_weights
from vllm_lens.common.points import POINTS, STEERABLE, hook_name, resolve
from vllm_lens.spec import LensRequest, ModelFacts, parse_extra_args

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8, max_model_len=64,
                   mapped=True, sites=("pre", "attn", "mid", "act", "post"), d_mlp=32,
                   n_heads=2, n_kv_heads=1, head_dim=4, qk_meta=({"scale": 0.5},) * 4)


def parse(extra, facts=FACTS):
    return parse_extra_args(extra, lambda: facts)[1]


@pytest.mark.parametrize(("name", "expected"), [
    ("attn_out", ("attn_out", None)), ("hook_resid_pre", ("resid_pre", None)),
    ("blocks.3.hook_mlp_out", ("mlp_out", 3)), ("blocks.0.attn.hook_z", ("attn_z", 0)),
    ("blocks.2.mlp.hook_post", ("mlp_post", 2)), ("pre_attn", ("resid_pre", None)),
    ("post_attn", ("resid_mid", None)), ("post_block", ("resid_post", None)),
    ("hook_z", ("attn_z", None)), ("blocks.4.hook_mlp_in", ("mlp_in", 4)),
    ("blocks.2.attn_in", ("attn_in", 2)), ("blocks.5.attn.hook_v", ("value", 5)),
    ("hook_v", ("value", None)), ("value", ("value", None)), ("hook_value", ("value", None)),
    ("blocks.1.hook_attn_out_pre_norm", ("attn_out_pre_norm", 1)),
    ("mlp_out_pre_norm", ("mlp_out_pre_norm", None)),
])
def test_names_and_aliases(name, expected):
    assert resolve(name) == expected


@pytest.mark.parametrize("name", ["attn", "blocks.x.hook_attn_out", "hook_", "resid", 3, None,
                                  "blocks.1.ln2.hook_normalized", ["resid_pre"], {"a": 1}])
def test_unknown_names_list_the_points(name):
    with pytest.raises(KeyError, match="resid_pre, attn_in, attn_out"):
        resolve(name)


@pytest.mark.parametrize("name", ["hook_attn_in", "blocks.2.hook_attn_in"])
def test_transformer_lens_attn_in_is_refused_not_read_as_another_tensor(name):
    with pytest.raises(KeyError, match="before ln1.*resid_pre"):
        resolve(name)
    assert hook_name("attn_in", 2) == "blocks.2.attn_in"
    assert resolve(hook_name("attn_in", 2)) == ("attn_in", 2)


def test_per_head_captures_over_heads_of_two_sizes_are_refused():
    mixed = dataclasses.replace(FACTS, qk_meta=({"scale": 0.5, "head_size": 4},) * 3 + (
        {"scale": 0.5, "head_size": 16},))
    for extra, field in (({"output_qk": [0, 3]}, "output_qk"),
                         ({"output_activations": {"attn_z": [1, 3]}}, "output_activations.attn_z"),
                         ({"output_activations": {"value": True}}, "output_activations.value")):
        with pytest.raises(LensRequestError, match="4 at layers \\[[01].*16 at layers \\[3\\]") \
                as info:
            parse(extra, mixed)
        assert info.value.field == field
    assert parse({"output_qk": [0, 2], "output_activations": {"value": [3]}}, mixed)
    # two names of one point join first, then the sizes are checked
    with pytest.raises(LensRequestError, match="differ in size"):
        parse({"output_activations": {"value": [0], "blocks.3.attn.hook_v": True}}, mixed)
    # rows are as wide as the layers' heads: admission, empty results, SAE widths
    assert mixed.row_shape("value", (0, 1)) == (1, 4) and mixed.row_shape("attn_z", (3,)) == (
        2, 16)
    assert mixed.head_size() == mixed.head_dim


def test_final_norm_is_read_once_after_the_last_layer():
    with_final = dataclasses.replace(FACTS, sites=(*FACTS.sites, "final"))
    for raw in (True, [3], {"layers": True, "positions": "last_prompt"}):
        (spec,) = parse({"output_activations": {"final_norm": raw}}, with_final).captures
        assert (spec.signal, spec.layers) == ("final_norm", (3,))
    (spec,) = parse({"output_activations": {"hook_final_norm": True}}, with_final).captures
    assert spec.layers == (3,) and hook_name("final_norm", 3) == "final_norm"
    with pytest.raises(LensRequestError, match="after the last layer: give true or \\[3\\]") \
            as info:
        parse({"output_activations": {"final_norm": [1, 3]}}, with_final)
    assert info.value.field == "output_activations.final_norm"
    with pytest.raises(UnsupportedModelError, match="no final norm was found") as info:
        parse({"output_activations": {"final_norm": True}})  # a model without the site
    with pytest.raises(KeyError, match="before its weight"):
        resolve("ln_final.hook_normalized")
    from vllm_lens.spec.saes import check_description

    sae = {"point": "final_norm", "layer": 1, "d_sae": 16, "d_in": FACTS.hidden_size}
    with pytest.raises(LensRequestError, match="after the last layer \\(3\\)"):
        check_description(sae, with_final, "output_sae_features[0]")
    assert check_description({**sae, "layer": 3}, with_final, "f")[:2] == ("final_norm", 3)
    with pytest.raises(LensRequestError, match="cannot be written to"):
        parse({"apply_steering_vectors": [SteeringVector(
            activations=torch.zeros(1, FACTS.hidden_size), layer_indices=[3],
            hook_point="final_norm")]}, with_final)


def test_steerable_points_are_the_stream_points():
    assert STEERABLE == ("resid_pre", "attn_in", "attn_out", "resid_mid", "mlp_in", "mlp_out",
                         "resid_post")
    assert not POINTS["mlp_post"].steerable and not POINTS["attn_z"].steerable
    assert not POINTS["value"].steerable


def test_value_is_read_beside_q_and_k_one_row_per_key_value_head():
    from vllm_lens.common.points import tap_key

    assert hook_name("value", 4) == "blocks.4.attn.hook_v"
    assert resolve(hook_name("value", 4)) == ("value", 4)
    assert tap_key("value", split=True) == "attn_v" and tap_key("attn_q", split=False) == "attn"
    extra = {"output_activations": {"blocks.1.attn.hook_v": True, "value": [2]}}
    (spec,) = parse(extra).captures
    assert (spec.signal, spec.layers) == ("value", (1, 2))
    assert FACTS.row_shape("value") == (FACTS.n_kv_heads, FACTS.head_dim)
    with pytest.raises(LensRequestError, match="cannot be written to"):
        parse({"apply_steering_vectors": [SteeringVector(
            activations=torch.zeros(1, FACTS.hidden_size), layer_indices=[1],
            hook_point="value")]})
    outer_only = dataclasses.replace(FACTS, sites=("pre", "post", "mid"))
    with pytest.raises(UnsupportedModelError, match="plain attention kernel") as info:
        parse({"output_activations": {"value": [1]}}, outer_only)
    assert info.value.field == "output_activations.value"


def test_output_activations_merges_names_of_one_point():
    lens = parse({"output_activations": {"blocks.3.hook_attn_out": True, "attn_out": [1],
                                         "mlp_post": {"layers": [0], "reduce": "mean"}}})
    by_signal = {c.signal: c for c in lens.points}
    assert by_signal["attn_out"].layers == (1, 3)
    assert by_signal["mlp_post"].reduce == "mean" and lens.capture is None
    assert LensRequest.from_payload(lens.to_payload()).points == lens.points


def test_output_activations_as_json_string_and_conflicts():
    lens = parse({"output_activations": '{"resid_mid": "true"}'})
    assert lens.points[0].layers == (0, 1, 2, 3)
    with pytest.raises(LensRequestError) as info:
        parse({"output_activations": {"attn_out": [1], "hook_attn_out": {
            "layers": [2], "positions": "prompt"}}})
    assert info.value.field == "output_activations.hook_attn_out"
    with pytest.raises(LensRequestError, match="unknown field"):
        parse({"output_activations": {"attn_out": {"layers": [1], "layer": 2}}})


def test_output_qk_is_q_and_k_at_every_position():
    lens = parse({"output_qk": [2, 0]})
    assert [(c.signal, c.layers, c.positions) for c in lens.points] == [
        ("attn_q", (0, 2), "all"), ("attn_k", (0, 2), "all")]
    assert lens.qk_layers == (0, 2) and all(c.wants_prompt_rows() for c in lens.points)
    assert parse({"output_qk": "true"}).qk_layers == (0, 1, 2, 3)
    assert parse({"output_qk": False}) is None
    assert parse({"output_activations": False}) is None
    half_blind = dataclasses.replace(FACTS, qk_meta=({"scale": 0.5}, {}, {}, {}))
    with pytest.raises(UnsupportedModelError, match="layers \\[1, 2\\]"):
        parse({"output_qk": [0, 1, 2]}, half_blind)


def test_points_the_model_lacks_are_refused_by_name():
    outer_only = dataclasses.replace(FACTS, sites=("pre", "post"))
    with pytest.raises(UnsupportedModelError) as info:
        parse({"output_activations": {"attn_out": [1]}}, outer_only)
    assert info.value.field == "output_activations.attn_out" and "LlamaForCausalLM" in str(
        info.value)
    with pytest.raises(UnsupportedModelError):
        parse({"output_qk": True}, outer_only)
    assert parse({"output_activations": {"resid_pre": [1]}}, outer_only) is not None


def test_qk_hooks_are_refused_under_tensor_parallelism_but_captures_are_not():
    from vllm_lens import NamedHook

    tp2 = dataclasses.replace(FACTS, tp_size=2)
    for extra in ({"output_qk": [1]}, {"output_activations": {"attn_z": [1]}},
                  {"output_activations": {"mlp_post": [1]}}):
        assert parse(extra, tp2) is not None  # each rank captures its part
    hook = NamedHook("attention_to_span", [1], {"span": [0, 2]}, hook_point="attn_qk")
    assert parse({"apply_hooks": [hook]}).hooks[0].point == "attn_qk"
    with pytest.raises(UnsupportedConfigError, match="tensor_parallel_size=2") as info:
        parse({"apply_hooks": [hook]}, tp2)
    assert info.value.field == "apply_hooks[0].hook_point"


def test_admission_counts_every_signal_at_its_width(monkeypatch):
    lens = parse({"output_activations": {"mlp_post": [0, 1]}, "output_qk": [0]})
    facts = dataclasses.replace(FACTS, max_model_len=1024)
    monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_BYTES", str(100 * 4 * (2 * 32 + 8 + 4)))
    check_capture_size(lens.captures, facts, 90, 10, 1)  # 100 rows fit exactly
    with pytest.raises(LensRequestError) as info:
        check_capture_size(lens.captures, facts, 91, 10, 1)
    assert info.value.field == "output_activations.mlp_post" and "2 signals" not in str(
        info.value) and "3 signals together" in str(info.value)


def _naive(q, k, scale, q_start, window=(-1, -1), cap=0.0, slopes=None, sinks=None):
    """Attention weights one query, one head at a time."""
    q_len, n_heads, _ = q.shape
    kv_len, n_kv, _ = k.shape
    out = torch.zeros(n_heads, q_len, kv_len, dtype=torch.float64)
    for h in range(n_heads):
        kh = h // (n_heads // n_kv)
        for i in range(q_len):
            qp = q_start + i
            logits = []
            for j in range(kv_len):
                visible = j <= qp and (window[0] < 0 or j >= qp - window[0]) and (
                    window[1] < 0 or j <= qp + window[1])
                if not visible:
                    logits.append(-math.inf)
                    continue
                s = float(q[i, h].double() @ k[j, kh].double()) * scale
                if cap:
                    s = cap * math.tanh(s / cap)
                if slopes is not None:
                    s += slopes[h] * (j - qp)
                logits.append(s)
            top = max(logits + ([sinks[h]] if sinks is not None else []))
            e = [math.exp(x - top) if x > -math.inf else 0.0 for x in logits]
            total = sum(e) + (math.exp(sinks[h] - top) if sinks is not None else 0.0)
            out[h, i] = torch.tensor(e) / total
    return out


@pytest.mark.parametrize("kwargs", [
    {}, {"window": (3, 0)}, {"cap": 2.0}, {"slopes": [0.5, 0.25, 0.125, 0.0625]},
    {"sinks": [0.3, -1.0, 2.0, 0.0]}, {"window": (2, 0), "cap": 1.5, "sinks": [1, 1, 1, 1]},
])
@pytest.mark.parametrize("q_rows", ["all", "decode"])
def test_attention_weights_match_a_naive_loop(kwargs, q_rows):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(9, 2, 8, generator=g)
    q = torch.randn(9, 4, 8, generator=g)
    q_start = 0 if q_rows == "all" else 7
    q = q[q_start:]
    got = compute_attention_weights(
        q, k, scale=0.35, q_start=q_start if q_rows == "decode" else None,
        sliding_window=kwargs.get("window", (-1, -1)), logits_soft_cap=kwargs.get("cap", 0.0),
        alibi_slopes=kwargs.get("slopes"), sinks=kwargs.get("sinks"), dtype=torch.float64)
    expected = _naive(q, k, 0.35, q_start, kwargs.get("window", (-1, -1)), kwargs.get("cap", 0.0),
                      kwargs.get("slopes"), kwargs.get("sinks"))
    torch.testing.assert_close(got, expected)


def test_attention_patterns_reads_an_output_qk_result():
    g = torch.Generator().manual_seed(1)
    acts = {"attn_q": torch.randn(2, 5, 4, 8, generator=g),
            "attn_k": torch.randn(2, 5, 2, 8, generator=g),
            "attn_q_positions": torch.arange(5), "qk_layers": [1, 3],
            "qk_meta": [{"scale": 0.5, "logits_soft_cap": 0.0, "sliding_window": [-1, -1],
                         "alibi_slopes": None, "sinks": None}] * 2}
    pattern = attention_patterns(acts, 3)
    expected = _naive(acts["attn_q"][1], acts["attn_k"][1], 0.5, 0)
    torch.testing.assert_close(pattern.double(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(KeyError, match="captured: \\[1, 3\\]"):
        attention_patterns(acts, 2)


def _part(signal, layers, rank, tensor, positions=(0, 1, 2)):
    return ({"signal": signal, "layers": list(layers), "tp_rank": rank,
             "positions": torch.tensor(positions)}, tensor)


def test_tensor_parallel_parts_join_in_rank_order():
    from vllm_lens.frontend.merge import merge_rank_payloads

    q = torch.randn(2, 3, 8, 4)  # [layers, positions, heads, dim]: 2 heads per rank of 4
    parts = [_part("attn_q", (0, 1), r, q[:, :, 2 * r : 2 * r + 2]) for r in (2, 0, 3, 1)]
    joined, positions = merge_rank_payloads(parts, n_kv_heads=2)
    assert torch.equal(joined, q) and positions.tolist() == [0, 1, 2]
    mlp = torch.randn(2, 3, 16)
    parts = [_part("mlp_post", (0, 1), r, mlp[..., 8 * r : 8 * r + 8]) for r in (1, 0)]
    assert torch.equal(merge_rank_payloads(parts)[0], mlp)


def test_replicated_key_heads_are_kept_once():
    from vllm_lens.frontend.merge import merge_rank_payloads

    k = torch.randn(1, 3, 2, 4)  # 2 key heads, tp=4: ranks 0,1 hold head 0, ranks 2,3 head 1
    parts = [_part("attn_k", (5,), r, k[:, :, r // 2 : r // 2 + 1]) for r in range(4)]
    assert torch.equal(merge_rank_payloads(parts, n_kv_heads=2)[0], k)
    # pipeline stages and ranks together: layers in order, heads joined within each stage
    parts = [_part("attn_k", (0,), r, k[:, :, r // 2 : r // 2 + 1] + 1) for r in range(4)]
    joined, _ = merge_rank_payloads(parts + [_part("attn_k", (5,), r, k[:, :, r // 2 :
                                                   r // 2 + 1]) for r in range(4)], 2)
    assert torch.equal(joined, torch.cat([k + 1, k]))
    with pytest.raises(ValueError, match="different positions"):
        merge_rank_payloads([_part("attn_q", (0,), 0, k), _part("attn_q", (0,), 1, k, (0, 1, 3))])
    v = torch.randn(1, 3, 2, 4)  # values: one per key/value head, replicated like keys
    parts = [_part("value", (5,), r, v[:, :, r // 2 : r // 2 + 1]) for r in range(4)]
    assert torch.equal(merge_rank_payloads(parts, n_kv_heads=2)[0], v)
    parts = [_part("value", (5,), r, v[:, :, r : r + 1]) for r in range(2)]  # one head a rank
    assert torch.equal(merge_rank_payloads(parts, n_kv_heads=2)[0], v)


def test_attention_metadata_joins_per_head_values_once_per_rank():
    from vllm_lens.common.messages import AttentionMeta, DescribeAnswer
    from vllm_lens.spec.facts import facts_from_describe

    def rank(r, pp_rank=0):
        return msgspec.structs.replace(
            DescribeAnswer.refused(""), unsupported=None, model_class="LlamaForCausalLM",
            n_layers=1, hidden_size=8, max_model_len=64, mapped=True, dtype="float32",
            tp_rank=r, pp_rank=pp_rank, tp_size=2, sites=["pre", "attn", "post"],
            num_heads_total=4, num_kv_heads_total=2, qk_meta=[AttentionMeta(
                layer=0, scale=0.5, logits_soft_cap=0.0, sliding_window=[-1, -1],
                alibi_slopes=None, sinks=[float(r), float(r) + 0.5], num_heads=2,
                num_kv_heads=1, head_size=4, layer_name="")])

    facts = facts_from_describe([rank(1), rank(0), rank(0), rank(1)])  # 2 DP engines
    meta = facts.qk_meta[0]
    assert meta["sinks"] == [0.0, 0.5, 1.0, 1.5]
    assert (meta["num_heads"], meta["num_kv_heads"]) == (4, 2)
    assert (facts.n_heads, facts.n_kv_heads, facts.head_dim, facts.tp_size) == (4, 2, 4, 2)
    assert facts.pp_size == 1 and facts.dp_size == 2
    assert facts_from_describe([rank(0), rank(1)]).dp_size == 1
    staged = facts_from_describe([rank(0, pp_rank=0), rank(0, pp_rank=1)])
    assert staged.pp_size == 2 and staged.dp_size == 1


def test_the_final_norm_site_is_the_last_stages():
    from vllm_lens.common.messages import DescribeAnswer
    from vllm_lens.spec.facts import facts_from_describe

    def stage(pp_rank, layers, sites):
        return msgspec.structs.replace(
            DescribeAnswer.refused(""), unsupported=None, model_class="LlamaForCausalLM",
            n_layers=4, local_layers=layers, hidden_size=8, max_model_len=64, mapped=True,
            dtype="float32", pp_rank=pp_rank, sites=sites)

    first, last = stage(0, [0, 1], ["pre", "post"]), stage(1, [2, 3], ["pre", "post", "final"])
    assert facts_from_describe([first, last]).sites == ("pre", "post", "final")
    assert facts_from_describe([first, stage(1, [2, 3], ["pre", "post"])]).sites == (
        "pre", "post")


def test_pipeline_parallel_is_refused_on_families_it_is_not_proven_on():
    staged = dataclasses.replace(SPLIT, pp_size=2)
    with pytest.raises(UnsupportedConfigError, match="pipeline_parallel_size=2.*GPT2LMHeadModel"):
        parse({"output_residual_stream": [0]}, staged)
    assert parse({"output_residual_stream": [0]}, dataclasses.replace(FACTS, pp_size=2))


SPLIT = dataclasses.replace(FACTS, model_class="GPT2LMHeadModel", split=True,
                            sites=("pre", "attn", "attn_block", "mid", "act", "mlp_block",
                                   "post"))
PARALLEL = dataclasses.replace(SPLIT, model_class="TransformersForCausalLM:GPTNeoXForCausalLM",
                               block="parallel",
                               sites=("pre", "attn", "attn_block", "act", "mlp_block", "post"))
MOE = dataclasses.replace(FACTS, model_class="MixtralForCausalLM", n_experts=4, moe_top_k=2,
                          sites=("pre", "attn", "mid", "router", "post"))


def test_split_layouts_read_attn_out_and_mlp_out_at_the_sublayers():
    from vllm_lens.common.points import site_of

    assert [site_of(p, split=False) for p in ("attn_out", "mlp_out", "resid_mid")] == [
        "mid", "post", "mid"]
    assert [site_of(p, split=True) for p in ("attn_out", "mlp_out", "resid_mid")] == [
        "attn_block", "mlp_block", "mid"]
    specs = parse({"output_activations": {"attn_out": [1], "mlp_out": [2]}}, SPLIT).captures
    assert [s.signal for s in specs] == ["attn_out", "mlp_out"]


def test_a_parallel_block_has_no_resid_mid():
    with pytest.raises(UnsupportedModelError, match="in parallel.*no resid_mid"):
        parse({"output_activations": {"resid_mid": [1]}}, PARALLEL)
    with pytest.raises(UnsupportedModelError, match="no resid_mid"):
        parse({"apply_steering_vectors": [SteeringVector(
            activations=torch.zeros(1, 8), layer_indices=[1], hook_point="post_attn")]},
            PARALLEL)
    assert parse({"output_activations": {"attn_out": [1]}}, PARALLEL).captures


def test_router_logits_only_where_there_is_a_router():
    (spec,) = parse({"output_activations": {"router_logits": True}}, MOE).captures
    assert spec.layers == (0, 1, 2, 3) and MOE.row_shape("router_logits") == (4,)
    with pytest.raises(UnsupportedModelError, match="router_logits is not available"):
        parse({"output_activations": {"router_logits": [0]}})
    with pytest.raises(LensRequestError, match="cannot be written"):
        parse({"apply_steering_vectors": [SteeringVector(
            activations=torch.zeros(1, 8), layer_indices=[1], hook_point="router_logits")]},
            MOE)


def test_chosen_experts_are_the_top_k_logits():
    from vllm_lens.frontend.collator import chosen_experts

    logits = torch.tensor([[[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.2, 0.1]]])
    assert chosen_experts(logits, 2).tolist() == [[[1, 3], [0, 2]]]
    assert chosen_experts(logits, 0).shape == (1, 2, 0)


def test_layouts_are_keyed_by_class_and_gated_by_config():
    from types import SimpleNamespace

    from vllm_lens.worker.layouts import layout_of, model_key

    TransformersForCausalLM = type("TransformersForCausalLM", (), {})  # noqa: N806
    neox = TransformersForCausalLM()
    neox.config = SimpleNamespace(architectures=["GPTNeoXForCausalLM"],
                                  use_parallel_residual=True)
    assert model_key(neox) == "TransformersForCausalLM:GPTNeoXForCausalLM"
    assert layout_of(neox).block == "parallel"
    neox.config.use_parallel_residual = False  # sequential GPT-NeoX: not this layout
    assert layout_of(neox) is None
    assert layout_of(type("GPTJForCausalLM", (), {})()) is None
