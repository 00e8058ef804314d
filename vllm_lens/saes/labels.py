"""Feature labels shipped beside an SAE or transcoder, read from its directory (runs in: front
end, caller).

A directory may hold ``labels.json`` or ``explanations.json`` (the first found, in that
order), either

- a JSON object ``{"<feature index>": "label", ...}``, or
- a JSON list of Neuronpedia's exported explanations, ``[{"index": "12", "description":
  "...", ...}, ...]`` (its ``index`` and ``description`` are read; a feature explained more
  than once keeps its first description).

The front end reads them (the first time a result needs them, again when the file changes)
and attaches, beside each ``sae_features`` entry's indices, the labels of the features that
entry holds. A file larger than ``MAX_LABEL_BYTES``, or one that is not in either form, is
refused with a ``ValueError`` naming the file.

>>> import json
>>> _ = (tmp / "labels.json").write_text(json.dumps({"3": "the sea", "7": "numbers"}))
>>> read_labels(tmp)
{3: 'the sea', 7: 'numbers'}
>>> labels_for(read_labels(tmp), [[3, -1], [7, 3]])
{3: 'the sea', 7: 'numbers'}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["LABEL_FILES", "MAX_LABEL_BYTES", "label_file", "labels_for", "read_labels"]

#: The files looked for, in order.
LABEL_FILES = ("labels.json", "explanations.json")
#: The largest labels file read (a million labels of ~60 characters fit).
MAX_LABEL_BYTES = 128 << 20


def label_file(directory: str | os.PathLike) -> Path | None:
    """The labels file in ``directory``, or ``None``."""
    for name in LABEL_FILES:
        path = Path(directory) / name
        if path.is_file():
            return path
    return None


def read_labels(directory: str | os.PathLike) -> dict[int, str] | None:
    """The labels in ``directory`` (feature index -> label), or ``None`` if it holds none;
    read once per version of the file.

    Raises:
        ValueError: the file is too large, not JSON, or in neither form (the message names
            it).
    """
    path = label_file(directory)
    if path is None:
        return None
    stat = path.stat()
    where, version = str(path.resolve()), (stat.st_mtime_ns, stat.st_size)
    cached = _CACHE.get(where)
    if cached is None or cached[0] != version:
        try:
            cached = (version, _read(where, stat.st_size))
        except ValueError as exc:  # kept too: a bad file is not parsed again per result
            cached = (version, exc)
        _CACHE.pop(where, None)
        while len(_CACHE) >= _CACHED_FILES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[where] = cached
    if isinstance(cached[1], ValueError):
        raise cached[1]
    return cached[1]


#: The labels read: real path -> ((modification time, size), labels or the problem), one
#: version per file, the oldest of ``_CACHED_FILES`` dropped first.
_CACHE: dict[str, tuple[tuple[int, int], dict[int, str] | ValueError]] = {}
_CACHED_FILES = 16


def _read(path: str, size: int) -> dict[int, str]:
    if size > MAX_LABEL_BYTES:
        raise ValueError(f"{path}: {size:,} bytes; labels files up to {MAX_LABEL_BYTES:,} are "
                         "read")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a JSON labels file ({exc})") from None
    if isinstance(data, Mapping):
        pairs: Iterable[tuple[Any, Any]] = data.items()
    elif isinstance(data, list) and all(isinstance(e, Mapping) for e in data):
        pairs = ((e.get("index"), e.get("description")) for e in data)
    else:
        raise ValueError(f"{path}: expected {{\"<index>\": \"label\"}} or Neuronpedia's list of "
                         "explanations ({\"index\", \"description\"})")
    labels: dict[int, str] = {}
    for index, label in pairs:
        feature = (index if isinstance(index, int) and not isinstance(index, bool) else
                   int(index) if isinstance(index, str) and index.isascii()
                   and index.isdecimal() else None)
        if feature is None:
            raise ValueError(f"{path}: {index!r} is not a feature index")
        if not isinstance(label, str):
            raise ValueError(f"{path}: the label of feature {feature} is not a string")
        labels.setdefault(feature, label)
    return labels


def labels_for(labels: Mapping[int, str], indices: Any) -> dict[int, str]:
    """The labels of the features ``indices`` holds (any nesting of ints, a tensor or an
    array; -1 padding and unlabelled features left out), ascending."""
    if hasattr(indices, "tolist"):
        indices = indices.tolist()
    seen: set[int] = set()
    stack = [indices]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None and int(item) >= 0:
            seen.add(int(item))
    return {i: labels[i] for i in sorted(seen) if i in labels}
