"""Tiny random checkpoints of the model families the suite proves, built from transformers
configs (no downloads; the tokenizer is SmolLM2's, so prompts are real text)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from vllm_lens.demo_models import _publish, cache_root, smollm2_dir

#: What every tiny model shares: 4 layers, hidden 128, 2 heads of 64 (one key head), MLP 256.
_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
              tie_word_embeddings=True)

#: family -> (transformers config class, model class, extra config fields)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 64, "sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None}),
}


def tiny_family_dir(family: str) -> str:
    """A seeded tiny random checkpoint of ``family`` (built once, cached beside the demo
    models). Biases and norm weights are randomised too, so that they matter."""
    final = cache_root() / f"tiny-{family}-h128-l4-v1"
    if (final / "config.json").exists():
        return str(final)
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_name, model_name, extra = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **_SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        build = Path(tmp) / "build"
        model.save_pretrained(build)
        tokenizer.save_pretrained(build)
        return str(_publish(build, final))
