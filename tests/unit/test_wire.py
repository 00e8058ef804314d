"""The tensor codec: every dtype, empty and large tensors, and corrupt input."""

import base64

import msgpack
import numpy as np
import pytest
import torch
import zstandard

from vllm_lens import WireError, wire


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()), ids=list(wire.DTYPES))
def test_round_trip_every_dtype(dtype):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    back = wire.loads(wire.dumps({"x": t}))["x"]
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_bfloat16_bits_survive():
    t = torch.tensor([1.0, -2.5, 3.140625, float("inf")], dtype=torch.bfloat16)
    back = wire.loads(wire.dumps(t))
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("shape", [(0,), (0, 5), (2, 0, 3), ()])
def test_empty_and_scalar(shape):
    t = torch.zeros(shape, dtype=torch.float16)
    back = wire.loads(wire.dumps(t))
    assert back.shape == t.shape and back.dtype == t.dtype


def test_large_tensor_and_nesting():
    big = torch.randn(30, 512, 576)  # ~35 MB
    obj = {"layers": [1, 2], "inner": [{"t": big}, "text", 3.5, None]}
    back = wire.loads(wire.dumps(obj))
    assert back["layers"] == [1, 2] and back["inner"][1:] == ["text", 3.5, None]
    assert torch.equal(back["inner"][0]["t"], big)


def test_non_contiguous_input():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    assert torch.equal(wire.loads(wire.dumps(t)), t)


def test_readable_with_numpy_and_zstd_only():
    t = torch.randn(2, 3)
    rec = msgpack.unpackb(wire.dumps(t))
    raw = zstandard.ZstdDecompressor().decompress(rec["data"])
    arr = np.frombuffer(raw, dtype=rec["dtype"]).reshape(rec["shape"])
    np.testing.assert_array_equal(arr, t.numpy())


def test_json_form_round_trips_and_reads_the_older_form():
    t = torch.randn(3, 4).to(torch.bfloat16)
    assert torch.equal(wire.tensor_from_json(wire.tensor_to_json(t)), t)
    older = {"data": base64.b64encode(zstandard.ZstdCompressor().compress(
                 t.view(torch.int16).numpy().tobytes())).decode(),
             "dtype": "int16", "original_dtype": "torch.bfloat16", "shape": [3, 4],
             "compression": "zstd"}
    assert torch.equal(wire.tensor_from_json(older), t)
    with pytest.raises(WireError):
        wire.tensor_from_json({"dtype": "float32", "shape": [1], "data": "!!"})


@pytest.mark.parametrize(
    "blob",
    [b"", b"\xc1\xc1\xc1", msgpack.packb({"__tensor__": True, "dtype": "float32",
                                           "shape": [1], "compression": "zstd",
                                           "data": b"not zstd"})],
    ids=["empty", "bad-msgpack", "bad-zstd"],
)
def test_corrupt_bytes_raise_wire_error(blob):
    with pytest.raises(WireError):
        wire.loads(blob)


def test_truncated_payload_raises():
    blob = wire.dumps(torch.randn(100))
    with pytest.raises(WireError):
        wire.loads(blob[: len(blob) // 2])


def test_inconsistent_tensor_record_raises():
    rec = wire.pack_tensor(torch.randn(4))
    rec["shape"] = [5]
    with pytest.raises(WireError, match="need 20"):
        wire.loads(msgpack.packb(rec))


def test_unknown_dtype_raises():
    with pytest.raises(WireError, match="complex64"):
        wire.dumps(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="object"):
        wire.dumps(object())


def test_non_bytes_input_raises():
    with pytest.raises(WireError, match="expected bytes"):
        wire.loads("a string")
