"""Prompt-injection detection from attention, in the engine (the Attention Tracker idea).

    python examples/attention_tracker.py [--data FILE] [--heads 8] [--out attention_tracker.png]

Each prompt is an instruction followed by data (``examples/data/attention_tracker.jsonl``: 20
instruction/data pairs written for this example, each once benign and once with an injected
instruction in the data). When the model gets distracted by an injected instruction, some
heads attend less, at the last prompt token, to the original instruction. The shipped
``attention_to_span`` named hook measures, in the worker, every head's attention mass on the
instruction's tokens at the last prompt token, so each request returns 30 x 9 numbers instead
of its Q and K. Half of the pairs (calibration) pick the heads whose mass drops most on
injected prompts; the other half (held out) is scored with the mean mass of those heads.
Prints the held-out AUROC (and, as a baseline, the AUROC of prompt length alone: injected
prompts are longer) and writes a per-head heatmap and the score histogram.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "attention_tracker.jsonl"


def auroc(positives: list[float], negatives: list[float]) -> float:
    """Probability that a positive scores above a negative (ties count half)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def instruction_span(tokenizer, instruction: str, data: str) -> tuple[list[int], list[int]]:
    """The chat-templated prompt's token ids and the [start, stop) token span of the
    instruction in it."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{instruction}\n\nText: {data}"}],
        tokenize=False, add_generation_prompt=True)
    begin = text.index(instruction)
    end = begin + len(instruction)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < end and b > begin]
    return encoded["input_ids"], [inside[0], inside[-1] + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA,
                        help="JSONL of {id, instruction, data, injected}; ids with the same "
                             "value stay in the same half")
    parser.add_argument("--heads", type=int, default=8,
                        help="how many heads the calibration half selects")
    parser.add_argument("--splits", type=int, default=20,
                        help="further random calibration/held-out splits of the pairs to "
                             "report the AUROC's spread over")
    parser.add_argument("--out", default="attention_tracker.png",
                        help="where to write the heatmap and histogram")
    args = parser.parse_args()

    # Imported after parsing, so that --help answers at once.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from vllm import LLM, SamplingParams

    from vllm_lens import NamedHook
    from vllm_lens.demo_models import smollm2_dir

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=128 << 20)
    n_layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    tokenizer = llm.get_tokenizer()
    prompts, params = [], []
    for row in rows:
        ids, span = instruction_span(tokenizer, row["instruction"], row["data"])
        hook = NamedHook("attention_to_span", list(range(n_layers)),
                         {"span": span, "queries": "last_prompt"}, hook_point="attn_qk")
        prompts.append({"prompt_token_ids": ids})
        params.append(SamplingParams(max_tokens=1, extra_args={"apply_hooks": [hook]}))
    outs = llm.generate(prompts, params)
    # mass[i]: [layers, heads] at the last prompt token
    mass = torch.stack([
        torch.stack([o.hook_results["0"]["mass"][str(layer)][0] for layer in range(n_layers)])
        for o in outs])
    injected = torch.tensor([bool(r["injected"]) for r in rows])
    calibration = torch.tensor([r["id"] % 2 == 0 for r in rows])

    def fit(calibration):
        """Heads chosen on ``calibration`` (effect size of the drop: benign - injected mean,
        over the pooled std) and every prompt's score (those heads' mean mass)."""
        cal_b, cal_i = mass[calibration & ~injected], mass[calibration & injected]
        spread = torch.sqrt((cal_b.var(0) + cal_i.var(0)) / 2).clamp_min(1e-6)
        effect = (cal_b.mean(0) - cal_i.mean(0)) / spread  # [layers, heads]
        top = effect.flatten().topk(args.heads).indices
        return effect, top, mass.flatten(1)[:, top].mean(1)  # low: attention left

    def held_out_auroc(calibration, score):
        held = ~calibration
        return auroc((-score[held & injected]).tolist(), (-score[held & ~injected]).tolist())

    effect, top, score = fit(calibration)
    heads = [(int(i) // effect.shape[1], int(i) % effect.shape[1]) for i in top]
    held = ~calibration
    held_auroc = held_out_auroc(calibration, score)
    # The same on other splits of the pairs (a small set: how much does the split matter?)
    ids = sorted({r["id"] for r in rows})
    generator = torch.Generator().manual_seed(0)
    others = []
    for _ in range(args.splits):
        half = set(torch.tensor(ids)[torch.randperm(len(ids), generator=generator)]
                   [: len(ids) // 2].tolist())
        split = torch.tensor([r["id"] in half for r in rows])
        others.append(held_out_auroc(split, fit(split)[2]))
    lengths = torch.tensor([float(len(p["prompt_token_ids"])) for p in prompts])
    length_auroc = auroc(lengths[held & injected].tolist(), lengths[held & ~injected].tolist())
    print(f"{len(rows)} prompts ({int(calibration.sum())} calibration, {int(held.sum())} held "
          f"out); heads (layer, head) chosen on calibration: {heads}")
    print(f"held-out AUROC (injected vs benign, lower instruction attention = injected): "
          f"{held_auroc:.3f}; prompt length alone: {length_auroc:.3f}")
    if others:
        others.sort()
        print(f"over {len(others)} random splits of the pairs: median held-out AUROC "
              f"{others[len(others) // 2]:.3f} (lowest {others[0]:.3f}, highest "
              f"{others[-1]:.3f})")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    image = left.imshow(effect.T, aspect="auto", cmap="coolwarm", origin="lower",
                        vmin=-effect.abs().max(), vmax=effect.abs().max())
    for layer, head in heads:
        left.add_patch(plt.Rectangle((layer - 0.5, head - 0.5), 1, 1, fill=False, lw=2))
    left.set_xlabel("layer")
    left.set_ylabel("head")
    left.set_title("calibration: drop of attention to the instruction\n(benign - injected, "
                   "in pooled std; boxes: chosen heads)")
    fig.colorbar(image, ax=left)
    bins = torch.linspace(float(score.min()), float(score.max()), 12).tolist()
    right.hist(score[held & ~injected].tolist(), bins=bins, alpha=0.6, label="benign")
    right.hist(score[held & injected].tolist(), bins=bins, alpha=0.6, label="injected")
    right.set_xlabel("mean attention of the chosen heads to the instruction")
    right.set_ylabel("held-out prompts")
    right.set_title(f"held out: AUROC {held_auroc:.2f} (length alone {length_auroc:.2f})")
    right.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
