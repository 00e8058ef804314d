"""Capture sinks without an engine: the operator's configuration, what a request may name,
and the safetensors sink's behaviour when a shard cannot be written."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from vllm_lens import datasets
from vllm_lens.errors import DatasetConflictError, LensRequestError, UnsupportedConfigError
from vllm_lens.sinks import Example, load_kind
from vllm_lens.sinks.config import SinkSpec, check_name, parse_config
from vllm_lens.sinks.shards import ShardSink
from vllm_lens.spec import ModelFacts, parse_extra_args

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8,
                   max_model_len=64, mapped=True, sites=("pre", "attn", "mid", "act", "post"),
                   d_mlp=16, n_heads=2, n_kv_heads=2, head_dim=4)


@pytest.mark.parametrize("name", ["acts", "run-1", "a.b_c", "A" * 128])
def test_valid_names(name):
    assert check_name(name, "dataset") == name


@pytest.mark.parametrize("name", ["", ".hidden", "..", "a/b", "../x", "a..b", "a b", "é",
                                  "A" * 129, 3, None, "-x" + "\x00"])
def test_names_that_could_leave_the_root_are_refused(name):
    with pytest.raises(ValueError, match="not a valid name"):
        check_name(name, "dataset")


def test_the_operator_config(tmp_path):
    sinks = parse_config(json.dumps({"acts": {"root": str(tmp_path), "clients": True,
                                              "rows_per_shard": 8}}))
    assert sinks["acts"].kind == "safetensors" and sinks["acts"].clients
    assert sinks["acts"].options == {"rows_per_shard": 8}
    path = tmp_path / "sinks.json"
    path.write_text(json.dumps({"b": {"root": str(tmp_path)}}))
    assert not parse_config(str(path))["b"].clients
    for bad, problem in [("[1]", "JSON object"), ("{", "not valid JSON"),
                         ('{"a/b": {"root": "/x"}}', "not a valid name"),
                         ('{"a": {"root": "relative"}}', "absolute directory"),
                         ('{"a": {"root": "/x", "clients": "yes"}}', "true or false"),
                         (str(tmp_path / "missing.json"), "cannot read")]:
        with pytest.raises(ValueError, match=problem):
            parse_config(bad)


def test_a_request_names_a_configured_sink_a_dataset_and_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_SINKS", json.dumps({"acts": {"root": str(tmp_path)}}))
    good = {"sink": "acts", "dataset": "d1", "key": "ex-1"}
    capture = {"output_residual_stream": [1, 2]}
    _, lens = parse_extra_args({**capture, "capture_sink": good}, lambda: FACTS)
    assert lens.sink == SinkSpec("acts", "d1", "ex-1")
    assert type(lens).from_payload(lens.to_payload()).sink == lens.sink
    for raw, field, problem in [
        ({**good, "sink": "other"}, "capture_sink.sink", "unknown sink 'other'; this "
         "engine's sinks: acts"),
        ({**good, "dataset": "../etc"}, "capture_sink.dataset", "not a valid name"),
        ({**good, "key": ""}, "capture_sink.key", "non-empty string"),
        ({**good, "path": "/tmp"}, "capture_sink.path", "unknown field"),
        ({"sink": "acts", "dataset": "d"}, "capture_sink.key", "missing"),
        ("[", "capture_sink", "not valid JSON"),
    ]:
        with pytest.raises(LensRequestError) as err:
            parse_extra_args({**capture, "capture_sink": raw}, lambda: FACTS)
        assert err.value.field == field and problem in err.value.problem
    with pytest.raises(LensRequestError, match="captures nothing"):
        parse_extra_args({"capture_sink": good}, lambda: FACTS)
    with pytest.raises(LensRequestError, match="the same layers"):
        parse_extra_args({"output_activations": {"resid_post": [1], "attn_out": [2]},
                          "capture_sink": good}, lambda: FACTS)
    assert not lens.sink.shared and "shared" not in lens.to_payload()["sink"]
    # Each stage or engine writes as a named writer; the stages learn the whole example's
    # row shapes and dtype for the manifest (a stage may hold none of the points' layers).
    _, lens = parse_extra_args({**capture, "capture_sink": good},
                               lambda: ModelFacts(**{**FACTS.__dict__, "pp_size": 2}))
    carried = type(lens).from_payload(lens.to_payload()).sink
    assert (carried.shared, carried.dtype, carried.row_shapes) == (
        True, "float32", {"residual_stream": (8,)})
    _, lens = parse_extra_args({**capture, "capture_sink": good},
                               lambda: ModelFacts(**{**FACTS.__dict__, "dp_size": 2}))
    carried = type(lens).from_payload(lens.to_payload()).sink
    assert carried.shared and carried.row_shapes is None and carried == lens.sink
    with pytest.raises(UnsupportedConfigError, match="attn_z under tensor parallelism"):
        parse_extra_args({"output_activations": {"attn_z": [1]}, "capture_sink": good},
                         lambda: ModelFacts(**{**FACTS.__dict__, "tp_size": 2}))
    monkeypatch.delenv("VLLM_LENS_SINKS")
    with pytest.raises(LensRequestError, match="VLLM_LENS_SINKS is not set"):
        parse_extra_args({**capture, "capture_sink": good}, lambda: FACTS)


def test_streaming_needs_positions_known_as_rows_are_made():
    _, lens = parse_extra_args({"output_residual_stream": [1], "stream_activations": True},
                               lambda: FACTS)
    assert lens.stream and type(lens).from_payload(lens.to_payload()).stream
    for capture, problem in [({"layers": [1], "reduce": "mean"}, "reduced"),
                             ({"layers": [1], "positions": "generated[-3:]"}, "from the end"),
                             ({"layers": [1], "positions": "all[:-1]"}, "from the end")]:
        with pytest.raises(LensRequestError, match=problem):
            parse_extra_args({"output_residual_stream": capture, "stream_activations": True},
                             lambda: FACTS)
    with pytest.raises(LensRequestError, match="true or false"):
        parse_extra_args({"output_residual_stream": [1], "stream_activations": "yes"},
                         lambda: FACTS)
    _, lens = parse_extra_args({"output_residual_stream": {"layers": [1], "positions":
                                                           "prompt[-2:]"},
                                "stream_activations": True}, lambda: FACTS)
    assert lens.stream  # a window at the prompt's end is known before generation starts


def _example(key, n_rows, settings, fill=1.0):
    rows = {"resid_post": torch.full((2, n_rows, 8), fill)}
    return Example(key=key, rows=rows, positions=list(range(n_rows)), reduced=False,
                   prompt_token_ids=list(range(n_rows)), token_ids=[], settings=settings)


SETTINGS = {"model": "m", "points": ["resid_post"], "layers": [1, 2], "dtype": "float32",
            "row_shapes": {"resid_post": [8]}, "positions": "all", "reduce": None}


def test_the_shard_sink_writes_a_dataset_and_receipts(tmp_path):
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 5,
                                               "flush_s": 0}}))["acts"]
    sink = load_kind("safetensors")(config)
    first = sink.write("d", _example("a", 3, SETTINGS))
    # Queued: where it lands is known once its shard is written.
    assert first == {"sink": "acts", "dataset": "d", "key": "a", "shard": None, "offset": None,
                     "rows": 3, "shapes": {"resid_post": [2, 3, 8]}, "durable": False}
    # Fills the shard, which goes to the writer thread: not on disk when the write returns.
    second = sink.write("d", _example("b", 3, SETTINGS, 2.0))
    assert (second["shard"], second["offset"], second["durable"]) == (None, None, False)
    third = sink.write("d", _example("c", 1, SETTINGS, 3.0))
    assert (third["shard"], third["offset"], third["durable"]) == (None, None, False)
    # The caller's to resolve (another key, another dataset): HTTP 409 on the server.
    with pytest.raises(DatasetConflictError, match="already in the dataset"):
        sink.write("d", _example("a", 1, SETTINGS))
    with pytest.raises(DatasetConflictError, match="holds examples with positions='all'"):
        sink.write("d", _example("x", 1, {**SETTINGS, "positions": "prompt"}))
    assert sink.flush() == []
    ds = datasets.open(tmp_path / "d")
    assert ds.keys() == ["a", "b", "c"]
    assert torch.equal(ds.get("b")["resid_post"], torch.full((2, 3, 8), 2.0))
    sink.close()


def test_a_dataset_on_disk_with_other_settings_is_a_conflict_and_a_broken_index_is_not(
        tmp_path):
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 1,
                                               "flush_s": 0}}))["acts"]
    first = ShardSink(config)
    first.write("d", _example("a", 1, SETTINGS))
    first.write("e", _example("a", 1, SETTINGS))
    first.close()
    later = ShardSink(config)  # a new worker: the datasets are opened from disk
    with pytest.raises(DatasetConflictError, match="manifest has layers=\\[1, 2\\]"):
        later.write("d", _example("b", 1, {**SETTINGS, "layers": [3, 4]}))
    with pytest.raises(DatasetConflictError, match="already in the dataset"):
        later.write("d", _example("a", 1, SETTINGS))
    # The operator's to mend, not the caller's (HTTP 500, not 409): a damaged index or
    # manifest, and another process writing the dataset.
    (tmp_path / "e" / "index.jsonl").write_text("not json\n")
    with pytest.raises(ValueError,
                       match="not an index entry.*sink's operator to resolve") as info:
        later.write("e", _example("b", 1, SETTINGS))
    assert not isinstance(info.value, DatasetConflictError)
    first.write("f", _example("a", 1, SETTINGS))  # holds "f" open
    with pytest.raises(ValueError, match="another writer.*sink's operator to resolve") as info:
        later.write("f", _example("b", 1, SETTINGS))
    assert not isinstance(info.value, DatasetConflictError)
    first.close()
    (tmp_path / "f" / "manifest.json").write_text("{truncated")
    with pytest.raises(ValueError) as info:
        later.write("f", _example("b", 1, SETTINGS))
    assert not isinstance(info.value, DatasetConflictError)
    later.close()


def test_a_shard_that_cannot_be_written_is_dropped_alone_and_reported_twice(tmp_path,
                                                                          monkeypatch):
    """A failed background write drops its shard's examples and no other; the next flush and
    the next request writing to the dataset each learn it (that request's example is not
    written), and the sink carries on."""
    from vllm_lens.dataset import writer

    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 4,
                                               "flush_s": 0}}))["acts"]
    sink = ShardSink(config)
    sink.write("d", _example("a", 4, SETTINGS))  # shard 0
    assert sink.flush() == []
    real = writer.write_shard_file
    queued = threading.Event()

    def shard_1_fails(path, tensors, **kw):
        if "shard-00001" in str(path):
            queued.wait(10)
            raise OSError(28, "No space left on device")
        real(path, tensors, **kw)

    monkeypatch.setattr(writer, "write_shard_file", shard_1_fails)
    sink.write("d", _example("b", 2, SETTINGS))
    receipt = sink.write("d", _example("c", 2, SETTINGS))  # shard 1: handed off, it fails
    assert not receipt["durable"]
    sink.write("d", _example("e", 4, SETTINGS))  # shard 2, queued behind it: written
    queued.set()
    sink._drain()
    with pytest.raises(RuntimeError, match=r"No space left.*keys \['b', 'c'\].*this request's "
                                           r"example was not written"):
        sink.write("d", _example("f", 1, SETTINGS))
    receipt = sink.write("d", _example("f", 1, SETTINGS))  # told once; the sink carries on
    assert not receipt["durable"]
    problems = sink.flush()
    assert len(problems) == 1 and "No space left" in problems[0] and "['b', 'c']" in problems[0]
    assert sink.flush() == []  # reported once
    assert datasets.open(tmp_path / "d").keys() == ["a", "e", "f"]
    assert sorted(p.name for p in (tmp_path / "d").glob("*shard*")) == [
        "shard-00000.safetensors", "shard-00002.safetensors", "shard-00003.safetensors"]
    monkeypatch.setattr(writer, "write_shard_file", real)
    sink.write("d", _example("b", 2, SETTINGS))  # a dropped key may be written again
    sink.close()
    assert datasets.open(tmp_path / "d").keys() == ["a", "e", "f", "b"]


def test_with_max_queued_shards_0_the_write_completing_a_shard_waits_for_it(tmp_path,
                                                                           monkeypatch):
    """No queue: the write whose example completes a shard returns once the shard is on disk
    (its receipt durable, naming shard and offset), and a failure fails that request, naming
    the keys dropped with it (and is reported by the next flush too)."""
    from vllm_lens.dataset import writer

    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 4,
                                               "flush_s": 0, "max_queued_shards": 0}}))["acts"]
    sink = ShardSink(config)
    assert not sink.write("d", _example("a", 2, SETTINGS))["durable"]
    second = sink.write("d", _example("b", 2, SETTINGS))
    assert (second["shard"], second["offset"], second["durable"]) == (0, 2, True)
    sink.write("d", _example("c", 2, SETTINGS))
    real = writer.write_shard_file
    monkeypatch.setattr(writer, "write_shard_file",
                        lambda *a, **kw: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(RuntimeError, match=r"No space left.*keys \['c', 'e'\]") as info:
        sink.write("d", _example("e", 2, SETTINGS))
    assert "not written (send it again)" not in str(info.value)  # it was, and was dropped
    assert datasets.open(tmp_path / "d").keys() == ["a", "b"]
    monkeypatch.setattr(writer, "write_shard_file", real)
    assert not sink.write("d", _example("e", 2, SETTINGS))["durable"]  # sent again
    problems = sink.flush()
    assert len(problems) == 1 and "['c', 'e']" in problems[0]
    sink.close()
    assert datasets.open(tmp_path / "d").keys() == ["a", "b", "e"]


def _gated_save(monkeypatch):
    """A disk that writes a shard only when the test opens the gate: returns (gate, the number
    of shards the writer thread had queued each time it began one)."""
    from vllm_lens.dataset import writer

    real = writer.write_shard_file
    gate, seen = threading.Event(), []

    def slow(path, tensors, **kw):
        seen.append(path)
        assert gate.wait(30), "the test never opened the gate"
        real(path, tensors, **kw)

    monkeypatch.setattr(writer, "write_shard_file", slow)
    return gate, seen


def test_writes_return_while_the_disk_is_busy_until_the_queue_is_full(tmp_path, monkeypatch):
    """A shard is written off the writing thread; past ``max_queued_shards`` a write waits for
    room (back-pressure), so at most that many shards wait besides the one being filled."""
    gate, seen = _gated_save(monkeypatch)
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 2,
                                               "flush_s": 0, "max_queued_shards": 2}}))["acts"]
    sink = ShardSink(config)
    receipts = [sink.write("d", _example(f"k{i}", 1, SETTINGS, i)) for i in range(5)]
    # Shards 0 (being written, the disk stuck) and 1 (waiting) are handed off, k4 is queued.
    assert [r["durable"] for r in receipts] == [False] * 5
    assert len(sink._queue) == 2 and not (tmp_path / "d" / "index.jsonl").exists()
    assert sink._writers["d"].sealed_keys == ["k0", "k1", "k2", "k3"]
    blocked = threading.Thread(target=sink.write, args=("d", _example("k5", 1, SETTINGS, 5)))
    blocked.start()  # completes shard 2: no room for it
    blocked.join(0.5)
    assert blocked.is_alive() and len(sink._queue) == 2
    gate.set()
    blocked.join(30)
    assert not blocked.is_alive()
    assert sink.flush() == []
    ds = datasets.open(tmp_path / "d")
    assert ds.keys() == [f"k{i}" for i in range(6)]
    assert [ds.get(f"k{i}")["resid_post"][0, 0, 0].item() for i in range(6)] == list(range(6))
    assert [(Path(p).parent.name, Path(p).name) for p in seen] == [  # (staged, then renamed)
        (f".shard-0000{i}.safetensors.tmp-{os.getpid()}", f"shard-0000{i}.safetensors")
        for i in range(3)]
    assert [p.name for p in (tmp_path / "d").iterdir() if ".tmp" in p.name] == []
    sink.close()


def test_durable_only_once_the_shard_is_on_disk_and_close_drains(tmp_path, monkeypatch):
    from vllm_lens.dataset.index import complete_keys

    gate, _ = _gated_save(monkeypatch)
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 1,
                                               "flush_s": 0}}))["acts"]
    sink = ShardSink(config)
    assert not sink.write("d", _example("a", 1, SETTINGS))["durable"]
    writer = sink._writers["d"]
    assert not writer.durable("a") and complete_keys(tmp_path / "d") == []
    gate.set()
    writer.wait_written()
    assert writer.durable("a") and complete_keys(tmp_path / "d") == ["a"]
    gate.clear()
    for key in "bc":
        sink.write("d", _example(key, 1, SETTINGS))
    closing = threading.Thread(target=sink.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # close waits for the shards handed off ...
    gate.set()
    closing.join(30)
    assert complete_keys(tmp_path / "d") == ["a", "b", "c"]  # ... and writes them
    assert not sink._queue and sink._writer_thread is None


def test_many_small_shards_from_two_writers_of_one_dataset_read_back_exactly(tmp_path,
                                                                            monkeypatch):
    """Two sinks (a data-parallel engine each, as named writers) write one dataset and a
    dataset of their own at once, with a disk of random delays, shards of 1 to 3 rows and a
    flush timer cutting shards too: every example reads back exactly, in each writer's order."""
    import random

    from vllm_lens.dataset import writer

    real = writer.write_shard_file
    pace = random.Random(0)

    def jittery(path, tensors, **kw):
        time.sleep(pace.random() * 0.004)
        real(path, tensors, **kw)

    monkeypatch.setattr(writer, "write_shard_file", jittery)
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 3,
                                               "flush_s": 0.05, "max_queued_shards": 1}}))
    written: dict[str, list[str]] = {}

    def engine(rank):
        sink, sizes = ShardSink(config["acts"]), random.Random(rank)
        for i in range(300):
            dataset = "shared" if i % 3 else f"own{rank}"
            key = f"e{rank}-{i}"
            example = _example(key, sizes.randint(1, 3), SETTINGS, fill=rank * 1000 + i)
            example.writer = f"dp{rank}-pp0"
            assert not sink.write(dataset, example)["durable"]
            written.setdefault(f"{dataset}/{rank}", []).append(key)
            if i % 100 == 99:
                assert sink.flush() == []
        sink.close()

    engines = [threading.Thread(target=engine, args=(rank,)) for rank in (0, 1)]
    for thread in engines:
        thread.start()
    for thread in engines:
        thread.join(120)
        assert not thread.is_alive()
    for dataset in ("shared", "own0", "own1"):
        ds = datasets.open(tmp_path / dataset)
        index = (tmp_path / dataset / "index.jsonl").read_text()
        lines = [json.loads(x) for x in index.splitlines()]
        for rank in (0, 1):
            mine = [e["key"] for e in lines if e["writer"] == f"dp{rank}-pp0"]
            assert mine == written.get(f"{dataset}/{rank}", [])
        for key in ds.keys():
            rank, i = map(int, key[1:].split("-"))
            got = ds.get(key)["resid_post"]
            assert torch.equal(got, torch.full((2, len(ds.get(key)["positions"]), 8),
                                               float(rank * 1000 + i)))
        assert not [p for p in (tmp_path / dataset).iterdir() if ".tmp" in p.name]
    assert sum(len(v) for v in written.values()) == 600
    assert len(list(tmp_path.glob("*/shard-*"))) > 200


def _write_then_die(root, acks):
    """A worker whose disk stops mid-shard after its first flush: it acknowledges the flushed
    keys and the receipts of the rest, then waits to be killed."""
    from vllm_lens.dataset import writer

    config = parse_config(json.dumps({"acts": {"root": str(root), "rows_per_shard": 2,
                                               "flush_s": 0}}))["acts"]
    sink = ShardSink(config)
    for i in range(5):
        sink.write("d", _example(f"a{i}", 1, SETTINGS, i))
    assert sink.flush() == []
    real = writer.write_shard_file

    def stuck(path, tensors, **kw):
        real(path, tensors, **kw)  # the temp file is complete, never renamed
        time.sleep(3600)

    writer.write_shard_file = stuck
    receipts = [sink.write("d", _example(f"b{i}", 1, SETTINGS, 10 + i)) for i in range(5)]
    lines = [f"a{i} flushed" for i in range(5)]
    lines += [f"{r['key']} {'durable' if r['durable'] else 'queued'}" for r in receipts]
    Path(acks).write_text("".join(line + "\n" for line in lines))
    time.sleep(3600)


def test_a_worker_killed_with_shards_queued_loses_only_what_it_never_acknowledged(tmp_path):
    import multiprocessing
    import signal

    acks = tmp_path / "acks"
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(target=_write_then_die, args=(tmp_path, acks))
    victim.start()
    deadline = time.monotonic() + 120
    while not acks.exists() and time.monotonic() < deadline and victim.is_alive():
        time.sleep(0.05)
    told = dict(line.split() for line in acks.read_text().splitlines())
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    assert told == {**{f"a{i}": "flushed" for i in range(5)},
                    **{f"b{i}": "queued" for i in range(5)}}
    assert [p.name for p in (tmp_path / "d").glob(".*tmp*")]  # the shard it was writing
    assert datasets.open(tmp_path / "d").keys() == [f"a{i}" for i in range(5)]
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "flush_s": 0}}))["acts"]
    sink = ShardSink(config)  # the resumed job writes the rest again
    for i in range(5):
        sink.write("d", _example(f"b{i}", 1, SETTINGS, 10 + i))
    sink.close()
    ds = datasets.open(tmp_path / "d")
    assert ds.keys() == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)]
    assert ds.get("b4")["resid_post"][0, 0, 0].item() == 14
    assert not [p for p in (tmp_path / "d").iterdir() if ".tmp" in p.name]


def test_a_timer_flushes_queued_examples(tmp_path):
    import time

    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "flush_s": 0.2}}))
    sink = ShardSink(config["acts"])
    sink.write("d", _example("a", 2, SETTINGS))
    deadline = time.monotonic() + 10
    while not (tmp_path / "d" / "index.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert datasets.open(tmp_path / "d").keys() == ["a"]
    sink.close()


def test_unknown_options_and_kinds(tmp_path):
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "shards": 3}}))["acts"]
    with pytest.raises(ValueError, match="unknown option 'shards'"):
        ShardSink(config)
    with pytest.raises(KeyError, match="no sink kind 'ftp'"):
        load_kind("ftp")


def test_a_failed_timer_write_is_reported_by_the_next_flush(tmp_path, monkeypatch):
    import time

    from vllm_lens.dataset import writer

    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "flush_s": 0.1}}))
    sink = ShardSink(config["acts"])
    monkeypatch.setattr(writer, "write_shard_file",
                        lambda *a, **kw: (_ for _ in ()).throw(OSError(28, "No space left")))
    sink.write("d", _example("a", 2, SETTINGS))
    deadline = time.monotonic() + 10
    while not sink._failures and time.monotonic() < deadline:
        time.sleep(0.05)
    problems = sink.flush()
    assert len(problems) == 1 and "No space left" in problems[0] and "['a']" in problems[0]
    assert sink.flush() == []  # reported once
    sink.close()


def test_open_datasets_are_bounded(tmp_path):
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "flush_s": 0,
                                               "max_open_datasets": 2}}))["acts"]
    sink = ShardSink(config)
    for name in ("d1", "d2", "d3"):
        sink.write(name, _example("k", 1, SETTINGS))
    assert list(sink._writers) == ["d2", "d3"]  # d1 was flushed and closed to open d3
    assert datasets.open(tmp_path / "d1").keys() == ["k"]
    sink.close()
    for bad in ({"max_open_datasets": 0}, {"rows_per_shard": "x"}, {"flush_s": True},
                {"max_queued_shards": -1}):
        config = parse_config(json.dumps({"acts": {"root": str(tmp_path), **bad}}))["acts"]
        with pytest.raises(ValueError, match="must be a number"):
            ShardSink(config)


def test_a_sink_open_to_clients_refuses_a_new_dataset_rather_than_closing_one_in_use(
        tmp_path, monkeypatch):
    """A client rotating over dataset names cannot make every write flush and reopen a
    dataset: past ``max_open_datasets`` the newcomer is refused while every open dataset was
    written within ``idle_close_s``; an idle one (nothing queued) is closed to make room."""
    from vllm_lens.errors import CapacityError
    from vllm_lens.sinks import shards

    config = parse_config(json.dumps({"acts": {
        "root": str(tmp_path), "clients": True, "flush_s": 0, "max_open_datasets": 2,
        "rows_per_shard": 1, "idle_close_s": 60}}))["acts"]
    sink = ShardSink(config)
    now = [1000.0]
    monkeypatch.setattr(shards.time, "monotonic", lambda: now[0])
    sink.write("d1", _example("k1", 1, SETTINGS))
    sink.write("d2", _example("k1", 1, SETTINGS))
    now[0] += 59
    with pytest.raises(CapacityError) as info:
        sink.write("d3", _example("k1", 1, SETTINGS))
    assert info.value.setting == "VLLM_LENS_SINKS['acts'].max_open_datasets"
    assert "dataset 'd3' was not opened" in str(info.value)
    assert list(sink._writers) == ["d1", "d2"] and not (tmp_path / "d3").exists()
    sink.write("d1", _example("k2", 1, SETTINGS))  # an open dataset is still written
    sink._drain()  # (a dataset whose shard is being written is not idle)
    now[0] += 2  # d2 idle for 61 s (d1 for 2): d2 is closed for d3
    sink.write("d3", _example("k1", 1, SETTINGS))
    assert list(sink._writers) == ["d1", "d3"]
    assert datasets.open(tmp_path / "d2").keys() == ["k1"]
    sink.close()
    # A sink only the operator's jobs write keeps closing the least recently written.
    assert not parse_config(json.dumps({"a": {"root": "/x"}}))["a"].clients
    with pytest.raises(ValueError, match="idle_close_s"):
        ShardSink(parse_config(json.dumps({"acts": {"root": str(tmp_path),
                                                    "idle_close_s": -1}}))["acts"])


def test_a_trailing_newline_is_not_a_name():
    with pytest.raises(ValueError, match="not a valid name"):
        check_name("acts\n", "dataset")


def test_a_sink_not_open_to_clients_is_refused_on_any_route_of_a_server(tmp_path,
                                                                          monkeypatch):
    from vllm_lens.errors import SinkRefusedError
    from vllm_lens.sinks import config as sink_config

    monkeypatch.setenv("VLLM_LENS_SINKS", json.dumps({
        "closed": {"root": str(tmp_path)}, "open": {"root": str(tmp_path), "clients": True},
        "odd": {"root": str(tmp_path), "kind": "ftp"}}))
    capture = {"output_residual_stream": [1]}

    def ask(sink):
        return parse_extra_args({**capture, "capture_sink": {"sink": sink, "dataset": "d",
                                                             "key": "k"}}, lambda: FACTS)

    assert ask("closed")[1].sink.sink == "closed"  # offline: the operator is the caller
    with pytest.raises(LensRequestError, match="misconfigured by the operator.*no sink kind"):
        ask("odd")
    monkeypatch.setattr(sink_config, "_serves_http", True)
    with pytest.raises(SinkRefusedError, match="not open to HTTP clients"):
        ask("closed")
    assert ask("open")[1].sink.sink == "open"


@pytest.mark.parametrize("value, streams", [(True, True), ("true", True), (1, True),
                                            ("1", True), (False, False), (0, False),
                                            ("false", False)])
def test_stream_flag_values_as_http_carries_them(value, streams):
    _, lens = parse_extra_args({"output_residual_stream": [1], "stream_activations": value},
                               lambda: FACTS)
    assert lens.stream is streams


def test_streaming_is_parsed_under_tensor_and_pipeline_parallelism():
    """Served under TP and PP (tests/integration/test_modes_and_parallel.py streams on both)."""
    for facts in (ModelFacts(**{**FACTS.__dict__, "tp_size": 2}),
                  ModelFacts(**{**FACTS.__dict__, "pp_size": 2})):
        _, lens = parse_extra_args({"output_residual_stream": [1], "stream_activations": True},
                                   lambda f=facts: f)
        assert lens.stream


def test_pipeline_stages_write_their_parts_and_the_front_end_joins_their_receipts(
        tmp_path, monkeypatch):
    from vllm_lens.frontend.receipts import join_receipts, unwritten

    sinks = json.dumps({"acts": {"root": str(tmp_path), "flush_s": 0}})
    monkeypatch.setenv("VLLM_LENS_SINKS", sinks)
    config = parse_config(sinks)["acts"]
    stages = [ShardSink(config), ShardSink(config)]  # each stage's worker has its own

    def part(stage, key):
        example = _example(key, 3, SETTINGS, fill=1.0 + stage)
        example.rows = {"resid_post": example.rows["resid_post"][stage:stage + 1]}
        example.writer, example.layers, example.sae_entries = f"dp0-pp{stage}", [1 + stage], []
        return stages[stage].write("d", example)

    first, second = part(0, "a"), part(1, "a")
    assert (first["writer"], first["layers"], first["saes"], first["durable"]) == (
        "dp0-pp0", [1], [], False)
    _, lens = parse_extra_args(
        {"output_residual_stream": [1, 2], "capture_sink": {"sink": "acts", "dataset": "d",
                                                            "key": "a"}},
        lambda: ModelFacts(**{**FACTS.__dict__, "pp_size": 2}))
    assert unwritten(lens, [first]) == (
        "vllm-lens lost part of this request's rows before they reached the sink: no pipeline "
        "stage wrote layers [2] (the stages that did keep their part in the dataset, which "
        "shows the example only once every part is in)")
    assert unwritten(lens, [second, first]) is None
    joined = join_receipts([second, first])
    assert joined == {"sink": "acts", "dataset": "d", "key": "a", "rows": 3,
                      "shapes": {"resid_post": [2, 3, 8]}, "durable": False,
                      "parts": [first, second]}
    assert join_receipts([first]) == first
    stages[0].flush()
    assert datasets.open(tmp_path / "d").keys() == []  # one part in: not an example yet
    stages[1].flush()
    ex = datasets.open(tmp_path / "d").get("a")
    assert torch.equal(ex["resid_post"], torch.stack([torch.full((3, 8), 1.0),
                                                      torch.full((3, 8), 2.0)]))
    assert part(1, "b")["writer"] == "dp0-pp1"
    for sink in stages:
        sink.close()


def test_each_engine_and_stage_names_its_writer(monkeypatch):
    from vllm.config import ParallelConfig

    from vllm_lens.worker.sink_writes import writer_name

    monkeypatch.delenv("VLLM_LENS_SINK_WRITER", raising=False)
    alone = ParallelConfig()
    assert writer_name(alone, 0, shared=False) is None  # the dataset's only writer
    assert writer_name(alone, 0, shared=True) == "dp0-pp0"  # the front end saw DP engines
    assert writer_name(ParallelConfig(pipeline_parallel_size=2), 1, shared=False) == "dp0-pp1"
    # vLLM runs a dense model's DP ranks as independent engines of size 1; the rank stays.
    rank1 = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    rank1.reconfigure_for_independent_dp_rank()
    assert writer_name(rank1, 0, shared=False) == "dp1-pp0"
    external = ParallelConfig(data_parallel_size=2, data_parallel_external_lb=True)
    external.reconfigure_for_independent_dp_rank()
    assert writer_name(external, 0, shared=False) == "dp0-pp0"
    monkeypatch.setenv("VLLM_LENS_SINK_WRITER", "actor-3")  # independent engines, one job
    assert writer_name(alone, 0, shared=False) == "actor-3"
    assert writer_name(rank1, 0, shared=False) == "actor-3-dp1-pp0"
    monkeypatch.setenv("VLLM_LENS_SINK_WRITER", "a/b")
    with pytest.raises(ValueError, match="VLLM_LENS_SINK_WRITER='a/b' must be"):
        writer_name(alone, 0, shared=False)


def test_a_shard_being_synced_holds_no_rows_and_leaves_room_for_the_next(tmp_path,
                                                                        monkeypatch):
    """Once a shard's rows are in its file, it lets go of them: while the disk syncs it, the
    next shard may be handed off (the queue bounds the rows in memory, not the syncs)."""
    from vllm_lens.dataset import writer

    synced, gate, syncing = [], threading.Event(), threading.Event()
    real = writer.publish

    def slow_sync(tmp, path, **kwargs):
        if not path.name.startswith("shard-"):  # (the manifest)
            return real(tmp, path, **kwargs)
        syncing.set()
        assert gate.wait(30), "the test never opened the gate"
        synced.append(path.name)
        real(tmp, path, **kwargs)

    monkeypatch.setattr(writer, "publish", slow_sync)
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 1,
                                               "flush_s": 0, "max_queued_shards": 1}}))["acts"]
    sink = ShardSink(config)
    sink.write("d", _example("k0", 1, SETTINGS, 0))  # shard 0: its rows written, then synced
    assert syncing.wait(30)
    first = sink._queue[0][1]
    assert first.examples == [(first.examples[0][0], {})]  # its rows let go
    done = threading.Event()
    writer = threading.Thread(target=lambda: (sink.write("d", _example("k1", 1, SETTINGS, 1)),
                                              done.set()))
    writer.start()
    assert done.wait(10), "a shard being synced kept the next one waiting"
    assert len(sink._queue) == 2 and synced == []
    # A third shard waits: shard 1 holds its rows (queued behind the one being synced).
    third = threading.Thread(target=sink.write, args=("d", _example("k2", 1, SETTINGS, 2)))
    third.start()
    third.join(0.5)
    assert third.is_alive()
    gate.set()
    third.join(30)
    writer.join(30)
    assert sink.flush() == []
    ds = datasets.open(tmp_path / "d")
    assert ds.keys() == ["k0", "k1", "k2"]
    assert [ds.get(k)["resid_post"][0, 0, 0].item() for k in ds.keys()] == [0, 1, 2]
    sink.close()


def test_a_shard_that_fails_after_letting_go_of_its_rows_is_dropped_and_reported(
        tmp_path, monkeypatch):
    """A sync that fails once the rows are gone from memory drops that shard's examples (no
    row is written again from memory), reports them, and the next shards go on."""
    from vllm_lens.dataset import writer

    real = writer.publish

    def sync_fails_once(tmp, path, **kwargs):
        if path.name == "shard-00000.safetensors":
            raise OSError(5, "Input/output error")
        return real(tmp, path, **kwargs)

    monkeypatch.setattr(writer, "publish", sync_fails_once)
    config = parse_config(json.dumps({"acts": {"root": str(tmp_path), "rows_per_shard": 2,
                                               "flush_s": 0}}))["acts"]
    sink = ShardSink(config)
    for i in range(2):
        sink.write("d", _example(f"a{i}", 1, SETTINGS, i))  # shard 0: its sync fails
    problems = sink.flush()
    assert len(problems) == 1 and "Input/output error" in problems[0]
    assert "['a0', 'a1']" in problems[0] and sink._released == 0
    with pytest.raises(RuntimeError, match=r"keys \['a0', 'a1'\].*was not written"):
        sink.write("d", _example("b0", 1, SETTINGS, 5))  # told once
    for key, fill in (("b0", 5), ("b1", 6), ("a0", 0)):  # a dropped key may come again
        sink.write("d", _example(key, 1, SETTINGS, fill))
    assert sink.flush() == []
    ds = datasets.open(tmp_path / "d")
    assert ds.keys() == ["b0", "b1", "a0"]
    assert [ds.get(k)["resid_post"][0, 0, 0].item() for k in ds.keys()] == [5, 6, 0]
    sink.close()
