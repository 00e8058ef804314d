"""Build a steering vector from contrastive prompts, steer SmolLM2 with it, and measure the
effect with a probe on the same direction.

    python examples/steering.py [--layer 12] [--scales -0.6 -0.3 0 0.3 0.6] [--out steering.png]

1. Capture the residual stream after ``--layer`` at every prompt token but the first
   (``"positions": "prompt[1:]"``: position 0 is the attention sink, whose norm is ~100x a
   normal token's and would swamp any mean).
2. The steering vector is mean(happy) - mean(sad), normalised to unit length. Scales are in
   units of the typical per-token norm of the stream at that layer (the median over those
   rows), so ``1.0`` adds a vector as long as a typical token's whole residual stream.
3. Generate answers to neutral questions at every scale, all in one batch (each request carries
   its own vector and scale).
4. Score each answer with the probe: read the answer back (unsteered), take its mean stream at
   the layer (sink excluded) and project it on the direction, relative to the midpoint of the
   happy and sad means. Positive = reads as happy. Plots score against scale.
"""

from __future__ import annotations

import argparse

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
QUESTIONS = ["Tell me about your weekend.", "Describe the weather outside.",
             "What do you think of Mondays?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=12, help="decoder layer to steer and probe")
    parser.add_argument("--scales", type=float, nargs="+", default=[-0.6, -0.3, 0.0, 0.3, 0.6],
                        help="steering scales, in units of the typical per-token norm of the "
                             "residual stream at --layer")
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens per answer")
    parser.add_argument("--out", default="steering.png", help="where to write the plot")
    parser.add_argument("--eager", action="store_true", help="run vLLM with enforce_eager")
    args = parser.parse_args()

    # Imported after parsing, so that --help answers at once.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from vllm import LLM, SamplingParams

    from vllm_lens import SteeringVector
    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(smollm2_dir(), dtype="float32", max_model_len=2048,
              kv_cache_memory_bytes=512 << 20, enforce_eager=args.eager)
    read = SamplingParams(max_tokens=1, extra_args={"output_residual_stream": {
        "layers": [args.layer], "positions": "prompt[1:]"}})

    def rows_of(texts: list[str]) -> list[torch.Tensor]:
        """Each text's residual stream at the layer, sink excluded: [n_tokens - 1, hidden]."""
        return [o.activations["residual_stream"][0] for o in llm.generate(texts, read)]

    rows = rows_of(HAPPY + SAD)
    means = torch.stack([r.mean(0) for r in rows])
    happy, sad = means[: len(HAPPY)].mean(0), means[len(HAPPY):].mean(0)
    direction = (happy - sad) / (happy - sad).norm()
    midpoint = float((happy + sad) @ direction) / 2
    typical = float(torch.cat(rows).norm(dim=-1).median())
    sink = llm.generate(HAPPY[:1], SamplingParams(max_tokens=1, extra_args={
        "output_residual_stream": {"layers": [args.layer], "positions": "prompt[0]"}}))[0]
    sink_norm = float(sink.activations["residual_stream"][0, 0].norm())
    print(f"\nlayer {args.layer}: typical per-token norm {typical:.1f} (median, sink excluded); "
          f"the sink at position 0 has {sink_norm:.0f}. Scale 1.0 = a vector of norm "
          f"{typical:.1f}.")

    conversations, params, labels = [], [], []
    for question in QUESTIONS:
        for scale in args.scales:
            sv = SteeringVector(activations=direction[None], layer_indices=[args.layer],
                                scale=scale * typical)
            conversations.append([{"role": "user", "content": question}])
            params.append(SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                         extra_args={"apply_steering_vectors": [sv]}))
            labels.append((question, scale))
    answers = [out.outputs[0].text.strip() for out in llm.chat(conversations, params)]
    scores = [float(r.mean(0) @ direction) - midpoint for r in rows_of(answers)]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for question in QUESTIONS:
        points = [(s, score) for (q, s), score in zip(labels, scores) if q == question]
        ax.plot(*zip(*points), marker="o", label=question)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel(f"steering scale (x typical per-token norm {typical:.0f} at layer {args.layer})")
    ax.set_ylabel("probe score of the answer (> 0: happy side)")
    ax.set_title(f"happy-minus-sad steering at layer {args.layer}: the answers' activations")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    for (question, scale), answer, score in zip(labels, answers, scores):
        print(f"\n[{question!r} | scale {scale:+.2f} | probe {score:+.1f}]\n  {answer!r}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
