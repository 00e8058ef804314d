"""Capture SmolLM2's residual stream per request with vllm-lens, then read it with a logit lens.

    python examples/capture_demo.py [--prompt "..."] [--eager]

Runs vLLM in its default (compiled) mode on the CPU with the embedded SmolLM2-135M-Instruct
(built locally from a PyPI wheel on first use). One capturing and one plain request share a
batch; the capturing one returns every layer's residual stream, which the demo projects through
the model's final norm and unembedding to show what each layer "would say" next.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def logit_lens(stream: torch.Tensor, model_dir: Path) -> torch.Tensor:
    """Top-1 token id per layer for the residual stream ``[n_layers, hidden]``."""
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    unembed = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # tied
    norm_w, eps = weights["model.norm.weight"], config["rms_norm_eps"]
    normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    return (normed @ unembed.T).argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="What is the capital of France?",
                        help="the user message of the capturing request")
    parser.add_argument("--eager", action="store_true", help="run vLLM with enforce_eager")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_lens.demo_models import smollm2_dir

    model_dir = Path(smollm2_dir())
    llm = LLM(str(model_dir), dtype="float32", max_model_len=2048,
              kv_cache_memory_bytes=512 << 20, enforce_eager=args.eager)
    tokenizer = llm.get_tokenizer()

    capture = SamplingParams(max_tokens=16, temperature=0,
                             extra_args={"output_residual_stream": True})
    plain = SamplingParams(max_tokens=16, temperature=0)
    conversations = [[{"role": "user", "content": args.prompt}],
                     [{"role": "user", "content": "Name a colour."}]]
    lensed, other = llm.chat(conversations, [capture, plain])

    stream = lensed.activations["residual_stream"]  # [n_layers, n_positions, hidden]
    n_prompt = len(lensed.prompt_token_ids)
    print(f"\nanswer: {lensed.outputs[0].text!r}")
    print(f"residual_stream: shape {tuple(stream.shape)} = (layers, prompt {n_prompt} + "
          f"generated {len(lensed.outputs[0].token_ids)} - 1, hidden), dtype {stream.dtype}")
    print(f"the plain request in the same batch: {other.outputs[0].text!r} "
          f"(activations: {getattr(other, 'activations', None)})")

    last = stream[:, n_prompt - 1]  # the position that predicts the first answer token
    top = logit_lens(last, model_dir)
    print("\nlogit lens at the last prompt token (what each layer would predict next):")
    for layer in range(0, stream.shape[0], 3):
        norm = last[layer].norm().item()
        print(f"  layer {layer:2d}  |h|={norm:7.1f}  -> {tokenizer.decode([int(top[layer])])!r}")
    print(f"  layer {stream.shape[0] - 1:2d}  |h|={last[-1].norm().item():7.1f}  -> "
          f"{tokenizer.decode([int(top[-1])])!r}   (vLLM generated "
          f"{tokenizer.decode([lensed.outputs[0].token_ids[0]])!r})")


if __name__ == "__main__":
    main()
