"""An activation dataset in sae-lens' cached-activations layout, so that sae-lens trains an SAE on
rows vLLM extracted (runs in: caller).

``vllm-lens extract --format sae-lens`` or any script; it needs the ``datasets`` package.

sae-lens reads a Hugging Face dataset saved with ``save_to_disk`` whose rows are contexts of
``context_size`` tokens: a column named by the hook (``blocks.12.hook_resid_post``) of
``Array2D((context_size, d_in))`` and ``token_ids``, a ``Sequence(int32, context_size)``
(``sae_lens.cache_activations_runner``; ``ActivationsStore`` with
``cached_activations_path``). Examples have different lengths, so their rows are laid end to
end in index order and cut into contexts, as sae-lens' own cache does with tokenized text;
rows left over after the last full context are not written (the count is returned). SAE
training reads tokens one at a time, so where a context crosses from one example into the
next does not matter to it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vllm_lens.common.points import hook_name

__all__ = ["write_sae_lens_cache"]

#: Row dtypes Arrow stores as they are; others (bfloat16) are written as float32.
_ARROW_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64"}


def write_sae_lens_cache(source: Any, output: Path, context_size: int,
                         point: str | None = None, layer: int | None = None) -> dict[str, Any]:
    """Write the rows of ``point`` at ``layer`` of the activation dataset ``source``
    (``vllm_lens.dataset.reader.open``; its only point and layer when not given) to ``output`` in
    sae-lens' layout, replacing what an earlier call wrote there. Returns ``{"hook_name",
    "contexts", "tokens", "dropped", "d_in", "dtype"}``.

    Raises:
        ValueError: ``context_size`` < 1, a reduced dataset (one row per example, no
            tokens), or ``point`` / ``layer`` not in it.
    """
    import datasets as hf

    if context_size < 1:
        raise ValueError(f"context_size must be >= 1, got {context_size}")
    if source.manifest.get("reduce"):
        raise ValueError("a reduced dataset has one row per example and no token per row; "
                         "sae-lens trains on the rows of single tokens")
    point = point or _only(source.points, "point")
    layer = _only(source.layers, "layer") if layer is None else layer
    if point not in source.points or layer not in source.layers:
        raise ValueError(f"the dataset holds {list(source.points)} at layers "
                         f"{list(source.layers)}, not {point} at {layer}")
    row_shape = source.manifest["row_shapes"][point]
    d_in = int(torch.tensor(row_shape).prod()) if row_shape else 1
    dtype = getattr(torch, source.manifest["dtype"])
    arrow_dtype = _ARROW_DTYPES.get(dtype, "float32")
    hook = hook_name(point, layer)
    features = hf.Features({
        hook: hf.Array2D(shape=(context_size, d_in), dtype=arrow_dtype),
        "token_ids": hf.Sequence(hf.Value("int32"), length=context_size)})
    counts = {"contexts": 0, "dropped": 0}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output, prefix=".hf-") as scratch:
        from datasets.arrow_writer import ArrowWriter

        written = Path(scratch) / "contexts.arrow"
        with ArrowWriter(features=features, path=str(written)) as writer:
            for context in _contexts(source, point, layer, hook, context_size, d_in,
                                     getattr(torch, arrow_dtype), counts):
                writer.write(context)
            writer.finalize()
        table = hf.Dataset.from_file(str(written))
        staged = Path(scratch) / "saved"
        table.save_to_disk(str(staged))
        del table
        for old in [*output.glob("data-*.arrow"), output / "state.json",
                    output / "dataset_info.json"]:
            old.unlink(missing_ok=True)
        for new in staged.iterdir():
            shutil.move(str(new), output / new.name)
    return {"hook_name": hook, "contexts": counts["contexts"],
            "tokens": counts["contexts"] * context_size, "dropped": counts["dropped"],
            "d_in": d_in, "dtype": arrow_dtype}


def _contexts(source: Any, point: str, layer: int, hook: str, context_size: int, d_in: int,
              dtype: torch.dtype, counts: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The dataset's rows (and the token at each row's position), ``context_size`` at a
    time."""
    at = source.layers.index(layer)
    rows: list[torch.Tensor] = []
    tokens: list[int] = []
    held = 0
    for example in source:
        every = [*example["prompt_token_ids"], *example["token_ids"]]
        part = example[point][at].reshape(-1, d_in).to(dtype)
        rows.append(part)
        tokens.extend(every[p] for p in example["positions"].tolist())
        held += part.shape[0]
        while held >= context_size:
            block = torch.cat(rows)
            yield {hook: block[:context_size].numpy(),
                   "token_ids": tokens[:context_size]}
            counts["contexts"] += 1
            rows, tokens = [block[context_size:]], tokens[context_size:]
            held -= context_size
    counts["dropped"] = held


def _only(values: Any, what: str) -> Any:
    if len(values) != 1:
        raise ValueError(f"the dataset holds {len(values)} {what}s ({list(values)}): name one")
    return values[0]
