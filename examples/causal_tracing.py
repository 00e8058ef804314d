"""Causal tracing (Meng et al., 2022) with hooks: where does SmolLM2 recall a fact?

    python examples/causal_tracing.py [--prompt TEXT] [--subject TEXT] [--out causal_tracing.png]

1. Clean run: capture the residual stream after every layer at every prompt position.
2. Corrupted run: a pre-hook adds Gaussian noise to the subject's token embeddings (the input
   of layer 0), so the model loses the fact.
3. For every (layer, position): the corrupted run again, plus a hook after that layer putting
   back the clean residual stream at that one position. A hook on the last layer records the
   probability of the clean answer at the last position.

All 1 + layers x positions runs go to the engine as one batch of independent requests, each
with its own hooks. Writes a heatmap (layers x prompt tokens; colour = restored probability).
"""

from __future__ import annotations

import argparse

import torch


def answer_prob(target: int, last: int):
    """Hook on the last layer: probability of ``target`` at position ``last``."""

    def hook(ctx, hidden):
        rows = (ctx.positions == last).nonzero().flatten()
        if rows.numel():
            x = hidden[rows[0]].float()
            eps = ctx.model.config.rms_norm_eps
            x = x * torch.rsqrt(x.pow(2).mean() + eps) * ctx.get_parameter("model.norm.weight")
            logits = ctx.get_parameter("lm_head.weight").float() @ x
            ctx.saved["p"] = float(torch.softmax(logits, -1)[target])

    return hook


def add_noise(noise: torch.Tensor):
    """Pre-hook on layer 0: add ``noise`` ([n_prompt, hidden]) at prompt positions."""

    def hook(ctx, hidden):
        keep = ctx.positions < noise.shape[0]
        out = hidden.clone()
        out[keep] += noise[ctx.positions[keep]].to(hidden)
        return out

    return hook


def restore(clean: torch.Tensor, position: int):
    """Post-hook: put back the clean stream ([n_prompt, hidden]) at ``position``."""

    def hook(ctx, hidden):
        rows = (ctx.positions == position).nonzero().flatten()
        if not rows.numel():
            return None
        out = hidden.clone()
        out[rows] = clean[position].to(hidden)
        return out

    return hook


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

    from vllm_lens import Hook
    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=256 << 20)
    tok = llm.get_tokenizer()
    ids = tok(args.prompt)["input_ids"]
    n, n_layers = len(ids), llm.llm_engine.model_config.hf_config.num_hidden_layers
    last_layer, prompt = n_layers - 1, {"prompt_token_ids": ids}

    clean = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, extra_args={
        "output_residual_stream": {"layers": True, "positions": "prompt"}}))[0]
    target = clean.outputs[0].token_ids[0]
    streams = clean.activations["residual_stream"]  # [layers, n, hidden]

    start = args.prompt.index(args.subject)
    spans = tok(args.prompt, return_offsets_mapping=True)["offset_mapping"]
    subject = [i for i, (a, b) in enumerate(spans) if a < start + len(args.subject) and b > start]
    embed_std = float(streams[0].std())  # scale of the stream entering the model
    g = torch.Generator().manual_seed(0)
    noise = torch.zeros(n, streams.shape[-1])
    noise[subject] = args.noise * embed_std * torch.randn(len(subject), streams.shape[-1],
                                                          generator=g)

    def request(extra_hooks):
        hooks = [Hook(add_noise(noise), [0], pre=True), *extra_hooks,
                 Hook(answer_prob(target, n - 1), [last_layer])]
        return SamplingParams(max_tokens=1, temperature=0, extra_args={"apply_hooks": hooks})

    grid = [(layer, p) for layer in range(n_layers) for p in range(n)]
    params = [request([])] + [request([Hook(restore(streams[layer], p), [layer])])
                              for layer, p in grid]
    outs = llm.generate([prompt] * len(params), params)
    def answer(out) -> float:  # the answer hook is each request's last hook
        return out.hook_results[str(len(out.hook_results) - 1)]["p"]

    corrupted = answer(outs[0])
    restored = torch.zeros(n_layers, n)
    for (layer, p), out in zip(grid, outs[1:]):
        restored[layer, p] = answer(out)
    clean_p = float(restored[last_layer, n - 1])  # restoring the last layer's output = clean

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
