"""The shard file writer: plain safetensors, read back by ``safetensors.safe_open``, whichever
way the bytes reach the disk."""

import errno
import fcntl
import multiprocessing
import os

import pytest
import torch
from safetensors import safe_open

from vllm_lens.dataset import shard_file
from vllm_lens.dataset.shard_file import write_shard_file


def _tensors():
    base = torch.randn(3, 10, 7)
    return {
        "resid_post/0": [base[0, :4], base[1, 2:9], base[2, 1:3]],
        "ids": [torch.arange(5, dtype=torch.int64)],
        "empty": [torch.zeros(0, 3, dtype=torch.bfloat16)],
        "flags": [torch.tensor([True, False])],
        "half": [torch.randn(2, 3).to(torch.bfloat16), torch.randn(1, 3).to(torch.bfloat16)],
        "sae.0.indices": [torch.arange(6, dtype=torch.int32).view(3, 2)],
        "strided": [base.transpose(0, 1)[:, 0]],  # a view that is not contiguous
    }


def _read(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _check(path, tensors):
    got = _read(path)
    assert set(got) == set(tensors)
    for name, parts in tensors.items():
        want = torch.cat(parts)
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    assert start % 4096 == 0  # the data starts where an O_DIRECT write may
    data = sum(t.numel() * t.element_size() for t in map(torch.cat, tensors.values()))
    assert len(raw) == start + data  # cut to its exact length


def test_mixed_dtypes_views_and_empty_tensors_read_back(tmp_path):
    tensors = _tensors()
    write_shard_file(tmp_path / "shard.safetensors", tensors)
    _check(tmp_path / "shard.safetensors", tensors)


def test_through_the_page_cache_where_o_direct_is_missing(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    tensors = _tensors()
    write_shard_file(tmp_path / "shard.safetensors", tensors)
    _check(tmp_path / "shard.safetensors", tensors)


def test_a_rewritten_file_is_replaced_whole(tmp_path):
    path = tmp_path / "shard.safetensors"
    write_shard_file(path, {"big": [torch.randn(5000, 8)]})
    small = {"small": [torch.randn(2, 8)]}
    write_shard_file(path, small)
    _check(path, small)


def test_the_thread_keeps_a_buffer_as_large_as_its_largest_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_file._local, "buffer", None)  # (other tests' shards)
    write_shard_file(tmp_path / "a.safetensors", {"x": [torch.randn(10, 4)]})
    kept = shard_file._local.buffer
    write_shard_file(tmp_path / "b.safetensors", {"x": [torch.randn(20, 4)]})
    assert shard_file._local.buffer is kept  # (it fits)
    write_shard_file(tmp_path / "c.safetensors", {"x": [torch.randn(3000, 4)]})
    grown = shard_file._local.buffer
    assert len(grown) == 53248  # header and data, to the next 4 KiB: one write
    write_shard_file(tmp_path / "d.safetensors", {"x": [torch.randn(10, 4)]})
    assert shard_file._local.buffer is grown


@pytest.mark.parametrize("direct", [True, False])
def test_a_shard_larger_than_the_buffer_goes_out_in_pieces(tmp_path, monkeypatch, direct):
    """Parts, tensors and the header itself straddle the buffer's end."""
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(shard_file, "MAX_BUFFER_BYTES", 2 * 4096)
    tensors = {f"layer/{i}": [torch.randn(n, 7) for n in (3, 30, 0, 41)] for i in range(200)}
    tensors["ids"] = [torch.arange(999, dtype=torch.int64)]
    tensors["half"] = [torch.randn(333, 5).to(torch.bfloat16)]
    write_shard_file(tmp_path / "big.safetensors", tensors)
    assert len(shard_file._local.buffer) == 2 * 4096
    _check(tmp_path / "big.safetensors", tensors)


@pytest.mark.parametrize("chunk", [2 * 4096, 1 << 20])
def test_the_parts_are_not_read_after_copied_is_called(tmp_path, monkeypatch, chunk):
    """Once told, the caller may reuse or free the parts: the file holds what they held."""
    monkeypatch.setattr(shard_file, "MAX_BUFFER_BYTES", chunk)
    tensors = {f"layer/{i}": [torch.randn(n, 7) for n in (30, 41)] for i in range(20)}
    want = {name: [p.clone() for p in parts] for name, parts in tensors.items()}
    calls = []

    def copied():
        calls.append(True)
        for parts in tensors.values():
            for p in parts:
                p.zero_()

    write_shard_file(tmp_path / "a.safetensors", tensors, copied=copied)
    assert calls == [True]
    _check(tmp_path / "a.safetensors", want)


def test_o_direct_refused_at_open_or_first_write_falls_back(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS")
    real_open, real_pwrite = os.open, os.pwrite
    refused = []

    def open_refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            refused.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_refusing)
    tensors = _tensors()
    write_shard_file(tmp_path / "a.safetensors", tensors)
    _check(tmp_path / "a.safetensors", tensors)
    monkeypatch.setattr(os, "open", real_open)

    def pwrite_refusing(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append("write")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_refusing)
    write_shard_file(tmp_path / "b.safetensors", tensors)
    _check(tmp_path / "b.safetensors", tensors)
    assert refused == ["open", "write"]


def test_a_refused_write_after_the_first_is_an_error(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS")
    monkeypatch.setattr(shard_file, "MAX_BUFFER_BYTES", 2 * 4096)
    real_pwrite = os.pwrite

    def second_refused(fd, data, offset):
        if offset > 0:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", second_refused)
    with pytest.raises(OSError, match="Invalid argument"):
        write_shard_file(tmp_path / "a.safetensors", {"x": [torch.randn(1000, 4)]})


def _write_in_child(path, value):
    for i in range(30):
        write_shard_file(f"{path}-{i}", {"x": [torch.full((500, 4), float(value))]})


def test_a_forked_child_never_writes_into_its_parents_buffer(tmp_path):
    write_shard_file(tmp_path / "first", {"x": [torch.zeros(500, 4)]})  # (the buffer exists)
    child = multiprocessing.get_context("fork").Process(
        target=_write_in_child, args=(str(tmp_path / "child"), 1))
    child.start()
    _write_in_child(str(tmp_path / "parent"), 2)
    child.join(60)
    assert child.exitcode == 0
    for who, value in (("child", 1), ("parent", 2)):
        for i in range(30):
            assert torch.equal(_read(tmp_path / f"{who}-{i}")["x"],
                               torch.full((500, 4), float(value))), (who, i)


def test_parts_that_do_not_match_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'x'.*differ"):
        write_shard_file(tmp_path / "a.safetensors",
                         {"x": [torch.zeros(2, 3), torch.zeros(2, 4)]})
    with pytest.raises(ValueError, match="'y'.*dtype"):
        write_shard_file(tmp_path / "a.safetensors", {"y": [torch.zeros(2, dtype=torch.cfloat)]})
    with pytest.raises(ValueError, match="'z' has no parts"):
        write_shard_file(tmp_path / "a.safetensors", {"z": []})
