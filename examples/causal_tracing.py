"""Causal tracing (Meng et al., 2022) as one patching sweep: where does SmolLM2 recall a fact?

    python examples/causal_tracing.py [--prompt TEXT] [--subject TEXT] [--out causal_tracing.png]

1. Clean run: capture the residual stream after every layer at every prompt position.
2. Corrupted run: Gaussian noise added to the subject's token embeddings (a steering vector at
   ``layer_indices=[-1]``, the input of layer 0), so the model loses the fact.
3. ``llm.patching_sweep``: for every (layer, position), the corrupted run with the clean
   residual stream written back at that one place (``mode="replace"``), the probability of
   the clean answer read at the last position.

No hook and no code travels: the sweep is data (the clean rows, the grid, the metric), so a
shared server accepts the same sweep (``POST /v1/lens/patching_sweep``). All 2 + layers x
positions runs go to the engine as one batch. Writes a heatmap (layers x prompt tokens;
colour = restored probability). ``benchmarks/patching_sweep.py`` times it against the same
sweep written with hooks.
"""

from __future__ import annotations

import argparse

import torch


def subject_noise(tok, prompt: str, subject: str, scale: float, hidden: int, std: float):
    """The subject's token positions and noise of ``scale`` x ``std`` for each of them."""
    start = prompt.index(subject)
    spans = tok(prompt, return_offsets_mapping=True)["offset_mapping"]
    positions = [i for i, (a, b) in enumerate(spans) if a < start + len(subject) and b > start]
    g = torch.Generator().manual_seed(0)
    return positions, scale * std * torch.randn(len(positions), hidden, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="The Eiffel Tower is located in the city of",
                        help="a factual prompt whose next token is the answer")
    parser.add_argument("--subject", default="Eiffel Tower",
                        help="the part of the prompt whose embeddings get noise (must occur "
                             "in --prompt)")
    parser.add_argument("--noise", type=float, default=3.0,
                        help="noise scale, in standard deviations of the embeddings")
    parser.add_argument("--out", default="causal_tracing.png", help="where to write the heatmap")
    args = parser.parse_args()

    # Imported after parsing, so that --help answers at once.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from vllm import LLM, SamplingParams

    from vllm_lens import SteeringVector
    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=256 << 20)
    tok = llm.get_tokenizer()
    ids = tok(args.prompt)["input_ids"]
    n, n_layers = len(ids), llm.llm_engine.model_config.hf_config.num_hidden_layers

    clean = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=1, temperature=0, extra_args={
            "output_residual_stream": {"layers": True, "positions": "prompt"}}))[0]
    target = clean.outputs[0].token_ids[0]
    streams = clean.activations["residual_stream"]  # [layers, n, hidden]

    # The noise's unit: the spread of layer 0's output (a proxy for the embeddings' scale; it
    # includes the attention sink at position 0).
    embed_std = float(streams[0].std())
    subject, noise = subject_noise(tok, args.prompt, args.subject, args.noise,
                                   streams.shape[-1], embed_std)
    corrupt = SteeringVector(activations=noise[None], layer_indices=[-1],
                             position_indices=subject)
    sweep = llm.patching_sweep(ids, streams, list(range(n_layers)), list(range(n)),
                               {"prob": target}, corrupt=[corrupt])
    restored, corrupted, clean_p = sweep["grid"], sweep["corrupted"], sweep["uncorrupted"]

    labels = [tok.decode([t]).replace(" ", "␣") + ("*" if i in subject else "")
              for i, t in enumerate(ids)]
    fig, ax = plt.subplots(figsize=(0.9 * n + 2, 0.25 * n_layers + 1.5))
    image = ax.imshow(restored.T.numpy(), aspect="auto", cmap="magma", origin="upper")
    ax.set_yticks(range(n), labels)
    ax.set_ylabel("prompt token whose clean state is restored")
    ax.set_xlabel("layer whose output is restored")
    ax.set_title(f"p({tok.decode([target])!r}) with one clean state restored "
                 f"(clean {clean_p:.2f}, corrupted {corrupted:.2f}; * = subject)")
    fig.colorbar(image, label="probability of the clean answer")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    best = divmod(int(restored.argmax()), n)
    for p in range(n):  # the picture in numbers: each token's best layer
        row = restored[:, p]
        print(f"  {labels[p]:>12}  best p={float(row.max()):.3f} at layer {int(row.argmax())}")
    print(f"answer {tok.decode([target])!r}: clean p={clean_p:.3f}, corrupted p={corrupted:.3f}; "
          f"strongest restoration at layer {best[0]}, token {labels[best[1]]!r} "
          f"(p={float(restored.max()):.3f}); wrote {args.out}")


if __name__ == "__main__":
    main()
