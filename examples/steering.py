"""Build a steering vector from contrastive prompts and steer SmolLM2 with it.

    python examples/steering.py [--layer 12] [--scales -60 0 30 60] [--eager]

1. Capture the mean residual stream after ``--layer`` over the prompt of each contrastive
   prompt (vllm-lens reduces on the worker: ``{"positions": "prompt", "reduce": "mean"}``).
2. The steering vector is mean(happy) - mean(sad), normalised to unit length.
3. Generate answers to neutral questions with ``apply_steering_vectors`` at several scales, all
   in one batch (each request carries its own vector and scale).
"""

from __future__ import annotations

import argparse

import torch

HAPPY = [
    "I am so happy today, everything is wonderful!",
    "What a joyful, delightful surprise, I love it!",
    "This is the best day of my life, I feel fantastic.",
    "Hooray! We won, and everyone is cheering with joy.",
]
SAD = [
    "I am so sad today, everything is terrible.",
    "What a miserable, painful disappointment, I hate it.",
    "This is the worst day of my life, I feel awful.",
    "We lost, and everyone is crying in despair.",
]
QUESTIONS = ["Tell me about your weekend.", "Describe the weather outside."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=12)
    # Scales are absolute: compare them with the stream's norm at the layer, printed below.
    parser.add_argument("--scales", type=float, nargs="+", default=[-60.0, 0.0, 30.0, 60.0])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--eager", action="store_true", help="run vLLM with enforce_eager")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_lens import SteeringVector
    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=2048,
              kv_cache_memory_bytes=512 << 20, enforce_eager=args.eager)

    capture = SamplingParams(max_tokens=1, extra_args={"output_residual_stream": {
        "layers": [args.layer], "positions": "prompt", "reduce": "mean"}})
    means = [o.activations["residual_stream"][0] for o in llm.generate(HAPPY + SAD, capture)]
    direction = torch.stack(means[: len(HAPPY)]).mean(0) - torch.stack(means[len(HAPPY):]).mean(0)
    direction /= direction.norm()
    typical = torch.stack(means).norm(dim=-1).mean()
    print(f"\nsteering vector: layer {args.layer}, mean(happy) - mean(sad), unit norm "
          f"(the residual stream's mean norm there is {typical:.0f})")

    conversations, params, labels = [], [], []
    for question in QUESTIONS:
        for scale in args.scales:
            sv = SteeringVector(activations=direction[None], layer_indices=[args.layer],
                                scale=scale)
            conversations.append([{"role": "user", "content": question}])
            params.append(SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                         extra_args={"apply_steering_vectors": [sv]}))
            labels.append((question, scale))
    for (question, scale), out in zip(labels, llm.chat(conversations, params)):
        print(f"\n[{question!r} | scale {scale:+.0f}]\n  {out.outputs[0].text.strip()!r}")


if __name__ == "__main__":
    main()
