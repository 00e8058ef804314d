"""Hypothesis strategies for hostile lens requests (runs in: the test process).

Each class of malformed or oversized input is a strategy drawing ``vllm_xargs``-shaped values
(strings, numbers and lists of them, as HTTP carries them; offline callers may send the same)
together with the field the refusal must name. ``CLASSES`` maps a class name to its strategy;
the suite draws from every class, offline and against the real server. Values are built for
SmolLM2 (30 layers, hidden 576) behind an engine with ``max_model_len`` 1024.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import msgpack
import torch
import zstandard
from hypothesis import strategies as st

from vllm_lens import NamedHook, SteeringVector
from vllm_lens.common import wire
from vllm_lens.hooks import Hook, hook_to_json

N_LAYERS, HIDDEN, CONTEXT = 30, 576, 1024
CAPTURE, STEER, HOOKS = "output_residual_stream", "apply_steering_vectors", "apply_hooks"

Case = tuple[dict, str]
"""(vllm_xargs, the field the refusal names, or its prefix)."""


def _capture(value) -> dict:
    return {CAPTURE: value if isinstance(value, str) else json.dumps(value)}


def _wire_vector(**fields) -> str:
    """A SteeringVector wire string with the given fields (tensors as wire records)."""
    return base64.b64encode(wire.dumps(fields)).decode()


def _good_vector(**overrides) -> dict:
    base = {"activations": torch.ones(1, HIDDEN), "layer_indices": [3], "scale": 1.0,
            "norm_match": False, "position_indices": None}
    return {**base, **overrides}


def _steer_json(**fields) -> dict:
    vector = _good_vector(**fields)
    if isinstance(vector["activations"], torch.Tensor):
        vector["activations"] = wire.tensor_to_json(vector["activations"])
    return {STEER: json.dumps([vector])}


def _zeros_frame(n_bytes: int) -> bytes:
    """A zstd frame of ``n_bytes`` zeros, compressed in 1 MiB pieces (never held whole)."""
    compressor = zstandard.ZstdCompressor().compressobj()
    piece = bytes(1 << 20)
    parts = [compressor.compress(piece) for _ in range(n_bytes >> 20)]
    return b"".join(parts) + compressor.flush()


_BOMB_FRAME = _zeros_frame(256 << 20)  # 256 MiB in ~8 KB; built once per session


def _bomb_record(shape: list[int]) -> dict:
    return {"__tensor__": True, "dtype": "float32", "shape": shape, "compression": "zstd",
            "data": _BOMB_FRAME}


layer_out = st.one_of(st.integers(max_value=-1), st.integers(min_value=N_LAYERS))
garbage_text = st.text(min_size=1, max_size=40).filter(
    lambda t: t.strip() and t.strip() not in ("true", "[]") and not t.strip().startswith(("[", "{")))


def _named(name: str, strategy: st.SearchStrategy[Case]) -> st.SearchStrategy[tuple[str, Case]]:
    return strategy.map(lambda case: (name, case))


CLASSES: dict[str, st.SearchStrategy[Case]] = {
    # --- output_residual_stream -------------------------------------------------------------
    "capture: layer out of range": layer_out.map(lambda v: (_capture([v]), f"{CAPTURE}[0]")),
    "capture: float layer": st.floats(allow_nan=False, allow_infinity=False).filter(
        lambda f: f != int(f)).map(lambda v: (_capture([v]), f"{CAPTURE}[0]")),
    "capture: boolean in the list": st.booleans().map(lambda v: (_capture([v]), f"{CAPTURE}[0]")),
    "capture: nested list": st.integers(0, 5).map(lambda v: (_capture([[v]]), f"{CAPTURE}[0]")),
    "capture: empty list": st.just((_capture([]), CAPTURE)),
    "capture: not JSON": garbage_text.map(lambda t: ({CAPTURE: t}, CAPTURE)),
    "capture: JSON of the wrong type": st.one_of(st.floats(allow_nan=False), st.text()).map(
        lambda v: (_capture(v) if not isinstance(v, str) else {CAPTURE: json.dumps(v)},
                   CAPTURE)),
    "capture: unknown field": st.sampled_from(["colour", "layer", "position", "reduction"]).map(
        lambda f: (_capture({"layers": [1], f: 1}), f"{CAPTURE}.{f}")),
    "capture: unknown selector": st.text(min_size=1, max_size=20).filter(
        lambda t: t.replace(" ", "") not in ("all", "prompt", "generated", "last_prompt")
        and "[" not in t).map(
        lambda t: (_capture({"layers": [1], "positions": t}), f"{CAPTURE}.positions")),
    "capture: slice with a step": st.integers(1, 9).map(
        lambda k: (_capture({"layers": [1], "positions": f"prompt[::{k}]"}),
                   f"{CAPTURE}.positions")),
    "capture: negative position": st.integers(max_value=-1).map(
        lambda p: (_capture({"layers": [1], "positions": [p]}), f"{CAPTURE}.positions[0]")),
    "capture: position past the context": st.integers(min_value=CONTEXT).map(
        lambda p: (_capture({"layers": [1], "positions": [p]}), f"{CAPTURE}.positions[0]")),
    "capture: unknown reduction": st.sampled_from(["max", "sum", "first", "MEAN"]).map(
        lambda r: (_capture({"layers": [1], "reduce": r}), f"{CAPTURE}.reduce")),
    # --- apply_steering_vectors -------------------------------------------------------------
    "steer: not base64": st.text(alphabet="!@#$%^&*()", min_size=3, max_size=30).map(
        lambda t: ({STEER: t}, f"{STEER}[0]")),
    "steer: base64 of garbage": st.binary(min_size=1, max_size=64).map(
        lambda b: ({STEER: base64.b64encode(b"\xc1" + b).decode()}, f"{STEER}[0]")),
    "steer: msgpack of a non-map": st.lists(st.integers(-2**31, 2**31), max_size=5).map(
        lambda v: ({STEER: base64.b64encode(msgpack.packb(v)).decode()}, f"{STEER}[0]")),
    # Declared sizes above the default VLLM_LENS_MAX_DECODED_BYTES (256 MiB).
    "steer: decompression bomb": st.sampled_from([[1, 1 << 27], [8, 1 << 24], [2, 4, 1 << 24]]).map(
        lambda shape: ({STEER: _wire_vector(**_good_vector(activations=_bomb_record(shape)))},
                       f"{STEER}[0]")),
    "steer: frame larger than its shape": st.sampled_from([[1, HIDDEN], [1, 2, HIDDEN]]).map(
        lambda shape: ({STEER: _wire_vector(**_good_vector(activations=_bomb_record(shape)))},
                       f"{STEER}[0]")),
    "steer: JSON bomb record": st.just(0).map(lambda _: (_json_bomb(), f"{STEER}[0]")),
    "steer: wrong hidden size": st.integers(1, 2000).filter(lambda h: h != HIDDEN).map(
        lambda h: ({STEER: SteeringVector(activations=torch.ones(1, h), layer_indices=[3])
                    .to_wire()}, f"{STEER}[0]")),
    "steer: layer out of range": layer_out.filter(lambda v: v >= 0).map(
        lambda v: ({STEER: SteeringVector(activations=torch.ones(1, HIDDEN),
                                          layer_indices=[v]).to_wire()}, f"{STEER}[0]")),
    "steer: duplicate layers": st.integers(0, N_LAYERS - 1).map(
        lambda v: ({STEER: _wire_vector(**_good_vector(activations=torch.ones(2, HIDDEN),
                                                      layer_indices=[v, v]))}, f"{STEER}[0]")),
    "steer: NaN or inf": st.sampled_from([float("nan"), float("inf"), -float("inf")]).map(
        lambda x: ({STEER: _wire_vector(**_good_vector(
            activations=torch.full((1, HIDDEN), x)))}, f"{STEER}[0]")),
    "steer: wrong rank": st.sampled_from([[HIDDEN], [1, 1, 1, HIDDEN]]).map(
        lambda shape: ({STEER: _wire_vector(**_good_vector(activations=torch.ones(shape)))},
                       f"{STEER}[0]")),
    "steer: integer tensor": st.sampled_from([torch.int32, torch.int64, torch.uint8]).map(
        lambda dt: ({STEER: _wire_vector(**_good_vector(
            activations=torch.ones(1, HIDDEN, dtype=dt)))}, f"{STEER}[0]")),
    "steer: JSON without activations": st.just(({STEER: json.dumps([{"layer_indices": [1]}])},
                                                f"{STEER}[0]")),
    "steer: position past the context": st.integers(min_value=CONTEXT, max_value=10**9).map(
        lambda p: ({STEER: SteeringVector(activations=torch.ones(1, 1, HIDDEN), layer_indices=[3],
                                          position_indices=[p]).to_wire()}, f"{STEER}[0]")),
    "steer: scale not finite": st.sampled_from(["Infinity", "-Infinity", "NaN"]).map(
        lambda s: ({STEER: json.dumps([_good_json_vector()]).replace('"scale": 1.0',
                                                                     f'"scale": {s}')},
                   f"{STEER}[0]")),
    # --- apply_hooks ------------------------------------------------------------------------
    "hooks: unknown named hook": st.text(alphabet="abcdefgh_", min_size=1, max_size=12).map(
        lambda name: ({HOOKS: json.dumps([hook_to_json(NamedHook(name, [1]))])},
                      f"{HOOKS}[0]")),
    "hooks: pickled code without the opt-in": st.just(
        ({HOOKS: json.dumps([hook_to_json(Hook(print, [1]))])}, f"{HOOKS}[0]")),
    "hooks: bad named-hook arguments": st.integers().filter(lambda k: not 1 <= k <= 100).map(
        lambda k: ({HOOKS: json.dumps([hook_to_json(NamedHook("logit_lens_topk", [1],
                                                              {"k": k}))])}, f"{HOOKS}[0]")),
    "hooks: hook layer out of range": layer_out.filter(lambda v: v >= 0).map(
        lambda v: ({HOOKS: json.dumps([hook_to_json(NamedHook("logit_lens_topk", [v]))])},
                   f"{HOOKS}[0]")),
    "hooks: oversized arguments": st.integers(600_000, 700_000).map(
        lambda n: ({HOOKS: json.dumps([hook_to_json(NamedHook(
            "linear_probe", [1], {"weight": [0.125] * n}))])}, HOOKS)),
    # --- the request as a whole -------------------------------------------------------------
    # Each item within its own caps, the request past the per-request ones (defaults:
    # VLLM_LENS_MAX_HOOKS 32, VLLM_LENS_MAX_STEERING_VECTORS 256).
    "request: too many hooks": st.integers(33, 3000).map(
        lambda n: ({HOOKS: json.dumps([hook_to_json(NamedHook("logit_lens_topk", [1],
                                                              {"k": 1}))] * n)}, HOOKS)),
    "request: too many vectors": st.integers(257, 400).map(
        lambda n: ({STEER: [SteeringVector(activations=torch.zeros(1, HIDDEN),
                                           layer_indices=[3]).to_wire()] * n}, STEER)),
    # The server's preset expands past the cap; offline (no presets) it is unknown.
    "request: too many preset references": st.integers(257, 50_000).map(
        lambda n: ({STEER: ["preset:calm"] * n}, STEER)),
    "keys: misspelt lens key": st.sampled_from(
        ["output_residual_streams", "apply_steering_vector", "apply_hook"]).map(
        lambda k: ({k: "[1]"}, k)),
    "keys: the reserved payload key": st.just(({"vllm_lens": "{}"}, "vllm_lens")),
    "keys: unknown transport": st.text(min_size=1, max_size=10).filter(
        lambda t: t not in ("json", "binary")).map(
        lambda t: ({CAPTURE: "[1]", "activations_transport": t}, "activations_transport")),
}


def _json_bomb() -> dict:
    return _steer_json(activations={"dtype": "float32", "shape": [1, 1 << 27],
                                    "compression": "zstd",
                                    "data": base64.b64encode(_BOMB_FRAME).decode()})


def _good_json_vector() -> dict:
    return {"activations": wire.tensor_to_json(torch.ones(1, HIDDEN)), "layer_indices": [3],
            "scale": 1.0, "norm_match": False, "position_indices": None}


#: Classes refused only by admission (they need the request's size): (xargs, field, body
#: overrides that make the request large).
ADMISSION: dict[str, tuple[dict, str, dict]] = {
    "admission: capture too large": (
        {CAPTURE: "true"}, CAPTURE, {"max_tokens": 1000, "n": 16, "temperature": 1.0}),
    "admission: logit lens on too many rows": (
        {HOOKS: json.dumps([hook_to_json(NamedHook("logit_lens_topk", list(range(N_LAYERS)),
                                                   {"k": 1}))])},
        f"{HOOKS}[0]", {"max_tokens": 1000, "n": 4, "temperature": 1.0}),
    # Each copy within the per-hook cap (30 layers x ~1,000 positions), three together past it.
    "admission: copies of a row-bounded hook": (
        {HOOKS: json.dumps([hook_to_json(NamedHook("logit_lens_topk", list(range(N_LAYERS)),
                                                   {"k": 1}))] * 3)},
        f"{HOOKS}[2]", {"max_tokens": 1000}),
}


def any_case() -> st.SearchStrategy[tuple[str, Case]]:
    """One hostile request, drawn from any class."""
    return st.one_of(*(_named(name, s) for name, s in CLASSES.items()))


def each_class(draw: Callable[[st.SearchStrategy], object]) -> dict[str, Case]:
    """One example of every class (``draw`` is a Hypothesis ``data.draw``)."""
    return {name: draw(s) for name, s in CLASSES.items()}
