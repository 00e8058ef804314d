"""The typed worker answers (``vllm_lens.common.messages``): they survive the two hops vLLM
carries a ``collective_rpc`` answer over (pickle from the worker to the engine core, msgpack
from the engine core to the front end), and the front end refuses one of another version or
shape, naming the field."""

import pickle

import msgspec
import pytest
import torch

from vllm_lens.common import messages, wire
from vllm_lens.common.messages import (
    AttentionMeta,
    DescribeAnswer,
    FetchAnswer,
    FetchPart,
    FlushAnswer,
    HookResultsAnswer,
    LayoutCheckSummary,
    ParamsAnswer,
    SaeAnswer,
    SaeSliceAnswer,
    StatsAnswer,
    WorkerAnswerError,
    read,
    read_all,
)


def _describe(**changed):
    meta = AttentionMeta(layer=0, scale=0.5, logits_soft_cap=0.0, sliding_window=[-1, -1],
                         alibi_slopes=None, sinks=[0.0, 0.5], num_heads=2, num_kv_heads=1,
                         head_size=4, layer_name="model.layers.0.self_attn.attn")
    fields = dict(unsupported=None, model_class="LlamaForCausalLM", mapped=True, n_layers=2,
                  local_layers=[0, 1], pre_taps=True, hidden_size=8, dtype="float32",
                  max_model_len=64, tp_rank=0, pp_rank=0, speculative=False, tp_size=1,
                  dp_size=1, num_heads_total=2, num_kv_heads_total=1,
                  sites=["pre", "attn", "post"], d_mlp=16, split=False, block="sequential",
                  n_experts=0, moe_top_k=0, unmapped=None, inner_taps=True, qk_meta=[meta],
                  derived_layout=True, refused_points={"attn_out": "the invariant failed"},
                  layout_check=LayoutCheckSummary(ran=True, passed=["continuity"],
                                                  seconds=0.01, error=None))
    return DescribeAnswer(**{**fields, **changed})


def _answers():
    """One answer of every worker RPC, with every nested part filled in."""
    part = FetchPart(error=None, conflict=False, capacity=None, held=True,
                     seen=["residual_stream"],
                     captures={"residual_stream": wire.dumps(torch.ones(2)),
                               "attn_out": {"path": "/dev/shm/vllm_lens_x"}},
                     hooks=b"hooks", gates=b"gates", monitors=b"monitors",
                     receipt={"sink": "acts", "rows": 3, "shapes": {"x": [1, 3, 8]}})
    failed = FetchPart.failed("vllm-lens failed at sink: full", capacity="VLLM_LENS_X")
    return [
        _describe(),
        DescribeAnswer.refused("vllm-lens cannot inspect this worker"),
        FetchAnswer(requests={"k": {"7-abc": part, "8-abc": failed}}),
        StatsAnswer(entries=1, bytes=2, records=3, device_bytes=4, saes=5, sae_bytes=6,
                    staging_bytes=7),
        HookResultsAnswer(results={"7-abc": b"blob"}),
        ParamsAnswer(params={"lm_head.weight": b"w"}),
        FlushAnswer(problems=["dataset d: key k dropped"]),
        SaeAnswer(description={"path": "/saes/a", "layer": 1, "d_sae": 32}, error=None),
        SaeSliceAnswer(data=b"slice", error=None),
    ]


def _through_vllm(result):
    """``result`` as the front end receives a ``collective_rpc`` answer from vLLM's engine
    core process: the worker's answer pickled through the executor's queue, then the utility
    result msgpack-encoded by the engine core and decoded by the front end."""
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    in_engine_core = pickle.loads(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    outputs = EngineCoreOutputs(utility_output=UtilityOutput(
        call_id=1, result=UtilityResult(in_engine_core)))
    frames = MsgpackEncoder().encode(outputs)
    return MsgpackDecoder(EngineCoreOutputs).decode(frames).utility_output.result.result


@pytest.mark.parametrize("answer", _answers(), ids=lambda a: type(a).__name__)
def test_every_answer_survives_vllms_transport(answer):
    ranks = _through_vllm([answer, answer])
    assert all(isinstance(rank, dict) for rank in ranks)  # msgpack: the record's fields by name
    assert read_all(type(answer), ranks) == [answer, answer]
    # In one process (the engine core inside the front end), the record itself comes back.
    assert read(type(answer), pickle.loads(pickle.dumps(answer))) == answer


def test_the_version_travels_with_each_answer():
    raw = _through_vllm([StatsAnswer(entries=0, bytes=0, records=0, device_bytes=0, saes=0,
                                     sae_bytes=0, staging_bytes=0)])[0]
    assert raw[messages.TAG_FIELD] == f"lens_stats/{messages.VERSION}"
    older = {**raw, messages.TAG_FIELD: f"lens_stats/{messages.VERSION - 1}"}
    with pytest.raises(WorkerAnswerError, match="lens_stats.*another vllm-lens version"):
        read(StatsAnswer, older)
    untagged = {k: v for k, v in raw.items() if k != messages.TAG_FIELD}
    with pytest.raises(WorkerAnswerError, match="lens_message=None"):
        read(StatsAnswer, untagged)
    with pytest.raises(WorkerAnswerError, match="lens_describe"):
        read(DescribeAnswer, raw)  # another RPC's answer
    with pytest.raises(WorkerAnswerError, match="a list instead of a FetchAnswer"):
        read(FetchAnswer, [])


class _RenamedPart(msgspec.Struct, frozen=True, kw_only=True):
    """``FetchPart`` with ``held`` renamed ``kept``, as a worker would send it."""

    error: str | None
    conflict: bool
    capacity: str | None
    kept: bool
    seen: list[str]
    captures: dict[str, bytes]
    hooks: bytes | None
    gates: bytes | None
    monitors: bytes | None
    receipt: dict | None


class _RenamedFetch(messages.Message, frozen=True, tag=f"lens_fetch/{messages.VERSION}"):
    requests: dict[str, dict[str, _RenamedPart]]


def test_a_field_renamed_on_the_worker_is_refused_naming_it():
    """The worker's class as it would be with ``held`` renamed ``kept``: the front end's
    ``FetchPart`` refuses its answer and names the missing field."""

    worker = _RenamedFetch(requests={"k": {"7": _RenamedPart(
        error=None, conflict=False, capacity=None, kept=True, seen=[], captures={},
        hooks=None, gates=None, monitors=None, receipt=None)}})
    with pytest.raises(WorkerAnswerError,
                       match=r"missing required field `held`.*\$\.requests"):
        read_all(FetchAnswer, _through_vllm([worker]))


@pytest.mark.parametrize("answer", _answers(), ids=lambda a: type(a).__name__)
def test_every_field_is_required(answer):
    """No silent default: a map missing any field of any record is refused, naming it (but
    the fields added later with a default, which the version rule allows)."""
    raw = _through_vllm([answer])[0]
    for name in (f.encode_name for f in msgspec.structs.fields(type(answer)) if f.required):
        missing = {k: v for k, v in raw.items() if k != name}
        with pytest.raises(WorkerAnswerError, match=f"missing required field `{name}`"):
            read(type(answer), missing)


def test_a_field_of_the_wrong_type_is_refused_naming_it():
    raw = _through_vllm([_describe()])[0]
    with pytest.raises(WorkerAnswerError, match=r"Expected `int`, got `str` - at `\$.tp_rank`"):
        read(DescribeAnswer, {**raw, "tp_rank": "0"})
    raw["qk_meta"][0].pop("head_size")
    with pytest.raises(WorkerAnswerError, match=r"`head_size` - at `\$.qk_meta\[0\]`"):
        read(DescribeAnswer, raw)


def test_an_optional_field_added_later_keeps_the_version():
    """Within a version, a worker may send a field this front end does not know (ignored),
    and a field added with a default is filled in for a worker that does not send it."""
    raw = _through_vllm([_describe()])[0]
    assert read(DescribeAnswer, {**raw, "a_field_of_a_later_release": ["attn_z"]}) == _describe()

    class Extended(messages.Message, frozen=True, tag=f"lens_stats/{messages.VERSION}"):
        entries: int
        refused_points: list[str] = []

    assert read(Extended, {messages.TAG_FIELD: f"lens_stats/{messages.VERSION}",
                           "entries": 1}).refused_points == []


def test_the_public_forms_stay_as_they_were():
    stats = StatsAnswer(entries=1, bytes=2, records=3, device_bytes=4, saes=5, sae_bytes=6,
                        staging_bytes=7)
    assert stats.as_json() == {"entries": 1, "bytes": 2, "records": 3, "device_bytes": 4,
                               "saes": 5, "sae_bytes": 6, "staging_bytes": 7}
    meta = _describe().qk_meta[0].as_dict()
    assert sorted(meta) == sorted(["scale", "logits_soft_cap", "sliding_window",
                                   "alibi_slopes", "sinks", "num_heads", "num_kv_heads",
                                   "head_size", "layer_name", "kv_cache_dtype"])
