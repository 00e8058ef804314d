"""Prompt files for ``vllm-lens extract``: JSONL, CSV or Parquet rows, or a local Hugging Face
dataset (a directory), with ``prompt`` or ``messages`` and an optional ``key``, each bad row named
(runs in: caller)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Example", "read_examples"]


@dataclass(frozen=True)
class Example:
    key: str
    prompt: str | None = None
    messages: list[Any] | None = None


def read_examples(path: Path, split: str | None = None) -> tuple[list[Example], list[str]]:
    """The examples of an input file, and one message per bad row (``"line N: ..."``; ``"row
    N: ..."`` in a dataset directory, whose rows count from 1 like a file's lines).

    A directory is read with Hugging Face ``datasets``: one written by ``save_to_disk``, or a
    folder of data files for ``load_dataset``; ``split`` picks one of several splits.
    """
    rows: Iterator[tuple[int, Any]]
    suffix = path.suffix.lower()
    unit = "line"
    if path.is_dir():
        rows, unit = _dataset_rows(path, split), "row"
    elif split is not None:
        raise SystemExit(f"vllm-lens extract: --split applies to a dataset directory, and "
                         f"{path} is a file")
    elif suffix == ".csv":
        with path.open(newline="") as f:
            rows = iter(list(enumerate(csv.DictReader(f), start=2)))  # line 1: the header
    elif suffix == ".parquet":
        try:
            import pandas
        except ImportError:
            raise SystemExit("vllm-lens extract: reading Parquet needs pandas "
                             "(pip install pandas pyarrow)") from None
        rows = ((i, {k: _plain(v) for k, v in row.items()}) for i, row in enumerate(
            pandas.read_parquet(path).to_dict(orient="records"), start=1))
    else:
        rows = _jsonl_rows(path)
    examples, bad, seen = [], [], set()
    for line, row in rows:
        try:
            example = _example(line, row)
        except ValueError as exc:
            bad.append(f"{unit} {line}: {exc}")
            continue
        if example.key in seen:
            bad.append(f"{unit} {line}: key {example.key!r} appears twice")
            continue
        seen.add(example.key)
        examples.append(example)
    return examples, bad


def _dataset_rows(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
    try:
        import datasets  # Hugging Face's, not vllm_lens.dataset.reader
        if not hasattr(datasets, "load_from_disk"):
            raise ImportError(f"{datasets.__name__} is not Hugging Face datasets")
    except ImportError:
        raise SystemExit(f"vllm-lens extract: {path} is a directory, read as a Hugging Face "
                         "dataset, which needs the datasets package (pip install datasets)"
                         ) from None
    saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    try:
        loaded = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(
            str(path))
    except Exception as exc:  # noqa: BLE001 - whatever datasets finds wrong, said once
        raise SystemExit(f"vllm-lens extract: {path} could not be read as a dataset "
                         f"({type(exc).__name__}: {exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None and len(names) != 1:
            raise SystemExit(f"vllm-lens extract: {path} has the splits {names}; pick one "
                             "with --split")
        name = names[0] if split is None else split
        if name not in loaded:
            raise SystemExit(f"vllm-lens extract: {path} has no split {name!r} (it has "
                             f"{names})")
        loaded = loaded[name]
    elif split is not None:
        raise SystemExit(f"vllm-lens extract: {path} holds one dataset, not splits; leave "
                         "out --split")
    for number, row in enumerate(loaded, start=1):
        yield number, {k: _plain(v) for k, v in row.items()}


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open() as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except ValueError as exc:
                yield line, ValueError(f"not JSON ({exc})")


def _example(line: int, row: Any) -> Example:
    if isinstance(row, ValueError):
        raise row
    if not isinstance(row, dict):
        raise ValueError("expected an object with prompt or messages")
    key = row.get("key")
    if key is None or key == "":
        key = str(line)
    elif isinstance(key, int) and not isinstance(key, bool):
        key = str(key)
    elif not isinstance(key, str):
        raise ValueError(f"key must be a string or an integer, got {key!r}")
    prompt, messages = row.get("prompt"), row.get("messages")
    if isinstance(messages, str) and messages:
        try:
            messages = json.loads(messages)
        except ValueError:
            raise ValueError("messages is not JSON") from None
    if prompt not in (None, "") and messages not in (None, ""):
        raise ValueError("give prompt or messages, not both")
    if isinstance(prompt, str) and prompt:
        return Example(key, prompt=prompt)
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return Example(key, messages=messages)
    raise ValueError("needs a non-empty prompt (text) or messages (a list of {role, content})")




def _plain(value: Any) -> Any:
    """A Parquet cell as JSON would give it: arrays as lists, NaN as missing."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
