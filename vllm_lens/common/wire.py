"""Tensor codec: torch tensors <-> compact bytes (runs in: any).

Payloads cross process boundaries (worker -> front end -> HTTP client) as msgpack, with every
tensor a self-describing map whose raw bytes are zstandard-compressed::

    {"__tensor__": True, "dtype": "bfloat16", "shape": [2, 3], "compression": "zstd",
     "data": <zstd frame of the raw little-endian bytes>}

Anything with msgpack + zstandard (numpy included) can read it back. Records between two
vllm-lens processes of one deployment may leave the bytes uncompressed (``"compression": None``,
``dumps(..., compress=False)``): compressing near-random floats costs more CPU than it saves. Compressing each tensor's
bytes, rather than the whole message, keeps the large buffers out of msgpack's copies; the raw
bytes of every dtype, bfloat16 included, are taken through a ``uint8`` view, so no dtype is
special-cased. In JSON (``tensor_to_json``) the same record carries ``data`` in base64; the
``lists`` transport (``tensor_to_lists``) carries the values themselves, for readers without
zstandard (a browser).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import torch
import zstandard

from vllm_lens.errors import WireError

__all__ = [
    "DTYPES", "decode_limit", "dtype_name", "dumps", "loads", "pack_tensor", "tensor_from_json",
    "is_lists_record", "tensor_to_lists",
    "tensor_to_json", "unpack_tensor",
]

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
# Activations are nearly incompressible floats; level 1 gets the same ratio as higher levels
# at twice the speed.
_ZSTD_LEVEL = 1


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` (a key of ``DTYPES``)."""
    name = _NAMES.get(dtype)
    if name is None:
        raise WireError(f"cannot encode tensors of dtype {dtype}")
    return name


def pack_tensor(tensor: torch.Tensor, compress: bool = True) -> dict[str, Any]:
    """Describe ``tensor`` as a msgpack-ready map (copies it to the CPU if needed);
    ``compress=False`` keeps the raw bytes (``"compression": None``)."""
    name = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element of a row: "contiguous" to torch
        flat = flat.clone(memory_format=torch.contiguous_format)
    raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""
    return {
        _TENSOR_TAG: True,
        "dtype": name,
        "shape": list(tensor.shape),
        "compression": "zstd" if compress else None,
        "data": _contexts.compressor.compress(raw) if compress else raw,
    }


class _Contexts(threading.local):
    """One zstd compressor and decompressor per thread (creating them costs about as much as
    compressing a token's rows; one context must not serve two threads at once)."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()


_contexts = _Contexts()


class _Budget:
    """Bytes that the tensors decoded under one ``decode_limit`` may still declare."""

    def __init__(self, max_bytes: int, what: str,
                 check_shape: Callable[[list[int]], None] | None) -> None:
        self.left = max_bytes
        self.max_bytes = max_bytes
        self.what = what
        self.check_shape = check_shape

    def take(self, nbytes: int, shape: list[int], dtype: str, *, check: bool = True) -> None:
        if check and self.check_shape is not None:
            self.check_shape(shape)
        if nbytes > self.left:
            raise WireError(
                f"tensor of shape {shape} ({dtype}) would take {nbytes:,} bytes decompressed; "
                f"{self.what} allows {self.max_bytes:,} bytes in all"
                + (f" and {self.left:,} are left" if self.left != self.max_bytes else ""))
        self.left -= nbytes


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "vllm_lens_decode_budget", default=None)


@contextlib.contextmanager
def decode_limit(max_bytes: int, what: str = "this request",
                 check_shape: Callable[[list[int]], None] | None = None) -> Iterator[None]:
    """Bound the decompressed size of every tensor decoded inside the block, together.

    Untrusted input (a client's steering vectors) is decoded under a limit: each tensor
    record's declared dtype × shape is charged *before* anything is decompressed, so a small
    compressed record that claims a huge shape is refused without allocating it.
    ``check_shape`` (raising ``WireError``) vets each declared shape first, e.g. against the
    model, so that even an allowed size is not decompressed for a tensor of the wrong shape.
    """
    token = _budget.set(_Budget(max_bytes, what, check_shape))
    try:
        yield
    finally:
        _budget.reset(token)


@contextlib.contextmanager
def trusted() -> Iterator[None]:
    """Decode inside the block without the active ``decode_limit``: for tensors from this
    deployment's own processes (an SAE's rows from a worker), charged with ``reserve``."""
    token = _budget.set(None)
    try:
        yield
    finally:
        _budget.reset(token)


def reserve(nbytes: int, shape: list[int], dtype: str) -> None:
    """Charge a tensor about to be built from trusted parts (an SAE's decoder rows a request
    selects) against the active ``decode_limit``, before it is built."""
    budget = _budget.get()
    if budget is not None:
        budget.take(nbytes, shape, dtype, check=False)  # its shape is the deployment's


def charge(blob: bytes, *, check: bool = True) -> None:
    """Charge the tensors ``blob`` (from `dumps`) declares against the active
    ``decode_limit`` without decompressing them: tensors validated earlier (a registered
    preset) still count towards the request that uses them. ``check=False``: their shapes are
    not vetted again (an SAE's rows and columns, whose shapes are the deployment's)."""
    budget = _budget.get()
    if budget is None:
        return
    try:
        obj = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"payload is not valid msgpack: {exc!r}") from None
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict) and item.get(_TENSOR_TAG) is True:
            _, shape, nbytes = _declared(item)
            budget.take(nbytes, shape, item["dtype"], check=check)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def unpack_tensor(obj: dict[str, Any]) -> torch.Tensor:
    """Inverse of `pack_tensor`; validates dtype, shape and byte count.

    The declared dtype × shape is checked (against ``decode_limit``, when one is active) before
    decompression, and decompression never produces more than that many bytes.
    """
    dtype, shape, nbytes = _declared(obj)
    try:
        data = obj["data"]
        compression = obj.get("compression")
    except (KeyError, TypeError) as exc:
        raise WireError(f"malformed tensor record: {exc!r}") from None
    if not isinstance(data, (bytes, bytearray)):
        raise WireError("malformed tensor record: bad data")
    if compression not in (None, "zstd"):
        raise WireError(f"malformed tensor record: unknown compression {compression!r}")
    numel = math.prod(shape)
    budget = _budget.get()
    if budget is not None:
        budget.take(nbytes, shape, obj["dtype"])
    if compression == "zstd":
        data = _decompress(data, nbytes)
    if len(data) != nbytes:
        raise WireError(
            f"tensor record holds {len(data)} bytes, but dtype {obj['dtype']} and shape "
            f"{shape} need {nbytes}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


def _declared(obj: Any) -> tuple[torch.dtype, list[int], int]:
    """A tensor record's declared dtype, shape and size in bytes, validated (``WireError``)
    without touching its data."""
    try:
        dtype = DTYPES[obj["dtype"]]
        shape = [_dim(s) for s in obj["shape"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed tensor record: {exc!r}") from None
    if any(s < 0 for s in shape) or len(shape) > 8:
        raise WireError("malformed tensor record: negative shape or more than 8 dims")
    return dtype, shape, math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _dim(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"shape entries must be integers, got {value!r}")
    return value


def _decompress(data: bytes, expected: int) -> bytearray:
    """Decompress a zstd frame into a buffer of ``expected + 1`` bytes at most (filling the
    extra byte tells a frame larger than declared)."""
    out = bytearray(expected + 1)
    view = memoryview(out)
    filled = 0
    try:
        with _contexts.decompressor.stream_reader(data) as reader:
            while filled < len(out):
                n = reader.readinto(view[filled:])
                if not n:
                    break
                filled += n
    except zstandard.ZstdError as exc:
        raise WireError(f"malformed tensor record: {exc!r}") from None
    finally:
        view.release()
    del out[filled:]
    return out


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return pack_tensor(obj)
    raise TypeError(f"vllm-lens wire cannot encode {type(obj).__name__}")


def _default_raw(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return pack_tensor(obj, compress=False)
    raise TypeError(f"vllm-lens wire cannot encode {type(obj).__name__}")


def _object_hook(obj: dict[Any, Any]) -> Any:
    return unpack_tensor(obj) if obj.get(_TENSOR_TAG) is True else obj


def dumps(obj: Any, compress: bool = True) -> bytes:
    """Encode nested dicts/lists/scalars/tensors as msgpack with zstd-compressed tensors
    (raw tensor bytes with ``compress=False``)."""
    return msgpack.packb(obj, default=_default if compress else _default_raw,
                         use_bin_type=True)


def loads(blob: bytes) -> Any:
    """Decode bytes from `dumps`; any corruption raises `WireError`."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(blob).__name__}")
    if not blob:
        raise WireError("empty payload")
    try:
        return msgpack.unpackb(blob, object_hook=_object_hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"payload is not valid msgpack: {exc!r}") from None


def tensor_to_json(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as a JSON object: dtype, shape and zstd-compressed raw bytes in base64.

    Readable with numpy + zstandard alone (bfloat16: read as uint16, then reinterpret).
    """
    record = pack_tensor(tensor)
    del record[_TENSOR_TAG]
    record["data"] = base64.b64encode(record["data"]).decode("ascii")
    return record


#: Non-finite floats in a ``lists`` record, which JSON cannot carry as numbers.
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: Most values of one ``lists`` record decoded from untrusted input (under ``decode_limit``):
#: each is a Python object on the way. A request's JSON is bounded before that anyway
#: (``VLLM_LENS_MAX_REQUEST_BYTES``).
_LISTS_MAX_VALUES = 1 << 24


def tensor_to_lists(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as a JSON object of its values: ``{"dtype", "shape", "encoding": "lists",
    "values"}``, ``values`` flat in row-major order, a non-finite float as the string
    ``"nan"``, ``"inf"`` or ``"-inf"`` (the ``lists`` transport: readable without zstandard,
    e.g. by a browser).

    Examples:
        >>> import torch
        >>> from vllm_lens.common.wire import tensor_to_lists
        >>> tensor_to_lists(torch.tensor([[1.5, float("inf")]]))["values"]
        [1.5, 'inf']
    """
    flat = tensor.detach().cpu().reshape(-1)
    values: list[Any] = flat.tolist()  # Python floats (double) hold every float32 exactly
    if flat.is_floating_point() and not bool(torch.isfinite(flat).all()):
        values = [x if math.isfinite(x) else _finite_name(x) for x in values]
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "encoding": "lists",
            "values": values}


def _finite_name(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def is_lists_record(obj: Any) -> bool:
    """Whether ``obj`` is a ``tensor_to_lists`` record."""
    return isinstance(obj, dict) and obj.get("encoding") == "lists" and "values" in obj


def _tensor_from_lists(obj: dict[str, Any]) -> torch.Tensor:
    dtype, shape, nbytes = _declared(obj)
    budget = _budget.get()
    if budget is not None:
        budget.take(nbytes, shape, obj["dtype"])
    values = obj["values"]
    if not isinstance(values, list) or len(values) != math.prod(shape):
        count = len(values) if isinstance(values, list) else "no"
        raise WireError(f"malformed tensor record: {count} values for shape {shape}")
    if budget is not None and len(values) > _LISTS_MAX_VALUES:
        raise WireError(f"a lists record of {len(values):,} values is above "
                        f"{_LISTS_MAX_VALUES:,}; send it in the json form")
    try:
        numbers = [_NON_FINITE[v] if isinstance(v, str) else v for v in values]
        raw = torch.tensor(numbers) if numbers else torch.empty(0, dtype=dtype)
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise WireError(f"malformed tensor record: bad values ({exc!r})") from None
    if raw.dim() != 1:
        raise WireError("malformed tensor record: bad values (not a flat list of numbers)")
    return _exactly(raw, dtype).reshape(shape)


def _exactly(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (what JSON's numbers became: bool, int64 or float64) as ``dtype``, refusing a
    value the dtype cannot hold: a fraction or a float for an integer dtype, an integer out of
    range, anything but true/false for bool, a finite float that overflows to infinity."""
    out = raw.to(dtype)
    if dtype == torch.bool:
        ok = raw.dtype == torch.bool
    elif not dtype.is_floating_point:
        ok = raw.dtype in (torch.int64, torch.bool) and torch.equal(out.to(raw.dtype), raw)
    else:
        ok = not bool((torch.isinf(out) & torch.isfinite(raw.double())).any())
    if not ok:
        raise WireError(f"malformed tensor record: values that {dtype_name(dtype)} cannot hold")
    return out


def tensor_from_json(obj: dict[str, Any]) -> torch.Tensor:
    """Inverse of `tensor_to_json`.

    Also reads the older vllm-lens form, where ``dtype`` is numpy's storage dtype and
    ``original_dtype`` (e.g. ``"torch.bfloat16"``) the tensor's own, and ``tensor_to_lists``
    records.
    """
    if is_lists_record(obj):
        return _tensor_from_lists(obj)
    try:
        name = str(obj.get("original_dtype") or obj["dtype"]).removeprefix("torch.")
        raw = base64.b64decode(obj["data"], validate=True)
    except (KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise WireError(f"malformed JSON tensor: {exc!r}") from None
    return unpack_tensor({**obj, "dtype": name, "data": raw})
