"""Reading activation datasets back (runs in: caller).

Torch and numpy, no vLLM.

Use::

    ds = vllm_lens.datasets.open("acts/my-dataset")
    ex = ds.get("example-7")        # {"key", "prompt_token_ids", "token_ids", "positions",
                                    #  <point>: tensor}
    ex["resid_post"].shape          # [n_layers, n_rows, hidden]
    x = ds.tensor("resid_post", 12)   # every row at layer 12 (memory-mapped if one shard)
    ex["sae_features"][0]["indices"]  # a dataset that read SAE features: as out.sae_features
    ds.sae_tensor(0, "values")        # the first SAE's top values for every row

The format (``vllm_lens.dataset.writer``): ``manifest.json``, ``index.jsonl`` (one example per
line: key, shard, offset, rows, positions, prompt token ids) and safetensors shards holding
``"<point>/<layer>"`` tensors of ``[rows, *row_shape]``, the examples' rows one after the other,
and per SAE read ``"sae.<i>.<field>"`` tensors of its sparse features at the same rows. A
dataset several writers wrote (data-parallel engines, pipeline stages) has a shard series
per writer and, under pipeline parallelism, an example in parts, one per stage
(``vllm_lens.dataset.index``): the reader joins the parts and shows only complete examples,
also while the dataset is being written.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_lens.dataset.format import (
    FORMAT, INDEX, MANIFEST, sae_column, sae_fields, shard_name, tensor_name)
from vllm_lens.dataset.index import IndexView, read_index

__all__ = ["ActivationDataset", "open"]

# safetensors dtype names -> (numpy dtype to map the bytes as, torch dtype to view them as)
_DTYPES = {
    "F64": (np.float64, torch.float64), "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16), "BF16": (np.uint16, torch.bfloat16),
    "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32),
    "I16": (np.int16, torch.int16), "I8": (np.int8, torch.int8),
    "U8": (np.uint8, torch.uint8), "BOOL": (np.bool_, torch.bool),
}


def open(path: str | os.PathLike) -> ActivationDataset:  # noqa: A001 - the documented name
    """Open the dataset directory ``path`` (written by a capture sink or ``ShardWriter``).

    The same as ``ActivationDataset(path)``. The manifest and the index are read now (the
    shards only when rows are asked for): open it again to see examples written since.

    Args:
        path: the dataset's directory (``vllm-lens extract --output``, a capture sink's
            ``<root>/<dataset>``, or a ``ShardWriter``'s ``root``).

    Returns:
        The `ActivationDataset` of its complete examples.

    Raises:
        FileNotFoundError: ``path`` holds no ``manifest.json``.
        ValueError: the manifest's ``format`` is not this reader's
            (``vllm-lens-activations/1``), the manifest is not JSON, or a line of
            ``index.jsonl`` other than a last one cut short is not an entry (a damaged
            dataset).

    Examples:
        >>> import torch
        >>> from vllm_lens.dataset import reader as datasets
        >>> from vllm_lens.dataset.writer import ShardWriter
        >>> manifest = {"points": ["resid_post"], "layers": [1, 3], "dtype": "float32",
        ...             "row_shapes": {"resid_post": [128]}}
        >>> with ShardWriter(tmp / "acts", manifest) as writer:   # 2 examples, 5 and 3 rows
        ...     for key, n in (("a", 5), ("b", 3)):
        ...         _ = writer.add(key, {"resid_post": torch.randn(2, n, 128)}, range(n))
        >>> ds = datasets.open(tmp / "acts")
        >>> len(ds), ds.keys(), ds.points, ds.layers
        (2, ['a', 'b'], ('resid_post',), (1, 3))
    """
    return ActivationDataset(path)


#: Where one example's rows of one column are: ((writer, shard), first row, rows).
_Segment = tuple[tuple[Any, int], int, int]


class ActivationDataset(torch.utils.data.Dataset):
    """The complete examples of a dataset, in the order they were completed (for a dataset
    one writer wrote, index order): ``len(ds)``, ``ds[i]``, ``ds.get(key)``, iteration, and
    ``ds.tensor(point, layer)`` for one point's rows across every example.

    Also a ``torch.utils.data.Dataset`` of examples (``ds[i]`` as above), for a
    ``DataLoader`` with a collate function of your own (examples have different lengths).
    The index is read when the dataset is opened: open it again to see what was written since.

    ``ds[i]`` (and ``ds.get(key)``, and each item of iteration) is one example: ``{"key":
    str, "prompt_token_ids": list[int], "token_ids": list[int] (the generated tokens' ids
    the writer recorded), "positions": int64 [n_rows], <point>: [n_layers, n_rows,
    *row_shape]}``, one entry per point the dataset holds, in the manifest's dtype, its
    layers in ``layers`` order (for a reduced dataset ``n_rows`` is 1 and ``positions`` the
    positions reduced into it); a dataset that read SAE features adds ``"sae_features"``,
    per SAE as ``LensResult.sae_features`` lays it out: ``{"sae", "layer", "point",
    "positions", "indices" int32 [n_rows, top_k], "values" float32 [n_rows, top_k]}`` (with
    reconstruction also ``"nmse"`` float32 and ``"l0"`` int32 [n_rows]). ``ds[i]`` raises
    ``IndexError`` past the end.

    Args:
        path: the dataset's directory.

    Attributes:
        root (pathlib.Path): the directory.
        manifest (dict): ``manifest.json`` as written: ``format``, ``points``, ``layers``,
            ``dtype``, ``row_shapes``, and what the writer added (model, versions,
            positions spec, ``sae_features`` ...).
        points (tuple[str, ...]): the tap points it holds (``resid_post`` ...).
        layers (tuple[int, ...]): the layers it holds, in the order of the rows' first
            axis.
        saes (tuple[dict, ...]): per SAE it read: ``sae``, ``point``, ``layer``, ``d_sae``,
            ``top_k``, ``reconstruction``.
        entries (list[dict]): per complete example, its (first) index line: ``key``,
            ``shard``, ``offset``, ``rows``, ``positions``, ``prompt_token_ids``,
            ``token_ids`` (and ``writer``, ``layers``, ``saes`` from named writers).

    Raises:
        FileNotFoundError: ``path`` holds no ``manifest.json``.
        ValueError: another format, or a damaged index (as `open`).

    Examples:
        >>> import torch
        >>> from vllm_lens.dataset import reader as datasets
        >>> from vllm_lens.dataset.writer import ShardWriter
        >>> manifest = {"points": ["resid_post"], "layers": [1, 3], "dtype": "float32",
        ...             "row_shapes": {"resid_post": [128]}}
        >>> with ShardWriter(tmp / "acts", manifest) as writer:   # 2 examples, 5 and 3 rows
        ...     for key, n in (("a", 5), ("b", 3)):
        ...         _ = writer.add(key, {"resid_post": torch.randn(2, n, 128)}, range(n))
        >>> ds = datasets.ActivationDataset(tmp / "acts")
        >>> ex = ds.get("b")
        >>> sorted(ex), ex["resid_post"].shape, ds.tensor("resid_post", 3).shape
        (['key', 'positions', 'prompt_token_ids', 'resid_post', 'token_ids'],
         torch.Size([2, 3, 128]), torch.Size([8, 128]))
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.root = Path(path)
        manifest_path = self.root / MANIFEST
        if not manifest_path.exists():
            raise FileNotFoundError(f"{self.root} is not an activation dataset (no {MANIFEST})")
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.root}: format {self.manifest.get('format')!r} is not "
                             f"{FORMAT!r}")
        self.points: tuple[str, ...] = tuple(self.manifest["points"])
        self.layers: tuple[int, ...] = tuple(int(x) for x in self.manifest["layers"])
        self.saes: tuple[dict[str, Any], ...] = tuple(self.manifest.get("sae_features") or ())
        """Per SAE the dataset read (``vllm-lens extract --sae``): ``sae`` (as the job named
        it), ``point``, ``layer``, ``d_sae``, ``top_k``, ``reconstruction``."""
        self._view = IndexView(self.layers, len(self.saes), keep_lines=True)
        for entry in read_index(self.root / INDEX)[0]:
            self._view.add(entry)
        self._parts = list(self._view.complete.values())
        """Per complete example, its index lines (one, unless pipeline stages wrote it)."""
        self.entries = [lines[0] for lines in self._parts]
        """Per complete example, its (first) index line."""
        self._by_key = {entry["key"]: i for i, entry in enumerate(self.entries)}
        self._shards: dict[tuple[Any, int], tuple[np.ndarray, dict[str, Any]]] = {}
        self._maps: dict[tuple[tuple[Any, int], str], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def _segment(self, i: int, slot: tuple[str, int]) -> _Segment:
        """Where example ``i``'s rows of a layer or SAE entry are: the first of its lines
        holding it."""
        line = next(e for e in self._parts[i] if slot in self._view.slots(e))
        return (line.get("writer"), line["shard"]), line["offset"], line["rows"]

    def _rows(self, segment: _Segment, name: str) -> torch.Tensor:
        shard, lo, n = segment
        return self._mapped(shard, name)[lo:lo + n]

    def __getitem__(self, i: int) -> dict[str, Any]:
        entry = self.entries[i]
        out: dict[str, Any] = {
            "key": entry["key"],
            "prompt_token_ids": list(entry["prompt_token_ids"]),
            "token_ids": list(entry.get("token_ids", ())),
            "positions": torch.tensor(entry["positions"], dtype=torch.int64),
        }
        for point in self.points:
            out[point] = torch.stack([
                self._rows(self._segment(i, ("layer", layer)), tensor_name(point, layer))
                for layer in self.layers])
        if self.saes:
            out["sae_features"] = [
                {"sae": spec["sae"], "layer": spec["layer"], "point": spec["point"],
                 "positions": out["positions"],
                 **{field: self._rows(self._segment(i, ("sae", number)),
                                      sae_column(number, field))
                    for field in sae_fields(spec)}}
                for number, spec in enumerate(self.saes)]
        return out

    def get(self, key: str) -> dict[str, Any]:
        """The example with ``key`` (``KeyError`` if the dataset has none).

        Args:
            key: the example's key (as given to the writer: ``capture_sink``'s ``key``, the
                prompt file's ``key`` column or line number).

        Returns:
            The example, as ``ds[i]`` gives it (see `ActivationDataset`).

        Raises:
            KeyError: no complete example has ``key`` (one whose pipeline-stage parts are
                not all in yet counts as absent).
        """
        return self[self._by_key[key]]

    def keys(self) -> list[str]:
        """The keys of the complete examples, in the order ``ds[i]`` and iteration give
        them (the order they were written; with several writers, the order they became
        complete).

        Returns:
            A new list of the keys (strings).
        """
        return [entry["key"] for entry in self.entries]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def tensor(self, point: str, layer: int) -> torch.Tensor:
        """``[total_rows, *row_shape]``: every example's rows of ``point`` at ``layer``, in
        the examples' order. A view of the shard file's memory map when they lie in one
        shard, one after the other (copy-on-write: writing to it never reaches the file);
        otherwise this point and layer are read into memory (``shard_tensors`` gives the
        memory-mapped parts).

        Args:
            point: one of ``points``.
            layer: one of ``layers`` (a layer index, not a position in ``layers``).

        Returns:
            ``[total_rows, *row_shape]`` in the manifest's dtype; row ``r`` is the ``r``-th
            row counting through the examples in order (their ``positions`` tell which
            token each is); ``[0, *row_shape]`` for a dataset without examples.

        Raises:
            KeyError: the dataset does not hold ``point`` or ``layer``.

        Examples:
            >>> import torch
            >>> from vllm_lens.dataset import reader as datasets
            >>> from vllm_lens.dataset.writer import ShardWriter
            >>> manifest = {"points": ["attn_out"], "layers": [0], "dtype": "bfloat16",
            ...             "row_shapes": {"attn_out": [128]}}
            >>> with ShardWriter(tmp / "acts", manifest) as writer:
            ...     _ = writer.add("a", {"attn_out": torch.randn(1, 4, 128)}, range(4))
            >>> x = datasets.open(tmp / "acts").tensor("attn_out", 0)
            >>> x.shape, x.dtype
            (torch.Size([4, 128]), torch.bfloat16)
        """
        parts = self.shard_tensors(point, layer)
        if not parts:
            dtype = getattr(torch, str(self.manifest["dtype"]))
            return torch.empty((0, *self.manifest["row_shapes"][point]), dtype=dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def sae_tensor(self, number: int, field: str) -> torch.Tensor:
        """One field (``indices``, ``values``; with reconstruction ``nmse``, ``l0``) of the
        ``number``-th SAE's features, for every row of every example in order (as
        ``tensor``: memory-mapped if they lie in one shard). ``vllm_lens.saes.to_sparse``
        turns ``{"indices", "values"}`` into a sparse ``[rows, d_sae]`` tensor.

        Args:
            number: the SAE's place in ``saes`` (0 for the first the job read).
            field: ``"indices"`` or ``"values"``; with the SAE's ``reconstruction``, also
                ``"nmse"`` or ``"l0"``.

        Returns:
            ``indices`` int32 and ``values`` float32 ``[total_rows, top_k]`` (-1 and 0 where
            fewer features were active), ``nmse`` float32 and ``l0`` int32 ``[total_rows]``,
            rows in the examples' order (as `tensor`); zero rows for a dataset
            without examples.

        Raises:
            KeyError: no SAE ``number``, or it does not store ``field`` (the message lists
                what the dataset holds).
        """
        if not 0 <= number < len(self.saes) or field not in sae_fields(self.saes[number]):
            raise KeyError(f"the dataset holds {len(self.saes)} SAE(s), with fields "
                           f"{[list(sae_fields(s)) for s in self.saes]}; not {field} of "
                           f"SAE {number}")
        parts = self._runs(("sae", number), sae_column(number, field))
        if not parts:
            width = (self.saes[number]["top_k"],) if field in ("indices", "values") else ()
            dtype = torch.int32 if field in ("indices", "l0") else torch.float32
            return torch.empty((0, *width), dtype=dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def shard_tensors(self, point: str, layer: int) -> list[torch.Tensor]:
        """The rows of ``point`` at ``layer``, memory-mapped (read-only: do not write to
        them), one tensor per run of examples lying one after the other in one shard (for a
        dataset one writer wrote, one per shard), in the examples' order.

        Args:
            point: one of ``points``.
            layer: one of ``layers``.

        Returns:
            A list of ``[rows, *row_shape]`` tensors in the manifest's dtype which,
            concatenated, are `tensor`; empty for a dataset without examples.

        Raises:
            KeyError: the dataset does not hold ``point`` or ``layer``.
        """
        if point not in self.points or layer not in self.layers:
            raise KeyError(f"the dataset holds {', '.join(self.points)} at layers "
                           f"{list(self.layers)}, not {point} at {layer}")
        return self._runs(("layer", layer), tensor_name(point, layer))

    def _runs(self, slot: tuple[str, int], name: str) -> list[torch.Tensor]:
        """Every example's rows of one column, as few memory-mapped slices as they lie in."""
        runs: list[list[Any]] = []
        for i in range(len(self.entries)):
            shard, lo, n = self._segment(i, slot)
            if runs and runs[-1][0] == shard and runs[-1][1] + runs[-1][2] == lo:
                runs[-1][2] += n
            else:
                runs.append([shard, lo, n])
        return [self._rows(tuple(run), name) for run in runs]

    def _mapped(self, shard: tuple[Any, int], name: str) -> torch.Tensor:
        cached = self._maps.get((shard, name))
        if cached is None:
            cached = self._maps[(shard, name)] = self._map(shard, name)
        return cached

    def _map(self, shard: tuple[Any, int], name: str) -> torch.Tensor:
        data, header = self._shard(shard)
        info = header[name]
        start, end = info["data_offsets"]
        np_dtype, torch_dtype = _DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        if end == start:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.from_numpy(data[start:end].view(np_dtype).reshape(shape)).view(torch_dtype)

    def _shard(self, shard: tuple[Any, int]) -> tuple[np.ndarray, dict[str, Any]]:
        """One copy-on-write memory map of a shard's data, and its header (one file
        descriptor per shard, however many tensors are read from it)."""
        cached = self._shards.get(shard)
        if cached is None:
            writer, number = shard
            path = self.root / shard_name(number, writer)
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            if path.stat().st_size > 8 + size:
                data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + size)
            else:  # only empty tensors (examples with no rows)
                data = np.empty(0, dtype=np.uint8)
            cached = self._shards[shard] = (data, header)
        return cached
