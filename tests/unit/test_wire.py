"""The tensor codec: every dtype, empty and large tensors, and corrupt input."""

import base64
import json

import msgpack
import numpy as np
import pytest
import torch
import zstandard

from vllm_lens import WireError
from vllm_lens.common import wire


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
    # One element of a wider row: torch calls it contiguous, yet its stride is the row's.
    column = torch.arange(34, dtype=torch.float32).reshape(1, 34)[:, 32].contiguous()
    assert column.stride() == (34,)
    assert torch.equal(wire.loads(wire.dumps(column)), column)
    assert torch.equal(wire.tensor_from_json(wire.tensor_to_json(column)), column)


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


# --- bounded decoding: check the declared size before decompressing -------------------------

_BOMB_PROBE = """
import base64, json, resource, sys, zstandard
from vllm_lens.spec import ModelFacts, parse_extra_args
from vllm_lens.errors import LensRequestError
from vllm_lens.common import wire
# A model whose hidden size is the bomb's last dimension: the declared shape passes the
# model check, and only the byte budget stands between it and 512 MiB.
facts = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=1 << 27,
                   max_model_len=64, mapped=True)
small = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=8,
                   max_model_len=64, mapped=True)
# 512 MiB of zeros in ~16 KB, compressed in pieces so this process never holds them.
compressor = zstandard.ZstdCompressor().compressobj()
chunk = bytes(1 << 20)
zeros = b"".join(compressor.compress(chunk) for _ in range(512)) + compressor.flush()
record = {"__tensor__": True, "dtype": "float32", "shape": [1, 1 << 27], "compression": "zstd",
          "data": zeros}
wire_string = base64.b64encode(wire.dumps({"activations": record, "layer_indices": [0],
                                           "scale": 1.0, "norm_match": False,
                                           "position_indices": None})).decode()
json_record = {"activations": {**record, "data": base64.b64encode(zeros).decode()},
               "layer_indices": [0]}
# The same bomb, declaring a small shape: decompression stops one byte past the declared size.
liar = {**record, "shape": [1, 8]}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
messages = []
for value in (wire_string, [json_record]):
    try:
        parse_extra_args({"apply_steering_vectors": value}, lambda: facts)
    except LensRequestError as exc:
        messages.append(str(exc))
try:
    wire.unpack_tensor(liar)
except ValueError as exc:
    messages.append(str(exc))
try:  # on a real-sized model the declared shape alone is refused
    parse_extra_args({"apply_steering_vectors": wire_string}, lambda: small)
except LensRequestError as exc:
    messages.append(str(exc))
grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"len": len(wire_string), "messages": messages, "grown_mib": grown_mib}))
"""


def test_decompression_bombs_are_refused_before_they_inflate():
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _BOMB_PROBE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["len"] < 40_000  # a ~25 KB request ...
    wire_msg, json_msg, liar_msg, shape_msg = report["messages"]
    assert "hidden size is 134217728 but the model's is 8" in shape_msg
    for msg in (wire_msg, json_msg):  # ... refused, naming the size and the setting
        assert "536,870,912 bytes decompressed" in msg and "VLLM_LENS_MAX_DECODED_BYTES" in msg
    assert "need 32" in liar_msg
    assert report["grown_mib"] < 64, report  # nothing near 512 MiB was ever allocated


def test_decode_limit_is_shared_by_the_tensors_of_one_request():
    small = wire.pack_tensor(torch.zeros(4, 8))  # 128 bytes each
    with wire.decode_limit(300, "the test"):
        wire.unpack_tensor(small)
        wire.unpack_tensor(small)
        with pytest.raises(WireError, match="the test allows 300 bytes in all and 44 are left"):
            wire.unpack_tensor(small)
    wire.unpack_tensor(small)  # no limit outside the block


@pytest.mark.parametrize("record", [
    {"dtype": "float32", "shape": [2], "compression": "lz4", "data": b"x" * 8},
    {"dtype": "float32", "shape": [1] * 9, "data": b"x" * 4},
    {"dtype": "float32", "shape": [2], "compression": "zstd", "data": b"not a frame"},
])
def test_malformed_records(record):
    with pytest.raises(WireError, match="malformed"):
        wire.unpack_tensor(record)


@pytest.mark.parametrize("tensor", [
    torch.tensor([[1.5, float("inf")], [float("nan"), -float("inf")]]),
    torch.arange(6, dtype=torch.int32).reshape(2, 3),
    torch.randn(3, 2, generator=torch.Generator().manual_seed(0)).bfloat16(),
    torch.zeros(0, 4),
    torch.tensor([True, False]),
])
def test_lists_records_round_trip_every_value(tensor):
    record = wire.tensor_to_lists(tensor)
    assert json.loads(json.dumps(record, allow_nan=False)) == record  # strict JSON
    back = wire.tensor_from_json(record)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.isnan(), tensor.isnan()) if tensor.is_floating_point() else True
    assert torch.equal(back.nan_to_num(0.0), tensor.nan_to_num(0.0))


@pytest.mark.parametrize("record, problem", [
    ({"dtype": "float32", "shape": [3], "values": [1.0, 2.0]}, "2 values for shape"),
    ({"dtype": "float32", "shape": [1], "values": ["infinity"]}, "bad values"),
    ({"dtype": "float32", "shape": [1], "values": [[1.0]]}, "bad values"),
    ({"dtype": "complex", "shape": [1], "values": [1.0]}, "malformed tensor record"),
    ({"dtype": "int64", "shape": [2], "values": [1, 1.7]}, "int64 cannot hold"),
    ({"dtype": "uint8", "shape": [1], "values": [-1]}, "uint8 cannot hold"),
    ({"dtype": "float16", "shape": [1], "values": [1e10]}, "float16 cannot hold"),
    ({"dtype": "bool", "shape": [1], "values": [5]}, "bool cannot hold"),
    ({"dtype": "int64", "shape": [1], "values": [2**70]}, "bad values"),
])
def test_malformed_lists_records_are_refused(record, problem):
    with pytest.raises(WireError, match=problem):
        wire.tensor_from_json({**record, "encoding": "lists"})


def test_a_dict_that_only_looks_like_a_record_is_not_a_tensor():
    from vllm_lens.activations import decode_json_tensors

    mine = {"dtype": "mine", "shape": "round", "values": [1, 2]}  # a hook's own result
    assert decode_json_tensors({"0": mine}) == {"0": mine}


def test_lists_records_count_against_the_decode_limit():
    record = wire.tensor_to_lists(torch.zeros(1000))
    with pytest.raises(WireError), wire.decode_limit(1000):
        wire.tensor_from_json(record)
    # A client reads a large answer (no limit); untrusted input is held to the value cap.
    big = wire.tensor_to_lists(torch.zeros(wire._LISTS_MAX_VALUES + 1, dtype=torch.bool))
    assert wire.tensor_from_json(big).shape == (wire._LISTS_MAX_VALUES + 1,)
    with pytest.raises(WireError, match="values is above"), wire.decode_limit(1 << 30):
        wire.tensor_from_json(big)
