"""``vllm_lens.safetensors_file``: a file written from tensors in parts is what the safetensors
library reads, for every dtype the datasets use."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_lens import safetensors_file


def _parts(dtype, shapes, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        t = torch.randn(shape, generator=g) * 100
        out.append(t > 0 if dtype == torch.bool else t.to(dtype))
    return out


def test_parts_of_every_dtype_read_back_joined_by_the_safetensors_library(tmp_path):
    columns = {}
    for i, (name, (_, dtype)) in enumerate(safetensors_file.DTYPES.items()):
        # Odd row sizes for the narrow dtypes: a wider column after them would start off its
        # alignment unless the wider columns come first.
        columns[f"col/{name}"] = _parts(dtype, [(3, 5), (0, 5), (2, 5)], i)
    columns["3d"] = _parts(torch.float32, [(2, 4, 3), (1, 4, 3)], 99)
    # A part that is a view with strides of its own (a layer of an example's rows).
    whole = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    columns["views"] = [whole[1], whole[0, 1:]]
    path = tmp_path / "x.safetensors"
    size = safetensors_file.write(path, columns)
    assert size == path.stat().st_size
    loaded = load_file(path)
    assert sorted(loaded) == sorted(columns)
    for name, parts in columns.items():
        assert loaded[name].dtype == parts[0].dtype
        assert torch.equal(loaded[name], torch.cat(parts)), name
    with safe_open(path, "pt") as f:  # the header the library parses
        assert set(f.keys()) == set(columns)


def test_data_offsets_are_aligned_to_each_element_size(tmp_path):
    import json
    import struct

    columns = {"bytes": [torch.ones(3, dtype=torch.uint8)],
               "halves": [torch.ones(1, dtype=torch.float16)],
               "longs": [torch.ones(2, dtype=torch.int64)],
               "floats": [torch.ones(1, dtype=torch.float32)]}
    path = tmp_path / "x.safetensors"
    safetensors_file.write(path, columns)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    for name, info in header.items():
        assert info["data_offsets"][0] % columns[name][0].element_size() == 0, name


def test_columns_that_cannot_be_written_are_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="'a' has no parts"):
        safetensors_file.write(path, {"a": []})
    with pytest.raises(ValueError, match="'a': parts of torch.float32 \\[2\\] and "
                                         "torch.float16 \\[2\\] cannot be joined"):
        safetensors_file.write(path, {"a": [torch.ones(1, 2), torch.ones(1, 2).half()]})
    with pytest.raises(ValueError, match="'a': parts of torch.float32 \\[2\\] and "
                                         "torch.float32 \\[3\\]"):
        safetensors_file.write(path, {"a": [torch.ones(1, 2), torch.ones(1, 3)]})
    with pytest.raises(ValueError, match="'a': safetensors has no dtype torch.complex64"):
        safetensors_file.write(path, {"a": [torch.ones(1, dtype=torch.complex64)]})
    with pytest.raises(ValueError, match="'a': parts need a first dimension"):
        safetensors_file.write(path, {"a": [torch.tensor(1.0)]})


def test_short_writes_are_continued_where_they_stopped(tmp_path, monkeypatch):
    """The kernel may take fewer bytes than asked (a signal, a pipe-like file system): the
    rest is written by the next calls, also from the middle of a part."""
    import os

    real, calls = os.writev, []

    def at_most_1000_bytes(fd, buffers):
        calls.append(len(buffers))
        taken, budget = [], 1000
        for b in buffers:
            if budget <= 0:
                break
            taken.append(b[:budget])
            budget -= len(taken[-1])
        return real(fd, taken)

    monkeypatch.setattr(safetensors_file.os, "writev", at_most_1000_bytes)
    columns = {"a": _parts(torch.float32, [(70, 33), (50, 33)], 1),
               "b": _parts(torch.bfloat16, [(3, 17)], 2)}
    path = tmp_path / "x.safetensors"
    safetensors_file.write(path, columns)
    assert len(calls) > 5
    loaded = load_file(path)
    for name, parts in columns.items():
        assert torch.equal(loaded[name], torch.cat(parts))
