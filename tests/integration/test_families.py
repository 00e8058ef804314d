"""Every model family in ``worker.layouts``, each a tiny random model (``tests/families.py``),
against transformers: the residual stream at every layer, every tap point the family has, Q/K
attention patterns, 2D and 3D steering, hooks that replace and read, and plain requests
token-identical to vLLM without the plugin; the multimodal family also with an image in the
prompt. One engine per family, prefill in chunks of 16 tokens; the families in ``COMPILED``
run in vLLM's default compiled mode (Dynamo traces the taps, and for GPT-NeoX and OLMo 2 the
Transformers backend's own modules), the rest eager.

``tools/family_matrix.py`` turns this module's results into the compatibility matrix.

Marked ``families``: the second step of ``make test`` (``pytest -m families``); a plain
``pytest`` (whose default options hold ``-m 'not families'``) leaves these out, also when
named by path."""

import pytest
import torch
from vllm import SamplingParams

from tests.families import FAMILIES, tiny_family_dir
from tests.integration.engines import generate_without_plugin, running_llm
from tests.integration.reference import HFReference, _steering_delta, max_relative_error
from vllm_lens import Hook, SteeringVector, UnsupportedModelError
from vllm_lens.attention import attention_patterns

PROMPT = ("Once upon a time in a quiet village by the sea, an old fisherman mended his nets "
          "and told the children stories about the storms he had seen.")
POINTS = ["resid_pre", "attn_in", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post",
          "mlp_post", "attn_z", "value", "attn_out_pre_norm", "mlp_out_pre_norm",
          "q_pre_norm", "q_normed", "k_pre_norm", "k_normed"]
#: MoE layers have no single MLP activation; they have a router.
MOE = {"mixtral", "qwen2_moe"}


#: Multimodal models (tested with text prompts and with an image).
MULTIMODAL = {"idefics3"}
#: Parallel blocks (attention and MLP both read resid_pre) have no resid_mid (nor mlp_in).
PARALLEL = {"gpt_neox"}
#: Post-norm layers: attention reads resid_pre and the MLP resid_mid themselves, so no
#: attn_in or mlp_in is offered.
POST_NORM = {"olmo2", "olmo3"}
#: Layers with a norm after each sublayer (sandwich or post-norm): the blocks' own outputs
#: before it are points of their own; elsewhere they would be attn_out and mlp_out.
AFTER_NORMS = {"gemma2", "gemma3", "olmo2", "olmo3"}
_PRE_NORM = ("attn_out_pre_norm", "mlp_out_pre_norm")
#: Families with norms of Q and K (per head; OLMo 2/3's span every head at once, so they are
#: not tapped under tensor parallelism).
QK_NORMS = {"qwen3", "gemma3", "olmo2", "olmo3"}
FULL_WIDTH_QK_NORMS = {"olmo2", "olmo3"}
_QK_NORM = ("q_pre_norm", "q_normed", "k_pre_norm", "k_normed")


def points_of(family: str, tp: int = 1) -> list[str]:
    points = POINTS if family in AFTER_NORMS else [p for p in POINTS if p not in _PRE_NORM]
    if family not in QK_NORMS or (tp > 1 and family in FULL_WIDTH_QK_NORMS):
        points = [p for p in points if p not in _QK_NORM]
    if family in MOE:
        return [p for p in points if p != "mlp_post"] + ["router_logits"]
    if family in PARALLEL:
        return [p for p in points if p not in ("resid_mid", "mlp_in")]
    if family in POST_NORM:
        return [p for p in points if p not in ("attn_in", "mlp_in")]
    return points
CHUNKED = dict(max_num_batched_tokens=16, max_num_seqs=8)
#: Families run in vLLM's default compiled mode; the rest with ``enforce_eager``.
COMPILED = {"gpt2", "gpt_neox", "olmo2", "gemma2", "gemma3", "mixtral", "qwen2_moe"}
TOL = 1e-4

pytestmark = [pytest.mark.slow, pytest.mark.families]  # two engines per family


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    path = tiny_family_dir(request.param)
    with running_llm(path, **_mode(request.param)) as llm:
        yield request.param, path, llm, HFReference(path)


def _mode(family: str) -> dict:
    return CHUNKED if family in COMPILED else {**CHUNKED, "enforce_eager": True}


def _ids(out):
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def _tp(llm) -> int:
    return llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size


def test_every_layer_every_point_and_attention_match_transformers(family):
    name, path, llm, ref = family
    points = points_of(name, _tp(llm))
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "output_residual_stream": True,
        "output_activations": {**{p: [1, 3] for p in points}, "final_norm": True},
        "output_qk": [0, 3]})
    out = llm.generate([PROMPT], sp)[0]
    assert out.lens_error is None
    ids = _ids(out)
    n_rows = len(ids) - 1
    expected = ref.points(ids[:n_rows], attentions=True)
    acts = out.activations
    for layer in range(4):
        assert max_relative_error(acts["residual_stream"][layer],
                                  expected[("resid_post", layer)]) <= TOL, (name, layer)
    for point in points:
        for i, layer in enumerate((1, 3)):
            err = max_relative_error(acts[point][i].flatten(1),
                                     expected[(point, layer)].flatten(1))
            assert err <= TOL, (name, point, layer, err)
    assert acts["final_norm"].shape[0] == 1  # once, after the last layer
    err = max_relative_error(acts["final_norm"][0], expected[("final_norm", 3)])
    assert err <= TOL, (name, "final_norm", err)
    for layer in (0, 3):
        pattern = attention_patterns(acts, layer)
        assert (pattern - expected[("attn", layer)]).abs().max() < 1e-5, (name, layer)
    if name in MULTIMODAL:
        _check_image_prompt(path, llm, ref)
    if name in MOE:  # the experts each token was routed to, from the captured logits
        for i, layer in enumerate((1, 3)):
            chosen = acts["router_experts"][i].sort(dim=-1).values
            assert torch.equal(chosen, expected[("router_experts", layer)].sort(dim=-1).values)


def test_2d_and_3d_steering_match_transformers(family):
    name, _, llm, ref = family
    n_prompt = len(llm.get_tokenizer()(PROMPT)["input_ids"])
    g = torch.Generator().manual_seed(3)
    flat = SteeringVector(activations=torch.randn(1, 128, generator=g), layer_indices=[1],
                          scale=2.0, hook_point="attn_out")
    placed = SteeringVector(activations=torch.randn(1, 3, 128, generator=g) * 3,
                            layer_indices=[2], position_indices=[2, 20, n_prompt + 1])
    vectors = [flat, placed]
    edits = {("attn_out", 1): lambda h: h + _steering_delta(flat, 0, h),
             ("resid_post", 2): lambda h: h + _steering_delta(placed, 0, h)}
    if "attn_in" in points_of(name):  # what attention reads, at layer 3
        into_attn = SteeringVector(activations=torch.randn(1, 128, generator=g),
                                   layer_indices=[3], scale=1.5, hook_point="attn_in")
        vectors.append(into_attn)
        edits[("attn_in", 3)] = lambda h: h + _steering_delta(into_attn, 0, h)
    if "mlp_in" in points_of(name):  # what the MLP reads, at layer 0
        into_mlp = SteeringVector(activations=torch.randn(1, 128, generator=g),
                                  layer_indices=[0], scale=1.5, hook_point="mlp_in")
        vectors.append(into_mlp)
        edits[("mlp_in", 0)] = lambda h: h + _steering_delta(into_mlp, 0, h)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={
        "apply_steering_vectors": vectors, "output_residual_stream": [3]})
    out = llm.generate([PROMPT], sp)[0]
    assert list(out.outputs[0].token_ids) == ref.point_greedy(
        list(out.prompt_token_ids), 6, edits), name
    expected = ref.points(_ids(out)[:-1], edits)
    assert max_relative_error(out.activations["residual_stream"][0],
                              expected[("resid_post", 3)]) <= TOL, name


def test_hooks_replace_and_read_as_transformers(family):
    name, _, llm, ref = family
    read_point = "resid_pre" if name in PARALLEL else "resid_mid"

    def halve(ctx, mlp_out):
        return 0.5 * mlp_out

    def record(ctx, stream):
        ctx.saved.setdefault("rows", []).append(stream.clone())

    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
        "apply_hooks": [Hook(halve, [1], hook_point="mlp_out"),
                        Hook(record, [2], hook_point=read_point)],
        "output_residual_stream": [3]})
    out = llm.generate([PROMPT], sp)[0]
    assert out.lens_error is None
    edits = {("mlp_out", 1): lambda h: 0.5 * h}
    assert list(out.outputs[0].token_ids) == ref.point_greedy(
        list(out.prompt_token_ids), 4, edits), name
    expected = ref.points(_ids(out)[:-1], edits)
    rows = torch.cat(out.hook_results["1"]["rows"])
    assert max_relative_error(rows, expected[(read_point, 2)]) <= TOL, name
    assert max_relative_error(out.activations["residual_stream"][0],
                              expected[("resid_post", 3)]) <= TOL, name


def _check_image_prompt(path, llm, ref):
    """An image in the prompt: the language model's rows at the image tokens too."""
    from PIL import Image
    from transformers import AutoProcessor

    image = Image.new("RGB", (32, 32), (200, 40, 90))
    text = "<image>What is in the picture?"
    inputs = AutoProcessor.from_pretrained(path)(text=text, images=[image], return_tensors="pt")
    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={
        "output_residual_stream": True, "output_activations": {"attn_out": [1]}})
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], sp)[0]
    assert out.lens_error is None
    ids = inputs["input_ids"][0].tolist()
    assert list(out.prompt_token_ids) == ids  # the image tokens are in the prompt
    with torch.no_grad(), ref.point_hooks() as seen:
        ref.model(**inputs)
    acts = out.activations
    for layer in range(4):
        assert max_relative_error(acts["residual_stream"][layer],
                                  seen[("resid_post", layer)]) <= TOL, layer
    assert max_relative_error(acts["attn_out"][0], seen[("attn_out", 1)]) <= TOL


def test_points_a_family_lacks_are_refused_by_name(family):
    name, _, llm, _ = family
    lacking = [p for p in POINTS + ["router_logits"] if p not in points_of(name)]
    for point in lacking:
        sp = SamplingParams(max_tokens=1, extra_args={"output_activations": {point: [0]}})
        with pytest.raises(UnsupportedModelError, match=point):
            llm.generate([PROMPT], sp)


def test_plain_requests_are_token_identical_to_vllm_without_plugin(family):
    name, path, llm, _ = family
    prompts = [PROMPT, "The capital of France is", "1, 2, 3, 4,"]
    sps = [SamplingParams(max_tokens=8, temperature=0,
                          extra_args={"output_activations": {"attn_out": [2]}} if i == 1
                          else None) for i in range(len(prompts))]
    with_plugin = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sps)]
    assert with_plugin == generate_without_plugin(path, prompts, 8, **_mode(name)), name


def test_ablation_and_cap_match_transformers(family):
    """``mode="ablate"`` at resid_pre, attn_out and mlp_out of every layer (the refusal
    recipe) and a one-sided ``cap`` at layer 2's stream, together, equal transformers with
    hooks doing the same edits; the ablated direction is gone from the stream leaving every
    layer but the capped one."""
    from tests.integration.test_steering_projections import _projecting
    from vllm_lens.steering import ABLATION_POINTS

    name, _, llm, ref = family
    ids = list(llm.get_tokenizer()(PROMPT)["input_ids"])
    stream = ref.points(ids)[("resid_post", 1)]
    r = stream[1:].mean(dim=0)  # a direction the model uses (the first position left out)
    g = torch.Generator().manual_seed(11)
    d = torch.randn(128, generator=g)
    upper = float((stream @ (d / d.norm())).median())
    vectors = [*SteeringVector.ablation(r),
               SteeringVector(activations=d[None], layer_indices=[2], mode="cap",
                              cap=(None, upper))]
    out = llm.generate([PROMPT], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True,
        extra_args={"apply_steering_vectors": vectors, "output_residual_stream": True}))[0]
    assert out.lens_error is None
    edits = {(point, layer): _projecting(r) for point in ABLATION_POINTS for layer in range(4)}
    ablate_post2 = edits.get(("resid_post", 2))
    cap = _projecting(d, -float("inf"), upper)
    edits[("resid_post", 2)] = cap if ablate_post2 is None else (
        lambda h: cap(ablate_post2(h)))
    assert list(out.outputs[0].token_ids) == ref.point_greedy(ids, 8, edits), name
    got = out.activations["residual_stream"][[0, 1, 3]].float()  # (layer 2's cap adds some)
    unit = (r / r.norm()).float()
    assert float(((got @ unit).abs() / got.norm(dim=-1)).max()) < 1e-4, name


def test_attention_steering_matches_transformers(family):
    """``steer_attention``: PASTA on one head of two (they share one key head) at layers 1
    and 2, and a bias lowering two keys in every head at layer 3, equal transformers' eager
    attention doing the same edit (Gemma 2's soft cap and both Gemmas' 16-token windows
    included); the stream leaving layer 3 too."""
    name, _, llm, ref = family
    edits = [{"layers": [1, 2], "heads": [1], "emphasize": [3, 12], "alpha": 0.02},
             {"layers": [3], "heads": None, "key_positions": [0, 5], "bias": -3.0}]
    out = llm.generate([PROMPT], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True,
        extra_args={"steer_attention": edits, "output_residual_stream": [3]}))[0]
    assert out.lens_error is None
    assert list(out.outputs[0].token_ids) == ref.attention_greedy(
        list(out.prompt_token_ids), 8, edits), name
    with ref.attention_edits(edits):
        expected = ref.residual_stream(_ids(out)[:-1], [3])
    assert max_relative_error(out.activations["residual_stream"][0], expected[0]) <= TOL, name
    plain = ref.residual_stream(_ids(out)[:-1], [3])
    assert max_relative_error(expected[0], plain[0]) > 1e-3, name  # the edits matter


def test_a_stop_monitor_stops_where_the_transformers_scores_cross(family):
    """A probe monitor at layer 2 (``monitors``): the ``flag`` run's scores are
    ``h · probe`` of transformers' rows, and the ``stop`` run ends right after the first
    position where those cross the threshold, a plain request beside them untouched."""
    name, _, llm, ref = family
    plain_sp = SamplingParams(max_tokens=8, temperature=0)
    ids = _ids(llm.generate([PROMPT], plain_sp)[0])
    n_prompt = len(ids) - 8
    rows = ref.points(ids[:-1])[("resid_post", 2)].float().flatten(1)
    target = n_prompt + 3  # a probe from the earlier rows' mean to this row: a new high here
    probe = rows[target] - rows[:target].mean(0)
    probe = probe / probe.norm()
    scores = rows @ probe
    before = float(scores[:target].max())
    assert float(scores[target]) > before, name
    first = int((scores > (before + float(scores[target])) / 2).nonzero()[0, 0])
    monitor = {"name": "probe", "probe": probe.tolist(), "layer": 2,
               "threshold": (before + float(scores[target])) / 2}
    stop, beside, flag = llm.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=8, temperature=0,
                       extra_args={"monitors": [{**monitor, "action": "stop"}]}),
        plain_sp,
        SamplingParams(max_tokens=8, temperature=0,
                       extra_args={"monitors": [{**monitor, "action": "flag"}]})])
    eos = llm.get_tokenizer().eos_token_id
    assert list(stop.outputs[0].token_ids) == [*ids[n_prompt:first + 1], eos], name
    assert stop.outputs[0].stop_reason == "probe" and stop.monitors[0]["position"] == first
    assert _ids(beside) == ids and _ids(flag) == ids, name
    got = flag.monitors[0]["scores"]
    assert bool(((got - scores).abs() <= 1e-4 * rows.norm(dim=-1) + 1e-6).all()), name
