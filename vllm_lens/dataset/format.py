"""The names of the activation dataset format, in one place: its files, the manifest's version tag
and fields, and the names of the tensors inside a shard. The writer, the index and the reader all
take them from here, and none of them from another (runs in: any).

A dataset directory holds ``manifest.json`` (``MANIFEST``), ``index.jsonl`` (``INDEX``,
appended under ``INDEX_LOCK``), writer locks (``WRITER_LOCK``, and one per named writer:
``writer_lock``) and safetensors shards (``shard_name``; ``SHARD_FILE`` parses them back).
Inside a shard, a point's rows at one layer are ``tensor_name(point, layer)`` and one field of
the n-th SAE's features is ``sae_column(n, field)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["FORMAT", "GENERATION_FIELDS", "INDEX", "INDEX_LOCK", "MANIFEST", "SAE_FIELDS",
           "SHARD_FILE", "VERSION_FIELDS", "WRITER_LOCK", "sae_column", "sae_fields",
           "shard_name", "tensor_name", "writer_lock"]

#: The manifest's ``format``: the version of this layout.
FORMAT = "vllm-lens-activations/1"
MANIFEST = "manifest.json"
INDEX = "index.jsonl"
INDEX_LOCK = ".index.lock"
#: Held exclusively by the one unnamed writer, shared by named writers.
WRITER_LOCK = ".lock"
#: A shard's file name: group 1 is its writer (``None`` for the unnamed one), group 2 its number.
SHARD_FILE = re.compile(r"^shard-(?:(.+)-)?(\d{5,})\.safetensors$")
#: Manifest fields that may differ between the runs that wrote one dataset.
VERSION_FIELDS = ("vllm_version", "vllm_lens_version")
#: What the parts of one example agree on: the tokens it ran and the positions of its rows.
GENERATION_FIELDS = ("rows", "positions", "prompt_token_ids", "token_ids")
#: The columns of one SAE's features, and their dtypes.
SAE_FIELDS = {"indices": torch.int32, "values": torch.float32, "nmse": torch.float32,
              "l0": torch.int32}


def writer_lock(writer: str) -> str:
    """The lock file a named writer holds exclusively (one process per writer name)."""
    return f"{WRITER_LOCK}-{writer}"


def shard_name(number: int, writer: str | None = None) -> str:
    """The file of shard ``number`` of ``writer`` (``None``: the single unnamed writer)."""
    if writer is None:
        return f"shard-{number:05d}.safetensors"
    return f"shard-{writer}-{number:05d}.safetensors"


def tensor_name(point: str, layer: int) -> str:
    """The name of one point's rows at one layer inside a shard."""
    return f"{point}/{layer}"


def sae_column(number: int, field: str) -> str:
    """The name of one field of the ``number``-th SAE's features inside a shard."""
    return f"sae.{number}.{field}"


def sae_fields(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """The fields a manifest's ``sae_features`` entry stores per row."""
    return ("indices", "values", "nmse", "l0") if entry.get("reconstruction") else (
        "indices", "values")
