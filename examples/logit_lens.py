"""Logit lens with a named hook: what would SmolLM2 predict if it stopped after each layer?

    python examples/logit_lens.py [--prompt TEXT] [--out logit_lens.png]

Runs the shipped ``logit_lens_topk`` hook (entry-point group ``vllm_lens.hooks``) inside the
engine at every layer: each layer's residual stream goes through the model's final norm and
unembedding, and the hook keeps the top token and its probability per position. Writes a
heatmap (layers x prompt tokens; colour = probability of the top token, text = the token).
"""

from __future__ import annotations

import argparse


def visible(token: str) -> str:
    """A token as a label that shows its whitespace (a leading space as ``␣``)."""
    shown = token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")
    return shown or "∅"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="The Eiffel Tower is located in the city of",
                        help="text whose every position is read through the logit lens")
    parser.add_argument("--out", default="logit_lens.png", help="where to write the heatmap")
    args = parser.parse_args()

    # Imported after parsing, so that --help answers at once.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from vllm import LLM, SamplingParams

    from vllm_lens import NamedHook
    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=128 << 20)
    n_layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    layers = list(range(n_layers))
    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={
        "apply_hooks": [NamedHook("logit_lens_topk", layers, {"k": 1})]})
    out = llm.generate([args.prompt], sp)[0]
    saved = out.hook_results["0"]
    tokenizer = llm.get_tokenizer()
    prompt_tokens = [tokenizer.decode([t]) for t in out.prompt_token_ids]
    n = len(prompt_tokens)
    probs = [saved["logprobs"][str(layer)][:n, 0].exp().tolist() for layer in layers]
    tops = [[tokenizer.decode([t]) for t in saved["token_ids"][str(layer)][:n, 0].tolist()]
            for layer in layers]

    fig, ax = plt.subplots(figsize=(1.1 * n + 2, 0.32 * n_layers + 1.5))
    image = ax.imshow(probs, aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower")
    for layer in layers:
        for p in range(n):
            ax.text(p, layer, visible(tops[layer][p])[:8], ha="center", va="center",
                    fontsize=6, color="white" if probs[layer][p] < 0.5 else "black")
    ax.set_xticks(range(n), [visible(t) for t in prompt_tokens], rotation=45, ha="right")
    ax.set_xlabel("input token (prediction made at this position; ␣ = leading space)")
    ax.set_ylabel("decoder layer")
    ax.set_title(f"logit lens (top-1) — model says: {out.outputs[0].text!r}")
    fig.colorbar(image, label="probability of the top token")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"next token {out.outputs[0].text!r}; layer {n_layers - 1} top-1 at the last "
          f"position: {tops[-1][-1]!r} (p={probs[-1][-1]:.2f}); wrote {args.out}")


if __name__ == "__main__":
    main()
