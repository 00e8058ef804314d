"""The operator's capture sinks, and what a request may ask of them (runs in: front end, worker).

The front end validates requests; the workers open the sinks.

An operator configures sinks with ``VLLM_LENS_SINKS``: a JSON object, or the path of a file
holding one, mapping each sink's name to its kind (an entry point of group
``vllm_lens.sinks``), its root directory and options::

    {"acts": {"kind": "safetensors", "root": "/data/activations", "clients": true,
              "rows_per_shard": 65536, "flush_s": 10}}

A request names a sink, a dataset inside it and the key of its example
(``extra_args["capture_sink"] = {"sink": "acts", "dataset": "run-1", "key": "ex-42"}``),
never a path: sink and dataset names are letters, digits, ``.``, ``_`` and ``-`` (no leading
dot), so a dataset is always a directory right under the sink's root. Over HTTP a sink is
refused unless the operator set ``"clients": true`` for it (clients could otherwise fill the
operator's disk).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KEY_MAX_CHARS", "SinkConfig", "SinkSpec", "check_name", "configured",
           "mark_http_process", "parse_config", "serves_http"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Longest example key (keys live in the index, never in a path).
KEY_MAX_CHARS = 1024
_FIELDS = ("sink", "dataset", "key")


_serves_http = False


def mark_http_process() -> None:
    """This process serves HTTP clients (vLLM's OpenAI server built its routes): from now on
    every request naming a sink that is not open to clients is refused (completions and chat;
    the other routes refuse lens keys altogether)."""
    global _serves_http
    _serves_http = True


def serves_http() -> bool:
    return _serves_http


def check_name(value: Any, what: str) -> str:
    """``value`` if it is a valid sink or dataset name; ``ValueError`` saying why not."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise ValueError(f"{what} {value!r} is not a valid name: use 1 to 128 letters, "
                         "digits, '.', '_' or '-', not starting with '.' and without '..'")
    return value


@dataclass(frozen=True)
class SinkConfig:
    """One sink the operator configured."""

    name: str
    kind: str
    root: str
    clients: bool = False
    """Whether HTTP clients may write to it."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Everything else in its entry, for the sink's factory (``rows_per_shard`` ...)."""


def parse_config(text: str) -> dict[str, SinkConfig]:
    """Sinks from ``VLLM_LENS_SINKS``' value (JSON, or a path to a JSON file).

    Raises:
        ValueError: naming the sink and field that is wrong.
    """
    text = text.strip()
    if not text:
        return {}
    if not text.startswith(("{", "[")):
        try:
            with open(text) as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"VLLM_LENS_SINKS: cannot read {text!r} ({exc.strerror})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"VLLM_LENS_SINKS is not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("VLLM_LENS_SINKS must be a JSON object: sink name -> its settings")
    sinks = {}
    for name, entry in raw.items():
        try:
            check_name(name, "sink")
        except ValueError as exc:
            raise ValueError(f"VLLM_LENS_SINKS: {exc}") from None
        if not isinstance(entry, dict):
            raise ValueError(f"VLLM_LENS_SINKS[{name!r}] must be an object")
        options = dict(entry)
        kind, root = options.pop("kind", "safetensors"), options.pop("root", None)
        clients = options.pop("clients", False)
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"VLLM_LENS_SINKS[{name!r}].kind must be a sink kind's name")
        if not isinstance(root, str) or not os.path.isabs(root):
            raise ValueError(f"VLLM_LENS_SINKS[{name!r}].root must be an absolute directory "
                             f"path, got {root!r}")
        if not isinstance(clients, bool):
            raise ValueError(f"VLLM_LENS_SINKS[{name!r}].clients must be true or false")
        sinks[name] = SinkConfig(name, kind, root, clients, options)
    return sinks


def configured() -> dict[str, SinkConfig]:
    """This process's sinks (``VLLM_LENS_SINKS``; none when unset)."""
    return parse_config(os.environ.get("VLLM_LENS_SINKS", ""))


@dataclass(frozen=True)
class SinkSpec:
    """Where one request's rows go: a configured sink, a dataset in it, the example's key."""

    sink: str
    dataset: str
    key: str
    shared: bool = field(default=False, compare=False)
    """Set by the front end when the engine writes with several processes (data-parallel
    engines, pipeline stages): each then writes as a named writer of its own."""
    dtype: str | None = field(default=None, compare=False)
    row_shapes: Mapping[str, tuple[int, ...]] | None = field(default=None, compare=False)
    """Under pipeline parallelism, set by the front end: the captured rows' dtype and each
    point's row shape, for the dataset's manifest, which a stage holding none of the
    points' layers (only an SAE's) could not tell from its rows."""

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"sink": self.sink, "dataset": self.dataset, "key": self.key}
        if self.shared:
            payload["shared"] = True
        if self.row_shapes is not None:
            payload["dtype"] = self.dtype
            payload["row_shapes"] = {k: list(v) for k, v in self.row_shapes.items()}
        return payload

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> SinkSpec:
        shapes = d.get("row_shapes")
        return cls(str(d["sink"]), str(d["dataset"]), str(d["key"]), bool(d.get("shared")),
                   d.get("dtype"), None if shapes is None else {
                       str(k): tuple(int(x) for x in v) for k, v in shapes.items()})

    @classmethod
    def parse(cls, raw: Any, sinks: Mapping[str, SinkConfig]) -> SinkSpec:
        """Validate ``capture_sink``'s value against the configured ``sinks``.

        Raises:
            ValueError: ``(field, problem)``: the sub-field at fault (``""`` for the value
                itself) and why.
        """
        if isinstance(raw, str):  # HTTP's vllm_xargs carries objects as JSON strings
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError("", f"not valid JSON ({exc.msg})") from None
        if not isinstance(raw, Mapping):
            raise ValueError("", 'must be {"sink": ..., "dataset": ..., "key": ...}')
        for name in raw:
            if name not in _FIELDS:
                raise ValueError(name, f"unknown field; allowed fields are {', '.join(_FIELDS)}")
        for name in _FIELDS:
            if name not in raw:
                raise ValueError(name, "missing")
        sink, dataset, key = raw["sink"], raw["dataset"], raw["key"]
        try:
            check_name(sink, "sink")
        except ValueError as exc:
            raise ValueError("sink", str(exc)) from None
        if sink not in sinks:
            have = ", ".join(sorted(sinks)) or "none (VLLM_LENS_SINKS is not set)"
            raise ValueError("sink", f"unknown sink {sink!r}; this engine's sinks: {have}")
        try:
            check_name(dataset, "dataset")
        except ValueError as exc:
            raise ValueError("dataset", str(exc)) from None
        if not isinstance(key, str) or not key or len(key) > KEY_MAX_CHARS or any(
                ord(c) < 32 for c in key):
            raise ValueError("key", f"must be a non-empty string of at most {KEY_MAX_CHARS} "
                             "characters without control characters")
        return cls(sink, dataset, key)
