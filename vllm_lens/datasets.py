"""Reading activation datasets back: the public face of ``vllm_lens.dataset.reader`` (runs in:
caller).

Use::

    from vllm_lens import datasets

    ds = datasets.open("acts/my-dataset")
    ex = ds.get("example-7")
    x = ds.tensor("resid_post", 12)

The format itself, and how writers produce it, live in ``vllm_lens.dataset``.
"""

from __future__ import annotations

from vllm_lens.dataset.reader import ActivationDataset, open

__all__ = ["ActivationDataset", "open"]
