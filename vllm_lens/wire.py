"""Tensor codec: torch tensors <-> compact bytes (runs in: every process).

Payloads cross process boundaries (worker -> front end -> HTTP client), so the format is plain
msgpack compressed with zstandard. A tensor becomes a self-describing map::

    {"__tensor__": True, "dtype": "bfloat16", "shape": [2, 3], "data": <raw little-endian bytes>}

which anything with msgpack + zstandard (numpy included) can read back. The raw bytes of every
dtype, bfloat16 included, are taken through a ``uint8`` view, so no dtype is special-cased.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import zstandard

from vllm_lens.errors import WireError

__all__ = ["DTYPES", "dumps", "loads", "pack_tensor", "unpack_tensor"]

#: dtypes the codec carries, by the name it writes on the wire.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_TENSOR_TAG = "__tensor__"
_ZSTD_LEVEL = 3  # fast; activations compress only modestly, so higher levels buy little


def pack_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """Describe ``tensor`` as a msgpack-ready map (copies it to the CPU if needed)."""
    name = _NAMES.get(tensor.dtype)
    if name is None:
        raise WireError(f"cannot encode tensors of dtype {tensor.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {_TENSOR_TAG: True, "dtype": name, "shape": list(tensor.shape), "data": data}


def unpack_tensor(obj: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`pack_tensor`; validates dtype, shape and byte count."""
    try:
        dtype = DTYPES[obj["dtype"]]
        shape = [int(s) for s in obj["shape"]]
        data = obj["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed tensor record: {exc!r}") from None
    if not isinstance(data, (bytes, bytearray)) or any(s < 0 for s in shape):
        raise WireError("malformed tensor record: bad data or negative shape")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != numel * itemsize:
        raise WireError(
            f"tensor record holds {len(data)} bytes, but dtype {obj['dtype']} and shape "
            f"{shape} need {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return pack_tensor(obj)
    raise TypeError(f"vllm-lens wire cannot encode {type(obj).__name__}")


def _object_hook(obj: dict[Any, Any]) -> Any:
    return unpack_tensor(obj) if obj.get(_TENSOR_TAG) is True else obj


def dumps(obj: Any) -> bytes:
    """Encode nested dicts/lists/scalars/tensors as zstd-compressed msgpack."""
    raw = msgpack.packb(obj, default=_default, use_bin_type=True)
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)


def loads(blob: bytes) -> Any:
    """Decode bytes from :func:`dumps`; any corruption raises :class:`WireError`."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(blob).__name__}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(blob))
    except zstandard.ZstdError as exc:
        raise WireError(f"payload is not valid zstd data: {exc}") from None
    try:
        return msgpack.unpackb(raw, object_hook=_object_hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"payload is not valid msgpack: {exc!r}") from None
