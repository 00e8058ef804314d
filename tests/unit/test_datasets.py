"""Activation datasets on disk: shards, index and manifest written atomically, read back by
key, by position and memory-mapped per point and layer; a killed writer leaves a valid
dataset and a resumed one skips what is there."""

import json

import pytest
import torch

from vllm_lens import datasets
from vllm_lens.dataset.format import INDEX
from vllm_lens.dataset.writer import ShardWriter

MANIFEST = {"model": "tiny", "points": ["resid_post", "attn_z"], "layers": [1, 3],
            "dtype": "bfloat16", "row_shapes": {"resid_post": [8], "attn_z": [2, 4]},
            "positions": "all"}


def example(i, n_rows):
    g = torch.Generator().manual_seed(i)
    return {"resid_post": torch.randn(2, n_rows, 8, generator=g),
            "attn_z": torch.randn(2, n_rows, 2, 4, generator=g)}


def write(root, keys, rows_per_shard=5, resume=False):
    written = {}
    with ShardWriter(root, MANIFEST, rows_per_shard=rows_per_shard, resume=resume) as w:
        for i, key in keys:
            n = 1 + i % 4
            written[key] = example(i, n)
            w.add(key, written[key], positions=range(10, 10 + n), prompt_token_ids=[i, i + 1])
    return written


def test_examples_come_back_exactly_by_index_key_and_point(tmp_path):
    written = write(tmp_path, [(i, f"ex{i}") for i in range(7)])
    ds = datasets.open(tmp_path)
    assert len(ds) == 7 and ds.keys() == [f"ex{i}" for i in range(7)]
    assert len(list(tmp_path.glob("shard-*.safetensors"))) > 1  # 5 rows per shard
    for i, ex in enumerate(ds):
        want = written[f"ex{i}"]
        assert ex["key"] == f"ex{i}" and ex["prompt_token_ids"] == [i, i + 1]
        assert ex["positions"].tolist() == list(range(10, 10 + 1 + i % 4))
        for point in ("resid_post", "attn_z"):
            assert ex[point].dtype == torch.bfloat16
            assert torch.equal(ex[point], want[point].to(torch.bfloat16))
    assert torch.equal(ds.get("ex3")["attn_z"], ds[3]["attn_z"])
    rows = ds.tensor("resid_post", 3)  # layer 3 is the second captured layer
    assert torch.equal(rows, torch.cat([written[k]["resid_post"][1] for k in ds.keys()])
                       .to(torch.bfloat16))
    with pytest.raises(KeyError, match="not attn_out at 3"):
        ds.tensor("attn_out", 3)


def test_rows_are_read_through_a_copy_on_write_map_of_the_shard(tmp_path):
    write(tmp_path, [(0, "a"), (1, "b")], rows_per_shard=1000)
    part = datasets.open(tmp_path).tensor("attn_z", 1)  # one shard: no copy
    assert part.shape == (1 + 2, 2, 4) and part.abs().sum() > 0
    shard = next(tmp_path.glob("shard-*.safetensors"))
    with open("/proc/self/maps") as maps:
        assert str(shard) in maps.read()
    before = shard.read_bytes()
    part -= 1.0  # writable, and the file never sees it
    assert shard.read_bytes() == before


def test_a_killed_writer_leaves_a_valid_dataset_and_resume_skips_what_is_there(tmp_path):
    write(tmp_path, [(i, f"ex{i}") for i in range(4)])
    # Killed while appending to the index, after a shard that never got its lines:
    with open(tmp_path / INDEX, "a") as f:
        f.write('{"key": "half')
    (tmp_path / "shard-00099.safetensors").write_bytes(b"partial")
    ds = datasets.open(tmp_path)
    assert ds.keys() == [f"ex{i}" for i in range(4)]  # the partial line is no entry
    more = write(tmp_path, [(i, f"ex{i}") for i in range(4, 9)], resume=True)
    ds = datasets.open(tmp_path)
    assert ds.keys() == [f"ex{i}" for i in range(9)]
    assert not (tmp_path / "shard-00099.safetensors").exists()
    assert torch.equal(ds.get("ex8")["resid_post"], more["ex8"]["resid_post"].to(torch.bfloat16))
    for line in (tmp_path / INDEX).read_text().splitlines():
        json.loads(line)


def test_a_shard_whose_lines_did_not_all_arrive_is_dropped_on_resume(tmp_path):
    write(tmp_path, [(i, f"ex{i}") for i in range(6)], rows_per_shard=100)  # one shard
    index = tmp_path / INDEX
    lines = index.read_text().splitlines(keepends=True)
    index.write_text("".join(lines[:4]))  # killed after four of its six lines
    ds = datasets.open(tmp_path)
    assert len(ds) == 4 and ds.tensor("resid_post", 1).shape[0] == sum(
        e["rows"] for e in ds.entries)  # only rows the index covers
    write(tmp_path, [(i, f"ex{i}") for i in range(6, 8)], resume=True)
    assert datasets.open(tmp_path).keys() == ["ex6", "ex7"]  # the torn shard went as a whole


def test_a_failed_flush_leaves_nothing_behind_and_keeps_the_examples(tmp_path, monkeypatch):
    from vllm_lens.dataset import writer

    w = ShardWriter(tmp_path, MANIFEST)
    w.add("a", example(0, 2), positions=[0, 1])
    real = writer.write_shard_file

    def full_disk(path, tensors, **kw):
        real(path, tensors, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_shard_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        w.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "manifest.json"]
    monkeypatch.setattr(writer, "write_shard_file", real)
    w.close()
    assert datasets.open(tmp_path).keys() == ["a"]


def test_a_damaged_index_line_is_an_error_not_a_truncation(tmp_path):
    write(tmp_path, [(i, f"ex{i}") for i in range(3)])
    lines = (tmp_path / INDEX).read_text().splitlines(keepends=True)
    (tmp_path / INDEX).write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match="line 2 is not an index entry"):
        datasets.open(tmp_path)
    with pytest.raises(ValueError, match="damaged"):
        ShardWriter(tmp_path, MANIFEST, resume=True)


def test_an_empty_dataset_and_a_second_writer(tmp_path):
    with ShardWriter(tmp_path, MANIFEST):
        with pytest.raises(RuntimeError, match="another writer"):
            ShardWriter(tmp_path, MANIFEST, resume=True)
    ds = datasets.open(tmp_path)
    assert len(ds) == 0 and ds.tensor("attn_z", 3).shape == (0, 2, 4)


def test_a_dtype_no_shard_can_hold_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="'complex64' is not one a shard holds"):
        ShardWriter(tmp_path, {**MANIFEST, "dtype": "complex64"})


def test_bad_examples_and_reopening_without_resume_are_refused(tmp_path):
    write(tmp_path, [(0, "a")])
    with pytest.raises(FileExistsError, match="resume=True"):
        ShardWriter(tmp_path, MANIFEST)
    with pytest.raises(ValueError, match="manifest has layers"):
        ShardWriter(tmp_path, {**MANIFEST, "layers": [2]}, resume=True)
    with pytest.raises(ValueError, match="manifest has positions"):
        ShardWriter(tmp_path, {**MANIFEST, "positions": "last_prompt"}, resume=True)
    ShardWriter(tmp_path, {**MANIFEST, "vllm_version": "9"}, resume=True).close()
    w = ShardWriter(tmp_path / "other", MANIFEST)
    with pytest.raises(ValueError, match="attn_z has shape"):
        w.add("x", {**example(0, 2), "attn_z": torch.zeros(2, 2, 3, 4)}, positions=[0, 1])
    with pytest.raises(ValueError, match="no rows of attn_z"):
        w.add("x", {"resid_post": torch.zeros(2, 1, 8)}, positions=[0])
    w.add("x", example(0, 1), positions=[0])
    with pytest.raises(ValueError, match="already in the dataset"):
        w.add("x", example(0, 1), positions=[0])
    with pytest.raises(ValueError, match="non-empty strings"):
        w.add(7, example(0, 1), positions=[0])
    with pytest.raises(ValueError, match="2 positions for 1 rows"):
        w.add("y", example(0, 1), positions=[0, 1])
    w.close()
    with pytest.raises(FileNotFoundError, match="not an activation dataset"):
        datasets.open(tmp_path / "nowhere")


def features(i, n_rows, top_k, reconstruction):
    g = torch.Generator().manual_seed(100 + i)
    found = {"indices": torch.randint(-1, 50, (n_rows, top_k), generator=g, dtype=torch.int32),
             "values": torch.rand(n_rows, top_k, generator=g)}
    if reconstruction:
        found["nmse"] = torch.rand(n_rows, generator=g)
        found["l0"] = torch.randint(0, 50, (n_rows,), generator=g, dtype=torch.int32)
    return found


SAES = [{"sae": "l1", "point": "resid_post", "layer": 1, "d_sae": 50, "top_k": 3,
         "reconstruction": True},
        {"sae": "l3", "point": "mlp_out", "layer": 3, "d_sae": 50, "top_k": 2,
         "reconstruction": False}]


@pytest.mark.parametrize("with_points", [True, False])
def test_sae_features_are_written_beside_the_rows_and_read_back_per_example(tmp_path,
                                                                            with_points):
    manifest = {**MANIFEST, "sae_features": SAES}
    if not with_points:
        manifest = {**manifest, "points": [], "layers": [], "row_shapes": {}}
    written = {}
    with ShardWriter(tmp_path, manifest, rows_per_shard=5) as w:
        for i in range(6):
            n = 1 + i % 4
            rows = example(i, n) if with_points else {}
            saes = [features(i, n, 3, True), features(i, n, 2, False)]
            written[f"ex{i}"] = (rows, saes)
            w.add(f"ex{i}", rows, positions=range(n), sae_features=saes)
        with pytest.raises(ValueError, match="SAE entry 1's indices has shape"):
            w.add("bad", example(9, 2) if with_points else {}, positions=range(2),
                  sae_features=[features(9, 2, 3, True), features(9, 3, 2, False)])
        with pytest.raises(ValueError, match="1 SAE feature entries, the dataset 2"):
            w.add("bad", example(9, 2) if with_points else {}, positions=range(2),
                  sae_features=[features(9, 2, 3, True)])
    ds = datasets.open(tmp_path)
    assert ds.keys() == [f"ex{i}" for i in range(6)] and len(ds.saes) == 2
    assert len(list(tmp_path.glob("shard-*.safetensors"))) > 1
    for ex in ds:
        rows, saes = written[ex["key"]]
        first, second = ex["sae_features"]
        assert (first["sae"], first["layer"], second["point"]) == ("l1", 1, "mlp_out")
        assert set(second) == {"sae", "layer", "point", "positions", "indices", "values"}
        for got, want in zip((first, second), saes):
            assert torch.equal(got["positions"], ex["positions"])
            for field, tensor in want.items():
                assert got[field].dtype == tensor.dtype and torch.equal(got[field], tensor)
        assert with_points == ("resid_post" in ex)
    values = ds.sae_tensor(0, "values")
    assert torch.equal(values, torch.cat([written[k][1][0]["values"] for k in ds.keys()]))
    with pytest.raises(KeyError, match="not nmse of SAE 1"):
        ds.sae_tensor(1, "nmse")
    # A resumed writer of the same dataset keeps to its SAEs.
    with ShardWriter(tmp_path, manifest, resume=True) as w:
        w.add("more", example(7, 1) if with_points else {}, positions=[0],
              sae_features=[features(7, 1, 3, True), features(7, 1, 2, False)])
    assert datasets.open(tmp_path).keys()[-1] == "more"
