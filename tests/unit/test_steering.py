"""SteeringVector validation and serialization, steering specs, and the worker's steering math."""

import dataclasses
import json

import pytest
import torch

from vllm_lens import LensRequestError, SteeringVector, WireError
from vllm_lens.spec import CaptureSpec, LensRequest, ModelFacts, parse_extra_args
from vllm_lens.worker.plan import RequestSlice
from vllm_lens.worker.steer import apply_steering, build_steer_groups, prepare

H = 8
FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=H, max_model_len=64,
                   mapped=True)


def sv(**kw):
    base = dict(activations=torch.randn(1, H), layer_indices=[2])
    return SteeringVector(**{**base, **kw})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_wire_and_json_round_trips(dtype):
    v = sv(activations=torch.randn(2, 3, H).to(dtype), layer_indices=[0, 3], scale=2.5,
           norm_match=True, position_indices=[4, 1, 9])
    for back in (SteeringVector.from_wire(v.to_wire()),
                 SteeringVector.model_validate(json.loads(json.dumps(v.model_dump(mode="json"))))):
        assert back.activations.dtype == dtype
        assert torch.equal(back.activations, v.activations)
        assert back.model_dump(exclude={"activations"}) == v.model_dump(exclude={"activations"})


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(activations=torch.randn(2, H)), "len\\(layer_indices\\)"),
        (dict(activations=torch.randn(H)), "2D"),
        (dict(activations=torch.ones(1, H, dtype=torch.int64)), "float32"),
        (dict(activations=torch.full((1, H), float("nan"))), "NaN"),
        (dict(activations=torch.full((1, H), float("inf"))), "NaN or inf"),
        (dict(activations=torch.randn(1, 2, H), position_indices=[0]), "position_indices"),
        (dict(activations=torch.randn(1, 2, H), position_indices=[0, -1]), "non-negative"),
        (dict(position_indices=[0]), "3D"),
        (dict(activations=torch.zeros(1, H), norm_match=True), "non-zero"),
    ],
)
def test_invalid_vectors_are_rejected(kwargs, words):
    with pytest.raises(ValueError, match=words):
        sv(**kwargs)


def test_undecodable_wire_string():
    with pytest.raises(WireError):
        SteeringVector.from_wire("not base64 !!")
    with pytest.raises(WireError):
        SteeringVector.from_wire("aGVsbG8=")  # base64 of "hello": not zstd


def parse(value):
    return parse_extra_args({"apply_steering_vectors": value}, lambda: FACTS)[1]


def test_every_accepted_form_gives_the_same_spec():
    v = sv(scale=3.0)
    forms = [[v], v, [v.model_dump()], [v.to_wire()], v.to_wire(),
             json.dumps([v.model_dump(mode="json")])]
    specs = [parse(form).steer for form in forms]
    assert all(s == specs[0] for s in specs)
    assert specs[0][0].layers == (2,) and specs[0][0].scale == 3.0


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ([sv(activations=torch.randn(1, H + 1))], "apply_steering_vectors[0].activations",
         "hidden size"),
        ([sv(layer_indices=[4])], "apply_steering_vectors[0].layer_indices[0]", "out of range"),
        ([sv(activations=torch.randn(1, 1, H), position_indices=[64])],
         "apply_steering_vectors[0].position_indices[0]", "outside"),
        ([{"activations": torch.ones(1, H, dtype=torch.int32), "layer_indices": [0]}],
         "apply_steering_vectors[0]", "float32"),
        (["@@@"], "apply_steering_vectors[0]", "base64"),
        ("[{", "apply_steering_vectors", "JSON"),
        ([], "apply_steering_vectors", "non-empty"),
        ([3], "apply_steering_vectors[0]", "got int"),
    ],
)
def test_bad_steering_names_the_field(value, field, words):
    with pytest.raises(LensRequestError, match=words) as info:
        parse(value)
    assert info.value.field == field


def test_cache_salt_depends_on_the_steering_only():
    v = sv()
    a, b = parse([v]), parse([v])
    assert a.key != b.key and a.cache_salt == b.cache_salt
    assert parse([sv(activations=v.activations, scale=2.0)]).cache_salt != a.cache_salt
    assert LensRequest(key="k", capture=CaptureSpec(layers=(0,))).cache_salt is None
    assert LensRequest.from_payload(a.to_payload()) == a


def _slice(lens, start, end, pos0, n_prompt=4):
    return RequestSlice(req_id="r", lens=lens, start=start, end=end, pos0=pos0, n_prompt=n_prompt)


def test_2d_and_3d_steering_land_on_the_right_rows():
    vec2 = torch.randn(1, H)
    vec3 = torch.randn(1, 3, H)
    a = parse([sv(activations=vec2, scale=2.0)])
    b = parse([sv(activations=vec3, position_indices=[7, 2, 5])])
    cpu = torch.device("cpu")
    steered = [
        (_slice(a, 0, 3, 0), [prepare(s, cpu, torch.float32) for s in a.steer]),
        # rows 3..6 of the batch hold positions 4..7 of request b
        (_slice(b, 3, 7, 4), [prepare(s, cpu, torch.float32) for s in b.steer]),
    ]
    groups = build_steer_groups(steered, cpu, split=False)
    hidden = torch.zeros(8, H)
    apply_steering(groups[(2, "post")], hidden, None)
    expected = torch.zeros(8, H)
    expected[0:3] += 2.0 * vec2[0]
    expected[3 + (5 - 4)] += vec3[0, 2]  # position 5 -> vector row 2
    expected[3 + (7 - 4)] += vec3[0, 0]  # position 7 -> vector row 0; position 2 not in slice
    torch.testing.assert_close(hidden, expected)


def test_norm_match_scales_with_the_full_stream():
    v = torch.tensor([[3.0, 4.0] + [0.0] * (H - 2)])
    lens = parse([sv(activations=v, norm_match=True, scale=0.5)])
    cpu = torch.device("cpu")
    groups = build_steer_groups(
        [(_slice(lens, 0, 2, 0), [prepare(s, cpu, torch.float32) for s in lens.steer])], cpu, split=False)
    hidden = torch.randn(2, H)
    residual = torch.randn(2, H)
    before = hidden + residual
    out = hidden.clone()
    apply_steering(groups[(2, "post")], out, residual)
    expected = hidden + 0.5 * before.norm(dim=-1, keepdim=True) * v / 5.0
    torch.testing.assert_close(out, expected)


def test_positions_beyond_the_slice_are_skipped():
    lens = parse([sv(activations=torch.randn(1, 2, H), position_indices=[10, 11])])
    cpu = torch.device("cpu")
    groups = build_steer_groups(
        [(_slice(lens, 0, 4, 0), [prepare(s, cpu, torch.float32) for s in lens.steer])], cpu, split=False)
    assert groups == {}


def test_duplicate_layer_indices_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"layer_indices \[3, 3\] has duplicates; sum the rows"):
        SteeringVector(activations=torch.ones(2, 8), layer_indices=[3, 3])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(mode="replace", scale=2.0), "scale must be 1.0"),
        (dict(mode="replace", norm_match=True), "norm_match False"),
        (dict(mode="swap"), "mode"),
        (dict(phase="prompt"), "phase"),
        (dict(activations=torch.randn(2, H), layer_indices=[-1, 3]), "addressed alone"),
        (dict(layer_indices=[-1], hook_point="attn_out"), "addressed alone"),
        (dict(hook_point="embed"), "addressed alone"),
    ],
)
def test_invalid_modes_phases_and_embeddings_are_rejected(kwargs, words):
    with pytest.raises(ValueError, match=words):
        sv(**kwargs)


def test_embeddings_are_the_stream_entering_layer_0():
    for form in (dict(layer_indices=[-1]), dict(layer_indices=[-1], hook_point="embed")):
        (spec,) = parse([sv(mode="replace", **form)]).steer
        assert (spec.layers, spec.point, spec.mode) == ((0,), "resid_pre", "replace")


def test_overlapping_replacements_are_refused():
    one = sv(activations=torch.randn(1, 2, H), position_indices=[3, 5], mode="replace")
    with pytest.raises(LensRequestError, match="rows of layer 2 at the post site") as info:
        parse([one, sv(mode="replace")])
    assert info.value.field == "apply_steering_vectors[1]"
    # apart: other positions, another phase, another site, or an addition
    parse([one, sv(activations=torch.randn(1, 1, H), position_indices=[4], mode="replace")])
    parse([sv(mode="replace", phase="prefill"), sv(mode="replace", phase="decode")])
    parse([one, sv(mode="replace", hook_point="resid_pre"), sv()])
    # two points read at one site write one tensor: mlp_out and resid_post at "post"
    with pytest.raises(LensRequestError, match="at the post site") as info:
        parse([one, sv(activations=torch.randn(1, 1, H), position_indices=[5],
                       mode="replace", hook_point="mlp_out")])
    assert info.value.field == "apply_steering_vectors[1]"
    # a decode-only replacement of every position clashes with one at a named position
    with pytest.raises(LensRequestError, match="replaces too"):
        parse([one, sv(mode="replace", phase="decode")])


def test_many_disjoint_replacements_are_accepted_and_one_overlap_found():
    many = [sv(activations=torch.zeros(1, 1, H), position_indices=[p], mode="replace")
            for p in range(60)]
    assert len(parse(many).steer) == 60
    with pytest.raises(LensRequestError, match=r"apply_steering_vectors\[7\] replaces too"):
        parse([*many, sv(activations=torch.zeros(1, 2, H), position_indices=[61, 7],
                         mode="replace")])


def test_misspelt_fields_are_errors_not_defaults():
    with pytest.raises(ValueError, match="phse"):
        SteeringVector.model_validate({"activations": torch.ones(1, H), "layer_indices": [1],
                                       "phse": "decode"})


def test_decode_only_steering_salts_generated_blocks_only():
    v = sv(phase="decode")
    lens = parse([v])
    assert lens.cache_salt is None and lens.decode_salt is not None
    assert lens.to_payload()["decode_salt"] == lens.decode_salt
    assert "salt" not in lens.to_payload()
    assert parse([sv(activations=v.activations, phase="decode", scale=3.0)]).decode_salt \
        != lens.decode_salt
    # Prompt-touching steering salts every block; its phases salt the generated ones apart
    # too, so a later prompt repeating this output never reuses them.
    both = parse([v, sv(phase="prefill")])
    assert both.cache_salt is not None and both.decode_salt is not None
    mixed = parse([sv(activations=v.activations), v])
    assert mixed.cache_salt == parse([sv(activations=v.activations)]).cache_salt
    assert mixed.decode_salt == lens.decode_salt
    assert parse([sv(activations=v.activations)]).decode_salt is None
    assert parse([sv(activations=v.activations)]).cache_salt != parse(
        [sv(activations=v.activations, mode="replace")]).cache_salt
    assert LensRequest.from_payload(lens.to_payload()) == lens


def test_replacement_sets_the_full_stream_before_additions():
    patch = torch.randn(1, 1, H)
    push = torch.randn(1, H)
    lens = parse([sv(activations=push), sv(activations=patch, position_indices=[5],
                                          mode="replace")])
    cpu = torch.device("cpu")
    groups = build_steer_groups(
        [(_slice(lens, 0, 4, 3), [prepare(s, cpu, torch.float32) for s in lens.steer])], cpu,
        split=False)
    hidden, residual = torch.randn(4, H), torch.randn(4, H)
    out = hidden.clone()
    apply_steering(groups[(2, "post")], out, residual)
    expected = hidden + residual + push[0]
    expected[2] = patch[0, 0] + push[0]  # position 5 is row 2
    torch.testing.assert_close(out + residual, expected)
    # a point without the residual (attn_out) is written as it is
    inner = dataclasses.replace(FACTS, sites=("pre", "mid", "post"))
    lens = parse_extra_args({"apply_steering_vectors": [sv(
        activations=patch, position_indices=[5], mode="replace", hook_point="attn_out")]},
        lambda: inner)[1]
    groups = build_steer_groups(
        [(_slice(lens, 0, 4, 3), [prepare(s, cpu, torch.float32) for s in lens.steer])], cpu,
        split=False)
    out = hidden.clone()
    apply_steering(groups[(2, "mid")], out, residual)
    torch.testing.assert_close(out[2], patch[0, 0])
    torch.testing.assert_close(out[[0, 1, 3]], hidden[[0, 1, 3]])


@pytest.mark.parametrize(("phase", "rows"), [("prefill", [0, 1]), ("decode", [2, 3]),
                                             ("all", [0, 1, 2, 3])])
def test_phases_split_the_slice_at_the_prompt_end(phase, rows):
    lens = parse([sv(activations=torch.ones(1, H), phase=phase)])
    cpu = torch.device("cpu")
    # rows 0..3 hold positions 2..5; the prompt has 4 tokens (positions 0..3)
    groups = build_steer_groups(
        [(_slice(lens, 0, 4, 2, n_prompt=4), [prepare(s, cpu, torch.float32)
                                              for s in lens.steer])], cpu, split=False)
    hidden = torch.zeros(4, H)
    apply_steering(groups[(2, "post")], hidden, None)
    assert hidden[:, 0].nonzero().flatten().tolist() == rows


def cond(**kw):
    return {"probe": torch.ones(H), "layer": 1, **kw}


@pytest.mark.parametrize(("value", "field", "words"), [
    ([sv(condition=cond(layer=3))], "apply_steering_vectors[0].condition.layer",
     "after the steering it gates"),
    ([sv(condition=cond(layer=2, point="resid_post"), hook_point="resid_pre")],
     "apply_steering_vectors[0].condition.layer", "after the steering it gates"),
    ([sv(condition=cond(probe=torch.ones(H + 1)))], "apply_steering_vectors[0].condition.probe",
     "hidden size"),
    ([sv(condition=cond(layer=9))], "apply_steering_vectors[0].condition.layer[0]",
     "out of range"),
    ([sv(condition=cond(point="nowhere"))], "apply_steering_vectors[0].condition.point",
     "unknown tap point"),
])
def test_bad_conditions_name_the_field(value, field, words):
    with pytest.raises(LensRequestError, match=words) as info:
        parse(value)
    assert info.value.field == field


def test_conditions_refused_where_not_proven_or_meaningless():
    with pytest.raises(ValueError, match="plain addition"):
        sv(condition=cond(), mode="replace")
    with pytest.raises(ValueError, match="plain addition"):
        sv(condition=cond(), norm_match=True)
    with pytest.raises(ValueError, match="extra"):
        sv(condition=cond(treshold=1.0))  # a misspelt field is an error, not a default
    staged = dataclasses.replace(FACTS, pp_size=2)
    with pytest.raises(LensRequestError, match="pipeline") as info:
        parse_extra_args({"apply_steering_vectors": [sv(condition=cond())]}, lambda: staged)
    assert info.value.field == "apply_steering_vectors[0].condition"


def test_gated_requests_touching_the_prompt_are_never_shared():
    a, b = parse([sv(condition=cond())]), parse([sv(condition=cond())])
    assert a.cache_salt != b.cache_salt  # every steered position computes its gate
    d = parse([sv(condition=cond(), phase="decode")])
    assert d.cache_salt is None and d.decode_salt is not None
    assert LensRequest.from_payload(a.to_payload()) == a


def test_gate_scales_each_row_and_is_read_before_steering_at_its_site():
    probe = torch.zeros(H)
    probe[0] = 1.0
    vector = torch.ones(1, H)
    lens = parse([sv(activations=vector, scale=2.0,
                     condition=cond(probe=probe, layer=2, threshold=1.0, sharpness=3.0))])
    cpu = torch.device("cpu")
    groups = build_steer_groups(
        [(_slice(lens, 0, 3, 0), [prepare(s, cpu, torch.float32) for s in lens.steer])], cpu,
        split=False)
    group = groups[(2, "post")]
    hidden, residual = torch.zeros(3, H), torch.zeros(3, H)
    hidden[:, 0] = torch.tensor([-2.0, 1.0, 4.0])
    residual[:, 0] = 0.5  # the condition reads hidden + residual at resid_post
    before = hidden.clone()
    apply_steering(group, hidden, residual)
    g = torch.sigmoid(3.0 * (before[:, 0] + 0.5 - 1.0))
    torch.testing.assert_close(group.conditions[0].values, g)
    torch.testing.assert_close(hidden, before + 2.0 * g[:, None] * vector)


def test_several_gated_vectors_of_several_requests_each_scale_their_own_rows():
    """One index_add_ for a site's gated vectors: each row gets its own vector times its own
    gate, for two requests with two gated vectors each (one of them per position, 3D), one of
    them at two layers."""
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    probes = [torch.randn(H, generator=g) for _ in range(4)]

    def steering(k):
        flat = sv(activations=torch.randn(2, H, generator=g), layer_indices=[2, 3],
                  condition=cond(probe=probes[2 * k], layer=1, threshold=0.1, sharpness=2.0))
        per_pos = sv(activations=torch.randn(1, 2, H, generator=g), layer_indices=[3],
                     position_indices=[1, 2], scale=0.5,
                     condition=cond(probe=probes[2 * k + 1], layer=2, threshold=-0.2))
        return parse([flat, per_pos])

    lenses = [steering(0), steering(1)]
    slices = [(dataclasses.replace(_slice(lens, start, start + 3, 0), req_id=f"r{k}"),
               [prepare(s, cpu, torch.float32) for s in lens.steer])
              for k, (lens, start) in enumerate(zip(lenses, (0, 3)))]
    groups = build_steer_groups(slices, cpu, split=False)
    # The rows each gate covers, by hand: request k owns rows 3k..3k+2 (positions 0..2); the
    # flat vector steers all three, the per-position one positions 1 and 2.
    by_request = {k: [c for c in groups[(1, "post")].conditions + groups[(2, "post")].conditions
                      if c.req_id == f"r{k}"] for k in (0, 1)}
    for k, gates in by_request.items():
        assert sorted(c.rows.tolist() for c in gates) == [
            [3 * k, 3 * k + 1, 3 * k + 2], [3 * k + 1, 3 * k + 2]]
    hidden, residual = torch.randn(6, H, generator=g), torch.randn(6, H, generator=g)
    expected = hidden.clone()
    for layer in (1, 2, 3):
        group = groups.get((layer, "post"))
        if group is None:
            continue
        # Per gate, by hand: read the gates here, then add each vector times its gate.
        stream = expected + residual
        wanted = {}
        for gate in group.conditions:
            wanted[id(gate)] = torch.sigmoid(gate.sharpness * (
                stream[gate.rows] @ gate.probe - gate.threshold))
        for k, (s, prepared) in enumerate(slices):
            for p in prepared:
                if layer not in p.spec.layers:
                    continue
                i = p.spec.layers.index(layer)
                gate = next(c for c in groups[(p.spec.condition.layer, "post")].conditions
                            if c.req_id == s.req_id and c.probe is p.probe)
                value = wanted.get(id(gate), gate.values)
                vectors = p.vectors[i] if p.vectors.dim() == 2 else p.vectors[i][
                    torch.as_tensor(p.position_rows)]
                expected[gate.rows] += vectors * value[:, None]
        apply_steering(group, hidden, residual)
        for gate in group.conditions:
            torch.testing.assert_close(gate.values, wanted[id(gate)])
        torch.testing.assert_close(hidden, expected)
    assert len(groups[(3, "post")].gated) == 4  # two requests' two gated vectors, batched


def test_conditional_vectors_parse_in_every_form():
    v = sv(condition=cond(threshold=0.5))
    forms = [[v], [v.model_dump(mode="json")], json.dumps([v.model_dump(mode="json")]),
             v.to_wire()]
    specs = [parse(form).steer[0] for form in forms]
    assert all(spec == specs[0] for spec in specs)
    assert specs[0].condition.threshold == 0.5
    with pytest.raises(LensRequestError, match="hidden size") as info:
        parse([sv(condition=cond(probe=torch.ones(H + 2))).model_dump(mode="json")])
    assert info.value.field == "apply_steering_vectors[0].condition.probe"


def test_malformed_probe_lists_are_value_errors():
    with pytest.raises(ValueError, match="list of floats"):
        sv(condition=cond(probe=[None]))


def test_a_request_carries_a_bounded_number_of_vectors(monkeypatch):
    monkeypatch.setenv("VLLM_LENS_MAX_STEERING_VECTORS", "4")
    assert len(parse([sv()] * 4).steer) == 4
    with pytest.raises(LensRequestError, match=r"apply_steering_vectors\[4\]'.*5 steering "
                                               r"vectors.*VLLM_LENS_MAX_STEERING_VECTORS \(4\)"):
        parse([sv()] * 5)


def _with_presets(value, presets):
    return parse_extra_args({"apply_steering_vectors": value}, lambda: FACTS,
                            presets=presets)[1]


def test_presets_count_towards_the_vector_cap_and_the_decoded_bytes(monkeypatch):
    """A preset reference is short, but expands to its vectors: they count as the request's
    own, so 50,000 references are refused at the first one past the cap, and a preset's
    tensors are charged against VLLM_LENS_MAX_DECODED_BYTES like sent ones."""
    from vllm_lens.spec import parse_steering

    three = parse_steering([sv(), sv(layer_indices=[1]), sv(layer_indices=[3])], FACTS, "p")
    presets = {"p": three}
    assert len(_with_presets(["preset:p"] * 2, presets).steer) == 6
    with pytest.raises(LensRequestError, match=r"apply_steering_vectors\[85\]'.*258 steering "
                                               r"vectors.*\(256\)"):
        _with_presets(["preset:p"] * 50_000, presets)
    # Each vector here declares 1 x 8 float32 = 32 bytes: two references (192 bytes) fit in
    # 200, a third does not.
    monkeypatch.setenv("VLLM_LENS_MAX_DECODED_BYTES", "200")
    assert len(_with_presets(["preset:p"] * 2, presets).steer) == 6
    with pytest.raises(LensRequestError, match=r"apply_steering_vectors\[2\]'.*"
                                               r"VLLM_LENS_MAX_DECODED_BYTES"):
        _with_presets(["preset:p"] * 3, presets)
    # A vector sent over the wire after them finds the budget the presets used.
    with pytest.raises(LensRequestError, match=r"apply_steering_vectors\[2\]'.*"
                                               r"VLLM_LENS_MAX_DECODED_BYTES"):
        _with_presets(["preset:p", "preset:p", sv().to_wire()], presets)


def test_a_requests_2d_vectors_at_one_site_are_summed_before_they_are_expanded():
    """200 plain 2D vectors at one layer add 200 x rows x hidden values if expanded one by
    one; summed per (site, phase) first, the addition is rows x hidden, with the same
    result. A decode-only vector keeps rows of its own, a 3D vector its positions."""
    vectors = [sv(activations=torch.randn(1, H)) for _ in range(200)]
    decode = sv(activations=torch.randn(1, H), phase="decode")
    placed = sv(activations=torch.randn(1, 1, H), position_indices=[3])
    lens = parse([*vectors, decode, placed])
    cpu = torch.device("cpu")
    s = RequestSlice(req_id="r", lens=lens, start=0, end=6, pos0=0, n_prompt=4)
    groups = build_steer_groups([(s, [prepare(v, cpu, torch.float32) for v in lens.steer])],
                                cpu, split=False)
    group = groups[(2, "post")]
    assert group.delta.shape == (6 + 2 + 1, H)  # every row, the 2 generated, position 3
    hidden = torch.zeros(6, H)
    apply_steering(group, hidden, None)
    expected = torch.zeros(6, H) + sum(v.activations[0] for v in vectors)
    expected[4:] += decode.activations[0]
    expected[3] += placed.activations[0, 0]
    torch.testing.assert_close(hidden, expected)


# -- ablate and cap ----------------------------------------------------------------------------

def _project(lens, hidden, residual=None, *, start=0, pos0=0, n_prompt=4, site="post"):
    """``hidden`` after the steering of ``lens`` at layer 2's ``site`` (rows 0.. of one
    request, positions ``pos0``..)."""
    cpu = torch.device("cpu")
    groups = build_steer_groups(
        [(_slice(lens, start, start + hidden.shape[0], pos0, n_prompt),
          [prepare(s, cpu, torch.float32) for s in lens.steer])], cpu, split=False)
    out = hidden.clone()
    apply_steering(groups[(2, site)], out, residual)
    return out


def _unit(v):
    return v / v.norm()


def test_ablation_removes_the_component_of_the_full_stream():
    r = torch.randn(H) * 7  # any length: normalised on the worker
    lens = parse([sv(activations=r[None], mode="ablate")])
    hidden, residual = torch.randn(5, H), torch.randn(5, H)
    out = _project(lens, hidden, residual)
    stream = hidden + residual
    expected = stream - (stream @ _unit(r))[:, None] * _unit(r)
    torch.testing.assert_close(out + residual, expected)
    assert (out + residual) @ _unit(r) == pytest.approx(torch.zeros(5), abs=1e-5)


def test_cap_clamps_the_projection_and_leaves_the_rest():
    r = _unit(torch.randn(H))
    lens = parse([sv(activations=r[None] * 3, mode="cap", cap=(-0.5, 1.0))])
    hidden = torch.randn(6, H) * 2
    out = _project(lens, hidden)
    before, after = hidden @ r, out @ r
    torch.testing.assert_close(after, before.clamp(-0.5, 1.0))
    orthogonal = lambda x: x - (x @ r)[:, None] * r  # noqa: E731
    torch.testing.assert_close(orthogonal(out), orthogonal(hidden))
    # one bound open: only that side is clamped
    upper = _project(parse([sv(activations=r[None], mode="cap", cap=(None, 0.0))]), hidden)
    torch.testing.assert_close(upper @ r, before.clamp(max=0.0))
    lower = _project(parse([sv(activations=r[None], mode="cap", cap=(0.0, None))]), hidden)
    torch.testing.assert_close(lower @ r, before.clamp(min=0.0))


def test_3d_ablation_uses_each_positions_direction_at_its_position():
    dirs = torch.randn(1, 2, H)
    lens = parse([sv(activations=dirs, position_indices=[6, 4], mode="ablate")])
    hidden = torch.randn(4, H)
    out = _project(lens, hidden, pos0=3)  # rows 0..3 hold positions 3..6
    expected = hidden.clone()
    for row, j in ((1, 1), (3, 0)):  # position 4 -> direction 1, position 6 -> direction 0
        d = _unit(dirs[0, j])
        expected[row] = hidden[row] - (hidden[row] @ d) * d
    torch.testing.assert_close(out, expected)


def test_ablation_at_a_component_point_and_its_phase():
    r = torch.randn(H)
    inner = dataclasses.replace(FACTS, sites=("pre", "mid", "post"))
    lens = parse_extra_args({"apply_steering_vectors": [sv(
        activations=r[None], mode="ablate", hook_point="attn_out", phase="decode")]},
        lambda: inner)[1]
    hidden, residual = torch.randn(4, H), torch.randn(4, H)
    # rows 0..3 hold positions 2..5 of a 4-token prompt: positions 4, 5 are generated
    out = _project(lens, hidden, residual, pos0=2, site="mid")
    torch.testing.assert_close(out[:2], hidden[:2])
    torch.testing.assert_close(out[2:] @ _unit(r), torch.zeros(2), atol=1e-5, rtol=0)


def test_projections_run_after_additions_components_first():
    """At one site: additions, then ablations of a component point (``mlp_out``), then of
    the full stream, whatever the list order."""
    r, push = _unit(torch.randn(H)), torch.randn(H) * 4
    inner = dataclasses.replace(FACTS, sites=("pre", "mid", "post"))
    lens = parse_extra_args({"apply_steering_vectors": [
        sv(activations=r[None], mode="cap", cap=(None, 0.25)),
        sv(activations=r[None], mode="ablate", hook_point="mlp_out"),
        sv(activations=push[None])]}, lambda: inner)[1]
    hidden, residual = torch.randn(3, H), torch.randn(3, H)
    out = _project(lens, hidden, residual)
    a = hidden + push
    a = a - (a @ r)[:, None] * r  # mlp_out ablated (with the push in it)
    full = a + residual
    full = full + ((full @ r).clamp(max=0.25) - full @ r)[:, None] * r
    torch.testing.assert_close(out + residual, full)


def test_layer_indices_all_is_every_decoder_layer_with_one_row():
    (spec,) = parse([sv(layer_indices="all", mode="ablate", hook_point="resid_pre")]).steer
    assert spec.layers == (0, 1, 2, 3) and spec.point == "resid_pre"
    prepared = prepare(spec, torch.device("cpu"), torch.float32)
    assert prepared.vectors.shape == (4, H)
    torch.testing.assert_close(prepared.vectors.norm(dim=-1), torch.ones(4))
    # also for additions: the one row added at every layer
    (add,) = parse([sv(activations=torch.ones(1, H), layer_indices="all", scale=2.0)]).steer
    assert add.layers == (0, 1, 2, 3)
    assert torch.equal(prepare(add, torch.device("cpu"), torch.float32).vectors,
                       torch.full((4, H), 2.0))


def test_the_ablation_helper_is_the_papers_recipe():
    r = torch.randn(H)
    vectors = SteeringVector.ablation(r)
    assert [(v.hook_point, v.layer_indices, v.mode) for v in vectors] == [
        ("resid_pre", "all", "ablate"), ("attn_out", "all", "ablate"),
        ("mlp_out", "all", "ablate")]
    inner = dataclasses.replace(FACTS, sites=("pre", "mid", "post"))
    specs = parse_extra_args({"apply_steering_vectors": vectors}, lambda: inner)[1].steer
    assert [(s.layers, s.point) for s in specs] == [
        ((0, 1, 2, 3), "resid_pre"), ((0, 1, 2, 3), "attn_out"), ((0, 1, 2, 3), "mlp_out")]
    listed = SteeringVector.ablation(r.numpy(), [1, 3], points=("resid_post",),
                                     phase="decode")
    assert [(v.layer_indices, v.activations.shape, v.phase) for v in listed] == [
        ([1, 3], (2, H), "decode")]
    with pytest.raises(ValueError, match="1D"):
        SteeringVector.ablation(torch.randn(2, H))


def test_ablations_and_caps_round_trip_and_salt_the_cache():
    for v in (sv(activations=torch.randn(1, 2, H), position_indices=[3, 1], mode="cap",
                 cap=(None, 2.5)),
              sv(layer_indices="all", mode="ablate", phase="prefill")):
        for back in (SteeringVector.from_wire(v.to_wire()), SteeringVector.model_validate(
                json.loads(json.dumps(v.model_dump(mode="json"))))):
            assert back.model_dump(exclude={"activations"}) == v.model_dump(
                exclude={"activations"})
        lens = parse([v])
        assert LensRequest.from_payload(lens.to_payload()) == lens
    r = torch.randn(1, H)
    salts = {parse([sv(activations=r, **kw)]).cache_salt for kw in (
        {}, {"mode": "ablate"}, {"mode": "cap", "cap": (0.0, 1.0)},
        {"mode": "cap", "cap": (0.0, 2.0)}, {"mode": "cap", "cap": (None, 1.0)})}
    assert len(salts) == 5


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        (dict(mode="ablate", activations=torch.zeros(1, H)), "activations", "no direction"),
        (dict(mode="cap", cap=(0, 1), activations=torch.cat(
            [torch.ones(1, 1, H), torch.zeros(1, 1, H)], dim=1)), "activations",
         "no direction"),
        (dict(mode="ablate", activations=torch.full((1, H), 3e38)), "activations",
         "too large"),
        (dict(mode="ablate", activations=torch.full((1, H), float("nan"))), "",
         "NaN or inf"),
        (dict(mode="cap", cap=(2.0, 1.0)), "cap", "above the upper bound"),
        (dict(mode="cap", cap=(None, None)), "cap", "bounds nothing"),
        (dict(mode="cap"), "cap", "needs cap"),
        (dict(mode="cap", cap=(float("nan"), 1.0)), "cap", "finite"),
        (dict(mode="cap", cap=(0.0, float("inf"))), "cap", "finite"),
        (dict(cap=(0.0, 1.0)), "cap", "only meaningful with mode='cap'"),
        (dict(mode="ablate", cap=(0.0, 1.0)), "cap", "only meaningful"),
        (dict(mode="ablate", scale=2.0), "scale", "no scale"),
        (dict(mode="cap", cap=(0, 1), norm_match=True), "norm_match", "no norm_match"),
        (dict(mode="ablate", condition=cond()), "condition", "gates mode='add' only"),
        (dict(mode="ablate", activations=torch.randn(2, H), layer_indices="all"),
         "activations", "one row at every layer"),
        (dict(layer_indices="every"), "layer_indices", "list of ints or 'all'"),
        (dict(layer_indices="all", hook_point="embed"), "", "addressed alone"),
    ],
)
def test_bad_ablations_and_caps_name_the_field(kwargs, field, words):
    with pytest.raises(ValueError, match=words):
        sv(**kwargs)
    # as a request's JSON vector: a LensRequestError naming the field
    item = {"activations": torch.randn(1, H), "layer_indices": [2], **kwargs}
    with pytest.raises(LensRequestError, match=words) as info:
        parse([item])
    assert info.value.field == "apply_steering_vectors[0]" + (f".{field}" if field else "")


@pytest.mark.parametrize("point", ["attn_z", "mlp_post", "attn_q", "router_logits"])
def test_projections_refused_at_points_steering_cannot_write(point):
    """Only the stream points (whole on every tensor-parallel rank) are writable; the ones
    each rank holds a part of are refused naming hook_point."""
    for kw in (dict(mode="ablate"), dict(mode="cap", cap=(None, 1.0))):
        with pytest.raises(LensRequestError, match="cannot be written to|unknown") as info:
            parse([sv(hook_point=point, **kw)])
        assert info.value.field == "apply_steering_vectors[0].hook_point"


def test_projection_groups_mix_with_plain_additions_of_the_model_dtype():
    """A request's plain additions keep the model dtype beside its float32 directions."""
    lens = parse([sv(mode="ablate"), sv(activations=torch.ones(1, H))])
    cpu = torch.device("cpu")
    groups = build_steer_groups(
        [(_slice(lens, 0, 3, 0), [prepare(s, cpu, torch.bfloat16) for s in lens.steer])],
        cpu, split=False)
    hidden = torch.randn(3, H, dtype=torch.bfloat16)
    apply_steering(groups[(2, "post")], hidden, None)
    assert hidden.dtype == torch.bfloat16
