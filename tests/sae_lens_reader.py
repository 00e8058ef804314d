"""sae-lens' own reader of a cached-activations dataset, for the tests that check what
``vllm-lens extract --format sae-lens`` writes."""

from __future__ import annotations

import torch


def read_with_sae_lens(cache, hook: str, context_size: int, d_in: int, n_contexts: int):
    """(rows ``[n_contexts * context_size, d_in]``, their token ids) as sae-lens'
    ``ActivationsStore`` reads the first ``n_contexts`` contexts of ``cache``."""
    from sae_lens.training.activations_store import ActivationsStore

    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None,
        context_size=context_size, d_in=d_in, n_batches_in_buffer=2,
        total_training_tokens=context_size * n_contexts, store_batch_size_prompts=n_contexts,
        train_batch_size_tokens=context_size, prepend_bos=False, normalize_activations="none",
        device=torch.device("cpu"), dtype="float32", cached_activations_path=str(cache))
    return store.get_raw_llm_batch()
