"""One activation dataset written by several writers at once — data-parallel engines,
pipeline stages (each its part of an example), independent engines — in separate processes:
read back exactly, a killed writer resumes losing nothing it acknowledged, the index's torn
lines are cut, names are exclusive, and old single-writer datasets still read and resume."""

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch

from vllm_lens import datasets
from vllm_lens.dataset.index import complete_keys
from vllm_lens.errors import DatasetConflictError
from vllm_lens.dataset.format import INDEX
from vllm_lens.dataset.writer import ShardWriter

MANIFEST = {"model": "tiny", "points": ["resid_post"], "layers": [1, 3], "dtype": "float32",
            "row_shapes": {"resid_post": [4]}, "positions": "all",
            "sae_features": [{"sae": "s", "point": "resid_post", "layer": 3, "d_sae": 9,
                              "top_k": 2, "reconstruction": False}]}


def rows(key, n_rows):
    """An example's rows, made from its key (any process makes the same ones)."""
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 31 + n_rows)
    return torch.randn(2, n_rows, 4, generator=g)


def features(key, n_rows):
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 17 + n_rows)
    return {"indices": torch.randint(-1, 9, (n_rows, 2), generator=g, dtype=torch.int32),
            "values": torch.rand(n_rows, 2, generator=g)}


def add_whole(w, key, n_rows):
    w.add(key, {"resid_post": rows(key, n_rows)}, positions=range(n_rows),
          prompt_token_ids=[n_rows], sae_features=[features(key, n_rows)])


def _write_keys(root, writer, keys, acks=None, start=None):
    """A writer process: its keys, 2 rows each, 3 rows a shard; each shard's keys are
    acknowledged (appended to ``acks``) once its flush returned. With ``start`` (a barrier)
    it waits for the other writers to have opened the dataset too."""
    with ShardWriter(root, MANIFEST, rows_per_shard=3, resume=True, writer=writer) as w:
        if start is not None:
            start.wait(60)
        for key in keys:
            before = w.pending_keys
            add_whole(w, key, 2)
            if acks is not None and not w.pending_keys:
                with open(acks, "a") as f:
                    f.write("".join(k + "\n" for k in [*before, key]))


def _run_processes(*targets):
    """Run ``_write_keys`` in a process per argument tuple, all writing at once."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(len(targets))
    procs = [ctx.Process(target=_write_keys, args=(*args, None, start)) for args in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    return procs


def check_exact(ds, keys):
    assert sorted(ds.keys()) == sorted(keys)
    for ex in ds:
        n = len(ex["positions"])
        assert torch.equal(ex["resid_post"], rows(ex["key"], n))
        for field, t in features(ex["key"], n).items():
            assert torch.equal(ex["sae_features"][0][field], t)
    assert torch.equal(ds.tensor("resid_post", 3),
                       torch.cat([rows(k, len(ds.get(k)["positions"]))[1] for k in ds.keys()]))


def test_two_writers_in_two_processes_write_one_dataset_at_once(tmp_path):
    a = [f"a{i}" for i in range(40)]
    b = [f"b{i}" for i in range(40)]
    _run_processes((tmp_path, "dp0-pp0", a), (tmp_path, "dp1-pp0", b))
    ds = datasets.open(tmp_path)
    check_exact(ds, a + b)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"shard-dp0-pp0-00000.safetensors", "shard-dp1-pp0-00013.safetensors",
            "manifest.json", INDEX} <= names
    assert not any(n.startswith("shard-0") or ".tmp" in n for n in names)
    writers = [json.loads(x)["writer"] for x in (tmp_path / INDEX).read_text().splitlines()]
    assert set(writers) == {"dp0-pp0", "dp1-pp0"}
    assert sum(a != b for a, b in zip(writers, writers[1:])) >= 2  # their appends interleave
    assert len(ds.shard_tensors("resid_post", 1)) >= 2  # two shard series


def test_a_killed_writer_resumes_and_loses_nothing_it_acknowledged(tmp_path):
    acks = tmp_path / "acks"
    acks.touch()
    root = tmp_path / "d"
    ctx = multiprocessing.get_context("spawn")
    keys = [f"k{i}" for i in range(100000)]
    victim = ctx.Process(target=_write_keys, args=(root, "w0", keys, acks))
    other = ctx.Process(target=_write_keys, args=(root, "w1", [f"o{i}" for i in range(30)]))
    victim.start()
    other.start()
    deadline = time.monotonic() + 120
    while len(acks.read_text().splitlines()) < 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)  # anywhere: mid-shard, mid-append ...
    victim.join()
    other.join(120)
    assert other.exitcode == 0
    acknowledged = acks.read_text().splitlines()
    assert len(acknowledged) >= 12
    there = set(datasets.open(root).keys())
    assert set(acknowledged) <= there
    # Resumed under its name: it skips what is there and writes the rest.
    done = [k for k in keys if k in there]
    _write_keys(root, "w0", [k for k in keys[:len(done) + 10] if k not in there])
    ds = datasets.open(root)
    check_exact(ds, keys[:len(done) + 10] + [f"o{i}" for i in range(30)])
    assert not [p for p in root.iterdir() if ".tmp" in p.name]


def test_a_partial_last_line_is_cut_by_the_next_writer_and_a_torn_shard_by_its_own(tmp_path):
    _write_keys(tmp_path, "a", ["x0", "x1", "x2", "x3"])  # two shards of two examples
    with open(tmp_path / INDEX, "a") as f:
        f.write('{"key": "half')  # a writer killed while appending
    assert datasets.open(tmp_path).keys() == ["x0", "x1", "x2", "x3"]
    _write_keys(tmp_path, "b", ["y0", "y1"])
    lines = (tmp_path / INDEX).read_text().splitlines()
    assert [json.loads(x)["key"] for x in lines] == ["x0", "x1", "x2", "x3", "y0", "y1"]
    # Writer a's last shard got only one of its two lines: a resumes by dropping that
    # shard's line (its examples were never acknowledged) and the shard, not b's lines.
    kept = [x for x in lines if json.loads(x)["key"] != "x3"]
    (tmp_path / INDEX).write_text("".join(x + "\n" for x in kept))
    _write_keys(tmp_path, "a", ["x4"])
    check_exact(datasets.open(tmp_path), ["x0", "x1", "y0", "y1", "x4"])
    assert datasets.open(tmp_path).keys() == ["x0", "x1", "y0", "y1", "x4"]
    assert json.loads((tmp_path / INDEX).read_text().splitlines()[-1])["shard"] == 1


def test_names_are_exclusive_and_a_single_writer_holds_the_directory_alone(tmp_path):
    with ShardWriter(tmp_path, MANIFEST, resume=True, writer="w"):
        with pytest.raises(RuntimeError, match="as writer 'w'; give each writer its own name"):
            ShardWriter(tmp_path, MANIFEST, resume=True, writer="w")
        with pytest.raises(RuntimeError, match="another writer has this dataset open"):
            ShardWriter(tmp_path, MANIFEST, resume=True)
        ShardWriter(tmp_path, MANIFEST, resume=True, writer="v").close()
    with ShardWriter(tmp_path, MANIFEST, resume=True):
        with pytest.raises(RuntimeError, match="a writer without a name has this dataset"):
            ShardWriter(tmp_path, MANIFEST, resume=True, writer="w")
    for bad in ("", "a/b", "a+b", "x" * 65, "é"):
        with pytest.raises(ValueError, match="writer name"):
            ShardWriter(tmp_path, MANIFEST, resume=True, writer=bad)
    with pytest.raises(DatasetConflictError, match="manifest has layers"):
        ShardWriter(tmp_path, {**MANIFEST, "layers": [1]}, resume=True, writer="w")


def test_single_writer_datasets_keep_their_files_and_mix_with_named_writers(tmp_path):
    with ShardWriter(tmp_path, MANIFEST) as w:
        add_whole(w, "old", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock", INDEX, "manifest.json", "shard-00000.safetensors"]
    line = json.loads((tmp_path / INDEX).read_text())
    assert list(line) == ["key", "rows", "positions", "prompt_token_ids", "token_ids",
                          "shard", "offset"]
    _write_keys(tmp_path, "dp1-pp0", ["new"])
    with ShardWriter(tmp_path, MANIFEST, resume=True) as w:  # alone again, after them
        with pytest.raises(DatasetConflictError, match="'new' is already in the dataset"):
            add_whole(w, "new", 2)
        add_whole(w, "later", 1)
    ds = datasets.open(tmp_path)
    check_exact(ds, ["old", "new", "later"])
    assert complete_keys(tmp_path) == ["old", "new", "later"]


def add_part(w, key, n_rows, stage):
    """Stage 0 holds layer 1; stage 1 layer 3 and the SAE at it."""
    if stage == 0:
        return w.add(key, {"resid_post": rows(key, n_rows)[:1]}, positions=range(n_rows),
                     prompt_token_ids=[n_rows], layers=[1], saes=[])
    return w.add(key, {"resid_post": rows(key, n_rows)[1:]}, positions=range(n_rows),
                 prompt_token_ids=[n_rows], layers=[3], saes=[0],
                 sae_features=[features(key, n_rows)])


def test_pipeline_stages_write_parts_and_readers_see_complete_examples_only(tmp_path):
    first = ShardWriter(tmp_path, MANIFEST, rows_per_shard=1, resume=True, writer="dp0-pp0")
    second = ShardWriter(tmp_path, MANIFEST, rows_per_shard=1, resume=True, writer="dp0-pp1")
    for i in range(4):
        add_part(first, f"e{i}", 1 + i, 0)
    for i in (2, 0, 1):
        add_part(second, f"e{i}", 1 + i, 1)
    ds = datasets.open(tmp_path)  # while it is being written
    assert ds.keys() == ["e2", "e0", "e1"]  # in the order they were completed
    check_exact(ds, ["e0", "e1", "e2"])
    with pytest.raises(KeyError):
        ds.get("e3")
    assert torch.equal(ds.sae_tensor(0, "values"),
                       torch.cat([features(k, len(ds.get(k)["positions"]))["values"]
                                  for k in ds.keys()]))
    assert complete_keys(tmp_path) == ["e2", "e0", "e1"]
    assert first.durable("e3") and not second.durable("e3")
    # A complete example is a conflict; a part the index already has (a resumed job sending
    # an incomplete example again) is not written twice.
    with pytest.raises(DatasetConflictError, match="'e0' is already in the dataset"):
        add_part(first, "e0", 1, 0)
    placed = add_part(first, "late", 2, 0)
    size = (tmp_path / INDEX).stat().st_size
    assert add_part(first, "late", 2, 0) == placed and first.durable("late")
    assert (tmp_path / INDEX).stat().st_size == size
    add_part(second, "late", 2, 1)
    add_part(second, "e3", 4, 1)
    first.close()
    second.close()
    ds = datasets.open(tmp_path)
    assert ds.keys() == ["e2", "e0", "e1", "late", "e3"]
    check_exact(ds, ["e0", "e1", "e2", "e3", "late"])
    lines = [json.loads(x) for x in (tmp_path / INDEX).read_text().splitlines()]
    assert sum(line["key"] == "late" for line in lines) == 2
    assert {(line["writer"], tuple(line["layers"]), tuple(line["saes"])) for line in lines} == {
        ("dp0-pp0", (1,), ()), ("dp0-pp1", (3,), (0,))}
    with pytest.raises(ValueError, match="layers \\[3, 1\\] are not the manifest's"):
        ShardWriter(tmp_path, MANIFEST, resume=True, writer="x").add(
            "bad", {"resid_post": torch.zeros(2, 1, 4)}, positions=[0], layers=[3, 1])


def test_parts_of_another_run_of_a_key_are_not_joined(tmp_path):
    """A pipeline job killed between its stages' flushes runs the key again, and a sampled
    run may differ: a part of another run (other rows or tokens) is not joined to the first
    run's, and the example stays incomplete, for readers and writers alike, until a part of
    the first run arrives; the rest of the dataset reads as before."""
    first = ShardWriter(tmp_path, MANIFEST, rows_per_shard=1, resume=True, writer="dp0-pp0")
    second = ShardWriter(tmp_path, MANIFEST, rows_per_shard=1, resume=True, writer="dp0-pp1")
    add_part(first, "ok", 2, 0)
    add_part(second, "ok", 2, 1)
    add_part(first, "k", 2, 0)
    add_part(second, "k", 3, 1)  # another run: 3 rows
    second.close()
    second = ShardWriter(tmp_path, MANIFEST, rows_per_shard=1, resume=True, writer="dp0-pp2")
    second.add("k", {"resid_post": rows("k", 2)[1:]}, positions=range(2),
               prompt_token_ids=[99], layers=[3], saes=[0],  # same rows, other tokens
               sae_features=[features("k", 2)])
    ds = datasets.open(tmp_path)
    assert ds.keys() == ["ok"] and complete_keys(tmp_path) == ["ok"]
    check_exact(ds, ["ok"])
    add_part(second, "k", 2, 1)  # the first run's part: now complete
    first.close()
    second.close()
    assert datasets.open(tmp_path).keys() == ["ok", "k"] == complete_keys(tmp_path)
    check_exact(datasets.open(tmp_path), ["ok", "k"])


def test_lines_read_then_rolled_back_are_forgotten_by_the_other_writers(tmp_path):
    """A failed append is cut back (``append_lines``); a writer that read its lines meanwhile
    reads the index again, whether the file shrank or grew again with other lines, instead
    of refusing keys that are not in the dataset or reading from the middle of a line."""
    # (a queues its examples until it closes: only b and the failed appends write meanwhile)
    a = ShardWriter(tmp_path, MANIFEST, rows_per_shard=100, resume=True, writer="a")
    b = ShardWriter(tmp_path, MANIFEST, rows_per_shard=1, resume=True, writer="b")
    add_whole(b, "x", 1)
    add_whole(a, "y", 1)  # a reads x's line
    index = tmp_path / INDEX
    real = index.read_bytes()
    x_line = json.loads(real.decode().splitlines()[0])
    for ghost, then in (("g", "shrink"), ("ghost-two", "regrow"), ("g3", "same length")):
        before = index.stat().st_size
        ghost_line = json.dumps({**x_line, "key": ghost, "shard": 7}) + "\n"
        with open(index, "a") as f:  # as if b's append got this far, then failed
            f.write(ghost_line)
        add_whole(a, f"after-{ghost}", 1)  # a reads the ghost's line
        with open(index, "r+b") as f:
            f.truncate(before)
        if then == "regrow":  # b appends again, a longer line where the ghost's ended
            add_whole(b, "a-much-longer-key-than-the-ghost-had", 1)
            assert index.stat().st_size > before + len(ghost_line)
        if then == "same length":  # b's next line ends exactly where the ghost's did
            add_whole(b, "q3", 1)
            assert index.stat().st_size == before + len(ghost_line)
        add_whole(a, ghost, 1)  # not "already in the dataset"
    for key in ("a-much-longer-key-than-the-ghost-had", "q3"):  # b's, read whole
        with pytest.raises(DatasetConflictError, match="already in the dataset"):
            add_whole(a, key, 1)
    a.close()
    b.close()
    assert sorted(datasets.open(tmp_path).keys()) == sorted(
        ["x", "y", "after-g", "g", "after-ghost-two", "ghost-two",
         "a-much-longer-key-than-the-ghost-had", "after-g3", "g3", "q3"])


def test_a_shard_that_cannot_be_read_is_not_taken_for_a_torn_one(tmp_path):
    """Resuming, a writer checks its last shard against the index; a shard missing or cut
    short is torn (its lines dropped), but one that cannot be read now (an I/O or permission
    error) stops the resume with the path, changing nothing."""
    _write_keys(tmp_path, "a", ["x0", "x1", "x2", "x3"])  # shards 0 and 1 of writer a
    shard = tmp_path / "shard-a-00001.safetensors"
    assert shard.exists()
    saved = shard.read_bytes()
    shard.unlink()
    shard.mkdir()  # reading it fails with IsADirectoryError, an OSError
    index = (tmp_path / INDEX).read_bytes()
    with pytest.raises(OSError, match="cannot read the shard's header"):
        ShardWriter(tmp_path, MANIFEST, resume=True, writer="a")
    assert (tmp_path / INDEX).read_bytes() == index
    shard.rmdir()
    shard.write_bytes(saved)
    check_exact(datasets.open(tmp_path), ["x0", "x1", "x2", "x3"])
